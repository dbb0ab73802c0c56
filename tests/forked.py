"""train.py runs for the tests, forked from a process that has already imported what train.py imports.

A tiny run's own work takes about a second; starting the Python that does it takes five or more
(torch, torch._dynamo, which every torch optimizer imports, DCP, Hydra), and every rank of a
torchrun pays that again on the same two cores. So the tests' ranks are forked from
multiprocessing's forkserver, preloaded with train.py's modules: each rank still is its own
process with its own environment, argv, working dir, stdout and stderr, and joins a real gloo group
through env://, as under torchrun (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). It runs
train.py as __main__, the preflight included, then its atexit handlers (launch.shutdown), and
exits with train.py's exit code.

What this does not exercise is the launch itself, which other tests keep: the CI stress pass
(tests/test_stress.py: real torchrun, beside a CPU hog, counting aborts at interpreter exit),
test_train's thread-join and bad-input tests, the fault scenarios (torchrun's restarts) and the
cluster tools. A forked rank also shares the server's hash seed, so set order is the same on
every rank here; under torchrun it is not, and the stress pass and the rehearsal's
nccl_rules (which compare every rank's collectives) are where an order that differs across ranks
would show.
"""
from __future__ import annotations

import atexit
import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What a train.py process imports before it does anything of its own: the project's modules (train
# imports them all) and torch._dynamo, which the first torch.optim optimizer imports.
PRELOAD = ["train", "torch._dynamo", "torch.distributed.checkpoint"]
_context = None


def context():
    global _context
    if _context is None:
        for path in (str(ROOT), str(ROOT / "tests")):  # the server imports with the tests' sys.path
            if path not in sys.path:
                sys.path.insert(0, path)
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def run(args: list, env: dict, nproc: int = 1, timeout: float = 600, script: str = "train.py") -> subprocess.CompletedProcess:
    """`python <script> *args` (nproc ranks as torchrun would start them when nproc > 1), script
    relative to the repository. stdout and stderr are the ranks' own, in rank order; the return
    code is the first non-zero rank's."""
    ctx = context()
    with tempfile.TemporaryDirectory(prefix="forked-") as out:
        ranks = [ctx.Process(target=_rank, args=(script, list(args), env, Path(out) / f"rank{r}"), name=f"rank{r}")
                 for r, env in enumerate(_rank_envs(env, nproc))]
        for p in ranks:
            p.start()
        for p in ranks:
            p.join(timeout)
        hung = [p for p in ranks if p.is_alive()]
        for p in hung:
            p.kill()
            p.join()
        text = lambda stream: "".join((Path(out) / f"rank{r}.{stream}").read_text(errors="replace")
                                      for r in range(nproc) if (Path(out) / f"rank{r}.{stream}").exists())
        stdout, stderr = text("out"), text("err")
    cmd = [script, *args]
    if hung:
        raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
    code = next((p.exitcode for p in ranks if p.exitcode), 0)
    return subprocess.CompletedProcess(cmd, code, stdout, stderr)


def _rank_envs(env: dict, nproc: int) -> list:
    if nproc == 1:
        return [dict(env)]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    shared = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(nproc),
              "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0",
              "MEGAREPRO_RUN_ID": env.get("MEGAREPRO_RUN_ID") or f"forked-{uuid.uuid4().hex[:8]}"}
    return [{**env, **shared, "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(nproc)]


def _rank(script: str, args: list, env: dict, out: Path) -> None:
    """One rank, in the forked child: the process `python <script>` would make."""
    os.chdir(ROOT)
    os.environ.clear()
    os.environ.update(env)
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, stream in ((1, "out"), (2, "err")):  # the C++ side's output too (gloo, torch warnings)
        target = os.open(f"{out}.{stream}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    import torch
    # OpenMP read OMP_NUM_THREADS when the server loaded it; this rank's value applies from here.
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    sys.argv = [str(ROOT / script), *args]
    sys.path.insert(0, str((ROOT / script).parent))  # as python puts the script's folder first
    code = 0
    try:
        import runpy
        runpy.run_path(str(ROOT / script), run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # as the interpreter would: the traceback on stderr, exit code 1
        import traceback
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # a process's exit runs these (launch.shutdown); os._exit below would not
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
