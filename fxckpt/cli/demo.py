"""``python -m fxckpt demo``: what checkpointing buys on a small GPT, measured, not predicted.

The demo trains one step of a GPT-style model (plain torch: token and position embeddings,
pre-LayerNorm blocks of causal self-attention and a GELU MLP, dropout) under each strategy and
reports, against the unmodified model measured in the same run:

* the plan fxckpt chose (one summary line per strategy) and the peak it promises;
* a memory budget (``budget=0.5``: half the unmodified model's peak), the headline feature: the
  solver picks the segments with the least recompute whose peak fits, and the table shows the
  plan's peak next to the measured one;
* peak activation memory of a forward+backward step by the RSS protocol of
  :mod:`fxckpt.measure` (fresh subprocess per configuration, median of several steps), next to
  the live-tensor tracker's count as a cross-check;
* the median step time. Absolute times on a shared machine are noise; the ratios are the point.

    parent ──run_in_subprocess──▶ child: build model, transform, measure ──JSON──▶ table

The children measure with the benchmark's helpers (:func:`fxckpt.measure.step_memory`,
:func:`fxckpt.measure.time_by_turns`); only the model and its strategies are the demo's own.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import statistics
import sys
from typing import TYPE_CHECKING, Any, Callable, Optional, TextIO

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from fxckpt.plan import Plan

__all__ = [
    "GPTConfig", "GPT", "STRATEGIES", "QUICK", "FULL",
    "measure_memory", "measure_times", "run_demo", "format_table", "budget_lines",
]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Size of the demo model and of its batch."""

    layers: int = 8
    """Transformer blocks (``model.blocks.0`` .. ``model.blocks.{layers-1}``)."""
    width: int = 256
    """Embedding width; the MLP is four times wider."""
    heads: int = 4
    """Attention heads; must divide ``width``."""
    vocab: int = 1024
    """Vocabulary size (tokens are random: the data does not matter for memory or time)."""
    batch: int = 8
    """Sequences per step."""
    seq: int = 128
    """Tokens per sequence (also the longest sequence the model accepts)."""
    dropout: float = 0.1
    """Dropout probability after embeddings, attention weights and each residual branch."""


FULL = GPTConfig()
QUICK = GPTConfig(layers=4, width=128, heads=4, vocab=256, batch=4, seq=64)

STRATEGIES: dict[str, dict[str, Any]] = {
    "none": {},
    "every=2": {"every": 2},
    "depth=2": {"depth": 2},
    "budget=0.5": {"budget": 0.5},
}
"""Demo row name -> keyword arguments of :func:`fxckpt.transform` (``none``: the model itself)."""


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.width % cfg.heads:
            raise ValueError(f"heads must divide width (got width={cfg.width}, heads={cfg.heads})")
        self.heads, self.width = cfg.heads, cfg.width
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.size(0), x.size(1)
        qkv = (
            self.qkv(x).view(b, t, 3, self.heads, self.width // self.heads).permute(2, 0, 3, 1, 4)
        )
        q, k, v = qkv[0], qkv[1], qkv[2]
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.width // self.heads))
        pos = torch.arange(
            t, device=x.device
        )  # built per call: symbolic_trace cannot slice a buffer by t
        att = att.masked_fill(pos[None, :] > pos[:, None], float("-inf")).softmax(dim=-1)
        y = self.attn_drop(att) @ v
        y = y.transpose(1, 2).reshape(b, t, self.width)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.width)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.width)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.width, 4 * cfg.width), nn.GELU(),
            nn.Linear(4 * cfg.width, cfg.width), nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A small GPT: ``GPT(cfg)(tokens[batch, seq]) -> logits[batch, seq, vocab]``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.width)
        self.pos = nn.Embedding(cfg.seq, cfg.width)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _setup(
    config: dict[str, Any], threads: Optional[int]
) -> tuple[GPT, torch.Tensor, torch.Tensor]:
    if threads is not None:
        torch.set_num_threads(threads)
    cfg = GPTConfig(**config)
    torch.manual_seed(0)
    idx = torch.randint(cfg.vocab, (cfg.batch, cfg.seq))
    return GPT(cfg).train(), idx, torch.randint(cfg.vocab, (cfg.batch, cfg.seq))


def _step_for(
    strategy: str, model: GPT, idx: torch.Tensor, targets: torch.Tensor
) -> tuple[Callable[[], None], Plan]:
    """A training step (forward, loss, backward) under ``strategy``, and its plan (for ``none``
    the plan of no checkpointing, which gives the unmodified model's peak; the model runs)."""
    from fxckpt.api import transform
    from fxckpt.viz.inspection import inspect
    from fxckpt.measure import training_step

    # verify=True: every row's plan peak (and the baseline's) is the verified figure, the one a
    # fractional budget is resolved against.
    transformed = transform(model, **STRATEGIES[strategy], example_inputs=(idx,), verify=True)
    run: nn.Module = transformed if STRATEGIES[strategy] else model

    def loss(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    return training_step(run, (idx,), loss), inspect(transformed).plan


def measure_memory(strategy: str, config: dict[str, Any], repeats: int = 3) -> dict[str, Any]:
    """Peak activation memory of one step under ``strategy`` (run with the mmap threshold set).

    One thread: with every freed tensor an ``munmap``, two-thread steps ran several times slower
    here (TLB shoot-downs across cores, most likely); the tensors are the same either way.
    """
    from fxckpt.measure import step_memory

    step, plan = _step_for(strategy, *_setup(config, threads=1))
    summary = plan.summary() if STRATEGIES[strategy] else "unmodified model (baseline)"
    return {"strategy": strategy, "summary": summary, "plan_bytes": plan.peak_bytes,
            "budget_bytes": plan.budget_bytes, **step_memory(step, repeats)}


def measure_times(strategies: list[str], config: dict[str, Any], repeats: int = 3,
                  threads: Optional[int] = None) -> dict[str, float]:
    """Median step seconds per strategy, in one process, taking turns so load hits all alike."""
    from fxckpt.measure import time_by_turns

    model, idx, targets = _setup(config, threads)
    steps = {name: _step_for(name, model, idx, targets)[0] for name in strategies}
    return {name: statistics.median(s) for name, s in time_by_turns(steps, repeats).items()}


def run_demo(quick: bool = False, repeats: int = 3, threads: Optional[int] = 1, jobs: int = 1,
             out: Optional[TextIO] = None) -> list[dict[str, Any]]:
    """Measure every strategy and print plans and the table to ``out``; returns the rows.

    Memory is measured in one subprocess per strategy, ``jobs`` of them at once (each process's
    RSS is its own, so running them side by side changes no number); times in one more
    subprocess afterwards, alone, with the default allocator and ``threads`` torch threads
    (``None``: torch's choice). One thread is the default because on a shared machine a second
    process makes multi-threaded steps stall at every barrier, and the ratios become noise.
    """
    from fxckpt.measure import run_in_subprocess

    out = out or sys.stdout
    cfg = QUICK if quick else FULL
    print(f"fxckpt demo: GPT with {cfg.layers} layers, width {cfg.width}, batch {cfg.batch} x "
          f"{cfg.seq} tokens; medians of {repeats} steps", file=out, flush=True)
    common = {"config": dataclasses.asdict(cfg), "repeats": repeats}
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        rows = list(pool.map(lambda name: run_in_subprocess(
            "fxckpt.cli.demo:measure_memory", {"strategy": name, **common}), STRATEGIES))
    for row in rows:
        print(f"  {row['strategy']:<10} {row['summary']}", file=out)
    times = run_in_subprocess(
        "fxckpt.cli.demo:measure_times",
        {"strategies": list(STRATEGIES), "threads": threads, **common},
        mmap_threshold=None,
    )
    for row in rows:
        row["seconds"] = times[row["strategy"]]
    print(file=out)
    print(format_table(rows), file=out)
    for line in budget_lines(rows):
        print(line, file=out)
    out.flush()
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """An aligned table of measured rows, each with its ratio to the first (baseline) row.

    A tracker count that could not be taken (``None``) shows as ``n/a``.
    """
    base = rows[0]
    header = ("strategy", "plan peak", "peak activation (RSS)", "vs none", "tracked tensors",
              "vs none", "step time", "vs none")
    table = [header] + [
        (r["strategy"], _bytes(r.get("plan_bytes")), _bytes(r["rss_bytes"]),
         _ratio(r["rss_bytes"], base["rss_bytes"]),
         _bytes(r["tracked_bytes"]), _ratio(r["tracked_bytes"], base["tracked_bytes"]),
         f"{r['seconds'] * 1000:.0f} ms", _ratio(r["seconds"], base["seconds"]))
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(row, widths)))
             for row in table]
    return "\n".join(lines)


def budget_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Under the table, one line per budgeted row: the budget, the plan's peak and the measured
    peak, and whether the measured peak kept to the budget."""
    base = rows[0]
    lines = []
    for r in rows[1:]:
        budget = r.get("budget_bytes")
        if budget is None:
            continue
        kept = "within" if r["rss_bytes"] <= budget else "OVER"
        lines.append(
            f"{r['strategy']}: budget {_bytes(budget)} "
            f"({_ratio(budget, base.get('plan_bytes'))} the unmodified plan peak), plan peak "
            f"{_bytes(r['plan_bytes'])}, measured peak {_bytes(r['rss_bytes'])}: {kept} "
            "the budget")
    return lines


def _ratio(value: Optional[float], baseline: Optional[float]) -> str:
    if value is None or baseline is None or baseline <= 0:
        return "n/a"
    return f"{value / baseline:.2f}x"


def _bytes(n: Optional[int]) -> str:
    from fxckpt.plan import format_bytes

    return "n/a" if n is None else format_bytes(n)
