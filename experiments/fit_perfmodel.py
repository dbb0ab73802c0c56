"""Fit clustermodel/perfmodel.py's efficiency constants on the fit half of the validation rows, and nothing else.

The constants: gemm_efficiency (the fraction of the A100's 312 TFLOP/s a large bf16 GEMM reaches,
before its shape's losses: rates.gemm_time) and inter_host_efficiency (the fraction of a GPU's
200 Gb/s NIC that large collectives across hosts reach), the latter for each cluster apart: MegaScale's
(a100_cluster) and Selene (a100_selene), whose networks differ. The rows: those marked fit in
experiments/data/published_runs.csv (every second run of each source, chosen before any error was
looked at) and MegaScale's Table 2 Megatron-LM column (experiments/validate_published.py). The
objective is the mean absolute MFU error over them, ties broken by the largest; a coarse grid, then
a fine one around its best, again until the best stays. The hardware constants are fitted on the rows of the project's own
framework family only (Megatron-LM and MegaScale); each other framework with fit rows (DeepSpeed,
MT-NLG's Megatron-DeepSpeed) then gets its framework overhead on its own fit rows: the fraction of
the family's compute rates its kernels reach and of its link efficiencies its collectives reach
(validate_published.FRAMEWORK_RATES): two where its fit rows outnumber them, else one for both.
The held-out rows
(MegaScale's column of Table 2, Table 3, the other published runs) are what the model predicts.

    python experiments/fit_perfmodel.py            # writes experiments/data/perfmodel_fit.json (~1-2 min)
    python experiments/fit_perfmodel.py --table2   # the former fit: Table 2's Megatron-LM column alone, minimax
"""
from __future__ import annotations

import copy
import datetime
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from clustermodel import perfmodel as pm  # noqa: E402
from clustermodel import cli  # noqa: E402


def megatron_rows():
    """[(config, GPUs, paper MFU)] for the Megatron-LM column of Table 2: the strong_scaling study's
    rows with Megatron-LM's settings (clustermodel.cli.table2_configs), the paper's MFU beside."""
    rows = [(cfg, gpus, float(row["megatron_mfu"])) for row, cfg, gpus in cli.table2_configs("Megatron-LM")]
    return rows[0][0].hardware, rows


def errors(hw, rows, gemm: float, network: float):
    """Predicted minus paper MFU, per row, in MFU points."""
    hw = copy.deepcopy(hw)
    hw.perfmodel.gemm_efficiency, hw.perfmodel.inter_host_efficiency = gemm, network
    return [100 * (pm.predict(cfg, gpus, hw).mfu - mfu) for cfg, gpus, mfu in rows]


def score(errs):
    return max(abs(e) for e in errs), math.sqrt(sum(e * e for e in errs) / len(errs))


def grid(lo: float, hi: float, step: float):
    n = int(round((hi - lo) / step))
    return [lo + i * step for i in range(n + 1)]


def fit(hw, rows, coarse: float = 0.02, fine: float = 0.002):
    best = None
    for gemm_range, net_range, step in (((0.4, 1.0), (0.05, 1.0), coarse), (None, None, fine)):
        if gemm_range is None:  # refine around the coarse optimum
            g0, n0 = best[1]
            gemm_range, net_range = (max(0.4, g0 - coarse), min(1.0, g0 + coarse)), (max(0.05, n0 - coarse), min(1.0, n0 + coarse))
        for g in grid(*gemm_range, step):
            for n in grid(*net_range, step):
                s = score(errors(hw, rows, g, n))
                if best is None or s < best[0]:
                    best = (s, (g, n))
    (worst, rms), (g, n) = best
    return {"gemm_efficiency": round(g, 4), "inter_host_efficiency": round(n, 4)}, worst, rms


# --- The fit on the published runs' fit half ---

def published_fit_rows():
    """The fit split of experiments/validate_published.py's rows, composed once: (vp, the rows of the
    project's own framework family, which fit the hardware constants; the other frameworks' rows,
    which fit their framework's efficiency)."""
    from experiments import validate_published as vp
    rows = vp.priced_rows([r for r in vp.all_rows() if r["split"] == "fit" and not vp.missing_knob(r)])
    own = [r for r in rows if r["row"]["framework"] in vp.OWN_FRAMEWORKS]
    return vp, own, [r for r in rows if r["row"]["framework"] not in vp.OWN_FRAMEWORKS]


def framework_overheads(vp, rows, gemm: float, nets) -> dict:
    """Per framework outside the project's family: {compute, communication} minimising its fit rows'
    mean absolute error (then the largest, each to 0.01 point), on a grid refined twice; of equal
    fits the one nearest a single efficiency for both (rows that one part binds leave the other
    free). Two parts only where its fit rows outnumber them (DeepSpeed's three): with one or two,
    one efficiency for both, as two numbers would match two rows whatever their cause."""
    by_fw = {}
    for r in rows:
        by_fw.setdefault(r["row"]["framework"], []).append(r)
    out = {}
    for fw, rs in by_fw.items():
        def score(compute, comm):
            errs = [100 * (vp.predict_row(r, hardware_constants(r, gemm, nets), {"compute": compute, "communication": comm}).mfu
                           - r["published"]) for r in rs]
            mae, worst = published_score(errs)
            return round(mae, 2), round(worst, 2), round(abs(compute - comm), 4)
        step, best = 0.04, None
        for _ in range(3):  # the whole range, then twice finer around the best
            axis = lambda c: grid(0.02, 1.22, step) if best is None else grid(max(0.02, c - 10 * step), c + 10 * step, step)
            pairs = [(c, c) for c in axis(best and best[0])] if len(rs) <= 2 else \
                [(a, c) for a in axis(best and best[0]) for c in axis(best and best[1])]
            best = min(pairs, key=lambda pair: score(*pair))
            step /= 5
        out[fw] = {"compute": round(best[0], 4), "communication": round(best[1], 4)}
    return out


def hardware_constants(r, gemm: float, nets) -> dict:
    return {"gemm_efficiency": gemm, "inter_host_efficiency": nets.get(r["hw"].name, nets["a100_cluster"])}


def cluster_errors(vp, rows, gemm: float, network: float):
    return [100 * (vp.predict_row(r, {"gemm_efficiency": gemm, "inter_host_efficiency": network}).mfu - r["published"])
            for r in rows]


def published_score(errs):
    return sum(abs(e) for e in errs) / len(errs), max(abs(e) for e in errs)


def best_network(vp, rows, gemm: float, networks):
    """The network efficiency of one cluster's rows that minimises their summed absolute error."""
    return min((sum(abs(e) for e in cluster_errors(vp, rows, gemm, n)), n) for n in networks)


def fit_published(coarse: float = 0.02, fine: float = 0.005):
    """{gemm_efficiency, per cluster: inter_host_efficiency} minimising the fit rows' mean |error|."""
    vp, rows, others = published_fit_rows()
    clusters = {}
    for r in rows:
        clusters.setdefault(r["hw"].name, []).append(r)

    def evaluate(gemm, networks):
        picked = {name: best_network(vp, rs, gemm, networks) for name, rs in clusters.items()}
        total = sum(err for err, _ in picked.values()) / len(rows)
        return total, gemm, {name: n for name, (_, n) in picked.items()}
    best = min(evaluate(g, grid(0.2, 1.0, 2 * coarse)) for g in grid(0.6, 0.96, coarse))
    for _ in range(4):  # the fine grid around the best so far, again until it stays (a cluster's optimum moves with the GEMM's)
        g0, nets0 = best[1], best[2]
        fine_nets = sorted({x for n in nets0.values() for x in grid(max(0.1, n - 2 * coarse), min(1.0, n + 2 * coarse), fine)})
        best = min(evaluate(g, fine_nets) for g in grid(g0 - coarse, g0 + coarse, fine))
        if (best[1], best[2]) == (g0, nets0):
            break
    _, gemm, nets = best
    errs = {r["row"]["run"]: cluster_errors(vp, [r], gemm, nets[r["hw"].name])[0] for r in rows}
    frameworks = framework_overheads(vp, others, gemm, nets)
    for r in others:
        pred = vp.predict_row(r, hardware_constants(r, gemm, nets), frameworks[r["row"]["framework"]])
        errs[r["row"]["run"]] = 100 * (pred.mfu - r["published"])
    return gemm, nets, errs, frameworks


def main_published() -> None:
    gemm, nets, errs, frameworks = fit_published()
    mae, worst = published_score(list(errs.values()))
    result = {
        "constants": {"gemm_efficiency": round(gemm, 4), "inter_host_efficiency": round(nets["a100_cluster"], 4)},
        "per_hardware": {name: {"inter_host_efficiency": round(n, 4)} for name, n in nets.items() if name != "a100_cluster"},
        "framework_overhead": dict(sorted(frameworks.items())),
        "fitted_on": "the fit split of experiments/data/published_runs.csv and MegaScale Table 2's Megatron-LM "
                     f"column ({len(errs)} rows): the hardware constants on the rows of the project's framework family "
                     "(Megatron-LM, MegaScale), inter_host_efficiency per cluster; then per other framework, on its own fit "
                     "rows, the fraction of the family's compute and communication rates it reaches (framework_overhead; "
                     "two only where its fit rows outnumber them, else one for both)",
        "objective": "min over the grid of mean |predicted - published MFU| (points), then the largest",
        "mean_abs_error_points": round(mae, 3), "max_abs_error_points": round(worst, 3),
        "row_errors_points": {run: round(e, 2) for run, e in errs.items()},
        "command": "python experiments/fit_perfmodel.py",
        "date": datetime.date.today().isoformat(),
    }
    pm.FIT_FILE.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


def main() -> None:
    if "--table2" not in sys.argv[1:]:
        return main_published()
    hw, rows = megatron_rows()
    constants, worst, rms = fit(hw, rows)
    errs = errors(hw, rows, constants["gemm_efficiency"], constants["inter_host_efficiency"])
    result = {
        "constants": constants,
        "fitted_on": "MegaScale Table 2, Megatron-LM column (8 rows), hardware=a100_cluster",
        "objective": "min over the grid of max |predicted - paper MFU| (points), then RMS",
        "max_abs_error_points": round(worst, 3), "rms_error_points": round(rms, 3),
        "row_errors_points": {f"{cfg.train.batch_size}@{gpus}": round(e, 2) for (cfg, gpus, _), e in zip(rows, errs)},
        "command": "python experiments/fit_perfmodel.py",
        "date": datetime.date.today().isoformat(),
    }
    pm.FIT_FILE.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
