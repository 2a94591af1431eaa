"""The kernels behind every allowlisted function hold their own checks against forged arguments.

``tests/export/fuzz_ops.py`` calls each function of the export allowlist with 96 lists of hostile
arguments in a child process; a call that kills the process (a crash, or 10 s without returning)
is recorded and the child restarted past it. None may: an export's graph can call these with any
arguments its file gives.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _run_all(progress: Path) -> tuple[list[str], int]:
    """(the calls that killed the child, how many functions ran)."""
    sys.path.insert(0, str(HERE))
    import fuzz_ops

    names = [name for name, _ in fuzz_ops.functions()]
    deaths: list[str] = []
    start = 0
    while True:
        done = subprocess.run([sys.executable, str(HERE / "fuzz_ops.py"), str(progress),
                               str(start)], capture_output=True, text=True, timeout=900)
        lines = progress.read_text().split()
        if lines[-2:-1] == ["done"]:
            return deaths, len(names)
        index, combo = int(lines[-2]), int(lines[-1])
        deaths.append(f"{names[index]} (combination {combo}, exit {done.returncode}: "
                      f"{done.stderr.strip()[-200:]})")
        start = index + 1


@pytest.mark.slow
def test_no_allowlisted_function_crashes_or_hangs_on_forged_arguments(tmp_path: Path) -> None:
    deaths, ran = _run_all(tmp_path / "progress")
    assert ran > 50  # the allowlist was read
    assert not deaths, "calls that killed the process:\n" + "\n".join(deaths)
