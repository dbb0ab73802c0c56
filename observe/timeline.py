"""The timeline of a run from its ranks' oplog.py snapshots: each rank's clock aligned from matched
collectives, a Chrome/Perfetto trace (a process per host, a thread per rank and beside it the
replay's predicted track where the run has one (clustermodel/predicted.py), matched collectives and
send/receive pairs linked), and a figure of it (a row per rank, spans coloured by kind).
`python -m observe RUN_DIR` writes both; this file is apart from oplog.py only to keep each
under ~700 lines."""
from __future__ import annotations

import collections
import statistics
from pathlib import Path
from typing import Optional

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


def lay_predicted(snaps: dict, stages: dict) -> dict:
    """{rank: spans in the snapshots' form ([kind, name, step, start, seconds])}: its pipeline stage's
    predicted step (clustermodel/predicted.py's predicted.json: {stage: [[kind, name, start, seconds]]}) laid at
    the start of each step the rank measured (its "data" phase), or where the predicted step before
    it ends if that is later (a track's slices do not overlap: the lag shows how far the
    prediction falls behind)."""
    out = {}
    for rank, snap in snaps.items():
        segments = stages.get(str(snap["coords"].get("pp", 0)), [])
        starts = {step: start for kind, name, step, start, _ in snap["spans"] if (kind, name) == ("phase", "data")}
        if not segments:
            continue
        length, free, laid = max(start + seconds for _, _, start, seconds in segments), float("-inf"), []
        for step, begin in sorted(starts.items()):
            begin = max(begin, free)
            laid += [[kind, name, step, begin + start, seconds] for kind, name, start, seconds in segments]
            free = begin + length
        out[rank] = laid
    return out


PREDICTED_TID = 1_000_000  # a rank's predicted track is thread PREDICTED_TID + rank, sorted beside it


def trace(snaps: dict, offsets: dict, predicted: Optional[dict] = None) -> dict:
    """A Chrome/Perfetto trace: a process per host, a thread per rank, the spans and ops as complete
    events on aligned clocks, matched collectives and send/receive pairs as flows; with
    `predicted` ({rank: spans}), a "predicted" thread beside each rank holding them."""
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
        events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": rank, "args": {"sort_index": 2 * rank}})
        if predicted and predicted.get(rank):
            tid = PREDICTED_TID + rank
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                           "args": {"name": f"rank {rank} predicted"}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                           "args": {"sort_index": 2 * rank + 1}})
            for kind, name, step, start, seconds in predicted[rank]:
                events.append({"ph": "X", "name": name, "cat": f"predicted {kind}", "pid": pid, "tid": tid,
                               "ts": us(rank, start), "dur": round(seconds * 1e6, 1), "args": {"step": step}})
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


# --- The figure: a row per rank (and its predicted row), spans coloured by kind ---

COLOURS = {"forward": "#4c72b0", "backward": "#55a868", "wait comm": "#dd8452", "wait bubble": "#c44e52",
           "agreed read": "#8172b3", "gc": "#937860", "checkpoint save": "#8c8c8c", "data": "#da8bc3",
           "compute": "#64b5cd", "waiting (unfinished)": "#222222"}


def kind_of(kind: str, name: str) -> Optional[str]:
    """The figure's colour key of a span (None: not drawn, e.g. the "compute" phase its segments fill)."""
    if kind in ("wait", "predicted wait"):
        return f"wait {name.split()[0]}"
    if kind in ("segment", "predicted compute"):
        first = name.split()[0]
        return first if first in ("forward", "backward", "compute", "gc") else name if name in COLOURS else None
    return "data" if (kind, name) == ("phase", "data") else None


def figure(snaps: dict, offsets: dict, path: Path, predicted: Optional[dict] = None) -> dict:
    """Draw the timeline to `path` (PNG): {row label: {kind: spans drawn}}, what the figure holds."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = []  # (label, rank, spans)
    for rank, snap in sorted(snaps.items()):
        rows.append((f"rank {rank}", rank, snap["spans"]))
        if predicted and predicted.get(rank):
            rows.append((f"rank {rank} predicted", rank, [["predicted " + k, *rest] for k, *rest in predicted[rank]]))
    starts = [s[3] - offsets.get(r, 0.0) for _, r, spans in rows for s in spans]
    t0 = min(starts) if starts else 0.0
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.45 * max(len(rows), 1)))
    drawn, waiting = {}, {}
    for rank, snap in snaps.items():
        waiting[f"rank {rank}"] = [(e[WAIT] - offsets.get(rank, 0.0) - t0, snap["time"] - e[WAIT]) for e in snap["ops"]
                                   if e[WAIT] is not None and e[DONE] is None]
    for y, (label, rank, spans) in enumerate(rows):
        by_kind = collections.defaultdict(list)
        for kind, name, step, start, seconds in spans:
            key = kind_of(kind, name)
            if key is not None and seconds is not None:
                by_kind[key].append((start - offsets.get(rank, 0.0) - t0, seconds))
        if waiting.get(label):  # an op it still waits in when the snapshot was written (a hang)
            by_kind["waiting (unfinished)"] = waiting[label]
        for key, bars in by_kind.items():
            ax.broken_barh(bars, (y - 0.35, 0.7), facecolors=COLOURS[key], label=key)
        drawn[label] = {k: len(v) for k, v in by_kind.items()}
    ax.set_yticks(range(len(rows)), [label for label, _, _ in rows])
    ax.invert_yaxis()
    ax.set_xlabel("seconds (clocks aligned from matched collectives)")
    handles = {h.get_label(): h for h in ax.get_legend_handles_labels()[0]}
    ax.legend(handles.values(), handles.keys(), loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=len(handles) or 1,
              fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn
