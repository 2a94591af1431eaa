"""``python -m fxckpt``: the ``fxckpt`` command line, which lives in :mod:`fxckpt.cli`."""

from __future__ import annotations

from fxckpt.cli import build_parser, main

__all__ = ["main", "build_parser"]

if __name__ == "__main__":
    raise SystemExit(main())
