"""Recording every collective and send/receive a rank posts: the rehearsal's eyes (rehearsal.py),
also worn by a real run (rehearse.record) so that the two compare op by op. While active, a
Recorder is a handler of observe/comms.py's interposer on torch.distributed's collectives and
point-to-point (in front of the op log's, in a real run); with NCCL's rules on it also names
every tensor off the compute device, every host read of a device tensor beyond the step's one,
and every host-to-device copy that waits for the host (host_syncs.py).
"""
from __future__ import annotations

import contextlib
import functools
import json
import sys
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

from clustermodel import host_syncs
from observe import comms
from observe.comms import COLLECTIVES, OBJECTS, POINT_TO_POINT

HERE = str(Path(__file__).resolve().parents[1])  # the repository: frames under it are the code's own
# Frames of the rules on host reads and copies, and of the rehearsal, not call sites.
WRAPPERS = {str(Path(__file__).resolve()), str(Path(__file__).with_name("rehearsal.py").resolve()),
            str(Path(host_syncs.__file__).resolve())}


# --- Recording every collective and send/receive ---


class Violation(Exception):
    pass


class _Done:
    """A completed work, for the fake mode (what the fake backend returns, plus the record)."""

    def __init__(self, recorder, index):
        self.recorder, self.index = recorder, index

    def wait(self, timeout=None):
        self.recorder.waited(self.index)
        return True

    def is_completed(self):
        return True

    def get_future(self):
        fut = torch.futures.Future()
        fut.set_result(None)
        return fut


class _Tracked:
    """A real work, recording its wait."""

    def __init__(self, recorder, index, work):
        self.recorder, self.index, self.work = recorder, index, work

    def wait(self, timeout=None):
        self.recorder.waited(self.index)
        return self.work.wait()

    def is_completed(self):
        return self.work.is_completed()

    def __getattr__(self, name):
        return getattr(self.work, name)


class Recorder:
    """Records torch.distributed's collectives and point-to-point while active. fake=True does
    nothing but record and hand back completed works (the rehearsal); fake=False records and
    calls through (a real run, to compare with its rehearsal). With nccl_rules, a tensor that is
    not on `device` is a violation naming the call site, and so are every host read of a
    device tensor except the step's one (named_read) and every host-to-device copy that
    syncs inside a step (host_syncs.py)."""

    def __init__(self, layout, device: torch.device, fake: bool, nccl_rules: bool = True):
        self.layout, self.device, self.fake, self.nccl_rules = layout, torch.device(device), fake, nccl_rules
        self.events, self.violations, self.step = [], [], 0
        self.in_flight = {}  # op index -> weak references to the storages of its tensors, until waited
        self._dims = _dim_names(layout)
        self._saved, self._reading = {}, False
        self.take_work = None  # the compute since the last event (FlopLedger.segment.take), stamped on each

    # recording while active

    def __enter__(self):
        comms.register(self._call)
        if self.nccl_rules:
            for name in ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__"):
                self._saved[f"Tensor.{name}"] = getattr(torch.Tensor, name)
                setattr(torch.Tensor, name, _host_read(self, name, self._saved[f"Tensor.{name}"]))
            host_syncs.install(self, self._saved, _site)
        return self

    def __exit__(self, *exc):
        comms.unregister(self._call)
        for name, fn in self._saved.items():
            if name.startswith("Tensor."):
                setattr(torch.Tensor, name[7:], fn)
            else:
                setattr(torch, name[6:], fn)
        self._saved.clear()

    @contextlib.contextmanager
    def named_read(self):
        """The step's one host read (train.py reads loss, stop flag and grad norm at once)."""
        self._reading = True
        self._append({"i": len(self.events), "step": self.step, "op": "host_read", "site": _site()})
        try:
            yield
        finally:
            self._reading = False

    # what a call records

    def _call(self, name, site, proceed, args, kwargs):
        """The interposer's handler (observe/comms.py): record the call, then, unless fake, make it."""
        if name in OBJECTS:
            self._record(name, [], kwargs.get("group"), None, site, async_op=False)
            if self.fake:
                return _fake_object_collective(name, *args, **kwargs)
            return proceed(*args, **kwargs)
        if name == comms.BATCH:
            ops = args[0]
            index = self._record("batch", [(POINT_TO_POINT[o.op.__name__], o.tensor, o.group, o.peer) for o in ops],
                                 None, None, site, async_op=True, batched=True)
            if self.fake:
                return [_Done(self, index) for _ in ops]
            return [_Tracked(self, index, w) for w in proceed(*args, **kwargs)]
        async_op = kwargs.get("async_op", False) or name in ("isend", "irecv")
        if name in POINT_TO_POINT:
            tensor = args[0]
            peer = args[1] if len(args) > 1 else kwargs.get("dst", kwargs.get("src"))
            index = self._record(POINT_TO_POINT[name], [tensor], kwargs.get("group"), peer, site, async_op)
        else:
            tensors = [a for a in args if torch.is_tensor(a)]
            index = self._record(COLLECTIVES[name], tensors, kwargs.get("group"), None, site, async_op)
        if self.fake:
            work = _Done(self, index)
        else:
            real = proceed(*args, **kwargs)
            work = _Tracked(self, index, real) if real is not None else None
        if not async_op:
            self.waited(index)
            return None
        return work

    def _record(self, op, tensors, group, peer, site, async_op, batched=False) -> int:
        index = len(self.events)
        self._posting = []
        if batched:  # [(send|recv, tensor, group, peer)]
            parts = [self._describe(kind, [t], g, p, site) for kind, t, g, p in tensors]
            event = {"i": index, "step": self.step, "op": "batch", "ops": parts, "site": site, "async": True}
        else:
            event = {"i": index, "step": self.step, **self._describe(op, tensors, group, peer, site), "async": async_op}
        self._append(event)
        self.in_flight[index] = self._posting
        return index

    def comm_storages(self) -> set:
        """Keys of the live storages of operations posted and not yet waited for."""
        return {id(ref()) for refs in self.in_flight.values() for ref in refs if ref() is not None}

    def _describe(self, op, tensors, group, peer, site) -> dict:
        group = group if group is not None else dist.group.WORLD
        ranks = dist.get_process_group_ranks(group)
        first = tensors[0] if tensors else None
        out = {"op": op, "group": self._dims.get(group.group_name, "world" if len(ranks) == dist.get_world_size() else "other"),
               "comm": group.group_name, "ranks": ranks, "site": site}
        if peer is not None:
            out["peer"] = int(peer)
        if first is not None:
            # the bytes a rank puts on the wire: a gather's input, a scatter's output, else the tensor
            moved = tensors[-1] if op == "all_gather" else first
            out.update(shape=list(first.shape), dtype=str(first.dtype).removeprefix("torch."),
                       bytes=moved.numel() * moved.element_size(), device=first.device.type)
            for t in tensors:
                self._posting.append(weakref.ref(t.untyped_storage()))
                if self.nccl_rules and t.device.type != self.device.type:
                    self.violations.append(f"{op} on {out['group']} at {site}: a {t.device.type} tensor, but NCCL "
                                           f"takes only tensors on the compute device ({self.device.type})")
        return out

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"rank": self.layout.rank, "coordinates": self.layout.coordinates(),
                                    "comm": self.events, "violations": self.violations}))

    def waited(self, index: int) -> None:
        self.in_flight.pop(index, None)
        self._append({"i": len(self.events), "step": self.step, "op": "wait", "of": index})

    def _append(self, event: dict) -> None:
        if self.take_work is not None:
            event["work"] = self.take_work()
        self.events.append(event)


def op_of(Op, ev: dict):
    """An event as nccl_rules sees it."""
    sig = (tuple(ev.get("shape", ())), ev.get("dtype")) if ev["op"] in ("send", "recv") else (ev.get("bytes"), ev.get("dtype"))
    return Op(ev["op"], tuple(ev["ranks"]), ev.get("peer"), sig=sig, site=ev["site"], comm=ev.get("comm"))


def _dim_names(layout) -> dict:
    """{process group name: mesh dimension} for this rank's mesh groups and pipeline channels."""
    names = {}
    if layout.mesh is not None:
        for dim in layout.mesh.mesh_dim_names:
            names[layout.mesh.get_group(dim).group_name] = dim
    for group in layout.pp_channels.values():
        names[group.group_name] = "pp"
    if getattr(layout, "zero_mesh", None) is not None:  # hybrid sharding's split of dp, apart: it crosses other links
        for dim in ("dp_shard", "dp_replicate"):
            names[layout.zero_mesh.get_group(dim).group_name] = dim
    return names


@functools.lru_cache(maxsize=None)
def _is_this_file(name: str) -> bool:
    return str(Path(name).resolve()) in WRAPPERS


def _site() -> str:
    """The first frame outside torch and this file: the project's line that made the call."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(HERE) and not _is_this_file(name):
            return f"{Path(name).name}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


def _host_read(recorder, name, original):
    def read(self, *args, **kwargs):
        if self.device.type == recorder.device.type and recorder.device.type != "cpu" and not recorder._reading:
            recorder.violations.append(f"host read ({name}) of a {self.device.type} tensor at {_site()}: "
                                       f"a device sync beyond the step's one")
        if self.is_meta:  # nothing to read: stand in with zeros of the right kind
            stand_in = torch.zeros(self.shape, dtype=self.dtype)
            return getattr(stand_in, name)(*args, **kwargs) if name != "cpu" else stand_in
        return original(self, *args, **kwargs)
    return read


def _fake_object_collective(name, *args, **kwargs):
    """What the fake backend does with objects: every slot gets this rank's."""
    if name == "all_gather_object":
        out, obj = args[0], args[1]
        for k in range(len(out)):
            out[k] = obj
    elif name == "gather_object":
        out = args[1] if len(args) > 1 else kwargs.get("object_gather_list")
        if out is not None:
            for k in range(len(out)):
                out[k] = args[0]
    elif name == "scatter_object_list":
        out, inputs = args[0], args[1] if len(args) > 1 else kwargs.get("scatter_object_input_list")
        if inputs:
            out[0] = inputs[0]
