#!/usr/bin/env bash
# A short subset of the tests on torch 2.11, the torch of the GPU machines fxckpt is checked on
# (scripts/gpu_check.sh), run here on the CPU: fxckpt uses a few torch internals (torch.fx's
# patcher, pre-dispatch modes, higher-order ops), and both versions must keep working.
# Creates .venv211 (torch 2.11 comes as a CUDA build from PyPI: about 4.6 GB, a minute).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv211
.venv211/bin/python -m pip install -q --upgrade pip
.venv211/bin/python -m pip install -q "torch==2.11.*" networkx pytest pytest-xdist numpy \
  "transformers>=4.45"
.venv211/bin/python -m pip install -q --no-deps -e .
.venv211/bin/python -c "import torch; print('torch', torch.__version__)"
.venv211/bin/python -m pytest -q -p no:cacheprovider -n auto -m "not frameworks" \
  tests/test_transform.py tests/test_fidelity.py tests/test_identity.py tests/test_errors.py \
  tests/capture/test_regions.py tests/capture/test_guards.py tests/capture/test_isolation.py \
  tests/cost/test_devices.py tests/capture/test_exporter.py tests/test_torch_nn.py tests/export/test_forged.py tests/runtime/test_segment.py \
  tests/runtime/test_clock.py tests/serve/test_refine.py \
  "tests/test_python_facts.py" -k "not test_python_facts or every1"
