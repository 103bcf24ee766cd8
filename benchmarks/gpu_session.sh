#!/usr/bin/env bash
# What a session with a GPU runs (issue 15), in parts that each fit the device tool's 10-minute call
# (four calls, about 25 minutes of device time with the machine's start):
#
#   bash benchmarks/gpu_session.sh mfu       # benchmark 7: MFU, cuDNN attention, top 5 ops of a profile
#   bash benchmarks/gpu_session.sh vjps      # benchmark 13 on the GPU: custom VJPs vs plain autodiff
#   bash benchmarks/gpu_session.sh attention # benchmark 14: cuDNN attention vs XLA in the model
#   bash benchmarks/gpu_session.sh plan      # benchmark 14: the plan's peak vs the GPU's compile
#   bash benchmarks/gpu_session.sh aot       # benchmark 23: the deviceless --target h100-1 vs this H100
#   bash benchmarks/gpu_session.sh decisions # benchmark 24: the step's choices timed (medium, 1b)
#
# It runs shardax from this checkout (PYTHONPATH=src) with the machine's own JAX, flax and optax,
# and copies each result to $OUT when that is set (the device tool brings $OUT's files back).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PYTHON=${PYTHON:-python3}
"$PYTHON" -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
case "${1:-}" in
  mfu) "$PYTHON" benchmarks/mfu.py; result=mfu.json ;;
  aot) "$PYTHON" benchmarks/h100_aot.py; result=h100_aot.json ;;
  decisions) "$PYTHON" benchmarks/gpu_decisions.py; result=gpu_decisions.json ;;
  vjps) "$PYTHON" benchmarks/layer_vjps.py --steps 30; result=layer_vjps_gpu.json ;;
  attention|plan) "$PYTHON" benchmarks/gpu_checks.py --only "$1"; result=gpu_checks.json ;;
  *) echo "usage: bash benchmarks/gpu_session.sh mfu|aot|vjps|attention|plan|decisions" >&2; exit 2 ;;
esac
if [ -n "${OUT:-}" ]; then cp "benchmarks/results/$result" "$OUT/"; fi
