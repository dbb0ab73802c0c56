"""The heartbeat: every rank's training loop says where it is (step, phase); a daemon thread watches it,
publishes it, and ends a rank whose progress stopped (MegaScale section 4: a broken rank found fast
and the job restarted from the newest checkpoint).

The thread writes it to <run dir>/heartbeat/rank<K>.json (atomically) for anyone to read, when it has
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
Stragglers are observe/stragglers.py's; ft.* configures both (FTConfig).
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

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
        append_event(self.dir.parent / "faults.jsonl", {"event": "hang_detected", "rank": self.rank, "idle_s": idle,
                                                  "behind_rank": behind["rank"], "behind_phase": behind["phase"],
                                                  "step": self.step, "attempt": attempt(), "time": time.time(),
                                                  **({"root": root, "early": early} if root else {})})
        logging.shutdown()
        os._exit(HANG_EXIT)


def append_event(path: Path, record: dict) -> None:
    """One event appended to a run's faults.jsonl, on disk before it returns (a rank may die next)."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())
