"""The GEMM shapes the performance model prices for given jobs, each timed on this device as a
fraction of its peak: a YAML fragment that conf/hardware/<gpu>.yaml takes as its
perfmodel.gemm_shapes, in place of the half-dim model for those shapes (rates.gemm_time).

    python experiments/bench_gemm.py --device cuda --out OUT       # every job's shapes, bf16 (estimated: under a minute on an H100)
    python experiments/bench_gemm.py --list                        # the shapes per job, nothing timed
    python experiments/bench_gemm.py --device cpu --dtype fp32 --shapes 64x32x48,32x32x32 --out OUT   # a smoke run

The shapes are what perfmodel.layer_time and ends_time ask rates.gemm_time for (one call per
[M,K] @ [K,N] that gemm_time looks up by shape: the batched attention GEMMs of the materialized
softmax are priced by the half-dim model alone): each block GEMM forward (M x N x K), input
gradient (M x K x N) and weight gradient (N x K x M), the row chunks of chunked TP overlap (M/k
rows), and the LM head. Jobs: Table 3's 175B steps (experiment=megascale_ablation), the 530B
model's Megatron-LM and MegaScale settings at 2,240 GPUs, Llama 3 70B at seq 8192 on TP8 (the job
of experiments/rehearse_paper.py, and the same under Megatron-LM's settings), and every published
run of experiments/data/published_runs.csv the code can express.

Each shape is timed in the three layouts a step runs a linear layer's GEMMs in (forward x @ W^T,
input gradient g @ W, weight gradient g^T @ x; the mean, as machine.gemm_shape_efficiency), each the
median of --reps CUDA-event timings after --warmup calls. The fraction is 2MNK / time / peak, the
peak being the device table's (machine.DEVICE_PEAK_TFLOPS) on a GPU and this CPU's measured best
matmul rate (machine.measured_cpu_peak) on a CPU, as MFU divides by them.
"""
from __future__ import annotations

import argparse
import datetime
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import machine  # noqa: E402
from clustermodel import cli  # noqa: E402
from clustermodel import perfmodel as pm  # noqa: E402

Shape = Tuple[int, int, int]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class _Asked(dict):
    """A gemm_shapes table that knows no shape and remembers every one it was asked for."""

    def __init__(self):
        super().__init__()
        self.asked = set()

    def __bool__(self):  # gemm_time looks a shape up only in a non-empty table
        return True

    def get(self, key, default=None):
        self.asked.add(key)
        return default


def priced_shapes(cfg, gpus: int) -> List[Shape]:
    """The (M, N, K) that perfmodel asks gemm_time for, one count at a time, for a layer and the
    head of cfg on `gpus` GPUs: the job's rates with a table that records the shapes asked."""
    hw = pm.resolve_hardware(cfg.hardware)
    cfg = pm.resolve_config(cfg, hw)
    lay = pm.layout_of(cfg, gpus)
    r, net = pm.Rates.of(hw, pm.precision(cfg), lay.gpus), pm.Network(hw, lay)
    r.gemm_shapes = _Asked()
    for layer_cfg, _ in pm.layer_mix(cfg, lay):
        pm.layer_time(layer_cfg, lay, r, net)
    pm.ends_time(cfg, lay, r, net)
    return sorted(parse_key(k) for k in r.gemm_shapes.asked)


def parse_key(key: str) -> Shape:
    M, N, K = (int(d) for d in key.split("x"))
    return M, N, K


def _table3():
    return [(f"Table 3 step {i}", cli.study_config([cli.ABLATION, f"ablation.step={i}"], "cluster"), None)
            for i in range(len(cli.ABLATION_LABELS))]


def _530b():
    return [(f"530B {s}", cli.with_batch(cfg, 2240, 2240, 1), 2240) for s, cfg in cli.settings_530b(2240).items()]


def _llama3_70b():
    """experiments/rehearse_paper.py's Llama 3 70B job (256 H100s, seq 8192, TP8 with TP overlap in 4
    pieces), and the same layout under Megatron-LM's settings (whole GEMMs)."""
    from experiments.rehearse_paper import LLAMA_70B
    megatron = LLAMA_70B + cli.MEGATRON + ["parallel.overlap.tp=off", "parallel.overlap.pp=false",
                                           "parallel.overlap.dp=false"]
    return [(f"Llama 3 70B {s}", cli.compose(o), 256) for s, o in (("MegaScale", LLAMA_70B), ("Megatron-LM", megatron))]


def _published():
    from experiments import validate_published as vp
    out = []
    for row in vp.read_rows():
        try:
            cfg, gpus = vp.row_config(row)
        except vp.NotExpressible:
            continue
        out.append((f"{row['source']} {row['run']}", cfg, gpus))
    return out


JOBS: Dict[str, Callable] = {"table3": _table3, "530b": _530b, "llama3_70b": _llama3_70b, "published": _published}


def job_shapes(names: List[str]) -> Dict[str, List[Shape]]:
    """{job: its distinct shapes}, a job being every config one of JOBS lists."""
    out = {}
    for name in names:
        shapes = set()
        for _, cfg, gpus in JOBS[name]():
            shapes.update(priced_shapes(cfg, gpus))
        out[name] = sorted(shapes)
    return out


def _timed(fn, device: torch.device, reps: int, warmup: int) -> float:
    """Median seconds of fn over reps calls, after warmup calls: CUDA events on a GPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def shape_seconds(shape: Shape, dtype: torch.dtype, device: torch.device, reps: int, warmup: int) -> float:
    """[M,K] @ [K,N] in its three layouts (x @ W^T, g @ W, g^T @ x), the mean of their medians."""
    M, N, K = shape
    x, w = torch.randn(M, K, dtype=dtype, device=device), torch.randn(N, K, dtype=dtype, device=device)
    wt, xt = w.t().contiguous(), x.t().contiguous()
    layouts = (lambda: F.linear(x, w), lambda: x @ wt, lambda: xt.t() @ wt)
    return statistics.mean(_timed(fn, device, reps, warmup) for fn in layouts)


def device_peak(device: torch.device, dtype: torch.dtype) -> Tuple[float, str]:
    """(peak TFLOP/s, the device's name): the device table's on a GPU, the measured best on a CPU."""
    if device.type == "cuda":
        return machine.peak_tflops(device, dtype)[0], torch.cuda.get_device_name(device)
    return machine.measured_cpu_peak(dtype, reuse=True), f"cpu: {machine.cpu_model()}"


def fragment(efficiency: Dict[str, float], name: str, peak: float, dtype: str, when: str, command: str) -> str:
    """The YAML fragment: what was measured, where and how (comments, and the device's name), and
    perfmodel.gemm_shapes, which a conf/hardware file takes as it is."""
    lines = [f"# GEMM shapes measured {when} on {name}, {dtype}, torch {torch.__version__}",
             f"# `{command}`: each the mean of three layouts' median times, as a fraction of {peak:g} TFLOP/s",
             f"device_name: {name!r}",  # not a hardware key: conf/hardware takes the perfmodel group
             "perfmodel:", "  gemm_shapes:"]
    lines += [f"    {key}: {value:.4g}" for key, value in efficiency.items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    p.add_argument("--jobs", default=",".join(JOBS), help=f"comma-separated, of {', '.join(JOBS)}")
    p.add_argument("--shapes", default="", help="MxNxK,... to time instead of the jobs' shapes")
    p.add_argument("--list", action="store_true", help="print each job's shapes and stop")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", type=Path, help="folder the fragment goes to")
    args = p.parse_args(argv)

    if args.shapes:
        per_job = {"given": [parse_key(s) for s in args.shapes.split(",")]}
    else:
        per_job = job_shapes(args.jobs.split(","))
    shapes = sorted({s for job in per_job.values() for s in job})
    for job, js in per_job.items():
        print(f"{job}: {len(js)} shapes" + (": " + " ".join(pm.gemm_key(*s) for s in js) if args.list else ""))
    print(f"{len(shapes)} distinct shapes")
    if args.list:
        return 0

    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    torch.manual_seed(0)
    peak, name = device_peak(device, dtype)
    efficiency = {}
    start = time.perf_counter()
    for shape in shapes:
        seconds = shape_seconds(shape, dtype, device, args.reps, args.warmup)
        efficiency[pm.gemm_key(*shape)] = 2 * shape[0] * shape[1] * shape[2] / seconds / (peak * 1e12)
        print(f"{pm.gemm_key(*shape):>20}  {seconds * 1e3:9.3f} ms  {efficiency[pm.gemm_key(*shape)]:.3f} of peak")
    print(f"{name}: {len(shapes)} shapes in {time.perf_counter() - start:.0f} s, peak {peak:g} TFLOP/s")
    if args.out:
        when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        args.out.mkdir(parents=True, exist_ok=True)
        slug = re.sub(r"[^A-Za-z0-9]+", "_", machine.gpu_key(name) or name).strip("_")
        path = args.out / f"gemm_shapes_{slug}_{when[:10]}.yaml"
        command = "python experiments/bench_gemm.py " + " ".join(argv if argv is not None else sys.argv[1:])
        path.write_text(fragment(efficiency, name, peak, args.dtype, when, command))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
