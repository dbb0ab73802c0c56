"""Where a hang started, from every rank's oplog.py snapshot (or a Flight Recorder dump read into
that form, flightrec.py): the root rank, its host and coordinates, and why: dead (no snapshot, or
its process gone), skipped (went on to a later step without posting the collective the others
wait in), mismatch (posted another op or size at the same sequence number: both call sites), busy
outside communication (its Python stack), or a wait-for cycle. Apart from oplog.py, which
records, so that each file holds one thing."""
from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Optional

from observe.timeline import BYTES, DIM, DONE, GROUP, OP, PAIR_SEQ, PEER, SEQ, SITE, STEP, WAIT


def ranks_of(members: list):
    """The ranks as_range's form stands for."""
    return range(*members[1:]) if members and members[0] == "range" else members



def snapshot_dir(run_dir: Path, attempt: int) -> Path:
    """Where an attempt's snapshots go: each restart keeps its own, so a crashed attempt's last
    state stays beside the next attempt's."""
    return Path(run_dir) / "observe" / f"attempt{attempt}"


def read_snapshots(run_dir: Path, world: int, attempt: int) -> dict:
    """{rank: its snapshot in that attempt, or None where it has none (or an unreadable one)}."""
    return read_snapshots_of(run_dir, attempt, range(world))


def read_snapshots_of(run_dir: Path, attempt: int, ranks) -> dict:
    out = {}
    for rank in ranks:
        try:
            out[rank] = json.loads((snapshot_dir(run_dir, attempt) / f"rank{rank}.json").read_text())
        except (OSError, ValueError):
            out[rank] = None
    return out


def localize(snaps: dict) -> dict:
    """The rank a hang started from, and why: {rank, host, coords, reason, detail, op, group, dim,
    seq, step, site, waiting}. reason: dead | skipped | mismatch | busy | cycle | waiting."""
    for rank, snap in sorted(snaps.items()):
        if snap is None or _gone(snap):
            why = "no snapshot" if snap is None else f"process {snap['pid']} on {snap['host']} is gone"
            return _report(rank, snap, "dead", why, _first_wait(snaps, waiting_on=rank))
    blocked = {r: _blocked(s) for r, s in snaps.items()}
    edges = {}
    for rank, entry in sorted(blocked.items()):
        if entry is None:
            continue
        for other, why, theirs in _blockers(snaps, rank, entry):
            if why == "skipped":
                where = f" (it would have been {theirs[SITE]})" if theirs else ""
                return _report(other, snaps[other], "skipped", f"did not post {entry[OP]} #{entry[SEQ]} of group "
                               f"{entry[GROUP]} ({entry[DIM]}){where} and went on (now step "
                               f"{snaps[other]['step']}, {snaps[other]['phase']}); rank {rank} waits in it at "
                               f"{entry[SITE]}", entry, sites=[entry[SITE]] + ([theirs[SITE]] if theirs else []))
            if why == "mismatch":
                return _report(other, snaps[other], "mismatch", f"posted {theirs[OP]} of {theirs[BYTES]} bytes "
                               f"at {theirs[SITE]} as #{entry[SEQ]} of group {entry[GROUP]}, where rank {rank} "
                               f"posted {entry[OP]} of {entry[BYTES]} bytes at {entry[SITE]}", entry,
                               sites=[entry[SITE], theirs[SITE]])
            edges.setdefault(rank, other)
    if not edges:
        rank = min(snaps, key=lambda r: (snaps[r]["step"], r))
        return _report(rank, snaps[rank], "busy", "no rank waits for another; it is the furthest behind",
                       None, stack=snaps[rank]["stack"])
    rank, chain = min(edges), []
    while rank in edges and rank not in chain:
        chain.append(rank)
        rank = edges[rank]
    waited = blocked[chain[-1]]
    if rank in chain:
        cycle = chain[chain.index(rank):] + [rank]
        return _report(rank, snaps[rank], "cycle", "wait-for cycle: " + " -> ".join(
            f"rank {r} ({blocked[r][OP]} #{blocked[r][SEQ]} of {blocked[r][GROUP]} at {blocked[r][SITE]})"
            for r in cycle[:-1]) + f" -> rank {rank}", blocked[cycle[0]])
    if blocked[rank] is None:
        stack = snaps[rank]["stack"]
        return _report(rank, snaps[rank], "busy", f"not in any collective or send/receive while rank "
                       f"{chain[-1]} waits for it; its stack ends at {stack[-1] if stack else '?'}", waited,
                       stack=stack)
    return _report(rank, snaps[rank], "waiting", f"waits in {blocked[rank][OP]} at {blocked[rank][SITE]}, "
                   "which every peer has posted", waited)


def _gone(snap: dict) -> bool:
    """Whether a snapshot's process has died (known only on this host; a rank that exited after
    reporting the hang itself is not dead)."""
    if snap.get("exiting") or snap["host"] != socket.gethostname():
        return False
    try:
        os.kill(snap["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    return False


def _blocked(snap: dict) -> Optional[list]:
    """The op this rank's main thread waits in: its wait began and has not ended."""
    return next((e for e in reversed(snap["ops"]) if e[WAIT] is not None and e[DONE] is None), None)


def _posted(snap: dict, group: str, seq: int, skipped: bool = False) -> Optional[list]:
    """The collective a rank posted (or, with `skipped`, an injected skip recorded) as number `seq`."""
    return next((e for e in reversed(snap["ops"]) if e[GROUP] == group and e[PEER] is None and e[SEQ] == seq
                 and e[OP].startswith("skipped") == skipped), None)


def _blockers(snaps: dict, rank: int, entry: list) -> list:
    """[(rank, why, its entry)] of the ranks `rank`'s op `entry` waits for. why: not posted |
    skipped (it went on to a later step) | mismatch (another op or size at the same number)."""
    if entry[PEER] is not None:
        peer, other = entry[PEER], "recv" if entry[OP] == "send" else "send"
        snap = snaps.get(peer)
        done = snap["pairs"].get(f"{entry[GROUP]}:{other}:{rank}", 0) if snap else 0
        return [(peer, "not posted", None)] if done < entry[PAIR_SEQ] else []
    out = []
    for member in ranks_of(snaps[rank]["members"].get(entry[GROUP], [])):
        snap = snaps.get(member)
        if member == rank or snap is None:
            continue
        if snap["seq"].get(entry[GROUP], 0) < entry[SEQ]:
            out.append((member, "skipped" if snap["step"] > entry[STEP] else "not posted", None))
            continue
        theirs = _posted(snap, entry[GROUP], entry[SEQ], skipped=True)
        if theirs is not None and theirs[OP].startswith("skipped"):
            out.append((member, "skipped", theirs))
            continue
        theirs = _posted(snap, entry[GROUP], entry[SEQ])
        if theirs is not None and (theirs[OP], theirs[BYTES]) != (entry[OP], entry[BYTES]):
            out.append((member, "mismatch", theirs))
    return out


def _first_wait(snaps: dict, waiting_on: int) -> Optional[list]:
    return next((e for r, s in sorted(snaps.items()) if s is not None and r != waiting_on
                 for e in [_blocked(s)] if e is not None), None)


def _report(rank: int, snap: Optional[dict], reason: str, detail: str, entry: Optional[list], **extra) -> dict:
    out = {"rank": rank, "host": snap["host"] if snap else None, "coords": snap["coords"] if snap else None,
           "reason": reason, "detail": detail}
    if entry is not None:
        out.update({"op": entry[OP], "group": entry[GROUP], "dim": entry[DIM], "step": entry[STEP],
                    "seq": entry[SEQ] if entry[PEER] is None else entry[PAIR_SEQ],  # a send/receive's: per pair
                    "peer": entry[PEER], "site": entry[SITE]})
    return {**out, **extra}
