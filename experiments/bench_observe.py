"""The op log's cost per op (observe.Recorder's wrapper: the post's bookkeeping, the call site,
the hash, the wait's times), measured on a 1-rank gloo all_reduce of a small tensor, wrapped and
unwrapped in alternating blocks, with call_site() alone timed beside it.

    .venv/bin/python experiments/bench_observe.py [--rounds 30] [--ops 2000]

Prints the load average (on a shared machine the figures are an upper bound), the per-op
difference's median and its 10th-90th percentile over rounds, and appends them as one line to
experiments/results/bench_observe.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import observe  # noqa: E402


def block(ops: int, tensor: torch.Tensor, async_op: bool) -> float:
    """Seconds per op of `ops` all_reduces posted from here (through whatever dist.all_reduce is)."""
    start = time.perf_counter()
    for _ in range(ops):
        work = dist.all_reduce(tensor, async_op=async_op)
        if async_op:
            work.wait()
    return (time.perf_counter() - start) / ops


def call_site_cost(ops: int) -> float:
    start = time.perf_counter()
    for _ in range(ops):
        observe.call_site()
    return (time.perf_counter() - start) / ops


def quantiles(values: list) -> dict:
    q = statistics.quantiles(values, n=10)
    return {"median_us": statistics.median(values) * 1e6, "p10_us": q[0] * 1e6, "p90_us": q[-1] * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--ops", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "bench_observe.jsonl")
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    tensor = torch.ones(4)
    recorder = observe.Recorder(observe.ObserveConfig(), 0, {"rank": 0}, {})
    result = {"load_before": os.getloadavg()}
    for async_op in (False, True):
        block(args.ops, tensor, async_op)  # warm-up
        deltas = []
        for _ in range(args.rounds):  # alternate, so the machine's drift hits both sides alike
            bare = block(args.ops, tensor, async_op)
            recorder.install()
            try:
                wrapped = block(args.ops, tensor, async_op)
            finally:
                recorder.uninstall()
            deltas.append(wrapped - bare)
        result["async" if async_op else "blocking"] = {"bare_us": bare * 1e6, **quantiles(deltas)}
    result["call_site"] = quantiles([call_site_cost(args.ops) for _ in range(args.rounds)])
    result.update(load_after=os.getloadavg(), rounds=args.rounds, ops=args.ops, torch=torch.__version__,
                  host=socket.gethostname(), cpus=os.cpu_count(),
                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                        text=True).stdout.strip())
    dist.destroy_process_group()
    print(json.dumps(result, indent=1))
    with args.out.open("a") as f:
        f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
