"""A rank's last state on disk when it is signalled, even while its main thread is wedged (oplog.py's
recorder writes it). Apart from oplog.py, which records, so that each file holds one thing."""
from __future__ import annotations

import faulthandler
import logging
import os
import signal
import threading
import time
from pathlib import Path

from observe.heartbeat import attempt
from observe.hangs import snapshot_dir

log = logging.getLogger("observe")


class LastWords:
    """A rank's last state on disk when it is signalled, even while its main thread is wedged.

    - A stop signal (STOPS: a launcher's SIGTERM, SLURM's USR1/USR2 before a preemption, Ctrl-C):
      this rank's snapshot is written at once, noting the signal, by a thread that
      signal.set_wakeup_fd wakes (a Python handler runs only in the main thread, and not until a
      collective it waits in returns, which a hang never does); then the handler that was there
      before runs (train.py's stop flag, which saves and exits at the next agreed step, and through
      it submitit's requeue), or the default action once the snapshot is out.
    - A fatal signal (SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL): no Python runs after it, so
      faulthandler writes every thread's stack to rank<K>.stacks.txt beside the snapshot, then
      the default action ends the process (the snapshot is the heartbeat's last one).
    Where the wakeup fd is taken already (an event loop's), the snapshot is written by the handler."""

    STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)

    def __init__(self, recorder, run_dir: Path):
        self.recorder, self.run_dir = recorder, run_dir
        folder = snapshot_dir(run_dir, attempt())
        folder.mkdir(parents=True, exist_ok=True)
        self.stacks = open(folder / f"rank{recorder.rank}.stacks.txt", "w")
        self.faulthandler_was = faulthandler.is_enabled()  # (to stderr: PYTHONFAULTHANDLER, torchrun's)
        faulthandler.enable(self.stacks, all_threads=True)
        self.written = threading.Event()
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.write_fd, False)
        self.previous_fd = signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)
        self.woken = self.previous_fd == -1
        if not self.woken:  # someone else's: put it back, and write from the handler instead
            signal.set_wakeup_fd(self.previous_fd)
        self.previous = {s: signal.signal(s, self._handle) for s in self.STOPS}
        self.thread = threading.Thread(target=self._watch, name="observe-signals", daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while True:
            try:
                received = os.read(self.read_fd, 64)
            except OSError:
                return
            if not received or 0 in received:  # closed, or close()'s own byte
                return
            for signum in received:
                if signum in self.STOPS:
                    self._write(signum)

    def _write(self, signum: int) -> None:
        self.recorder.signals.append({"name": signal.Signals(signum).name, "time": time.time()})
        try:
            self.recorder.write(self.run_dir)
        except OSError as err:
            log.warning("the snapshot on %s was not written: %s", signal.Signals(signum).name, err)
        self.written.set()

    def _handle(self, signum, frame) -> None:
        if self.woken:
            self.written.wait(timeout=5.0)  # the thread's snapshot is out before any exit
        else:
            self._write(signum)
        self.written.clear()
        previous = self.previous[signum]
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def close(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        if self.woken:
            signal.set_wakeup_fd(-1)
        os.write(self.write_fd, b"\0")
        self.thread.join(timeout=5.0)
        os.close(self.read_fd)
        os.close(self.write_fd)
        faulthandler.disable()
        if self.faulthandler_was:
            faulthandler.enable()
        self.stacks.close()
