"""A signalled rank's last state on disk (lastwords.LastWords): two gloo ranks, rank 0 wedged in an
all-reduce its peer never posts (its main thread inside gloo, where no Python signal handler runs)
and rank 1 asleep with a handler of its own installed first (as train.py's stop flag is)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT

RANK_SCRIPT = r"""
import os, signal, sys, time
from pathlib import Path
import torch, torch.distributed as dist
sys.path.insert(0, os.environ["REPO"])
from observe import diagnose, heartbeat, lastwords, oplog, timeline

rank, run_dir = int(os.environ["RANK"]), Path(os.environ["RUN_DIR"])
dist.init_process_group("gloo")
if rank == 1:  # the handler that was there before (train.py's stop flag, submitit's requeue)
    signal.signal(signal.SIGTERM, lambda s, f: (Path(run_dir, "previous_handler_ran").write_text(str(s)),
                                                os._exit(7)))
recorder = oplog.Recorder(oplog.ObserveConfig(), rank, {"rank": rank, "dp": rank, "pp": 0, "tp": 0}, {})
recorder.install()
lastwords.LastWords(recorder, run_dir)
beat = heartbeat.Heartbeat(run_dir, rank, 2, heartbeat.FTConfig(hang_timeout=600, heartbeat_interval=0.05), observer=recorder)
dist.all_reduce(torch.ones(4))
beat.progress(1, "compute")
time.sleep(0.5)  # the heartbeat writes the new phase; nothing changes after it for 60 s


def ready():  # once the main thread's all-reduce has begun its wait (the wrapper stamps it, then enters gloo)
    while rank == 0 and not (recorder.ops[-1][timeline.BYTES] == 32 and recorder.ops[-1][timeline.WAIT]):
        time.sleep(0.01)
    time.sleep(0.3)
    Path(run_dir, f"ready{rank}").write_text("")


import threading
threading.Thread(target=ready, daemon=True).start()
if rank == 0:
    dist.all_reduce(torch.ones(8))  # rank 1 never posts it
time.sleep(600)
"""


def _wait_for(path, seconds=60.0):
    deadline = time.time() + seconds
    while not path.exists():
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def signalled(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("signals")
    script = run_dir / "rank.py"
    script.write_text(RANK_SCRIPT)
    with __import__("socket").socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, str(script)], cwd=run_dir, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, env=dict(os.environ, REPO=str(ROOT), RUN_DIR=str(run_dir),
                                                                 RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                                                 MASTER_PORT=str(port), OMP_NUM_THREADS="1"))
             for r in range(2)]
    try:
        for r in range(2):
            _wait_for(run_dir / f"ready{r}")
        beats = {r: json.loads((run_dir / "heartbeat" / f"rank{r}.json").read_text()) for r in range(2)}
        sent, snaps = {}, {}
        for r in range(2):  # rank 0 first: its peer's exit would end its all-reduce
            sent[r] = time.time()
            procs[r].send_signal(signal.SIGTERM)
            time.sleep(1.0)
            snaps[r] = json.loads((run_dir / "observe" / "attempt0" / f"rank{r}.json").read_text())
            if r == 0:
                alive_after_term = procs[0].poll() is None
                procs[0].send_signal(signal.SIGABRT)  # fatal: faulthandler's stacks, then the default action
                procs[0].wait(timeout=30)
        codes = [p.wait(timeout=30) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return run_dir, beats, sent, snaps, alive_after_term, codes


def test_a_stop_signal_writes_the_wedged_ranks_snapshot_at_once(signalled):
    run_dir, beats, sent, snaps, alive_after_term, _ = signalled
    snap = snaps[0]
    assert [s["name"] for s in snap["signals"]] == ["SIGTERM"]
    # Newer than its last heartbeat's, written after the signal, though its main thread never left gloo
    assert beats[0]["time"] < sent[0] <= snap["signals"][0]["time"] <= snap["time"]
    assert alive_after_term  # its own handler (the default's) has not run: it waits in the collective
    blocked = [e for e in snap["ops"] if e[snap["fields"].index("done")] is None]
    assert [e[snap["fields"].index("op")] for e in blocked] == ["all_reduce"]
    assert any(line.startswith("rank.py:") for line in snap["stack"]), snap["stack"]


def test_the_handler_that_was_there_before_runs_after_the_snapshot(signalled):
    run_dir, beats, sent, snaps, _, codes = signalled
    assert [s["name"] for s in snaps[1]["signals"]] == ["SIGTERM"]
    assert beats[1]["time"] < snaps[1]["time"]
    assert (run_dir / "previous_handler_ran").read_text() == str(int(signal.SIGTERM)) and codes[1] == 7


def test_a_fatal_signal_leaves_every_threads_stack_beside_the_snapshot(signalled):
    run_dir, _, _, _, _, codes = signalled
    assert codes[0] == -signal.SIGABRT
    stacks = (run_dir / "observe" / "attempt0" / "rank0.stacks.txt").read_text()
    assert "Fatal Python error: Aborted" in stacks
    assert "all_reduce" in stacks and "rank.py" in stacks
    assert stacks.count("hread 0x") >= 3  # the main thread, the heartbeat's and the signal watcher's


def test_the_diagnosis_says_which_rank_was_signalled_and_which_died_of_a_fatal_signal(signalled):
    from observe import diagnose
    run_dir = signalled[0]
    diagnosis = diagnose.diagnose(run_dir)
    assert {r: [s["name"] for s in got] for r, got in diagnosis["signals"].items()} == {0: ["SIGTERM"], 1: ["SIGTERM"]}
    assert diagnosis["fatal"] == {0: "Fatal Python error: Aborted"}
    report = (run_dir / "observe" / "report.txt").read_text()
    assert "rank 0 received SIGTERM" in report and "rank 0: Fatal Python error: Aborted" in report
