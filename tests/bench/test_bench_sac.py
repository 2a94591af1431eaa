"""The op-level peers: their policies op by op, and the models' gradients under them."""

from __future__ import annotations

import collections
from types import SimpleNamespace
from typing import Any, Callable

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy

from benchmarks import sac
from benchmarks.methods import METHODS, NotApplicable, PEERS, prepare
from benchmarks.models import spec_for
from benchmarks.runner import PEER_METHODS

aten = torch.ops.aten
S, R = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
FORWARD, RECOMPUTE = SimpleNamespace(is_recompute=False), SimpleNamespace(is_recompute=True)
FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default


def _decide(policy: sac.Policy, ops: list[Any], ctx: Any = FORWARD) -> list[CheckpointPolicy]:
    return [policy(ctx, op) for op in ops]


def test_the_op_policy_saves_attention_and_every_other_matmul_of_each_kind() -> None:
    mm, addmm = aten.mm.default, aten.addmm.default
    ops = [mm, aten.view.default, mm, mm, FLASH, mm, aten.add.Tensor, addmm, addmm, mm,
           aten.silu.default, mm]
    expect = [S, R, R, S, S, R, R, S, R, S, R, R]
    policy = sac.ops_policy()
    assert _decide(policy, ops) == expect
    # the recompute counts on its own, so it meets the forward's decisions again
    assert _decide(policy, ops, RECOMPUTE) == expect
    assert _decide(sac.ops_policy(), [mm, mm, mm]) == [S, R, S]  # a fresh policy per block call
    assert {FLASH, aten._scaled_dot_product_efficient_attention.default} <= sac.ATTENTION_OPS


def test_the_megatron_policy_recomputes_the_core_and_what_autograd_does_not_keep() -> None:
    bmm, add, clone = aten.bmm.default, aten.add.Tensor, aten.clone.default
    decomposed = [aten.addmm.default, aten.view.default, aten.mul.Scalar, clone,
                  bmm, add, aten._safe_softmax.default, aten.empty_like.default,
                  aten.bernoulli_.float, aten.mul.Tensor, bmm,
                  clone, aten.addmm.default, aten.native_layer_norm.default,
                  aten.gelu.default, aten.empty_like.default, aten.div_.Scalar, add, add]
    expect = [S, R, R, S,
              R, R, R, R, R, R, R,  # score bmm ... probabilities x values bmm: the core
              R, S, S, S, R, R, R, S]  # outside: kept if autograd keeps it, or a matmul
    saved = frozenset({(clone, 0), (aten.native_layer_norm.default, 0),
                       (aten.gelu.default, 0), (add, 2), (bmm, 0), (add, 0)})
    policy = sac.megatron_policy(saved)
    assert _decide(policy, decomposed) == expect
    assert _decide(policy, decomposed, RECOMPUTE) == expect
    fused = [aten.mm.default, aten.cat.default, FLASH, aten.transpose.int, aten.mm.default]
    assert _decide(sac.megatron_policy(frozenset()), fused) == [S, R, R, R, S]


def test_autograd_saved_names_the_ops_whose_outputs_backward_needs() -> None:
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)

    def forward(x: torch.Tensor) -> torch.Tensor:
        h = x.mm(w)  # mm saves x (an input) and w (a leaf): no op of ours
        # sin saves h; dropout's mask is saved, but made by empty_like + bernoulli_: ops that
        # cost nothing to recompute (the RNG is replayed), so no op to keep
        g = torch.nn.functional.dropout(h.sin(), 0.5)
        return g.add(1).tanh()  # add saves nothing; tanh saves its output

    state = torch.get_rng_state()
    got = sac.autograd_saved(forward, (x,), {})
    assert torch.equal(torch.get_rng_state(), state)  # dropout drew from a forked RNG
    assert {(op._opname, n) for op, n in got} == {("mm", 0), ("tanh", 0)}


def test_op_level_peers_are_peers_of_the_benchmark() -> None:
    assert {"sac_ops", "sac_megatron"} <= set(METHODS) and set(PEERS) <= set(METHODS)
    assert PEER_METHODS == PEERS and "sac_ops" in PEERS and "sac_megatron" in PEERS


def _recorded(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool, str, CheckpointPolicy]]:
    """Record every decision of the two policies (method, recompute?, op, decision)."""
    log: list[tuple[str, bool, str, CheckpointPolicy]] = []

    def logging(method: str, make: Callable[..., sac.Policy]) -> Callable[..., sac.Policy]:
        def made(saved: frozenset[sac.Key]) -> sac.Policy:
            policy = make(saved)

            def decide(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
                got = policy(ctx, op, *args, **kwargs)
                log.append((method, ctx.is_recompute, op._opname, got))
                return got

            return decide

        return made

    for method, make in list(sac.POLICIES.items()):
        monkeypatch.setitem(sac.POLICIES, method, logging(method, make))
    return log


class _Count(TorchDispatchMode):
    """Counts the aten ops run while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        self.ops[func._opname] += 1
        return func(*args, **(kwargs or {}))


def _step(name: str, method: str) -> tuple[list[torch.Tensor | None], collections.Counter[str]]:
    """Parameter gradients of one step, and the ops its backward ran (recompute included)."""
    spec = spec_for(name)
    torch.manual_seed(0)
    model, inputs, loss = spec.build(spec.quick)
    module, _ = prepare(method, model, inputs, spec, None)
    torch.manual_seed(1)
    total = loss(module(*inputs))
    with _Count() as backward:
        total.backward()
    return [p.grad for p in model.parameters()], backward.ops


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_op_level_peers_keep_the_models_gradients_and_recompute_what_they_say(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("transformers")
    log = _recorded(monkeypatch)
    reference, base = _step(name, "unmodified")
    extra = {}
    for method in ("sac_ops", "sac_megatron"):
        got, ops = _step(name, method)
        assert all((a is None and b is None) or torch.equal(a, b)
                   for a, b in zip(reference, got)), method
        extra[method] = ops - base  # what the recompute ran
    layers = spec_for(name).quick["layers"]
    matmul = "mm" if name == "llama" else "addmm"
    linears = {"llama": 7, "gpt2": 4, "bert": 6}[name]  # per block
    said = {m: collections.Counter(op for mm, _, op, d in log if mm == m and d == R)
            for m in extra}
    # torchtitan's policy: every second matmul is recomputed, attention is not
    assert said["sac_ops"][matmul] == extra["sac_ops"][matmul] == layers * (linears // 2)
    assert extra["sac_ops"][FLASH._opname] == 0
    # Megatron's: no matmul of a linear layer, only the attention core
    assert said["sac_megatron"][matmul] == extra["sac_megatron"][matmul] == 0
    core = {"llama": {FLASH._opname: 1}, "gpt2": {"bmm": 2, "_safe_softmax": 1},
            "bert": {"bmm": 2, "_safe_softmax": 1}}[name]
    for op, count in core.items():
        assert said["sac_megatron"][op] == extra["sac_megatron"][op] == layers * count, op
    if name == "llama":  # RoPE's rotate_half: autograd keeps no cat, so it is recomputed
        assert said["sac_megatron"]["cat"] == extra["sac_megatron"]["cat"] == 2 * layers


def test_op_level_peers_do_not_apply_to_models_without_attention() -> None:
    spec = spec_for("mlp")
    model, inputs, _ = spec.build(spec.quick)
    with pytest.raises(NotApplicable, match="sac_megatron is an attention policy and mlp's "
                                            "blocks hold no attention"):
        prepare("sac_megatron", model, inputs, spec, None)
