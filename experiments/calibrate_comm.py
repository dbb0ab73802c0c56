"""Calibrate gloo on this machine for clustermodel/perfmodel.py: the latency and bandwidth of
each collective and of a send between ranks, over loopback or over the emulated cluster's throttled
link, and how much compute slows when ranks share the cores.

    python experiments/calibrate_comm.py                        # loopback (2 ranks) and 250mbit (2 hosts x 1)
    python experiments/calibrate_comm.py --links 250mbit --ranks-per-host 2
    python experiments/calibrate_comm.py --sharing              # compute alone and beside 1, 3 and 7 other ranks,
                                                                # and a small collective beside it

Each setting runs this script's worker under experiments/emucluster.py (the link) or its
--loopback (one torchrun). Every rank times all_reduce, all_gather, reduce_scatter over the whole
world, and rank 0 a send/recv round trip with the last rank (across the link when there is one),
at sizes from 16 KiB to 16 MiB, the median of --reps after a barrier. The fit is the alpha-beta
model perfmodel.collective_time prices (Thakur et al. 2005): t = steps * latency + f * bytes / bw,
with steps and f of the ring on n ranks (2(n-1) and 2(n-1)/n for all_reduce, n-1 and (n-1)/n for
the others; one message for a send). The table gives the fitted latency and bandwidth, the
bandwidth as a fraction of the link's rate (the efficiency perfmodel's hardware files carry), and
each size's error of the fit. Then experiments/probe_allreduce.py on the same fabric gives what
overlapping an all-reduce with GEMMs still costs the compute (perfmodel's overlap_slowdown). The results are appended to <cache>/comm_calibration.jsonl
(machine.cache_dir()), one line per setting.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import machine  # noqa: E402

SIZES = [2 ** k for k in range(14, 25, 2)]  # bytes: 16 KiB .. 16 MiB
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "send")
# The fit starts at the token bucket's depth (emucluster.BURST, 256 KiB): a smaller message leaves
# at the veth's own speed, not the tbf rate. Training's collectives are larger (the tiny model's
# TP activations and DP buckets are MiBs); the table still gives every size's error.
FIT_FROM = 2 ** 18


def ring_terms(kind: str, n: int) -> tuple:
    """(steps, fraction of the buffer each rank moves) of a ring collective on n ranks, or of one message."""
    if kind == "send":
        return 1, 1.0
    steps, fraction = n - 1, (n - 1) / n
    return (2 * steps, 2 * fraction) if kind == "all_reduce" else (steps, fraction)


def fit(points: list) -> tuple:
    """Least squares of t = steps * latency + moved / bw over [(steps, moved bytes, seconds)], each
    point weighted by 1/t^2 (relative error: the sizes span three decades): (latency s, bandwidth
    B/s). Every kind has one steps value, so latency is the intercept / steps."""
    steps = points[0][0]
    w = [1 / p[2] ** 2 for p in points]
    xs, ts = [p[1] for p in points], [p[2] for p in points]
    mx, mt = (sum(wi * v for wi, v in zip(w, vs)) / sum(w) for vs in (xs, ts))
    slope = (sum(wi * (x - mx) * (t - mt) for wi, x, t in zip(w, xs, ts))
             / sum(wi * (x - mx) ** 2 for wi, x in zip(w, xs)))
    return max(mt - slope * mx, 0.0) / steps, 1.0 / slope


# --- The worker: one rank of the job ---

def timed(fn, reps: int) -> float:
    import torch.distributed as dist
    fn()  # warm-up: connections, buffers
    out = []
    for _ in range(reps):
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return statistics.median(out)


def worker(args) -> int:
    import torch.distributed as dist
    from launch import init_distributed
    torch.set_num_threads(1)
    rank, world = init_distributed(torch.device("cpu"), "gloo", timeout_s=300)
    if args.sharing:
        return sharing_worker(rank, world, args)
    if world < 2:
        raise SystemExit("calibrate_comm: the worker needs 2 or more ranks")
    rows = []
    for nbytes in SIZES:
        full = torch.ones(nbytes // 4)
        part = torch.ones(nbytes // 4 // world)
        ops = {"all_reduce": lambda: dist.all_reduce(full),
               "all_gather": lambda: dist.all_gather_into_tensor(full, part),
               "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, full)}
        for kind, op in ops.items():
            rows.append({"kind": kind, "bytes": part.numel() * 4 * world, "s": timed(op, args.reps)})
        rows.append({"kind": "send", "bytes": nbytes, "s": timed(lambda: ping(full, rank, world), args.reps) / 2})
    if rank == 0:
        Path(args.out).write_text(json.dumps({"world": world, "rows": rows}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def ping(buf, rank: int, world: int) -> None:
    """A message from rank 0 to the last rank and back (the others wait at the next barrier)."""
    import torch.distributed as dist
    last = world - 1
    if rank == 0:
        dist.send(buf, last)
        dist.recv(buf, last)
    elif rank == last:
        dist.recv(buf, 0)
        dist.send(buf, 0)


def sharing_worker(rank: int, world: int, args) -> int:
    """Every rank times the same single-threaded GEMMs at once: the step slows by how much when
    `world` ranks share this machine's cores. Then what a small collective adds beside them."""
    import torch.distributed as dist
    a = torch.randn(512, 512)
    gemm = lambda: [a @ a for _ in range(20)]
    result = torch.tensor([timed(gemm, args.reps), collective_beside_gemms(rank, world, args.reps * 5)])
    if world > 1:
        dist.all_reduce(result, op=dist.ReduceOp.MAX)
        dist.destroy_process_group()
    if rank == 0:
        gemm_s, collective_s = result.tolist()
        Path(args.out).write_text(json.dumps({"world": world, "gemm_s": gemm_s, "collective_s": collective_s}))
    return 0


def collective_beside_gemms(rank: int, world: int, reps: int) -> float:
    """Seconds a 4 KiB all-reduce between a pair of ranks adds to ~2 ms of a rank's GEMMs, while
    every rank does the same (as TP pairs do in a step): the host's cost of a collective beside
    compute, which the link fits (from 256 KiB up) leave out. A collective waits until its peer's
    threads are scheduled, and gloo's threads take cores from the GEMMs. clustermodel/replay.py adds it to every
    collective and send (hardware.perfmodel.collective_host_us)."""
    import torch.distributed as dist
    if world < 2:
        return 0.0
    pairs = [dist.new_group([i, i + 1]) for i in range(0, world - 1, 2)]  # every rank makes every group
    pair, small, b = pairs[min(rank // 2, len(pairs) - 1)], torch.ones(1024), torch.randn(256, 256)
    gemms = lambda: [b @ b for _ in range(4)]
    return max(0.0, timed(lambda: (gemms(), dist.all_reduce(small, group=pair)), reps) - timed(gemms, reps))


# --- The driver: one job per setting, then the fit and the table ---

def launch(link: str, hosts: int, per_host: int, extra: list, reps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        where = ["--loopback"] if link == "loopback" else ["--bandwidth", link]
        cmd = [sys.executable, str(ROOT / "experiments" / "emucluster.py"), "--hosts", str(hosts), "--ranks-per-host",
               str(per_host), *where, "--", __file__, "--worker", "--out", str(out), "--reps", str(reps), *extra]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not out.exists():
            raise SystemExit(f"calibrate_comm: {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
        return json.loads(out.read_text())


def overlap_probe(link: str, hosts: int, per_host: int, compute_ms: float, size_mb: float = 4.0) -> dict:
    """experiments/probe_allreduce.py on this fabric: an all-reduce alone, GEMMs alone, one after the
    other, and the all-reduce issued before the GEMMs and waited on after them. What hiding it
    still costs the compute (gloo's copies and reductions on the same cores) is perfmodel's
    overlap_slowdown: overlapped = max(compute, comm) + slowdown * min(compute, comm). The GEMMs are
    given twice the all-reduce's fitted time, so that the whole all-reduce can hide.

    compute is the GEMMs' time in the sequential mode (sequential - comm) where that is longer than
    the GEMMs alone: beside the other rank and its link they ran 3-17% slower whether overlapped or
    not (Xeon, 100 mbit to 1 gbit, the modes interleaved). Against the GEMMs alone that slowing
    was read as overlap's cost: 1.00 (the clamp) at 250 mbit, where overlapping cost 2 ms of 1,128."""
    where = ["--loopback"] if link == "loopback" else ["--bandwidth", link]
    cmd = [sys.executable, str(ROOT / "experiments" / "emucluster.py"), "--hosts", str(hosts), "--ranks-per-host",
           str(per_host), *where, "--", str(ROOT / "experiments" / "probe_allreduce.py"), "--size-mb", str(size_mb),
           "--compute-ms", str(compute_ms), "--iters", "5"]
    proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True)
    rows = [json.loads(l[l.index("{"):]) for l in proc.stdout.splitlines() if '"hidden_frac"' in l]
    if proc.returncode != 0 or not rows:
        raise SystemExit(f"calibrate_comm: {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    row = next((r for r in rows if r["rank"] == 0), rows[0])
    return {**{k: row[k] for k in ("size_mb", "comm_ms", "compute_ms", "sequential_ms", "overlapped_ms",
                                    "hidden_frac")}, **overlap_slowdown(row)}


def overlap_slowdown(row: dict) -> dict:
    """overlap_probe's estimate from probe_allreduce's medians (ms), clamped to [0, 1]."""
    comm = row["comm_ms"]
    compute = max(row["compute_ms"], row["sequential_ms"] - comm)  # the GEMMs as they ran beside the link
    slowdown = (row["overlapped_ms"] - max(comm, compute)) / min(comm, compute)
    return {"compute_beside_ms": compute, "overlap_slowdown": min(max(slowdown, 0.0), 1.0)}


def calibrate(link: str, hosts: int, per_host: int, reps: int) -> dict:
    result = launch(link, hosts, per_host, [], reps)
    n = result["world"]
    fits = {}
    for kind in KINDS:
        steps, fraction = ring_terms(kind, n if kind != "send" else 2)
        points = [(steps, fraction * r["bytes"], r["s"]) for r in result["rows"] if r["kind"] == kind]
        latency, bandwidth = fit([p for p, size in zip(points, SIZES) if size >= FIT_FROM])
        errors = [(steps * latency + moved / bandwidth) / s - 1 for _, moved, s in points]
        fitted = [abs(e) for e, size in zip(errors, SIZES) if size >= FIT_FROM]
        fits[kind] = {"latency_us": latency * 1e6, "GBps": bandwidth / 1e9, "max_fit_error": max(fitted),
                      "points": [{"bytes": r["bytes"], "s": r["s"], "fit_error": e}
                                 for r, e in zip((r for r in result["rows"] if r["kind"] == kind), errors)]}
    rate = None if link == "loopback" else rate_Bps(link)
    return {"link": link, "hosts": hosts, "ranks_per_host": per_host, "world": n, "rate_GBps": rate and rate / 1e9,
            "cpu": machine.cpu_model(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "fits": fits,
            "overlap": overlap_probe(link, hosts, per_host, compute_ms=max(200.0, 2e3 * all_reduce_s(fits["all_reduce"], n)))}


def append(path: Path, record: dict) -> None:
    with path.open("a") as f:  # appended, never overwritten: perfmodel reads the newest line of a setting
        f.write(json.dumps(record) + "\n")


def all_reduce_s(fit: dict, n: int, nbytes: float = 4 * 2 ** 20) -> float:
    steps, fraction = ring_terms("all_reduce", n)
    return steps * fit["latency_us"] * 1e-6 + fraction * nbytes / (fit["GBps"] * 1e9)


def rate_Bps(rate: str) -> float:
    """tc's rate syntax (250mbit, 2gbit, 100mbps) in bytes/s."""
    value = rate.lower()
    unit = 8 if value.endswith("bit") else 1
    value = value.removesuffix("bit").removesuffix("bps")
    scale = {"k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}.get(value[-1], 1)
    return float(value.rstrip("kmgt")) * scale / unit


def table(result: dict) -> str:
    head = (f"{result['link']}, {result['hosts']} host(s) x {result['ranks_per_host']} rank(s), "
            f"world {result['world']}, gloo, {result['cpu']}")
    lines = [head, "", f"| op | latency/step | bandwidth | of the link's rate | worst fit error >= {FIT_FROM // 1024} KiB | "
             + " | ".join(f"{b // 1024} KiB (fit error)" for b in SIZES) + " |", "|---" * (5 + len(SIZES)) + "|"]
    for kind, f in result["fits"].items():
        share = f"{f['GBps'] / result['rate_GBps']:.2f}" if result["rate_GBps"] else "-"
        times = " | ".join(f"{p['s'] * 1e3:.2f} ms ({100 * p['fit_error']:+.0f}%)" for p in f["points"])
        lines.append(f"| {kind} | {f['latency_us']:.0f} us | {f['GBps'] * 1e3:.1f} MB/s | {share} | "
                     f"{100 * f['max_fit_error']:.0f}% | {times} |")
    o = result["overlap"]
    lines.append(f"\nOverlap (probe_allreduce.py, {o['size_mb']:g} MB): all-reduce {o['comm_ms']:.0f} ms, GEMMs "
                 f"{o['compute_ms']:.0f} ms, one after the other {o['sequential_ms']:.0f} ms, overlapped "
                 f"{o['overlapped_ms']:.0f} ms: {100 * o['hidden_frac']:.0f}% of the comm hidden, "
                 f"overlap_slowdown {o['overlap_slowdown']:.2f}")
    return "\n".join(lines)


def sharing(reps: int) -> dict:
    runs = {k: launch("loopback", 1, k, ["--sharing"], reps) for k in (1, 2, 4, 8)}
    ranks = {k: run["gemm_s"] for k, run in runs.items()}
    return {"ranks": ranks, "slowdown": {k: v / ranks[1] for k, v in ranks.items()}, "cores": machine.cores(),
            "collective_beside_gemms_s": {k: run["collective_s"] for k, run in runs.items() if k > 1}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--links", default="loopback,250mbit", help="comma-separated: loopback and/or tc rates")
    p.add_argument("--hosts", type=int, default=2, help="emulated hosts of a throttled link (loopback: 1)")
    p.add_argument("--ranks-per-host", type=int, default=1)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--sharing", action="store_true", help="instead: the same GEMMs on 1, 2, 4 and 8 ranks at once")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    cache = machine.cache_dir() / "comm_calibration.jsonl"
    if args.sharing:
        result = sharing(args.reps)
        append(cache, {"sharing": result, "cpu": machine.cpu_model(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")})
        print(f"{machine.cpu_model()}, {result['cores']} cores: single-threaded GEMMs, each rank alone vs together")
        print("\n| ranks | GEMMs | slowdown | a 4 KiB pair all-reduce beside them |\n|---|---|---|---|")
        for k, v in result["ranks"].items():
            beside = result["collective_beside_gemms_s"].get(k)
            print(f"| {k} | {v * 1e3:.1f} ms | {result['slowdown'][k]:.2f}x | "
                  f"{'-' if beside is None else f'+{beside * 1e3:.2f} ms'} |")
        return 0
    for link in args.links.split(","):
        hosts, per_host = (1, max(2, args.ranks_per_host)) if link == "loopback" else (args.hosts, args.ranks_per_host)
        result = calibrate(link, hosts, per_host, args.reps)
        append(cache, result)
        print(table(result) + "\n")
    print(f"appended to {cache}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
