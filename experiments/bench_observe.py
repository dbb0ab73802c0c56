"""What observability costs, two ways.

Per op: the op log's wrapper (oplog.Recorder: the post's bookkeeping, the call site, the hash,
the wait's times) on a 1-rank gloo all_reduce of a small tensor, wrapped and unwrapped in
alternating blocks; the same wrapper around a stand-in collective that returns at once (its own
cost, which the real op's tens of microseconds of noise hide); call_site() and a wait's span alone.

    .venv/bin/python experiments/bench_observe.py [--rounds 30] [--ops 2000]

Per step: train.py run with every observability default on (op log, spans, snapshots, hang
localization, desync check, signal handlers, straggler windows) and with all of them off, the two
runs alternating round by round (the first of a pair swaps each round, so drift hits both alike);
each run's median step time after its warm-up and the CPU seconds its ranks spent a step (every
rank and thread, read from /proc), the on/off ratios per round, and their medians and ranges. With
more ranks than cores a step's wall time is largely the scheduler's; its CPU time is the work. --layout single is bench_step's default shape on one rank; --layout demo is make demo's
8-rank job (tp2 pp2 dp2, every MegaScale switch on) under torchrun on this machine's loopback.

    .venv/bin/python experiments/bench_observe.py --runs --layout single|demo [--rounds R] [--steps S] [--warmup W]

R, S, W default to 5, 40, 5 for single and to 3, 10, 2 for demo, whose step takes ~2.6 s on 8 ranks
sharing 2 cores and whose start-up 30-55 s: its 6 runs then take 6-9 minutes. Its 12 steps hold no
straggler window (20 steps): the on runs pay for every other default, the windows' one gather and
one all-reduce per 20 steps not.

Both print the load average (on a shared machine the figures are an upper bound) and append one
JSON line to experiments/results/bench_observe.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from observe import comms, oplog
from corpus.__main__ import build_for  # noqa: E402


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
        comms.call_site()
    return (time.perf_counter() - start) / ops


class _Done:
    """The work of a collective that has completed."""

    def wait(self, timeout=None):
        return True


def _returns_at_once(*args, **kwargs):
    return _Done() if kwargs.get("async_op") else None


def wrapper_cost(recorder, tensor: torch.Tensor, ops: int, rounds: int) -> dict:
    """The op log's own seconds per op (blocking; asynchronous with its wait) and per wait's span:
    the wrapper around a collective that returns at once, less that collective alone."""
    wrapped = comms._interposed("all_reduce", _returns_at_once)  # as the interposer wraps dist.all_reduce
    out = {}
    recorder.install()  # its handler, the only one
    try:
        for name, async_op in (("blocking", False), ("async", True)):
            deltas = []
            for _ in range(rounds):
                deltas.append(block_of(wrapped, ops, tensor, async_op) - block_of(_returns_at_once, ops, tensor, async_op))
            out[name] = quantiles(deltas)
    finally:
        recorder.uninstall()
    spans = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(ops):
            recorder.wait_span("comm", time.time(), 0.001)
        spans.append((time.perf_counter() - start) / ops)
    out["span"] = quantiles(spans)
    return out


def block_of(post, ops: int, tensor: torch.Tensor, async_op: bool) -> float:
    start = time.perf_counter()
    for _ in range(ops):
        work = post(tensor, async_op=async_op)
        if async_op:
            work.wait()
    return (time.perf_counter() - start) / ops


def quantiles(values: list) -> dict:
    q = statistics.quantiles(values, n=10)
    return {"median_us": statistics.median(values) * 1e6, "p10_us": q[0] * 1e6, "p90_us": q[-1] * 1e6}


# --- Per step: train.py with the defaults against everything off ---

OFF = ["observe.ops=false", "observe.spans=0", "observe.localize=false", "observe.signals=false",
       "observe.desync_every=0", "observe.stall_s=0", "ft.straggler_interval=0"]
COMMON = ["logging.wandb.mode=disabled", "logging.progress=false", "train.eval_interval=0", "checkpoint.interval=0",
          "data.tokenizer=bytes", "hardware.peak_tflops=1"]
LAYOUTS = {  # name -> (ranks, overrides)
    "single": (1, ["model=tiny", "model.n_layers=6", "model.d_model=384", "model.n_heads=6", "model.bias=false",
                   "train.batch_size=8", "train.seq_len=256", "precision=fp32", "train.compile=false"]),
    "demo": (8, ["experiment=megascale_ablation", "ablation.step=8"]),
}

RUN_DEFAULTS = {"single": (5, 40, 5), "demo": (3, 10, 2)}  # layout -> rounds, timed steps, warm-up steps


def run_steps(layout: str, on: bool, steps: int, warmup: int) -> tuple:
    """One train.py run: its median step time (s) after `warmup` steps, and the CPU seconds all its
    ranks spent a step over the same steps (read from /proc as rank 0 logs each step's row)."""
    ranks, overrides = LAYOUTS[layout]
    build_for(overrides + COMMON)  # a job of several ranks never builds its corpus
    with tempfile.TemporaryDirectory() as run_dir:
        launcher = [sys.executable, "train.py"] if ranks == 1 else \
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", "train.py"]
        cmd = [*launcher, *overrides, *COMMON, *([] if on else OFF), f"train.max_steps={warmup + steps}",
               f"logging.interval=1", f"hydra.run.dir={run_dir}"]
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        cpu = rows_cpu(proc, Path(run_dir) / "metrics.jsonl", warmup, warmup + steps - 1)
        if proc.wait() != 0:
            raise subprocess.CalledProcessError(proc.returncode, cmd)
        rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time"] for r in rows if "step_time" in r and r.get("step", 0) > warmup]
    return statistics.median(times), cpu


def rows_cpu(proc: subprocess.Popen, metrics: Path, first: int, last: int) -> float:
    """CPU seconds a step of proc and its descendants (every rank, every thread), from the row of
    step `first` to the row of step `last` (the last row is left out: the ranks may exit at once).
    With more ranks than cores a step's wall time is the scheduler's; its CPU time is the work."""
    marks = {}
    while len(marks) < 2 and proc.poll() is None:
        lines = metrics.read_text().count("\n") if metrics.exists() else 0
        for step in (first, last):
            if step not in marks and lines >= step:
                marks[step] = tree_cpu_s(proc.pid)
        time.sleep(0.02)
    return (marks[last] - marks[first]) / (last - first) if len(marks) == 2 else float("nan")


def tree_cpu_s(root: int) -> float:
    """User + system CPU seconds of root and its living descendants, from /proc."""
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(entry)] = (int(fields[1]), int(fields[11]) + int(fields[12]))  # ppid, utime + stime
    children = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    tree, total = [root], 0
    while tree:
        pid = tree.pop()
        total += stats.get(pid, (0, 0))[1]
        tree += children.get(pid, [])
    return total / os.sysconf("SC_CLK_TCK")


def per_step(args) -> dict:
    ratios, cpu_ratios, on_s, off_s, on_cpu, off_cpu = [], [], [], [], [], []
    for k in range(args.rounds):
        order = (True, False) if k % 2 == 0 else (False, True)
        got = {on: run_steps(args.layout, on, args.steps, args.warmup) for on in order}
        on_s.append(got[True][0])
        off_s.append(got[False][0])
        on_cpu.append(got[True][1])
        off_cpu.append(got[False][1])
        ratios.append(got[True][0] / got[False][0])
        cpu_ratios.append(got[True][1] / got[False][1])
        print(f"round {k}: on {got[True][0] * 1e3:.1f} ms, off {got[False][0] * 1e3:.1f} ms, ratio {ratios[-1]:.4f}; "
              f"CPU a step on {got[True][1]:.3f} s, off {got[False][1]:.3f} s, ratio {cpu_ratios[-1]:.4f}", flush=True)
    return {"layout": args.layout, "steps": args.steps, "warmup": args.warmup, "on_ms": statistics.median(on_s) * 1e3,
            "off_ms": statistics.median(off_s) * 1e3, "overhead_pct_median": (statistics.median(ratios) - 1) * 100,
            "overhead_pct_min": (min(ratios) - 1) * 100, "overhead_pct_max": (max(ratios) - 1) * 100, "ratios": ratios,
            "on_cpu_s": statistics.median(on_cpu), "off_cpu_s": statistics.median(off_cpu),
            "cpu_overhead_pct_median": (statistics.median(cpu_ratios) - 1) * 100,
            "cpu_overhead_pct_min": (min(cpu_ratios) - 1) * 100, "cpu_overhead_pct_max": (max(cpu_ratios) - 1) * 100,
            "cpu_ratios": cpu_ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=None, help="30 per op; 5 with --runs")
    parser.add_argument("--ops", type=int, default=2000)
    parser.add_argument("--runs", action="store_true", help="per step: paired train.py runs, observability on and off")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="single")
    parser.add_argument("--steps", type=int, default=None, help="timed steps a run: 40 (single), 10 (demo)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first: 5 (single), 2 (demo)")
    parser.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "bench_observe.jsonl")
    args = parser.parse_args()
    rounds, steps, warmup = RUN_DEFAULTS[args.layout]
    args.rounds = args.rounds or (rounds if args.runs else 30)
    args.steps, args.warmup = args.steps or steps, args.warmup if args.warmup is not None else warmup
    if args.runs:
        result = {"load_before": os.getloadavg(), **per_step(args)}
        record(result, args)
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    tensor = torch.ones(4)
    recorder = oplog.Recorder(oplog.ObserveConfig(), 0, {"rank": 0}, {})
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
    result["wrapper"] = wrapper_cost(recorder, tensor, args.ops, args.rounds)
    result.update(ops=args.ops)
    dist.destroy_process_group()
    record(result, args)


def record(result: dict, args) -> None:
    """Prints the result with the machine's facts and appends it as one line to args.out."""
    result.update(load_after=os.getloadavg(), rounds=args.rounds, torch=torch.__version__,
                  host=socket.gethostname(), cpus=os.cpu_count(), cpu=machine_cpu(),
                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                        text=True).stdout.strip())
    print(json.dumps(result, indent=1))
    with args.out.open("a") as f:
        f.write(json.dumps(result) + "\n")


def machine_cpu() -> str:
    """The CPU's model name (a CPU timing holds for that CPU only)."""
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return "?"


if __name__ == "__main__":
    main()
