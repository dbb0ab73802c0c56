#!/usr/bin/env python
"""The sampling index's memory per rank, before and after the shared memory-mapped index.

    python experiments/bench_sample_index.py                     # 146M sequences (a ~300B-token corpus at 2,048 tokens)
    python experiments/bench_sample_index.py --quick             # 1M sequences: checks that it runs

Before: every rank built an int64 permutation of all of the corpus's sequences (two around an
epoch boundary): measured as the bytes of that array. After: rank 0 writes the stream's index
once (corpus/blend.SampleIndex, int32, for the samples training needs) and every rank maps it:
measured as the file's size on disk, and as the resident pages of the mapping in one rank after it
has read its slice of a number of steps (/proc/self/smaps, this process standing for the rank).
Also the index's build time, for one source and for a 0.3/0.7 blend. A size figure, not a
timing contest: the build time is one run's wall clock.
"""
from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from corpus import blend  # noqa: E402

MiB = 2**20


def mapping_rss(path: Path) -> int:
    """Bytes of `path` resident in this process's mappings (Linux /proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            inside = len(fields) >= 6 and fields[5] == str(path.resolve())
        elif inside and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


def one_rank_reads(index: blend.SampleIndex, global_batch: int, dp: int, steps: int) -> int:
    """Rank dp//2's slices of `steps` steps, as sampling.Sampler reads them; the mapping's resident bytes."""
    fresh = blend.SampleIndex(index.sizes, index.units, index.seed, index.samples, index.cache_dir, index.names)
    local, rank = global_batch // dp, dp // 2
    for step in range(steps):
        fresh.rows(step * global_batch + rank * local, local)
    return mapping_rss(fresh.path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=float, default=146e6, help="the corpus's sequences (default 146M)")
    parser.add_argument("--global-batch", type=int, default=1536)
    parser.add_argument("--dp", type=int, default=64)
    parser.add_argument("--steps", type=int, default=1000, help="steps one rank reads before its mapping is measured")
    parser.add_argument("--quick", action="store_true", help="1M sequences, 100 steps")
    args = parser.parse_args()
    n = 10**6 if args.quick else int(args.sequences)
    steps = 100 if args.quick else args.steps
    samples = n  # one epoch: max_steps x global batch of a run that reads the corpus once

    started = time.perf_counter()
    before = np.random.default_rng([0, 0]).permutation(n)  # what each rank built (sampling.Sampler before)
    before_s, before_bytes = time.perf_counter() - started, before.nbytes
    del before

    rows = [f"corpus: {n:,} sequences; index for {samples:,} samples; global batch {args.global_batch}, dp {args.dp}", "",
            "| | per rank | once, shared |", "|---|---|---|",
            f"| before: int64 permutation of every sequence (two at an epoch boundary) | {before_bytes / MiB:,.1f} MiB "
            f"({2 * before_bytes / MiB:,.1f} MiB) | - |"]
    timings = [f"before: one permutation {before_s:.1f} s on every rank"]
    with tempfile.TemporaryDirectory() as tmp:
        for label, sizes, weights in (("one source", [n], [1.0]),
                                      ("blend 0.3/0.7", [int(n * 0.3), n - int(n * 0.3)], [0.3, 0.7])):
            cache = Path(tmp) / label.replace(" ", "_").replace("/", "_")
            started = time.perf_counter()
            index = blend.SampleIndex(sizes, weights, seed=0, samples=samples, cache_dir=cache)
            built_s = time.perf_counter() - started
            on_disk = index.path.stat().st_size
            resident = one_rank_reads(index, args.global_batch, args.dp, steps)
            rows.append(f"| after, {label}: the mapped index ({index.dtype.name}), resident after {steps} steps "
                        f"| {resident / 1024:,.0f} KiB | {on_disk / MiB:,.1f} MiB on disk |")
            timings.append(f"after, {label}: built in {built_s:.1f} s, once (rank 0)")
            index.path.unlink()
    local = args.global_batch // args.dp
    rows += ["", f"A rank reads {local} rows x 4 B = {local * 4} B of the index a step (one 4 KiB page, two "
                 f"where its slice straddles one); the pages stay cached while the mapping is open, so "
                 f"a rank's resident share grows by at most global batch x 4 B a step, and the kernel can drop it.",
             "", *timings]
    print(f"# {platform.processor() or platform.machine()}, numpy {np.__version__}\n")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
