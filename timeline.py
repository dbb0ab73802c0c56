"""The timeline of a run from its ranks' observe.py snapshots: each rank's clock aligned from matched
collectives, and a Chrome/Perfetto trace (a process per host, a thread per rank, matched
collectives and send/receive pairs linked). `python observe.py RUN_DIR` writes it; this file is
apart from observe.py only to keep each under ~700 lines."""
from __future__ import annotations

import collections
import statistics

# An op-log entry (observe.Recorder's ring): a list of these fields, in this order
FIELDS = ("group", "dim", "seq", "op", "bytes", "dtype", "peer", "pair_seq", "site", "step", "post", "wait",
          "done", "hash")
GROUP, DIM, SEQ, OP, BYTES, DTYPE, PEER, PAIR_SEQ, SITE, STEP, POST, WAIT, DONE, HASH = range(len(FIELDS))


def clock_offsets(snaps: dict) -> tuple:
    """Each rank's clock less the lowest rank's, from matched collectives (a collective ends at
    nearly the same moment on every member): ({rank: seconds}, the median residual in seconds)."""
    ends = collections.defaultdict(dict)  # (group, seq) -> {rank: its end}
    for rank, snap in snaps.items():
        for e in snap["ops"]:
            if e[PEER] is None and e[DONE] is not None and not e[OP].startswith("skipped"):
                ends[(e[GROUP], e[SEQ])][rank] = e[DONE]
    pairs = collections.defaultdict(list)  # (a, b) -> [a's end - b's end]
    for by_rank in ends.values():
        for a in by_rank:
            for b in by_rank:
                if a != b:
                    pairs[(a, b)].append(by_rank[a] - by_rank[b])
    offsets, todo = {min(snaps): 0.0}, [min(snaps)]
    while todo:  # out from the lowest rank, through the groups each rank shares with a known one
        known = todo.pop()
        for (a, b), diffs in pairs.items():
            if b == known and a not in offsets:
                offsets[a] = offsets[b] + statistics.median(diffs)
                todo.append(a)
    residuals = []
    for by_rank in ends.values():
        aligned = [t - offsets[r] for r, t in by_rank.items() if r in offsets]
        if len(aligned) > 1:
            middle = statistics.median(aligned)
            residuals += [abs(t - middle) for t in aligned]
    return offsets, statistics.median(residuals) if residuals else 0.0


def trace(snaps: dict, offsets: dict) -> dict:
    """A Chrome/Perfetto trace: a process per host, a thread per rank, the spans and ops as complete
    events on aligned clocks, matched collectives and send/receive pairs as flows."""
    hosts = sorted({s["host"] for s in snaps.values()})
    events, t0 = [], min(e[POST] for s in snaps.values() for e in s["ops"]) if any(s["ops"] for s in snaps.values()) \
        else min(s["time"] for s in snaps.values())
    for host in hosts:
        events.append({"ph": "M", "name": "process_name", "pid": hosts.index(host), "args": {"name": host}})

    def us(rank, t):
        return round((t - offsets.get(rank, 0.0) - t0) * 1e6, 1)
    ends = collections.defaultdict(list)  # a flow's key -> [(rank, pid, its end)]
    for rank, snap in sorted(snaps.items()):
        pid, c = hosts.index(snap["host"]), snap["coords"]
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": rank,
                       "args": {"name": f"rank {rank} (dp {c.get('dp')}, pp {c.get('pp')}, tp {c.get('tp')})"}})
        for kind, name, step, start, seconds in snap["spans"]:
            seconds = snap["time"] - start if seconds is None else seconds
            events.append({"ph": "X", "name": name, "cat": kind, "pid": pid, "tid": rank, "ts": us(rank, start),
                           "dur": round(seconds * 1e6, 1), "args": {"step": step}})
        for e in snap["ops"]:
            end = e[DONE] if e[DONE] is not None else snap["time"]
            events.append({"ph": "X", "name": f"{e[OP]} {e[DIM]}", "cat": "op", "pid": pid, "tid": rank,
                           "ts": us(rank, e[POST]), "dur": round((end - e[POST]) * 1e6, 1),
                           "args": {"group": e[GROUP], "seq": e[SEQ], "bytes": e[BYTES], "peer": e[PEER],
                                    "site": e[SITE], "step": e[STEP], "finished": e[DONE] is not None}})
            if e[OP].startswith("skipped"):
                continue
            key = (e[GROUP], e[SEQ]) if e[PEER] is None else (
                (e[GROUP], rank, e[PEER], e[PAIR_SEQ]) if e[OP] == "send" else (e[GROUP], e[PEER], rank, e[PAIR_SEQ]))
            ends[key].append((rank, pid, us(rank, e[POST]), e[OP]))
    flow = 0
    for key, members in ends.items():
        if len(members) < 2 or (len(key) == 4 and {m[3] for m in members} != {"send", "recv"}):
            continue
        members.sort(key=lambda m: (m[3] != "send", m[0]))  # a send's flow starts at the sender
        first = members[0]
        for other in members[1:]:
            flow += 1
            events.append({"ph": "s", "id": flow, "name": "match", "cat": "flow", "pid": first[1], "tid": first[0],
                           "ts": first[2]})
            events.append({"ph": "f", "bp": "e", "id": flow, "name": "match", "cat": "flow", "pid": other[1],
                           "tid": other[0], "ts": other[2]})
    return {"traceEvents": events, "displayTimeUnit": "ms"}
