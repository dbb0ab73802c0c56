#!/usr/bin/env bash
# The GPU checks in one call, on a CUDA host whose python3 already has torch (a cluster node, a
# lent machine): the GPU paths against their oracles (tests/test_cuda.py), then, given a nanoGPT
# checkout, the train step against it on the GPU (experiments/bench_step.py --device cuda); and the
# caching allocator's fragmentation: 20 steps of the unfused attention ([T, T] transients) by
# train.py, whose metrics.jsonl logs max_memory_reserved beside max_memory_allocated every step,
# once as is and once with expandable segments (conf/hardware's memory_headroom_gib assumes 5%).
#
#     bash experiments/gpu_check.sh OUT_DIR [NANOGPT_DIR]
#     PARTS=efficiency bash experiments/gpu_check.sh OUT_DIR NANOGPT_DIR     # the efficiency checks alone
#     PARTS=gemm bash experiments/gpu_check.sh OUT_DIR                       # the GEMM shape sweep alone
#
#     PARTS=zero3 bash experiments/gpu_check.sh OUT_DIR                      # ZeRO-3 against stage 1 on CUDA
#
# PARTS (default "tests bench sync memory") picks what runs: tests, tests/test_cuda.py; bench,
# bench_step at its default shape; sync, the host-sync check; memory, the fragmentation runs;
# llama, Llama's block (llama_tiny, a layer of Llama 3 8B) beside GPT's, compiled, bf16;
# efficiency, the per-GPU efficiency checks (~6 min on an H100 without the CUDA graphs' checks,
# which add at most 5 min, their time limits): one transformer layer forward and backward at GPT-3
# 175B's TP8 slice (experiments/bench_layer.py) against the GPU's peak and perfmodel's per-layer
# compute time, bench_step against nanoGPT at nanoGPT's GPT-2 124M configuration and at
# bench_step's default shape, bf16, eager and compiled, what the step dispatches (bench_step
# --count) and the LayerNorm-under-autocast test; then the step recorded as CUDA graphs
# (train.compile_mode=reduce-overhead): train.py's losses against the CPU run's and its resume
# (tests/test_cuda.py), bench_step's `ours+graphs` against the compiled step at the launch-bound
# shape, and what it dispatches; gemm, every GEMM shape perfmodel prices for Table 3, the 530B model,
# Llama 3 70B and the expressible published runs, timed in bf16 as a fraction of the GPU's peak
# (experiments/bench_gemm.py: 169 shapes, each in 3 layouts x 13 calls of at most a few ms, plus ~10 s
# pricing the jobs: estimated at under a minute on an H100, not yet run on one; GEMM_TIMEOUT, 180 s, bounds it):
# OUT_DIR/gemm_shapes_<gpu>_<date>.yaml, whose perfmodel group conf/hardware/<gpu>.yaml takes as it is.
#
# Each part runs under its own time limit (TEST_TIMEOUT, BENCH_TIMEOUT, MEMORY_TIMEOUT, GEMM_TIMEOUT seconds) so that a hang
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
parts=" ${PARTS:-tests bench sync memory} "
if [[ $parts == *" tests "* ]]; then
  timeout "${TEST_TIMEOUT:-600}" "$python" -m pytest tests/test_cuda.py -q -p no:cacheprovider --durations=8 2>&1 \
      | tee "$out/test_cuda.log"
fi
if [[ $parts == *" efficiency "* ]]; then
  # the headline figures first (the layer against the peak and the model, the GPT-2 124M and
  # default shapes against nanoGPT), then the counts and the CUDA graphs' checks
  timeout 90 "$python" experiments/bench_layer.py --device cuda 2>&1 | tee "$out/bench_layer.log"
  if [ -n "$nanogpt" ]; then
    timeout 150 "$python" experiments/bench_step.py --nanogpt "$nanogpt" --device cuda --shape gpt2 --dtype bf16 \
        --compile both --no-loop --rounds 2 --steps 5 --warmup 3 2>&1 | tee "$out/bench_step_gpt2.log"
    timeout 120 "$python" experiments/bench_step.py --nanogpt "$nanogpt" --device cuda --dtype bf16 --compile both \
        --variants graphs --no-loop --rounds 2 --steps 10 --warmup 3 2>&1 | tee "$out/bench_step_issue.log"
    timeout 60 "$python" experiments/bench_step.py --nanogpt "$nanogpt" --device cuda --count --dtype bf16 --compile eager \
        --steps 5 --warmup 2 2>&1 | tee "$out/bench_step_count.log"
  fi
  timeout 60 "$python" -m pytest tests/test_cuda.py -q -p no:cacheprovider -k layer_norm 2>&1 | tee "$out/test_layer_norm.log"
  timeout 150 "$python" -m pytest tests/test_cuda.py -q -p no:cacheprovider -k cudagraphs 2>&1 | tee "$out/test_cudagraphs.log"
  if [ -n "$nanogpt" ]; then
    timeout 90 "$python" experiments/bench_step.py --nanogpt "$nanogpt" --device cuda --shape launch --dtype bf16 \
        --compile compiled --variants graphs --no-loop --rounds 2 --steps 20 --warmup 3 2>&1 | tee "$out/bench_step_launch.log"
    timeout 60 "$python" experiments/bench_step.py --nanogpt "$nanogpt" --device cuda --shape launch --count --dtype bf16 \
        --compile compiled --variants graphs --steps 5 --warmup 3 2>&1 | tee "$out/bench_step_launch_count.log"
  fi
fi
if [ -n "$nanogpt" ] && [[ $parts == *" bench "* ]]; then
  timeout "${BENCH_TIMEOUT:-200}" "$python" experiments/bench_step.py --nanogpt "$nanogpt" --device cuda \
      ${BENCH_ARGS:---dtype bf16 --compile both --variants fused --rounds 2 --steps 20} 2>&1 | tee "$out/bench_step.log"
fi

# Host syncs: a few LAMB steps (with clipping, the loader's pinned batch and agree) under
# torch.cuda.set_sync_debug_mode("error"), which raises at any copy or read that waits for the GPU.
if [[ $parts == *" sync "* ]]; then
  timeout "${SYNC_TIMEOUT:-120}" "$python" experiments/host_sync_check.py --device cuda 2>&1 | tee "$out/host_sync_check.log"
fi

# Llama's block beside GPT's (PARTS=llama, ~3 min on an H100): a few compiled bf16 steps of
# llama_tiny and of tiny, then one layer of Llama 3 8B (GQA 32/8, SwiGLU 14336, RMSNorm) and one
# GPT layer of the same width (LayerNorm, GeLU 4h, MHA), both at seq 4096; each run's median step
# time from its metrics.jsonl, in llama.txt.
if [[ $parts == *" llama "* ]]; then
  ckpt=$(mktemp -d)
  steps=(train.max_steps=20 train.eval_interval=0 train.compile=true precision=bf16 logging.wandb.mode=disabled
         checkpoint.interval=0 "checkpoint.dir=$ckpt")
  layer=(model.n_layers=1 data.tokenizer=bytes model.vocab_size=32768 train.seq_len=4096 train.batch_size=2)
  for run in "llama_tiny model=llama_tiny" "gpt_tiny model=tiny" \
             "llama3_8B_layer model=llama3_8B ${layer[*]}" \
             "gpt_8B_width_layer model=llama3_8B ${layer[*]} model.norm=layernorm model.mlp=gelu model.n_kv_heads=null model.ffn_hidden_size=null model.bias=true"; do
    name=${run%% *}
    timeout "${LLAMA_TIMEOUT:-240}" "$python" train.py ${run#* } "${steps[@]}" "hydra.run.dir=$out/$name" \
        > "$out/$name.log" 2>&1 || echo "llama check $name failed: see $out/$name.log"
  done
  rm -rf "$ckpt"
  "$python" - "$out" <<'PY' 2>&1 | tee "$out/llama.txt"
import json, pathlib, statistics, sys
out = pathlib.Path(sys.argv[1])
for name in ("llama_tiny", "gpt_tiny", "llama3_8B_layer", "gpt_8B_width_layer"):
    path = out / name / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    times = [r["step_time"] for r in rows[5:]]  # past compilation
    print(f"{name}: " + (f"median step {1e3 * statistics.median(times):.1f} ms over {len(times)} steps, "
                         f"MFU {statistics.median(r.get('mfu', 0) for r in rows[5:]):.3f}" if times else "no steps"))
PY
fi
# GEMM shapes (PARTS=gemm): the fragment conf/hardware takes, and the log with each shape's time.
if [[ $parts == *" gemm "* ]]; then
  timeout "${GEMM_TIMEOUT:-180}" "$python" experiments/bench_gemm.py --device cuda --dtype bf16 --out "$out" 2>&1 \
      | tee "$out/bench_gemm.log"
fi
# ZeRO-3 on CUDA (PARTS=zero3, ~1 min): 10 bf16 eager steps of a 12-layer GPT-3-Small-wide model at stages 1 and
# 3 on the one GPU (dp=1: NCCL refuses two ranks on one device, so nothing is sharded; what stage 3 changes
# there is that each module's bf16 parameters exist only while it computes, its storage freed and
# gathered again through resize_storage_bytes_). zero3.txt: the losses, equal step by step, and the
# peak allocated memory of each (stage 3 below stage 1 by about the bf16 weights, less the live modules').
if [[ $parts == *" zero3 "* ]]; then
  ckpt=$(mktemp -d)
  for stage in 1 3; do
    timeout "${ZERO3_TIMEOUT:-120}" "$python" train.py model=small train.seq_len=1024 train.batch_size=4 \
        train.max_steps=10 train.eval_interval=0 train.compile=false precision=bf16 parallel.zero_stage=$stage \
        logging.wandb.mode=disabled checkpoint.interval=0 "checkpoint.dir=$ckpt/$stage" "hydra.run.dir=$out/zero$stage" \
        > "$out/zero$stage.log" 2>&1 || echo "zero3 check (stage $stage) failed: see $out/zero$stage.log"
  done
  rm -rf "$ckpt"
  "$python" - "$out" <<'PY' 2>&1 | tee "$out/zero3.txt"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
runs = {}
for stage in (1, 3):
    path = out / f"zero{stage}" / "metrics.jsonl"
    runs[stage] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    rows = runs[stage]
    print(f"stage {stage}: {len(rows)} steps, peak allocated {max((r['memory_gib'] for r in rows), default=float('nan')):.3f} GiB")
pairs = list(zip(runs[1], runs[3]))
print(f"losses equal on {sum(a['loss'] == b['loss'] for a, b in pairs)} of {len(pairs)} steps; largest difference "
      f"{max((abs(a['loss'] - b['loss']) for a, b in pairs), default=float('nan')):.3g}")
PY
fi
[[ $parts == *" memory "* ]] || exit 0

# Fragmentation: GPT-3 Small at seq 2048 with the materialized softmax, bf16, eager (what is
# allocated is then what the ledger counts), 20 steps; memory.json has, per setting, the total CUDA
# shows (mem_get_info) and, per step, allocated and reserved GiB and their ratio.
ckpt=$(mktemp -d)  # the run's final save (2 GB) stays out of OUT_DIR
for alloc in default expandable_segments:True; do
  run="$out/memory_${alloc%%:*}"
  if [ "$alloc" = default ]; then with=(env -u PYTORCH_CUDA_ALLOC_CONF); else with=(env "PYTORCH_CUDA_ALLOC_CONF=$alloc"); fi
  "${with[@]}" timeout "${MEMORY_TIMEOUT:-240}" "$python" train.py model=small train.seq_len=2048 \
      train.batch_size=4 train.max_steps=20 train.eval_interval=0 train.compile=false precision=bf16 \
      kernels.attention=unfused kernels.fused=false "checkpoint.dir=$ckpt/${alloc%%:*}" \
      logging.wandb.mode=disabled "hydra.run.dir=$run" > "$run.log" 2>&1 || echo "memory check ($alloc) failed: see $run.log"
done
rm -rf "$ckpt"
"$python" - "$out" <<'PY' 2>&1 | tee "$out/memory.txt"
import json, sys, pathlib, torch
out = pathlib.Path(sys.argv[1])
free, total = torch.cuda.mem_get_info()
report = {"mem_get_info_total_gib": total / 2**30, "name": torch.cuda.get_device_name()}
for setting in ("default", "expandable_segments"):
    path = out / f"memory_{setting}" / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    steps = [{"step": r["step"], "allocated_gib": r["memory_gib"], "reserved_gib": r.get("memory_reserved_gib"),
              "reserved_over_allocated": r.get("memory_reserved_gib", 0) / r["memory_gib"]} for r in rows]
    report[setting] = steps
    if steps:
        last = steps[-1]
        print(f"{setting}: after {last['step']} steps allocated {last['allocated_gib']:.2f} GiB, reserved "
              f"{last['reserved_gib']:.2f} GiB ({100 * (last['reserved_over_allocated'] - 1):.1f}% fragmentation)")
print(f"CUDA shows {report['mem_get_info_total_gib']:.2f} GiB on {report['name']}")
(out / "memory.json").write_text(json.dumps(report, indent=1))
PY
