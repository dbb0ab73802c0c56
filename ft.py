"""Fault tolerance: hang detection, straggler reports, synchronised garbage collection, and the
fault injection that tests them (MegaScale section 4: >90% effective training time over 100+
restarts comes from detecting a broken rank fast and restarting from the newest checkpoint).

- Heartbeat: every rank's training loop says where it is (step, phase). A thread watches it, and
  writes it to <run dir>/heartbeat/rank<K>.json (atomically) for anyone to read, when it has
  changed, at most every ft.hang_timeout/10 seconds after the first step (a shared file system
  sees W/30 files a second at the default 300 s, not W every ft.heartbeat_interval: the files are
  read only when a hang is reported, and a rank that stopped has written its last state by
  then). A rank whose
  progress stops for ft.hang_timeout seconds logs who is behind (its own or another rank's last
  step and phase: a rank waiting in a collective is usually waiting for that one) and exits with
  HANG_EXIT, so that torchrun (--max-restarts) or SLURM (requeue) restarts the job, which resumes
  from the newest complete checkpoint. A run's first step has ft.first_step_timeout instead: it
  compiles every chunk (torch.compile) and creates the communicators (NCCL connects each group at
  its first collective), minutes at the paper's scale, and rank 0 logs how long it took and why.
  Collectives themselves time out after ft.collective_timeout seconds (the process group's timeout).
- Stragglers (stragglers.py): every ft.straggler_interval steps a rank compares its own work with
  its dp group's (alone in it, its compute over the performance model's for its stage with the
  job's); a rank ft.straggler_threshold slower in ft.straggler_windows of the last that many
  plus one windows is logged as the culprit, with its kind (compute, input, link) and its cost.
- GC: Python's collector is off during steps and runs on every rank at the same step, every
  train.gc_interval steps (MegaScale traced decaying MFU to ranks collecting at different times).
- Faults (MEGAREPRO_FAULT, for tests and experiments/faults.py): kill:RANK@STEP (SIGKILL itself),
  hang:RANK@STEP (sleeps forever), disk_full@STEP (the save at that step fails with ENOSPC),
  truncate@STEP (truncates the newest checkpoint's data, then SIGKILLs itself), slow_save@SECONDS
  (each background checkpoint write takes that much longer), slow_first_step@SECONDS (the run's
  first step takes that much longer, as one that compiles and connects does), slow:RANK@FACTOR (that
  rank's forward and backward take FACTOR times as long, every step), spike:RANK@STEP (that rank's
  forward and backward of that one step take SPIKE times as long). Several, comma-separated; each
  fires only in the attempt (restart) it names with #ATTEMPT, default 0.
"""
from __future__ import annotations

import errno
import gc
import json
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import spans

log = logging.getLogger("ft")
HANG_EXIT = 75  # what a rank exits with when it finds the job hung (EX_TEMPFAIL: retry)


@dataclass
class FTConfig:
    collective_timeout: float = 600.0   # seconds a collective may wait before it fails
    hang_timeout: float = 300.0         # seconds without progress before a rank reports a hang and exits
    first_step_timeout: float = 3600.0  # the same for a run's first step, which compiles and connects
    heartbeat_interval: float = 1.0     # seconds between heartbeat writes and checks
    straggler_interval: int = 20        # steps in a straggler window (stragglers.py); 0: off
    straggler_threshold: float = 0.2    # a rank this much slower than its peers' reference is a suspect
    straggler_windows: int = 3          # windows, of the last this many + 1, a suspect must be one in for a verdict


def attempt() -> int:
    """Which restart of the job this is (torchrun counts them; a requeued SLURM job too)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", os.environ.get("SLURM_RESTART_COUNT", 0)))


class Heartbeat:
    """This rank's progress, published and watched by a daemon thread."""

    def __init__(self, run_dir: Path, rank: int, world: int, cfg: FTConfig, first_step_work: str = "",
                 observer=None):
        self.dir, self.rank, self.world, self.cfg = Path(run_dir) / "heartbeat", rank, world, cfg
        self.observer = observer  # observe.Recorder: its snapshot is written with the heartbeat
        self.dir.mkdir(parents=True, exist_ok=True)
        self.step, self.phase, self.changed = 0, "start", time.monotonic()
        # The first step's allowance holds until a later step or another phase than its own begins.
        self.first_step, self.first_step_work, self.first_step_s = None, first_step_work, None
        self.published, self.published_at = None, float("-inf")  # the state in the file, and when written
        self.published_ops = -1  # the op log's version in the observer's snapshot
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()

    def progress(self, step: int, phase: str) -> None:
        now = time.monotonic()
        if self.first_step is None:
            self.first_step = (step, now)
        elif self.first_step_s is None and (step > self.first_step[0] or phase not in ("data", "compute")):
            self.first_step_s = now - self.first_step[1]
            if self.rank == 0:
                log.info("step %d took %.1f s%s; the hang timer now allows %g s without progress", self.first_step[0],
                         self.first_step_s, f" ({self.first_step_work})" if self.first_step_work else "",
                         self.cfg.hang_timeout)
        self.step, self.phase, self.changed = step, phase, now
        if self.observer is not None:
            self.observer.mark(step, phase)

    def timeout(self) -> float:
        """Seconds without progress that make a hang: more while the first step runs."""
        if self.first_step_s is None:
            return max(self.cfg.hang_timeout, self.cfg.first_step_timeout)
        return self.cfg.hang_timeout

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        if self.observer is not None and self.observer.version != self.published_ops:
            self._publish()  # the run's last state, once, whatever the rate bound left unwritten

    def _run(self) -> None:
        while not self._stop.wait(self.cfg.heartbeat_interval):
            if self._due():
                self._publish()
            if self.observer is not None:  # observe.desync_every: each group's hash against its members'
                self.observer.check_desync(self.dir.parent)
            idle = time.monotonic() - self.changed
            # observe.stall_s: a stall whose root is already certain ends the job before the timeout
            root = self.observer.check_stall(self.dir.parent, self.world) if self.observer is not None else None
            if root is not None:
                self._report_hang(idle, root)
            elif idle > self.timeout() and self.phase != "done":
                self._report_hang(idle)

    def _due(self) -> bool:
        """Whether the file is to be rewritten: the state changed, and hang_timeout/10 has passed
        since the last write (every change while the first step runs: it has few)."""
        interval = 0.0 if self.first_step_s is None else self.cfg.hang_timeout / 10
        since = time.monotonic() - self.published_at
        if (self.step, self.phase) != self.published and since >= interval:
            return True
        # The op log changes at every op, the first step's too: hang_timeout/10 always bounds it.
        return (self.observer is not None and self.observer.version != self.published_ops
                and since >= self.cfg.hang_timeout / 10)

    def _publish(self) -> None:
        idle = time.monotonic() - self.changed
        beat = {"rank": self.rank, "host": socket.gethostname(), "pid": os.getpid(), "attempt": attempt(),
                "step": self.step, "phase": self.phase, "idle_s": round(idle, 3), "time": time.time(),
                "since": time.time() - idle}  # (a reader's idle time: its own clock less "since")
        self.published, self.published_at = (self.step, self.phase), time.monotonic()
        path = self.dir / f"rank{self.rank}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(beat))
        os.replace(tmp, path)
        if self.observer is not None:  # the op log and spans, at the same bounded rate
            self.published_ops = self.observer.version
            self.observer.write(self.dir.parent)

    def _report_hang(self, idle: float, root=None) -> None:
        """Name the rank that is behind (lowest step, then longest idle) and exit for a restart."""
        self._publish()
        beats = []
        for k in range(self.world):
            try:
                beat = json.loads((self.dir / f"rank{k}.json").read_text())
                beat["idle_s"] = time.time() - beat.get("since", beat["time"] - beat["idle_s"])
                beats.append(beat)
            except (OSError, ValueError, KeyError):
                beats.append({"rank": k, "step": -1, "phase": "no heartbeat", "idle_s": float("inf"), "host": "?"})
        behind = min(beats, key=lambda b: (b["step"], -b["idle_s"]))
        early = root is not None
        if self.observer is not None and root is None:
            root = self.observer.report_hang(self.dir.parent, self.world, self.cfg.hang_timeout / 10)
        if root is not None:
            log.error("hang started at rank %d on %s %s: %s: %s%s", root["rank"], root["host"], root["coords"],
                      root["reason"], root["detail"], " (found at observe.stall_s)" if early else "")
        log.error("hang: no progress on rank %d for %.0f s (step %d, %s); rank %d on %s is behind at step %d, "
                  "phase %s. Exiting %d so the launcher restarts the job from the newest checkpoint.",
                  self.rank, idle, self.step, self.phase, behind["rank"], behind["host"], behind["step"],
                  behind["phase"], HANG_EXIT)
        _append(self.dir.parent / "faults.jsonl", {"event": "hang_detected", "rank": self.rank, "idle_s": idle,
                                                  "behind_rank": behind["rank"], "behind_phase": behind["phase"],
                                                  "step": self.step, "attempt": attempt(), "time": time.time(),
                                                  **({"root": root, "early": early} if root else {})})
        logging.shutdown()
        os._exit(HANG_EXIT)


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


# --- Fault injection ---

def planned_faults() -> list:
    """[(kind, rank or None, value)] from MEGAREPRO_FAULT (KIND[:RANK]@VALUE[#ATTEMPT], comma-
    separated) that fire in this attempt."""
    out = []
    for item in filter(None, (s.strip() for s in os.environ.get("MEGAREPRO_FAULT", "").split(","))):
        item, _, when = item.partition("#")
        head, _, value = item.partition("@")
        kind, _, rank = head.partition(":")
        if int(when or 0) == attempt():
            out.append((kind, int(rank) if rank else None, float(value)))
    return out


SPIKE = 10.0  # how many times as long a spike:RANK@STEP makes that step's forward and backward


class Faults:
    """Fires the planned faults at their steps (checked by train.py after each step)."""

    def __init__(self, rank: int, run_dir: Path):
        self.rank, self.run_dir = rank, Path(run_dir)
        self.plan = [(k, r, v) for k, r, v in planned_faults() if r is None or r == rank]
        self.stepped = False  # whether the run's first step is over

    def slowing(self, fn, step_of, clock=None):
        """fn (a rank's forward and backward, or one pipeline action of them) made slow:RANK@FACTOR
        times as long every step, SPIKE times in the step of spike:RANK@STEP (step_of() says which
        step runs): it sleeps (factor - 1) times fn's own time, its waits left out (the rank's
        overlap.WaitClock, `clock`; none left out without one),
        inside the step's compute, so that its peers' waits for it grow. fn itself without either."""
        slow = max([v for k, _, v in self.plan if k == "slow"], default=1.0)
        spikes = {int(v) for k, _, v in self.plan if k == "spike"}
        if slow == 1.0 and not spikes:
            return fn
        waits = (lambda: sum(clock.seconds.values())) if clock is not None else (lambda: 0.0)

        def slowed(*args, **kwargs):
            waited = waits()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            own = time.perf_counter() - t0 - (waits() - waited)
            factor = slow * (SPIKE if step_of() in spikes else 1.0)
            time.sleep(max(own, 0.0) * (factor - 1))
            return out
        return slowed

    def _mine(self, kind: str, step: int) -> bool:
        return any(k == kind and int(v) == step for k, _, v in self.plan)

    def after_step(self, step: int, ckpt_dir: Path, saver) -> None:
        delay = max([v for k, _, v in self.plan if k == "slow_first_step"], default=0.0) * (not self.stepped)
        self.stepped = True
        if delay:
            self._note("slow_first_step", step)
            time.sleep(delay)
        if self._mine("kill", step):
            self._note("kill", step)
            os.kill(os.getpid(), signal.SIGKILL)
        if self._mine("hang", step):
            self._note("hang", step)
            while True:
                time.sleep(3600)
        if self._mine("truncate", step):
            import checkpoint
            saver.wait()  # the newest checkpoint is the one a restart would take
            newest = checkpoint.latest(ckpt_dir)
            if newest is not None:
                data = sorted(newest.glob("*.distcp"))[-1]
                os.truncate(data, data.stat().st_size // 2)
            self._note("truncate", step, folder=str(newest))
            os.kill(os.getpid(), signal.SIGKILL)

    def before_save(self, step: int, saver) -> None:
        """Arm the checkpoint writer: a full disk for this step's save, a slow disk for every save."""
        saver.write_delay = max([v for k, _, v in self.plan if k == "slow_save"], default=0.0)
        if self._mine("disk_full", step):
            self._note("disk_full", step)
            saver.write_error = OSError(errno.ENOSPC, "No space left on device (injected)")

    def _note(self, kind: str, step: int, **extra) -> None:
        _append(self.run_dir / "faults.jsonl", {"event": f"injected_{kind}", "rank": self.rank, "step": step,
                                               "attempt": attempt(), "time": time.time(), **extra})


def _append(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())
