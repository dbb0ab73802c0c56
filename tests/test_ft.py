"""Fault tolerance (fault_injection.py, observe/heartbeat.py, experiments/faults.py): every fault it injects injected into one real
torchrun job on 2 gloo ranks, detected, restarted from, and finishing with the uninterrupted
run's loss, bit for bit (resume at the same layout is exact)."""
import gc
import json
import re
import sys
import time

import pytest

import fault_injection
import launch
from conftest import ROOT
from observe import heartbeat

sys.path.insert(0, str(ROOT / "experiments"))
import faults  # noqa: E402


@pytest.fixture(scope="module")
def scenario(tmp_path_factory, cache_dir, monkeypatch_module):
    monkeypatch_module.setenv("MEGAREPRO_CACHE", str(cache_dir))
    monkeypatch_module.setenv("HF_DATASETS_OFFLINE", "1")
    return faults.run_scenario(2, tmp_path_factory.mktemp("faults"), steps=12)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_every_fault_is_survived_with_the_uninterrupted_final_loss(scenario):
    # launch 1 ends at the SIGTERM (its ranks stop cleanly; torchrun's own exit code after a
    # SIGTERM varies), launch 2 finishes; killed and hung attempts never finish their record
    assert scenario["exit_codes"][1] == 0 and scenario["attempts"][-1] == "finished"
    assert scenario["attempts"].count("interrupted") == 1, scenario["attempts"]
    # metrics.jsonl is only appended to: the steps that killed attempts logged are still there,
    # and logged again, tagged with the later attempt, after the restart
    logged = [(r["attempt"], r["step"]) for r in faults.rows(scenario["run_dir"])]
    assert logged == sorted(logged) and len(logged) > len({s for _, s in logged}) == 12
    rows = {r["fault"]: r for r in scenario["table"]}
    assert len(rows) == 5 and all(r["final_loss_equal"] for r in rows.values()), scenario["table"]
    # Saves are asynchronous: when a rank dies the newest save may still be being written, so the
    # newest complete checkpoint is at most two intervals back (one, had the save finished).
    interval = 2
    kill, hang = rows["kill -9 of one rank"], rows["a rank hangs"]
    assert kill["restarted"] and 0 < kill["steps_lost"] <= 2 * interval and kill["detected_s"] < 10
    assert hang["restarted"] and 0 < hang["steps_lost"] <= 2 * interval
    # ft.hang_timeout=5 after the detecting rank's last progress (never earlier), checked every
    # 0.5 s; that progress precedes the hang by the step's tail, so the hang itself is found
    # after it (never before) and within the timeout and a check or two
    assert hang["idle_s"] >= 5 and 0 < hang["detected_s"] <= 5 + 3
    assert "rank 0 behind" in hang["how"]
    assert rows["disk full during a save"]["steps_lost"] == 0
    assert rows["SIGTERM during an async save"]["steps_lost"] == 0
    # the newest complete checkpoint is the broken one: the one before it, an interval more
    cut = rows["truncated checkpoint file"]
    assert cut["detected"] and "skipped" in cut["how"] and 0 < cut["steps_lost"] <= 3 * interval


def test_faults_are_parsed_per_attempt(monkeypatch):
    monkeypatch.setenv("MEGAREPRO_FAULT", "kill:1@3,hang:0@5#1,disk_full@6#1,slow_save@2.5")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert fault_injection.planned_faults() == [("hang", 0, 5.0), ("disk_full", None, 6.0)]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert fault_injection.planned_faults() == [("kill", 1, 3.0), ("slow_save", None, 2.5)]


def test_gc_runs_only_at_its_interval():
    collector = launch.CollectGarbage(3)
    try:
        assert not gc.isenabled()
        garbage = []
        garbage.append(garbage)  # a cycle only the collector frees
        del garbage
        before = gc.get_count()[0]
        assert collector.after_step(1) == 0.0 and gc.get_count()[0] >= before
        assert collector.after_step(3) > 0.0 and gc.get_count()[0] < before
    finally:
        collector.close()
    assert gc.isenabled()


def test_the_imports_objects_are_frozen_and_what_the_run_makes_is_still_collected():
    """train.py freezes what its imports made, so a collection walks only the run's own objects;
    a cycle made afterwards (a finished job's model and groups, at launch.shutdown) is still freed."""
    import weakref
    import train  # noqa: F401
    assert gc.isenabled()  # the importer's setting, restored after the imports
    assert gc.get_freeze_count() > 100_000  # torch's, DCP's and dynamo's objects

    class Node:
        pass
    node = Node()
    node.cycle = node
    alive = weakref.ref(node)
    del node
    gc.collect()
    assert alive() is None


def test_a_slowed_rank_sleeps_its_own_time_times_the_factor_less_one_and_its_waits_not(monkeypatch, tmp_path):
    from parallelisms.overlap import WaitClock
    monkeypatch.setenv("MEGAREPRO_FAULT", "slow:1@1.5,spike:1@4,slow:0@3")
    clock, slept = [100.0], []
    monkeypatch.setattr(fault_injection.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(fault_injection.time, "sleep", slept.append)
    waits = WaitClock()
    waits.seconds = {"comm": 0.0}

    def forward_backward():  # 2 s of its own, 1 s of it waiting in a collective
        clock[0] += 2.0
        waits.seconds["comm"] += 1.0
    step = [3]
    slowed = fault_injection.Faults(1, tmp_path).slowing(lambda: step[0], waits)  # a hook around each compute
    with slowed(backward=True):
        forward_backward()
    step[0] = 4
    with slowed(backward=True):
        forward_backward()
    assert slept == [pytest.approx(0.5), pytest.approx(1.0 * (1.5 * fault_injection.SPIKE - 1))]
    assert fault_injection.Faults(2, tmp_path).slowing(lambda: 1) is None  # not its fault: no hook


def test_the_hang_timer_spares_a_slow_first_step_but_not_a_later_hang(tmp_path, cache_dir):
    """A first step that takes 5 s longer (as one that compiles and connects does) under a 2 s
    hang timeout runs to its end, and rank 0 logs how long it took; a hang in step 2 is still
    caught (exit HANG_EXIT, recorded at step 2)."""
    from conftest import SMALL, read_metrics, run_train
    proc = run_train(tmp_path, SMALL + ["train.max_steps=5", "ft.hang_timeout=2", "ft.first_step_timeout=60",
                                        "ft.heartbeat_interval=0.2"], cache_dir, check=False,
                     MEGAREPRO_FAULT="slow_first_step@5,hang@2")
    assert proc.returncode == heartbeat.HANG_EXIT, proc.stderr[-2000:]
    events = [json.loads(line) for line in (tmp_path / "faults.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "hang_detected"] == [2]
    assert [r["step"] for r in read_metrics(tmp_path)] in ([1], [1, 2])  # step 2 hangs after its row, if flushed
    took = re.search(r"step 1 took (\d+\.\d) s", proc.stdout + proc.stderr)
    assert took and float(took.group(1)) >= 5


def test_the_first_steps_allowance_ends_with_the_first_step(monkeypatch, tmp_path):
    """The heartbeat's own clock: while step 1 runs it waits first_step_timeout, after it hang_timeout."""
    cfg = heartbeat.FTConfig(hang_timeout=0.5, first_step_timeout=30, heartbeat_interval=0.05)
    beat = heartbeat.Heartbeat(tmp_path, 0, 1, cfg, "torch.compile of every chunk")
    hangs = []
    monkeypatch.setattr(beat, "_report_hang", hangs.append)
    try:
        beat.progress(1, "data")
        beat.progress(1, "compute")
        assert beat.timeout() == 30
        time.sleep(1.0)
        assert hangs == []
        beat.progress(2, "data")
        assert beat.timeout() == 0.5 and beat.first_step_s >= 1.0
        deadline = time.monotonic() + 30
        while not hangs and time.monotonic() < deadline:
            time.sleep(0.05)
        assert hangs and hangs[0] > 0.5
    finally:
        beat.close()


def test_the_heartbeat_file_is_written_at_most_every_tenth_of_the_hang_timeout(monkeypatch, tmp_path):
    """A shared file system sees a rank's heartbeat file rewritten once per hang_timeout/10, not per
    heartbeat_interval (~100 checks here, one a step); a rank that stops has its last state in the
    file within that time, which is what a hang report reads."""
    cfg = heartbeat.FTConfig(hang_timeout=2.0, first_step_timeout=30, heartbeat_interval=0.01)
    writes, replace = [], heartbeat.os.replace
    monkeypatch.setattr(heartbeat.os, "replace", lambda a, b: (writes.append(time.monotonic()), replace(a, b)))
    beat = heartbeat.Heartbeat(tmp_path, 0, 1, cfg)
    try:
        beat.progress(1, "data")
        beat.progress(1, "compute")
        time.sleep(0.1)
        start, step = time.monotonic(), 1
        while time.monotonic() - start < 1.0:
            step += 1
            beat.progress(step, "data")
            beat.progress(step, "compute")
            time.sleep(0.01)
        later = [t for t in writes if t > start]
        assert 1 <= len(later) <= 1.0 / 0.2 + 2, len(later)
        assert all(b - a >= 0.2 - 1e-3 for a, b in zip(later, later[1:]))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and json.loads((tmp_path / "heartbeat" / "rank0.json").read_text())["step"] != step:
            time.sleep(0.05)
        assert json.loads((tmp_path / "heartbeat" / "rank0.json").read_text())["step"] == step
    finally:
        beat.close()
