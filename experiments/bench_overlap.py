"""Step time and exposed communication with each overlap off and on, on the emulated cluster.

    sudo .venv/bin/python experiments/bench_overlap.py [--steps 12] [--only tp dp pp] [--loopback] [--keep DIR]

Each case runs train.py across 2 emulated hosts (experiments/emucluster.py: network namespaces
joined by a throttled link, 1 rank each), in the layout its overlap needs: TP overlap at tp2
(chunked and domino), PP overlap at pp2 with interleaving, DP overlap at dp2 with ZeRO-2. The
link rate is per case, chosen so that communication is a real share of the step (PP moves far
fewer bytes than TP or DP). Figures are medians over the steps after the first three, from the
run's own metrics.jsonl: step time, exposed comm (blocked on TP/DP collectives and PP sends) and
bubble (blocked on PP receives: the schedule's own fill and drain, plus transfers not hidden).
--loopback runs the same cases on plain loopback for contrast: there gloo's copies and
reductions take CPU from the compute, so overlap helps less.

Results are appended to experiments/results/bench_overlap.jsonl (never overwritten) and printed
as a Markdown table: each overlap's cut in step time and in exposed communication (MegaScale
issue target: >= 15% and >= 50%).
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import machine  # noqa: E402
from corpus.__main__ import build_for  # noqa: E402
RESULTS = ROOT / "experiments" / "results" / "bench_overlap.jsonl"
COMMON = ["model=tiny", "train.batch_size=16", "train.seq_len=256", "precision=fp32", "logging.wandb.mode=disabled",
          "logging.progress=false", "train.eval_interval=0", "checkpoint.interval=0", "resume=none"]
CASES = {  # name: (link rate, layout overrides, {overlap label: overrides})
    "tp": ("1gbit", ["parallel.tp=2"], {
        "off": [], "chunked": ["parallel.overlap.tp=chunked", "parallel.overlap.tp_chunks=4"],
        "domino": ["parallel.overlap.tp=domino", "parallel.overlap.tp_chunks=4"]}),
    "pp": ("100mbit", ["parallel.pp=2", "parallel.vpp=2", "parallel.microbatches=4"], {
        "off": [], "on": ["parallel.overlap.pp=true"]}),
    "dp": ("250mbit", ["parallel.zero_stage=2"], {
        "off": [], "on": ["parallel.overlap.dp=true"]}),
}


def hardware(rate: str, loopback: bool) -> list:
    """The fabric, in the run's own config, for `python -m clustermodel validate`: this machine as 2 emulated
    hosts of 1 rank on links of this rate, or plain loopback (cpu_local)."""
    if loopback:
        return ["hardware=cpu_local"]
    gbit = float(rate.removesuffix("gbit")) if rate.endswith("gbit") else float(rate.removesuffix("mbit")) / 1000
    return ["hardware=emulated_2x2_250mbit", "hardware.perfmodel.devices_per_host=1",
            f"hardware.perfmodel.inter_host_Gbps={gbit:g}"]


def run(case: str, label: str, steps: int, loopback: bool, workdir: Path, keep: bool = False) -> dict:
    rate, layout, variants = CASES[case]
    run_dir = workdir / f"{case}_{label}{'_loopback' if loopback else ''}"
    fabric = ["--loopback", "--ranks-per-host", "2"] if loopback else ["--ranks-per-host", "1", "--bandwidth", rate]
    cmd = [sys.executable, "experiments/emucluster.py", "--hosts", "1" if loopback else "2", *fabric, "--timeout", "900",
           "--", "train.py", *COMMON, *hardware(rate, loopback), *layout, *variants[label], f"train.max_steps={steps}",
           f"hydra.run.dir={run_dir}"]
    build_for(cmd[cmd.index("train.py") + 1:])  # a job of several ranks never builds its corpus
    if keep:  # kept for python -m clustermodel validate, which prices it on this machine as measured around it (~20 s)
        machine.calibrate_beside(run_dir, "before")
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True)
    if keep:
        machine.calibrate_beside(run_dir, "after")
    row = {"case": case, "overlap": label, "fabric": "loopback" if loopback else f"2 hosts, {rate} links",
           "steps": steps, "when": datetime.datetime.now().isoformat(timespec="seconds")}
    if proc.returncode != 0:
        return row | {"error": (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1][:160]}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][3:]
    med = lambda key: statistics.median(r[key] for r in rows)
    return row | {"step_time": med("step_time"), "exposed_comm_s": med("exposed_comm_s"), "bubble_s": med("bubble_s"),
                  "loss": rows[-1]["loss"]}


def table(results: list) -> str:
    lines = ["| overlap | fabric | step time | exposed comm | bubble | Δ step time | Δ exposed comm (PP: bubble) |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['case']} {r['overlap']} | {r['fabric']} | failed: {r['error']} | | | | |")
            continue
        base = next(b for b in results if b["case"] == r["case"] and b["overlap"] == "off" and b["fabric"] == r["fabric"])
        def cut(key):  # change against overlap off on the same fabric: -30% is 30% less
            return "" if r is base else f"{(r[key] - base[key]) / max(base[key], 1e-9):+.0%}"
        lines.append(f"| {r['case'].upper()} {r['overlap']} | {r['fabric']} | {r['step_time']:.3f} s | "
                     f"{r['exposed_comm_s']:.3f} s | {r['bubble_s']:.3f} s | {cut('step_time')} | "
                     f"{cut('exposed_comm_s' if r['case'] != 'pp' else 'bubble_s')} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--only", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--loopback", action="store_true", help="plain loopback, one host, for contrast")
    parser.add_argument("--keep", type=Path, default=None, metavar="DIR",
                        help="keep each case's run dir under DIR (for `python -m clustermodel validate DIR`)")
    args = parser.parse_args()
    results = []
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.only:
            for label in CASES[case][2]:
                results.append(run(case, label, args.steps, args.loopback, args.keep or Path(tmp), args.keep is not None))
                print(json.dumps(results[-1]), file=sys.stderr, flush=True)
                with RESULTS.open("a") as f:
                    f.write(json.dumps(results[-1]) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
