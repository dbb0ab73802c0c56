"""Kernel speed: fused vs eager operators, and banded sliding-window vs full causal attention.

    python experiments/bench_kernels.py                       # both parts, bf16
    python experiments/bench_kernels.py --only fused --shape 16,256,256
    python experiments/bench_kernels.py --only attention --seqs 2048,4096 --windows 512
    python experiments/bench_kernels.py --threads 1 --clock cpu   # on a shared machine, see below
    python experiments/bench_kernels.py --only fused --device cuda --fused true,triton

Every number is forward + backward, the median of --reps timed runs after --warmup untimed
ones (the first of which compiles, for the fused path; its time is reported separately). The
eager and fused runs of an op alternate, so that load from other processes falls on both.

(a) fused: each kernels.fused value of --fused (true: the op compiled on its own, as inside a
    compiled step, where fused=true fuses; triton: the Triton kernels, CUDA only) against the eager reference for the residual add + LayerNorm, bias +
    GeLU (on the MLP's 4h-wide activation) and the cross-entropy, each on its own, and "LN+GeLU",
    the two ops the MLP input goes through. A lone LayerNorm stays ATen's under fused=true (one
    kernel each way already); its row times torch.compile of it, the alternative not taken.
(b) attention: kernels.attention_banded against one causal SDPA call (which already skips the
    upper triangle), B=1, for every sequence length and window. "FLOP ratio" is the speed-up the
    work alone predicts, s / (2·(W + block)); "x2 s" is the time ratio to the previous, half as
    long sequence at the same window, from banded runs of that window at every length timed in
    turn (not from the table's banded column, timed beside causal SDPA): 2.0 is linear.

--clock cpu times with the process' CPU time instead of the wall clock. With --threads 1 it is
the time the work takes on one core, and other processes sharing the machine barely change it.

glibc returns every freed block of 32 MiB or more to the kernel, so each new activation of that
size is page-faulted in again, at about 3 ns per fp32 element on a VM: that, not the kernel,
dominates a memory-bound op on [8, 1024, 4096]. A GPU run never sees it (the CUDA caching
allocator recycles memory), so by default this script raises glibc's mmap threshold to keep
freed memory in the process (mallopt, as MALLOC_MMAP_THRESHOLD_ would); --malloc default
measures glibc's behaviour instead. Prints Markdown tables.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the flat repo root
import kernels  # noqa: E402
from model import rope_tables  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=("fused", "attention", "all"), default="all")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--fused", default="true", help="kernels.fused values to time against eager: true, triton or both")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    p.add_argument("--malloc", choices=("recycle", "default"), default="recycle",
                   help="recycle: keep freed memory in the process (see the docstring)")
    p.add_argument("--shape", default="8,1024,1024", help="B,T,h of the fused part's activations")
    p.add_argument("--vocab", type=int, default=32768, help="cross-entropy vocabulary")
    p.add_argument("--seqs", default="2048,4096,8192")
    p.add_argument("--windows", default="256,512,1024")
    p.add_argument("--block", type=int, default=kernels.DEFAULT_BLOCK)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    return p.parse_args(argv)


def keep_freed_memory() -> bool:
    """Ask glibc to serve big blocks from its heap and never trim it, like a caching allocator."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    return bool(libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 1 << 62))


def cuda_clock() -> float:
    """The wall clock once the GPU has finished: CUDA kernels run asynchronously."""
    torch.cuda.synchronize()
    return time.perf_counter()


def timed_together(fns, reps: int, warmup: int, clock) -> list:
    """(median seconds of the timed runs, seconds of the first call) for each of fns, their timed
    runs taken in turn (a, b, a, b, ...): a burst of load from another process then slows each
    alike, rather than all the runs of one of them."""
    firsts = []
    for fn in fns:
        start = clock()
        fn()
        firsts.append(clock() - start)
        for _ in range(warmup - 1):
            fn()
    times = [[] for _ in fns]
    for _ in range(reps):
        for fn, t in zip(fns, times):
            start = clock()
            fn()
            t.append(clock() - start)
    return [(statistics.median(t), first) for t, first in zip(times, firsts)]


def forward_backward(fn, inputs, compiled: bool = False):
    """A closure running fn(*inputs) and its backward, under a fixed random output gradient;
    compiled: fn through torch.compile, as a compiled step runs it."""
    grads = None
    fn = torch.compile(fn, dynamic=False) if compiled else fn

    def run():
        nonlocal grads
        outs = fn(*inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        if grads is None:
            grads = [torch.randn_like(o) for o in outs]
        torch.autograd.grad(outs, [t for t in inputs if t.requires_grad], grads)
    return run


def fused_ops(args, dtype):
    """name -> (fn(fused) -> closure), on the shapes of one transformer layer's activations."""
    B, T, h = (int(s) for s in args.shape.split(","))
    leaf = lambda *shape: torch.randn(*shape, dtype=dtype, device=args.device).requires_grad_()
    norm = nn.LayerNorm(h).to(args.device, dtype)
    x, delta, pre_gelu, bias = leaf(B, T, h), leaf(B, T, h), leaf(B, T, 4 * h), leaf(4 * h)
    rows = getattr(args, "logit_rows", None) or B * T // 8  # bench_step: every token's logits
    logits, targets = leaf(rows, args.vocab), torch.randint(0, args.vocab, (rows,), device=args.device)
    params = list(norm.parameters())

    def ln(fused):
        return forward_backward(lambda x, *_: kernels.layer_norm(x, norm, fused), [x, *params])

    def ln_compiled(fused):  # why fused=true keeps ATen's lone LayerNorm: this is what it would run
        if fused is not True:
            return ln(fused)
        return forward_backward(lambda x, w, b: F.layer_norm(x, w.shape, w, b), [x, *params], compiled=True)

    def add_ln(fused):
        return forward_backward(lambda x, d, *_: kernels.add_layer_norm(x, d, norm, fused), [x, delta, *params],
                                compiled=fused is True)

    def gelu(fused):
        return forward_backward(lambda a, b: kernels.bias_gelu(a, b, fused), [pre_gelu, bias], compiled=fused is True)

    def ln_gelu(fused):
        a, b = ln(fused), gelu(fused)
        return lambda: (a(), b())

    def ce(fused):
        return forward_backward(lambda z: kernels.cross_entropy(z, targets, fused), [logits], compiled=fused is True)

    head_dim = getattr(args, "head_dim", None) or 64
    qkv = leaf(B, T, 3 * h)
    cos, sin = (t.to(args.device) for t in rope_tables(T, head_dim, 10000.0, "cpu"))

    def heads_rope(fused):  # the projection's heads, q and k rotated; eager: the written-out op
        return forward_backward(lambda z: kernels.heads_with_rope(z, head_dim, cos, sin), [qkv], compiled=fused is True)

    def heads_rope_derived(fused):  # the plain ops compiled with autograd's derived backward: the alternative not taken
        if fused is not True:
            return heads_rope(fused)
        return forward_backward(lambda z: kernels._heads_then_rope(z, head_dim, cos, sin), [qkv], compiled=True)

    return {"LayerNorm, compiled (unused)": ln_compiled, "LN+residual": add_ln, "bias+GeLU (4h)": gelu, "LN+GeLU": ln_gelu,
            f"cross-entropy ({rows}x{args.vocab})": ce, f"heads+RoPE (head_dim {head_dim})": heads_rope,
            "heads+RoPE, plain ops compiled (unused)": heads_rope_derived}


def fused_values(args) -> list:
    """--fused as kernels.fused values; triton dropped, with a line saying why, off CUDA (Triton's
    CPU interpreter runs Python per program: correct, and useless to time)."""
    known = {"true": True, "triton": "triton"}
    if not set(args.fused.split(",")) <= set(known):
        sys.exit(f"--fused {args.fused}: use true, triton or true,triton")
    values = [known[v] for v in args.fused.split(",")]
    if "triton" in values and args.device != "cuda":
        print("kernels.fused=triton: not timed, Triton kernels run on CUDA only (--device cuda)")
        values.remove("triton")
    return values


def bench_fused(args, dtype, clock) -> None:
    values = fused_values(args)
    names = ["fused" if v is True else str(v) for v in values]
    print(f"\n### Fused vs eager, {args.dtype} on {args.device}, activations {args.shape}, forward + backward\n")
    print("| op | eager ms | " + " | ".join(f"{n} ms | speed-up | first {n} call s" for n in names) + " |")
    print("|---|---:|" + "---:|---:|---:|" * len(values))
    for name, make in fused_ops(args, dtype).items():
        # The first call compiles (true) or JIT-builds the kernels (triton).
        (eager, _), *fused = timed_together([make(v) for v in [False, *values]], args.reps, args.warmup, clock)
        cells = [f"{t * 1e3:.1f} | {eager / t:.2f}x | {first:.1f}" for t, first in fused]
        print(f"| {name} | {eager * 1e3:.1f} | " + " | ".join(cells) + " |", flush=True)


def bench_attention(args, dtype, clock) -> None:
    seqs = [int(s) for s in args.seqs.split(",")]
    windows = [int(w) for w in args.windows.split(",")]
    H, D, blk = args.heads, args.head_dim, args.block
    qkv = {s: [torch.randn(1, H, s, D, dtype=dtype, device=args.device).requires_grad_() for _ in range(3)]
           for s in seqs}
    banded = lambda s, W: forward_backward(lambda a, b, c: kernels.attention_banded(a, b, c, W, blk), qkv[s])
    # "x2 s" compares banded runs of one window at every length, timed in turn: the ratio of two
    # medians taken minutes apart, around the much longer causal runs, moved with the machine's load.
    by_length = {W: [t for t, _ in timed_together([banded(s, W) for s in seqs], args.reps, args.warmup, clock)]
                 for W in windows}
    print(f"\n### Banded SWA vs causal SDPA, {args.dtype}, B=1 H={H} D={D} block={blk}, forward + backward\n")
    print("| s | W | causal SDPA ms | banded ms | speed-up | FLOP ratio | x2 s |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for i, s in enumerate(seqs):
        causal = forward_backward(lambda a, b, c: kernels.attention_sdpa(a, b, c, None), qkv[s])
        times = timed_together([causal] + [banded(s, W) for W in windows], args.reps, args.warmup, clock)
        full = times[0][0]
        for W, (band, _) in zip(windows, times[1:]):
            doubling = f"{by_length[W][i] / by_length[W][i - 1]:.2f}" if i and seqs[i] == 2 * seqs[i - 1] else "-"
            print(f"| {s} | {W} | {full * 1e3:.0f} | {band * 1e3:.0f} | {full / band:.2f}x "
                  f"| {s / (2 * (W + blk)):.2f} | {doubling} |", flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    recycled = args.malloc == "recycle" and keep_freed_memory()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.device == "cuda":
        clock = cuda_clock
    dtype = DTYPES[args.dtype]
    print(f"torch {torch.__version__}, {args.device}, {torch.get_num_threads()} threads, {args.clock} clock, "
          f"median of {args.reps} after {args.warmup} warm-up, "
          f"{'recycled' if recycled else 'default'} malloc")
    if args.only in ("fused", "all"):
        bench_fused(args, dtype, clock)
    if args.only in ("attention", "all"):
        bench_attention(args, dtype, clock)


if __name__ == "__main__":
    main()
