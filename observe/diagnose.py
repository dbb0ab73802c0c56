"""A run's post-mortem, `python -m observe RUN_DIR`: from the newest attempt's snapshots (oplog.py
writes them) and faults.jsonl, the diagnosis (hangs, desyncs, stragglers, signals, fatal errors),
the cross-rank timeline (Perfetto's trace format and a figure) and a short report; from a folder of
PyTorch Flight Recorder dumps, the same for another job's collectives (flightrec.py).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from observe import stragglers, timeline
from observe.hangs import snapshot_dir



def diagnose(run_dir: Path, price=None) -> dict:
    """Write RUN_DIR/observe/diagnosis.json, trace.json, timeline.png, heatmap.png and report.txt
    from the newest attempt's snapshots and faults.jsonl; works while the run still runs (the
    snapshots are renamed into place). The timeline gains the replay's predicted track where
    clustermodel/predicted.py has written observe/predicted.json. price(run_dir, stragglers) ->
    stragglers re-prices the verdicts (`python -m clustermodel.predicted RUN_DIR` passes the
    what-if replay's: the cluster model imports the config, which imports this module); without
    it each keeps the detector's estimate (`priced_by` "excess")."""
    run_dir = Path(run_dir)
    attempts = sorted(int(p.name.removeprefix("attempt")) for p in (run_dir / "observe").glob("attempt*"))
    if not attempts:
        raise SystemExit(f"{run_dir}/observe has no snapshots: was the run started with observe.ops=true?")
    folder = snapshot_dir(run_dir, attempts[-1])
    snaps = {int(p.stem.removeprefix("rank")): json.loads(p.read_text()) for p in folder.glob("rank*.json")}
    offsets, residual = timeline.clock_offsets(snaps)
    hangs, faults = [], run_dir / "faults.jsonl"
    events = [json.loads(line) for line in faults.read_text().splitlines()] if faults.exists() else []
    for event in events:
        if event.get("event") == "hang_detected" and "root" in event:
            hangs.append({**{k: event["root"].get(k) for k in ("rank", "op", "group", "seq", "reason")},
                          "attempt": event["attempt"], "detail": event["root"]["detail"]})
    desyncs = [{**e["desync"], "attempt": e["attempt"]} for e in events if e.get("event") == "desync"]
    late = stragglers.post_lateness(snaps, offsets)
    found = [{**v, "priced_by": "excess"} for v in stragglers.from_metrics(run_dir, late)]
    signals = {r: s["signals"] for r, s in sorted(snaps.items()) if s.get("signals")}
    fatal = {int(p.name.split(".")[0].removeprefix("rank")): p.read_text().splitlines()[0]
             for p in sorted(folder.glob("rank*.stacks.txt")) if p.stat().st_size}  # faulthandler's first line
    diagnosis = {"ranks": sorted(snaps), "attempt": attempts[-1], "hang": hangs[-1] if hangs else None,
                 "hangs": hangs, "desync": desyncs, "stragglers": price(run_dir, found) if price else found,
                 "post_late_ms": {str(r): ms for r, ms in late.items()}, "signals": signals, "fatal": fatal,
                 "clock_offsets_s": {str(r): o for r, o in sorted(offsets.items())},
                 "clock_residual_s": residual}
    out = run_dir / "observe"
    predicted = _predicted(run_dir, snaps)
    diagnosis["predicted_track"] = sorted(predicted)
    _write(out / "diagnosis.json", json.dumps(diagnosis, indent=1))
    _write(out / "trace.json", json.dumps(timeline.trace(snaps, offsets, predicted)))
    timeline.figure(snaps, offsets, out / "timeline.png", predicted)
    stragglers.heat_map(run_dir, out)
    lines = [f"{run_dir}: attempt {attempts[-1]}, {len(snaps)} ranks' snapshots",
             f"clocks aligned from matched collectives; residual {residual * 1e3:.3f} ms"]
    lines += [f"hang (attempt {h['attempt']}): rank {h['rank']}, {h['reason']}: {h['detail']}" for h in hangs] or \
        ["no hang reported"]
    lines += [f"desync (attempt {d['attempt']}): rank {d['rank']}: {d['detail']}" for d in desyncs] or \
        ["no desync reported"]
    lines += [f"straggler: rank {s['rank']}, {s['kind']}, {s['slowdown']:.2f}x its peers, {s['cost_pct']:.1f}% of "
              f"the step (priced by {s['priced_by']}; first at step {s['first_step']}); posts its collectives {s.get('post_late_ms', '?')} ms "
              "after the first member (median)" for s in diagnosis["stragglers"]] or ["no straggler reported"]
    lines += [f"rank {r} received {', '.join(s['name'] for s in got)}" for r, got in signals.items()]
    lines += [f"rank {r}: {first} (every thread's stack in {folder.name}/rank{r}.stacks.txt)" for r, first in fatal.items()]
    _write(out / "report.txt", "\n".join(lines) + "\n")
    return diagnosis


def _predicted(run_dir: Path, snaps: dict) -> dict:
    """{rank: the replay's predicted spans} from RUN_DIR/observe/predicted.json (python clustermodel/predicted.py
    RUN_DIR writes it), or {}."""
    path = Path(run_dir) / "observe" / "predicted.json"
    return timeline.lay_predicted(snaps, json.loads(path.read_text())["stages"]) if path.exists() else {}


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv: Optional[list] = None, price=None) -> None:
    """`python -m observe RUN_DIR`; price: as diagnose takes it."""
    import argparse
    parser = argparse.ArgumentParser(prog="python -m observe", description="A run dir's diagnosis, timeline and report.")
    parser.add_argument("run_dir", type=Path, help="the run's directory (hydra.run.dir), or a folder of PyTorch "
                        "Flight Recorder dumps (<prefix><rank>, as TORCH_FR_DUMP_TEMP_FILE names them)")
    run_dir = parser.parse_args(argv).run_dir
    if not any((run_dir / "observe").glob("attempt*")) and run_dir.is_dir() and _holds_dumps(run_dir):
        from observe import flightrec  # another job's collectives, from its Flight Recorder
        flightrec.diagnose(run_dir)
    else:
        diagnose(run_dir, price)
    print((run_dir / "observe" / "report.txt").read_text(), end="")


def _holds_dumps(folder: Path) -> bool:
    from observe import flightrec
    try:
        return bool(flightrec.dump_files(folder))
    except SystemExit:
        return False
