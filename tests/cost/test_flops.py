"""cost/flops.py: torch's FLOP counter, taught CPU attention, and silent to other threads."""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from fxckpt.cost.flops import EXTRA_FORMULAS, counter


def test_a_matmul_counts_two_flops_per_multiply_add() -> None:
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    with counter() as c:
        a @ b
    assert c.get_total_flops() == 2 * 8 * 16 * 4


def test_cpu_attention_counts_its_two_batched_matmuls_forward_and_five_backward() -> None:
    b, h, s, d = 2, 3, 8, 4
    q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
    with counter() as c:
        out = F.scaled_dot_product_attention(q, k, v)
    forward = c.get_total_flops()
    assert forward == 2 * (2 * b * h * s * s * d)  # q @ k^T, then the weights @ v
    with counter() as c:
        out.sum().backward()
    assert c.get_total_flops() == 5 * (2 * b * h * s * s * d)


def test_the_cpu_kernels_are_the_extra_formulas() -> None:
    names = {packet.__name__ for packet in EXTRA_FORMULAS}
    assert names <= {"_scaled_dot_product_flash_attention_for_cpu",
                     "_scaled_dot_product_flash_attention_for_cpu_backward"}
    assert "_scaled_dot_product_flash_attention_for_cpu" in names  # this torch has the kernel


def test_a_counter_installs_no_global_module_hooks() -> None:
    """torch's own counter tracks modules with global hooks, which another thread's model would
    see; this one counts the same total without them."""
    seen: list[bool] = []
    barrier = threading.Barrier(2)

    def other_thread() -> None:
        barrier.wait()
        seen.append(bool(torch.nn.modules.module._global_forward_hooks))
        barrier.wait()

    t = threading.Thread(target=other_thread)
    t.start()
    model = torch.nn.Linear(4, 4)
    with counter() as c:
        barrier.wait()  # the other thread looks while this one counts
        model(torch.randn(2, 4))
        barrier.wait()
    t.join()
    assert seen == [False]
    assert c.get_total_flops() == 2 * 2 * 4 * 4
