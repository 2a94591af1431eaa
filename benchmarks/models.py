"""The benchmark's models, defined here (the package never imports ``tests/``).

The transformers are GPT-2 and BERT (learned positions, multi-head attention, GELU MLP) and a
Llama-style decoder (RoPE, grouped-query attention: fewer key/value heads than query heads,
SwiGLU MLP, RMSNorm, no biases, no dropout), all from Hugging Face configs with ``sdpa``
attention. Llama's attention has no dropout, so on CPU its ``sdpa`` runs the fused
``_scaled_dot_product_flash_attention_for_cpu`` kernel (GPT-2's and BERT's dropout sends
theirs through the decomposed math path), which the op-level peers treat as one op.

Each :class:`ModelSpec` builds a model with random weights, its inputs and its loss, and names
the *blocks* (the repeated layers) that the ``torch.utils.checkpoint`` peers wrap. Full sizes make
one training step take roughly 50-500 ms on one thread of the benchmark machine; quick sizes
make every step take a few milliseconds, for tests, while keeping activations above the 64 KiB
``mmap`` threshold, so the RSS protocol still sees them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ModelSpec", "MODELS", "MODEL_NAMES", "BenchMLP", "BenchResNet", "spec_for", "Built",
           "llama_config"]


class BenchMLP(nn.Module):
    """``depth`` blocks of ``Linear -> GELU``, then a classifier head."""

    def __init__(self, depth: int, width: int, classes: int = 10) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)
        )
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class ResBlock(nn.Module):
    """conv-BN-ReLU-conv-BN plus the identity, then ReLU."""

    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(ch, ch, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(ch)
        self.conv2 = nn.Conv2d(ch, ch, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(ch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(y)))


class BenchResNet(nn.Module):
    """A ResNet-style CNN: stem, ``blocks`` residual blocks with BatchNorm, pooling, classifier."""

    def __init__(self, blocks: int, ch: int, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, ch, 3, padding=1, bias=False), nn.BatchNorm2d(ch), nn.ReLU()
        )
        self.blocks = nn.Sequential(*(ResBlock(ch) for _ in range(blocks)))
        self.fc = nn.Linear(ch, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        return self.fc(x.mean(dim=(2, 3)))


Built = tuple[nn.Module, tuple[torch.Tensor, ...], Callable[[Any], torch.Tensor]]
"""A model in training mode, its positional inputs, and ``loss(output) -> scalar``."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """How to build one benchmark model and where its blocks are."""

    name: str
    """Key used on the command line (``--models mlp,gpt2``)."""
    build: Callable[[dict[str, int]], Built]
    """Build from a size dict (``full`` or ``quick``), seeded by the caller."""
    full: dict[str, int]
    """Sizes for the real run."""
    quick: dict[str, int]
    """Tiny sizes for tests (``--quick``)."""
    blocks: str
    """Dotted attribute path of the container of repeated blocks."""
    iterated: bool
    """True when ``forward`` iterates the container (``for b in self.h``); False when it calls it.
    """
    attention: bool = False
    """True when the blocks hold attention (the op-level peers apply only then)."""

    def describe(self, quick: bool) -> str:
        sizes = ", ".join(f"{k}={v}" for k, v in (self.quick if quick else self.full).items())
        return f"{self.name} ({sizes})"


def _mlp(s: dict[str, int]) -> Built:
    model = BenchMLP(s["depth"], s["width"])
    x = torch.randn(s["batch"], s["width"])
    y = torch.randint(10, (s["batch"],))
    return model.train(), (x,), lambda out: F.cross_entropy(out, y)


def _resnet(s: dict[str, int]) -> Built:
    model = BenchResNet(s["blocks"], s["ch"])
    x = torch.randn(s["batch"], 3, s["hw"], s["hw"])
    y = torch.randint(10, (s["batch"],))
    return model.train(), (x,), lambda out: F.cross_entropy(out, y)


def _gpt2(s: dict[str, int]) -> Built:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=s["layers"],
        n_embd=s["width"],
        n_head=s["heads"],
        n_positions=s["seq"],
        vocab_size=s["vocab"],
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    )
    ids = torch.randint(s["vocab"], (s["batch"], s["seq"]))
    return (
        GPT2LMHeadModel(cfg).train(),
        (ids,),
        lambda out: F.cross_entropy(out.logits.flatten(0, 1), ids.flatten()),
    )


def _bert(s: dict[str, int]) -> Built:
    from transformers import BertConfig, BertModel

    cfg = BertConfig(
        hidden_size=s["width"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        intermediate_size=4 * s["width"],
        vocab_size=s["vocab"],
        max_position_embeddings=s["seq"],
        use_cache=False,
    )
    ids = torch.randint(s["vocab"], (s["batch"], s["seq"]))
    return BertModel(cfg).train(), (ids,), lambda out: out.last_hidden_state.square().mean()


def llama_config(s: dict[str, int]) -> Any:
    """A ``LlamaConfig`` for the size dict ``s`` (``sdpa`` attention, no dropout, no cache)."""
    from transformers import LlamaConfig

    attention: dict[str, Any] = {"attn_implementation": "sdpa"}  # a kwarg the stubs do not list
    return LlamaConfig(
        vocab_size=s["vocab"],
        hidden_size=s["width"],
        intermediate_size=s["ffn"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        max_position_embeddings=s["seq"],
        attention_dropout=0.0,
        tie_word_embeddings=False,
        use_cache=False,
        **attention,
    )


def _llama(s: dict[str, int]) -> Built:
    from transformers import LlamaForCausalLM

    ids = torch.randint(s["vocab"], (s["batch"], s["seq"]))
    return (
        LlamaForCausalLM(llama_config(s)).train(),
        (ids,),
        lambda out: F.cross_entropy(out.logits.flatten(0, 1), ids.flatten()),
    )


_HF_FULL = {"layers": 12, "width": 128, "heads": 4, "vocab": 512, "batch": 4, "seq": 128}
_HF_QUICK = {"layers": 2, "width": 64, "heads": 2, "vocab": 128, "batch": 8, "seq": 32}
# SwiGLU's three matrices of ~8/3 x width hold as many weights as GPT-2's two of 4 x width.
_LLAMA_FULL = dict(_HF_FULL, heads=4, kv_heads=2, ffn=352)
_LLAMA_QUICK = dict(_HF_QUICK, heads=4, kv_heads=2, ffn=176)

MODELS: dict[str, ModelSpec] = {
    "mlp": ModelSpec(
        name="mlp",
        build=_mlp,
        blocks="layers",
        iterated=True,
        full={"depth": 24, "width": 256, "batch": 2048},
        quick={"depth": 8, "width": 64, "batch": 512},
    ),
    "resnet": ModelSpec(
        name="resnet",
        build=_resnet,
        blocks="blocks",
        iterated=False,
        full={"blocks": 6, "ch": 32, "hw": 32, "batch": 16},
        quick={"blocks": 2, "ch": 8, "hw": 32, "batch": 8},
    ),
    "gpt2": ModelSpec(
        name="gpt2",
        build=_gpt2,
        blocks="transformer.h",
        iterated=True,
        attention=True,
        full=_HF_FULL,
        quick=_HF_QUICK,
    ),
    "bert": ModelSpec(
        name="bert",
        build=_bert,
        blocks="encoder.layer",
        iterated=True,
        attention=True,
        full=_HF_FULL,
        quick=_HF_QUICK,
    ),
    "llama": ModelSpec(
        name="llama",
        build=_llama,
        blocks="model.layers",
        iterated=True,
        attention=True,
        full=_LLAMA_FULL,
        quick=_LLAMA_QUICK,
    ),
}
"""The benchmark models, in report order."""

MODEL_NAMES = tuple(MODELS)


def spec_for(name: str) -> ModelSpec:
    """The spec called ``name``; a ``ValueError`` listing the known ones otherwise."""
    if name not in MODELS:
        raise ValueError(f"unknown benchmark model {name!r}; choose from {', '.join(MODELS)}")
    return MODELS[name]
