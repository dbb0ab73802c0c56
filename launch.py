"""How a rank joins its job and leaves it: the device it computes on, the process group (env://
under torchrun, or filled in from SLURM's variables under srun, so no torchrun is needed inside
it), the checkpoint's own gloo group, the orderly end of the groups at exit, and the stop a signal
asks for (StopFlag: a preemption's warning, Ctrl-C), and Python's garbage collection, off during steps and run on every rank at the same step, every
train.gc_interval steps (MegaScale traced decaying MFU to ranks collecting at different times).
"""
from __future__ import annotations

import atexit
import datetime
import gc
import os
import signal
import time
from typing import Optional

import torch
import torch.distributed as dist

from observe import spans


def pick_device(requested: str = "auto") -> torch.device:
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda":
        # Modulo the devices this process sees: SLURM's --gpus-per-task (or a CUDA_VISIBLE_DEVICES
        # per task) shows each task only its own GPU, as device 0, whatever its local id.
        local = int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", 0)))
        return torch.device("cuda", local % max(1, torch.cuda.device_count()))
    return torch.device("cpu")


def set_cuda_connections(tp: int, device: str) -> Optional[str]:
    """CUDA_DEVICE_MAX_CONNECTIONS=1 for a run with tp > 1 that may use CUDA (device cuda or auto),
    set before CUDA starts: train.py's main calls this first, and every launch path (torchrun,
    experiments/slurm/train.sbatch, the submitit launcher) ends in that main, which alone knows tp.
    With one hardware queue the GPU starts kernels in the order the host issued them, so the TP
    collective issued before the GEMM it hides under gets its SMs first; with several queues the
    GEMM can take every SM and the collective waits for it (Megatron-LM sets 1 for the same
    overlap and warns when it is not). Left at CUDA's default for tp = 1, where DP and PP overlap
    want their streams' kernels to run side by side. A value the user set is kept. Returns a
    warning for the log, or None."""
    if tp <= 1 or device == "cpu":
        return None
    current = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    if current is not None and current != "1":
        return (f"CUDA_DEVICE_MAX_CONNECTIONS={current} is set and tp={tp}: the GPU may run a GEMM before the TP "
                f"collective meant to overlap it; unset it (this run then sets 1) or set 1")
    if current is None and torch.cuda.is_initialized():
        return ("CUDA started before CUDA_DEVICE_MAX_CONNECTIONS=1 could be set for tp > 1: set it in the environment "
                "of the launch")
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    return None


def ranks_on_this_node() -> Optional[int]:
    """How many ranks run on this node: torchrun's LOCAL_WORLD_SIZE, else SLURM's tasks on this
    node (SLURM_STEP_TASKS_PER_NODE inside srun, else SLURM_TASKS_PER_NODE: "8(x4),2" means 8 on
    each of the first four nodes, then 2); None outside both."""
    if os.environ.get("LOCAL_WORLD_SIZE"):
        return int(os.environ["LOCAL_WORLD_SIZE"])
    spec = os.environ.get("SLURM_STEP_TASKS_PER_NODE") or os.environ.get("SLURM_TASKS_PER_NODE")
    if not spec:
        return None
    counts = []
    for part in spec.split(","):
        count, _, times = part.partition("(x")
        counts += [int(count)] * int(times.rstrip(")") or 1)
    return counts[min(int(os.environ.get("SLURM_NODEID", 0)), len(counts) - 1)]


def gpu_sharing_problem(ranks: Optional[int], visible: int, torchrun: bool) -> Optional[str]:
    """Why ranks of this node would share a GPU (pick_device takes LOCAL_RANK modulo the GPUs a
    rank sees, and NCCL refuses two ranks on one GPU at its first collective), or None. torchrun's
    ranks all see the node's GPUs; srun's tasks may each see only their own (--gpus-per-task), so
    one visible GPU under srun is not a sign of sharing."""
    if ranks is None or ranks <= visible or (visible <= 1 and not torchrun):
        return None
    return (f"{ranks} ranks on this node but {visible} GPU{'s' * (visible != 1)} visible to each, so two ranks "
            f"would share a GPU (NCCL refuses that at the first collective)")


def init_distributed(device: torch.device, backend: str = "auto", timeout_s: Optional[float] = None) -> tuple[int, int]:
    """Join the job's process group if launched by torchrun or srun; returns (rank, world).
    Under srun the env:// variables are filled from SLURM's, so no torchrun is needed inside it."""
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ and int(os.environ.get("SLURM_NTASKS", 1)) > 1:
        os.environ["RANK"] = os.environ["SLURM_PROCID"]
        os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
        os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
        os.environ.setdefault("MASTER_ADDR", _slurm_first_host())
        os.environ.setdefault("MASTER_PORT", str(20000 + int(os.environ.get("SLURM_JOB_ID", 0)) % 20000))
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world == 1:
        return 0, 1
    raise_open_files_limit()
    if dist.is_initialized():  # the next job of a Hydra multirun in the same processes
        return dist.get_rank(), dist.get_world_size()
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kwargs = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    if device.type == "cuda":
        # A bound device makes NCCL create the world's communicator now, and every later group an
        # ncclCommSplit of it; send/recv then use their group's communicator instead of one
        # 2-rank communicator per pair of ranks, made at the pair's first message (pytorch#129140).
        kwargs["device_id"] = device
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's store outlives a restart (--max-restarts) and gloo's keys in it are not per
        # attempt: a restarted rank can read a dead rank's address and hang connecting to it. So
        # every attempt gets keys of its own.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s or 600))
        dist.init_process_group(backend=backend, store=dist.PrefixStore(f"megarepro/attempt_{attempt}", store),
                                rank=int(os.environ["RANK"]), world_size=world, **kwargs)
    else:
        dist.init_process_group(backend=backend, init_method="env://", **kwargs)
    # Once per process, not per job: a second init after destroy reuses torchrun's store keys and
    # hangs, and a multirun runs its jobs one after another in the same ranks.
    atexit.register(shutdown)
    return dist.get_rank(), dist.get_world_size()


# What holds a process group beyond the layout: the checkpoint's group, made once per process group.
_CHECKPOINT_GROUP: dict = {}
_FAILED = False  # a job of this process raised: shutdown leaves the groups alone


def checkpoint_group(timeout_s: Optional[float] = None):
    """One gloo group over all ranks for checkpoint traffic (checkpoint.Saver), so that a background
    save's collectives never interleave with training's; made once per process group (a
    multirun's jobs share it). Its connections are made lazily (TORCH_GLOO_LAZY_INIT), each pair
    of ranks at its first message: gloo's default connects every pair at creation, W-1 sockets per
    rank and W-1 store reads each (W^2 in all, past a default `ulimit -n` of 1024 from 1,024 ranks
    on). Lazily, a rank connects only to the peers its collectives reach: DCP's coordinator (rank 0)
    to each rank it gathers plans from, every other rank to O(log W) peers (tests/test_checkpoint.py
    counts them)."""
    world = dist.group.WORLD
    if world not in _CHECKPOINT_GROUP:
        _CHECKPOINT_GROUP.clear()
        before = os.environ.get("TORCH_GLOO_LAZY_INIT")
        os.environ["TORCH_GLOO_LAZY_INIT"] = "1"  # read when the gloo backend is constructed
        try:
            kwargs = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
            _CHECKPOINT_GROUP[world] = dist.new_group(backend="gloo", **kwargs)
        finally:
            if before is None:
                del os.environ["TORCH_GLOO_LAZY_INIT"]
            else:
                os.environ["TORCH_GLOO_LAZY_INIT"] = before
    return _CHECKPOINT_GROUP[world]


def raise_open_files_limit() -> None:
    """The soft limit on open files up to the hard one: DCP's coordinator holds a socket per rank it
    gathers from, and a default soft `ulimit -n` of 1024 is below that from 1,024 ranks on."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):  # an unlimited hard limit above the kernel's nr_open
            pass


def mark_failed() -> None:
    global _FAILED
    _FAILED = True


def shutdown() -> None:
    """The end of a rank, at exit. By then train() has closed, in this order, the data loader
    (its prefetch thread joined), the checkpoint writer (an asynchronous save written) and the
    heartbeat; every send and collective was waited in its step. Left: the process groups. Every
    reference to them goes (the checkpoint's group; a finished job's model and layout, if only a
    cycle still holds them), then destroy_process_group drops c10d's, so that the groups' gloo
    threads join here, while the interpreter is whole. Left to interpreter finalization, they
    abort a rank after a finished run: SIGABRT, "terminate called without an active exception"
    (pytorch#190489). After a failure it does nothing (torchtitan#1342): a group whose
    peer is gone can block in its destructor, and the rank is failing anyway."""
    if _FAILED or not dist.is_initialized():
        return
    _CHECKPOINT_GROUP.clear()
    gc.collect()
    dist.destroy_process_group()


def _slurm_first_host() -> str:
    nodes = os.environ.get("SLURM_JOB_NODELIST", "127.0.0.1")
    import subprocess
    try:
        return subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True, text=True,
                              check=True).stdout.split()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return first_host(nodes)


def first_host(nodelist: str) -> str:
    """The first host of a SLURM hostlist, as `scontrol show hostnames` would give it, for nodes
    without scontrol: "gpu[001-032]" -> gpu001, "gpu[003,007],cpu1" -> gpu003, "r[1-2]-n[08-09]" -> r1-n08."""
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):  # the first comma outside brackets ends the first entry
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            end = i
            break
    entry = nodelist[:end]
    while "[" in entry:
        head, rest = entry.split("[", 1)
        ranges, tail = rest.split("]", 1)
        entry = head + ranges.split(",")[0].split("-")[0] + tail
    return entry


class StopFlag:
    """Ctrl-C, SIGTERM and SLURM's warning before a preemption or the time limit (USR1 or USR2, as
    sbatch --signal sends it) ask for a stop at the next step that every rank agrees on
    (parallel.agree), so the run saves a checkpoint there and exits cleanly instead of dying
    mid-step. A launcher's own handler for USR1/USR2 (submitit's: requeue the job, then exit) is
    held back and run by hand_back once that checkpoint is written. A second Ctrl-C stops at once."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
    LAUNCHER_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)

    def __init__(self):
        self.requested = False
        self.signal_name = ""
        self._held_back: dict = {}  # signum -> the launcher's handler, run after the stop's save
        self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        self.signal_name = self.signal_name or signal.Signals(signum).name
        previous = self._previous[signum]
        if signum in self.LAUNCHER_SIGNALS and callable(previous):
            self._held_back[signum] = previous

    def restore(self):
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def hand_back(self) -> None:
        """Run the launcher handlers held back (submitit's on rank 0 requeues the job and exits)."""
        for signum, handler in self._held_back.items():
            handler(signum, None)


class CollectGarbage:
    """gc off for the run; a full collection on every rank at the same steps."""

    def __init__(self, interval: int):
        self.interval = interval
        self.was_enabled = gc.isenabled()
        if interval > 0:
            gc.disable()

    def after_step(self, step: int) -> float:
        if self.interval > 0 and step % self.interval == 0:
            t0 = time.perf_counter()
            with spans.segment("gc"):
                gc.collect()
            return time.perf_counter() - t0
        return 0.0

    def close(self) -> None:
        if self.was_enabled:
            gc.enable()
