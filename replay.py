"""The step time of the code as it runs: a rehearsal's programs replayed on a machine's rates.

perfmodel.py prices the step from the layout (what a Megatron-style step should issue); this
prices what the code did issue, as SimAI (NSDI'25) replays a framework's own workload on a
calibrated network. The workload is rehearsal.py's record of each rehearsed rank: every
collective, send, receive and wait in program order, each stamped with the compute since the
event before it (GEMM and batched-GEMM shapes, the fused attention kernels' FLOPs, bytes of
the memory-bound kernels). The rates are
perfmodel's (Rates, Network), so both models stand on one calibration and the analytical step
stays the cross-check.

The replay is a discrete-event simulation. Each rank has one compute stream; a wait blocks it
until its operation ends. Each rank runs a process group's collectives in order on a stream of
their own (NCCL: a communicator's kernels are ordered; gloo: a group's work queue), sends and
receives each direction on their own. A collective starts when every rehearsed member has posted
it and its streams are free (members not rehearsed mirror the rank that was: ranks of one stage
issue the same program); a send and its receive pair up first in, first out, per pair of ranks,
and start when both are posted. Compute that runs beside communication in flight is slowed by
hardware.overlap_slowdown of the overlapped time (gloo's threads take the same cores; NCCL's
kernels take SMs). Not modelled: contention between two groups' transfers on one link (each group
gets the link's rate), and the host's Python time beyond the per-op overhead.

    python perfmodel.py validate <run dirs>    # prices each run both ways, beside its measured step
"""
from __future__ import annotations

import json
from collections import deque
from pathlib import Path
from typing import Dict, List, Optional

import perfmodel as pm

GATHERS = ("all_gather", "reduce_scatter")  # recorded bytes are one rank's shard of the buffer


def compute_time(work: dict, r: pm.Rates) -> float:
    """Seconds of one recorded segment of compute on rates r."""
    seconds = sum(n * pm.gemm_time(r, M, N, K, 1, e) for M, N, K, e, n in work.get("gemm", ()))
    seconds += sum(n * pm.gemm_time(r, M, N, K, B, e) for B, M, N, K, e, n in work.get("bmm", ()))
    if work.get("attention_ops"):
        seconds += pm._kernel(r, work["attention"] / (r.flops * r.flash_eff), work["attention_ops"])
    if work.get("ops"):
        seconds += pm.stream_time(r, work["bytes"], work["ops"])
    return seconds


def comm_time(ev: dict, net: pm.Network) -> float:
    """Seconds one recorded operation takes on the wire (a batch's parts are priced one by one)."""
    op, n = ev["op"], len(ev.get("ranks", ()))
    if op in ("send", "recv"):
        return net.pp_send(ev.get("bytes", 0))
    if n <= 1:
        return 0.0
    nbytes = ev.get("bytes", 0) * (n if op in GATHERS else 1)
    kind = op if op in ("all_reduce",) + GATHERS else "all_gather"  # broadcast, objects, barrier: one pass
    if ev.get("group") in ("tp", "pp", "dp") and n == getattr(net.lay, ev["group"]):
        return net.collective(kind, nbytes, ev["group"])
    link = net.inter if n > net.hw.devices_per_host else net.intra
    nbytes /= (net.hw.collective_efficiency or {}).get(kind, 1.0)
    return pm.collective_time(kind, nbytes, n, *link, net.hw.collective_algo)


class _Rank:
    """One rehearsed rank's program, replayed: its clock, and when each of its operations ends."""

    def __init__(self, record: dict):
        self.rank, self.events = record["rank"], record["comm"]
        self.pos, self.t, self.computed = 0, 0.0, False
        self.ends: Dict[int, float] = {}              # op index -> when its transfers end (so far)
        self.parts: Dict[int, list] = {}              # op index -> its transfers (a batch has several)
        self.unmatched: Dict[int, int] = {}           # op index -> its transfers whose peer has not posted
        self.busy: List[tuple] = []                   # (start, end) of its transfers: the overlap's
        self.streams: Dict[tuple, float] = {}         # stream -> when it is next free
        self.stalls = {"comm": 0.0, "bubble": 0.0}
        self.step_ends: Dict[int, float] = {}
        self.stalls_at: Dict[int, dict] = {}


class Replay:
    """The rehearsed ranks' programs run together on rates r and network net (the module's rules);
    run() replays every event, step(k) reads off step k."""

    def __init__(self, records: List[dict], r: pm.Rates, net: pm.Network, slowdown: float):
        self.ranks = {rec["rank"]: _Rank(rec) for rec in records}
        self.r, self.net, self.slowdown = r, net, slowdown
        self.p2p: Dict[tuple, deque] = {}    # (src, dst, "send"|"recv") -> posted, not yet paired
        self.joint: Dict[tuple, dict] = {}   # (comm, k-th) -> {rank: post time} of a shared collective
        self.nth: Dict[tuple, int] = {}      # (rank, comm) -> collectives posted on it so far

    def run(self) -> None:
        progressed = True
        while progressed:
            progressed = False
            for rank in self.ranks.values():
                while rank.pos < len(rank.events) and self._advance(rank):
                    progressed = True
        stuck = [r.rank for r in self.ranks.values() if r.pos < len(r.events)]
        if stuck:
            raise RuntimeError(f"replay: ranks {stuck} wait for operations no rehearsed rank posts")

    def _advance(self, rank: _Rank) -> bool:
        """Handles rank's next event; False if it must wait for another rank first."""
        ev = rank.events[rank.pos]
        if not rank.computed:
            self._compute(rank, compute_time(ev.get("work", {}), self.r))
            rank.computed = True
        op = ev["op"]
        if op == "wait":
            if rank.unmatched.get(ev["of"]):
                return False
            end = rank.ends.get(ev["of"], rank.t)
            if end > rank.t:
                kind = "bubble" if any(p["op"] == "recv" for p in rank.parts.get(ev["of"], ())) else "comm"
                rank.stalls[kind] += end - rank.t
                rank.t = end
        elif op == "host_read":
            if isinstance(ev["step"], int):
                rank.step_ends[ev["step"]], rank.stalls_at[ev["step"]] = rank.t, dict(rank.stalls)
        else:
            self._post(rank, ev)
        rank.pos, rank.computed = rank.pos + 1, False
        return True

    def _compute(self, rank: _Rank, seconds: float) -> None:
        start, end = rank.t, rank.t + seconds
        overlapped = sum(max(0.0, min(b, end) - max(a, start)) for a, b in rank.busy if b > start)
        rank.t = end + self.slowdown * overlapped
        rank.busy = [(a, b) for a, b in rank.busy if b > start]

    def _post(self, rank: _Rank, ev: dict) -> None:
        parts = ev["ops"] if ev["op"] == "batch" else [ev]
        rank.parts[ev["i"]], rank.unmatched[ev["i"]] = parts, len(parts)
        for part in parts:
            if part["op"] in ("send", "recv"):
                self._post_p2p(rank, ev["i"], part)
            else:
                self._post_collective(rank, ev["i"], part)

    def _finish(self, rank: _Rank, index: int, stream: tuple, start: float, seconds: float) -> None:
        start = max(start, rank.streams.get(stream, 0.0))
        end = start + seconds
        rank.streams[stream] = end
        rank.busy.append((start, end))
        rank.ends[index] = max(rank.ends.get(index, 0.0), end)
        rank.unmatched[index] -= 1

    def _post_p2p(self, rank: _Rank, index: int, part: dict) -> None:
        me, peer = rank.rank, part["peer"]
        src, dst = (me, peer) if part["op"] == "send" else (peer, me)
        seconds = comm_time(part, self.net)
        if peer not in self.ranks:  # its peer mirrors: posted now
            self._finish(rank, index, (part["op"], peer), rank.t, seconds)
            return
        other = "recv" if part["op"] == "send" else "send"
        waiting = self.p2p.get((src, dst, other))
        if not waiting:
            self.p2p.setdefault((src, dst, part["op"]), deque()).append((rank, index, rank.t))
            return
        their_rank, their_index, their_t = waiting.popleft()
        start = max(rank.t, their_t, rank.streams.get((part["op"], peer), 0.0),
                    their_rank.streams.get((other, me), 0.0))
        self._finish(rank, index, (part["op"], peer), start, seconds)
        self._finish(their_rank, their_index, (other, me), start, seconds)

    def _post_collective(self, rank: _Rank, index: int, part: dict) -> None:
        comm, seconds = part.get("comm"), comm_time(part, self.net)
        members = [m for m in part.get("ranks", ()) if m in self.ranks]
        k = self.nth[(rank.rank, comm)] = self.nth.get((rank.rank, comm), -1) + 1
        posted = self.joint.setdefault((comm, k), {})
        posted[rank.rank] = (index, rank.t)
        if len(posted) < len(members):
            return
        start = max(max(t, self.ranks[m].streams.get(("coll", comm), 0.0)) for m, (_, t) in posted.items())
        for m, (i, _) in posted.items():
            self._finish(self.ranks[m], i, ("coll", comm), start, seconds)
        del self.joint[(comm, k)]

    def step(self, step: int) -> dict:
        """The slowest rank's step `step`: its time and how much of it stood waiting."""
        rows = []
        for rank in self.ranks.values():
            before, after = rank.step_ends.get(step - 1, 0.0), rank.step_ends[step]
            s0, s1 = rank.stalls_at.get(step - 1, {"comm": 0.0, "bubble": 0.0}), rank.stalls_at[step]
            comm, bubble = s1["comm"] - s0["comm"], s1["bubble"] - s0["bubble"]
            rows.append({"step_s": after - before, "comm_s": comm, "bubble_s": bubble,
                         "compute_s": after - before - comm - bubble})
        return max(rows, key=lambda row: row["step_s"])


def predict(records: List[dict], cfg, hw, gpus: int) -> dict:
    """The replayed steady step (the last rehearsed) of cfg's rehearsed ranks on hardware hw (resolved)."""
    lay = pm.layout_of(cfg, gpus)
    cfg = pm.resolve_config(cfg, hw)
    r, net = pm.Rates.of(hw, pm.precision(cfg), lay.gpus), pm.Network(hw, lay)
    replay = Replay(records, r, net, hw.overlap_slowdown or 0.0)
    replay.run()
    out = replay.step(max(rec["steps"] for rec in records))
    data = hw.loader_step_s if cfg.data.pipeline != "megascale" else 0.0
    out["step_s"] += data
    return out


def stage_ranks(cfg, gpus: int) -> List[int]:
    """One rank per pipeline stage, the first of its DP and TP groups: the ranks whose programs
    make up the step (the others of a stage mirror them)."""
    lay = pm.layout_of(cfg, gpus)
    sizes = {"dp": lay.dp, "pp": lay.pp, "tp": lay.tp}
    stride = {d: 1 for d in lay.order}
    for inner, dim in zip(reversed(lay.order), reversed(lay.order[:-1])):
        stride[dim] = stride[inner] * sizes[inner]
    return [s * stride["pp"] for s in range(lay.pp)]


def rehearse(cfg, hw, gpus: int, out: Path) -> List[dict]:
    """The records of stage_ranks, rehearsed in this process (once: kept in `out`), with what
    `auto` leaves to the machine decided as a run on hw (resolved) decides it: an fp32 run's
    rehearsal moves fp32 bytes."""
    import rehearsal
    cfg, records = pm.resolve_config(cfg, hw), []
    for rank in stage_ranks(cfg, gpus):
        path = out / f"rank{rank}.json"
        record = json.loads(path.read_text()) if path.exists() else rehearsal.rehearse_rank(cfg, rank, gpus, out)
        if record.get("crash"):
            raise RuntimeError(f"the rehearsal of rank {rank} ({path}) crashed: {record['crash']}")
        if any("work" not in ev for ev in record["comm"]):
            raise RuntimeError(f"{path} is a rehearsal from before events carried their work: delete it")
        if any("bmm" not in ev["work"] for ev in record["comm"]):
            raise RuntimeError(f"{path} is a rehearsal from before batched GEMMs were recorded by shape (1a55e81): "
                               f"delete it")
        records.append(record)
    return records
