"""Time one all_reduce, alone, after compute (sequential), and under compute (overlapped).

    torchrun --nproc_per_node 2 experiments/probe_allreduce.py [--size-mb 16] [--compute-ms 50]
    python experiments/emucluster.py --hosts 2 --bandwidth 2gbit -- experiments/probe_allreduce.py
    srun -n2 --overcommit python experiments/probe_allreduce.py

Each rank prints one JSON line: the median times in ms of the all_reduce alone (comm), of the
matmuls alone (compute), of compute then all_reduce (sequential), and of an async all_reduce
issued before the same matmuls and waited on after them (overlapped). hidden_frac is the share
of comm that overlap removed from the step: (sequential - overlapped) / comm.

This is the measurement behind the MegaScale overlap ablations in miniature. Over loopback on a
small CPU the collective costs CPU time (copies, the reduction), so overlap hides little; over a
bandwidth-limited link (experiments/emucluster.py) the wire is the cost and overlap hides most.

The reduced values are checked on every iteration (exit 1 on a mismatch), so a run also proves
that the process group the launcher built is correct. The process group comes from
launch.init_distributed, the path train.py takes, so torchrun and srun launches test it too.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the flat repo root
from launch import init_distributed  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mb", type=float, default=16.0, help="all_reduce payload, fp32 MB (default 16)")
    p.add_argument("--compute-ms", type=float, default=50.0, help="matmul time to overlap with (default 50)")
    p.add_argument("--iters", type=int, default=5, help="timed iterations per mode (median reported)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--timeout-s", type=float, default=120.0, help="process group timeout")
    p.add_argument("--skip-overlap", action="store_true", help="time comm only (faster)")
    return p.parse_args(argv)


def pattern(numel: int, rank: int) -> torch.Tensor:
    # rank- and position-dependent, so a reduction that drops, duplicates or misaligns a chunk
    # from any rank shows up in the check; integers below 2**24 keep the fp32 sums exact
    return torch.arange(numel, dtype=torch.float32).remainder_(1000).add_(1000.0 * (rank + 1))


def reduced_pattern(numel: int, world: int) -> torch.Tensor:
    return sum(pattern(numel, r) for r in range(world))


def check(buf: torch.Tensor, expected: torch.Tensor) -> None:
    if not torch.equal(buf, expected):
        bad = (buf != expected).nonzero()[0].item()
        raise SystemExit(f"probe_allreduce: wrong all_reduce result at element {bad}: "
                         f"{buf[bad].item()} != {expected[bad].item()}")


def matmuls_for(target_ms: float) -> int:
    """How many 256x256 fp32 matmuls take target_ms on this rank; the ranks then agree on the max."""
    a = torch.randn(256, 256)
    for _ in range(3):
        a @ a
    t = time.perf_counter()
    for _ in range(20):
        a @ a
    per_ms = (time.perf_counter() - t) * 1000 / 20
    n = torch.tensor([max(1, round(target_ms / per_ms))])
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    return int(n.item())


def compute(n: int) -> None:
    a = torch.randn(256, 256)
    b = a
    for _ in range(n):
        b = a @ b
        b.mul_(0.01)  # keep the values bounded


def timed_in_turn(modes: dict, iters: int, warmup: int) -> dict:
    """Median ms of each mode, the modes run in turn within every iteration rather than one block
    after another: this shared machine's speed drifts within a minute, and the overlap's gain is
    the difference of three of these times (blocks gave 'overlapped' faster than the GEMMs alone)."""
    times = {name: [] for name in modes}
    for i in range(warmup + iters):
        for name, fn in modes.items():
            dist.barrier()  # every rank starts together, so the slowest rank's lateness is not counted as comm
            t = time.perf_counter()
            fn()
            if i >= warmup:
                times[name].append((time.perf_counter() - t) * 1000)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv=None) -> int:
    args = parse_args(argv)
    rank, world = init_distributed(torch.device("cpu"), "gloo", timeout_s=args.timeout_s)
    if world < 2:
        print("probe_allreduce: needs at least 2 ranks (torchrun, srun or emucluster)", file=sys.stderr)
        return 2
    numel = int(args.size_mb * 2**20) // 4
    mine, expected = pattern(numel, rank), reduced_pattern(numel, world)
    buf = torch.empty_like(mine)
    n = matmuls_for(args.compute_ms)

    def comm():
        buf.copy_(mine)
        dist.all_reduce(buf)
        check(buf, expected)

    def sequential():
        compute(n)
        comm()

    def overlapped():
        buf.copy_(mine)
        work = dist.all_reduce(buf, async_op=True)
        compute(n)
        work.wait()
        check(buf, expected)

    # the refill and the check are inside every timed call; time them alone to subtract them out
    def bookkeeping():
        buf.copy_(mine)
        torch.equal(buf, mine)

    result = {"rank": rank, "world": world, "host": os.environ.get("EMUCLUSTER_HOST", socket.gethostname()),
              "size_mb": args.size_mb, "matmuls": n}
    modes = {"bookkeeping": bookkeeping, "comm_ms": comm}
    if not args.skip_overlap:
        modes.update(compute_ms=lambda: compute(n), sequential_ms=sequential, overlapped_ms=overlapped)
    med = timed_in_turn(modes, args.iters, args.warmup)
    extra = med.pop("bookkeeping")
    result.update({k: v - extra if k != "compute_ms" else v for k, v in med.items()})
    if not args.skip_overlap:
        saved = result["sequential_ms"] - result["overlapped_ms"]
        result["hidden_frac"] = saved / result["comm_ms"] if result["comm_ms"] > 0 else 0.0
    result = {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}
    result["correct"] = True  # check() exits on any mismatch
    sys.stdout.write(json.dumps(result) + "\n")  # one write: ranks sharing a pipe do not interleave
    sys.stdout.flush()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
