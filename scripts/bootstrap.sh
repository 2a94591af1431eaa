#!/usr/bin/env bash
# Create .venv and install fxckpt with its test dependencies. Safe to run again.
# torch is installed first and pinned, so pip does not pull a multi-GB CUDA build by accident;
# set FXCKPT_TORCH to choose another torch requirement.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "${FXCKPT_TORCH:-torch==2.13.0}"
.venv/bin/python -m pip install -q -e ".[dev]"
