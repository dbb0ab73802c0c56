"""A slow link told apart from a slow rank on the emulated cluster (experiments/emucluster.py):
one host's link throttled far below the others' is named as a link problem, its dp group's
ranks listed, and no rank is reported as a compute straggler (observe/stragglers.py).

The layout: 4 hosts of 1 rank each, tp 2 dp 2. Each emulated host stands for one GPU with its own
NIC, as MegaScale's hosts give every GPU one: the dp groups are ranks {0, 2} and {1, 3}, and host
3's link slows only the second's DP transfers (and the TP pair {2, 3}, whose waits are no part of
a DP floor). The model is sized so that DP's gradients (3 M floats a rank) cost the throttled link
a third of the step while the compute stays above a CPU's scheduling noise: on 2 cores its 4 ranks
alone lose ~10 ms a step each to preemption, beside the CI stress pass up to 300 ms, so the run holds
conftest.cpu_load_lock and never runs beside that pass.

    pytest tests/test_emulated_link.py -q      # as root, with iproute2 (else skipped)
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from observe import diagnose
from conftest import SMALL, cpu_load_lock, read_metrics, train_env

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "experiments"))
import emucluster  # noqa: E402

NO_NAMESPACES = emucluster.why_no_namespaces()
THROTTLED_HOST = 3  # its rank too: one rank a host
LAYOUT = ["parallel.tp=2", "parallel.dp=2", "model.n_layers=2", "model.d_model=512", "train.batch_size=4",
          "ft.straggler_interval=5", "ft.straggler_windows=3", "train.max_steps=20"]  # a verdict at step 20


@pytest.fixture(scope="module")
def throttled_run(tmp_path_factory, cache_dir):
    run_dir = tmp_path_factory.mktemp("throttled")
    small = [a for a in SMALL if not a.startswith("train.batch_size=")]
    cmd = [sys.executable, str(REPO / "experiments" / "emucluster.py"), "--hosts", "4", "--bandwidth", "none",
           "--host-bandwidth", f"{THROTTLED_HOST}=600mbit", "--timeout", "240", "--",
           str(REPO / "train.py"), *small, *LAYOUT, f"hydra.run.dir={run_dir}"]
    with cpu_load_lock(tmp_path_factory, exclusive=True):  # never beside the CI stress pass (conftest)
        proc = subprocess.run(cmd, cwd=REPO, env=train_env(cache_dir, OMP_NUM_THREADS=1), capture_output=True,
                              text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir


@pytest.mark.skipif(NO_NAMESPACES is not None, reason=f"emulated hosts need namespaces: {NO_NAMESPACES}")
def test_a_throttled_host_is_a_link_verdict_and_no_compute_straggler(throttled_run):
    verdicts = [v for row in read_metrics(throttled_run) for v in row.get("straggler_verdicts", [])]
    assert verdicts, "no verdict"
    assert {(v["kind"], tuple(v["ranks"])) for v in verdicts} == {("link", (1, THROTTLED_HOST))}, verdicts
    # named as soon as the rule allows: 3 of 4 five-step windows, read a window late
    assert min(v["first_step"] for v in verdicts) == 20
    assert all(v["slowdown"] > 2 and v["cost_pct"] > 10 for v in verdicts)
    diagnosis = diagnose.diagnose(throttled_run)
    assert [(s["rank"], s["kind"]) for s in diagnosis["stragglers"]] == [(1, "link")]
