"""The sign of each measured Table 3 step, over repeated sweeps, beside both models'.

    python experiments/ablation_signs.py /tmp/d22 /tmp/d22r2 /tmp/d22r3

Each argument is one sweep of the 9 ablation steps (make demo's, or the 2 x 2 one in experiments/results/table3.md),
already priced by `python -m clustermodel validate`: this reads the newest row of each run from
experiments/results/perfmodel_validation.jsonl. A step's change is in tokens/s (+LAMB triples
the batch, so step time would not compare), per sweep. Its interval is the 95% Student-t
interval of the mean over the sweeps. A step counts only where that interval excludes zero,
and then both models' mean change must have its sign: a prediction of no change is wrong.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROWS = ROOT / "experiments" / "results" / "perfmodel_validation.jsonl"
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}  # two-sided, by dof


def newest_rows(path: Path = ROWS) -> dict:
    """{run dir: its newest row with a replayed prediction}."""
    rows = {}
    for line in path.read_text().splitlines():
        row = json.loads(line) if line.strip() else {}
        if "replayed" in row:
            rows[row["run"]] = row
    return rows


def tokens_per_step(run: str) -> int:
    train = json.loads((Path(run) / "run.json").read_text())["config"]["train"]
    return train["batch_size"] * train["seq_len"]


def step_changes(sweeps: list, rows: dict, tokens=tokens_per_step) -> list:
    """[{label, measured: [Δ tokens/s per sweep], analytical, replayed: mean Δ}] for steps 1..8."""
    out = []
    for k in range(1, 9):
        change = {"measured": [], "analytical": [], "replayed": []}
        label = None
        for sweep in sweeps:
            before, after = rows.get(f"{sweep}/{k - 1}"), rows.get(f"{sweep}/{k}")
            if before is None or after is None:
                continue
            label = after["label"]
            t0, t1 = tokens(f"{sweep}/{k - 1}"), tokens(f"{sweep}/{k}")
            change["measured"].append(t1 / after["measured_s"] - t0 / before["measured_s"])
            change["analytical"].append(t1 / after["predicted_s"] - t0 / before["predicted_s"])
            change["replayed"].append(t1 / after["replayed"]["step_s"] - t0 / before["replayed"]["step_s"])
        if label is not None:
            out.append({"label": label, "measured": change["measured"],
                        "analytical": statistics.mean(change["analytical"]),
                        "replayed": statistics.mean(change["replayed"])})
    return out


def interval(values: list) -> tuple:
    """(mean, half-width of its 95% interval); one sweep has no interval (inf)."""
    mean = statistics.mean(values)
    if len(values) < 2:
        return mean, math.inf
    return mean, T95.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values))


def table(changes: list) -> str:
    lines = ["| step | measured Δ tokens/s, per sweep | mean ± 95% | beyond its noise | analytical Δ | replayed Δ "
             "| sign right (analytical / replayed) |", "|---|---|---|---|---|---|---|"]
    for c in changes:
        mean, half = interval(c["measured"])
        beyond = abs(mean) > half
        right = f"{'yes' if c['analytical'] * mean > 0 else 'no'} / {'yes' if c['replayed'] * mean > 0 else 'no'}"
        lines.append(f"| {c['label']} | {', '.join(f'{m:+.0f}' for m in c['measured'])} | {mean:+.0f} ± {half:.0f} | "
                     f"{'yes' if beyond else 'no'} | {c['analytical']:+.0f} | {c['replayed']:+.0f} | "
                     f"{right if beyond else 'n/a'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sweeps", nargs="+", help="sweep dirs of the 9 ablation steps, each priced by python -m clustermodel validate")
    args = p.parse_args(argv)
    rows = newest_rows()
    missing = [s for s in args.sweeps if f"{s.rstrip('/')}/0" not in rows]
    if missing:
        print(f"ablation_signs: {missing[0]} has no priced row in {ROWS}; run `python -m clustermodel validate {missing[0]}` "
              "first", file=sys.stderr)
        return 2
    print(table(step_changes([s.rstrip("/") for s in args.sweeps], rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
