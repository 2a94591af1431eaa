#!/usr/bin/env bash
# The GPU check: the CUDA tier of the tests, then the GPU bench; everything into OUTDIR.
#
#   scripts/gpu_check.sh OUTDIR                   on a GPU machine (CUDA tier + bench --quick)
#   scripts/gpu_check.sh OUTDIR --device cpu      here, to check the script end to end
#
# Runs on whatever Python is given as $PYTHON (default: python3), with no installs, taking
# fxckpt from this checkout (PYTHONPATH=.): the GPU machine's image has torch, transformers and
# pytest already. Budget: about 8 minutes on one H100. The last line is a one-line summary.
set -uo pipefail
out=${1:?usage: scripts/gpu_check.sh OUTDIR [--device cuda|cpu] [--full]}
shift
device=cuda
size=--quick
while [ $# -gt 0 ]; do
  case "$1" in
    --device) device=$2; shift 2 ;;
    --full) size=""; shift ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")/.."
mkdir -p "$out"
python=${PYTHON:-python3}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
start=$(date +%s)

"$python" - > "$out/environment.txt" 2>&1 <<'PY'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"cuda:{i}", p.name, f"{p.total_memory / 2**30:.1f} GiB")
PY

# 1. the CUDA tier (every test marked cuda; they skip without a GPU)
"$python" -m pytest -q -m cuda tests -p no:cacheprovider --junitxml="$out/cuda_tier.xml" \
  > "$out/cuda_tier.txt" 2>&1
tier_rc=$?
tier=$(tail -n 1 "$out/cuda_tier.txt")

# 2. the GPU bench (on the CPU: the bench's tiny sizes, without torch.compile, for speed)
methods=checkpoint_per_block,sac_ops,sac_megatron,compile
[ "$device" = cpu ] && methods=checkpoint_per_block,sac_ops,sac_megatron
"$python" -m benchmarks.gpu --out "$out" --device "$device" $size --methods "$methods" \
  > "$out/gpu_bench.txt" 2>&1
bench_rc=$?
bench=$(tail -n 1 "$out/gpu_bench.txt")

echo "gpu check ($device, $(( $(date +%s) - start )) s): CUDA tier: $tier; $bench" \
  | tee "$out/summary.txt"
{ [ $tier_rc -eq 0 ] || [ $tier_rc -eq 5 ]; } && [ $bench_rc -eq 0 ]  # 5: none collected
