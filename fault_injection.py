"""Fault injection (MEGAREPRO_FAULT), for tests and experiments/faults.py: the faults that prove the
heartbeat (observe/heartbeat.py), the stragglers report and the checkpoints detect and survive them.

The faults: kill:RANK@STEP (SIGKILL itself),
hang:RANK@STEP (sleeps forever), disk_full@STEP (the save at that step fails with ENOSPC),
truncate@STEP (truncates the newest checkpoint's data, then SIGKILLs itself), slow_save@SECONDS
(each background checkpoint write takes that much longer), slow_first_step@SECONDS (the run's
first step takes that much longer, as one that compiles and connects does), slow:RANK@FACTOR (that
rank's forward and backward take FACTOR times as long, every step), spike:RANK@STEP (that rank's
forward and backward of that one step take SPIKE times as long). Several, comma-separated; each
fires only in the attempt (restart) it names with #ATTEMPT, default 0.
"""
from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from pathlib import Path

from observe.heartbeat import append_event, attempt

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

    def slowing(self, step_of, clock=None):
        """The hook around each unit of this rank's compute (ParallelModel.around_compute: its forward
        and backward, or one pipeline action of them) that makes it slow:RANK@FACTOR times as long
        every step, SPIKE times in the step of spike:RANK@STEP (step_of() says which step runs): it
        sleeps (factor - 1) times the unit's own time, its waits left out (the rank's
        overlap.WaitClock, `clock`; none left out without one), inside the step's compute, so that
        its peers' waits for it grow. None where neither names this rank."""
        slow = max([v for k, _, v in self.plan if k == "slow"], default=1.0)
        spikes = {int(v) for k, _, v in self.plan if k == "spike"}
        if slow == 1.0 and not spikes:
            return None
        waits = (lambda: sum(clock.seconds.values())) if clock is not None else (lambda: 0.0)

        @contextlib.contextmanager
        def slowed(backward: bool, action=None):
            waited, t0 = waits(), time.perf_counter()
            yield
            own = time.perf_counter() - t0 - (waits() - waited)
            factor = slow * (SPIKE if step_of() in spikes else 1.0)
            time.sleep(max(own, 0.0) * (factor - 1))
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
        append_event(self.run_dir / "faults.jsonl", {"event": f"injected_{kind}", "rank": self.rank, "step": step,
                                               "attempt": attempt(), "time": time.time(), **extra})
