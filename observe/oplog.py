"""Observability (MegaScale section 5): what every rank posted and where its time went, on disk
while it runs, and on a hang the rank it started from.

- Op log (Recorder): every collective and send/receive a rank posts through torch.distributed,
  in a bounded ring: process group and mesh dimension, per-group sequence number (the k-th
  collective of a group is the same collective on every member), per-pair sequence number of
  a send or receive, op, bytes, dtype, peer, call site, step, and the wall times of its post,
  the start of its wait and the end of its wait. Per group, a running hash of (op, bytes,
  dtype, call site), kept in each entry. The recorder is a handler of observe/comms.py's
  interposer, registered at start-up, beside the rehearsal's Recorder (clustermodel/recorder.py)
  when a real run records its first steps for its rehearsal.
- Spans: the phases the heartbeat is told (data, compute, eval, checkpoint), the segments spans.py
  times (forward and backward per chunk and microbatch, gc, checkpoint save, the agreed read) and
  every wait overlap.WaitClock times, named by what it waits for (comm tp, bubble pp recv, comm pp
  send, comm dp, comm optimizer, bubble agree: wait_label), with wall-clock start and duration.
- Snapshots: the heartbeat thread (observe/heartbeat.py) writes <run dir>/observe/attempt<A>/rank<K>.json (temporary
  file, then rename) with the ring, the spans, the main thread's Python stack and who wrote it
  (rank, host, pid, attempt, dp/pp/tp coordinates), at the heartbeat file's own bounded rate
  (at most every ft.hang_timeout/10 seconds once the first step is over, and only when
  something changed), once more at once when it finds a hang, and at once on a stop signal
  (lastwords.py, which also leaves every thread's stack on a fatal one).
- Hang localization (hangs.localize): on the hang timeout, rank 0 reads every rank's snapshot
  (once, O(world) on one rank only) and names the root rank and why. The report is appended to
  faults.jsonl; the job then exits HANG_EXIT as the heartbeat does.
- Desync (check_desync): every observe.desync_every heartbeats each rank publishes each group's
  (seq, hash) through the c10d store, and each group's lowest rank compares its members' with its
  own at that seq; a divergence is bisected to the first differing seq in the snapshots' rings and
  reported (the odd rank, both call sites) to the log and faults.jsonl, before anything hangs.
- Faults (MEGAREPRO_FAULT, fault_injection.py; start() is given them): skip:RANK@STEP (that rank does not post the first
  collective of that step on a group of more than one rank, and goes on); swap:RANK@STEP (that
  rank posts two same-size collectives of that step from two call sites in swapped order; where its
  step has none, a warning says so and faults.jsonl records it).
"""
from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import socket
import sys
import threading
import time
import traceback
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from observe import comms, spans
from observe.heartbeat import append_event, attempt
# Where a hang started (hangs.py reads the snapshots this module writes)
from observe.hangs import localize, ranks_of, read_snapshots, read_snapshots_of, snapshot_dir
# An op-log entry's fields (timeline.py defines them: it reads entries without importing this module)
from observe.timeline import BYTES, DIM, DONE, FIELDS, GROUP, HASH, OP, PEER, POST, SEQ, SITE, STEP, WAIT

log = logging.getLogger("observe")

# The collectives the op log keeps (torch.distributed function -> op name); it keeps every
# point-to-point op (comms.POINT_TO_POINT) too, and passes the others on unrecorded.
COLLECTIVES = {**comms.COLLECTIVES, "all_gather_object": "all_gather_object",
               "broadcast_object_list": "broadcast_object_list"}


@dataclass
class ObserveConfig:
    ops: bool = True         # the op log: every collective and send/receive, in a ring per rank
    ring: int = 4096         # op-log entries kept per rank (a 175B rank 0 posts ~51k ops in a step at batch 768)
    spans: int = -1          # spans kept per rank; -1: one step's of the layout (span_capacity); 0: none
    localize: bool = True    # on a hang, rank 0 reads every rank's snapshot and names the root rank
    # On a stop signal, the snapshot at once (LastWords); on a fatal one, every thread's stack
    signals: bool = True
    # Seconds rank 0 may wait in one op before it reads every rank's snapshot (once per op); a root
    # that is certain (dead, skipped, mismatch) then ends the job as a hang does, before
    # ft.hang_timeout. Keep it above ft.hang_timeout/10, the snapshots' age. 0: off.
    stall_s: float = 60.0
    # Heartbeats between cross-rank comparisons of each group's running hash (a desync found
    # before it hangs: a store set per group on every rank, a read of its members on each group's
    # lowest rank). 30 heartbeats is the snapshots' own cadence (ft.hang_timeout/10 at the
    # defaults), which a divergence needs before it can be bisected; it keeps the one store's load
    # at ~groups/30 sets a second per rank (about 3,000 a second at 12,288 ranks). 0: off.
    desync_every: int = 30
    # Only groups of at most this many ranks are compared: the mesh's tp, pp and dp groups of the
    # paper's layouts (8, 8 or 35, up to 192 at 12,288 GPUs), not the world group of a large job,
    # whose reader would fetch a key per rank (agree's all-reduce, posted from one line anyway).
    desync_max_group: int = 256


class Recorder:
    """This rank's op log and spans. Entries are lists, filled in as the op's wait starts and
    ends; the heartbeat thread copies the ring when it writes a snapshot."""

    def __init__(self, cfg: ObserveConfig, rank: int, coords: dict, dims: dict, skip_step: Optional[int] = None,
                 swap_step: Optional[int] = None, run_dir: Optional[Path] = None):
        self.cfg, self.rank, self.coords, self.dims = cfg, rank, coords, dims  # dims: group name -> mesh dim
        self.run_dir = run_dir  # where faults.jsonl is, if any
        self.last_words = None  # lastwords.LastWords while it records, where start() set them up
        self.ops = collections.deque(maxlen=cfg.ring)
        self.spans = collections.deque(maxlen=SPANS_BOUNDS[0] if cfg.spans < 0 else max(cfg.spans, 1))
        self.seq, self.hash, self.pairs, self.members = {}, {}, {}, {}
        self.step, self.phase, self.version = 0, "start", 0
        self.skip_step, self.skipped = skip_step, None
        self.stall_checked = None  # the op whose stall rank 0 last looked into
        # swap:RANK@STEP; swapped: None until that step swaps (its number) or ends with no swap (False)
        self.swap_step, self.swapped, self.held = swap_step, None, None
        self.beats, self.desynced = 0, set()  # the desync check's state
        self.waited = None  # the op whose wait began last (what a WaitClock wait waits for)
        self.signals = []  # [{name, time}] of the stop signals this rank received (LastWords)

    # --- recording ---

    def mark(self, step: int, phase: str) -> None:
        """The training loop's phase changed (heartbeat.Heartbeat.progress calls this)."""
        now = time.time()
        if spans.DEVICE is not None and phase != "compute":  # the last step's host sync has passed its events
            spans.DEVICE.resolve(self)
        if self.cfg.spans and self.spans and self.spans[-1][0] == "phase" and self.spans[-1][4] is None:
            self.spans[-1][4] = now - self.spans[-1][3]
        if self.cfg.spans:
            self.spans.append(["phase", phase, step, now, None])
        if self.step == self.swap_step and self.swapped is None and (step != self.step or phase == "done"):
            self._note_unswapped()
        self.step, self.phase = step, phase
        self.version += 1

    def wait_span(self, kind: str, start: float, seconds: float) -> None:
        """A wait WaitClock timed, at wall time `start`: kind is the label wait_label gave it (as it
        ended on a CPU, as it was queued on a GPU), or WaitClock's kind (comm or bubble) alone."""
        if " " not in kind:  # unlabelled: its op, if any, is the one waited last
            kind = self.wait_label(kind)
        self.spans.append(["wait", kind, self.step, start, seconds])

    def wait_label(self, kind: str) -> str:
        """What the wait of WaitClock's `kind` that has just ended waits for, from the op whose wait
        began last: "comm tp", "bubble pp recv", "comm pp send", "comm dp", "comm optimizer" (the
        gradient norm's and the LAMB trust ratios' all-reduces), "bubble agree" (the step's agreed
        loss and stop flag); the kind alone where no op's wait began since the last wait ended."""
        entry, self.waited = self.waited, None
        if entry is None:
            return kind
        site = entry[SITE]
        if site.startswith("optim.py") or site.endswith(" finish_gradients"):
            what = "optimizer"
        elif site.endswith(" agree"):
            what = "agree"
        elif entry[PEER] is not None:
            what = f"{entry[DIM]} {entry[OP]}"
        else:
            what = entry[DIM]
        return f"{kind} {what}"

    def add_span(self, kind: str, name: str, start: float, seconds: float) -> None:
        """A named segment (spans.py: forward, backward, gc, checkpoint save, agreed read)."""
        self.spans.append([kind, name, self.step, start, seconds])

    def _group(self, group) -> str:
        group = group or dist.group.WORLD
        name = group.group_name
        if name not in self.members:
            self.members[name] = as_range(dist.get_process_group_ranks(group))
        return name

    def post(self, op: str, tensors: list, group, peer: Optional[int], site: str) -> list:
        name = self._group(group)
        nbytes, dtype = (tensors[0].nbytes, _dtype_name(tensors[0].dtype)) if tensors else (0, "")
        running = None
        if peer is None:
            seq = self.seq[name] = self.seq.get(name, 0) + 1
            self._hash_before = self.hash.get(name, 0)
            # The call site is hashed too: two same-size ops posted in swapped order differ only there.
            running = self.hash[name] = zlib.crc32(f"{op}:{nbytes}:{dtype}:{site}".encode(), self._hash_before)
            pair_seq = None
        else:
            key = f"{name}:{op}:{peer}"
            seq, pair_seq = self.seq.get(name, 0), self.pairs.get(key, 0) + 1
            self.pairs[key] = pair_seq
        dim = self.dims.get(name)
        if dim is None:
            dim = self.dims[name] = "world" if len(ranks_of(self.members[name])) > 1 else "self"
        entry = [name, dim, seq, op, nbytes, dtype, peer, pair_seq, site, self.step, time.time(), None, None, running]
        self.ops.append(entry)
        self.version += 1
        return entry

    def skips(self, group) -> bool:
        """skip:RANK@STEP: this rank's first collective of that step on a group of several ranks is
        not posted, as a rank taking another code path would; the op log keeps it, marked skipped,
        under the sequence number it would have had, and counts on from there."""
        if self.skip_step != self.step or self.skipped is not None:
            return False
        name = self._group(group)
        if len(ranks_of(self.members[name])) < 2:
            return False
        self.skipped = self.step
        return True

    def _note_skipped(self, op: str, tensors: list, group, site: str) -> None:
        entry = self.post(f"skipped {op}", tensors, group, None, site)
        name = entry[GROUP]
        self.seq[name] -= 1  # it never went on the wire: the next op takes its number
        self.hash[name] = self._hash_before
        entry[WAIT] = entry[DONE] = entry[POST]

    def install(self) -> None:
        """Register this recorder with the interposer (observe/comms.py)."""
        comms.register(self.intercept)

    def uninstall(self) -> None:
        comms.unregister(self.intercept)

    def intercept(self, name: str, site: str, proceed, args: tuple, kwargs: dict):
        """The interposer's handler: log the op (a collective of COLLECTIVES, a send or receive)
        and post it through `proceed`, or inject skip:... or swap:..."""
        if name in comms.POINT_TO_POINT:
            self._release()
            peer = args[1] if len(args) > 1 else kwargs.get("dst", kwargs.get("src"))
            entry = self.post(comms.POINT_TO_POINT[name], [args[0]], kwargs.get("group"), peer, site)
            return self._run(proceed, args, kwargs, entry, launched=name in ("isend", "irecv"))
        op = COLLECTIVES.get(name)
        if op is None:  # gather_object, scatter_object_list, batch_isend_irecv: not in the op log
            return proceed(*args, **kwargs)
        tensors = [a for a in args if torch.is_tensor(a)]
        if self.skips(kwargs.get("group")):
            self._note_skipped(op, tensors, kwargs.get("group"), site)
            return _Skipped() if kwargs.get("async_op") else None
        if self.swap_step is not None:
            return self._swap(proceed, op, tensors, args, kwargs, site)
        return self._run(proceed, args, kwargs, self.post(op, tensors, kwargs.get("group"), None, site))

    def _run(self, proceed, args, kwargs, entry: list, launched: bool = False):
        if launched or kwargs.get("async_op"):
            return _Watched(proceed(*args, **kwargs), entry, self)
        entry[WAIT] = entry[POST]  # a blocking op waits from its post
        self.waited = entry
        work = proceed(*args, **kwargs)
        entry[DONE] = time.time()
        self.version += 1
        return work

    def _swap(self, proceed, op: str, tensors: list, args: tuple, kwargs: dict, site: str):
        """swap:RANK@STEP: in that step, a collective on a group of several ranks is held back, and
        posted after the next one when that one is the same op and size from another call site (a
        swap of two posts of one line, a loop's, is invisible to any hash of what is posted);
        else it is posted before it, unswapped, and the next is held instead. A held blocking op
        returns at once and goes on the wire later on copies of its tensors: its caller computes on
        an output never written, as a rank whose posts were swapped computes on another's data.
        A step with no such pair is reported as it ends (_note_unswapped)."""
        group, nbytes = kwargs.get("group"), sum(t.numel() * t.element_size() for t in tensors[:1])
        held, self.held = self.held, None
        if held is not None:
            same = (held[1], held[2], held[3]) == (self._group(group), op, nbytes) and held[4] != site \
                and self.step == self.swap_step
            if same:
                self.swapped = self.step
                result = self._run(proceed, args, kwargs, self.post(op, tensors, group, None, site))
                self._post_held(held)
                return result
            self._post_held(held)
        if self.swap_step == self.step and self.swapped is None and len(ranks_of(
                self.members[self._group(group)])) > 1 and "object" not in op:
            if not kwargs.get("async_op"):  # its caller goes on with the output: it is written elsewhere
                args = tuple(a.clone() if torch.is_tensor(a) else a for a in args)
            self.held = ((proceed, args, kwargs, tensors), self._group(group), op, nbytes, site)
            return _Held(self) if kwargs.get("async_op") else None
        return self._run(proceed, args, kwargs, self.post(op, tensors, group, None, site))

    def _note_unswapped(self) -> None:
        """The step of swap:RANK@STEP ended with nothing swapped: its collectives went out in
        order. A warning says so, and faults.jsonl records it (as fault_injection.py's faults)."""
        self.swapped = False
        detail = (f"swap:{self.rank}@{self.swap_step} swapped nothing: step {self.swap_step} posted no two "
                  f"same-size collectives one after the other from two call sites on a group of several ranks, "
                  f"so its collectives went out in order")
        log.warning(detail)
        if self.run_dir is not None:
            append_event(Path(self.run_dir) / "faults.jsonl", {"event": "injected_swap", "rank": self.rank,
                                                             "step": self.swap_step, "attempt": attempt(),
                                                             "time": time.time(), "swapped": False, "detail": detail})

    def _post_held(self, held: tuple) -> None:
        (proceed, args, kwargs, tensors), _, op, _, site = held
        work = self._run(proceed, args, kwargs, self.post(op, tensors, kwargs.get("group"), None, site))
        if isinstance(work, _Watched):
            work.wait()  # its caller's work object (_Held) has no wait of its own to do

    def _release(self) -> None:
        """Post a held collective (swap:...) before anything else goes on the wire."""
        held, self.held = self.held, None
        if held is not None:
            self._post_held(held)

    def check_stall(self, run_dir: Path, world: int) -> Optional[dict]:
        """On rank 0, from the heartbeat thread: once its main thread has waited observe.stall_s in
        one op, the root localize finds, if that root is certain (dead, skipped, mismatch)."""
        if self.rank != 0 or not self.cfg.stall_s or not self.cfg.localize:
            return None
        ops = list(self.ops)  # a copy: the main thread appends meanwhile
        waiting = next((e for e in reversed(ops) if e[WAIT] is not None and e[DONE] is None), None)
        if waiting is None or waiting is self.stall_checked or time.time() - waiting[WAIT] < self.cfg.stall_s:
            return None
        self.stall_checked = waiting
        self.write(run_dir)
        root = localize(read_snapshots(run_dir, world, attempt()))
        return root if root["reason"] in ("dead", "skipped", "mismatch") else None

    def report_hang(self, run_dir: Path, world: int, grace_s: float) -> Optional[dict]:
        """On this rank's hang timeout (observe/heartbeat.py): write its snapshot at once; rank 0 then reads
        every rank's and returns where the hang started (the other ranks return None)."""
        self.write(run_dir, exiting="hang")
        if self.rank != 0 or not self.cfg.localize:
            # Rank 0 times out within a few heartbeats of this rank; the launcher stops every rank
            # once one exits, so this one waits a little for rank 0 to have read the snapshots.
            time.sleep(min(2.0, grace_s))
            return None
        return localize(read_snapshots(run_dir, world, attempt()))

    # --- the snapshot ---

    def snapshot(self, exiting: str = "") -> dict:
        return {"rank": self.rank, "host": socket.gethostname(), "pid": os.getpid(), "attempt": attempt(),
                "coords": self.coords, "time": time.time(), "step": self.step, "phase": self.phase,
                "exiting": exiting, "fields": FIELDS, "ops": [list(e) for e in list(self.ops)],
                "spans": [list(s) for s in list(self.spans)], "seq": dict(self.seq), "pairs": dict(self.pairs),
                "hash": dict(self.hash), "members": dict(self.members), "stack": main_stack(),
                "signals": list(self.signals)}

    def write(self, run_dir: Path, exiting: str = "") -> Path:
        folder = snapshot_dir(run_dir, attempt())
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{self.rank}.json"
        tmp = path.with_suffix(f".{threading.get_ident()}.tmp")  # the heartbeat's and a signal's may write at once
        tmp.write_text(json.dumps(self.snapshot(exiting)))
        os.replace(tmp, path)
        return path

    # --- a desync, found before it hangs ---

    def check_desync(self, run_dir: Path, store=None) -> list:
        """Every observe.desync_every heartbeats (from the heartbeat thread): publish each group's
        newest (seq, hash) in the ring through the c10d store, one set per group; on each group's
        lowest rank, read the other members' (one check and one multi_get per group) and compare
        each with its own hash at that seq, while its ring holds it. A divergence is reported once
        per group, once the other rank's snapshot holds a differing op."""
        self.beats += 1
        if not self.cfg.desync_every or self.beats % self.cfg.desync_every:
            return []
        try:
            return self._compare(run_dir, store or dist.distributed_c10d._get_default_store())
        except (RuntimeError, ValueError, OSError) as err:  # a store gone at shutdown ends nothing
            log.debug("desync check: %s", err)
            return []

    def _compare(self, run_dir: Path, store) -> list:
        prefix = f"observe/desync/{attempt()}/"
        newest = {}
        for e in reversed(list(self.ops)):  # whole entries: the main thread sets seq and hash apart
            if e[HASH] is not None and e[GROUP] not in newest:
                newest[e[GROUP]] = (e[SEQ], e[HASH])
        compared = {name: list(ranks_of(members)) for name, members in list(self.members.items())
                    if len(ranks_of(members)) <= self.cfg.desync_max_group}
        for name, point in newest.items():
            if name in compared:
                store.set(f"{prefix}{name}/{self.rank}", json.dumps(point))
        found = []
        for name, ranks in compared.items():
            if len(ranks) < 2 or min(ranks) != self.rank or name in self.desynced:
                continue
            others = [r for r in ranks if r != self.rank]
            keys = [f"{prefix}{name}/{r}" for r in others]
            if not store.check(keys):
                continue
            mine = {e[SEQ]: e for e in list(self.ops) if e[GROUP] == name and e[HASH] is not None}
            differ = [r for r, raw in zip(others, store.multi_get(keys))
                      for seq, theirs in [json.loads(raw)] if seq in mine and mine[seq][HASH] != theirs]
            report = self._report_desync(run_dir, name, mine, differ, len(others)) if differ else None
            if report is not None:
                self.desynced.add(name)
                found.append(report)
        return found

    def _report_desync(self, run_dir: Path, name: str, mine: dict, differ: list, others: int) -> Optional[dict]:
        """Bisect to the first differing seq against the first differing member's snapshot ring;
        name the odd rank (this one where every other member differs from it and they are several),
        log it and append it to faults.jsonl. None while that snapshot holds no differing op yet
        (it is written at most every ft.hang_timeout/10 s): a later check reports it."""
        other = differ[0]
        snap = read_snapshots_of(run_dir, attempt(), [other])[other]
        theirs = {e[SEQ]: e for e in (snap["ops"] if snap else []) if e[GROUP] == name and e[HASH] is not None}
        seqs = sorted(set(mine) & set(theirs))
        if not seqs or mine[seqs[-1]][HASH] == theirs[seqs[-1]][HASH]:
            return None
        low, high = 0, len(seqs) - 1  # the running hash differs from the first divergence on
        while low < high:
            middle = (low + high) // 2
            low, high = (middle + 1, high) if mine[seqs[middle]][HASH] == theirs[seqs[middle]][HASH] else (low, middle)
        seq = seqs[low]
        a, b = mine[seq], theirs[seq]
        odd = self.rank if len(differ) == others > 1 else other
        report = {"rank": odd, "ranks": [self.rank, other], "group": name, "dim": a[DIM], "seq": seq,
                  "step": b[STEP], "ops": [a[OP], b[OP]], "bytes": [a[BYTES], b[BYTES]], "sites": [a[SITE], b[SITE]],
                  "first_held": seq == seqs[0] and seq > 1,  # the rings may not reach back to where it began
                  "detail": f"#{seq} of group {name} ({a[DIM]}): rank {self.rank} posted {a[OP]} of {a[BYTES]} "
                            f"bytes at {a[SITE]}, rank {other} posted {b[OP]} of {b[BYTES]} bytes at {b[SITE]}"}
        log.error("desync on rank %d (of ranks %s differing in group %s): %s", odd, differ, name, report["detail"])
        append_event(Path(run_dir) / "faults.jsonl", {"event": "desync", "rank": self.rank, "attempt": attempt(),
                                                    "time": time.time(), "desync": report})
        return report


class _Watched:
    """A launched op's work: its wait is timed into the op log's entry."""

    def __init__(self, work, entry: list, recorder: Recorder):
        self.work, self.entry, self.recorder = work, entry, recorder

    def wait(self, timeout=None):
        if self.entry[WAIT] is None:
            self.entry[WAIT] = time.time()
            self.recorder.version += 1
        self.recorder.waited = self.entry
        done = self.work.wait() if timeout is None else self.work.wait(timeout)
        if self.entry[DONE] is None:
            self.entry[DONE] = time.time()
            self.recorder.version += 1
        return done

    def __getattr__(self, name):
        return getattr(self.work, name)


class _Held:
    """The work of a collective swap:... holds back: waiting on it posts it (unswapped)."""

    def __init__(self, recorder: Recorder):
        self.recorder = recorder

    def wait(self, timeout=None):
        self.recorder._release()
        return True

    def is_completed(self):
        return self.recorder.held is None


class _Skipped:
    """The work of a collective skip:... did not post: complete at once."""

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True


def as_range(ranks: list) -> list:
    """A group's global ranks as ["range", start, stop, step] where they are an arithmetic
    progression (a mesh dimension's groups are), so that a snapshot holds four items for the world
    group, not one per rank; else the ranks themselves."""
    step = ranks[1] - ranks[0] if len(ranks) > 1 else 1
    if step > 0 and ranks == list(range(ranks[0], ranks[-1] + 1, step)):
        return ["range", ranks[0], ranks[-1] + 1, step]
    return list(ranks)


def _dtype_name(dtype) -> str:
    name = _DTYPES.get(dtype)
    if name is None:
        name = _DTYPES[dtype] = str(dtype).removeprefix("torch.")
    return name


_DTYPES: dict = {}  # torch dtype -> its name ("float32"), found once


def main_stack(limit: int = 12) -> list:
    """The main thread's Python stack, innermost last, as "file:line function" lines."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return []
    return [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in traceback.extract_stack(frame)[-limit:]]




SPANS_BOUNDS = (2048, 32768)  # the spans ring's least and most entries: ~4 MB of a snapshot at the most
SPANS_PER_STEP_FIXED = 256  # phases, DP and optimizer waits, GC, checkpoint, agreed read: at most, a step


def span_capacity(cfg, layers: int) -> int:
    """The spans ring's size for a run's config (observe.spans=-1): one step of this rank's spans,
    within SPANS_BOUNDS. A step has, per model chunk and microbatch, a forward and a backward
    segment, each with a pipeline receive wait before it and a send wait after it, and with tp > 1
    four TP waits per layer of the chunk (the sequence-parallel gather and scatter each way), plus
    SPANS_PER_STEP_FIXED. At the paper's 175B layout (Table 2: TP8 PP8, 6 chunks, ~190
    microbatches, 2 layers a chunk) that is ~16k, which the ring holds; smaller layouts keep the
    least, several steps. `layers`: the most blocks a pipeline rank holds (chunks may differ in
    size: parallel.pp_first/last_chunk_layers; the caller counts them, as observe imports nothing
    of the training code)."""
    p = cfg.parallel
    per_microbatch = p.vpp * 2 * 3 + (4 * layers if p.tp > 1 else 0)
    return min(max(p.microbatches * per_microbatch + SPANS_PER_STEP_FIXED, SPANS_BOUNDS[0]), SPANS_BOUNDS[1])


def start(cfg: ObserveConfig, layout, run_dir: Optional[Path] = None, device=None,
          spans_capacity: int = SPANS_BOUNDS[0], faults: tuple = ()) -> Optional[Recorder]:
    """Install this rank's recorder (cfg.ops), its segments (cfg.spans; spans_capacity entries where
    it is -1: span_capacity's) and, with a run dir, its last words on a signal (cfg.signals; from
    the main thread); or none. faults: the planned faults (fault_injection.planned_faults), whose skip:RANK@STEP
    and swap:RANK@STEP this rank's recorder injects."""
    if not cfg.ops:
        return None
    skip = [int(v) for k, r, v in faults if k == "skip" and r == layout.rank]
    swap = [int(v) for k, r, v in faults if k == "swap" and r == layout.rank]
    if cfg.spans < 0:
        cfg = dataclasses.replace(cfg, spans=spans_capacity)
    recorder = Recorder(cfg, layout.rank, layout.coordinates(), dim_names(layout), skip[0] if skip else None,
                        swap[0] if swap else None, run_dir)
    recorder.install()
    if cfg.spans:
        spans.SINK = recorder
        if device is not None and torch.device(device).type == "cuda":
            spans.DEVICE = spans.DeviceSegments(torch.cuda.Event)
    if cfg.signals and run_dir is not None and threading.current_thread() is threading.main_thread():  # (signal's rule)
        from observe import lastwords
        recorder.last_words = lastwords.LastWords(recorder, Path(run_dir))
    return recorder


def stop(recorder: Optional[Recorder]) -> None:
    """Undo what start() installed for `recorder` (its last words, the segments, the interposer's handler)."""
    if recorder is None:
        return
    if recorder.last_words is not None:
        recorder.last_words.close()
        recorder.last_words = None
    if spans.DEVICE is not None:
        spans.DEVICE.resolve(recorder)
    spans.SINK, spans.DEVICE = None, None
    recorder.uninstall()



def dim_names(layout) -> dict:
    """{process group name: mesh dimension} for this rank's mesh groups and pipeline channels."""
    names = {}
    if getattr(layout, "mesh", None) is not None:
        for dim in layout.mesh.mesh_dim_names:
            names.setdefault(layout.mesh.get_group(dim).group_name, dim)
    for group in getattr(layout, "pp_channels", {}).values():
        names.setdefault(group.group_name, "pp")
    if getattr(layout, "zero_mesh", None) is not None:  # hybrid sharding's split of dp: DP's collectives still
        for dim in ("dp_shard", "dp_replicate"):
            names.setdefault(layout.zero_mesh.get_group(dim).group_name, "dp")
    return names
