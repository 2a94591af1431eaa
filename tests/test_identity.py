"""Promise 6: any model works and stays itself (no name collisions, its attributes and methods)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn as nn

import fxckpt
from patterns import Stack, Tempered
from support import assert_steps_equal, run_step

FXCKPT_NAMES = (
    "model",
    "config",
    "plan",
    "code",
    "pipeline",
    "graph_module",
    "plan_for",
    "offload_stats",
    "inspect",
    "dispatcher",
)


class Settings:
    """A config object as Hugging Face models keep one: read by the model and by libraries."""

    width = 16
    vocab_size = 32


class Colliding(nn.Module):
    """Children, a parameter, a buffer and attributes under every name fxckpt ever used."""

    def __init__(self) -> None:
        super().__init__()
        self.config = Settings()
        self.model = Stack()
        self.plan = nn.Linear(4, 16)
        self.code = nn.Linear(16, 16)
        self.register_parameter("pipeline", nn.Parameter(torch.ones(16)))
        self.register_buffer("graph_module", torch.zeros(16))
        self.graph = nn.Identity()  # a GNN's child; also a GraphModule's own attribute
        self.segment_0 = nn.Identity()  # the name fxckpt gives its first segment
        self.plan_for = "a string attribute"
        self.offload_stats = 3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.code(torch.relu(self.plan(x))) * self.pipeline + self.graph_module
        return self.model(self.segment_0(self.graph(h)))

    def describe(self) -> str:
        return f"width {self.config.width}"


def test_a_model_with_fxckpt_names_transforms_and_trains_bit_exact() -> None:
    model = Colliding()
    reference = copy.deepcopy(model)
    tm = fxckpt.transform(model, depth=2)
    assert tm.config is model.config and tm.model is model.model and tm.plan is model.plan
    assert (
        tm.plan_for == "a string attribute"
        and tm.offload_stats == 3
        and tm.describe() == "width 16"
    )
    assert list(tm.state_dict()) == list(model.state_dict())
    assert isinstance(tm, Colliding) and isinstance(tm, fxckpt.TransformedModule)
    x = torch.randn(4, 4)
    for step in range(2):
        assert_steps_equal(
            run_step(tm, (x,), {}, seed=step), run_step(reference, (x,), {}, seed=step)
        )
    assert fxckpt.inspect(tm).plan.segments and fxckpt.inspect(tm).model is model


def test_hugging_face_causal_lm_keeps_its_model_child_config_and_generate() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    # Eager attention, so that generate() below runs the same kernels with and without a cache;
    # sdpa training steps are compared bit for bit in tests/capture/test_simplify.py.
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=False,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    model = LlamaForCausalLM(cfg).train()
    reference = copy.deepcopy(model)
    tm = fxckpt.transform(model, depth=3)
    assert tm.config is model.config and tm.model is model.model and tm.config.vocab_size == 64
    assert tm.generation_config is model.generation_config
    assert tm.get_input_embeddings() is model.model.embed_tokens
    assert list(tm.state_dict()) == list(model.state_dict())
    ids = torch.randint(0, 64, (2, 12))
    for step in range(2):
        got = run_step(tm, (ids,), {"labels": ids}, seed=step)
        assert_steps_equal(got, run_step(reference, (ids,), {"labels": ids}, seed=step))
    assert [s.module_paths for s in fxckpt.inspect(tm).plan.segments] == [
        ("model.layers.0",),
        ("model.layers.1",),
    ]
    tm.eval()
    reference.eval()
    prompt = torch.randint(0, 64, (1, 4))
    assert torch.equal(tm.generate(prompt, max_new_tokens=4, do_sample=False),
                       reference.generate(prompt, max_new_tokens=4, do_sample=False))
    assert fxckpt.inspect(tm).captures == 1  # generate ran the model itself


def test_a_causal_lm_with_its_default_cache_trains_without_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``GPT2Config()`` turns ``use_cache`` on; a training call builds a ``DynamicCache``, which no
    graph capture can return. fxckpt calls it with ``use_cache=False``, as Hugging Face's own
    gradient checkpointing does, and says so once; eval calls keep the cache."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=32, vocab_size=64)
    assert cfg.use_cache
    model = GPT2LMHeadModel(cfg).train()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2, 12))
    with caplog.at_level("INFO", logger="fxckpt"):
        tm = fxckpt.transform(model, budget=0.6, example_inputs=(ids,))  # planned without one
        for step in range(2):
            got = run_step(tm, (ids,), {"labels": ids}, seed=step)
            want = run_step(reference, (ids,), {"labels": ids, "use_cache": False}, seed=step)
            assert_steps_equal(got, want)
    said = [r.getMessage() for r in caplog.records if "config.use_cache" in r.getMessage()]
    assert said == ["GPT2LMHeadModel: config.use_cache is on; training calls run with "
                    "use_cache=False (no key/value cache, as under Hugging Face's gradient "
                    "checkpointing)"]
    assert tm(ids).past_key_values is None  # a second call structure: no labels
    tm.eval()
    with torch.no_grad():
        assert tm(ids).past_key_values is not None  # the model's own forward: cache kept


def test_deepcopy_and_pickle_give_an_independent_transformed_module() -> None:
    model = Stack()
    tm = fxckpt.transform(model, every=1)
    x = torch.randn(4, 16)
    tm(x)
    for other in (copy.deepcopy(tm), pickle.loads(pickle.dumps(tm))):
        assert isinstance(other, Stack) and isinstance(other, fxckpt.TransformedModule)
        assert fxckpt.inspect(other).config == fxckpt.inspect(tm).config
        assert all(p is not q for p, q in zip(other.parameters(), tm.parameters()))
        assert_steps_equal(run_step(other, (x,), {}), run_step(copy.deepcopy(model), (x,), {}))
        assert fxckpt.inspect(other).plan.segments


def test_transforming_twice_and_inspecting_a_plain_model_are_refused() -> None:
    tm = fxckpt.transform(Stack(), every=1)
    with pytest.raises(
        fxckpt.ConfigError, match="already transformed; transform the original model"
    ):
        fxckpt.transform(tm, every=2)
    with pytest.raises(fxckpt.ConfigError, match="takes a module fxckpt.transform returned"):
        fxckpt.inspect(Stack())


def test_train_and_eval_follow_on_the_model_and_to_drops_captured_graphs() -> None:
    model = Stack()
    tm = fxckpt.transform(model, every=1)
    tm(torch.randn(4, 16))
    tm.eval()
    assert not model.training and not model.blocks[0].training
    tm.train()
    assert model.training
    tm.to(torch.float64)
    assert model.head.weight.dtype == torch.float64
    out = tm(torch.randn(4, 16, dtype=torch.float64))
    assert (
        out.dtype == torch.float64 and fxckpt.inspect(tm).captures == 2
    )  # captured again after .to()


def test_a_to_that_moves_nothing_keeps_captures_and_plans() -> None:
    """Lightning calls ``.to(device)`` as ``fit`` starts and ``.cpu()`` as it ends."""
    tm = fxckpt.transform(Stack(), every=1)
    tm(torch.randn(4, 16)).sum().backward()
    plan = fxckpt.inspect(tm).plan
    tm.to("cpu").cpu().float().to(torch.float32)
    assert fxckpt.inspect(tm).plan is plan
    tm(torch.randn(4, 16)).sum().backward()
    assert fxckpt.inspect(tm).captures == 1 and fxckpt.inspect(tm).plans_made == 1
    tm.half()
    with pytest.raises(fxckpt.NotPlannedError):
        fxckpt.inspect(tm).plan


def test_one_state_attributes_set_on_either_are_set_on_both() -> None:
    model = Tempered()
    tm = fxckpt.transform(model, every=1)
    tm.temperature = 2.0
    assert model.temperature == 2.0
    model.note = "set on the model"
    assert tm.note == "set on the model"
    del tm.note
    assert not hasattr(model, "note")
    model.eval()
    assert not tm.training
    tm.train()
    assert model.training and all(m.training for m in model.modules())


def test_two_transforms_of_one_model_keep_their_own_options() -> None:
    model = Tempered()
    x = torch.randn(4, 16)
    every = fxckpt.transform(model, every=1, example_inputs=(x,))
    none = fxckpt.transform(model, example_inputs=(x,))
    assert len(fxckpt.inspect(every).plan.segments) > 0
    assert len(fxckpt.inspect(none).plan.segments) == 0
    assert "__fxckpt__" not in vars(model)
    with pytest.raises(fxckpt.ConfigError, match="already transformed"):
        fxckpt.transform(every, every=2)
