"""Why the banded attention's middle call masks every score: the alternative, measured.

    python experiments/bench_band_split.py                          # bf16 and fp32, s=8192
    python experiments/bench_band_split.py --dtype fp32 --windows 512 --threads 1

kernels.attention_banded runs all the middle query blocks as one SDPA call over their windows of
keys, with one [block, window] additive mask on every score. The keys of a window fall in three
groups: a left edge that only some of the block's queries see, an interior that all of them see,
and the block's own keys (causal). Masking only where it is needed means three kernel calls,
merged by their log-sum-exps (as ring attention merges its blocks), with the kernel's backward
per piece given the merged output and log-sum-exp. SDPA's public call returns no log-sum-exp,
so this uses its CPU flash kernel's ops directly (CPU only).

Per window, forward + backward, the median of --reps runs taken in turn: the single masked call,
the same call without the mask (wrong, timed only to price the mask), and the split. The split is
checked against the single call first. Prints a Markdown table.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the flat repo root
import kernels  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
cpu_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
cpu_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def pieces(mask: torch.Tensor, edge: int):
    """(keys, causal, mask) of the three groups of a window's keys; `edge` = lead + block - W."""
    block, window_len = mask.shape
    lead = window_len - block
    return [p for p in [(slice(0, edge), False, mask[:, :edge]), (slice(edge, lead), False, None),
                        (slice(lead, window_len), True, None)] if p[0].stop > p[0].start]


class BandSplit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, edge: int):
        outs, lses = [], []
        for keys, causal, piece_mask in pieces(mask, edge):
            out, lse = cpu_flash(q, k[:, :, keys], v[:, :, keys], 0.0, causal, attn_mask=piece_mask)
            if piece_mask is not None:  # a row that sees none of these keys: the kernel says lse 0
                lse = lse.masked_fill(torch.isinf(piece_mask).all(-1), float("-inf"))
            outs.append(out)
            lses.append(lse)
        lse = torch.logsumexp(torch.stack(lses), dim=0)
        out = sum((part_lse - lse).exp().unsqueeze(-1) * part.float() for part, part_lse in zip(outs, lses))
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, mask, out, lse)
        ctx.edge = edge
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, mask, out, lse = ctx.saved_tensors
        grad_q, grad_k, grad_v = torch.zeros_like(q, dtype=torch.float32), [], []
        for keys, causal, piece_mask in pieces(mask, ctx.edge):
            gq, gk, gv = cpu_flash_backward(grad_out.contiguous(), q, k[:, :, keys], v[:, :, keys], out, lse,
                                            0.0, causal, attn_mask=piece_mask)
            grad_q += gq
            grad_k.append(gk)
            grad_v.append(gv)
        return grad_q.to(q.dtype), torch.cat(grad_k, dim=2), torch.cat(grad_v, dim=2), None, None


def middle_inputs(T: int, W: int, block: int, heads: int, head_dim: int, dtype):
    """q blocks, key/value windows and the shared mask of the banded middle call, as kernels builds them."""
    window_len = kernels._round_up(block + W - 1, 16)
    lead = window_len - block
    n = (T - kernels._round_up(lead, block)) // block
    q = torch.randn(heads, n, block, head_dim, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(heads, n, window_len, head_dim, dtype=dtype, requires_grad=True) for _ in range(2))
    allowed = kernels.band_mask(block, window_len, lead, W, "cpu")
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
    return q, k, v, mask, lead + block - W


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bf16,fp32")
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--windows", default="256,512,1024")
    p.add_argument("--block", type=int, default=kernels.DEFAULT_BLOCK)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    libc = ctypes.CDLL("libc.so.6")  # keep freed memory, as bench_kernels does (see its docstring)
    libc.mallopt(-3, 1 << 30), libc.mallopt(-1, 1 << 62)
    print(f"torch {torch.__version__}, {args.threads} thread(s), CPU clock, s={args.seq}, block={args.block}, "
          f"median of {args.reps}\n")
    print("| dtype | W | masked call ms | unmasked ms | mask costs | split ms | split vs masked |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in args.dtype.split(","):
        for W in (int(w) for w in args.windows.split(",")):
            q, k, v, mask, edge = middle_inputs(args.seq, W, args.block, 8, 64, DTYPES[name])
            grad = torch.randn_like(q)
            variants = [lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                        lambda: F.scaled_dot_product_attention(q, k, v),
                        lambda: BandSplit.apply(q, k, v, mask, edge)]
            runs = [lambda fn=fn: torch.autograd.grad(fn(), (q, k, v), grad) for fn in variants]
            want, got = runs[0](), runs[2]()
            for a, b in zip(want, got):  # the split is the same attention
                torch.testing.assert_close(b.float(), a.float(), atol=3e-2, rtol=3e-2)
            times = [[] for _ in runs]
            for _ in range(args.reps):
                for run, t in zip(runs, times):
                    start = time.process_time()
                    run()
                    t.append(time.process_time() - start)
            masked, unmasked, split = (statistics.median(t) for t in times)
            print(f"| {name} | {W} | {masked * 1e3:.0f} | {unmasked * 1e3:.0f} | {100 * (masked / unmasked - 1):.1f}% "
                  f"| {split * 1e3:.0f} | {masked / split:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
