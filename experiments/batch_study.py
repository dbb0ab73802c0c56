"""Fig. 10 as a researcher would run it: where does LAMB at k times the batch match AdamW at equal
tokens, and where does it stop (the critical batch)? AdamW and LAMB at k = 1, 2, 3, 4, 8 times the
batch, each seeing the same tokens, with a small learning-rate sweep per cell around the scaling
rule's rate (optim.batch_scaled_lr) and three seeds at each cell's best rate.

    python experiments/batch_study.py run [--out DIR] [-- more train.py overrides]
    python experiments/batch_study.py report DIR              # the table and figures again

`run` is Hydra multiruns of experiment=convergence: the sweep (optimizer x k x lr_mult, seed 1337);
then, for each cell whose best rate is the lowest or highest it tried, the next factor of 2 beyond
it (at most twice), so that a reported rate is bracketed; then the seeds 1338 and 1339 at each
cell's best rate (lowest final validation loss at seed 1337). Each phase runs only what the --out
dir does not hold yet, so `run --out DIR` again goes on with a study that was cut off. Add
hydra/launcher=submitit_slurm (and its settings) after `--` to run them on SLURM.
`report` writes batch_study.md (appended), .csv and the figures into DIR.

The scale: a 2-layer, 128-wide model on the embedded corpus (4,096-token BPE), sequences of 128,
k=1 at 8 sequences (1,024 tokens) a step, 384 Ki tokens per run: k=1 takes 384 steps, k=4 96 and
k=8 48, so the largest batches still take tens of steps after a warm-up of 32 Ki tokens. The whole
study (57 runs with the bracketing) took about an hour on 2 cores; a larger model or budget moves the critical
batch (it grows as the loss falls), which is the point of measuring where it is here.

The rates at k=1 come from a pilot at this scale (final val loss after 384 steps): AdamW 5e-4 5.655,
2e-3 5.112, 8e-3 5.233; LAMB 2e-3 6.397, 8e-3 5.156, 3.2e-2 5.000, 1.28e-1 6.775. LAMB's step is
relative to each weight's norm (the trust ratio), so its rate is an order of magnitude above
AdamW's: the same peak rate for both, as the first version of this study used, starves LAMB.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from experiments import intervals, tables  # noqa: E402

OPTIMIZERS = ("adamw", "lamb")
KS = (1, 2, 3, 4, 8)
LR_MULTS = (0.5, 1.0, 2.0)
# A cell whose best rate is at the end of what it tried gets the next factor of 2 beyond it, up to
# twice: a best rate at the sweep's edge is not yet the best rate.
MAX_EXTENSIONS = 2
MIN_MULT, MAX_MULT = LR_MULTS[0] / 4, LR_MULTS[-1] * 4
SEEDS = (1337, 1338, 1339)   # the sweep runs the first; the best rate of each cell gets the others
SCALE = ["model=tiny", "model.n_layers=2", "model.d_model=128", "model.n_heads=4", "train.seq_len=128",
         "convergence.batch=8", "convergence.steps=384", "convergence.warmup_tokens=32768", "convergence.evals=8",
         "convergence.adamw_lr=2e-3", "convergence.lamb_lr=3.2e-2",
         "convergence.eval_sequences=192", "logging.interval=100", "logging.wandb.mode=disabled"]

Cell = Tuple[str, int]  # (optimizer, k)


# --- Running ---

def multirun(overrides: List[str], sweep_dir: Path, extra: List[str]) -> None:
    cmd = [sys.executable, "train.py", "-m", "experiment=convergence", *SCALE, *overrides, *extra,
           f"hydra.sweep.dir={sweep_dir}"]
    print("$ " + " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, env=dict(os.environ, WANDB_MODE="disabled"))


def run(out: Path, extra: List[str]) -> None:
    """The sweep, then the rate bracketed where a cell's best is at the edge of what it tried, then
    the seeds at each cell's best. Each phase runs only what out does not hold yet (into a new
    folder, never over another run), so a study cut off goes on where it stopped."""
    if not cells_in(out):
        multirun([f"convergence.optimizer={','.join(OPTIMIZERS)}", f"convergence.k={','.join(map(str, KS))}",
                  f"convergence.lr_mult={','.join(f'{m:g}' for m in LR_MULTS)}", f"train.seed={SEEDS[0]}"],
                 new_dir(out, "sweep"), extra)
    found = cells_in(out)
    missing: Dict[Tuple[str, float], List[int]] = {}
    for optimizer, k, mult in itertools.product(OPTIMIZERS, KS, LR_MULTS):
        if SEEDS[0] not in found.get((optimizer, k), {}).get(mult, {}):
            missing.setdefault((optimizer, mult), []).append(k)
    run_groups(out, "sweep", missing, extra)
    for _ in range(MAX_EXTENSIONS):
        wanted = beyond_the_edge(cells_in(out))
        if not wanted:
            break
        run_groups(out, "edge", wanted, extra)
    found = cells_in(out)
    for (optimizer, k), mult in sorted(best_rates(found).items()):
        seeds = [seed for seed in SEEDS[1:] if seed not in found[(optimizer, k)][mult]]
        if seeds:
            multirun([f"convergence.optimizer={optimizer}", f"convergence.k={k}", f"convergence.lr_mult={mult:g}",
                      f"train.seed={','.join(map(str, seeds))}"], new_dir(out, f"seeds_{optimizer}_k{k}_x{mult:g}"), extra)


def run_groups(out: Path, phase: str, wanted: Dict[Tuple[str, float], List[int]], extra: List[str]) -> None:
    """One multirun per (optimizer, lr_mult) over its ks, at the sweep's seed."""
    for (optimizer, mult), ks in sorted(wanted.items()):
        multirun([f"convergence.optimizer={optimizer}", f"convergence.k={','.join(map(str, ks))}",
                  f"convergence.lr_mult={mult:g}", f"train.seed={SEEDS[0]}"],
                 new_dir(out, f"{phase}_{optimizer}_x{mult:g}"), extra)


def new_dir(out: Path, name: str) -> Path:
    """out/name, or out/name-2, -3, ... where it exists: a multirun never writes over earlier jobs."""
    path, n = out / name, 1
    while path.exists():
        n += 1
        path = out / f"{name}-{n}"
    return path


def cells_in(out: Path) -> Dict[Cell, Dict[float, Dict[int, tables.Run]]]:
    return cells(tables.load_runs(sorted(d for d in out.iterdir() if d.is_dir()))) if out.is_dir() else {}


def beyond_the_edge(found) -> Dict[Tuple[str, float], List[int]]:
    """{(optimizer, lr_mult): [k, ...]}: the next rate (half or double) for each cell whose best rate
    is the lowest or highest it has tried, so that every reported rate is bracketed by a worse one
    on each side (or MAX_EXTENSIONS steps past the sweep say it was not)."""
    wanted: Dict[Tuple[str, float], List[int]] = {}
    for (optimizer, k), mult in best_rates(found).items():
        tried = [m for m, runs in found[(optimizer, k)].items() if SEEDS[0] in runs]
        step = 0.5 if mult == min(tried) else 2.0 if mult == max(tried) else None
        if step is not None and MIN_MULT <= mult * step <= MAX_MULT:
            wanted.setdefault((optimizer, mult * step), []).append(k)
    return wanted


# --- Reading ---

def key(run: tables.Run) -> Optional[Tuple[str, int, float, int]]:
    """(optimizer, k, lr_mult, seed) of a batch-study run, or None for another run."""
    c = run.config.get("convergence") or {}
    if run.study != "convergence" or c.get("variant", "baseline") != "baseline" or not run.measured:
        return None
    return c.get("optimizer", "adamw"), int(c.get("k", 1)), float(c.get("lr_mult", 1.0)), int(run.config["train"]["seed"])


def cells(runs: Sequence[tables.Run]) -> Dict[Cell, Dict[float, Dict[int, tables.Run]]]:
    """{(optimizer, k): {lr_mult: {seed: run}}}, the newest run of each."""
    out: Dict[Cell, Dict[float, Dict[int, tables.Run]]] = {}
    for run in sorted(runs, key=lambda r: r.started):
        found = key(run)
        if found and run.final.get("val_loss") is not None:
            optimizer, k, mult, seed = found
            out.setdefault((optimizer, k), {}).setdefault(mult, {})[seed] = run
    return out


def best_rates(found: Dict[Cell, Dict[float, Dict[int, tables.Run]]]) -> Dict[Cell, float]:
    """Each cell's lr_mult with the lowest final validation loss at the sweep's seed."""
    return {cell: min((m for m in by_mult if SEEDS[0] in by_mult[m]),
                      key=lambda m: by_mult[m][SEEDS[0]].final["val_loss"])
            for cell, by_mult in found.items() if any(SEEDS[0] in runs for runs in by_mult.values())}


def val_losses(found, cell: Cell, mult: float) -> List[float]:
    return [r.final["val_loss"] for _, r in sorted(found[cell][mult].items())]


# --- The table ---

def table(found) -> Tuple[str, List[dict]]:
    best = best_rates(found)
    reference = ("adamw", 1)
    ref = val_losses(found, reference, best[reference]) if reference in best else None
    lines = ["| optimizer | k | batch x steps | lr (x rule) | val loss by rate tried (x rule: loss) | val loss, seeds | "
             "vs own k=1 | vs AdamW k=1 | matches AdamW k=1? |", "|---|---|---|---|---|---|---|---|---|"]
    records = []
    for cell in sorted(best, key=lambda c: (OPTIMIZERS.index(c[0]), c[1])):
        optimizer, k = cell
        mult = best[cell]
        losses = val_losses(found, cell, mult)
        run = found[cell][mult][SEEDS[0]]
        tried = sorted(m for m, runs in found[cell].items() if SEEDS[0] in runs)
        sweep = " / ".join(f"x{m:g}: {found[cell][m][SEEDS[0]].final['val_loss']:.3f}" for m in tried)
        own = val_losses(found, (optimizer, 1), best[(optimizer, 1)]) if (optimizer, 1) in best else None
        vs_own, vs_ref = compare(losses, own), compare(losses, ref)
        verdict = "" if vs_ref is None or cell == reference else (
            "yes (within seed noise)" if abs(vs_ref[0]) <= vs_ref[1] else ("better" if vs_ref[0] < 0 else "no"))
        edge = " (edge)" if mult in (tried[0], tried[-1]) else ""
        lines.append(f"| {optimizer} | {k} | {run.batch} x {run.final['steps']} | {run.config['train']['lr']:.2e} "
                     f"(x{mult:g}){edge} | {sweep} | {spread(losses)} | {fmt(vs_own, cell == (optimizer, 1))} | "
                     f"{fmt(vs_ref, cell == reference)} | {verdict} |")
        records.append({"optimizer": optimizer, "k": k, "batch": run.batch, "steps": run.final["steps"],
                        "lr": run.config["train"]["lr"], "lr_mult": mult, "seeds": len(losses),
                        "val_loss_mean": statistics.fmean(losses),
                        "val_loss_sd": statistics.stdev(losses) if len(losses) > 1 else None,
                        "vs_adamw_k1": None if vs_ref is None else vs_ref[0],
                        "vs_adamw_k1_ci95": None if vs_ref is None else vs_ref[1], "matches_adamw_k1": verdict})
    return "\n".join(lines), records


def compare(losses: List[float], reference: Optional[List[float]]) -> Optional[Tuple[float, float]]:
    """(mean difference, its 95% half-width over seeds, Welch), or None without two seeds each."""
    if not reference or len(losses) < 2 or len(reference) < 2:
        return None
    return statistics.fmean(losses) - statistics.fmean(reference), intervals.difference_half_width(reference, losses)


def spread(losses: List[float]) -> str:
    if len(losses) < 2:
        return f"{losses[0]:.3f} (1 seed)"
    return f"{statistics.fmean(losses):.3f} ± {statistics.stdev(losses):.3f} ({len(losses)})"


def fmt(diff: Optional[Tuple[float, float]], itself: bool) -> str:
    if itself:
        return "-"
    return "?" if diff is None else f"{diff[0]:+.3f} ± {diff[1]:.3f}"


# --- The figures ---

def figures(found, out: Path) -> List[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    best = best_rates(found)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, optimizer in zip(axes, OPTIMIZERS):
        for i, k in enumerate(KS):
            if (optimizer, k) not in best:
                continue
            runs = list(found[(optimizer, k)][best[(optimizer, k)]].values())
            curves = [[(r["step"] * run.batch * run.seq_len, r["val_loss"]) for r in tables.read_metrics(run.dir)
                       if r.get("val_loss") is not None] for run in runs]
            tokens = [t for t, _ in curves[0]]
            points = list(zip(*[[v for _, v in c] for c in curves]))[:len(tokens)]
            mean = [statistics.fmean(p) for p in points]
            ax.plot(tokens, mean, "-o", ms=3, color=f"C{i}", label=f"k={k} (lr x{best[(optimizer, k)]:g})")
            ax.fill_between(tokens, [min(p) for p in points], [max(p) for p in points], color=f"C{i}", alpha=0.2)
        ax.set(title=f"{optimizer}: best rate per k, band = seeds' range", xlabel="tokens seen")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("validation loss")
    fig.tight_layout()
    _save(fig, out / "batch_study_curves")
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, optimizer in enumerate(OPTIMIZERS):
        ks = [k for k in KS if (optimizer, k) in best]
        losses = [val_losses(found, (optimizer, k), best[(optimizer, k)]) for k in ks]
        ax.errorbar(ks, [statistics.fmean(v) for v in losses],
                    yerr=[statistics.stdev(v) if len(v) > 1 else 0 for v in losses], fmt="-o", capsize=3,
                    color=f"C{i}", label=optimizer)
    if ("adamw", 1) in best:
        ref = val_losses(found, ("adamw", 1), best[("adamw", 1)])
        ax.axhline(statistics.fmean(ref), color="gray", ls="--", lw=1, label="AdamW at k=1")
    ax.set(xscale="log", xticks=list(KS), xlabel="batch multiple k (equal tokens)",
           ylabel="final validation loss (bars: seeds' sd)", title="Where a larger batch stops matching")
    ax.set_xticklabels([str(k) for k in KS])
    ax.minorticks_off()  # a log axis would label 6 as 6x10^0 between the ks
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, out / "batch_study_final")
    return figure_paths(out)


def figure_paths(out: Path) -> List[Path]:
    return [out / f"batch_study_{name}.{ext}" for name in ("curves", "final") for ext in ("png", "pdf")]


def _save(fig, stem: Path) -> None:
    import matplotlib.pyplot as plt
    for ext in ("png", "pdf"):
        fig.savefig(f"{stem}.{ext}", dpi=150)
    plt.close(fig)


def report(dirs: List[Path], out: Path) -> int:
    missing = [d for d in dirs if not d.is_dir()]
    if missing:
        raise tables.SourceError(f"{missing[0]}: no such directory. Fix: give the dir `run` wrote (its --out)")
    runs = tables.load_runs([sweep for root in dirs for sweep in sorted(root.iterdir()) if sweep.is_dir()])
    found = cells(runs)
    if not found:
        raise tables.SourceError(f"no finished batch-study run (experiment=convergence, variant baseline, with a "
                                 f"val loss) in {', '.join(map(str, dirs))}. Fix: give the dir `run` wrote")
    text, records = table(found)
    tables.refuse_existing([out / "batch_study.csv"] + figure_paths(out))  # before anything is written
    title = (f"\n## Batch study, {datetime.datetime.now():%Y-%m-%d %H:%M}: final validation loss at equal tokens "
             f"({len(runs)} runs; {' '.join(SCALE)})\n\n")
    notes = ("\nlr: the rule's rate for k (square root, optim.batch_scaled_lr) times the sweep's best multiple "
             "(edge: still the lowest or highest rate tried, after 2 factors of 2 beyond the sweep). val loss: mean ± sd over seeds at that rate. vs own k=1 and vs AdamW "
             "k=1: the difference of means ± its 95% interval (Welch); a matching cell's interval holds zero.\n")
    print(title + text + notes)
    with open(out / "batch_study.md", "a") as f:  # appended, never overwritten
        f.write(title + text + notes)
    import csv
    with open(out / "batch_study.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)
    print("wrote\n" + "\n".join(f"  {p}" for p in [out / "batch_study.md", out / "batch_study.csv"]
                                 + figures(found, out)))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=["run", "report"])
    p.add_argument("dirs", nargs="*", type=Path, help="report: the study's dir (run's --out)")
    p.add_argument("--out", type=Path, default=None, help="run: where the sweeps go (default multirun/batch-study-<time>)")
    args = p.parse_args(argv)
    try:
        if args.command == "run":
            out = args.out or ROOT / "multirun" / f"batch-study-{datetime.datetime.now():%Y-%m-%d_%H-%M-%S}"
            run(out, extra)
            return report([out], out)
        if not args.dirs:
            raise tables.SourceError("report needs the study's dir. Fix: python experiments/batch_study.py report DIR")
        return report(args.dirs, args.dirs[0])
    except tables.SourceError as err:
        print(err, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
