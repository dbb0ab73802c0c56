"""Named segments of a step (forward and backward per pipeline chunk and microbatch, GC, the
checkpoint save, the agreed read) timed into oplog.py's spans: `with spans.segment(name, device):`
where the work runs. A leaf module (it imports no project module), so parallelisms/pipeline.py, parallel.py and
launch.py and the heartbeat can mark their segments without importing observe/oplog.py, whose analysis reaches the cluster
model and through it parallel.py.

On a CPU (or with no device) a segment is the host's wall clock around the work. On a GPU the host
only queues the work, so a segment is a pair of CUDA events on the compute stream (from a pool, as
overlap.WaitClock's waits), resolved at the next step's start, after the step's one host sync has
passed them; a step's first event is placed at the host time it was queued, as WaitClock places
its waits."""
from __future__ import annotations

import time
from typing import Optional

SINK = None  # observe.Recorder while a run records spans: its add_span(kind, name, start, seconds)


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


NULL = _Null()


class _Host:
    """A segment timed by the host's wall clock."""

    __slots__ = ("name", "start")

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        self.start = time.time()
        return self

    def __exit__(self, *exc):
        if SINK is not None:
            SINK.add_span("segment", self.name, self.start, time.time() - self.start)
        return False


class DeviceSegments:
    """Segments timed by events on a device's compute stream. `events`: the event class
    (torch.cuda.Event; tests pass a stand-in, as WaitClock's do)."""

    def __init__(self, events):
        self.events = events
        self._pool, self._used, self._pending = [], 0, []  # pending: (name, start event, end event)
        self._anchor: Optional[tuple] = None  # (event, the host time it was queued)

    def _event(self):
        if self._used == len(self._pool):
            self._pool.append(self.events(enable_timing=True))
        self._used += 1
        return self._pool[self._used - 1]

    def segment(self, name: str) -> "_Device":
        if self._anchor is None:
            anchor = self._event()
            anchor.record()
            self._anchor = (anchor, time.time())
        return _Device(self, name)

    def resolve(self, sink) -> None:
        """Hand every pending segment to `sink` (after a host sync has passed their events)."""
        if self._anchor is not None and self._pending:
            anchor, wall = self._anchor
            anchor.synchronize()
            for name, a, b in self._pending:
                b.synchronize()
                sink.add_span("segment", name, wall + anchor.elapsed_time(a) / 1e3, a.elapsed_time(b) / 1e3)
        self._pending, self._used, self._anchor = [], 0, None


class _Device:
    __slots__ = ("owner", "name", "start")

    def __init__(self, owner: DeviceSegments, name: str):
        self.owner, self.name = owner, name

    def __enter__(self):
        self.start = self.owner._event()
        self.start.record()
        return self

    def __exit__(self, *exc):
        end = self.owner._event()
        end.record()
        self.owner._pending.append((self.name, self.start, end))
        return False


DEVICE: Optional[DeviceSegments] = None  # set by oplog.py on a CUDA rank


def segment(name: str, device=None):
    """A context that times the work inside it as segment `name`; nothing while no run records."""
    if SINK is None:
        return NULL
    if DEVICE is not None and device is not None and getattr(device, "type", device) != "cpu":
        return DEVICE.segment(name)
    return _Host(name)


def action_name(action: tuple) -> str:
    """A pipeline action's segment: "forward c0 mb1" (chunk 0, microbatch 1), "backward ..."."""
    kind, mb, chunk = action
    return f"{'forward' if kind == 'F' else 'backward'} c{chunk} mb{mb}"
