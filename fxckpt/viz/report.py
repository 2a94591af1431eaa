"""A plan report on disk: the table, the JSON, the code, the pictures and one HTML page.

    out/
      index.html      summary, plan table, stages and schedule, pictures, rewritten code
      plan.txt        str(plan)            plan.json    plan.to_dict()
      code.py         the rewritten forward
      graph.png  memory.png  pareto.png  schedule.png (staged plans)

Pictures need the ``viz`` extra; without matplotlib the report is written without them and says
so. Each picture is a separate step under a progress bar (tqdm, when installed and stderr is a
terminal), because on big graphs a Pareto sweep or a measured step takes a while.
"""

from __future__ import annotations

import html
import json
import logging
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

__all__ = ["write_report", "Progress"]

log = logging.getLogger(__name__)


class Progress:
    """A tqdm bar over named steps, or nothing when tqdm is missing or stderr is not a terminal."""

    def __init__(self, total: int, desc: str) -> None:
        self.bar: Any = None
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self.bar = tqdm(total=total, desc=desc, file=sys.stderr, leave=False, disable=None)

    def step(self, what: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(what)
            self.bar.update(1)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.close()


def write_report(tm: Any, model: torch.nn.Module, inputs: Sequence[Any], out_dir: Any, *,
                 pareto: bool = True) -> Path:
    """Write the report of ``tm``'s latest plan (made for ``inputs``) to ``out_dir``; returns
    index.html."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plan = _inspect(tm).plan
    (out / "plan.txt").write_text(str(plan) + "\n")
    (out / "plan.json").write_text(json.dumps(plan.to_dict(), indent=2))
    (out / "code.py").write_text(_inspect(tm).code)
    pictures, skipped = _pictures(tm, model, tuple(inputs), out, pareto)
    index = out / "index.html"
    index.write_text(_html(tm, pictures, skipped))
    return index


def _pictures(
    tm: Any, model: torch.nn.Module, inputs: tuple, out: Path, pareto: bool
) -> tuple[list[str], str]:
    try:
        from fxckpt.viz.common import require_matplotlib

        require_matplotlib()
    except ImportError as e:
        log.warning("%s; the report has no pictures", e)
        return [], str(e)
    from fxckpt.viz import plot_memory, plot_pareto, plot_schedule, show

    plan = _inspect(tm).plan
    # A pipelined step has no single-graph timeline.
    measure = plan.training and plan.pipeline is None
    jobs: list[tuple[str, Callable[[Path], Any]]] = [
        ("graph.png", lambda p: show(tm, p)),
        ("memory.png", lambda p: plot_memory(tm, p, inputs=inputs if measure else None)),
    ]
    if pareto and plan.pipeline is None:
        jobs.append(
            ("pareto.png", lambda p: plot_pareto(model, inputs, mark={"this plan": tm}, path=p))
        )
    if plan.pipeline is not None:
        jobs.append(("schedule.png", lambda p: plot_schedule(tm, p)))
    done = []
    with Progress(total=len(jobs), desc="pictures") as progress:
        for name, draw in jobs:
            draw(out / name)
            done.append(name)
            progress.step(name)
    return done, ""


def _html(tm: Any, pictures: list[str], skipped: str) -> str:
    plan = _inspect(tm).plan
    images = "".join(
        f'<figure><img src="{name}" alt="{name}"><figcaption>{name}</figcaption></figure>'
        for name in pictures
    )
    note = f"<p><i>Pictures skipped: {html.escape(skipped)}</i></p>" if skipped else ""
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>fxckpt plan report</title>
<style>body{{font-family:sans-serif;max-width:1200px;margin:2em auto}} \
table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:2px 6px;font-size:13px}} img{{max-width:100%}} \
pre{{background:#f6f6f6;
padding:8px;overflow-x:auto;font-size:12px}}</style></head>
<body><h1>fxckpt plan report</h1>
<p>Inputs: <code>{html.escape(plan.signature)}</code>. Files: <a href="plan.json">plan.json</a>,
<a href="plan.txt">plan.txt</a>, <a href="code.py">code.py</a>.</p>
{plan._repr_html_()}
<h2>Pictures</h2>{note}{images}
<h2>Rewritten forward</h2><pre>{html.escape(_inspect(tm).code)}</pre>
</body></html>
"""


def _inspect(tm: Any) -> Any:
    from fxckpt.viz.inspection import inspect

    return inspect(tm)

