"""fxckpt.runtime.attention: which masks are dropped, when the verdict is looked at again."""

from __future__ import annotations

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from fxckpt.runtime.attention import (CAUSAL, FULL, attention, layer_mask, mask_kind,
                                     sized_mask)


def _causal(*shape: int) -> torch.Tensor:
    return torch.ones(*shape, dtype=torch.bool).tril()


def test_mask_kinds() -> None:
    assert mask_kind(_causal(2, 1, 5, 5), 5, 5) == CAUSAL
    assert mask_kind(_causal(5, 5), 5, 5) == CAUSAL
    assert mask_kind(torch.ones(2, 1, 5, 5, dtype=torch.bool), 5, 5) == FULL
    # One query over five keys (decoding): all visible is FULL, not the top-left causal row.
    assert mask_kind(torch.ones(1, 1, 1, 5, dtype=torch.bool), 1, 5) == FULL
    padded = _causal(2, 1, 5, 5)
    padded[1, :, :, 4] = False
    assert mask_kind(padded, 5, 5) is None
    assert mask_kind(_causal(5, 5).float(), 5, 5) is None  # float masks stay
    assert mask_kind(torch.ones(2, 1, 1, 5, dtype=torch.bool), 5, 5) is None  # broadcast rows
    assert mask_kind(torch.ones(5, 5, dtype=torch.bool, device="meta"), 5, 5) is None
    with FakeTensorMode():
        assert mask_kind(torch.ones(5, 5, dtype=torch.bool), 5, 5) is None


def test_the_verdict_is_remembered_until_the_mask_is_written() -> None:
    mask = _causal(1, 1, 4, 4)
    assert mask_kind(mask, 4, 4) == CAUSAL
    mask[0, 0, 0, 3] = True  # bumps the version: looked at again
    assert mask_kind(mask, 4, 4) is None
    other = _causal(1, 1, 4, 4)
    assert mask_kind(other, 4, 4) == CAUSAL


class Names(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_the_mask_check_is_out_of_sight_of_dispatch_modes_and_results_equal_the_aten_op() -> None:
    # A selective-checkpoint mode counts a kept node's calls in forward and recompute: the
    # check (run once, in the forward) must not show up in its count.
    q, k, v = (torch.randn(2, 2, 6, 8, requires_grad=True) for _ in range(3))
    mask = _causal(2, 1, 6, 6)
    mode = Names()
    with mode:
        out = attention(q, k, v, mask, scale=0.5)
    assert "_scaled_dot_product_flash_attention_for_cpu" in mode.names
    assert not {"all", "ones", "tril", "equal", "expand"} & set(mode.names), mode.names
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.5)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    expected = torch.autograd.grad(ref.square().sum(), (q, k, v))
    assert torch.equal(out, ref) and all(torch.equal(a, b) for a, b in zip(grads, expected))


class Kernel(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[bool, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore
        kwargs = kwargs or {}
        if func is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default:
            self.calls.append((kwargs.get("attn_mask") is not None, args[1].shape[1]))
        return func(*args, **kwargs)


def test_fake_tensors_follow_expect_and_real_ones_their_values() -> None:
    # Planning runs on fake tensors, which have no values: the verdict found at capture stands
    # in, so the plan sees the kernels (and the saved tensors) of a real step.
    q = torch.randn(2, 4, 6, 8)
    k, v = torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    mask = _causal(2, 1, 6, 6)
    padded = mask.clone()
    padded[0, :, :, 0] = False
    for m, expect, calls in ((mask, "causal", [(False, 2)]), (padded, "causal", [(True, 4)]),
                             (mask, None, [(False, 2)])):
        mode = Kernel()
        with mode:
            out = attention(q, k, v, m, kv_repeats=2, expect=expect)
        assert mode.calls == calls and out.shape == (2, 4, 6, 8)
    with FakeTensorMode() as fake:
        fq, fk, fv, fm = (fake.from_tensor(t) for t in (q, k, v, mask))
        for expect, calls in (("causal", [(False, 2)]), (None, [(True, 4)])):
            mode = Kernel()
            with mode:
                attention(fq, fk, fv, fm, kv_repeats=2, expect=expect)
            assert mode.calls == calls, expect


def test_a_layer_called_as_it_is_gets_the_mask_eager_code_gives_it() -> None:
    """None where Hugging Face's eager mask code skips the mask, the mask itself elsewhere."""
    causal = torch.ones(6, 6, dtype=torch.bool).tril().expand(2, 1, 6, 6)
    full = torch.ones(2, 1, 6, 6, dtype=torch.bool)
    padded = causal.clone()
    padded[0, ..., 0] = False
    one_query = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    assert layer_mask(causal, causal=True) is None
    assert layer_mask(causal, causal=False) is causal  # an encoder given a causal mask keeps it
    assert layer_mask(full, causal=False) is None
    assert layer_mask(full, causal=True) is full  # 6 queries, all visible: not what eager skips
    assert layer_mask(one_query, causal=True) is None  # one query (decoding): eager skips it
    assert layer_mask(padded, causal=True) is padded
    additive = torch.zeros(2, 1, 6, 6)
    assert layer_mask(additive, causal=True) is additive  # eager attention's float mask
    assert layer_mask(None, causal=True) is None
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(causal)
        assert layer_mask(fake, causal=True) is fake  # no values: planning keeps the mask


def _window_builder(window: int) -> tuple[torch.fx.GraphModule, list[int]]:
    """A graph that builds a sliding-window causal mask from the sequence length alone (as a
    traced Mistral does), counting its runs."""

    class Window(torch.nn.Module):
        def forward(self, s: int) -> torch.Tensor:
            rows = torch.arange(s)
            ahead = rows[None, :] <= rows[:, None]
            return (ahead & (rows[:, None] - rows[None, :] < window)).expand(2, 1, s, s)

    build = torch.fx.symbolic_trace(Window())
    runs: list[int] = []
    build.register_forward_pre_hook(lambda _module, args: runs.append(args[0]))
    return build, runs


def test_a_mask_from_sizes_is_built_only_at_sizes_capture_did_not_see() -> None:
    build, runs = _window_builder(window=8)
    # At the captured sizes: the verdict, nothing built.
    assert sized_mask(build, 6, at=(6,), kind=CAUSAL, lengths=(6, 6)) == (CAUSAL, 6, 6)
    assert runs == []
    # A shorter sequence: still inside the window, so causal; looked at once (on the CPU, out of
    # sight: the builder's own forward does not run), then remembered.
    for _ in range(3):
        assert sized_mask(build, 5, at=(6,), kind=CAUSAL, lengths=(6, 6)) == (CAUSAL, 5, 5)
    assert build.__dict__["_fxckpt_kinds"] == {(5,): (CAUSAL, 5, 5)} and runs == []
    # Longer than the window: the mask cuts, so it is built and handed over on every call.
    for _ in range(2):
        mask = sized_mask(build, 12, at=(6,), kind=CAUSAL, lengths=(6, 6))
        assert isinstance(mask, torch.Tensor) and mask.shape == (2, 1, 12, 12)
        assert not mask[0, 0, 11, 0] and mask[0, 0, 11, 4]
    assert runs == [12, 12] and build.__dict__["_fxckpt_kinds"][(12,)] is None


def test_a_verdict_attends_as_eager_code_would_and_checks_its_lengths() -> None:
    q, k, v = (torch.randn(2, 2, 6, 8, requires_grad=True) for _ in range(3))
    for verdict, mask in (((CAUSAL, 6, 6), _causal(6, 6)),
                          ((FULL, 6, 6), torch.ones(6, 6, dtype=torch.bool))):
        mode = Kernel()
        with mode:
            out = attention(q, k, v, verdict)
        assert mode.calls == [(False, 2)]  # no mask handed to the kernel
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        torch.testing.assert_close(out, ref)
    with pytest.raises(RuntimeError, match="was causal over 5 x 5 positions, but the call "
                                           "attends 6 queries to 6 keys"):
        attention(q, k, v, (CAUSAL, 5, 5))


def test_fake_runs_and_compiled_runs_of_a_mask_from_sizes() -> None:
    build, runs = _window_builder(window=4)
    with FakeTensorMode():  # a plan at sizes capture did not see: looked at on the CPU
        assert sized_mask(build, 3, at=(6,), kind=CAUSAL, lengths=(6, 6)) == (CAUSAL, 3, 3)
        assert sized_mask(build, 6, at=(6,), kind=CAUSAL, lengths=(6, 6)) == (CAUSAL, 6, 6)
    assert runs == []

    def compiled(s: int) -> object:
        return sized_mask(build, s, at=(6,), kind=CAUSAL, lengths=(6, 6))

    torch._dynamo.reset()
    mask = torch.compile(compiled, backend="eager", fullgraph=True)(6)
    torch._dynamo.reset()
    # torch.compile keeps masks (mask_kind says so there): the mask is built in the graph.
    assert isinstance(mask, torch.Tensor) and torch.equal(mask, build(6))
