#!/usr/bin/env bash
# The GPU checks in one call, on a CUDA host whose python3 already has torch (a cluster node, a
# lent machine): the GPU paths against their oracles (tests/test_cuda.py), then, given a nanoGPT
# checkout, the train step against it on the GPU (experiments/bench_step.py --device cuda).
#
#     bash experiments/gpu_check.sh OUT_DIR [NANOGPT_DIR]
#
# Each part runs under its own time limit (TEST_TIMEOUT, BENCH_TIMEOUT seconds) so that a hang
# still leaves the other's log; the logs and the versions seen go to OUT_DIR. On an H100 (16 cores)
# the tests took ~6.5 min, most of it train.py's five runs and their resumes (compiling).
set -uo pipefail
out=${1:?usage: gpu_check.sh OUT_DIR [NANOGPT_DIR]}
nanogpt=${2:-}
python=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  "$python" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  git rev-parse --short HEAD 2>/dev/null; } 2>&1 | tee "$out/versions.txt"
timeout "${TEST_TIMEOUT:-600}" "$python" -m pytest tests/test_cuda.py -q -p no:cacheprovider --durations=8 2>&1 \
    | tee "$out/test_cuda.log"
if [ -n "$nanogpt" ]; then
  timeout "${BENCH_TIMEOUT:-200}" "$python" experiments/bench_step.py --nanogpt "$nanogpt" --device cuda \
      ${BENCH_ARGS:---dtype bf16 --compile both --variants fused --rounds 2 --steps 20} 2>&1 | tee "$out/bench_step.log"
fi

# Host syncs: a few LAMB steps (with clipping, the loader's pinned batch and agree) under
# torch.cuda.set_sync_debug_mode("error"), which raises at any copy or read that waits for the GPU.
timeout "${SYNC_TIMEOUT:-120}" "$python" experiments/host_sync_check.py --device cuda 2>&1 | tee "$out/host_sync_check.log"
