"""The step time of the code as it runs: a rehearsal's programs replayed on a machine's rates.

perfmodel.py prices the step from the layout (what a Megatron-style step should issue); this
prices what the code did issue, as SimAI (NSDI'25) replays a framework's own workload on a
calibrated network. The workload is rehearsal.py's record of each rehearsed rank: every
collective, send, receive and wait in program order, each stamped with the compute since the
event before it (GEMM and batched-GEMM shapes, the fused attention kernels' FLOPs, bytes of
the memory-bound kernels). The rates are
perfmodel's (Rates, Network), so both models stand on one calibration and the analytical step
stays the cross-check.

The replay is a discrete-event simulation, in time order over all rehearsed ranks. Each rank has
one compute stream; a wait blocks it until its operation ends. Each rank runs a process group's
collectives in order on a stream of their own (NCCL: a communicator's kernels are ordered; gloo: a
group's work queue), sends and receives each direction on their own. A collective starts when
every rehearsed member has posted it and its streams are free (members not rehearsed mirror the
rank that was: ranks of one stage issue the same program); a send and its receive pair up first
in, first out, per pair of ranks, and start when both are posted. Compute that runs beside its
rank's own communication in flight runs 1 + hardware.perfmodel.overlap_slowdown times slower (gloo's
threads take the same cores; NCCL's kernels take SMs).

On a CPU the job's ranks share the machine's cores, so a rank computes as fast as the ranks
computing beside it leave it: its one thread gets a core while no more ranks compute than there
are cores, and an equal share of them otherwise (processor sharing; a rank that waits frees its core).
And every collective and send costs the host a fixed time beside compute (`host_s`: a rank's gloo
threads and its peer's must be scheduled), which calibrate_comm.py --sharing measures with a small
all-reduce beside GEMMs; the link fits start at 256 KiB and leave it out. Not modelled:
contention between two groups' transfers on one link (each group gets the link's rate), and the
host's Python time beyond the per-op overhead.

    python -m clustermodel validate <run dirs>    # prices each run both ways, beside its measured step
"""
from __future__ import annotations

import json
from collections import deque
from pathlib import Path
from typing import Callable, Dict, List, Optional

import machine
from clustermodel import perfmodel as pm

GATHERS = ("all_gather", "reduce_scatter")  # recorded bytes are one rank's shard of the buffer
EPS = 1e-12  # seconds: a segment's remainder below this has ended


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
    if ev.get("group") in ("tp", "pp", "dp", "dp_shard", "dp_replicate") and n == net.lay.group(ev["group"])[0]:
        return net.collective(kind, nbytes, ev["group"])  # (hybrid sharding's groups: their own links)
    link = net.inter if n > net.rates.devices_per_host else net.intra
    nbytes /= (net.rates.collective_efficiency or {}).get(kind, 1.0)
    return pm.collective_time(kind, nbytes, n, *link, net.rates.collective_algo)


class _Rank:
    """One rehearsed rank's program, replayed: its clock, and when each of its operations ends."""

    def __init__(self, record: dict, weight: float):
        self.rank, self.events, self.weight = record["rank"], record["comm"], weight  # weight: ranks it stands for
        self.pos, self.t, self.computed = 0, 0.0, False
        self.work = 0.0                               # seconds left of its compute segment, at full speed
        self.since: Optional[float] = None            # when it reached the wait it stands at
        self.ends: Dict[int, float] = {}              # op index -> when its transfers end (so far)
        self.parts: Dict[int, list] = {}              # op index -> its transfers (a batch has several)
        self.unmatched: Dict[int, int] = {}           # op index -> its transfers whose peer has not posted
        self.busy: List[tuple] = []                   # (start, end) of its transfers: the overlap's
        self.streams: Dict[tuple, float] = {}         # stream -> when it is next free
        self.stalls = {"comm": 0.0, "bubble": 0.0}
        self.step_ends: Dict[int, float] = {}
        self.stalls_at: Dict[int, dict] = {}

    def done(self) -> bool:
        return self.pos >= len(self.events)

    def computing(self) -> bool:
        return not self.done() and self.computed and self.work > EPS

    def in_flight(self, now: float) -> bool:
        return any(a <= now < b for a, b in self.busy)


class Replay:
    """The rehearsed ranks' programs run together on rates r and network net (the module's rules);
    run() replays every event, step(k) reads off step k. speed(n): how many times r's compute rate
    a rank gets while ranks standing for n compute at once (None: always r's); host_s: what each
    collective or send costs beside compute; weight: the ranks each rehearsed one stands for."""

    def __init__(self, records: List[dict], r: pm.Rates, net: pm.Network, slowdown: float, host_s: float = 0.0,
                 speed: Optional[Callable[[float], float]] = None, weight: float = 1.0,
                 scale: Optional[Dict[int, float]] = None):
        self.ranks = {rec["rank"]: _Rank(rec, weight) for rec in records}
        self.scale = scale or {}             # rank -> how many times as long its compute takes (what_if)
        self.r, self.net, self.slowdown, self.host_s, self.speed = r, net, slowdown, host_s, speed
        self.p2p: Dict[tuple, deque] = {}    # (src, dst, "send"|"recv") -> posted, not yet paired
        self.joint: Dict[tuple, dict] = {}   # (comm, k-th) -> {rank: post time} of a shared collective
        self.nth: Dict[tuple, int] = {}      # (rank, comm) -> collectives posted on it so far

    def run(self) -> None:
        now = 0.0
        while True:
            self._settle(now)
            active = sum(r.weight for r in self.ranks.values() if r.computing())  # ranks computing, mirrors counted
            later = self._next_change(now, active)
            if later is None:
                break
            self._compute_until(now, later, active)
            now = later
        stuck = [r.rank for r in self.ranks.values() if not r.done()]
        if stuck:
            raise RuntimeError(f"replay: ranks {stuck} wait for operations no rehearsed rank posts")

    def _settle(self, now: float) -> None:
        """Every rank handles what it can at `now`, until each computes, waits or has ended (one
        rank's post may let another's wait end)."""
        progressed = True
        while progressed:
            progressed = False
            for rank in self.ranks.values():
                while self._advance(rank, now):
                    progressed = True

    def _advance(self, rank: _Rank, now: float) -> bool:
        """Handles rank's next event at `now`; False if it computes or waits first."""
        if rank.done():
            return False
        ev = rank.events[rank.pos]
        if not rank.computed:
            rank.work, rank.computed = compute_time(ev.get("work", {}), self.r) * self.scale.get(rank.rank, 1.0), True
        if rank.work > EPS:
            return False
        rank.t, op = now, ev["op"]
        if op == "wait":
            rank.since = now if rank.since is None else rank.since
            if rank.unmatched.get(ev["of"]) or rank.ends.get(ev["of"], now) > now + EPS:
                return False
            if now > rank.since:
                kind = "bubble" if any(p["op"] == "recv" for p in rank.parts.get(ev["of"], ())) else "comm"
                rank.stalls[kind] += now - rank.since
            rank.since = None
        elif op == "host_read":
            if isinstance(ev["step"], int):
                rank.step_ends[ev["step"]], rank.stalls_at[ev["step"]] = now, dict(rank.stalls)
        else:
            self._post(rank, ev)
        rank.pos, rank.computed = rank.pos + 1, False
        return True

    def _rate(self, rank: _Rank, now: float, active: float) -> float:
        """rank's compute speed at `now`, as a multiple of r's rates."""
        speed = self.speed(active) if self.speed else 1.0
        return speed / (1.0 + self.slowdown) if rank.in_flight(now) else speed

    def _next_change(self, now: float, active: float) -> Optional[float]:
        """When a segment of compute ends, a wait's operation ends, or a rank's transfers start or
        end (its compute speed changes): the next moment the replay must look at; None at the end."""
        times = []
        for rank in self.ranks.values():
            rank.busy = [(a, b) for a, b in rank.busy if b > now]
            if rank.computing():
                times.append(now + rank.work / self._rate(rank, now, active))
                times += [t for a, b in rank.busy for t in (a, b) if t > now]
            elif not rank.done() and rank.events[rank.pos]["op"] == "wait":
                of = rank.events[rank.pos]["of"]
                if not rank.unmatched.get(of) and rank.ends.get(of, now) > now:
                    times.append(rank.ends[of])
        return min(times) if times else None

    def _compute_until(self, now: float, later: float, active: float) -> None:
        for rank in self.ranks.values():
            if rank.computing():
                rank.work = max(0.0, rank.work - (later - now) * self._rate(rank, now, active))

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
        seconds = comm_time(part, self.net) + self.host_s
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
        seconds += self.host_s if len(part.get("ranks", ())) > 1 else 0.0  # a group of one rank posts nothing
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
        return max(self.step_of_ranks(step).values(), key=lambda row: row["step_s"])

    def step_of_ranks(self, step: int) -> Dict[int, dict]:
        """{rank: its step `step`: its time and how much of it stood waiting}."""
        rows = {}
        for rank in self.ranks.values():
            before, after = rank.step_ends.get(step - 1, 0.0), rank.step_ends[step]
            s0, s1 = rank.stalls_at.get(step - 1, {"comm": 0.0, "bubble": 0.0}), rank.stalls_at[step]
            comm, bubble = s1["comm"] - s0["comm"], s1["bubble"] - s0["bubble"]
            rows[rank.rank] = {"step_s": after - before, "comm_s": comm, "bubble_s": bubble,
                               "compute_s": after - before - comm - bubble}
        return rows


def predict(records: List[dict], cfg, hw, gpus: int) -> dict:
    """The replayed steady step (the last rehearsed) of cfg's rehearsed ranks on hardware hw (resolved)."""
    lay = pm.layout_of(cfg, gpus)
    cfg = pm.resolve_config(cfg, hw)
    r, net = pm.Rates.of(hw, pm.precision(cfg), lay.gpus), pm.Network(hw, lay)
    host = host_cost(hw, lay.gpus)
    replay = Replay(records, r, net, hw.perfmodel.overlap_slowdown or 0.0, host, core_sharing(hw, lay.gpus),
                    weight=lay.gpus / len(records))
    replay.run()
    out = replay.step(max(rec["steps"] for rec in records))
    out["step_s"] += pm.data_time(cfg, hw, lay.tp)
    out["host_s"] = host
    return out


def what_if(records: List[dict], cfg, hw, gpus: int, rank: int, slowdown: float) -> dict:
    """A straggler priced by replay (ByteDance's what-if analysis): the steady step with `rank`'s
    compute `slowdown` times as long (as measured), and without (every rank at the model's speed).
    cost_pct: what its slowness adds to the step, over the slowed step; excess_pct: its own added
    compute over the same step, the price a synchronous step would pay for all of it. The two differ
    where the rest of the step (a pipeline's bubble, a faster stage's wait) absorbs part of it."""
    lay = pm.layout_of(cfg, gpus)
    cfg = pm.resolve_config(cfg, hw)
    r, net = pm.Rates.of(hw, pm.precision(cfg), lay.gpus), pm.Network(hw, lay)
    last = max(rec["steps"] for rec in records)
    rows = []
    for scale in ({rank: slowdown}, {}):
        replay = Replay(records, r, net, hw.perfmodel.overlap_slowdown or 0.0, host_cost(hw, lay.gpus),
                        core_sharing(hw, lay.gpus), weight=lay.gpus / len(records), scale=scale)
        replay.run()
        rows.append(replay.step_of_ranks(last))
    slowed = max(row["step_s"] for row in rows[0].values())
    without = max(row["step_s"] for row in rows[1].values())
    excess = rows[0][rank]["compute_s"] * (1 - 1 / slowdown)
    return {"step_s": slowed, "without_s": without, "cost_pct": 100 * (slowed - without) / slowed,
            "excess_pct": 100 * excess / slowed}


def host_cost(hw, world: int) -> float:
    """Seconds each collective or send costs the host beside compute: hardware.perfmodel.collective_host_us
    where set, else 0 on a GPU (NCCL runs on the device), and on a CPU this machine's calibration
    (calibrate_comm.py --sharing; 0 until it has run, which validate says)."""
    if hw.perfmodel.collective_host_us is not None:
        return hw.perfmodel.collective_host_us * 1e-6
    if hw.device != "cpu" or world < 2:
        return 0.0
    return machine.collective_host_s(world) or 0.0


def core_sharing(hw, world: int) -> Optional[Callable[[float], float]]:
    """On a CPU, the speed of a rank while ranks standing for n compute, as a multiple of
    Rates.of's (which has every rank computing at once, one thread each: peak / max(world, cores)):
    a core each while n is at most the cores, cores / n each above. None for one process or a
    GPU (each rank its own device)."""
    if hw.device != "cpu" or world < 2:
        return None
    cores = hw.perfmodel.cores or 1
    return lambda n: max(world, cores) / max(n, cores)


def stage_ranks(cfg, gpus: int) -> List[int]:
    """One rank per pipeline stage, the first of its DP and TP groups: the ranks whose programs
    make up the step (the others of a stage mirror them)."""
    lay = pm.layout_of(cfg, gpus)
    sizes = {"dp": lay.dp, "pp": lay.pp, "tp": lay.tp}
    stride = {d: 1 for d in lay.order}
    for inner, dim in zip(reversed(lay.order), reversed(lay.order[:-1])):
        stride[dim] = stride[inner] * sizes[inner]
    return [s * stride["pp"] for s in range(lay.pp)]


def rehearse(cfg, hw, gpus: int, out: Path, also: tuple = ()) -> List[dict]:
    """The records of stage_ranks (and of the ranks `also`, which then no longer mirror their
    stage's), rehearsed in this process (once: kept in `out`), with what `auto` leaves to the
    machine decided as a run on hw (resolved) decides it: an fp32 run's rehearsal moves fp32 bytes."""
    from clustermodel import rehearsal
    cfg, records = pm.resolve_config(cfg, hw), []
    for rank in sorted(set(stage_ranks(cfg, gpus)) | set(also)):
        path = out / f"rank{rank}.json"
        record = json.loads(path.read_text()) if path.exists() else rehearsal.rehearse_rank(cfg, rank, gpus, out)
        if record.get("crash"):
            raise RuntimeError(f"the rehearsal of rank {rank} ({path}) crashed: {record['crash']}")
        if any("work" not in ev for ev in record["comm"]):
            raise RuntimeError(f"{path} is a rehearsal whose events lack their work (an older recorder's): delete it")
        if any("bmm" not in ev["work"] for ev in record["comm"]):
            raise RuntimeError(f"{path} is a rehearsal whose events lack their batched GEMMs' shapes (an older "
                               f"recorder's): delete it")
        records.append(record)
    return records
