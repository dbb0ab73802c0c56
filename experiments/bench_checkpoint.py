"""How long a checkpoint save holds training up: synchronous against asynchronous (the
target: the async stall is at most 10% of the sync one).

    python experiments/bench_checkpoint.py                 # the small model (162M), one process
    python experiments/bench_checkpoint.py --model tiny --steps 6

Runs train.py twice with a save after every step, once per mode, and reads each save's stall
from run.json (final.checkpoint_stall_s: the time from the start of save() until training may go
on; for async that is the snapshot to host memory, plus any wait for the previous write). Prints
a Markdown table and appends the figures to experiments/results/bench_checkpoint.jsonl.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(mode: str, args, out: Path) -> dict:
    run_dir = out / mode
    cmd = [sys.executable, "train.py", f"model={args.model}", f"train.max_steps={args.steps}",
           f"train.batch_size={args.batch}", f"train.seq_len={args.seq}", "precision=fp32", "train.eval_interval=0",
           "logging.wandb.mode=disabled", "logging.progress=false", "checkpoint.interval=1", "checkpoint.keep=2",
           f"checkpoint.async_save={mode == 'async'}", "resume=none", f"hydra.run.dir={run_dir}"]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    final = json.loads((run_dir / "run.json").read_text())["final"]
    steps = [json.loads(line)["step_time"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    newest = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    size = sum(p.stat().st_size for p in newest.iterdir())
    stalls = final["checkpoint_stall_s"][1:]  # the first save also warms up the writer
    return {"mode": mode, "stall_s": statistics.median(stalls), "stalls_s": final["checkpoint_stall_s"],
            "step_s": statistics.median(steps[1:]), "checkpoint_bytes": size}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="checkpoint stall: async against sync")
    p.add_argument("--model", default="small")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_checkpoint-") as tmp:
        sync, asyn = (run(mode, args, Path(tmp)) for mode in ("sync", "async"))
    ratio = asyn["stall_s"] / sync["stall_s"]
    print(f"model={args.model}, one process, fp32, {sync['checkpoint_bytes'] / 2**20:,.0f} MiB per checkpoint, "
          f"a save after every step, medians over saves 2..{args.steps}\n")
    print("| save | training stalled per save | step time (without the save) |\n|---|---|---|")
    for r in (sync, asyn):
        print(f"| {r['mode']} | {r['stall_s']:.3f} s | {r['step_s']:.2f} s |")
    print(f"\nasync stall / sync stall = {ratio:.1%} (target <= 10%)")
    record = {"when": time.strftime("%Y-%m-%dT%H:%M:%S"), "args": vars(args), "sync": sync, "async": asyn,
              "ratio": ratio}
    with open(ROOT / "experiments" / "results" / "bench_checkpoint.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
