"""What this machine can do, measured once and cached.

- The peak FLOP/s that MFU divides by: a GPU's from its datasheet (DEVICE_PEAK_TFLOPS); a CPU has
  no datasheet peak that torch reaches, so its best measured matmul rate (measured_cpu_peak). The
  same measurement decides precision=auto on a CPU (resolve_precision).
- The microbenchmarks perfmodel's hardware=cpu_local is made of (local_measurements): matmul rates,
  DRAM bandwidth, the fixed cost of an op, attention, gloo bandwidth. The same, measured before and
  after a benchmark's run into its dir (calibrate_beside; `python machine.py beside DIR before`),
  so that `python -m clustermodel validate` prices the run on the machine as it was then.

Both caches live in $MEGAREPRO_CACHE (default ~/.cache/megarepro), keyed by what changes the
numbers: torch version, CPU model, thread count.
"""
from __future__ import annotations

import ctypes
import json
import logging
import os
import platform
import re
import statistics
import time
from pathlib import Path
from queue import Empty
from typing import Dict, Optional

import torch
import torch.nn.functional as F

from metrics import atomic_write

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    path = Path(os.environ.get("MEGAREPRO_CACHE") or Path.home() / ".cache" / "megarepro")
    path.mkdir(parents=True, exist_ok=True)
    return path


def cores() -> int:
    """The cores this process may run on (a container's or taskset's, not the host's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cpu_model() -> str:
    try:
        return next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def native_bf16() -> bool:
    """Whether this CPU computes bf16 in hardware (AVX512-BF16 or AMX); elsewhere torch emulates it,
    and a bf16 matmul runs far slower than an fp32 one."""
    try:
        flags = next(l.split(":", 1)[1].split() for l in open("/proc/cpuinfo") if l.startswith("flags"))
    except (OSError, StopIteration):
        return False
    return bool({"avx512_bf16", "amx_bf16"} & set(flags))


# glibc's mallopt parameters (<malloc.h>) and the largest mmap threshold it accepts on 64-bit.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_MAX = 32 << 20


def keep_freed_memory() -> str:
    """On a CPU, have glibc's malloc keep freed blocks for reuse instead of handing them back to the
    kernel. Returns what was done, for the log.

    By default glibc serves a block above its mmap threshold (128 KiB, rising on its own to at most
    32 MiB) with a fresh mapping that free() unmaps, and trims the top of its heap. A training step
    frees and allocates the same activation sizes every step, so the kernel faults in and zeroes
    their pages every step, thousands of minor faults a step; with the threshold at glibc's ceiling
    and trimming off there are none (experiments/bench_step.py --allocator; the figures are in
    experiments/results/bench_step.md). jemalloc or tcmalloc through LD_PRELOAD do the same
    (Intel's launcher for PyTorch preloads one); this needs nothing installed.
    Blocks above 32 MiB are still mapped afresh. The cost: the heap keeps its peak, which every
    step reaches again anyway."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return "allocator: the C library's defaults (not glibc)"
    if mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) and mallopt(M_TRIM_THRESHOLD, 2 ** 31 - 1):
        return "allocator: glibc's malloc keeps freed blocks up to 32 MiB for reuse"
    return "allocator: glibc's defaults (mallopt refused)"


# Dense bf16 peak TFLOP/s per device (vendor datasheets, no sparsity). Matched by substring of the
# CUDA device name, longest key first, so "H100" does not shadow "H100 PCIe".
DEVICE_PEAK_TFLOPS = {
    "A100": 312.0, "A800": 312.0, "H100 PCIe": 756.0, "H100": 989.0, "H800": 989.0, "H200": 989.0,
    "GH200": 989.0, "B200": 2250.0, "L40S": 362.0, "L4": 121.0, "A10G": 125.0, "A10": 125.0,
    "V100": 125.0, "MI300X": 1307.0, "MI250X": 383.0,
}
# Dense fp32 without TF32 (the same datasheets; the CDNA parts' fp32 matrix rate): what an fp32
# run's matmuls reach while torch leaves TF32 off, its default. With TF32 allowed they run on the
# tensor cores at half the bf16 rate.
DEVICE_PEAK_FP32_TFLOPS = {
    "A100": 19.5, "A800": 19.5, "H100 PCIe": 51.0, "H100": 67.0, "H800": 67.0, "H200": 67.0, "GH200": 67.0,
    "L40S": 91.6, "L4": 30.3, "A10": 31.2, "V100": 15.7, "MI300X": 163.4, "MI250X": 95.7,
}


def tf32_matmuls() -> bool:
    """Whether torch lets fp32 matmuls on CUDA run in TF32 (torch.backends.cuda.matmul.allow_tf32,
    which torch.set_float32_matmul_precision("high") also turns on)."""
    return bool(torch.backends.cuda.matmul.allow_tf32)


def gpu_key(device_name: str) -> Optional[str]:
    """The DEVICE_PEAK_TFLOPS key a CUDA device name matches ("NVIDIA H100 80GB HBM3" -> "H100"), or None."""
    return next((key for key in sorted(DEVICE_PEAK_TFLOPS, key=len, reverse=True) if key in device_name), None)


def other_gpu_problem(hardware, device_name: str) -> Optional[tuple]:
    """(why, fix) when the hardware config describes another GPU than the one this run is on, else
    None. Refused rather than warned about: its peak_tflops is what MFU divides by (scale=cluster
    pins a100_cluster, 312 TFLOP/s, so an H100 run would read 3.2x too high) and its spec numbers
    what perfmodel prices the run with, so every row the run writes would describe the wrong
    machine, and a warning among thousands of ranks' start-up lines is easily missed."""
    if not hardware.gpu or gpu_key(device_name) == hardware.gpu:
        return None
    here = gpu_key(device_name)
    configs = sorted(p.stem for p in (Path(__file__).resolve().parent / "conf" / "hardware").glob("*.yaml")
                     if here and re.search(rf"^gpu:\s*{re.escape(here)}\s*(#|$)", p.read_text(), re.M))
    fix = f"hardware={configs[0]} (the config of this GPU)" if configs else "a hardware config describing this GPU"
    return (f"hardware={hardware.name} describes {hardware.gpu} GPUs ({hardware.peak_tflops or 0:g} TFLOP/s peak) but this "
            f"run is on {device_name!r}" + (f" ({DEVICE_PEAK_TFLOPS[here]:g} TFLOP/s)" if here else ""),
            f"use {fix}, or hardware.gpu=null hardware.peak_tflops=null to take this GPU's peak from the device table")


def peak_tflops(device: torch.device, dtype: torch.dtype, override: Optional[float] = None,
                override_fp32: Optional[float] = None) -> tuple[float, str]:
    """Peak FLOP/s per device that MFU divides by, and where the number came from. The overrides
    are a hardware config's (checked against the device the run is on: other_gpu_problem):
    peak_tflops (on CUDA the bf16 peak, halved for fp32 on TF32), and for an fp32 run on CUDA
    without TF32, peak_tflops_fp32 before it."""
    plain_fp32 = device.type == "cuda" and dtype == torch.float32 and not tf32_matmuls()
    if plain_fp32 and override_fp32:
        return float(override_fp32), "config:fp32"
    tf32 = device.type == "cuda" and dtype == torch.float32 and not plain_fp32  # TF32 tensor cores: half the bf16 rate
    if override:
        return float(override) * (0.5 if tf32 else 1.0), "config" + (" tf32" if tf32 else "")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        key = gpu_key(name)
        if key and plain_fp32 and key in DEVICE_PEAK_FP32_TFLOPS:
            return DEVICE_PEAK_FP32_TFLOPS[key], f"table:{key} fp32"
        if key and not plain_fp32:
            return DEVICE_PEAK_TFLOPS[key] * (0.5 if tf32 else 1.0), f"table:{key}" + (" tf32" if tf32 else "")
        log.warning("no fp32 peak known for GPU %r: set hardware.peak_tflops for a meaningful MFU" if key else
                    "unknown GPU %r: set hardware.peak_tflops for a meaningful MFU", name)
        return float("nan"), "unknown"
    return measured_cpu_peak(dtype), "measured"


REUSED_AFTER = 3  # measurements of a dtype's peak before precision=auto reuses the best of them


def measured_cpu_peak(dtype: torch.dtype, max_size: int = 2048, reps: int = 5, reuse: bool = False) -> float:
    """A CPU has no datasheet peak that torch reaches, so MFU on CPU divides by the best matmul
    rate measured on this machine at this thread count. The size grows until one matmul takes
    ~50 ms, which bounds the cost (about a second a dtype) even where a dtype is emulated (bf16
    without AVX512-BF16/AMX runs ~1000x slower than fp32). Shared machines are noisy, and a peak
    measured under load would inflate MFU forever, so every run measures again and the cache keeps
    the best rate seen on this machine, and how many runs measured it. reuse: the cached best,
    unmeasured, once REUSED_AFTER runs have measured it (one measurement under load could be far
    off)."""
    key = f"{platform.node()}|{cpu_model()}|{torch.get_num_threads()}t|{dtype}|torch{torch.__version__}"
    path = cache_dir() / "cpu_peak.json"
    known = json.loads(path.read_text()) if path.exists() else {}
    samples = known.get("samples", {})
    if reuse and samples.get(key, 0) >= REUSED_AFTER:
        return known[key]
    size, best = 128, 0.0
    while True:
        a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
        a @ b  # warm-up
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t0)
        best = max(best, 2 * size**3 / min(times) / 1e12)
        if size >= max_size or min(times) > 0.05:
            break
        size *= 2
    known[key] = max(best, known.get(key, 0.0))
    known["samples"] = {**samples, key: samples.get(key, 0) + 1}
    atomic_write(path, json.dumps(known, indent=1))
    return known[key]


def bf16_gemm_slowdown() -> float:
    """How many times longer a bf16 matmul takes than an fp32 one here, at the best rates measured:
    below 1 with AVX512-BF16 or AMX, ~4 where AVX512 emulates bf16, ~1000 on AVX2 alone."""
    return measured_cpu_peak(torch.float32) / measured_cpu_peak(torch.bfloat16)


def resolve_precision(precision: str, device: torch.device) -> str:
    """precision=auto: bf16 on CUDA, and on a CPU only where bf16 matmuls are not slower than fp32
    (AVX512-BF16 or AMX). On an AVX2-only CPU bf16 is emulated and ~1000x slower, so fp32 it is.
    The rates are the cached best ones once a few runs have measured them (per machine, thread
    count and torch): which dtype is faster is the CPU's instruction set, and measuring both at
    every start-up cost ~2 s."""
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bf16"
    faster = measured_cpu_peak(torch.bfloat16, reuse=True) >= measured_cpu_peak(torch.float32, reuse=True)
    return "bf16" if faster else "fp32"


# --- hardware=cpu_local: perfmodel's description of this machine ---

LOCAL_MEASUREMENTS_VERSION = 5  # raised whenever what is measured, or how, changes: older caches are measured again


def local_measurements_key() -> Dict[str, object]:
    """What the cached measurements depend on; another key measures again."""
    return {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": cpu_model(),
            "version": LOCAL_MEASUREMENTS_VERSION}


def local_measurements(remeasure: bool = False) -> Dict[str, float]:
    """This machine's numbers for cpu_local, measured once (~20 s) and cached per torch version,
    CPU model and thread count, since they don't change between runs."""
    key = local_measurements_key()
    path = cache_dir() / "cpu_local.json"
    if path.exists() and not remeasure:
        cached = json.loads(path.read_text())
        if cached.get("key") == key:
            return cached["measured"]
    measured = measure_local_hardware()
    atomic_write(path, json.dumps({"key": key, "measured": measured}, indent=1))
    return measured


# --- Measured beside a run: this shared machine's speed drifts over hours (perfmodel_validation.md) ---

CALIBRATION = "calibration.json"  # in a run (or sweep) dir: measure_local_hardware before and after it


def calibrate_beside(run_dir: Path, when: str) -> None:
    """Adds this machine's measurements now (`when`: before or after) to run_dir's calibration, for
    `python -m clustermodel validate` to price the run on the machine as it was while the run ran."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / CALIBRATION
    known = json.loads(path.read_text()) if path.exists() else {}
    known[when] = measure_local_hardware()
    atomic_write(path, json.dumps({"key": local_measurements_key(), **known}, indent=1))


def calibration_beside(run_dir: Path) -> Optional[Dict[str, Dict[str, float]]]:
    """{before, after: measurements} around the run (its own dir's, else its sweep's), or None."""
    for folder in (run_dir, run_dir.parent):
        path = folder / CALIBRATION
        if path.exists():
            known = json.loads(path.read_text())
            return {w: known[w] for w in ("before", "after") if w in known} or None
    return None


def typical_time(fn, repeats: int = 5) -> float:
    """The median of a few runs after a warm-up. The runs a calibration prices are timed by their
    median step on this shared machine, neighbours and all, so their rates are medians too; the
    fastest of a few (timeit's rule) would price every run too fast."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2]


def measure_local_hardware() -> Dict[str, float]:
    """Microbenchmarks, none of them the model being predicted: matmul rates (a 2048^3 GEMM gives the
    peak of each dtype, as train.py's MFU uses; a K=64 one the size effect), a copy (DRAM bandwidth), a chain of
    tiny autograd ops (fixed cost per op), causal SDPA at a generic shape, gloo all-reduce.
    GEMMs go through F.linear, the oneDNN path nn.Linear and autocast take: on CPUs without native
    bf16 (AVX2 only), a bare bf16 `a @ b` falls back to a path ~10x slower."""
    keep_freed_memory()  # as train.py runs on a CPU: the memory-bound kernels' times without fresh pages

    def gemm_rate(M, N, K, dtype):
        a, w = torch.randn(M, K, dtype=dtype), torch.randn(N, K, dtype=dtype)
        return 2 * M * N * K / typical_time(lambda: F.linear(a, w))

    peaks = {dtype: gemm_rate(2048, 2048, 2048, dtype) for dtype in (torch.bfloat16, torch.float32)}
    # The shape effect and attention's rate differ by dtype (AMX or AVX512-BF16 run bf16 GEMMs on
    # other units than fp32's FMAs), so each is measured in each dtype a run takes: fp32, and bf16
    # where it is not slower (precision=auto's rule). Where bf16 is emulated, its shape profile
    # would say nothing of the fp32 GEMMs a run takes instead; bf16 then gets fp32's.
    dtypes = [torch.float32] + ([torch.bfloat16] if peaks[torch.bfloat16] >= peaks[torch.float32] else [])
    shape = {dtype: _shape_and_attention(gemm_rate, peaks[dtype], dtype) for dtype in dtypes}
    bf16 = shape.get(torch.bfloat16, shape[torch.float32])
    x = torch.empty(2 ** 26)
    y = torch.empty_like(x)
    bandwidth = 2 * x.numel() * 4 / typical_time(lambda: y.copy_(x))

    leaf = torch.ones(16, requires_grad=True)

    def chain():
        z = leaf
        for _ in range(200):
            z = z * 1.0001
        z.sum().backward()
    op_us = typical_time(chain) / 400 * 1e6  # 200 forward ops and their 200 backward nodes

    stream_efficiency = _elementwise_efficiency(bandwidth)
    gloo = measure_gloo_GBps()
    ranks = 2  # cpu_local's devices_per_host: the measured host is shared by its ranks
    return {"peak_tflops": peaks[torch.bfloat16] / 1e12, "peak_tflops_fp32": peaks[torch.float32] / 1e12,
            **bf16, **{key + "_fp32": value for key, value in shape[torch.float32].items()},
            "memory_GBps": bandwidth / 1e9, "memory_efficiency": stream_efficiency, "op_overhead_us": op_us,
            "intra_host_GBps": gloo, "inter_host_Gbps": gloo * 8 * ranks,
            "memory_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30 / ranks}


def _elementwise_efficiency(copy_Bps: float) -> float:
    """The fraction of the copy's bandwidth that a transformer step's memory-bound kernels reach:
    perfmodel prices them as bytes / (bandwidth * efficiency). It is fitted on the tiny
    model's forward and backward in one process (8 x 256 tokens). The bytes are
    what the rehearsal counts (ledgers.Segment: every tensor read and written by a kernel that is
    neither a GEMM nor attention). The seconds are those kernels' own time in torch.profiler. They
    reach well below the copy's bandwidth (experiments/results/perfmodel_validation.md): GeLU's erf
    and the loss's exp are compute, not bytes."""
    import kernels
    import model as gpt
    from clustermodel.ledgers import FlopLedger
    from torch.profiler import ProfilerActivity, profile
    torch.manual_seed(0)
    net = gpt.GPT(gpt.ModelConfig())
    tokens = torch.randint(0, net.cfg.vocab_size, (8, 257))

    def step():
        kernels.cross_entropy(net(tokens[:, :-1]), tokens[:, 1:]).backward()
        net.zero_grad()

    step()
    with FlopLedger() as ledger:
        step()
    nbytes = ledger.segment.take()["bytes"]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            step()
    seconds = _stream_kernel_seconds(prof) / 3
    return min(1.0, max(0.05, nbytes / copy_Bps / max(seconds, 1e-9)))


def _stream_kernel_seconds(prof) -> float:
    """Self time of the aten kernels that are neither GEMMs nor attention (views take ~none)."""
    gemms = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear", "aten::matmul")
    return sum(e.self_cpu_time_total for e in prof.key_averages() if e.key.startswith("aten::")
               and e.key not in gemms and "scaled_dot_product" not in e.key and "flash" not in e.key) / 1e6


def _shape_and_attention(gemm_rate, peak: float, dtype: torch.dtype) -> Dict[str, float]:
    """In one dtype: the GEMM dim that runs at half speed (from a K=64 GEMM against the 2048³ one),
    the efficiency that makes the 2048³ GEMM the peak under that shape model, and the fraction of
    the peak causal SDPA reaches forward and backward at a generic shape."""
    skinny = gemm_rate(2048, 2048, 64, dtype) / peak
    lo, hi = 0.01, 4096.0  # solve (64/(64+d)) / (2048/(2048+d)) = skinny for the half-speed dim d
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if 64 / (64 + mid) * (2048 + mid) / 2048 > skinny else (lo, mid)
    half = (lo + hi) / 2
    q, k, v = (torch.randn(8, 8, 512, 64, dtype=dtype, requires_grad=True) for _ in range(3))
    attn_s = typical_time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward(), 3)
    attn_flops = 3.5 * 4 * 8 * 8 * 512 * (512 + 1) / 2 * 64  # fwd + bwd, (T+1)/2 keys per causal query
    return {"gemm_half_dim": half, "gemm_efficiency": 1 / (2048 / (2048 + half)) ** 3,
            "flash_efficiency": attn_flops / attn_s / peak}


def gemm_shape_efficiency(shapes, dtype: torch.dtype, threads: int) -> Dict[str, float]:
    """{"MxNxK": FLOP rate of [M,K] @ [K,N] / that of the 2048^3 GEMM}, at `threads` threads in
    `dtype`, for perfmodel's gemm_time (hardware.perfmodel.gemm_shapes), in place of the half-dim
    model (fitted on one skinny GEMM at the machine's thread count, it misprices ranks of another
    thread count: experiments/results/perfmodel_validation.md). The shapes a rehearsal records are
    few, so each is measured once and cached per CPU, torch, dtype and thread count.
    A step runs a shape in one of three layouts (forward x @ W^T, input gradient g @ W, weight
    gradient g^T @ x) that the rehearsal does not tell apart: a shape's time is their mean. Each
    round times the shape right after the 2048^3 GEMM, and the table keeps the median ratio of
    5 rounds, so it holds while this shared machine's speed drifts (_shape_vs_peak)."""
    key = {"torch": torch.__version__, "cpu": cpu_model(), "dtype": str(dtype), "threads": threads,
           "method": 2}  # how the table is measured (_shape_vs_peak): a table of another method is measured again
    path = cache_dir() / "gemm_shapes.json"
    tables = json.loads(path.read_text()) if path.exists() else []
    table = next((t["efficiency"] for t in tables if t["key"] == key), None)
    if table is None:
        table = {}
        tables.append({"key": key, "efficiency": table})
    wanted = [(round(M), round(N), round(K)) for M, N, K in shapes]
    missing = sorted({s for s in wanted if f"{s[0]}x{s[1]}x{s[2]}" not in table})
    if missing:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            for M, N, K in missing:
                table[f"{M}x{N}x{K}"] = _shape_vs_peak(M, N, K, dtype)
        finally:
            torch.set_num_threads(before)
        atomic_write(path, json.dumps(tables, indent=1))
    return {f"{M}x{N}x{K}": table[f"{M}x{N}x{K}"] for M, N, K in wanted}


def _shape_vs_peak(M: int, N: int, K: int, dtype: torch.dtype, rounds: int = 5) -> float:
    """The median over `rounds` of (shape's rate / 2048^3 rate), each round timing both back to back:
    a ratio per round cancels this shared machine's drift in speed, which a ratio of two medians
    taken seconds apart would carry (a neighbour slowing one GEMM and not the other). A tiny shape
    runs in microseconds, so it is timed over enough calls to outweigh the timer and the Python call."""
    big = [torch.randn(2048, 2048, dtype=dtype) for _ in range(2)]
    x, w, xt = torch.randn(M, K, dtype=dtype), torch.randn(N, K, dtype=dtype), torch.randn(K, M, dtype=dtype)
    wt = w.t().contiguous()
    layouts = (lambda: F.linear(x, w), lambda: x @ wt, lambda: xt.t() @ wt)
    calls = [_calls_lasting(fn, 2e-3) for fn in layouts]
    F.linear(*big)
    ratios = []
    for _ in range(rounds):
        peak_s = _seconds_per_call(lambda: F.linear(*big), 1) / 2048 ** 3
        shape_s = sum(_seconds_per_call(fn, n) for fn, n in zip(layouts, calls)) / len(layouts) / (M * N * K)
        ratios.append(peak_s / shape_s)
    return statistics.median(ratios)


def _seconds_per_call(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def _calls_lasting(fn, seconds: float) -> int:
    """How many calls of fn (after a warm-up) take about `seconds`."""
    fn()
    return max(1, round(seconds / max(_seconds_per_call(fn, 3), 1e-7)))


def measure_gloo_GBps(nbytes: int = 2 ** 24) -> float:
    """All-reduce bus bandwidth between two local gloo processes of one thread each."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29000 + os.getpid() % 1000
    procs = [ctx.Process(target=_gloo_worker, args=(rank, port, nbytes, queue)) for rank in range(2)]
    for p in procs:
        p.start()
    seconds = None
    while seconds is None:  # a worker that dies (a busy port, a main module without a __main__ guard) ends the wait
        try:
            seconds = queue.get(timeout=1.0)
        except Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"measure_gloo_GBps: a gloo worker exited with code {dead[0]}")
    for p in procs:
        p.join()
    return nbytes / seconds / 1e9  # ring all-reduce on 2 ranks moves 2*(n-1)/n = 1 buffer per rank


def _gloo_worker(rank: int, port: int, nbytes: int, queue) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    buf = torch.ones(nbytes // 4)
    seconds = typical_time(lambda: dist.all_reduce(buf))
    if rank == 0:
        queue.put(seconds)
    dist.destroy_process_group()


def _comm_calibrations() -> list:
    """Every record experiments/calibrate_comm.py appended to <cache>/comm_calibration.jsonl, oldest first."""
    path = cache_dir() / "comm_calibration.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.strip()]


def link_calibration(rate_Gbps: float) -> Optional[Dict[str, object]]:
    """The newest run of experiments/calibrate_comm.py on this CPU over a link of this rate (tc's
    token bucket on the emulated cluster), or None: {kind: {latency_us, GBps, ...}} under "fits"."""
    found = None
    for record in _comm_calibrations():
        rate = record.get("rate_GBps")
        if rate and abs(rate * 8 - rate_Gbps) < 1e-9 * max(rate_Gbps, 1) and record.get("cpu") == cpu_model():
            found = record
    return found


def collective_host_s(world: int) -> Optional[float]:
    """What a small collective costs beside compute on this CPU with `world` ranks sharing it: the
    median over every `calibrate_comm.py --sharing` run here, at the most ranks it measured that
    do not exceed world (2, 4 or 8), or None if it never ran on this CPU. One run varies with the
    VM's scheduling (experiments/results/perfmodel_validation.md), so the median of them all is used."""
    by_ranks: Dict[int, list] = {}
    for record in _comm_calibrations():
        if "sharing" in record and record.get("cpu") == cpu_model():
            for ranks, seconds in record["sharing"].get("collective_beside_gemms_s", {}).items():
                by_ranks.setdefault(int(ranks), []).append(seconds)
    measured = [k for k in by_ranks if k <= world]
    return statistics.median(by_ranks[max(measured)]) if measured else None


def tensor_memory_gib(hw) -> Optional[float]:
    """The memory a rank's tensors (torch.cuda.max_memory_allocated) may reach on this hardware:
    memory_gib less memory_headroom_gib; None where the hardware names no memory."""
    return None if hw.memory_gib is None else hw.memory_gib - hw.memory_headroom_gib


def compiles(cfg) -> bool:
    """Whether the run torch.compiles its chunks: train.compile, else the default of
    train.compile_choice (compiled on CUDA, eager elsewhere), on the hardware's device."""
    if cfg.train.compile is not None:
        return bool(cfg.train.compile)
    if cfg.hardware.device == "auto":
        import torch
        return torch.cuda.is_available()
    return cfg.hardware.device == "cuda"


if __name__ == "__main__":
    # python machine.py beside DIR before|after: measure this machine into DIR/calibration.json,
    # around a sweep that cannot do it per run (make demo's multirun), for python -m clustermodel validate
    import sys
    if len(sys.argv) != 4 or sys.argv[1] != "beside" or sys.argv[3] not in ("before", "after"):
        sys.exit("usage: python machine.py beside DIR before|after")
    calibrate_beside(Path(sys.argv[2]), sys.argv[3])

