"""PyTorch Flight Recorder dumps read as oplog.py snapshots, so that a job that ran without
megarepro's op log (an NCCL job of another codebase) gets the same hang report and timeline.

The Flight Recorder (TORCH_FR_BUFFER_SIZE=N) keeps a ring of each rank's collectives; a dump is one
pickled dict per rank ({version, pg_config, pg_status, entries}, each entry with process_group
(name, desc), collective_seq_id, p2p_seq_id, profiling_name "nccl:all_reduce" / "nccl:send 0->1" /
"nccl:recv 1<-0" (group ranks), input_sizes, input_dtypes, state, time_created_ns,
time_discovered_started_ns, time_discovered_completed_ns, frames innermost first), in files named
<prefix><rank>: NCCL's watchdog writes them on a timeout to TORCH_FR_DUMP_TEMP_FILE<rank>, and a
job can write its own with torch._C._distributed_c10d._dump_fr_trace() (gloo has no watchdog dump).

Each entry becomes an op-log entry (timeline.FIELDS): group and its description as the dimension,
the per-group sequence number, the per-pair p2p number, op, bytes, dtype, peer (the global rank),
the first frame outside torch as the call site, and the post, wait and end times. What a dump
cannot say is filled so that hangs.localize reads it right: an entry not completed is waited in
from its post; the step is 0 on every rank (a dump has none); the host is unknown (no rank is
taken for dead). On torch 2.13 with gloo the entries stay "scheduled" and pg_config is keyed by an
empty name: an entry counts as completed up to its group's last_completed_collective, and a group
missing from pg_config is the default group's (pg_config's only entry) or else every dumped rank."""
from __future__ import annotations

import json
import math
import pickle
import re
from pathlib import Path
from typing import Optional

from observe import hangs
from observe import timeline

DTYPE_BYTES = {"float": 4, "double": 8, "half": 2, "bfloat16": 2, "long": 8, "int": 4, "short": 2, "char": 1,
               "byte": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}
TORCH_DIR = "/torch/"


def dump_files(path: Path) -> dict:
    """{rank: file} of the dumps in folder `path` (files named <prefix><rank>, one prefix), or of
    the files `path` is the prefix of."""
    path = Path(path)
    candidates = sorted(path.iterdir()) if path.is_dir() else sorted(path.parent.glob(path.name + "*"))
    by_prefix = {}
    for file in candidates:
        match = re.fullmatch(r"(.*?)(\d+)", file.name)
        if file.is_file() and match and not file.name.endswith((".json", ".txt")):
            by_prefix.setdefault(match.group(1), {})[int(match.group(2))] = file
    if len(by_prefix) != 1:
        raise SystemExit(f"{path}: {'no' if not by_prefix else 'several kinds of'} Flight Recorder dump files "
                         f"(<prefix><rank>){': ' + ', '.join(sorted(by_prefix)) if by_prefix else ''}")
    return next(iter(by_prefix.values()))


def load(file: Path) -> dict:
    raw = Path(file).read_bytes()
    return json.loads(raw) if raw[:1] == b"{" else pickle.loads(raw)  # noqa: S301 (a dump of one's own job)


def read_dumps(path: Path) -> dict:
    """{rank: its dump as an oplog.py snapshot} of every dump under `path`."""
    dumps = {rank: load(file) for rank, file in dump_files(path).items()}
    world = sorted(dumps)
    return {rank: snapshot(rank, dump, world) for rank, dump in dumps.items()}


def snapshot(rank: int, dump: dict, world: list) -> dict:
    members = _members(dump, world)
    status = dump.get("pg_status", {})
    ops, seq, pairs, last = [], {}, {}, None
    for e in dump.get("entries", []):
        group, desc = e["process_group"]
        backend, _, name = e["profiling_name"].partition(":")
        op, _, meta = (name or backend).partition(" ")
        ranks = sorted(hangs.ranks_of(members.get(group, members.get("", world))))
        peer = _peer(op, meta, ranks)
        nbytes = math.prod(e["input_sizes"][0]) * DTYPE_BYTES.get(str(e["input_dtypes"][0]).lower(), 4) \
            if e.get("input_sizes") else 0
        post = e["time_created_ns"] / 1e9
        done = _completed(e, status.get(group, status.get(str(e.get("pg_id")), {})))
        wait = e["time_discovered_started_ns"] / 1e9 if e.get("time_discovered_started_ns") else post
        entry = [None] * len(timeline.FIELDS)
        entry[timeline.GROUP], entry[timeline.DIM], entry[timeline.OP] = group, desc, op
        entry[timeline.SEQ], entry[timeline.PEER] = e["collective_seq_id"], peer
        entry[timeline.PAIR_SEQ] = e.get("p2p_seq_id") if peer is not None else None
        entry[timeline.BYTES], entry[timeline.DTYPE] = nbytes, str(e["input_dtypes"][0]).lower() if nbytes else ""
        entry[timeline.SITE], entry[timeline.STEP] = _site(e.get("frames", [])), 0
        entry[timeline.POST], entry[timeline.WAIT] = post, wait
        entry[timeline.DONE] = post if done is True else done
        ops.append(entry)
        if peer is None:
            seq[group] = max(seq.get(group, 0), e["collective_seq_id"])
        else:
            key = f"{group}:{op}:{peer}"
            pairs[key] = max(pairs.get(key, 0), e.get("p2p_seq_id") or 0)
        last = e
    stack = [f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in reversed((last or {}).get("frames", []))]
    return {"rank": rank, "host": "?", "pid": None, "attempt": 0, "coords": {"rank": rank}, "step": 0,
            "phase": "flight recorder dump", "exiting": "", "time": max((o[timeline.POST] for o in ops), default=0.0),
            "fields": timeline.FIELDS, "ops": ops, "spans": [], "seq": seq, "pairs": pairs, "hash": {},
            "members": members, "stack": stack, "signals": [], "source": "flight recorder"}


def _members(dump: dict, world: list) -> dict:
    """{group name: its global ranks} from pg_config; the default group's under "" where gloo keys
    it so, and the group of every rank dumped where a dump names none."""
    members = {}
    for key, config in dump.get("pg_config", {}).items():
        ranks = config.get("ranks")
        members[key] = json.loads(ranks) if isinstance(ranks, str) else list(ranks or world)
    names = {e["process_group"][0]: e["process_group"][1] for e in dump.get("entries", [])}
    for name, desc in names.items():
        if name not in members:
            members[name] = members[""] if "" in members and desc == "default_pg" else list(world)
    return members


def _peer(op: str, meta: str, ranks: list) -> Optional[int]:
    """A send's or receive's peer as a global rank (the profiling name holds group ranks)."""
    if op == "send" and "->" in meta:
        return ranks[int(meta.split("->")[1])]
    if op == "recv" and "<-" in meta:
        return ranks[int(meta.split("<-")[1])]
    return None


def _completed(entry: dict, status: dict):
    """The entry's end time, True where it completed at an unknown time, or None (not completed)."""
    if entry.get("time_discovered_completed_ns"):
        return entry["time_discovered_completed_ns"] / 1e9
    if entry.get("state") == "completed":
        return True
    done = status.get("last_completed_collective", -1)
    return True if not entry.get("is_p2p") and 0 < entry["collective_seq_id"] <= done else None


def _site(frames: list) -> str:
    """The first frame outside torch, innermost first: the line that posted the op."""
    for f in frames:
        if TORCH_DIR not in f.get("filename", "").replace("\\", "/"):
            return f"{Path(f['filename']).name}:{f['line']} {f['name']}"
    return "?"


def diagnose(path: Path, out: Optional[Path] = None) -> dict:
    """The hang report and the timeline of a job's Flight Recorder dumps, written as oplog.py
    writes a run's: <out>/diagnosis.json ({source, ranks, hang}), trace.json and report.txt."""
    snaps = read_dumps(path)
    out = Path(out) if out is not None else (Path(path) if Path(path).is_dir() else Path(path).parent) / "observe"
    out.mkdir(parents=True, exist_ok=True)
    blocked = {r: hangs._blocked(s) for r, s in snaps.items()}
    hang = None
    if any(e is not None for e in blocked.values()):
        root = hangs.localize(snaps)
        hang = {k: root.get(k) for k in ("rank", "op", "group", "seq", "reason", "detail", "site")}
        if root.get("op") is not None and root.get("peer") is None:  # the ranks that never posted it, as FR's analyzer says
            posted = [r for r, s in snaps.items() if s["seq"].get(root["group"], 0) >= root["seq"]]
            hang["posted"] = sorted(posted)
            hang["missing"] = sorted(r for r in hangs.ranks_of(snaps[posted[0]]["members"].get(root["group"], []))
                                     if r not in posted) if posted else []
    offsets, residual = timeline.clock_offsets(snaps)
    diagnosis = {"source": "flight recorder", "dumps": str(path), "ranks": sorted(snaps), "hang": hang,
                 "clock_offsets_s": {str(r): o for r, o in sorted(offsets.items())}, "clock_residual_s": residual}
    (out / "diagnosis.json").write_text(json.dumps(diagnosis, indent=1))
    (out / "trace.json").write_text(json.dumps(timeline.trace(snaps, offsets)))
    lines = [f"{path}: Flight Recorder dumps of {len(snaps)} ranks"]
    if hang is None:
        lines.append("no rank waits in an op: no hang")
    else:
        lines.append(f"hang: rank {hang['rank']}, {hang['reason']}: {hang['detail']}")
        if "missing" in hang:
            lines.append(f"{hang['op']} #{hang['seq']} of group {hang['group']} posted by ranks {hang['posted']}, "
                         f"never by {hang['missing']}")
    (out / "report.txt").write_text("\n".join(lines) + "\n")
    return diagnosis
