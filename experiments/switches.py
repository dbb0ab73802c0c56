"""What each Table 3 step's switch needs in a run to act on, and what its communication runs over.

A step whose switch has nothing to act on in a run's layout (PP overlap at pp 1, a window at least
the sequence) measures the previous step again; the tables print it as n/a, with the reason, never
as a gain of zero. And where the fabric decides a row's result (TP over a host's loopback costs
the CPU the compute uses; PP and DP across emulated links are wire-bound, as between GPU hosts),
the row says so. Read from run.json (config, layout, study.fabric): no torch here.
"""
from __future__ import annotations

import re
from typing import Dict, List, Optional, Tuple

# The step that turns each switch on (conf/experiment/megascale_ablation.yaml), and what it
# communicates over: the mesh dimension whose traffic it changes, if any.
SWA, TP_OVERLAP, PP_OVERLAP, DP_OVERLAP = 2, 3, 4, 5
DIMENSION_OF_STEP = {1: "tp", TP_OVERLAP: "tp", PP_OVERLAP: "pp", DP_OVERLAP: "dp"}  # 1: PTB halves TP's collectives
NEEDS = {TP_OVERLAP: ("tp", "no TP collectives to overlap"), PP_OVERLAP: ("pp", "no pipeline sends to overlap"),
         DP_OVERLAP: ("dp", "no gradient reduce-scatter or parameter all-gather to overlap")}


def sizes(config: dict, layout: dict) -> Dict[str, int]:
    """tp, pp, dp of a run: its layout as built (run.json), else its config."""
    p = config.get("parallel") or {}
    out = {}
    for dim in ("tp", "pp", "dp"):
        built = layout.get(f"{dim}_size")
        out[dim] = int(built if built is not None else (p.get(dim) if (p.get(dim) or 0) > 0 else 1))
    return out


def window_inert(config: dict) -> Optional[str]:
    """Why sliding-window attention changes nothing in this run, or None."""
    attention = (config.get("model") or {}).get("attention") or {}
    if "window" not in attention:  # a config that does not say (a job that died early): unknown
        return None
    window, seq = attention["window"], (config.get("train") or {}).get("seq_len")
    if window is None:
        return "no window set"
    if seq is not None and window >= seq:
        return f"window {window} >= seq_len {seq}: every key is inside it"
    return None


def inert(step: Optional[int], config: dict, layout: dict) -> Optional[str]:
    """Why this ablation step's switch has nothing to act on in this run, or None. Unknown (a job
    that died before run.json) is None: the row shows its status instead."""
    if not config or step is None:
        return None
    if step == SWA:
        why = window_inert(config)
        return f"SWA: {why}" if why else None
    if step in NEEDS and layout:
        dim, nothing = NEEDS[step]
        if sizes(config, layout)[dim] == 1:
            return f"{dim.upper()} overlap: {dim} = 1 in this layout, {nothing}"
    return None


def hosts_of(fabric: str) -> Optional[int]:
    """Ranks per host of a fabric name: "emulated:4x2@250mbit" -> 2; None for loopback, cluster."""
    found = re.match(r"emulated:(\d+)x(\d+)@", fabric or "")
    return int(found.group(2)) if found else None


def crosses_hosts(dim: str, layout: dict, per_host: int) -> bool:
    """Whether any of the run's `dim` groups (ranks equal in the other two coordinates) spans hosts."""
    groups: Dict[tuple, set] = {}
    for r in layout.get("ranks") or []:
        key = tuple(r[d] for d in ("dp", "pp", "tp") if d != dim)
        groups.setdefault(key, set()).add(r["rank"] // per_host)
    return any(len(hosts) > 1 for hosts in groups.values())


def fabric_note(step: Optional[int], fabric: str, layout: dict) -> Optional[str]:
    """Where this step's communication runs, when that decides its result on this machine."""
    dim = DIMENSION_OF_STEP.get(step)
    if dim is None or not layout or fabric == "cluster" or sizes({}, layout)[dim] == 1:
        return None
    per_host = hosts_of(fabric)
    if per_host is not None and crosses_hosts(dim, layout, per_host):
        rate = fabric.split("@", 1)[1]
        return (f"{dim.upper()} crosses the emulated {rate} links between hosts: its bytes cost wire time, "
                f"not this machine's CPU, as between GPU hosts")
    return (f"{dim.upper()} runs over loopback{' inside a host' if per_host else ''}: gloo's copies and sums take "
            f"the same CPU cores as the compute, so overlapping them hides little here (on GPUs NVLink or "
            f"the NIC moves them)")


def footnotes(rows: List[Optional[str]]) -> Tuple[List[str], List[str]]:
    """Markers for the distinct notes in row order, (a), (b), ...: (a marker or "" per row, the notes)."""
    seen: Dict[str, str] = {}
    for note in rows:
        if note and note not in seen:
            seen[note] = f"({chr(ord('a') + len(seen))})"
    return [seen.get(note, "") if note else "" for note in rows], [f"{m} {n}" for n, m in seen.items()]
