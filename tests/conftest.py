"""Shared helpers: run train.py as a user would (its own processes, Hydra and all) on small settings.
Its ranks are forked from a server that has already imported its modules (tests/forked.py), unless
a test asks for a real python or torchrun launch."""
import contextlib
import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def import_triton_for_its_interpreter() -> None:
    """Import triton, if installed, with TRITON_INTERPRET=1 set, so that tests/test_kernels.py can
    run the Triton kernels in its interpreter on CPU: triton wraps its own library functions (tl.sum
    and the like) for the interpreter only if the variable is set when triton.language is first
    imported. That has to happen here, before any test module is collected: importing kernels
    imports torch._dynamo (torch.compiler.assume_constant_result), and torch._dynamo imports
    triton, so any module that imports kernels before test_kernels would import it unwrapped.
    The variable is unset again at once, so no test, nor a process one starts, sees it. Not on a
    CUDA host, whose tests (tests/test_cuda.py) launch the compiled kernels."""
    if "triton" in sys.modules:
        return
    import torch
    if torch.cuda.is_available():
        return
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language  # noqa: F401
    except ImportError:
        pass
    finally:
        del os.environ["TRITON_INTERPRET"]


import_triton_for_its_interpreter()

import forked  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# Under pytest-xdist (make test) each worker's runs get its share of the cores: OpenMP threads that
# outnumber the free cores wait on each other at every barrier (one 26 s test took 290 s).
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    os.environ["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // WORKERS))
    import torch
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# The tiny model on a 1.5 MB slice of the stdlib corpus with a 512-token BPE: seconds per run.
SMALL = ["model=tiny", "model.vocab_size=512", "data.bpe_vocab_size=512", "data.max_bytes=1500000",
         "train.seq_len=64", "train.batch_size=8", "logging.wandb.mode=disabled", "logging.progress=false",
         "train.eval_interval=0", "logging.interval=1000", "hardware.peak_tflops=1"]
# (hardware.peak_tflops: MFU over a given peak, not a measured one: a second of rank 0's start-up
# in every run; test_tiny_model_learns_on_the_embedded_corpus keeps the measurement.)


# `make test` runs the suite on every core (pytest-xdist). Many tests wait (on SLURM, on a hang
# timeout, on torchrun's restarts) or use one core, so a second worker fills the gaps. A module
# stays on one worker, so its module-scoped fixtures run once. The CI stress pass's runs (the
# session fixture ci_stress) also serve other modules' tests, so each case and every module that
# reads it share a worker, and each run happens once; the cases come in two such groups, so that
# no worker holds all of the pass (660 of the suite's ~1,600 worker-seconds). (xdist's own
# --dist loadgroup marks do nothing under pytest 9, whose node ids it can no longer suffix.)
STRESS_GROUPS = {  # group: (the modules that read its cases' runs, its cases)
    "stress_resume": ({"test_checkpoint"}, {"resume_pp2_vpp2", "async_tp2_dp2"}),
    "stress_overlap": ({"test_parallel", "test_rehearsal"}, {"tp2_pp2_dp2_overlap", "pp2_vpp2_overlap"}),
}


def scope_of(nodeid: str) -> str:
    """The xdist scope of a test: its stress group, else its module."""
    module = nodeid.split("::")[0].rsplit("/", 1)[-1].removesuffix(".py")
    case = nodeid.rsplit("[", 1)[-1].rstrip("]") if module == "test_stress" and "[" in nodeid else None
    for group, (modules, cases) in STRESS_GROUPS.items():
        if module in modules or case in cases:
            return group
    return module


# Worker-seconds of the longest scopes (one `make test` on 2 cores), handed out longest first so
# that no long scope starts last: xdist orders scopes by their number of tests, which put
# test_cluster_tools (200 s) last and one worker idle 40 s at the end. Only the order matters;
# every other scope follows in xdist's order.
SCOPE_SECONDS = {"stress_overlap": 257, "test_cluster_tools": 204, "stress_resume": 113, "test_ft": 83,
                 "test_observe": 63, "test_experiments": 60, "test_train": 59, "test_perfmodel": 53,
                 "test_stragglers": 33, "test_emulated_link": 32, "test_docs": 28, "test_nccl_rules": 22}


def pytest_xdist_make_scheduler(config, log):
    from collections import OrderedDict

    from xdist.scheduler import LoadScopeScheduling

    class ByScope(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

        def _assign_work_unit(self, node) -> None:
            if not getattr(self, "longest_first", False):  # once, before the first unit goes out
                self.workqueue = OrderedDict(sorted(self.workqueue.items(),
                                                    key=lambda unit: -SCOPE_SECONDS.get(unit[0], 0)))
                self.longest_first = True
            super()._assign_work_unit(node)
    return ByScope(config, log)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One data cache for the whole session, with SMALL's corpus built in it (as a user runs
    `python -m corpus build` before a job of several ranks, which never builds)."""
    cache = tmp_path_factory.mktemp("cache")
    build_corpus(SMALL, cache)
    return cache


def build_corpus(args: list, cache: Path) -> None:
    """The corpus of a train.py command line's data.* keys, built into cache (in this process)."""
    sys.path.insert(0, str(ROOT))
    from corpus.__main__ import build_for
    build_for(args, cache)


def train_env(cache: Path, **extra) -> dict:
    env = dict(os.environ, MEGAREPRO_CACHE=str(cache), HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled",
               PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_train(run_dir: Path, args: list, cache: Path, nproc: int = 1, check: bool = True, timeout: int = 600,
              launch: str = "forked", **env) -> subprocess.CompletedProcess:
    """python train.py (or torchrun with nproc ranks) with its run dir pinned to run_dir. launch:
    "forked" (ranks forked from a server that has imported train.py's modules: tests/forked.py) or
    "real" (python or torchrun, started as a user starts them)."""
    args = list(args) + [f"hydra.run.dir={run_dir}"]
    if nproc > 1:  # torchrun's own default: ranks sharing 2 cores with 2 threads each wait on each other
        env.setdefault("OMP_NUM_THREADS", 1)
    if launch == "forked":
        proc = forked.run(args, train_env(cache, **env), nproc=nproc, timeout=timeout)
    else:
        launcher = [sys.executable, "train.py"] if nproc == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "train.py"]
        proc = subprocess.run(launcher + args, cwd=ROOT, env=train_env(cache, **env), capture_output=True, text=True,
                              timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"train.py failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


# The 8-rank layout with every overlap on: test_parallel checks that it equals one process, and
# test_rehearsal that its rehearsal posts the collectives it posted (rehearse.record). It is one of
# the CI stress pass's cases, whose first run serves both (8 ranks on 2 cores is the suite's dearest run).
EIGHT_RANKS = ["parallel.tp=2", "parallel.pp=2", "parallel.microbatches=2", "parallel.zero_stage=1",
               "parallel.overlap.tp=chunked", "parallel.overlap.pp=true", "parallel.overlap.dp=true"]
EXACT_STEPS = 3
EXACT = SMALL + [f"train.max_steps={EXACT_STEPS}", "precision=fp32", f"checkpoint.interval={EXACT_STEPS}",
                 "train.eval_interval=3"]
CI_STRESS_RUNS = 3


# The CI stress pass loads the cores on purpose (a busy process beside runs of up to 8 ranks: on 2
# cores, 13 runnable processes). A test that judges a run's timings must not run on the other xdist
# worker meanwhile: there a rank's 33 ms of compute a step (its thread's CPU time, the same on every
# rank to a millisecond) took up to 330 ms of wall time, preempted, in a fifth of its steps, often a
# few steps running, so that a 5-step window's median named a rank a compute straggler (1.66x) or
# hid a throttled link (tests/test_emulated_link.py). The pass's cases hold this lock shared (they
# may overlap each other, as its two groups do on the two workers); a timing test holds it
# exclusively, for its run only. A wait costs little: ordered by SCOPE_SECONDS the link test comes
# after the pass, and where they would meet, on cores the pass saturates, side by side takes as long.
def cpu_load_lock_path(tmp_path_factory) -> Path:
    """The session's lock file, one for all xdist workers (their basetemps' common folder)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker's basetemp is <the session's>/<worker>
        root = root.parent
    return root / "cpu_load.lock"


@contextlib.contextmanager
def cpu_load_lock(tmp_path_factory, exclusive: bool):
    """The session's lock on loading the cores (the CI stress pass: shared) and on needing them
    unloaded (a timing test: exclusive), across xdist workers."""
    with open(cpu_load_lock_path(tmp_path_factory), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def ci_stress(tmp_path_factory, cache_dir):
    """The CI stress pass (experiments/stress.py): a case's CI_STRESS_RUNS runs beside one
    CPU hog, on its first request, as stress.Tally. Its first run also serves the tests that check
    that case's result (one process's losses and weights), so the pass costs two runs a case."""
    sys.path.insert(0, str(ROOT / "experiments"))
    import stress
    out, setups, tallies = tmp_path_factory.mktemp("stress"), {}, {}

    def run(name: str):
        if name not in tallies:
            with cpu_load_lock(tmp_path_factory, exclusive=False), stress.Hog(1):
                tallies[name] = stress.stress_case(name, CI_STRESS_RUNS, 600, out, cache_dir, setups, progress=print)
        return tallies[name]
    run.setups = setups
    return run


def first_good_run(tally) -> Path:
    """The dir of a stress case's first run that exited 0 (test_stress counts the others)."""
    assert tally.good, f"no run of the case exited 0: see {tally.dirs[0] / 'stderr.txt'}"
    return tally.good[0]


@pytest.fixture(scope="session")
def eight_rank_run(ci_stress) -> Path:
    """The run dir of EXACT at tp2 pp2 dp2 with every overlap on, its collectives recorded."""
    return first_good_run(ci_stress("tp2_pp2_dp2_overlap"))


def read_metrics(run_dir: Path) -> list:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def spawn(fn, world: int, *args) -> None:
    """fn(rank, world, port, *args) on `world` processes (gloo ranks), joined; forked from the
    server tests/forked.py keeps, so a rank does not import torch again."""
    import socket
    import torch.multiprocessing as mp
    forked.context()  # the server, with its preloaded modules
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.start_processes(fn, args=(world, port, *args), nprocs=world, start_method="forkserver")


@pytest.fixture
def gpu_node(monkeypatch):
    """A node of 8 CUDA GPUs, as torch.cuda reports it, whose name a test sets (gpu_node["name"]);
    no launcher's variables. Nothing touches a real GPU."""
    import torch
    for var in ("LOCAL_WORLD_SIZE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "LOCAL_RANK", "SLURM_LOCALID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    named = {"name": None}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: named["name"])
    return named
