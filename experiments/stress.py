"""Stress: run the multi-rank layouts the tests use again and again, under load, and count what
went wrong. A rare abort after "done" fails CI on a fresh machine; this is where rare
things get counted.

    .venv/bin/python experiments/stress.py                        # every case, N=30, one CPU hog
    .venv/bin/python experiments/stress.py --cases ci --n 3       # the pass CI runs (tests/test_stress.py)
    .venv/bin/python experiments/stress.py --cases pp2_vpp2,resume_pp2_vpp2 --n 50 --hog 2
    .venv/bin/python experiments/stress.py --out stress/<time>     # go on with a run that was cut off

The cases are the tests' own commands, taken from them so the two never drift: every layout of
tests/test_parallel.py (each overlap switch and the data pipeline among them) and the saves and
resumes of tests/test_checkpoint.py (resume at the same and at other layouts, asynchronous saves).
Each run has its own run dir under --out. Beside the runs, --hog busy processes compete for the
cores, as on a loaded CI machine. Counted per case:
  failed   runs that exited non-zero (hung and signalled runs included)
  hung     runs past --timeout, killed
  signal   runs with a rank killed by a signal (torchrun reports "Signal 6 (SIGABRT)")
  differ   runs whose losses (and val loss) or final weights are not bitwise those of the case's
           first good run
  stray    runs with stderr lines that are not the run's own log lines (warnings, C++ aborts,
           tracebacks: a clean run prints nothing else there)
The table is appended to experiments/results/stress.md (with the command, commit and CPU) and
every run's record to <out>/runs.jsonl. All cases at N=30 take hours on 2 cores; given an --out that
already holds a runs.jsonl, the harness counts the runs recorded there and makes only the missing ones
(a machine restart then costs one run, not the whole study).
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402

import checkpoint  # noqa: E402
import machine  # noqa: E402
from conftest import EIGHT_RANKS, EXACT, train_env  # noqa: E402
from test_checkpoint import ARGS as RESUME_ARGS, ASYNC_ARGS, PP2_VPP2, SAVED_AT  # noqa: E402
from test_parallel import LAYOUTS  # noqa: E402
from corpus.__main__ import build_for  # noqa: E402

RESULTS = ROOT / "experiments" / "results" / "stress.md"
OWN_LOG_LINE = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\]\[[\w.]+\]\[[A-Z]+\] - ")
SIGNAL = re.compile(r"Signal (\d+) \((SIG\w+)\)")


@dataclass
class Case:
    ranks: int
    args: list
    needs: str = ""  # a case whose run this one resumes from (run once, before it)


def cases() -> dict:
    """name -> Case: the tests' commands, each ending in a checkpoint whose weights are compared."""
    found = {"single": Case(1, EXACT)}
    found.update({name: Case(ranks, EXACT + overrides) for name, (ranks, overrides) in LAYOUTS.items()})
    found["tp2_pp2_dp2_overlap"].args += ["rehearse.record=true"]  # as the tests run it (conftest.eight_rank_run)
    # test_checkpoint: 5 steps at tp2 x dp2 saving at step 3, then resumes from that step at the
    # same layout and at three others; and asynchronous saves (one rank, and at tp2 x dp2).
    found["saved_tp2_dp2"] = Case(4, RESUME_ARGS + SAVED_AT + ["checkpoint.interval=3"])
    resumes = {"resume_tp2_dp2": (4, SAVED_AT), "resume_single": (1, ["parallel.zero_stage=0"]),
               "resume_pp2_vpp2": (2, PP2_VPP2),
               "resume_dp2_zero2": (2, ["parallel.zero_stage=2"])}
    for name, (ranks, layout) in resumes.items():
        found[name] = Case(ranks, RESUME_ARGS + layout + ["checkpoint.interval=5"], needs="saved_tp2_dp2")
    found["async_single"] = Case(1, ASYNC_ARGS + ["checkpoint.async_save=true"])
    found["async_tp2_dp2"] = Case(4, ASYNC_ARGS + SAVED_AT + ["checkpoint.async_save=true"])
    return found


# The riskiest four, which CI runs at N=3: the resume that aborted once, the 8-rank layout
# with every overlap on, asynchronous saves across ranks, and the interleaved pipeline with overlap.
CI_CASES = ["resume_pp2_vpp2", "tp2_pp2_dp2_overlap", "async_tp2_dp2", "pp2_vpp2_overlap"]
assert all(name in cases() for name in CI_CASES)
assert cases()["tp2_pp2_dp2_overlap"].args == EXACT + EIGHT_RANKS + ["rehearse.record=true"]


def command(case: Case, run_dir: Path, resume_from: Path | None) -> list:
    launcher = [sys.executable, "train.py"] if case.ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={case.ranks}", "train.py"]
    resume = [f"resume={checkpoint.step_dir(resume_from / 'checkpoints', 3)}"] if resume_from else []
    return launcher + case.args + resume + [f"hydra.run.dir={run_dir}"]


def run_once(case: Case, run_dir: Path, resume_from: Path | None, cache: Path, timeout: float) -> dict:
    """One run in its own process group (a hung one is killed whole), and what it left."""
    env = train_env(cache, **({"OMP_NUM_THREADS": 1} if case.ranks > 1 else {}))
    build_for(case.args, cache)  # a job of several ranks never builds its corpus
    t0 = time.monotonic()
    proc = subprocess.Popen(command(case, run_dir, resume_from), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        hung = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        hung = True
    (run_dir / "stdout.txt").write_text(out)
    (run_dir / "stderr.txt").write_text(err)
    record = {"run_dir": str(run_dir), "rc": proc.returncode, "hung": hung, "seconds": round(time.monotonic() - t0, 1),
              "signals": sorted({m.group(2) for m in SIGNAL.finditer(err)}
                                | ({signal.Signals(-proc.returncode).name} if proc.returncode < 0 and not hung else set())),
              "stray": [line for line in err.splitlines() if line.strip() and not OWN_LOG_LINE.match(line)]}
    if proc.returncode == 0:
        record.update(outcome(run_dir))
    return record


def outcome(run_dir: Path) -> dict:
    """Losses (and val losses) step by step, and a digest of the final checkpoint's weights."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    final = checkpoint.complete_checkpoints(run_dir / "checkpoints")[-1]
    digest = hashlib.sha256()
    for name, tensor in sorted(checkpoint.consolidate_model(final).items()):
        digest.update(name.encode())
        digest.update(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    # lists, not tuples: a record read back from runs.jsonl (a study resumed in another process)
    # must compare equal to one made here
    return {"losses": [[r["loss"], r.get("val_loss")] for r in rows], "final_step": final.name,
            "weights_sha256": digest.hexdigest()}


@dataclass
class Tally:
    runs: int = 0
    failed: int = 0
    hung: int = 0
    signal: int = 0
    differ: int = 0
    stray: int = 0
    seconds: list = field(default_factory=list)
    reference: dict | None = None
    dirs: list = field(default_factory=list)  # every run's dir, in order
    good: list = field(default_factory=list)  # those of runs that exited 0

    def add(self, record: dict) -> None:
        self.runs += 1
        self.failed += record["rc"] != 0
        self.hung += record["hung"]
        self.signal += bool(record["signals"])
        self.stray += bool(record["stray"])
        self.seconds.append(record["seconds"])
        if record["rc"] == 0:
            # as JSON holds it: a record made here and one read back from runs.jsonl compare alike
            mine = (json.loads(json.dumps(record["losses"])), record["weights_sha256"])
            if self.reference is None:
                self.reference = {"losses": mine[0], "weights_sha256": mine[1]}
            self.differ += mine != (self.reference["losses"], self.reference["weights_sha256"])

    def bad(self) -> int:
        return self.failed + self.differ + self.stray


class Hog:
    """`count` processes spinning on a core each, for as long as the stress runs."""

    def __init__(self, count: int):
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
            p.wait()


def stress(names: list, n: int, hog: int, timeout: float, out: Path, cache: Path, progress=print) -> dict:
    """Every case in `names`, n runs each, beside `hog` busy processes: {name: Tally}. Runs already
    recorded in out/runs.jsonl count and are not made again."""
    setups, recorded = {}, recorded_runs(out)
    with Hog(hog):
        return {name: stress_case(name, n, timeout, out, cache, setups, progress, recorded.get(name, []))
                for name in names}


def recorded_runs(out: Path) -> dict:
    """name -> the records of out/runs.jsonl for that case, in run order (a run cut off mid-way left
    no record and is made again)."""
    found: dict = {}
    log = out / "runs.jsonl"
    for line in log.read_text().splitlines() if log.exists() else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # the line being written when the harness was killed: made again
            continue
        found.setdefault(record["case"], {})[record["i"]] = record
    return {name: [by_index[i] for i in sorted(by_index)] for name, by_index in found.items()}


def stress_case(name: str, n: int, timeout: float, out: Path, cache: Path, setups: dict, progress=print,
                recorded: list = ()) -> Tally:
    """n runs of one case in out/<name>/<i>, after the run it resumes from (once, kept in setups);
    the `recorded` runs (from an earlier, cut-off invocation) count first."""
    case, tally = cases()[name], Tally()
    out.mkdir(parents=True, exist_ok=True)
    recorded = list(recorded)[:n]
    for record in recorded:
        tally.add(record)
        tally.dirs.append(Path(record["run_dir"]))
        if record["rc"] == 0:
            tally.good.append(Path(record["run_dir"]))
    if len(recorded) == n:
        return tally
    if case.needs and case.needs not in setups and checkpoint.complete_checkpoints(out / case.needs / "setup" / "checkpoints"):
        setups[case.needs] = out / case.needs / "setup"  # made by the cut-off invocation
    if case.needs and case.needs not in setups:
        setup_dir = out / case.needs / "setup"
        if setup_dir.exists():  # cut off before it saved
            shutil.rmtree(setup_dir)
        setup_dir.mkdir(parents=True)
        record = run_once(cases()[case.needs], setup_dir, None, cache, timeout)
        if record["rc"] != 0:
            raise RuntimeError(f"stress: the setup run {case.needs} failed ({record['rc']}): see {setup_dir}")
        setups[case.needs] = setup_dir
    with (out / "runs.jsonl").open("a+") as log:
        log.seek(0)
        if log.read()[-1:] not in ("", "\n"):  # a torn last line: the next record starts a line of its own
            log.write("\n")
        for i in range(len(recorded), n):
            run_dir = out / name / f"{i:03d}"
            if run_dir.exists():  # a run cut off before its record: its metrics and checkpoints must not carry over
                shutil.rmtree(run_dir)
            run_dir.mkdir(parents=True)
            record = {"case": name, "i": i, **run_once(case, run_dir, setups.get(case.needs), cache, timeout)}
            tally.add(record)
            tally.dirs.append(run_dir)
            if record["rc"] == 0:
                tally.good.append(run_dir)
            log.write(json.dumps(record) + "\n")
            log.flush()
            progress(f"{name} {i + 1}/{n}: rc {record['rc']}, {record['seconds']} s"
                     + (f", signals {record['signals']}" if record["signals"] else "")
                     + (f", {len(record['stray'])} stray stderr lines" if record["stray"] else ""))
    return tally


def table(tallies: dict) -> str:
    lines = ["| case | ranks | runs | failed | hung | signal | differ | stray stderr | median s |",
             "|---|---|---|---|---|---|---|---|---|"]
    known = cases()
    for name, t in tallies.items():
        median = sorted(t.seconds)[len(t.seconds) // 2] if t.seconds else float("nan")
        lines.append(f"| {name} | {known[name].ranks} | {t.runs} | {t.failed} | {t.hung} | {t.signal} | {t.differ} "
                     f"| {t.stray} | {median:.0f} |")
    total = sum(t.bad() for t in tallies.values())
    lines.append(f"\n{sum(t.runs for t in tallies.values())} runs, {total} with a failure, a difference or stray output.")
    return "\n".join(lines)


def append_results(text: str, argv: list, n: int, hog: int, path: Path = RESULTS) -> None:
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    heading = (f"\n## {datetime.datetime.now():%Y-%m-%d %H:%M} | git {git} | {machine.cpu_model()}, "
               f"{os.cpu_count()} cores | N={n}, {hog} CPU hog(s)\n\n`python experiments/stress.py {' '.join(argv)}`\n\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:  # appended, never overwritten
        f.write(heading + text + "\n")


def main(argv: list | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="all", help="all, ci, or names separated by commas: " + ", ".join(cases()))
    p.add_argument("--n", type=int, default=30, help="runs of each case")
    p.add_argument("--hog", type=int, default=1, help="busy processes beside the runs")
    p.add_argument("--timeout", type=float, default=600, help="seconds before a run counts as hung")
    p.add_argument("--out", type=Path, default=None, help="where the run dirs go (default stress/<time>)")
    p.add_argument("--results", type=Path, default=RESULTS, help="the Markdown file the table is appended to")
    args = p.parse_args(argv)
    names = list(cases()) if args.cases == "all" else CI_CASES if args.cases == "ci" else args.cases.split(",")
    unknown = [n for n in names if n not in cases()]
    if unknown:
        print(f"stress: --cases: unknown case {unknown[0]!r}. Fix: use all, ci, or some of {', '.join(cases())}",
              file=sys.stderr)
        return 2
    out = args.out or ROOT / "stress" / f"{datetime.datetime.now():%Y-%m-%d_%H-%M-%S}"
    cache = Path(os.environ.get("MEGAREPRO_CACHE") or machine.cache_dir())
    print(f"stress: {len(names)} cases x {args.n} runs, {args.hog} hog(s) | {machine.cpu_model()} | runs in {out}")
    tallies = stress(names, args.n, args.hog, args.timeout, out, cache)
    text = table(tallies)
    print(text)
    append_results(text, argv, args.n, args.hog, args.results)
    return 1 if any(t.bad() for t in tallies.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
