"""The cluster tools launch real multi-process jobs: experiments/emucluster.py (hosts as network
namespaces with throttled links) and experiments/slurm/local_cluster.sh (a one-node SLURM).

What must hold: a job across emulated hosts computes the right all_reduce; a throttled link is
really slower; a failing script, a lost host, or a SIGTERM leave no namespace and no process
behind and set the exit code; without root or iproute2 it falls back to loopback; and a 2-task SLURM job
runs probe_allreduce through launch.init_distributed's SLURM mapping.

    pytest tests/test_cluster_tools.py -x -q               # all (SLURM: starts a local cluster)
    pytest tests/test_cluster_tools.py -x -q -m "not slurm"
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EMUCLUSTER = REPO / "experiments" / "emucluster.py"
PROBE = REPO / "experiments" / "probe_allreduce.py"
LOCAL_SLURM = REPO / "experiments" / "slurm" / "local_cluster.sh"

sys.path.insert(0, str(EMUCLUSTER.parent))
import emucluster  # noqa: E402

NO_NAMESPACES = emucluster.why_no_namespaces()
needs_namespaces = pytest.mark.skipif(NO_NAMESPACES is not None, reason=f"emulated hosts need namespaces: {NO_NAMESPACES}")

# a job that stays in collectives until killed: for the lost-host and SIGTERM cases
HANG = """
import time, torch, torch.distributed as dist
dist.init_process_group("gloo")
print("ready", dist.get_rank(), flush=True)
t = torch.ones(1000)
while True:
    dist.all_reduce(t)
    time.sleep(0.05)
"""


def emucluster_cmd(*args: str) -> list[str]:
    return [sys.executable, str(EMUCLUSTER), *args]


def run_emucluster(*args: str, timeout: float = 120) -> tuple[int, str, int]:
    """(exit code, output, emucluster's pid) of one run."""
    proc = subprocess.Popen(emucluster_cmd(*args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out, proc.pid


def probe_results(out: str) -> list[dict]:
    """The JSON lines of probe_allreduce, with emucluster's [hK] prefixes taken off."""
    rows = []
    for line in out.splitlines():
        body = line.split("] ", 1)[1] if line.startswith("[") and "] " in line else line
        if body.startswith("{"):
            rows.append(json.loads(body))
    return rows


def leftovers(pid: int, marker: str) -> tuple[list[str], list[int]]:
    """Namespaces of the emucluster with this pid, and live processes whose command line has marker."""
    namespaces = [ns for ns in emucluster.namespaces() if ns.startswith(f"{emucluster.PREFIX}{pid}-")]
    procs = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if marker in cmdline and int(entry.name) != os.getpid():
                procs.append(int(entry.name))
    return namespaces, procs


@pytest.fixture(scope="module")
def link_runs():
    """probe_allreduce on 2 hosts x 1 rank, with 2gbit links, and with host 1's link at 200mbit."""
    probe = ["--", str(PROBE), "--size-mb", "4", "--iters", "3", "--skip-overlap"]
    fast = run_emucluster("--hosts", "2", "--bandwidth", "2gbit", *probe)
    slow = run_emucluster("--hosts", "2", "--bandwidth", "2gbit", "--host-bandwidth", "1=200mbit", *probe)
    return fast, slow


@needs_namespaces
def test_two_hosts_allreduce_is_correct(link_runs):
    (code, out, pid), _ = link_runs
    assert code == 0, out
    rows = probe_results(out)
    # the probe exits 1 on a wrong sum; every rank must also have reported from its own host
    assert sorted((r["rank"], r["host"]) for r in rows) == [(0, "h0"), (1, "h1")], out
    assert all(r["world"] == 2 and r["correct"] for r in rows)
    assert "h0=10.77.0.1@2gbit, h1=10.77.0.2@2gbit" in out
    assert leftovers(pid, str(PROBE)) == ([], [])


@needs_namespaces
def test_slow_link_is_slower(link_runs):
    (fast_code, fast_out, _), (slow_code, slow_out, _) = link_runs
    assert fast_code == 0 and slow_code == 0, slow_out
    assert "h1=10.77.0.2@200mbit" in slow_out
    fast = max(r["comm_ms"] for r in probe_results(fast_out))
    slow = max(r["comm_ms"] for r in probe_results(slow_out))
    # 4 MB over 200 Mbit/s is ~170 ms on the wire, 10x the 2 Gbit/s link; ask for much less than that
    assert slow > 2 * fast, (fast, slow)


@needs_namespaces
def test_failing_script_exit_code_propagates_and_cleans_up(tmp_path):
    script = tmp_path / "fail3.py"
    script.write_text("import sys\nsys.exit(3)\n")
    code, out, pid = run_emucluster("--hosts", "2", "--", str(script))
    assert code == 3, out  # torchrun says 1; emucluster reports the script's own code
    assert "exit codes h0=3, h1=3" in out
    assert leftovers(pid, str(script)) == ([], [])


@needs_namespaces
def test_killed_host_fails_the_job_and_cleans_up(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    code, out, pid = run_emucluster("--hosts", "2", "--kill-host", "1", "--after", "5", "--grace", "5",
                                    "--timeout", "90", "--", str(script))
    assert "killing host h1" in out
    assert code == 128 + signal.SIGKILL, out
    survivor = int(out.split("exit codes h0=")[1].split(",")[0])
    assert survivor != 0, out  # host 0 noticed the loss (or was killed after --grace), it did not succeed
    assert leftovers(pid, str(script)) == ([], [])


@needs_namespaces
def test_sigterm_cleans_up(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    proc = subprocess.Popen(emucluster_cmd("--hosts", "2", "--timeout", "90", "--", str(script)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        ready, deadline = 0, time.monotonic() + 90
        while ready < 2 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            ready += "] ready " in line
        assert ready == 2, "the ranks never connected"
        assert len(leftovers(proc.pid, str(script))[0]) == 3  # two hosts and the switch, while running
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "interrupted (SIGTERM)" in out
    assert leftovers(proc.pid, str(script)) == ([], [])


def test_loopback_fallback():
    """Without root, or without iproute2, one torchrun on loopback runs the same job."""
    env = dict(os.environ)
    if os.geteuid() == 0:
        # as root, hide tc (Debian keeps it in /usr/sbin only) to take the no-iproute2 path
        env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if not p.endswith("sbin"))
        if shutil.which("tc", path=env["PATH"]):
            pytest.skip("tc is on PATH outside sbin; cannot hide iproute2 to test the fallback")
        expected = "iproute2 (ip, tc) not installed; running one torchrun with 2 ranks on loopback instead"
    else:
        expected = "not root; running one torchrun with 2 ranks on loopback instead"
    proc = subprocess.run(emucluster_cmd("--hosts", "2", "--", str(PROBE), "--size-mb", "1", "--iters", "1",
                                         "--skip-overlap"), capture_output=True, text=True, timeout=120, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert expected in out
    rows = probe_results(out)
    assert sorted(r["rank"] for r in rows) == [0, 1] and all(r["correct"] for r in rows), out


def test_without_root_it_runs_on_loopback():
    """A launch by a user who is not root: the same job, on loopback, and
    it says why. The tests run as root here, and the venv's Python lives in root's home, out of
    another user's reach; so emucluster runs with os.geteuid answering a user's uid."""
    as_user = ("import os, runpy, sys; os.geteuid = lambda: 1000; sys.argv = sys.argv[1:]; "
               "runpy.run_path(sys.argv[0], run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", as_user, str(EMUCLUSTER), "--hosts", "2", "--", str(PROBE),
                           "--size-mb", "1", "--iters", "1", "--skip-overlap"], capture_output=True, text=True,
                          timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "emucluster: not root; running one torchrun with 2 ranks on loopback instead" in out
    rows = probe_results(out)
    assert sorted(r["rank"] for r in rows) == [0, 1] and all(r["correct"] for r in rows), out


# --- SLURM --------------------------------------------------------------------------------------

JOB = """#!/bin/bash
#SBATCH --job-name=megarepro-probe --ntasks=2 --overcommit --time=5
export OMP_NUM_THREADS=1
srun --overcommit {python} {probe} --size-mb 1 --iters 1 --skip-overlap
"""


def slurm_up() -> bool:
    return subprocess.run(["bash", str(LOCAL_SLURM), "status"], capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def local_slurm():
    """The local one-node cluster: started here if it was not up, and then stopped here."""
    was_up = slurm_up()
    if not was_up:
        if os.geteuid() != 0:
            pytest.skip("no SLURM cluster up, and starting the local one needs root")
        start = subprocess.run(["bash", str(LOCAL_SLURM), "start"], capture_output=True, text=True, timeout=300)
        assert start.returncode == 0, start.stdout + start.stderr
    yield
    if not was_up:
        subprocess.run(["bash", str(LOCAL_SLURM), "stop"], capture_output=True, timeout=60)


@pytest.mark.slurm
def test_slurm_two_task_allreduce(local_slurm, tmp_path):
    srun = subprocess.run(["srun", "-n2", "--overcommit", "hostname"], capture_output=True, text=True, timeout=60)
    assert srun.returncode == 0 and len(srun.stdout.split()) == 2, srun.stderr

    job = tmp_path / "probe.sbatch"
    job.write_text(JOB.format(python=sys.executable, probe=PROBE))
    output = tmp_path / "probe.out"
    job_id = subprocess.run(["sbatch", "--parsable", f"--output={output}", f"--chdir={REPO}", str(job)],
                            capture_output=True, text=True, check=True, timeout=30).stdout.strip().split(";")[0]
    # sbatch --wait polls with a backoff that adds ~30 s; squeue every half second does not
    deadline = time.monotonic() + 120
    while subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True).stdout.strip():
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job_id])
            pytest.fail(f"SLURM job {job_id} still queued or running after 120 s")
        time.sleep(0.5)
    state = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
    text = output.read_text()
    assert "JobState=COMPLETED" in state and "ExitCode=0:0" in state, state + text
    rows = probe_results(text)
    # ranks and world came from SLURM_PROCID / SLURM_NTASKS via launch.init_distributed
    assert sorted(r["rank"] for r in rows) == [0, 1], text
    assert all(r["world"] == 2 and r["correct"] for r in rows), text


TRAIN_SBATCH = REPO / "experiments" / "slurm" / "train.sbatch"
TINY = ["model=tiny", "model.vocab_size=512", "data.bpe_vocab_size=512", "data.max_bytes=1500000",
        "train.seq_len=64", "train.batch_size=8", "logging.wandb.mode=disabled", "logging.progress=false",
        "train.eval_interval=0", "precision=fp32"]


def wait_for_job(job_id: str, timeout: float) -> str:
    """Poll squeue until the job has left the queue; returns `scontrol show job`'s text."""
    deadline = time.monotonic() + timeout
    while subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True).stdout.strip():
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job_id])
            pytest.fail(f"SLURM job {job_id} still queued or running after {timeout:.0f} s")
        time.sleep(0.5)
    return subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout


# The preempted runs: 2 ranks at tp2, saving only where a preemption stops them (checkpoint.interval=0).
PREEMPTED = [*TINY, "parallel.tp=2", "train.max_steps=40", "checkpoint.interval=0"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, cache_dir):
    """PREEMPTED's losses, run straight through by torchrun outside SLURM."""
    from conftest import read_metrics, run_train
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    run_train(run_dir, PREEMPTED, cache_dir, nproc=2)
    return [r["loss"] for r in read_metrics(run_dir)]


def preempt_when_running(run_dir: Path, signal_job) -> None:
    """Signal the job once its run has logged 8 steps, then let the requeued job start at once."""
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 240
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 8):
        assert time.monotonic() < deadline, "the job logged no steps in 240 s"
        time.sleep(0.5)
    job_id = signal_job()
    # SLURM holds a requeued job back for a while (its begin time moves ~2 minutes ahead); a
    # test need not wait for that, so release it once it is pending again
    deadline = time.monotonic() + 120
    while "JobState=PENDING" not in (show := subprocess.run(["scontrol", "show", "job", job_id],
                                                             capture_output=True, text=True).stdout):
        assert time.monotonic() < deadline and "JobState=COMPLETED" not in show, show
        time.sleep(0.5)
    # ...but not before the node has cleaned up the first run: started while it is still
    # "completing", the job is killed at once ("Job credential revoked"). On a loaded machine (the
    # suite's other worker) the ranks' checkpoint and exit take longer: the wait has its own deadline.
    deadline = time.monotonic() + 300
    while subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True).stdout.strip() != "idle":
        assert time.monotonic() < deadline, "the node never went idle after the first run"
        time.sleep(0.5)
    time.sleep(2)
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True, timeout=30)


def assert_resumed_from_the_stop_step(run_dir: Path, uninterrupted: list, log: str) -> None:
    """One checkpoint, at the step the preemption stopped at; the requeued run resumed from it and
    logged each later step once, with the uninterrupted run's losses, bit for bit."""
    saved = sorted((run_dir / "checkpoints").glob("step_*"))
    assert len(saved) == 1, saved
    stop = int(saved[0].name.split("_")[1])
    assert f"saving a checkpoint at step {stop} and exiting cleanly" in log and f"(step {stop})" in log, log[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 41)) and 8 <= stop < 40, log[-3000:]
    assert [r["loss"] for r in rows] == uninterrupted
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "finished" and record["final"]["steps"] == 40


@pytest.mark.slurm
def test_sbatch_training_job_requeues_on_preemption_and_resumes(local_slurm, tmp_path, cache_dir, uninterrupted):
    """experiments/slurm/train.sbatch on the local cluster (a node with no GPUs: --gpus-per-node=0):
    a 2-rank CPU job (srun, then torchrun rendezvous) gets the preemption signal mid-run, saves at
    the step its ranks agree on, requeues itself, and resumes from that step in the same run dir.
    Its save is slowed past torchrun's default grace after SIGTERM (30 s), as a 175B save is, and
    still completes."""
    run_dir, output = tmp_path / "run", tmp_path / "job.out"
    env = dict(os.environ, PYTHON=sys.executable, NPROC="2", RUN_DIR=str(run_dir), OMP_NUM_THREADS="1",
               MEGAREPRO_CACHE=str(cache_dir), HF_DATASETS_OFFLINE="1", MEGAREPRO_FAULT="slow_save@32")
    job_id = subprocess.run(
        ["sbatch", "--parsable", f"--output={output}", f"--chdir={REPO}", "--gpus-per-node=0", "--time=10",
         str(TRAIN_SBATCH), *PREEMPTED],
        capture_output=True, text=True, check=True, timeout=30, env=env).stdout.strip().split(";")[0]

    def signal_batch_shell():
        subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], check=True, timeout=30)
        return job_id
    preempt_when_running(run_dir, signal_batch_shell)
    state = wait_for_job(job_id, 400)
    text = output.read_text()
    assert "JobState=COMPLETED" in state and "Restarts=1" in state, state + text[-3000:]
    assert "preemption signal" in text and "requeueing job" in text, text[-3000:]
    assert_resumed_from_the_stop_step(run_dir, uninterrupted, text)


BAD_LAYOUT = ["model=tiny", "data.tokenizer=bytes", "model.vocab_size=257", "parallel.tp=2", "parallel.dp=2"]
BAD_LAYOUT_LINE = "config error: parallel.tp: tp=2 must divide"
# srun's own tasks as ranks, task 0 started 8 s after the others (a sitecustomize only it runs), and
# srun ending the step's other tasks as soon as one exits with an error
SRUN_TASKS = """#!/bin/bash
#SBATCH --job-name=megarepro-bad-input --ntasks=4 --overcommit --time=5
export OMP_NUM_THREADS=1 PYTHONPATH={site}
srun --kill-on-bad-exit=1 --overcommit {python} train.py {args} hydra.run.dir={run_dir}
"""


@pytest.mark.slurm
def test_bad_input_under_slurm_is_one_line(local_slurm, tmp_path, cache_dir):
    """A layout that does not fit 4 ranks. Through train.sbatch: its preflight says so in one line
    before srun starts a torchrun (the job's ranks never start). As srun's own 4 tasks, task 0 the
    last to find it: the line is printed once, not lost when srun ends the other tasks."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text('import os, time\nif os.environ.get("SLURM_PROCID") == "0":\n    time.sleep(8)\n')
    script = tmp_path / "tasks.sbatch"
    script.write_text(SRUN_TASKS.format(site=site, python=sys.executable, args=" ".join(BAD_LAYOUT),
                                        run_dir=tmp_path / "tasks"))
    env = dict(os.environ, PYTHON=sys.executable, NPROC="4", RUN_DIR=str(tmp_path / "sbatch"),
               MEGAREPRO_CACHE=str(cache_dir), HF_DATASETS_OFFLINE="1")
    jobs = {}
    for name, job in (("sbatch", [f"--gpus-per-node=0", "--time=5", str(TRAIN_SBATCH), *BAD_LAYOUT]),
                      ("tasks", [str(script)])):
        output = tmp_path / f"{name}.out"
        job_id = subprocess.run(["sbatch", "--parsable", f"--output={output}", f"--chdir={REPO}", *job],
                                capture_output=True, text=True, check=True, timeout=30, env=env).stdout.strip()
        jobs[name] = (job_id.split(";")[0], output)
    for name, (job_id, output) in jobs.items():
        state, text = wait_for_job(job_id, 240), output.read_text()
        assert "JobState=FAILED" in state, state + text[-3000:]  # srun's code is its killed tasks' (143)
        assert text.count(BAD_LAYOUT_LINE) == 1, text[-3000:]
    sbatch = jobs["sbatch"][1].read_text()
    assert "torch.distributed" not in sbatch and "ExitCode=2:0" in wait_for_job(jobs["sbatch"][0], 10), sbatch


@pytest.mark.slurm
def test_submitit_multirun_runs_each_job_as_slurm_tasks(local_slurm, tmp_path, cache_dir):
    """hydra/launcher=submitit_slurm: a 2-step ablation multirun, each job one SLURM job of 2 tasks
    (no torchrun: the ranks come from SLURM_PROCID/SLURM_NTASKS); the run dirs land in the sweep
    dir the submitting process named, and tables.py reads their metrics back."""
    sweep = tmp_path / "sweep"
    env = dict(os.environ, OMP_NUM_THREADS="1", MEGAREPRO_CACHE=str(cache_dir), HF_DATASETS_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "train.py", "-m", "hydra/launcher=submitit_slurm", "experiment=megascale_ablation",
         "ablation.step=0,1", *TINY, "parallel.pp=1", "parallel.dp=1", "train.max_steps=4", "checkpoint.interval=0",
         "hydra.launcher.nodes=1", "hydra.launcher.tasks_per_node=2", "hydra.launcher.cpus_per_task=1",
         "hydra.launcher.timeout_min=10", "hydra.launcher.partition=debug",
         "++hydra.launcher.additional_parameters={overcommit: true}", f"hydra.sweep.dir={sweep}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sys.path.insert(0, str(REPO))
    from experiments import tables
    runs = {r.step: r for r in tables.load_runs([sweep])}
    assert sorted(runs) == [0, 1], list(sweep.rglob("*"))
    for run in runs.values():
        assert run.status == "ok" and run.world == 2 and run.final["steps"] == 4, run
    assert "| +PTB (a) |" in tables.ablation_table(list(runs.values()))  # (a): TP ran over loopback


@pytest.mark.slurm
def test_submitit_job_saves_at_the_stop_step_requeues_and_resumes(local_slurm, tmp_path, cache_dir, uninterrupted):
    """hydra/launcher=submitit_slurm: USR2 to the job's tasks (as SLURM sends it before the time
    limit) makes its ranks save at an agreed step before submitit's handler requeues the job; the
    requeued job resumes from that step, and the multirun that submitted it ends when it finishes."""
    sweep = tmp_path / "sweep"
    env = dict(os.environ, OMP_NUM_THREADS="1", MEGAREPRO_CACHE=str(cache_dir), HF_DATASETS_OFFLINE="1")
    submitter = subprocess.Popen(
        [sys.executable, "train.py", "-m", "hydra/launcher=submitit_slurm", *PREEMPTED, "hydra.job.name=preempted",
         "hydra.launcher.nodes=1", "hydra.launcher.tasks_per_node=2", "hydra.launcher.cpus_per_task=1",
         # submitit takes a signal within 10 minutes of a job's start as its time limit (the
         # 80% of its time it counts on is min(0.8 x 10, 10 - 10) minutes), and requeues it only
         # while such limits number at most max_num_timeout, as conf/scale/cluster.yaml allows
         "hydra.launcher.timeout_min=10", "hydra.launcher.max_num_timeout=1", "hydra.launcher.partition=debug",
         "++hydra.launcher.additional_parameters={overcommit: true}", f"hydra.sweep.dir={sweep}"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def signal_tasks():
        job_id = subprocess.run(["squeue", "-h", "-n", "preempted", "-o", "%i"], capture_output=True,
                                text=True, check=True).stdout.split()[0]
        subprocess.run(["scancel", "--signal=USR2", job_id], check=True, timeout=30)
        return job_id
    try:
        preempt_when_running(sweep / "0", signal_tasks)
        out, _ = submitter.communicate(timeout=400)
    finally:
        submitter.kill()
    assert submitter.returncode == 0, out[-3000:]
    logs = "".join(f.read_text() for f in sorted((sweep / ".submitit").rglob("*_log.*")))
    assert "Requeued job" in logs, logs[-3000:]  # submitit's handler, on rank 0
    assert_resumed_from_the_stop_step(sweep / "0", uninterrupted, logs)
