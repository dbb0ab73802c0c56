"""The time the data loader adds to a training step (the performance model's loader_step_s), measured.

    python experiments/bench_loader.py --dir /path/on/the/corpus/filesystem   # Table 3's 175B rank
    python experiments/bench_loader.py --quick                                  # a smoke run: small file, few steps

The batch is one rank's at Table 3's layout (conf/study_scale/megascale_ablation_cluster.yaml,
conf/parallel/megascale_175B.yaml): global batch 256 over dp 4 = 64 sequences of 2048 (+1) tokens a
step (--batch 192 for the LAMB step's 768). The loader is sampling.Loader, the job's, over a random
uint16 token file of --file-gib on --dir (put it on the file system the job's corpus lives on), read
in the sampler's shuffled order. Three ways a host's TP group of --ranks GPUs gets its batches:

  naive     every rank reads its own batch when its step asks for it: --ranks processes read at
            once; a step waits for the slowest (its TP collectives join the group), so each step's
            figure is the longest of its ranks' reads (data.pipeline=naive);
  prefetch  the batches are read in the loader's background thread while the step computes (a
            sleep of --step-s seconds stands for it); timed: what next() still blocks
            (data.prefetch_async, the part of data.pipeline=megascale that hides the read);
  shared    one reader per TP group reads once for the group (data.tp_shared); the broadcast to the
            group (64 x 2049 x 2 bytes = 262 KB over NVLink) is not in this figure.

Page cache: cold drops the file's pages before every step with posix_fadvise(POSIX_FADV_DONTNEED)
(no root needed; it drops this file's clean pages, as `echo 1 > /proc/sys/vm/drop_caches` would
drop everyone's), so each step's rows come from the storage; warm reads the whole file once first.
Each figure (after one set-up step): the median over steps, a 95% bootstrap interval of the median, and the 5th-95th
percentile range. perfmodel's loader_step_s is naive's median, cold (a job's corpus is far larger
than the page cache); data.pipeline=megascale is priced at 0 when prefetch's median is ~0.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import machine  # noqa: E402
import sampling  # noqa: E402


class TokenFile:
    """What sampling.Loader reads: a flat uint16 token file cut into overlapping [seq_len + 1] rows."""

    vocab_size = 50257  # GPT-3's: uint16 tokens

    def __init__(self, path: Path):
        self.path, self.tokens = path, np.memmap(path, dtype=np.uint16, mode="r")

    def num_sequences(self, split: str, seq_len: int) -> int:
        return (len(self.tokens) - 1) // seq_len

    def sequences(self, split: str, seq_len: int) -> np.ndarray:
        n = self.num_sequences(split, seq_len)
        return np.lib.stride_tricks.as_strided(self.tokens, shape=(n, seq_len + 1), strides=(2 * seq_len, 2),
                                               writeable=False)


def write_token_file(folder: Path, gib: float) -> Path:
    path = folder / "bench_loader_tokens.bin"
    rng, left = np.random.default_rng(0), int(gib * 2**30) // 2
    with open(path, "wb") as f:
        while left > 0:
            chunk = min(left, 2**26)
            rng.integers(0, TokenFile.vocab_size, chunk, dtype=np.uint16).tofile(f)
            left -= chunk
        f.flush()
        os.fsync(f.fileno())  # dirty pages cannot be dropped
    return path


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def warm_cache(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(2**26):
            pass


def loader(path: Path, args, rank: int, prefetch: int) -> sampling.Loader:
    corpus = TokenFile(path)
    sampler = sampling.Sampler(corpus.num_sequences("train", args.seq), args.batch * args.ranks,
                               dp_rank=rank, dp_size=args.ranks, seed=rank)
    return sampling.Loader(corpus, "train", args.seq, sampler, prefetch=prefetch, pin_memory=torch.cuda.is_available())


def _naive_rank(rank: int, path: Path, args, barrier, cold: bool, results) -> None:
    """One rank of a host whose ranks all read at the start of every step."""
    torch.set_num_threads(1)
    batches, seconds = loader(path, args, rank, prefetch=0), []
    for _ in range(args.steps + 1):
        if cold and rank == 0:
            drop_cache(path)
        barrier.wait()
        start = time.perf_counter()
        next(batches)
        seconds.append(time.perf_counter() - start)
    results.put(seconds[1:])  # the first: the loader's set-up


def naive(path: Path, args, cold: bool, ranks: int) -> list:
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(ranks), ctx.Queue()
    procs = [ctx.Process(target=_naive_rank, args=(r, path, args, barrier, cold, results)) for r in range(ranks)]
    for p in procs:
        p.start()
    per_rank = [results.get() for _ in procs]
    for p in procs:
        p.join()
    return np.max(per_rank, axis=0).tolist()  # each step waits for its slowest rank


def prefetch(path: Path, args, cold: bool) -> list:
    batches, seconds = loader(path, args, 0, prefetch=2), []
    with batches:
        for _ in range(args.steps + 1):
            if cold:
                drop_cache(path)
            time.sleep(args.step_s)  # the step's compute, during which the thread reads the next batches
            start = time.perf_counter()
            next(batches)
            seconds.append(time.perf_counter() - start)
    return seconds[1:]  # the first: the thread's start, with nothing read ahead yet


def summary(seconds: list) -> dict:
    s = np.asarray(seconds)
    rng = np.random.default_rng(0)
    medians = np.median(rng.choice(s, size=(1000, len(s))), axis=1)
    return {"median_s": float(np.median(s)), "median_ci95_s": [float(x) for x in np.percentile(medians, [2.5, 97.5])],
            "p5_p95_s": [float(x) for x in np.percentile(s, [5, 95])], "n": len(s)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64, help="sequences a rank reads per step (Table 3: 256 / dp 4)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--ranks", type=int, default=8, help="GPUs per host, one TP group")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--step-s", type=float, default=1.0, help="the compute the prefetch hides behind")
    p.add_argument("--file-gib", type=float, default=8.0)
    p.add_argument("--dir", default=None, help="where the token file is written (default: a temporary folder)")
    p.add_argument("--out", default=None, help="also write the figures as JSON here")
    p.add_argument("--quick", action="store_true", help="a smoke run: 16 MiB, 4 steps, 2 ranks, short steps")
    args = p.parse_args()
    if args.quick:
        args.batch, args.seq, args.ranks, args.steps, args.step_s, args.file_gib = 8, 512, 2, 4, 0.05, 1 / 64
    print(f"{machine.cpu_model()} | {machine.cores()} cores | bf16 native: {machine.native_bf16()} | torch {torch.__version__} | "
          f"batch {args.batch} x {args.seq + 1} tokens per rank, {args.ranks} ranks per host, step {args.step_s} s, "
          f"file {args.file_gib:g} GiB{' | --quick: a smoke run, not a measurement' if args.quick else ''}")
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        path = write_token_file(Path(folder), args.file_gib)
        figures = {}
        for cache in ("cold", "warm"):
            cold = cache == "cold"
            if not cold:
                warm_cache(path)
            figures[cache] = {"naive": summary(naive(path, args, cold, args.ranks)),
                              "prefetch": summary(prefetch(path, args, cold)),
                              "shared": summary(naive(path, args, cold, 1))}
            for how, f in figures[cache].items():
                print(f"{cache:4} {how:8} median {f['median_s'] * 1e3:8.3f} ms  95% CI [{f['median_ci95_s'][0] * 1e3:.3f}, "
                      f"{f['median_ci95_s'][1] * 1e3:.3f}]  p5-p95 [{f['p5_p95_s'][0] * 1e3:.3f}, {f['p5_p95_s'][1] * 1e3:.3f}]"
                      f"  ({f['n']} steps)")
    print(f"loader_step_s (naive, cold): {figures['cold']['naive']['median_s']:.4f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "cpu": machine.cpu_model(), **figures}, indent=1))


if __name__ == "__main__":
    main()
