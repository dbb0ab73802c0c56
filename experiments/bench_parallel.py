"""Step time and tokens/s of each parallel layout on 2 CPU ranks (gloo over loopback).

    .venv/bin/python experiments/bench_parallel.py [--steps 20] [--layouts tp2 pp2 ...] [--keep DIR] [overrides ...]

Each layout runs train.py under torchrun on the same model and global batch; the figures are the
medians over the steps after the first three (warm-up) from the run's own metrics.jsonl. On 2
cores the two ranks share the CPU with gloo's copies, so this measures overheads of the
layouts relative to each other, not what a GPU cluster would see (see experiments/emucluster.py).
"""
import argparse
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
LAYOUTS = {
    "single (1 rank)": (1, []),
    "dp2 zero0": (2, ["parallel.zero_stage=0"]),
    "dp2 zero1": (2, ["parallel=dp2_zero1"]),
    "dp2 zero2": (2, ["parallel=dp2_zero2"]),
    "tp2": (2, ["parallel=tp2"]),
    "tp2 PTB": (2, ["parallel=tp2", "model.block=parallel"]),  # MegaScale step 1: half the TP collectives
    "pp2 (1F1B)": (2, ["parallel=pp2"]),
    "pp2 vpp2 (interleaved)": (2, ["parallel=pp2_vpp2"]),
}


def run(name: str, ranks: int, overrides: list, steps: int, extra: list, workdir: Path, keep: bool = False) -> dict:
    run_dir = workdir / name.replace(" ", "_").replace("(", "").replace(")", "")
    launcher = [sys.executable, "train.py"] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", "train.py"]
    cmd = launcher + overrides + [f"train.max_steps={steps}", "logging.wandb.mode=disabled", "logging.progress=false",
                                  "train.eval_interval=0", "resume=none", f"hydra.run.dir={run_dir}"] + extra
    env = dict(os.environ, OMP_NUM_THREADS="1" if ranks > 1 else os.environ.get("OMP_NUM_THREADS", "2"))
    build_for(overrides + extra)  # a job of several ranks never builds its corpus
    if keep:  # kept for python -m clustermodel validate, which prices it on this machine as measured around it (~20 s)
        machine.calibrate_beside(run_dir, "before")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if keep:
        machine.calibrate_beside(run_dir, "after")
    if proc.returncode != 0:
        return {"name": name, "error": proc.stderr.strip().splitlines()[-1][:120]}
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()][3:]
    return {"name": name, "ranks": ranks, "step_time": statistics.median(r["step_time"] for r in rows),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows), "loss": rows[-1]["loss"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS))
    parser.add_argument("--keep", type=Path, default=None, metavar="DIR",
                        help="keep each layout's run dir under DIR (for `python -m clustermodel validate DIR`)")
    parser.add_argument("overrides", nargs="*", help="extra train.py overrides for every layout")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.layouts:
            ranks, overrides = LAYOUTS[name]
            results.append(run(name, ranks, overrides, args.steps, args.overrides, args.keep or Path(tmp),
                               args.keep is not None))
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    base = next((r for r in results if "step_time" in r), None)
    print("| layout | ranks | step time (s) | tokens/s | vs single | final loss |")
    print("|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['name']} | | failed: {r['error']} | | | |")
            continue
        print(f"| {r['name']} | {r['ranks']} | {r['step_time']:.3f} | {r['tokens_per_s']:,.0f} | "
              f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x | {r['loss']:.3f} |")


if __name__ == "__main__":
    main()
