"""The CI stress pass: the riskiest cases of experiments/stress.py, CI_STRESS_RUNS runs
each beside a CPU hog. A rank that aborts after "done", a hang, a stray warning or a run that does
not repeat bitwise fails CI here rather than at random on a fresh machine."""
import json
import sys

import pytest

from conftest import CI_STRESS_RUNS, ROOT

sys.path.insert(0, str(ROOT / "experiments"))
import stress  # noqa: E402


@pytest.mark.parametrize("name", stress.CI_CASES)
def test_the_riskiest_cases_exit_cleanly_and_repeat_bitwise(name, ci_stress):
    tally = ci_stress(name)
    assert tally.runs == CI_STRESS_RUNS
    counts = {"failed": tally.failed, "hung": tally.hung, "signal": tally.signal, "differ": tally.differ,
              "stray": tally.stray}
    assert counts == dict.fromkeys(counts, 0), (counts, [str(d) for d in tally.dirs])


def test_the_tally_counts_what_went_wrong():
    """What stress.run_once reads from a run, on torchrun's own words for a rank killed after done."""
    err = ("[2026-11-25 17:37:49,311][train][INFO] - resumed from x (step 3)\n"
           "terminate called without an active exception\n"
           "  traceback : Signal 6 (SIGABRT) received by PID 4242\n")
    own = [line for line in err.splitlines() if stress.OWN_LOG_LINE.match(line)]
    assert len(own) == 1 and [m.group(2) for m in stress.SIGNAL.finditer(err)] == ["SIGABRT"]
    tally = stress.Tally()
    good = {"rc": 0, "hung": False, "signals": [], "stray": [], "seconds": 1.0, "losses": [(6.0, None)],
            "weights_sha256": "a"}
    tally.add(good)
    tally.add({**good, "weights_sha256": "b"})                       # same losses, other weights
    tally.add({**good, "rc": 1, "signals": ["SIGABRT"], "stray": ["terminate called"]})
    tally.add({**good, "rc": -9, "hung": True})
    assert (tally.runs, tally.failed, tally.hung, tally.signal, tally.differ, tally.stray) == (4, 2, 1, 1, 1, 1)
    assert tally.bad() == 2 + 1 + 1


def test_a_cut_off_stress_run_goes_on_where_it_stopped(tmp_path, monkeypatch):
    """Given an --out whose runs.jsonl holds some runs, only the missing ones are made, and the
    recorded ones count in the tally (a run cut off mid-way left no record and is made again)."""
    good = {"rc": 0, "hung": False, "signals": [], "stray": [], "seconds": 1.0, "losses": [[6.0, None]],
            "weights_sha256": "a"}
    records = [{"case": "single", "i": 1, "run_dir": str(tmp_path / "single/001"), **good},
               {"case": "single", "i": 0, "run_dir": str(tmp_path / "single/000"), **good, "weights_sha256": "b"},
               {"case": "dp2_zero1", "i": 0, "run_dir": str(tmp_path / "dp2_zero1/000"), **good}]
    torn = json.dumps({"case": "dp2_zero1", "i": 1, **good})[:40]   # killed while writing run 1's record
    (tmp_path / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + torn)
    stale = tmp_path / "dp2_zero1" / "001" / "metrics.jsonl"   # the cut-off run's: must not carry over
    stale.parent.mkdir(parents=True)
    stale.write_text('{"step": 1, "loss": 9.0}\n')
    made = []
    # a run made now holds tuples where the records read back hold lists: still the same losses
    made_now = {**good, "losses": [(6.0, None)]}
    monkeypatch.setattr(stress, "run_once", lambda case, run_dir, *a: made.append(run_dir) or dict(made_now))
    tallies = stress.stress(["single", "dp2_zero1"], 2, 0, 60, tmp_path, tmp_path, progress=lambda line: None)
    assert made == [tmp_path / "dp2_zero1" / "001"] and not stale.exists()
    assert (tallies["single"].runs, tallies["single"].differ) == (2, 1)  # run 0 is the reference
    assert (tallies["dp2_zero1"].runs, tallies["dp2_zero1"].differ) == (2, 0)
    assert len((tmp_path / "runs.jsonl").read_text().splitlines()) == 5
    assert set(stress.recorded_runs(tmp_path)) == {"single", "dp2_zero1"} and len(stress.recorded_runs(tmp_path)["dp2_zero1"]) == 2


def test_each_ci_case_runs_on_the_worker_of_the_modules_that_read_it():
    """conftest.STRESS_GROUPS puts each case of the pass, and the modules that read its first run,
    in one xdist scope: a case split from its readers would run twice, on two workers."""
    from conftest import STRESS_GROUPS, scope_of
    grouped = [case for _, cases in STRESS_GROUPS.values() for case in cases]
    assert sorted(grouped) == sorted(stress.CI_CASES)
    stress_test = "tests/test_stress.py::test_the_riskiest_cases_exit_cleanly_and_repeat_bitwise"
    readers = {"resume_pp2_vpp2": "tests/test_checkpoint.py::test_resume_at_the_same_layout_is_bitwise",
               "tp2_pp2_dp2_overlap": "tests/test_rehearsal.py::test_a_real_8_rank_run_and_its_rehearsal_post_"
                                      "the_same_collectives",
               "pp2_vpp2_overlap": "tests/test_parallel.py::test_layout_equals_single_process[pp2_vpp2_overlap]"}
    for case, reader in readers.items():
        assert scope_of(f"{stress_test}[{case}]") == scope_of(reader) != scope_of("tests/test_model.py::test_x")
    assert len({scope_of(f"{stress_test}[{case}]") for case in stress.CI_CASES}) == len(STRESS_GROUPS)


def test_the_pass_and_a_timing_test_never_load_the_cores_at_once(tmp_path_factory):
    """conftest.cpu_load_lock: the pass's cases hold it shared, so they may run side by side; a
    timing test (tests/test_emulated_link.py) holds it exclusively, so it waits for the pass and
    the pass for it."""
    import fcntl

    from conftest import cpu_load_lock, cpu_load_lock_path

    def free(mode) -> bool:  # could another holder take it now (another open file: flock's unit)
        with open(cpu_load_lock_path(tmp_path_factory), "a") as f:
            try:
                fcntl.flock(f, mode | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            fcntl.flock(f, fcntl.LOCK_UN)
            return True

    with cpu_load_lock(tmp_path_factory, exclusive=False):
        assert free(fcntl.LOCK_SH) and not free(fcntl.LOCK_EX)
    with cpu_load_lock(tmp_path_factory, exclusive=True):
        assert not free(fcntl.LOCK_SH) and not free(fcntl.LOCK_EX)
    assert free(fcntl.LOCK_EX)
