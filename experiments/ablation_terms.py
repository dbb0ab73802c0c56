"""Table 3 explained term by term, and how much each unstated assumption moves it.

    python experiments/ablation_terms.py [--figure PNG] [--sensitivity] [overrides ...]

Waterfall: each step's predicted MFU change (clustermodel/perfmodel.py, experiment=megascale_ablation
scale=cluster) split over the terms of the step it moves: GEMMs, attention, elementwise, exposed
TP/PP/DP communication, bubble, optimizer, data, the overlap's own cost, and the FLOPs the MFU
formula counts (a window changes them). MFU is F / (c * T), T the step's seconds per token, the
sum of the terms' seconds per token; a step's change in MFU at the old F is split in proportion to
each term's change in T, and the change of F is a term of its own, so a row sums to the step's
ΔMFU. As a Markdown table and, with --figure, a waterfall (one bar per step, split by term).

Sensitivity (--sensitivity): the paper leaves unstated the NICs per host and their speed, NCCL's
algorithm, the microbatch size and whether its Megatron-LM baseline overlaps DP at all. Each row of
ASSUMPTIONS re-predicts the study with another choice, and the table gives each step's ΔMFU under
it minus its ΔMFU under perfmodel's assumptions (conf/hardware/a100_cluster.yaml, one sequence per
microbatch, no DP overlap in the baseline): how far each assumption moves each step, in points.
Nothing here is fitted; the paper's qualitative claim (+PTB and +LAMB the two largest steps) stays
a strict xfail in tests/test_perfmodel.py.
"""
import argparse
import sys
from pathlib import Path
from typing import Dict, List, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clustermodel import cli  # noqa: E402
from metrics import markdown_table  # noqa: E402

TERMS = {"gemm": "GEMMs", "attention": "attention", "elementwise": "elementwise", "tp_comm": "exposed TP",
         "pp_comm": "exposed PP", "dp_comm": "exposed DP", "bubble": "bubble", "optimizer": "optimizer",
         "data": "data", "overlap_slowdown": "overlap's cost"}
COUNTED = "FLOPs counted"
ASSUMPTIONS = {  # the paper's silences: name -> overrides of every step
    "NICs 4 x 200 Gb/s per host (we: 8 x 200)": ["hardware.perfmodel.inter_host_Gbps=800"],
    "NICs 8 x 400 Gb/s per host": ["hardware.perfmodel.inter_host_Gbps=3200"],
    "NCCL tree, hierarchical (we: ring)": ["hardware.perfmodel.collective_algo=tree"],
    "2 sequences per microbatch (we: 1)": ["parallel.microbatches=${ablation:8,96,32}"],
    "baseline overlaps DP (we: not)": ["parallel.overlap.dp=true"],
}


def seconds_per_token(pred) -> Dict[str, float]:
    tokens = pred.tokens_per_s * pred.step_s
    return {k: v / tokens for k, v in pred.breakdown.items()}


def attribute(before, after) -> Dict[str, float]:
    """{term: MFU points} of the step from `before` to `after` (predictions); sums to ΔMFU."""
    t0, t1 = seconds_per_token(before), seconds_per_token(after)
    T0, T1 = sum(t0.values()), sum(t1.values())
    counted0, counted1 = before.mfu * T0, after.mfu * T1          # F / c, before and after
    out = {COUNTED: 100 * (counted1 - counted0) / T1}
    timed = 100 * counted0 * (1 / T1 - 1 / T0)                    # the change at the old F
    for key in TERMS:
        change = t1.get(key, 0.0) - t0.get(key, 0.0)
        out[TERMS[key]] = timed * change / (T1 - T0) if T1 != T0 else 0.0
    return out


def waterfall(results) -> List[Dict[str, float]]:
    """[{term: points}] for steps 1.. of ablation() results."""
    return [attribute(results[i - 1][2], results[i][2]) for i in range(1, len(results))]


def waterfall_table(results) -> str:
    rows = waterfall(results)
    columns = [c for c in [COUNTED] + list(TERMS.values()) if any(abs(r[c]) >= 0.005 for r in rows)]
    body = [[results[0][0], f"{100 * results[0][2].mfu:.1f}%"] + [""] * (len(columns) + 1)]
    for (label, _, pred), row in zip(results[1:], rows):
        body.append([label, f"{100 * pred.mfu:.1f}%", f"{sum(row.values()):+.2f}"] +
                    [f"{row[c]:+.2f}" if abs(row[c]) >= 0.005 else "" for c in columns])
    return markdown_table(["step", "MFU", "ΔMFU (points)"] + columns, body)


def waterfall_figure(results, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = waterfall(results)
    names = [COUNTED] + list(TERMS.values())
    colors = dict(zip(names, plt.get_cmap("tab20").colors))
    fig, ax = plt.subplots(figsize=(10, 5))
    level = 100 * results[0][2].mfu
    ax.bar(0, level, color="grey")
    for x, row in enumerate(rows, start=1):  # gains stacked up from the last MFU, losses back down from their top
        top = level
        for name in names:
            if row[name] > 0:
                ax.bar(x, row[name], bottom=top, color=colors[name])
                top += row[name]
        for name in names:
            if row[name] < 0:
                ax.bar(x, row[name], bottom=top, color=colors[name], hatch="//", edgecolor="white")
                top += row[name]
        level += sum(row.values())
        ax.plot([x - 0.4, x + 0.4], [level, level], color="black", lw=1.5)
    used = [n for n in names if any(abs(r[n]) >= 0.005 for r in rows)]
    ax.legend([plt.Rectangle((0, 0), 1, 1, color=colors[n]) for n in used], used, fontsize=7, ncol=2, loc="upper left")
    ax.set_xticks(range(len(results)), [label.split(" (")[0] for label, _, _ in results], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("MFU (%)")
    ax.set_ylim(min(100 * results[0][2].mfu, level) * 0.8, None)
    ax.set_title("Table 3 predicted: each step's MFU change by the term it moves (hatched: losses; black: the step's MFU)")
    fig.tight_layout()
    fig.savefig(path, dpi=150)


def step_gains(results) -> List[float]:
    return [100 * (results[i][2].mfu - results[i - 1][2].mfu) for i in range(1, len(results))]


def sensitivity_table(overrides: Sequence[str] = ()) -> str:
    base = cli.ablation(overrides)
    default = step_gains(base)
    columns = {name: step_gains(cli.ablation(list(overrides) + extra)) for name, extra in ASSUMPTIONS.items()}
    rows = [[label, f"{gain:+.2f}"] + [f"{columns[name][i] - gain:+.2f}" for name in ASSUMPTIONS]
            for i, ((label, _, _), gain) in enumerate(zip(base[1:], default))]
    return markdown_table(["step", "ΔMFU, our assumptions"] + [f"moved by: {n}" for n in ASSUMPTIONS], rows)


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--figure", default=None, metavar="PNG")
    parser.add_argument("--sensitivity", action="store_true")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    results = cli.ablation(args.overrides)
    lay = results[0][2].layout
    print(f"Table 3 predicted, {results[0][1].model.name} on {lay.gpus} x {results[0][1].hardware.name}: each step's "
          f"ΔMFU (points) by the term it moves\n")
    print(waterfall_table(results))
    if args.figure:
        waterfall_figure(results, args.figure)
        print(f"\nfigure: {args.figure}")
    if args.sensitivity:
        print("\nEach step's ΔMFU (points) under perfmodel's assumptions, and how much another choice moves it\n")
        print(sensitivity_table(args.overrides))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
