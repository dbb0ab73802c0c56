"""ConfigError, the one-line error for bad input, in a module that imports nothing of the project.

config.py assembles every module's config dataclass and validates across them; the modules it
imports (checkpoint, data, optim, parallel, ...) raise this error for their own settings. Defined
here, neither side has to import the other back. config.py re-exports it (config.ConfigError).
"""
import glob
import hashlib
import os
import sys
import tempfile
import time


class ConfigError(ValueError):
    """A bad setting. str() is the one line the user sees."""

    def __init__(self, key: str, problem: str, fix: str):
        super().__init__(f"config error: {key}: {problem}. Fix: {fix}")
        self.key = key


# How long a rank that did not print waits for the rank that does. Long enough for the slowest
# rank of a launch to import and reach the same check on a loaded host (ranks of one launch start
# together; imports take 2-10 s on 2 busy cores); short enough that a bad setting found by one
# rank alone still ends the job within a minute.
SPEAKER_WAIT_S = 30.0


def fail(line: str) -> None:
    """Bad input's exit: one line on stderr, exit code 2, read exactly once in a launch of many.

    Every rank meets the same bad input and stops. Rank 0 prints the line. A launcher ends the
    remaining ranks as soon as one exits (torchrun's agent, `srun --kill-on-bad-exit`), so a rank
    that exited before rank 0 had printed would have it killed mid-way and the line lost; so no
    other rank exits first:
    - the other ranks of a node wait until the node's first rank (rank 0, or local rank 0 on the
      other nodes) has exited, seen through a marker file, then exit without a word;
    - the first rank of another node waits SPEAKER_WAIT_S for the launcher to end it once rank 0
      has exited, and prints the line itself if it is still running then.
    A rank whose node's first rank never fails (a setting bad on that rank alone) prints its line
    after the wait. So: once in a one-node launch, at most once per node otherwise.
    Markers over a polling wait on a process group because most bad input is found before one
    exists (the preflight), and over a plain sleep because a launcher that does not end the
    others (`srun` by default) would then print the line once per rank."""
    rank, local_rank = _ranks()
    if rank == 0:
        _say(line)
    elif local_rank == 0:
        time.sleep(SPEAKER_WAIT_S)  # rank 0's exit normally ends this process here
        _say(line)
    elif not _node_leader_done(SPEAKER_WAIT_S + 5.0):
        print(line, file=sys.stderr, flush=True)
    sys.exit(2)


def _ranks() -> tuple:
    """(rank, local rank) from torchrun's or srun's environment; (0, 0) for one process."""
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    local = os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID"))
    return rank, rank if local is None else int(local)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
    if int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1"))) == 1:
        return  # no other rank to tell
    try:
        _forget_old_markers()
        with open(_marker(), "w"):
            pass
    except OSError:  # no writable temp dir: the node's other ranks print after their wait
        pass


def _marker() -> str:
    """A file all ranks of this launch on this node name alike: they share the launcher process
    (torchrun's agent, srun's step daemon) as their parent and the launch's identity in their
    environment, so a marker of another launch or of an earlier restart never matches."""
    launch = [str(os.getppid())] + [os.environ.get(v, "") for v in (
        "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
        "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_RESTART_COUNT")]
    key = hashlib.sha256("/".join(launch).encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"megarepro-bad-input-{key}")


def _node_leader_done(timeout_s: float) -> bool:
    """True once this node's first rank has printed (its marker is newer than this process)."""
    marker, started = _marker(), _process_start_time() - 5.0
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if os.stat(marker).st_mtime >= started:
                return True
        except OSError:
            pass
        time.sleep(0.05)
    return False


def _process_start_time() -> float:
    """When this process started, in seconds since the epoch (Linux's /proc), else now."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def _forget_old_markers() -> None:
    """Markers of launches that ended over an hour ago: one small file per failed launch, removed."""
    for path in glob.glob(os.path.join(tempfile.gettempdir(), "megarepro-bad-input-*")):
        try:
            if os.stat(path).st_mtime < time.time() - 3600:
                os.remove(path)
        except OSError:
            pass
