"""Fault injection: one training job under torchrun --max-restarts takes every fault below
in turn, and the table says, per fault, how fast it was detected, that the job restarted, how
many steps were lost, and whether the final loss equals an uninterrupted run's.

    python experiments/faults.py --ranks 4            # the table for the closing note
    python experiments/faults.py --ranks 2 --steps 12  # what tests/test_ft.py runs

The faults (fault_injection.py injects them from MEGAREPRO_FAULT; each fires once, in the attempt it names):
  launch 1, attempt 0  kill -9 of rank 1 at step 3        -> torchrun restarts every rank
           attempt 1  rank 0 hangs at step 5               -> heartbeat watchdog, exit 75, restart
           attempt 2  the disk is full at step 6's save    -> logged, older checkpoints kept, goes on
           attempt 2  slow disk; SIGTERM (preemption) while the step-8 async save is being written
                      -> the ranks finish it, save where they stop, exit 0
  launch 2 (as SLURM's requeue would relaunch)
           attempt 0  rank 0 truncates the newest checkpoint, then kill -9 of itself at step 11
                      -> restart; the truncated checkpoint fails its manifest and is skipped
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from corpus.__main__ import build_for  # noqa: E402

TINY = ["model=tiny", "model.vocab_size=512", "data.bpe_vocab_size=512", "data.max_bytes=1500000",
        "train.seq_len=64", "train.batch_size=8", "precision=fp32", "logging.wandb.mode=disabled",
        "logging.progress=false", "train.eval_interval=0", "logging.interval=1000"]
FT = ["checkpoint.interval=2", "checkpoint.async_save=true", "checkpoint.keep=0", "ft.hang_timeout=5",
      "ft.heartbeat_interval=0.5", "parallel.zero_stage=1"]
LAUNCH_1 = "kill:1@3,hang:0@5#1,disk_full@6#2,slow_save@2#2"
LAUNCH_2 = "truncate:0@11"
SIGTERM_AT = 8  # the step whose async save is in flight when the SIGTERM comes (attempt 2)


def torchrun(ranks: int, run_dir: Path, steps: int, faults: str = "", extra=()) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
           "--max-restarts=3", "train.py", *TINY, *FT, f"train.max_steps={steps}", f"hydra.run.dir={run_dir}", *extra]
    env = dict(os.environ, MEGAREPRO_FAULT=faults, PYTHONUNBUFFERED="1", WANDB_MODE="disabled")
    log = open(run_dir.parent / f"{run_dir.name}.log", "a")
    # a session of its own: the SIGTERM goes to torchrun only, as a scheduler's would to the job step
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def rows(run_dir) -> list:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def preempt_during_save(proc: subprocess.Popen, run_dir: Path, timeout: float = 300) -> float:
    """SIGTERM torchrun once attempt 2 has logged step SIGTERM_AT (its slow async save is then
    being written). Returns when it was sent."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if any(r["step"] == SIGTERM_AT and r["attempt"] == 2 for r in rows(run_dir)):
            sent = time.time()
            proc.send_signal(signal.SIGTERM)
            return sent
        time.sleep(0.05)
    raise RuntimeError(f"attempt 2 never reached step {SIGTERM_AT} (torchrun exit {proc.poll()})")


def run_scenario(ranks: int, out: Path, steps: int = 12) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    reference, faulty = out / "uninterrupted", out / "faulty"
    ref = torchrun(ranks, reference, steps)
    if ref.wait() != 0:
        raise RuntimeError(f"the uninterrupted run failed: see {reference}.log")
    first = torchrun(ranks, faulty, steps, LAUNCH_1)
    sigterm_at = preempt_during_save(first, faulty)
    code_1 = first.wait()
    second = torchrun(ranks, faulty, steps, LAUNCH_2)
    code_2 = second.wait()
    statuses = [a["status"] for a in json.loads((faulty / "run.json").read_text())["attempts"]]
    return {"ranks": ranks, "run_dir": str(faulty), "exit_codes": [code_1, code_2], "attempts": statuses,
            "sigterm_at": sigterm_at,
            "reference_loss": rows(reference)[-1]["loss"], "table": table(faulty, sigterm_at, rows(reference)[-1])}


FAILED = re.compile(r"^E(\d{4}) (\d\d:\d\d:\d\d\.\d+) .*failed \(exitcode: (-?\d+)\)")


def torchrun_saw_failures(log: Path) -> list:
    """[(unix time, exit code)] of each worker failure torchrun's agent logged."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        m = FAILED.match(line)
        if m:
            day = time.strftime("%Y") + m.group(1)
            t = time.mktime(time.strptime(day + " " + m.group(2).split(".")[0], "%Y%m%d %H:%M:%S"))
            out.append((t + float("0." + m.group(2).split(".")[1]), int(m.group(3))))
    return out


def table(run_dir: Path, sigterm_at: float, reference: dict) -> list:
    """One row per fault, from faults.jsonl (what was injected and detected, when), run.json's
    attempts (when each restart began) and metrics.jsonl (which steps each attempt logged)."""
    events = [json.loads(line) for line in (run_dir / "faults.jsonl").read_text().splitlines()]
    attempts = json.loads((run_dir / "run.json").read_text())["attempts"]
    logged = rows(run_dir)

    def first(kind):
        return min((e for e in events if e["event"] == kind), key=lambda e: e["time"])

    def after(t):
        """(index, start) of the first attempt begun after time t, and the step it resumed from."""
        k = next(i for i, a in enumerate(attempts) if a["started_unix"] > t)
        steps = [r["step"] for r in logged if r["attempt"] == k]
        return k, attempts[k]["started_unix"], (min(steps) - 1 if steps else None)

    seen = torchrun_saw_failures(run_dir.parent / f"{run_dir.name}.log")

    def noticed(t):  # when torchrun's agent logged the first worker failure after t
        return min((when for when, code in seen if when >= t - 1.0), default=float("nan")) - t

    out = []
    kill = first("injected_kill")
    k, start, resumed = after(kill["time"])
    out.append(dict(fault="kill -9 of one rank", step=kill["step"], detected_s=noticed(kill["time"]),
                    how=f"torchrun's agent saw the rank die; training again {start - kill['time']:.0f} s after",
                    restarted=True, steps_lost=kill["step"] - resumed))
    hang, found = first("injected_hang"), first("hang_detected")
    k, start, resumed = after(found["time"])
    # idle_s: the detecting rank's time without progress, counted from its last mark, which comes
    # before the injection by the step's tail (longer on a loaded machine), so detected_s alone
    # can be under hang_timeout
    out.append(dict(fault="a rank hangs", step=hang["step"], detected_s=found["time"] - hang["time"],
                    idle_s=found["idle_s"],
                    how=f"heartbeat watchdog (ft.hang_timeout=5): rank {found['behind_rank']} behind in "
                        f"{found['behind_phase']}", restarted=True, steps_lost=hang["step"] - resumed))
    full = first("injected_disk_full")
    out.append(dict(fault="disk full during a save", step=full["step"], detected_s=0.0,
                    how="the save's OSError, on every rank; previous checkpoints kept, training went on",
                    restarted=False, steps_lost=0))
    k, start, resumed = after(sigterm_at)
    stopped = max(r["step"] for r in logged if r["attempt"] == k - 1)
    out.append(dict(fault="SIGTERM during an async save", step=SIGTERM_AT, detected_s=None,
                    how=f"ranks finished the in-flight save, saved at step {stopped}, exited 0; relaunched",
                    restarted=True, steps_lost=stopped - resumed))
    cut = first("injected_truncate")
    k, start, resumed = after(cut["time"])
    log = (run_dir.parent / f"{run_dir.name}.log").read_text(errors="replace")
    skipped = f"skipping checkpoint: {cut['folder']}" in log
    verdict = "failed its manifest and was skipped" if skipped else "was NOT detected"
    out.append(dict(fault="truncated checkpoint file", step=cut["step"], detected_s=None,
                    how=f"newest ({Path(cut['folder']).name}) truncated, then kill -9; at resume it {verdict}",
                    restarted=True, steps_lost=cut["step"] - resumed))
    final = logged[-1]
    out[-1]["detected"] = skipped
    for row in out:
        row["final_loss_equal"] = final["step"] == reference["step"] and final["loss"] == reference["loss"]
    return out


def markdown(result: dict) -> str:
    lines = [f"Fault injection, {result['ranks']} gloo ranks, tiny model, checkpoint every 2 steps (async), "
             f"final loss {result['reference_loss']:.6f} uninterrupted",
             "", "| fault | at step | detected in | how | restarted | steps lost | final loss equal |",
             "|---|---|---|---|---|---|---|"]
    for r in result["table"]:
        detected = "" if r["detected_s"] is None else f"{r['detected_s']:.1f} s"
        lines.append(f"| {r['fault']} | {r['step']} | {detected} | {r['how']} | {'yes' if r['restarted'] else 'no (not needed)'} "
                     f"| {r['steps_lost']} | {'yes' if r['final_loss_equal'] else 'NO'} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / time.strftime("faults-%Y-%m-%d_%H-%M-%S"))
    args = p.parse_args(argv)
    build_for(TINY)  # a job of several ranks never builds its corpus
    result = run_scenario(args.ranks, args.out, args.steps)
    text = markdown(result)
    print(text)
    with open(args.out / "faults.md", "a") as f:  # appended, never overwritten
        f.write(text + "\n")
    with open(ROOT / "experiments" / "results" / "faults.jsonl", "a") as f:
        f.write(json.dumps({**result, "when": time.strftime("%Y-%m-%dT%H:%M:%S")}) + "\n")


if __name__ == "__main__":
    main()
