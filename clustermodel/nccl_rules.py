"""NCCL's rules, checked on the communication a program issues, without a GPU.

gloo (what CPU tests run on) is forgiving where NCCL is not: gloo matches point-to-point messages
by tag and its sends never block, while NCCL ignores tags, matches sends and receives first-in
first-out per pair of ranks and communicator, and runs every operation as a kernel on a stream
that does not finish until its peers have posted theirs. So code that passes every CPU test can
hang at step 1 on a cluster. This module replays what each rank posted (rehearsal.py records it,
parallelisms/pipeline.py can also write its plan out directly) under NCCL's model and reports:

- mismatches: the k-th send of a channel and its k-th receive differ in shape or dtype, or the
  k-th collective of a communicator differs between the ranks of its group;
- unmatched operations: a send nobody receives, a collective a rank never joins;
- deadlocks: a cycle of waits, reported where it closes (rank, op index, peer).

The model (torch 2.x ProcessGroupNCCL on NCCL 2.x), per rank:
- a compute stream, on which `work.wait()` is an item that completes when the work's kernel has;
- a communication stream per communicator. Collectives and batched point-to-point
  (batch_isend_irecv) of a process group share the group's communicator and stream; an
  unbatched send or receive gets a two-rank communicator and stream of its own per peer pair.
  A send posted batched is never received by an unbatched receive (other communicators);
- a kernel starts once the one before it on its stream has finished and the compute stream has
  reached the point where it was posted (ProcessGroupNCCL makes the comm stream wait for it);
- a send and its receive complete once both kernels have started; a collective once every
  member's has; a kernel (a batched group is one kernel) finishes when all its operations have.
The host never blocks in this model: it posts everything in program order, as it does on a GPU
(a host sync only delays posting, which the stream dependencies above already imply).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

from parallelisms.pipeline import Message, plan

P2P = ("send", "recv")


@dataclass
class Op:
    op: str                       # send | recv | all_reduce | all_gather | reduce_scatter | broadcast ...
    group: tuple                  # the global ranks of the process group, in group-rank order
    peer: Optional[int] = None    # global rank of the other end (send/recv)
    sig: tuple = ()               # what both ends must agree on: (shape, dtype) or a collective's size
    site: str = ""                # the caller, for the report
    comm: object = None           # the process group's identity (its name): groups over the same ranks differ


@dataclass
class Kernel:
    rank: int
    index: int                    # this rank's post number (program order)
    ops: list
    stream: tuple
    compute_pos: int              # how many compute-stream waits the rank posted before it
    started: bool = False
    done: bool = False
    op_done: list = field(default_factory=list)

    def describe(self) -> str:
        parts = []
        for op in self.ops:
            where = f" {'to' if op.op == 'send' else 'from'} rank {op.peer}" if op.op in P2P else f" on ranks {list(op.group)}"
            parts.append(f"{op.op}{where}{f' [{op.site}]' if op.site else ''}")
        return f"rank {self.rank} op #{self.index} ({'; '.join(parts)})"


class Violation(Exception):
    pass


def stream_of(rank: int, ops: list, batched: bool) -> tuple:
    first = ops[0]
    comm = (first.comm, first.group)
    if first.op in P2P and not batched:
        return ("pair", comm, tuple(sorted((rank, first.peer))))
    return ("comm", comm)


def check(programs: dict, partial: bool = False) -> list:
    """programs: {rank: [event, ...]} with events ("post", id, [Op...], batched) and ("wait", id),
    in each rank's program order. Returns the list of problems found (empty when NCCL would run it).
    partial: only some ranks of the job are given (a rehearsal of chosen ranks). A collective then
    matches among the members given (the others are taken to mirror them, as ranks of one stage
    do), and a send or receive whose peer is not given completes on its own."""
    kernels, waits, problems = _kernels(programs)
    problems += _match(kernels, set(programs) if partial else None)
    if problems:
        return problems
    return _simulate(kernels, waits)


def _kernels(programs: dict):
    kernels, waits, problems = {}, {}, []
    for rank, events in programs.items():
        ids, mine, rank_waits = {}, [], []
        for ev in events:
            if ev[0] == "post":
                _, wid, ops, batched = ev
                k = Kernel(rank, len(mine), list(ops), stream_of(rank, ops, batched), len(rank_waits))
                k.op_done = [False] * len(k.ops)
                ids[wid] = k
                mine.append(k)
            elif ev[0] == "wait":
                if ev[1] not in ids:
                    problems.append(f"rank {rank} waits for work {ev[1]} it never posted")
                    continue
                rank_waits.append(ids[ev[1]])
        kernels[rank], waits[rank] = mine, rank_waits
    return kernels, waits, problems


def _match(kernels: dict, present: Optional[set] = None) -> list:
    """Pairs every operation with its counterparts (FIFO per channel / communicator); records the
    pairing on the ops (op.partners) and returns mismatches and unmatched operations."""
    sends, recvs, colls = defaultdict(list), defaultdict(list), defaultdict(lambda: defaultdict(list))
    for rank, ks in kernels.items():
        for k in ks:
            for i, op in enumerate(k.ops):
                op.partners = []
                if present is not None and op.op in P2P and op.peer not in present:
                    continue  # its peer was not rehearsed: it completes on its own
                if op.op == "send":
                    sends[(k.stream, rank, op.peer)].append((k, i))
                elif op.op == "recv":
                    recvs[(k.stream, op.peer, rank)].append((k, i))
                else:
                    colls[k.stream][rank].append((k, i))
    problems = []
    for channel in set(sends) | set(recvs):
        s, r = sends.get(channel, []), recvs.get(channel, [])
        for n, ((ks, i), (kr, j)) in enumerate(zip(s, r)):
            if ks.ops[i].sig != kr.ops[j].sig:
                problems.append(f"mismatch: message {n} from rank {channel[1]} to rank {channel[2]} is sent as "
                                f"{ks.ops[i].sig} by {ks.describe()} but received as {kr.ops[j].sig} by {kr.describe()}")
            ks.ops[i].partners = [(kr, j)]
            kr.ops[j].partners = [(ks, i)]
        for k, i in s[len(r):]:
            problems.append(f"unmatched: {k.describe()} sends message {s.index((k, i))} to rank {channel[2]}, "
                            f"which posts only {len(r)} receives from rank {channel[1]} on that communicator")
        for k, i in r[len(s):]:
            problems.append(f"unmatched: {k.describe()} receives message {r.index((k, i))} from rank {channel[1]}, "
                            f"which posts only {len(s)} sends to rank {channel[2]} on that communicator")
    for stream, by_rank in colls.items():
        members = stream[1][1]
        group = members if present is None else tuple(r for r in members if r in present)
        count = max(len(v) for v in by_rank.values())
        for n in range(count):
            members = [(r, by_rank[r][n]) for r in group if n < len(by_rank.get(r, []))]
            if len(members) < len(group):
                absent = [r for r in group if n >= len(by_rank.get(r, []))]
                k, i = members[0][1]
                problems.append(f"unmatched: collective {n} on ranks {list(group)} ({k.describe()}) is never "
                                f"joined by rank {absent[0]}")
                continue
            first_k, first_i = members[0][1]
            for r, (k, i) in members[1:]:
                a, b = first_k.ops[first_i], k.ops[i]
                if (a.op, a.sig) != (b.op, b.sig):
                    problems.append(f"mismatch: collective {n} on ranks {list(group)} is {a.op} {a.sig} on "
                                    f"{first_k.describe()} but {b.op} {b.sig} on {k.describe()}")
            for r, (k, i) in members:
                k.ops[i].partners = [m for _, m in members if m != (k, i)]
    return problems


def _simulate(kernels: dict, waits: dict) -> list:
    """Runs every stream forward as far as NCCL's rules let it (event-driven: each kernel is
    looked at when something it waits for changes); whatever never finishes is deadlocked."""
    previous, following = {}, {}
    streams = defaultdict(list)
    for rank, ks in kernels.items():
        for k in ks:
            streams[(rank, k.stream)].append(k)
    for queue in streams.values():
        for a, b in zip(queue, queue[1:]):
            previous[id(b)], following[id(a)] = a, b
    reached = {rank: 0 for rank in kernels}      # compute-stream waits passed, per rank
    unblocked = {rank: 0 for rank in kernels}    # kernels (in post order) whose compute point is passed
    events = []

    def try_start(k):
        before = previous.get(id(k))
        if not k.started and (before is None or before.done) and reached[k.rank] >= k.compute_pos:
            k.started = True
            events.append(("started", k))

    def try_finish(k):
        if not k.started or k.done:
            return
        for i, op in enumerate(k.ops):
            if not k.op_done[i] and all(p.started for p, _ in op.partners):
                k.op_done[i] = True
                for p, j in op.partners:
                    p.op_done[j] = True
                    if all(p.op_done) and p.started and not p.done:
                        p.done = True
                        events.append(("done", p))
        if all(k.op_done):
            k.done = True
            events.append(("done", k))

    def release(rank):
        ks = kernels[rank]
        while unblocked[rank] < len(ks) and ks[unblocked[rank]].compute_pos <= reached[rank]:
            try_start(ks[unblocked[rank]])
            unblocked[rank] += 1

    for rank in kernels:
        release(rank)
    while events:
        what, k = events.pop()
        if what == "started":
            try_finish(k)
            for op in k.ops:
                for p, _ in op.partners:
                    try_finish(p)
            continue
        nxt = following.get(id(k))
        if nxt is not None:
            try_start(nxt)
        rank_waits = waits[k.rank]
        moved = False
        while reached[k.rank] < len(rank_waits) and rank_waits[reached[k.rank]].done:
            reached[k.rank] += 1
            moved = True
        if moved:
            release(k.rank)
    everything = [k for ks in kernels.values() for k in ks]
    stuck = [k for k in everything if not k.done]
    if not stuck:
        return []
    return [_deadlock_report(stuck, previous, waits, reached)]


def _blocker(k: Kernel, previous: dict, waits: dict, reached: dict) -> tuple:
    """What k waits for: (kernel, why)."""
    if not k.started:
        before = previous.get(id(k))
        if before is not None and not before.done:
            return before, "is queued behind"
        pending = waits[k.rank][reached[k.rank]]
        return pending, "is posted after the compute stream waits for"
    for i, op in enumerate(k.ops):
        if not k.op_done[i]:
            for p, _ in op.partners:
                if not p.started:
                    return p, f"{op.op}s{' to' if op.op == 'send' else ' from' if op.op == 'recv' else ''}" \
                              f"{f' rank {op.peer}' if op.peer is not None else ''} and waits for"
    raise AssertionError("a started kernel with every partner started is not stuck")


def _deadlock_report(stuck: list, previous: dict, waits: dict, reached: dict) -> str:
    """Follow the waits from the first stuck kernel until one repeats: the cycle where the wait closes."""
    chain, seen, k = [], {}, min(stuck, key=lambda s: (s.index, s.rank))
    while id(k) not in seen:
        seen[id(k)] = len(chain)
        nxt, why = _blocker(k, previous, waits, reached)
        chain.append((k, why, nxt))
        k = nxt
    cycle = chain[seen[id(k)]:]
    closing = cycle[-1]
    lines = [f"deadlock: the wait closes at {closing[0].describe()}, which {closing[1]} {closing[2].describe()}",
             "  cycle:"]
    lines += [f"    {a.describe()} {why} {b.describe()}" for a, why, b in cycle]
    return "\n".join(lines)


def pipeline_programs(pp: int, vpp: int, microbatches: int, overlap: bool, backward: bool = True,
                      channel=None) -> dict:
    """Every pp rank's plan as NCCL sees it ({pp rank: events} for check): each receive
    and send an unbatched op on its channel's group, each wait a compute-stream wait. `channel`
    picks a message's group (tests pass one group for every message, to show the deadlocks that has)."""
    channel = channel or Message.channel
    programs = {}
    for rank in range(pp):
        events, works = [], {}
        for op in plan(pp, rank, vpp, microbatches, overlap, backward):
            if op[0] in ("recv", "send"):
                msg = op[2]
                work = len(events)
                works[op[1]] = work
                peer = msg.src if op[0] == "recv" else msg.dst
                events.append(("post", work, [Op(op[0], tuple(range(pp)), peer, sig=(msg.kind, msg.mb, msg.stage),
                                                  comm=channel(msg))], False))
            elif op[0] == "wait":
                events.append(("wait", works[op[1]]))
        programs[rank] = events
    return programs
