"""simplify: the calls torch.export records that eager code never makes are gone, values equal."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxckpt
from fxckpt.capture.simplify import simplify
from fxckpt.runtime.attention import attention
from support import assert_steps_equal, run_step

aten = torch.ops.aten


class Casts(nn.Module):
    """``.to`` to the same dtype, whole-dimension slices, and what must stay."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x).to(torch.float32)  # same dtype: eager returns h itself
        whole = h[:, None, :][:, 0]  # x[:, None] records slice(h, 0, 0, INT64_MAX)
        wider = h.to(torch.float64)  # a real cast
        tail = h[:, 1:]  # a real slice
        return whole.sin() + wider.sum().float() + tail.sum()


def _exported(model: nn.Module, *args: torch.Tensor) -> torch.fx.GraphModule:
    """As fxckpt exports: every dimension dynamic (where whole slices are recorded)."""
    auto = torch.export.Dim.AUTO
    shapes = tuple({d: auto for d in range(a.dim())} for a in args)
    return torch.export.export(model, args, strict=False, dynamic_shapes=shapes).module()


def _targets(gm: torch.fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _slice_ends(gm: torch.fx.GraphModule) -> list:
    return [n.args[1:] for n in gm.graph.nodes if n.target is aten.slice.Tensor]


def test_asserts_whole_slices_and_same_dtype_casts_go_real_ones_stay() -> None:
    model = Casts()
    x = torch.randn(4, 8)
    gm = _exported(model, x)
    before = _targets(gm)
    assert aten._assert_tensor_metadata.default in before

    done = simplify(gm)

    after = _targets(gm)
    assert done.asserts == before.count(aten._assert_tensor_metadata.default) > 0
    assert done.casts == 1 and done.slices >= 1 and done.attention.calls == 0
    assert aten._assert_tensor_metadata.default not in after
    assert len(after) == len(before) - done.total
    casts = [n for n in gm.graph.nodes if n.target in (aten.to.dtype, aten._to_copy.default)]
    # The real casts stay: to float64, and the sum back to float32.
    assert [(n.args[0].meta["val"].dtype, n.meta["val"].dtype) for n in casts] == [
        (torch.float32, torch.float64), (torch.float64, torch.float32)]
    assert all(end[1:3] != (0, 2**63 - 1) for end in _slice_ends(gm))  # no whole slice left
    assert (1, 1, 2**63 - 1) in [tuple(end) for end in _slice_ends(gm)]  # h[:, 1:] stays
    xg = x.clone().requires_grad_()
    out = gm(xg)
    out.sum().backward()
    xe = x.clone().requires_grad_()
    ref = model(xe)
    ref.sum().backward()
    assert torch.equal(out, ref) and torch.equal(xg.grad, xe.grad)


def test_a_graph_without_such_calls_is_left_as_it_is() -> None:
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    code = gm.code
    assert simplify(gm).total == 0 and gm.code == code


class MaskedAttention(nn.Module):
    """Attention given a boolean mask the model builds: causal, all-visible, or padded."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.qkv = nn.Linear(16, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        mask = torch.ones(b, 1, s, s, dtype=torch.bool, device=x.device)
        if self.kind == "causal":
            mask = mask.tril()
        elif self.kind == "padded":
            mask = mask.tril() & (torch.arange(s, device=x.device) < s - 2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class KernelCalls(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the CPU attention kernel's mask, causal flag and key heads, and every name."""

    def __init__(self) -> None:
        super().__init__()
        self.kernel: list[tuple[bool, bool]] = []
        self.key_heads: list[int] = []
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore
        kwargs = kwargs or {}
        self.names.append(func.overloadpacket.__name__)
        if func is aten._scaled_dot_product_flash_attention_for_cpu.default:
            causal = kwargs.get("is_causal", args[4] if len(args) > 4 else False)
            self.kernel.append((kwargs.get("attn_mask") is not None, bool(causal)))
            self.key_heads.append(args[1].shape[1])
        return func(*args, **kwargs)


def test_attention_drops_a_causal_or_all_visible_mask_and_keeps_a_padding_mask() -> None:
    x = torch.randn(2, 6, 16)
    expected = {"causal": (False, True), "full": (False, False), "padded": (True, False)}
    for kind, kernel in expected.items():
        model = MaskedAttention(kind)
        gm = _exported(model, x)
        assert simplify(gm).attention.calls == 1
        assert attention in _targets(gm)
        mode = KernelCalls()
        with mode:
            gm(x)
        assert mode.kernel == [kernel], kind
        xg, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
        out, ref = gm(xg), model(xe)  # eager passes the mask: the kernels agree bit for bit
        out.square().sum().backward()
        ref.square().sum().backward()
        assert torch.equal(out, ref) and torch.equal(xg.grad, xe.grad), kind
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(gm.parameters(),
                                                                 model.parameters())), kind
        model.zero_grad()


def _llama(kv_heads: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads, use_cache=False,
                      max_position_embeddings=64, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).train()


def test_hugging_face_sdpa_models_run_eager_kernels_and_match_eager_bit_for_bit() -> None:
    # Eager Hugging Face runs is_causal=True, and enable_gqa=True on the unrepeated key/value
    # heads; traced, it builds a causal mask and repeats the heads. The graph now runs what eager
    # runs: with 1 and 2 key/value heads of 4, gradients differed in rounding before.
    ids = torch.randint(0, 64, (2, 12))
    for kv_heads in (4, 2, 1):
        model = _llama(kv_heads)
        reference = copy.deepcopy(model)
        tm = fxckpt.transform(model, depth=3, example_inputs=(ids,))
        gm = fxckpt.inspect(tm).graph_module
        code = "".join(m.code for m in gm.modules() if isinstance(m, torch.fx.GraphModule))
        assert code.count("fxckpt_attention(") == 2 and "_assert_tensor_metadata" not in code
        assert code.count("fxckpt_sized_mask(") == 1 and code.count("kind = 'causal'") == 1
        assert code.count(f"kv_repeats = {4 // kv_heads}") == (2 if kv_heads < 4 else 0)
        mode = KernelCalls()
        with mode:
            tm(ids)
        assert mode.kernel == [(False, True)] * 2, kv_heads  # no mask handed over, causal
        assert mode.key_heads == [kv_heads] * 2  # the heads are not repeated
        assert "where" not in mode.names and "clone" not in mode.names
        for step in range(2):
            assert_steps_equal(run_step(tm, (ids,), {}, seed=step),
                               run_step(reference, (ids,), {}, seed=step))


def test_a_padding_mask_from_the_inputs_is_not_expected_and_is_looked_at_each_call() -> None:
    model = _llama(2)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2, 12))
    padded = torch.ones(2, 12, dtype=torch.long)
    padded[1, :3] = 0
    tm = fxckpt.transform(model, depth=3, example_inputs=(ids,),
                          example_kwargs={"attention_mask": padded})
    gm = fxckpt.inspect(tm).graph_module
    code = "".join(m.code for m in gm.modules() if isinstance(m, torch.fx.GraphModule))
    assert code.count("kv_repeats = 2") == 2 and "sized_mask" not in code  # reads the inputs
    for mask, kernel, heads in ((padded, (True, False), 4),
                                (torch.ones(2, 12, dtype=torch.long), (False, True), 2)):
        mode = KernelCalls()
        with mode:
            tm(ids, attention_mask=mask)
        assert mode.kernel == [kernel] * 2 and mode.key_heads == [heads] * 2
        assert_steps_equal(run_step(tm, (ids,), {"attention_mask": mask}),
                           run_step(reference, (ids,), {"attention_mask": mask}))


class OwnRepeat(nn.Module):
    """Grouped-query attention written by hand: eager repeats the heads, so the graph must too."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.kv = nn.Linear(16, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, 4, 4).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, 1, 4).permute(3, 0, 2, 1, 4)[0].chunk(2, dim=1)
        k = k.unsqueeze(2).expand(b, 1, 4, s, 4).reshape(b, 4, s, 4)
        v = v.unsqueeze(2).expand(b, 1, 4, s, 4).reshape(b, 4, s, 4)
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_repeats_outside_hugging_face_attention_stay_in_the_graph() -> None:
    model = OwnRepeat()
    x = torch.randn(2, 6, 16)
    gm = _exported(model, x)
    done = simplify(gm).attention
    assert (done.calls, done.repeats, done.expected) == (1, 0, 1)
    xg, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, ref = gm(xg), model(xe)
    out.square().sum().backward()
    ref.square().sum().backward()
    assert torch.equal(out, ref) and torch.equal(xg.grad, xe.grad)


class RandomMask(nn.Module):
    """A mask drawn from torch's RNG: building it at capture would change the random state."""

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        s = q.shape[-2]
        mask = (torch.rand(s, s, device=q.device) >= 0).tril()
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)


def test_a_mask_drawn_at_random_is_not_built_at_capture() -> None:
    gm = _exported(RandomMask(), torch.randn(1, 2, 5, 4))
    state = torch.get_rng_state()
    done = simplify(gm).attention
    assert torch.equal(torch.get_rng_state(), state)
    assert (done.calls, done.expected) == (1, 0)


def test_the_mask_every_layer_shares_is_built_once_at_capture(monkeypatch) -> None:
    from fxckpt.capture import eager_attention

    built = []
    evaluate = eager_attention._evaluate
    monkeypatch.setattr(eager_attention, "_evaluate", lambda n: built.append(n) or evaluate(n))
    tm = fxckpt.transform(_llama(2), depth=3, example_inputs=(torch.randint(0, 64, (2, 12)),))
    gm = fxckpt.inspect(tm).graph_module
    code = "".join(m.code for m in gm.modules() if isinstance(m, torch.fx.GraphModule))
    assert code.count("kind = 'causal'") == 1 and len(built) == 1
