"""Figures from the run dirs that experiments/tables.py reads, as PNG and PDF (matplotlib, Agg).

    python experiments/figures.py multirun/2025-01-01/12-00-00 [more dirs] [--out DIR]

One set per study group (scale, fabric), as in the tables:
- loss_<study>_<group>: training loss against tokens seen (step * batch * seq_len), one line per
  variant (convergence variants, ablation steps); val loss as markers where logged.
- mfu_<group>: MFU per ablation step. A step with no measurement gets its status ("missing",
  "failed", "pending") written where its bar would be, never a zero bar.
- step_time_<group>: each ablation step's median step time, split into compute / exposed comm /
  bubble / other where metrics.jsonl logs compute_s, exposed_comm_s and bubble_s; otherwise the
  total only, hatched and labelled "total (no breakdown logged)".
Out defaults to the first dir. Existing files are never overwritten (one line, exit code 2).
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

import matplotlib
matplotlib.use("Agg")  # files only: no display on a cluster node or in CI
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from experiments import tables  # noqa: E402

PARTS = (("compute_s", "compute"), ("exposed_comm_s", "exposed comm"), ("bubble_s", "pipeline bubble"))
WARMUP_STEPS = 3  # skipped in medians, as metrics.summarize does: the first steps pay for allocation


def median(rows: List[dict], key: str) -> Optional[float]:
    """The same upper median as metrics.summarize, so the bar's total is the table's step time."""
    values = sorted(r[key] for r in rows[min(WARMUP_STEPS, max(len(rows) - 1, 0)):] if r.get(key) is not None)
    return values[len(values) // 2] if values else None


def slug(*parts: str) -> str:
    return re.sub(r"[^A-Za-z0-9._]+", "-", "_".join(parts)).strip("-")


# --- The figures ---

def loss_figure(runs: Sequence[tables.Run], title: str):
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for run in runs:
        rows = tables.read_metrics(run.dir)
        if not rows or run.batch is None or run.seq_len is None:
            continue
        per_step = run.batch * run.seq_len
        name = run.label + ("" if run.status == "ok" else f" ({run.status})")
        line, = ax.plot([r["step"] * per_step for r in rows], [r["loss"] for r in rows], label=name, lw=1.2)
        val = [(r["step"] * per_step, r["val_loss"]) for r in rows if r.get("val_loss") is not None]
        if val:
            ax.plot(*zip(*val), "o", color=line.get_color(), ms=4)
    ax.set(xlabel="tokens seen", ylabel="training loss (dots: val loss)", title=title)
    if ax.lines:
        ax.legend(fontsize=8)
    else:  # every run of the group died before logging a step
        ax.text(0.5, 0.5, "no run logged a step", transform=ax.transAxes, ha="center", color="gray")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def mfu_figure(records: List[dict], title: str):
    """MFU per step with its 95% interval (tables' windows); a step without a measurement, or whose
    switch had nothing to act on (n/a), has its status where the bar would be, and n/a's reason below."""
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    xs = range(len(records))
    for x, rec in zip(xs, records):
        if rec["mfu"] is None:
            _status(ax, x, rec["status"])
        else:
            ci = rec.get("mfu_ci95")
            ax.bar(x, 100 * rec["mfu"], color="C0", yerr=None if ci is None else 100 * ci, capsize=3,
                   error_kw={"elinewidth": 1})
            ax.text(x, 100 * (rec["mfu"] + (ci or 0)), f"{100 * rec['mfu']:.1f}", ha="center", va="bottom", fontsize=8)
    _step_axis(ax, records)
    ax.set(ylabel="MFU (%), 95% interval", title=title)
    reasons = [f"n/a {r['label']}: {r['na_reason']}" for r in records if r.get("na_reason")]
    fig.tight_layout(rect=(0, 0.035 * len(reasons), 1, 1))
    for k, line in enumerate(reasons):
        fig.text(0.01, 0.035 * (len(reasons) - k - 1) + 0.01, line, fontsize=7, color="gray")
    return fig


def breakdown(rec: dict) -> Tuple[List[Tuple[str, float]], bool]:
    """[(part, seconds)] of one step's median step time, and whether the parts were logged."""
    rows = tables.read_metrics(rec["dir"])
    total = median(rows, "step_time") or rec["step_time"]
    parts = [(name, median(rows, key)) for key, name in PARTS]
    parts = [(name, v) for name, v in parts if v is not None]
    if not parts:
        return [("total (no breakdown logged)", total)], False
    rest = total - sum(v for _, v in parts)
    return parts + ([("other", rest)] if rest > 0 else []), True


def step_time_figure(records: List[dict], title: str):
    fig, ax = plt.subplots(figsize=(9, 4.2))
    colors = {name: f"C{i}" for i, name in enumerate([n for _, n in PARTS] + ["other"])}
    seen = set()
    for x, rec in enumerate(records):
        if rec["mfu"] is None:
            _status(ax, x, rec["status"])
            continue
        bottom = 0.0
        parts, logged = breakdown(rec)
        for name, value in parts:
            ax.bar(x, value, bottom=bottom, color=colors.get(name, "lightgray"), hatch=None if logged else "//",
                   edgecolor="gray", label=None if name in seen else name)
            seen.add(name)
            bottom += value
    _step_axis(ax, records)
    ax.set(ylabel="median step time (s)", title=title)
    if seen:  # outside the axes: the bars fill the plot's whole height
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    return fig


def _status(ax, x: int, status: str) -> None:
    """A step with no measurement: its status where the bar would be (an empty slot, not a zero)."""
    ax.annotate(status, (x, 0), xytext=(0, 4), textcoords="offset points", rotation=90, ha="center",
                va="bottom", color="gray", fontsize=9)


def _step_axis(ax, records: List[dict]) -> None:
    ax.set_xticks(range(len(records)), [r["label"] for r in records], rotation=35, ha="right", fontsize=8)
    ax.grid(axis="y", alpha=0.3)


# --- What to draw, and writing it ---

def plan(runs: Sequence[tables.Run]) -> List[Tuple[str, Callable]]:
    """[(file stem, a function drawing the figure)], so every path is known (and checked) before drawing."""
    jobs = []
    for (scale, fabric), group in tables.groups(runs, "convergence").items():
        jobs.append((f"loss_convergence_{slug(scale, fabric)}",
                     lambda g=group, s=scale, f=fabric: loss_figure(g, f"Convergence ({s}, {f})")))
    for (scale, fabric), group in tables.groups(runs, "megascale_ablation").items():
        best = tables.best_per_step(group)
        steps = sorted(best.values(), key=lambda r: (r.step is None, r.step or 0))
        jobs.append((f"loss_megascale_ablation_{slug(scale, fabric)}",
                     lambda g=steps, s=scale, f=fabric: loss_figure(g, f"Ablation loss ({s}, {f})")))
    for table in tables.ablation(runs):
        scale, fabric = table.records[0]["scale"], table.records[0]["fabric"]
        jobs.append((f"mfu_{slug(scale, fabric)}", lambda t=table, s=scale, f=fabric:
                     mfu_figure(t.records, f"MFU per ablation step ({s}, {f})")))
        jobs.append((f"step_time_{slug(scale, fabric)}", lambda t=table, s=scale, f=fabric:
                     step_time_figure(t.records, f"Step time per ablation step ({s}, {f})")))
    return jobs


def write_figures(runs: Sequence[tables.Run], out: Path) -> List[Path]:
    jobs = plan(runs)
    paths = [out / f"{stem}.{ext}" for stem, _ in jobs for ext in ("png", "pdf")]
    tables.refuse_existing(paths)
    out.mkdir(parents=True, exist_ok=True)
    for stem, draw in jobs:
        fig = draw()
        for ext in ("png", "pdf"):
            fig.savefig(out / f"{stem}.{ext}", dpi=150)
        plt.close(fig)
    return paths


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description="PNG and PDF figures from multirun dirs.")
    p.add_argument("dirs", nargs="+", help="Hydra multirun dirs (or single run dirs)")
    p.add_argument("--out", help="where the figures go (default: the first dir)")
    args = p.parse_args(argv)
    try:
        runs = tables.load_runs(args.dirs)
        if runs and not any(run.measured for run in runs):
            raise tables.SourceError(f"none of the {len(runs)} runs in {', '.join(args.dirs)} has a measurement "
                                     f"({tables.status_counts(runs)}): nothing to draw. Fix: see why in each "
                                     f"job's train_rank0.log, then run them again")
        if not plan(runs):
            raise tables.SourceError(f"none of {len(runs)} runs is in a convergence or megascale_ablation study. "
                                     f"Fix: run them with an experiment preset that sets study.name")
        paths = write_figures(runs, Path(args.out or args.dirs[0]))
    except tables.SourceError as err:
        print(err, file=sys.stderr)
        return 2
    print("wrote\n" + "\n".join(f"  {p}" for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
