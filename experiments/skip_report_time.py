#!/usr/bin/env -S sh -c 'p="$(dirname "$0")/../.venv/bin/python"; [ -x "$p" ] || p=python3; exec "$p" "$0" "$@"'
"""How long a skipped collective takes to become a hang report: one 2-rank pipeline job (pp 2,
tiny model) in which rank 1 skips one collective of step 3 (MEGAREPRO_FAULT=skip:1@3), under
torchrun --max-restarts=1, so the job reports, exits 75, resumes from its checkpoint and finishes.

    python experiments/skip_report_time.py                   # ft and observe at their defaults
    python experiments/skip_report_time.py --short            # the tests' timeouts (tests/test_observe.py)
    python experiments/skip_report_time.py --run-dir DIR      # only read a finished run

It prints one JSON line: post_to_report_s, from the healthy ranks' post of the op the skipped rank
never posted (their op log's post time) to the hang report's line in faults.jsonl (its `time`);
whether it came early (observe.stall_s) or at ft.hang_timeout; the root it names; post_to_desync_s,
when the desync check (observe.desync_every) reported the skipped op's group first; and the job's
wall time and exit code. Both times are the same host's clock (one machine).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from corpus.__main__ import build_for  # noqa: E402

TINY = ["model=tiny", "model.vocab_size=512", "data.bpe_vocab_size=512", "data.max_bytes=1500000",
        "train.seq_len=64", "train.batch_size=8", "logging.wandb.mode=disabled", "logging.progress=false",
        "train.eval_interval=0", "logging.interval=1000", "parallel.pp=2", "parallel.microbatches=2",
        "train.max_steps=5", "checkpoint.interval=2"]
SHORT = ["ft.hang_timeout=3", "ft.heartbeat_interval=0.1", "observe.stall_s=1"]  # test_observe's


def measure(run_dir: Path) -> dict:
    """post_to_report_s and the report's root, from faults.jsonl and the reporting attempt's snapshots."""
    from observe import hangs, timeline
    events = [json.loads(line) for line in (run_dir / "faults.jsonl").read_text().splitlines()]
    event = next(e for e in events if e["event"] == "hang_detected" and "root" in e)
    root = event["root"]
    posts = []
    for path in hangs.snapshot_dir(run_dir, event["attempt"]).glob("rank*.json"):
        snap = json.loads(path.read_text())
        posts += [e[timeline.POST] for e in snap["ops"] if e[timeline.GROUP] == root["group"]
                  and e[timeline.SEQ] == root["seq"] and e[timeline.PEER] is None and e[timeline.OP] == root["op"]]
    config = json.loads((run_dir / "run.json").read_text())["config"]
    ft, obs = config["ft"], config["observe"]
    settings = {"ft.hang_timeout": ft["hang_timeout"], "ft.heartbeat_interval": ft["heartbeat_interval"],
                "observe.stall_s": obs["stall_s"]}
    return {"settings": settings, "post_to_report_s": round(event["time"] - min(posts), 2), "early": event["early"],
            "idle_s": round(event["idle_s"], 2),
            "post_to_desync_s": next((round(e["time"] - min(posts), 2) for e in events if e["event"] == "desync"
                                      and e["attempt"] == event["attempt"]), None),
            "root": {k: root[k] for k in ("rank", "reason", "op", "group", "dim", "seq")}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--short", action="store_true", help="the tests' short timeouts instead of the defaults")
    p.add_argument("--run-dir", type=Path, default=None, help="read this run instead of running one")
    args = p.parse_args(argv)
    out = {}
    run_dir = args.run_dir
    if run_dir is None:
        build_for(TINY)  # a job of several ranks never builds its corpus
        run_dir = ROOT / "outputs" / f"skip_report_{time.strftime('%Y%m%d_%H%M%S')}"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "--max-restarts=1", "train.py", *TINY, *(SHORT if args.short else []), f"hydra.run.dir={run_dir}"]
        env = dict(os.environ, MEGAREPRO_FAULT="skip:1@3", OMP_NUM_THREADS="1", WANDB_MODE="disabled")
        start = time.monotonic()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        out.update(job_wall_s=round(time.monotonic() - start, 1), exit_code=proc.returncode)
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
    out.update(measure(run_dir), run_dir=str(run_dir))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
