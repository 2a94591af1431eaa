"""Small models the tests share: one of each kind users bring to fxckpt.

Each factory builds a model with fixed shapes small enough for a 2-core CPU, and comes with an
``inputs`` function giving matching example inputs. Hugging Face models are built from a config
with random weights (nothing is downloaded).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from benchmarks.models import BenchResNet


class MLPBlock(nn.Module):
    def __init__(self, width: int, p: float) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(F.gelu(self.fc(x)))


class MLP(nn.Module):
    """``depth`` blocks of Linear -> GELU -> Dropout, then a head."""

    def __init__(self, depth: int = 6, width: int = 32, p: float = 0.1) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MLPBlock(width, p) for _ in range(depth))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class Shuffled(MLP):
    """An MLP whose blocks run in the order ``order``, not the order they were registered in."""

    def __init__(self, order: tuple[int, ...] = (3, 1, 0, 2), width: int = 32) -> None:
        super().__init__(depth=len(order), width=width, p=0.0)
        self.order = order

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in self.order:
            x = self.layers[i](x)
        return self.head(x)


class ResNet(BenchResNet):
    """The benchmark's ResNet-style CNN (stem, residual blocks with BatchNorm), small by
    default."""

    def __init__(self, blocks: int = 3, ch: int = 8, classes: int = 5) -> None:
        super().__init__(blocks, ch, classes)


def _double_conv(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(cout, cout, 3, padding=1),
        nn.ReLU(),
    )


class Down(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv = _double_conv(cin, cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.max_pool2d(x, 2))


class Up(nn.Module):
    def __init__(self, cin: int, cskip: int, cout: int) -> None:
        super().__init__()
        self.conv = _double_conv(cin + cskip, cout)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        x = F.interpolate(x, scale_factor=2.0, mode="nearest")
        return self.conv(torch.cat([x, skip], dim=1))


class UNet(nn.Module):
    """A U-Net-style model: every encoder level is concatenated into the decoder (long skips)."""

    def __init__(self, ch: int = 4, levels: int = 2) -> None:
        super().__init__()
        self.inc = _double_conv(1, ch)
        self.down = nn.ModuleList(Down(ch * 2**i, ch * 2 ** (i + 1)) for i in range(levels))
        self.up = nn.ModuleList(
            Up(ch * 2 ** (i + 1), ch * 2**i, ch * 2**i) for i in reversed(range(levels))
        )
        self.out = nn.Conv2d(ch, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inc(x)
        skips = []
        for down in self.down:
            skips.append(x)
            x = down(x)
        for up in self.up:
            x = up(x, skips.pop())
        return self.out(x)


class KwargsDict(nn.Module):
    """Keyword arguments with defaults, a non-tensor flag, and a dict output."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))
        self.dec = nn.Sequential(nn.Linear(width, width), nn.Dropout(0.2), nn.Linear(width, 3))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 1.0,
                return_hidden: bool = False) -> dict:
        h = self.enc(x) * scale
        if mask is not None:
            h = h * mask
        out = {"logits": self.dec(h), "n": x.shape[0]}
        if return_hidden:
            out["hidden"] = h
        return out


class TrainingFlag(nn.Module):
    """Uses ``F.dropout(training=self.training)``: tracing bakes the flag into the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.dropout(F.relu(self.fc1(x)), p=0.5, training=self.training))


class Noisy(nn.Module):
    """Draws ``torch.randn`` in forward: must be fresh each call, not a traced constant."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x + torch.randn(x.shape))


class Positions(nn.Module):
    """Adds positions made with ``torch.arange`` (a call_function target with no stable repr)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1], device=x.device, dtype=x.dtype)[None, :, None]
        return self.fc2(torch.relu(self.fc1(x + pos)))


class DataDependent(nn.Module):
    """Branches on a tensor's value: neither symbolic_trace nor export can capture it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.fc(x)
        return -self.fc(x)


def gpt2(layers: int = 2) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=layers, n_embd=32, n_head=2, n_positions=32, vocab_size=64,
                     bos_token_id=0, eos_token_id=0, use_cache=False)
    return GPT2LMHeadModel(cfg)


def bert(layers: int = 2) -> nn.Module:
    from transformers import BertConfig, BertModel

    cfg = BertConfig(
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=64,
        max_position_embeddings=32,
        use_cache=False,
    )
    return BertModel(cfg)


@dataclasses.dataclass(frozen=True)
class Case:
    """A model factory with inputs and the strategies that make sense for it."""

    name: str
    make: Callable[[], nn.Module]
    inputs: Callable[[], tuple[tuple, dict]]
    depth: int


def _float(*shape: int) -> Callable[[], tuple[tuple, dict]]:
    return lambda: ((torch.randn(*shape, requires_grad=True),), {})


def _ids() -> tuple[tuple, dict]:
    return (torch.randint(0, 64, (2, 12)),), {}


def _kwargs_inputs() -> tuple[tuple, dict]:
    x = torch.randn(4, 16, requires_grad=True)
    return (x,), {"mask": (torch.rand(4, 16) > 0.3).float(), "scale": 0.5}


CASES = [
    Case("mlp", MLP, _float(8, 32), depth=2),
    Case("resnet", ResNet, _float(2, 3, 8, 8), depth=2),
    Case("unet", UNet, _float(2, 1, 8, 8), depth=2),
    Case("kwargs_dict", KwargsDict, _kwargs_inputs, depth=1),
    Case("gpt2", gpt2, _ids, depth=3),
    Case("bert", bert, _ids, depth=3),
]
