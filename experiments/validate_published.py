"""clustermodel/perfmodel.py against published, measured training runs (experiments/data/published_runs.csv).

Each row is a run as its source states it: model shape, GPUs, layout, recomputation, sequence
parallelism and the throughput it measured. The throughput is converted to the project's MFU
(model.flops_per_token: 6N + 12·L·h·T per token, over the GPU's dense bf16 peak) through the
source's own FLOP formula (published_mfu), the run is composed as a config train.py would take
(row_config), and the model predicts its MFU. A run the model cannot express (context parallelism,
FP8, ...) is not approximated: it is reported with one line naming the missing knob.

The rows' split (fit / held_out) is in the CSV, fixed before any error was looked at. Table 2 of
MegaScale is a source too: its Megatron-LM column is fit, its MegaScale column held out. A run
measured on a framework outside the project's family (Megatron-LM, MegaScale) is priced at that
framework's fitted overhead (framework_overhead: the fraction of the family's compute rates its
kernels reach, and of its link efficiencies its collectives and sends reach); the summary is given
over all rows and over the rows whose figures were checked against their source (the CSV's verified
column).

    python experiments/validate_published.py            # the table and its summary, per source and split (~1 min)
    python experiments/validate_published.py --csv      # the same rows as CSV
"""
from __future__ import annotations

import copy
import csv
import json
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import machine  # noqa: E402
import model as gpt  # noqa: E402
from clustermodel import cli  # noqa: E402
from clustermodel import perfmodel as pm  # noqa: E402
from metrics import markdown_table  # noqa: E402

CSV_FILE = pm.DATA_DIR / "published_runs.csv"
# Megatron-LM of 2021-22 as these sources ran it: materialized-softmax attention, its fused bias+GeLU,
# bias+dropout+add and LayerNorm kernels (Narayanan et al. 2021 §4.2), Adam, no DP or PP overlap.
MEGATRON_2021 = ["kernels.attention=unfused", "kernels.fused=true", "optim.name=adamw", "data.pipeline=naive",
                 "parallel.overlap.tp=off", "parallel.overlap.pp=false", "parallel.overlap.dp=false"]
MEGASCALE_TABLE2 = "jiang2024"
# The frameworks whose overhead the hardware constants carry (the project's own family): 1.0.
# Any other framework's runs are priced with two efficiencies fitted on its fit rows
# (experiments/fit_perfmodel.py, perfmodel_fit.json's framework_overhead), each scaling the rates of
# FRAMEWORK_RATES: what its kernels reach of ours (compute) and its collectives and sends
# (communication). Apart because a step bound by one prices the other's loss only where it shows:
# DeepSpeed's ZeRO-3 rows at 4 sequences a GPU are compute-bound and lose less than those at 1-2,
# which wait on the gathers (a single factor on the MFU left the former 4.5 points under).
OWN_FRAMEWORKS = ("megatron-lm", "megascale")
FRAMEWORK_RATES = {"compute": ("gemm_efficiency", "flash_efficiency", "memory_efficiency"),
                   "communication": ("intra_host_efficiency", "inter_host_efficiency", "p2p_efficiency")}
NO_OVERHEAD = {part: 1.0 for part in FRAMEWORK_RATES}
# Rows made expressible after the split rule's fit that stay held out whatever their place in table
# order: Meta's two Llama 3 405B runs, the only ones of their stack (a framework constant fitted on
# one would make the other's prediction its own fit).
HELD_OUT_AFTER_FIT = ("Llama 3 405B@8192", "Llama 3 405B@16384")
# What a framework outside Megatron-LM of 2021-22 runs differently, on top of MEGATRON_2021: ZeRO-3
# (DeepSpeed's, FSDP's) prefetches each module's gather behind the compute (parallel.overlap.dp);
# Meta's Llama 3 stack (arXiv 2407.21783 §3.3) overlaps DP and PP communication and runs flash attention.
FRAMEWORK_OVERRIDES = {
    "deepspeed": ["parallel.overlap.dp=true"],
    "metaseq": ["parallel.overlap.dp=true"],
    "meta-llama3": ["kernels.attention=flash", "parallel.overlap.dp=true", "parallel.overlap.pp=true"],
    # torchtitan's FSDP2 (docs/performance.md's runs): SDPA's flash kernel, each block's gather
    # prefetched behind the one before, eager PyTorch without torch.compile (no fused kernels).
    "torchtitan": ["kernels.attention=flash", "parallel.overlap.dp=true", "kernels.fused=false"],
}


class NotExpressible(Exception):
    """A published run that needs a knob the code does not have; its message is one line naming it."""


def read_rows(path: Path = CSV_FILE) -> List[Dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def megascale_table2_rows() -> List[Dict[str, str]]:
    """MegaScale's Table 2 as rows of this set: the Megatron-LM column fit, the MegaScale column held out."""
    rows = []
    for setting, key, split in (("Megatron-LM", "megatron", "fit"), ("MegaScale", "megascale", "held_out")):
        for row, _, gpus in cli.table2_configs(setting):
            rows.append({"source": MEGASCALE_TABLE2, "run": f"175B {setting}@{gpus}", "split": split,
                         "framework": "megatron-lm" if key == "megatron" else "megascale",
                         "verified": "unverified: megascale_table2.csv, the project's transcription, not re-checked "
                                     "against the paper in this pass",
                         "gpu": "A100-80GB", "measured": str(100 * float(row[f"{key}_mfu"])),
                         "measured_unit": "mfu_percent", "flop_formula": "project", "setting": setting,
                         "gpus": str(gpus), "batch": row["batch"], "not_expressible": "",
                         "citation": "Jiang et al., MegaScale, NSDI'24 (arXiv 2402.15627), Table 2"})
    return rows


def all_rows() -> List[Dict[str, str]]:
    return read_rows() + megascale_table2_rows()


# --- A row as a config ---

# Knobs a published run may need that the code does not have: (test on the row, the one line).
MISSING_KNOBS = [
    (lambda r: r.get("precision", "bf16") == "fp8", "FP8 GEMMs (precision=fp8) are not in the code"),
    (lambda r: recompute_overrides(r["recompute"]) is None,
     "the recomputation is not one the code has: none, selective, full, or full:N (the first N layers of each "
     "model chunk, train.recompute_layers=N) with N stated"),
    (lambda r: int(r["layers"]) % (int(r["pp"]) * int(r["vpp"])) and not r.get("pp_first_chunk_layers"),
     "uneven pipeline stages without their first and last chunks' layers stated (parallel.pp_first_chunk_layers, "
     "pp_last_chunk_layers)"),
    (lambda r: r["pp_scatter_gather"] == "false" and r["sequence_parallel"] == "true" and int(r["pp"]) > 1 and int(r["tp"]) > 1,
     "pipeline sends without the scatter/gather optimisation are not in the code under sequence parallelism "
     "(each rank sends its sequence shard; parallel.pp_scatter_gather=false sends whole messages only without SP)"),
]


def recompute_overrides(value: str) -> Optional[List[str]]:
    """The recompute column as overrides: none, selective or full; full:N, Megatron-LM's
    --recompute-method block --recompute-num-layers N (train.recompute_layers); None for anything
    else (a row that says it recomputed some layers without saying how many)."""
    if value in ("none", "selective", "full"):
        return [f"train.recompute={value}"]
    kind, _, layers = value.partition(":")
    if kind == "full" and layers.isdigit():
        return ["train.recompute=full", f"train.recompute_layers={int(layers)}"]
    return None


def missing_knob(row: Dict[str, str]) -> Optional[str]:
    """The one line naming what the code lacks to run this row as published, or None."""
    if row["source"] == MEGASCALE_TABLE2:
        return None
    for lacks, line in MISSING_KNOBS:
        if lacks(row):
            return line
    return row.get("not_expressible") or None


def row_config(row: Dict[str, str]):
    """The run as a config (and its GPU count); NotExpressible if the code cannot run it as published."""
    knob = missing_knob(row)
    if knob:
        raise NotExpressible(f"{row['source']} {row['run']}: {knob}")
    if row["source"] == MEGASCALE_TABLE2:
        for r, cfg, gpus in cli.table2_configs(row["setting"]):
            if gpus == int(row["gpus"]) and r["batch"] == row["batch"]:
                return cfg, gpus
    gpus, dp, mb, batch = (int(row[k]) for k in ("gpus", "dp", "micro_batch", "global_batch"))
    overrides = [f"model={row.get('model_config') or '175B'}", f"hardware={row['hardware']}", "precision=bf16",
                 *MEGATRON_2021, *FRAMEWORK_OVERRIDES.get(row["framework"], []),
                 f"model.n_layers={row['layers']}", f"model.d_model={row['hidden']}", f"model.n_heads={row['heads']}",
                 f"model.vocab_size={row['vocab']}", f"model.max_seq_len={row['seq']}", f"model.dropout={row['dropout']}",
                 f"train.seq_len={row['seq']}", f"train.batch_size={batch}", *recompute_overrides(row["recompute"]),
                 f"parallel.tp={row['tp']}", f"parallel.pp={row['pp']}", f"parallel.vpp={row['vpp']}", f"parallel.dp={dp}",
                 f"parallel.zero_stage={row['zero_stage']}", f"parallel.microbatches={batch // (dp * mb)}",
                 f"parallel.sequence_parallel={row['sequence_parallel']}", f"parallel.pp_scatter_gather={row['pp_scatter_gather']}",
                 f"parallel.reduce_dtype={row['grad_reduce']}",
                 f"hardware.perfmodel.inter_host_Gbps={row['inter_host_Gbps']}"]
    for key in ("pp_first_chunk_layers", "pp_last_chunk_layers", "reshard_after_forward"):  # (columns added later: empty in older rows)
        if row.get(key):
            overrides.append(f"parallel.{key}={row[key]}")
    return cli.compose(overrides), gpus


# --- The published figure in the project's MFU ---

def source_flops_per_sequence(row: Dict[str, str]) -> float:
    """FLOPs of one sequence's training step as the source counts them (the CSV's header)."""
    s, l, h, V = (float(row[k]) for k in ("seq", "layers", "hidden", "vocab"))
    if row["flop_formula"] == "megatron_recompute":
        return 96 * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    if row["flop_formula"] == "megatron_model":
        return 72 * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))
    raise ValueError(f"{row['run']}: unknown flop_formula {row['flop_formula']!r}")


def row_model(row: Dict[str, str]) -> gpt.ModelConfig:
    """The row's model as model.py builds it (GPT's block: LayerNorm, GeLU MLP, biases)."""
    return gpt.ModelConfig(name=row["run"], n_layers=int(row["layers"]), n_heads=int(row["heads"]),
                           d_model=int(row["hidden"]), vocab_size=int(row["vocab"]), max_seq_len=int(row["seq"]),
                           dropout=float(row["dropout"]))


def published_mfu(row: Dict[str, str], model: Optional[gpt.ModelConfig] = None) -> float:
    """The run's measured throughput as the project's MFU (a fraction): the sequences per second per
    GPU the source's figure implies, times model.flops_per_token's FLOPs a sequence, over the GPU's
    dense bf16 peak (machine.DEVICE_PEAK_TFLOPS). A figure in tokens a second per GPU is priced with
    `model` (the row's composed model: Llama's blocks are not GPT's)."""
    measured = float(row["measured"])
    if row["flop_formula"] in ("project", "source_mfu"):  # source_mfu: the source's own MFU, taken as the project's
        return measured / 100
    peak = machine.DEVICE_PEAK_TFLOPS[machine.gpu_key(row["gpu"])] * 1e12
    if row["measured_unit"] == "tokens_per_s_per_gpu":
        return measured * gpt.flops_per_token(model or row_config(row)[0].model, int(row["seq"])) / peak
    achieved = measured * 1e12 if row["measured_unit"] == "tflops_per_gpu" else measured / 100 * peak
    seq = int(row["seq"])
    return achieved / source_flops_per_sequence(row) * gpt.flops_per_token(row_model(row), seq) * seq / peak


# --- The table ---

def priced_rows(rows: List[Dict[str, str]]) -> List[Dict]:
    """Each row composed once: {row, cfg, gpus, hw (resolved), published} or {row, missing}."""
    out = []
    for row in rows:
        try:
            cfg, gpus = row_config(row)
        except NotExpressible as e:
            out.append({"row": row, "missing": str(e)})
            continue
        out.append({"row": row, "cfg": cfg, "gpus": gpus, "hw": pm.resolve_hardware(cfg.hardware),
                    "published": published_mfu(row, cfg.model)})
    return out


def verified(row: Dict[str, str]) -> bool:
    """Whether the row's figures were checked against its source (the CSV's verified column)."""
    return bool(row.get("verified")) and not row["verified"].startswith("unverified")


def framework_overhead(framework: str, fitted: Optional[Dict[str, Dict[str, float]]] = None) -> Dict[str, float]:
    """The fitted {compute, communication} efficiencies of a framework's runs relative to the project's
    own family (OWN_FRAMEWORKS: 1.0 each); 1.0 each for a framework no fit row was run on."""
    if framework in OWN_FRAMEWORKS:
        return dict(NO_OVERHEAD)
    if fitted is None:
        fitted = json.loads(pm.FIT_FILE.read_text()).get("framework_overhead", {}) if pm.FIT_FILE.exists() else {}
    return dict(fitted.get(framework, NO_OVERHEAD))


def predict_row(r: Dict, constants: Optional[Dict[str, float]] = None, overhead: Optional[Dict[str, float]] = None):
    """r's prediction, with constants ({key: value}) in place of its hardware's where given, and the
    rates of FRAMEWORK_RATES scaled by a framework's overhead ({compute, communication}) where given."""
    hw = r["hw"]
    if constants or overhead:
        hw = copy.deepcopy(hw)
        for key, value in (constants or {}).items():
            setattr(pm.owner(hw, key), key, value)
        for part, factor in (overhead or {}).items():
            for key in FRAMEWORK_RATES[part]:
                setattr(pm.owner(hw, key), key, getattr(pm.owner(hw, key), key) * factor)
            if part == "compute":  # measured GEMM shapes are the family's rates too
                hw.perfmodel.gemm_shapes = {shape: f * factor for shape, f in hw.perfmodel.gemm_shapes.items()}
    return pm.predict(r["cfg"], r["gpus"], hw)


def overhead_label(overhead: Dict[str, float]) -> str:
    return "1.0" if overhead == NO_OVERHEAD else f"{overhead['compute']:.2f} / {overhead['communication']:.2f}"


def validate(rows: List[Dict[str, str]]) -> List[Dict]:
    """Each row priced: {row, published, predicted, error (points), fits} or {row, missing}."""
    out = []
    for r in priced_rows(rows):
        if "missing" not in r:
            hardware_only = predict_row(r)
            overhead = framework_overhead(r["row"]["framework"])
            pred = predict_row(r, overhead=overhead) if overhead != NO_OVERHEAD else hardware_only
            r.update(hardware_predicted=hardware_only.mfu, framework_overhead=overhead, predicted=pred.mfu,
                     error=100 * (pred.mfu - r["published"]), fits=pred.memory.fits)
        out.append(r)
    return out


def summary(results: List[Dict]) -> List[list]:
    """Per source and split: rows, mean absolute error and the worst row (points)."""
    groups: Dict[tuple, List[Dict]] = {}
    for r in results:
        if "error" in r:
            groups.setdefault((r["row"]["source"], r["row"]["split"]), []).append(r)
            groups.setdefault(("all", r["row"]["split"]), []).append(r)
            if verified(r["row"]):
                groups.setdefault(("all, verified only", r["row"]["split"]), []).append(r)
    lines = []
    for (source, split), rs in sorted(groups.items(), key=lambda kv: (kv[0][0].startswith("all"), kv[0])):
        worst = max(rs, key=lambda r: abs(r["error"]))
        lines.append([source, split, len(rs), f"{statistics.mean(abs(r['error']) for r in rs):.2f}",
                      f"{worst['error']:+.1f} ({worst['row']['run']})"])
    return lines


def tables(results: List[Dict]) -> str:
    rows = [[r["row"]["source"], r["row"]["run"], r["row"]["split"], r["row"]["framework"],
             "yes" if verified(r["row"]) else "no", f"{100 * r['published']:.1f}%",
             f"{100 * r['hardware_predicted']:.1f}%", overhead_label(r["framework_overhead"]),
             f"{100 * r['predicted']:.1f}%", f"{r['error']:+.1f}",
             "" if r["fits"] else "over memory"]
            for r in results if "error" in r]
    priced = markdown_table(["source", "run", "split", "framework", "verified", "published MFU",
                             "hardware-only MFU", "framework overhead (compute / comm)", "predicted MFU", "error (pts)", "note"], rows)
    missing = "\n".join(f"- {r['missing']}" for r in results if "missing" in r)
    totals = markdown_table(["source", "split", "rows", "mean abs error (pts)", "worst row (pts)"], summary(results))
    return f"{priced}\n\n{totals}\n\nNot expressible:\n{missing}\n"


def main(argv: List[str]) -> int:
    results = validate(all_rows())
    if "--csv" in argv:
        w = csv.writer(sys.stdout)
        w.writerow(["source", "run", "split", "framework", "verified", "published_mfu", "hardware_predicted_mfu",
                    "framework_compute", "framework_communication", "predicted_mfu", "error_points", "missing"])
        for r in results:
            w.writerow([r["row"]["source"], r["row"]["run"], r["row"]["split"], r["row"]["framework"],
                        verified(r["row"]), r.get("published", ""), r.get("hardware_predicted", ""),
                        r.get("framework_overhead", {}).get("compute", ""),
                        r.get("framework_overhead", {}).get("communication", ""), r.get("predicted", ""), r.get("error", ""),
                        r.get("missing", "")])
    else:
        print(tables(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
