"""The performance model's studies, their Markdown tables and its command line (the model itself is
perfmodel.py). Run it from the repository's root:

  python -m clustermodel experiment=megascale_ablation scale=cluster|cpu [overrides]
        Table 3 predicted, each step composed from conf/experiment/megascale_ablation.yaml as
        train.py composes it (ablation.step=K); at cluster scale the paper's column beside it
  python -m clustermodel experiment=strong_scaling scale=cluster|cpu [overrides]
        Table 2 predicted, rows from conf/study_scale/strong_scaling_<scale>.yaml; at cluster scale
        the Megatron-LM and MegaScale columns with the paper's beside them
  python -m clustermodel ablation | scaling [scale=...]             the same two, by name
  python -m clustermodel 530b [--rehearse]                          the 530B model, batch = GPUs (--rehearse: its
        first and last stage at 2,240 GPUs through the rehearsal first, so memory per GPU is the rehearsal's)
  python -m clustermodel plan scale=cluster gpus=1024 batch=768     layouts ranked by predicted MFU (scale=cluster:
        175B at seq 2048 in bf16 on a100_cluster; without it the embedded defaults, seq 256)
  python -m clustermodel validate [--remeasure] [--analytical-only] [--figure=PNG] [RUN_OR_SWEEP_DIR ...]
        cpu_local prediction vs measured runs: analytical, and each run's rehearsal replayed (replay.py)
  python -m clustermodel [predict] [overrides] [gpus=N] [batch=B]   one config, with its breakdown
"""
from __future__ import annotations

import copy
import csv
import functools
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import config
import machine
import model as gpt
from clustermodel import perfmodel as pm
from clustermodel import replay
from clustermodel.schema import PerfModelHardware
from errors import ConfigError
# Table 3's row names and the number formats: one definition, shared with the tables of measured runs.
from config import ABLATION_LABELS
from metrics import markdown_table, pct, seconds

# --- The paper's runs, as configs (the assumptions behind them: perfmodel.py's docstring) ---
#
# The studies are the ones train.py runs: Table 3's steps are composed from
# conf/experiment/megascale_ablation.yaml (each switch written ${ablation:K,on,off} there, and
# nowhere else), Table 2's rows from conf/study_scale/strong_scaling_<scale>.yaml. Only what the
# paper's Megatron-LM baseline runs with, and the layouts of Table 1, are stated here.

ABLATION = "experiment=megascale_ablation"
SCALING = "experiment=strong_scaling"
# Table 2's MegaScale column: every switch of Table 3 but LAMB, whose step also triples the batch
# (Table 2 keeps the same batch for both columns).
MEGASCALE_STEP = 7
# Megatron-LM at the paper's commit, beside the study's layout: materialized-softmax core
# attention, unfused LayerNorm/GeLU/cross-entropy, the naive loader, Adam, the distributed
# optimizer (ZeRO-1), no overlap switch on; sequence parallelism (parallel.py's TP always) without
# recomputation, as Table 3's baseline (conf/experiment/megascale_ablation.yaml says why).
MEGATRON = ["kernels.attention=unfused", "kernels.fused=false", "data.pipeline=naive", "optim.name=adamw",
            "parallel.zero_stage=1", "train.recompute=none"]
LAYOUTS = {"175B": ["model=175B", "parallel=megascale_175B"],     # Table 1 (conf/parallel/)
           "530B": ["model=530B", "parallel=megascale_530B"]}
# conf/scale/cpu.yaml leaves the machine to hardware=auto; at CPU scale the model predicts the
# measured one, unless the command line names another.
SCALE_DEFAULTS = {"cluster": [], "cpu": ["hardware=cpu_local"]}


def compose(overrides: Sequence[str]) -> config.Config:
    return config.compose(list(overrides))


def study_config(overrides: Sequence[str], scale: str, extra: Sequence[str] = ()) -> config.Config:
    """A study's config at a scale: overrides, the scale's defaults (unless the command line's
    `extra` sets the same key), then extra, which wins."""
    keys = {o.split("=", 1)[0] for o in extra}
    defaults = [d for d in SCALE_DEFAULTS.get(scale, []) if d.split("=", 1)[0] not in keys]
    return compose(list(overrides) + [f"scale={scale}"] + defaults + list(extra))


def megatron_config(model: str = "175B", overrides: Sequence[str] = ()) -> config.Config:
    """The Megatron-LM baseline of Table 2 (the fit's column) at the paper's scale."""
    return study_config(LAYOUTS[model] + MEGATRON, "cluster", overrides)


def megascale_config(model: str = "175B", overrides: Sequence[str] = ()) -> config.Config:
    """MegaScale's setting of Table 2: the ablation's step MEGASCALE_STEP, DP from the GPU count."""
    return study_config([ABLATION, f"ablation.step={MEGASCALE_STEP}"] + LAYOUTS[model] + ["parallel.dp=-1"],
                        "cluster", overrides)


def with_batch(cfg: config.Config, batch: int, gpus: int, micro_batch: Optional[int]) -> config.Config:
    """cfg at a global batch; with micro_batch set, the microbatch count follows from the DP size."""
    cfg = copy.deepcopy(cfg)
    cfg.train.batch_size = batch
    if micro_batch:
        dp = gpus // (cfg.parallel.tp * cfg.parallel.pp)
        cfg.parallel.microbatches = max(1, batch // (dp * micro_batch))
    return cfg


def read_csv(name: str) -> List[Dict[str, str]]:
    with open(pm.DATA_DIR / name) as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


# --- Studies ---

def ablation(overrides: Sequence[str] = (), scale: str = "cluster", gpus: Optional[int] = None):
    """Table 3: [(step label, config, prediction)], each step composed as train.py composes
    `experiment=megascale_ablation scale=<scale> ablation.step=K`, the caller's overrides last.
    GPUs: the study's layout (tp * pp * dp) unless given."""
    results = []
    for step, label in enumerate(ABLATION_LABELS):
        cfg = study_config([ABLATION, f"ablation.step={step}"], scale, overrides)
        if cfg.study.pending:  # as the run records it: the switch has not landed, the step trains nothing
            label += " (pending)"
        results.append((label, cfg, pm.predict(cfg, gpus)))
    return results


def scaling_rows(scale: str = "cluster") -> List[Dict]:
    """Table 2's rows as the strong_scaling study lists them, with the paper's numbers (at cluster
    scale, experiments/data/megascale_table2.csv) joined on (GPUs, batch)."""
    rows = [dict(r) for r in compose([SCALING, f"scale={scale}"]).scaling.rows]
    paper = {(int(r["gpus"]), int(r["batch"])): r for r in read_csv("megascale_table2.csv")} if scale == "cluster" else {}
    for row in rows:
        row.update(paper.get((int(row["gpus"]), int(row["batch"])), {}))
    return rows


def table2_configs(setting: str, scale: str = "cluster", overrides: Sequence[str] = ()):
    """[(row, config, GPUs)] of one column of Table 2 (Megatron-LM, MegaScale, or at CPU scale the
    study as configured). Cached: compose takes ~0.4 s; callers must not modify the configs."""
    return _table2_configs(setting, scale, tuple(overrides))


@functools.lru_cache(maxsize=None)
def _table2_configs(setting: str, scale: str, overrides: Tuple[str, ...]):
    out = []
    for i, row in enumerate(scaling_rows(scale)):
        if setting == "MegaScale":
            at_row = [f"train.batch_size={row['batch']}", f"parallel.microbatches={row['microbatches']}"]
            cfg = megascale_config("175B", at_row + list(overrides))
        else:
            base = [SCALING, f"scaling.row={i}"] + (LAYOUTS["175B"] + MEGATRON if setting == "Megatron-LM" else [])
            cfg = study_config(base, scale, overrides)
        out.append((row, cfg, int(row["gpus"])))
    return out


def strong_scaling(overrides: Sequence[str] = (), scale: str = "cluster"):
    """Table 2: {setting: [(row, prediction)]}: the Megatron-LM and the MegaScale columns at cluster
    scale, the study as configured at CPU scale."""
    settings = ("Megatron-LM", "MegaScale") if scale == "cluster" else ("as configured",)
    return {setting: [(row, pm.predict(cfg, gpus)) for row, cfg, gpus in table2_configs(setting, scale, overrides)]
            for setting in settings}


def settings_530b(first_gpus: int = 2240, overrides: Sequence[str] = ()) -> Dict[str, config.Config]:
    """The 530B model of Table 1, both columns: {setting: config}. A setting whose activations
    overflow the GPU runs with selective recomputation, as Megatron-LM's users turn it on
    (--recompute-activations, Korthikanti et al. 2022): at 530B its materialized attention,
    dropout masks included, needs ~92 GiB without it. The setting's name then says so."""
    out = {}
    for setting, base in (("Megatron-LM", megatron_config("530B", overrides)),
                          ("MegaScale", megascale_config("530B", overrides))):
        hw = pm.resolve_hardware(base.hardware)
        if base.train.recompute == "none" and not pm.predict(with_batch(base, first_gpus, first_gpus, 1),
                                                               first_gpus, hw).memory.fits:
            base = copy.deepcopy(base)
            base.train.recompute = "selective"
        out[setting + (" + selective recompute" if base.train.recompute == "selective" else "")] = base
    return out


def predict_530b(gpu_counts: Sequence[int] = (2240, 4480, 11200), overrides: Sequence[str] = ()):
    """The 530B model at batch = GPUs, each setting of settings_530b: {setting: [(gpus, prediction)]}.
    Memory per GPU is the rehearsal's where one is remembered (rehearse_530b), else modelled."""
    out = {}
    for setting, base in settings_530b(gpu_counts[0], overrides).items():
        hw = pm.resolve_hardware(base.hardware)
        out[setting] = [(g, pm.predict(with_batch(base, g, g, 1), g, hw)) for g in gpu_counts]
    return out


def rehearse_530b(gpu_counts: Sequence[int] = (2240,), overrides: Sequence[str] = ()) -> None:
    """Rehearses the first and the last pipeline stage (one rank each, the fullest under 1F1B and
    the one with the head) of each 530B setting at each GPU count, unless remembered: then
    predict_530b's memory is the rehearsal's. ~3 minutes a rank here (2 cores), 4 ranks in all."""
    from clustermodel import rehearsal
    import tempfile
    for base in settings_530b(gpu_counts[0], overrides).values():
        hw = pm.resolve_hardware(base.hardware)
        for g in gpu_counts:
            cfg = pm.resolve_config(with_batch(base, g, g, 1), hw)  # the key predict() looks it up by
            stages = replay.stage_ranks(cfg, g)
            missing = [r for r in (stages[0], stages[-1]) if r not in rehearsal.remembered(cfg, g)]
            with tempfile.TemporaryDirectory() as out:
                records = [rehearsal.rehearse_rank(cfg, r, g, Path(out)) for r in missing]
            broken = [f"rank {rec['rank']}: {rec.get('crash') or rec['violations'][0]}" for rec in records
                      if rec.get("crash") or rec["violations"]]
            if broken:
                raise RuntimeError(f"the 530B rehearsal at {g} GPUs failed: {broken[0]}")
            rehearsal.remember(cfg, g, records)


def plan(cfg: config.Config, gpus: int, batch: int, micro_batch: int = 1, include_oom: bool = False):
    """Every valid (tp, pp, vpp, dp, zero, dp_shard, reshard, reduce_each) layout of cfg on `gpus`
    devices at a global batch, with cfg's technique switches, ranked by predicted MFU: ZeRO stages
    0-3, hybrid sharding over each power-of-two shard group below dp (ZeRO 1-3), ZeRO-3 with and
    without resharding after forward, ZeRO 2/3 without a pipeline reducing each microbatch or not. Layouts that overflow memory are left out unless include_oom; TP
    stays inside a host; chunks are even, or where pp*vpp does not divide the layers, the first
    and last chunk short (uneven_ends: Llama 3's split)."""
    hw = pm.resolve_hardware(cfg.hardware)
    m, L = cfg.model, cfg.model.n_layers
    tps = [t for t in (1, 2, 4, 8, 16) if t <= hw.perfmodel.devices_per_host and m.n_heads % t == 0
           and gpt.kv_heads(m) % t == 0]   # a TP rank holds whole KV heads (parallel.validate)
    ranked = []
    for tp in tps:
        for pp in (p for p in range(1, L + 1) if gpus % (tp * p) == 0):
            dp = gpus // (tp * pp)
            if batch % (dp * micro_batch):
                continue
            microbatches = batch // (dp * micro_batch)
            for vpp in (v for v in range(1, 9) if (v == 1 or (pp > 1 and microbatches % pp == 0))):
                ends = uneven_ends(L, pp * vpp)
                if ends is None:
                    continue
                for zero, shard, reshard, each in sharding_choices(dp, reduce_each=pp == 1 and microbatches > 1):
                    c = copy.deepcopy(cfg)
                    c.parallel.pp_first_chunk_layers = c.parallel.pp_last_chunk_layers = ends
                    c.parallel.tp, c.parallel.pp, c.parallel.vpp, c.parallel.dp = tp, pp, vpp, -1
                    c.parallel.zero_stage, c.parallel.microbatches, c.train.batch_size = zero, microbatches, batch
                    c.parallel.dp_shard, c.parallel.reshard_after_forward = shard, reshard
                    c.parallel.reduce_each_microbatch = each
                    try:
                        pred = pm.predict(c, gpus, hw)
                    except ConfigError:
                        continue
                    if include_oom or pred.memory.fits:
                        ranked.append(pred)
    return sorted(ranked, key=lambda p: -p.mfu)


def uneven_ends(layers: int, chunks: int) -> Optional[int]:
    """The layers of the first and of the last model chunk a plan tries: -1 (even) where `chunks`
    divides `layers`; else each of the two short by the same count, the others holding
    ceil(layers/chunks) (126 layers in 16 chunks: 7 and 7 around fourteen of 8; in 128: 0 and 0,
    Llama 3 405B's two readings); None where no such split exists."""
    if layers % chunks == 0:
        return -1
    each = -(-layers // chunks)
    rest = layers - (chunks - 2) * each
    return rest // 2 if chunks > 2 and 0 <= rest < 2 * each and rest % 2 == 0 else None


def sharding_choices(dp: int, reduce_each: bool = False) -> List[Tuple[int, int, bool, bool]]:
    """(zero stage, dp_shard, reshard_after_forward, reduce_each_microbatch) a plan tries at `dp`:
    stages 0-2 over all of dp, then hybrid shard groups (powers of two below dp) for stages 1-3,
    ZeRO-3 with and without resharding; with reduce_each (no pipeline, several microbatches)
    every stage 2-3 choice reducing each microbatch as well."""
    shards = [-1] + [1 << k for k in range(1, dp.bit_length()) if (1 << k) < dp and dp % (1 << k) == 0]
    out = [(zero, -1, True) for zero in (0, 1, 2)]
    out += [(zero, s, True) for zero in (1, 2) for s in shards[1:]]
    out += [(3, s, reshard) for s in shards for reshard in (True, False)]
    return [c + (False,) for c in out] + [c + (True,) for c in out if reduce_each and c[0] >= 2]


def sharding_note(lay) -> str:
    """What the layout shards beyond its ZeRO stage, for a heading: nothing where it is the default."""
    return ((f", dp_shard {lay.shard}" if lay.shard < lay.dp and lay.zero else "")
            + (", no reshard" if lay.zero == 3 and not lay.reshard else "")
            + (", reduced each microbatch" if lay.reduce_each else "")
            + (f", chunks {'/'.join(map(str, lay.chunks))}" if lay.chunks and len(lay.chunks) <= 8 else ""))


# --- Markdown tables of predictions (markdown_table, pct, seconds: metrics.py) ---

def ablation_table(results, paper: Optional[Dict[str, str]] = None) -> str:
    """Columns: step, MFU, ΔMFU vs the previous step, tokens/s, step time, exposed comm, paper MFU."""
    rows, previous = [], None
    for i, (name, _, pred) in enumerate(results):
        known = (paper or {}).get(str(i), "")
        rows.append([name, pct(pred.mfu), "" if previous is None else pct(pred.mfu - previous, True),
                     f"{pred.tokens_per_s:,.0f}", seconds(pred.step_s), seconds(pred.exposed_comm_s), known])
        previous = pred.mfu
    return markdown_table(["step", "MFU", "ΔMFU", "tokens/s", "step time", "exposed comm", "paper MFU"], rows)


def paper_ablation() -> Dict[str, str]:
    return {r["step"]: ("~" if r["approx"] == "1" else "") + pct(float(r["paper_mfu"]))
            for r in read_csv("megascale_table3.csv") if r["paper_mfu"]}


def scaling_table(results, paper_key: Optional[str] = None, per_batch: bool = True) -> str:
    """Columns: GPUs, batch, step time, tokens/s, MFU, scaling efficiency (per-GPU throughput against
    the first run of the same batch, or of the table when per_batch is off), and the paper's step
    time, MFU and our error beside them."""
    rows, first = [], {}
    for row, pred in results:
        gpus, batch = int(row["gpus"]), int(row["batch"])
        per_gpu = pred.tokens_per_s / gpus
        base = first.setdefault(batch if per_batch else None, per_gpu)
        cells = [gpus, batch, seconds(pred.step_s), f"{pred.tokens_per_s:,.0f}", pct(pred.mfu), pct(per_gpu / base)]
        if paper_key and row.get(f"{paper_key}_mfu"):
            mfu = float(row[f"{paper_key}_mfu"])
            cells += [seconds(float(row[f"{paper_key}_iter_s"])), pct(mfu), pct(pred.mfu - mfu, True)]
        elif paper_key:  # a row the paper does not have
            cells += ["", "", ""]
        rows.append(cells)
    headers = ["GPUs", "batch", "step time", "tokens/s", "MFU", "scaling eff."]
    return markdown_table(headers + (["paper step", "paper MFU", "error (pts)"] if paper_key else []), rows)


def plan_table(ranked, top: int = 15) -> str:
    rows = [[i + 1, p.layout.tp, p.layout.pp, p.layout.vpp, p.layout.dp,
             f"{p.layout.zero}{' (each)' if p.layout.reduce_each else ''}", p.layout.shard,
             ("yes" if p.layout.reshard else "no") if p.layout.zero == 3 else "",
             f"{p.layout.micro_batch}x{p.layout.microbatches}", seconds(p.step_s), pct(p.mfu),
             pct(p.breakdown["bubble"] / p.step_s), f"{p.memory.total:.1f}" + ("" if p.memory.fits else " (OOM)")]
            for i, p in enumerate(ranked[:top])]
    return markdown_table(["#", "tp", "pp", "vpp", "dp", "zero", "dp_shard", "reshard", "micro-batch x m", "step time", "MFU",
                           "bubble", "memory GiB"], rows)


def breakdown_table(pred) -> str:
    rows = [[k, seconds(v), pct(v / pred.step_s)] for k, v in pred.breakdown.items() if v > 0]
    mem = pred.memory
    rows += [[f"memory: {k}", f"{getattr(mem, k):.2f} GiB", ""] for k in ("weights", "grads", "optimizer", "activations")]
    verdict = "fits" if mem.fits else f"OVER {mem.capacity:g} GiB"
    rows.append([f"memory: total ({'rehearsed' if mem.source == 'rehearsal' else 'modelled'})", f"{mem.total:.2f} GiB", verdict])
    return markdown_table(["part", "per step", "share"], rows)


# --- Validation against this machine ---

def measure_tiny_step(batch: int = 16, seq: int = 256, repeats: int = 5, precision: str = "bf16") -> Dict[str, float]:
    """Seconds (median of `repeats`, like the hardware numbers) of the tiny model's forward+backward,
    and of a whole step with AdamW, in `precision` (bf16: autocast) on this CPU: what cpu_local
    should predict."""
    import torch
    import kernels
    import model as gpt
    torch.manual_seed(0)
    cfg = gpt.ModelConfig()
    net = gpt.GPT(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, foreach=True)

    def forward_backward():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = kernels.cross_entropy(net(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()

    def step():
        forward_backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"forward_backward_s": machine.typical_time(lambda: (forward_backward(), net.zero_grad()), repeats),
            "step_s": machine.typical_time(step, repeats)}


VALIDATE = ["model=tiny", "hardware=cpu_local", "train.seq_len=256", "train.batch_size=16"]


def validate_cpu(remeasure: bool = False) -> Dict[str, float]:
    """The tiny model's step on one rank of this CPU, measured and predicted, in the precision a run
    here would take (precision=auto: fp32 where bf16 matmuls are emulated)."""
    machine.local_measurements(remeasure)
    cfg = compose(VALIDATE)
    hw = pm.resolve_hardware(cfg.hardware)
    precision = pm.resolve_config(cfg, hw).precision
    measured = measure_tiny_step(precision=precision)
    pred = pm.predict(cfg, 1, hw)
    fb = pred.step_s - pred.breakdown["optimizer"] - pred.breakdown["data"]
    return {"precision": precision,"measured_forward_backward_s": measured["forward_backward_s"], "predicted_forward_backward_s": fb,
            "forward_backward_error": fb / measured["forward_backward_s"] - 1,
            "measured_step_s": measured["step_s"], "predicted_step_s": pred.step_s,
            "step_error": pred.step_s / measured["step_s"] - 1}


STEP_TIME_KEYS = ("step_time_s", "step_time", "time_s", "dt_s", "dt")


def runs_in(paths: Sequence[str]) -> List[Path]:
    """Each path a run directory (it holds Hydra's .hydra/config.yaml) or a multirun sweep
    directory, which stands for its job directories in job order."""
    runs = []
    for path in map(Path, paths):
        if (path / ".hydra" / "config.yaml").exists():
            runs.append(path)
            continue
        jobs = sorted((d for d in path.glob("*") if (d / ".hydra" / "config.yaml").exists()),
                      key=lambda d: (len(d.name), d.name))
        if not jobs:
            raise ConfigError("validate", f"{path} holds no run (no .hydra/config.yaml in it or its subfolders)",
                              "give a run directory or a multirun sweep directory")
        runs += jobs
    return runs


def fabric_hardware(cfg: config.Config, fabric: str) -> Optional[config.HardwareConfig]:
    """The emulated cluster a run ran on, with today's calibration of its link: the hardware its
    config names (bench_overlap.py passes conf/hardware/emulated_*), or the fabric emucluster.py
    recorded (run.json's study.fabric = emulated:<hosts>x<ranks>@<rate>, as make demo's runs have it)."""
    h = cfg.hardware
    if h.name.startswith("emulated"):
        per_host, gbps = h.perfmodel.devices_per_host, h.perfmodel.inter_host_Gbps
    elif fabric.startswith("emulated:"):
        shape, rate = fabric.split(":", 1)[1].split("@")
        if "/" in rate:
            raise ConfigError("study.fabric", f"{fabric}: links of several rates", "validate runs on one rate")
        per_host = int(shape.split("x")[1])
        gbps = float(rate.removesuffix("mbit")) / 1000 if rate.endswith("mbit") else float(rate.removesuffix("gbit"))
    else:
        return None
    return compose([EMULATED, f"hardware.perfmodel.devices_per_host={per_host}",
                    f"hardware.perfmodel.inter_host_Gbps={gbps}"]).hardware


def measured_beside(hw: config.HardwareConfig, run: Path) -> Tuple[config.HardwareConfig, Optional[float]]:
    """hw with this machine's numbers as measured beside the run (machine.calibrate_beside: before
    and after it, averaged) where it has them, else as cached; and how far the fp32 GEMM peak
    moved from before to after (None: no calibration beside)."""
    taken = machine.calibration_beside(run)
    if taken is None:
        return hw, None
    hw = copy.deepcopy(hw)
    for key in pm.MEASURED + pm.MEASURED_FP32:
        values = [m[key] for m in taken.values() if key in m]
        if getattr(pm.owner(hw, key), key) is None and values:
            setattr(pm.owner(hw, key), key, sum(values) / len(values))
    peak = {when: m["peak_tflops_fp32"] for when, m in taken.items()}
    return hw, peak["after"] / peak["before"] - 1 if len(peak) == 2 else 0.0


def run_config(run: Path) -> config.Config:
    """The config a run ran with (Hydra's <run>/.hydra/config.yaml) on the schema. A file that names
    the performance model's hardware keys at hardware's top level (the layout of runs recorded
    before the hardware.perfmodel group) has them moved into the group."""
    from omegaconf import OmegaConf
    config.register()  # a study's saved config keeps its ${ablation:...} interpolations
    saved = OmegaConf.load(run / ".hydra" / "config.yaml")
    hardware = saved.get("hardware") or {}
    flat = [k for k in list(hardware) if k in PerfModelHardware.__dataclass_fields__]
    if flat:
        rates = {k: hardware.pop(k) for k in flat}
        hardware["perfmodel"] = OmegaConf.merge(hardware.get("perfmodel") or {}, rates)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(config.Config), saved))


EMULATED = "hardware=emulated_2x2_250mbit"  # this machine as an emulated cluster; shape and rate are overrides


def compare_with_runs(run_dirs: Sequence[str], hardware: str = "cpu_local", gpus: Optional[int] = None,
                      replayed: bool = True):
    """Predicted against measured step time of finished runs (run or sweep directories, runs_in):
    each run holds Hydra's .hydra/config.yaml and metrics.jsonl (one JSON object per step, with a
    step time under one of STEP_TIME_KEYS), and its world size in run.json (train.py's record) or
    in the metrics (else the config's layout). The first fifth of the
    steps is skipped (warm-up, compilation). A run on the emulated cluster is priced on that
    cluster (fabric_hardware), the others on `hardware`; either with this machine as measured
    beside the run where it was (measured_beside). With `replayed`, each run is also rehearsed (once: <run>/rehearsal/)
    and its program replayed (replay.py). Returns [{run, label, measured_s, predicted_s, error,
    measured: {comm_s, bubble_s, compute_s}, replayed: {step_s, ...}, replay_error}]."""
    hw = compose([f"hardware={hardware}"]).hardware
    out = []
    for run in runs_in(run_dirs):
        cfg = run_config(run)
        record = json.loads((run / "run.json").read_text()) if (run / "run.json").exists() else {}
        fabric = record.get("study", {}).get("fabric") or "loopback"  # as it ran (config.yaml has the env's interpolation)
        cfg.hardware, drift = measured_beside(fabric_hardware(cfg, fabric) or hw, run)
        lines = [json.loads(l) for l in open(run / "metrics.jsonl") if l.strip()]
        key = next((k for k in STEP_TIME_KEYS if any(k in l for l in lines)), None)
        if key is None:
            raise ValueError(f"{run}/metrics.jsonl has none of {STEP_TIME_KEYS}")
        times = [l[key] for l in lines if key in l]
        measured = statistics.median(times[len(times) // 5:])
        steady = lines[len(lines) // 5:]
        world = gpus or record.get("world_size") or next((l["world_size"] for l in lines if "world_size" in l), None)
        resolved = pm.resolve_hardware(cfg.hardware)
        ranks = world or cfg.parallel.tp * cfg.parallel.pp * max(cfg.parallel.dp, 1)
        records = replay.rehearse(cfg, resolved, ranks, run / "rehearsal") if replayed else None
        if records and resolved.device == "cpu":  # both models price its GEMMs at their measured speed
            resolved.perfmodel.gemm_shapes = measured_gemm_shapes(records, ranks)
        predicted = pm.predict(cfg, world, resolved).step_s
        label = cfg.study.label if cfg.study.name else run.name
        row = {"run": str(run), "label": label, "measured_s": measured, "predicted_s": predicted,
               "error": predicted / measured - 1, "calibration_drift": drift,
               "measured": {term: statistics.median(l[logged] for l in steady if logged in l)
                            for term, logged in MEASURED_TERMS.items() if any(logged in l for l in steady)}}
        if records:  # the code's own program: its rehearsal (kept in the run dir), replayed
            row["replayed"] = replay.predict(records, cfg, resolved, ranks)
            row["replay_error"] = row["replayed"]["step_s"] / measured - 1
        out.append(row)
    return out


def measured_gemm_shapes(records: List[dict], world: int) -> Dict[str, float]:
    """The GEMM shapes of a run's rehearsal, each measured on this CPU as the run's ranks run it
    (machine.gemm_shape_efficiency): one thread a rank when ranks share the machine (torchrun's
    and emucluster's OMP_NUM_THREADS=1), all of them for one process."""
    import torch
    shapes = {(M, N, K, e) for rec in records for ev in rec["comm"] for M, N, K, e, _ in ev["work"].get("gemm", ())}
    table = {}
    for elem in {e for *_, e in shapes}:
        dtype = {4: torch.float32, 2: torch.bfloat16}[elem]
        threads = 1 if world > 1 else (os.cpu_count() or 1)
        table.update(machine.gemm_shape_efficiency([s[:3] for s in shapes if s[3] == elem], dtype, threads))
    return table


MEASURED_TERMS = {"comm_s": "exposed_comm_s", "bubble_s": "bubble_s", "compute_s": "compute_s"}  # train.py's keys


def validation_table(rows: List[Dict]) -> str:
    """Measured against analytical and replayed, run by run, with the replay's split of the step."""
    split = lambda d: " / ".join(f"{d[k]:.2f}" if k in d else "-" for k in MEASURED_TERMS)
    return markdown_table(
        ["run", "measured step", "analytical", "error", "replayed", "error",
         "measured comm / bubble / compute (s)", "replayed comm / bubble / compute (s)", "calibration"],
        [[r["label"], seconds(r["measured_s"]), seconds(r["predicted_s"]), pct(r["error"], True) + "%",
          seconds(r["replayed"]["step_s"]) if "replayed" in r else "-",
          pct(r["replay_error"], True) + "%" if "replayed" in r else "-",
          split(r["measured"]), split(r["replayed"]) if "replayed" in r else "-",
          "cached" if r["calibration_drift"] is None else f"beside (GEMM peak {100 * r['calibration_drift']:+.0f}% over the run)"]
         for r in rows])


VALIDATION_LOG = pm.ROOT / "experiments" / "results" / "perfmodel_validation.jsonl"  # appended, never overwritten


def append_validation(rows: List[Dict]) -> None:
    import datetime
    import metrics
    stamp = {"when": datetime.datetime.now().isoformat(timespec="seconds"), "git": metrics.git_commit(),
             "cpu": machine.cpu_model()}
    VALIDATION_LOG.parent.mkdir(parents=True, exist_ok=True)
    with VALIDATION_LOG.open("a") as f:
        for row in rows:
            f.write(json.dumps({**stamp, **row}) + "\n")


def error_summary(rows: List[Dict], key: str) -> str:
    errors = sorted(abs(r[key]) for r in rows if key in r)
    return f"median |error| {100 * statistics.median(errors):.1f}%, worst {100 * errors[-1]:.1f}%" if errors else "none"


def validation_figure(rows: List[Dict], path: str) -> None:
    """Predicted against measured step time, both models, on log axes, with y = x and the ±10%
    band; runs outside ±20% are named."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 6))
    replayed = [r for r in rows if "replayed" in r]
    values = [r["measured_s"] for r in rows] + [r["predicted_s"] for r in rows] + [r["replayed"]["step_s"] for r in replayed]
    line = [0.8 * min(values), 1.25 * max(values)]
    ax.plot(line, line, color="black", lw=1, label="y = x")
    ax.fill_between(line, [0.9 * x for x in line], [1.1 * x for x in line], color="grey", alpha=0.25, label="±10%")
    ax.scatter([r["measured_s"] for r in rows], [r["predicted_s"] for r in rows], marker="o", s=18,
               label="analytical (perfmodel.py)")
    ax.scatter([r["measured_s"] for r in replayed], [r["replayed"]["step_s"] for r in replayed], marker="x", s=22,
               label="replayed rehearsal (replay.py)")
    for r in replayed:
        if abs(r["replay_error"]) > 0.2:
            ax.annotate(r["label"], (r["measured_s"], r["replayed"]["step_s"]), fontsize=5, alpha=0.7)
    ax.set(xscale="log", yscale="log", xlim=line, ylim=line, xlabel="measured step (s)", ylabel="predicted step (s)",
           title=f"python -m clustermodel validate: {len(rows)} runs (named: replayed error > 20%)")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=150)


# --- Command line ---

COMMANDS = ("predict", "ablation", "scaling", "530b", "plan", "validate")
OWN_KEYS = ("gpus", "batch", "micro_batch", "scale", "top", "experiment")
SCALE_NAMES = ("cluster", "cpu")  # conf/scale/


def parse(argv: Sequence[str]):
    command, own, overrides, flags = None, {}, [], set()
    for arg in argv:
        key = arg.split("=", 1)[0]
        if arg in COMMANDS:
            command = arg
        elif arg.startswith("--"):
            flags.add(arg)
        elif "=" in arg and key in OWN_KEYS:
            own[key] = arg.split("=", 1)[1]
        else:
            overrides.append(arg)
    # Without a command, experiment=megascale_ablation and experiment=strong_scaling name the
    # studies; otherwise the experiment, and scale=, go to the config of predict and plan (so
    # `predict experiment=megascale_ablation scale=cluster ablation.step=3` is one step, broken down).
    experiment = own.pop("experiment", "")
    studies = {"megascale_ablation": "ablation", "strong_scaling": "scaling"}
    if command is None and experiment in studies:
        command = studies[experiment]
    elif experiment and command not in studies.values():
        overrides.append(f"experiment={experiment}")
    command = command or "predict"
    if command not in ("ablation", "scaling") and "scale" in own:  # with the studies' defaults at that scale
        scale, keys = own.pop("scale"), {o.split("=", 1)[0] for o in overrides}
        overrides += [f"scale={scale}"] + [d for d in SCALE_DEFAULTS.get(scale, []) if d.split("=", 1)[0] not in keys]
    return command, own, overrides, flags


def main(argv: Sequence[str]) -> int:
    if "--help" in argv or "-h" in argv:
        print(__doc__.split("\n\n", 1)[1].strip())
        return 0
    command, own, overrides, flags = parse(argv)
    try:
        return run(command, own, overrides, flags)
    except ConfigError as err:
        print(err, file=sys.stderr)
    except Exception as err:  # a Hydra composition error: one line, like train.py's
        if type(err).__module__.split(".")[0] not in ("hydra", "omegaconf"):
            raise
        print(config.describe_composition_error(err), file=sys.stderr)
    return 2


def run(command: str, own: Dict[str, str], overrides: List[str], flags: set) -> int:
    scale = own.get("scale", "cluster")
    if command in ("ablation", "scaling") and scale not in SCALE_NAMES:
        raise ConfigError("scale", f"unknown value {scale!r}", f"use one of: {', '.join(SCALE_NAMES)}")
    picked = {"ablation": "ablation.step", "scaling": "scaling.row"}.get(command)
    if picked and any(o.split("=", 1)[0].lstrip("+~") == picked for o in overrides):
        raise ConfigError(picked, f"the {command} study predicts every one", f"leave it out, or use `python -m clustermodel "
                          f"predict experiment={'megascale_ablation' if command == 'ablation' else 'strong_scaling'} "
                          f"scale={scale} {picked}=K` for one, broken down")
    if command == "ablation":
        results = ablation(overrides, scale, int(own["gpus"]) if "gpus" in own else None)
        (_, first, pred), (_, last, _) = results[0], results[-1]
        lay = pred.layout
        print(f"Table 3 ablation (experiment=megascale_ablation scale={scale}), predicted: {first.model.name} on "
              f"{lay.gpus} x {first.hardware.name}, batch {first.train.batch_size} ({last.train.batch_size} at the "
              f"last step), seq {lay.seq}\n")
        print(ablation_table(results, paper_ablation() if scale == "cluster" and not overrides else None))
    elif command == "scaling":
        for setting, results in strong_scaling(overrides, scale).items():
            key = {"Megatron-LM": "megatron", "MegaScale": "megascale"}.get(setting)
            print(f"\nTable 2 strong scaling (experiment=strong_scaling scale={scale}), {setting} settings, predicted"
                  + (" (paper beside)" if key and not overrides else "") + "\n")
            print(scaling_table(results, None if overrides else key))
    elif command == "530b":
        if "--rehearse" in flags:
            rehearse_530b(overrides=overrides)
        for setting, results in predict_530b(overrides=overrides).items():
            print(f"\n530B (TP8 PP35 vpp3, seq 2048, batch = GPUs), {setting} settings, predicted\n")
            print(scaling_table([({"gpus": g, "batch": g}, p) for g, p in results], per_batch=False))
            print("memory per GPU: " + ", ".join(f"{p.memory.total:.1f} GiB ({'rehearsed' if p.memory.source == 'rehearsal' else 'modelled'})"
                                                 for _, p in results))
    elif command == "plan":
        cfg = compose(overrides + (["hardware=a100_cluster"] if not any(o.startswith("hardware=") for o in overrides) else []))
        gpus, batch = int(own.get("gpus", 256)), int(own.get("batch", cfg.train.batch_size))
        ranked = plan(cfg, gpus, batch, int(own.get("micro_batch", 1)), "--all" in flags)
        print(f"{cfg.model.name} on {gpus} x {cfg.hardware.name}, batch {batch}, seq {cfg.train.seq_len}: "
              f"{len(ranked)} layouts{'' if '--all' in flags else ' that fit in memory'}, best first\n")
        print(plan_table(ranked, int(own.get("top", 15))))
    elif command == "validate":
        result = validate_cpu("--remeasure" in flags)
        print(markdown_table(["quantity", "measured", "predicted", "error"], [
            [f"tiny fwd+bwd (16x256, {result['precision']})", seconds(result["measured_forward_backward_s"]),
             seconds(result["predicted_forward_backward_s"]), pct(result["forward_backward_error"], True) + "%"],
            ["tiny step with AdamW", seconds(result["measured_step_s"]), seconds(result["predicted_step_s"]),
             pct(result["step_error"], True) + "%"]]))
        if overrides:
            rows = compare_with_runs(overrides, replayed="--analytical-only" not in flags)
            print("\n" + validation_table(rows))
            print(f"\n{len(rows)} runs. Analytical: {error_summary(rows, 'error')}. "
                  f"Replayed: {error_summary(rows, 'replay_error')}.")
            host = sorted({round(r["replayed"]["host_s"] * 1e3, 2) for r in rows if "replayed" in r} - {0.0})
            print(f"Replayed with each collective or send costing the host {' or '.join(map(str, host))} ms beside "
                  f"compute (calibrate_comm.py --sharing)." if host else "Replayed with no host cost per collective: "
                  "on a CPU, run `python experiments/calibrate_comm.py --sharing` (a few times) to measure it.")
            append_validation(rows)
            print(f"appended to {VALIDATION_LOG.relative_to(pm.ROOT)}")
            figure = next((f.split("=", 1)[1] for f in flags if f.startswith("--figure=")), None)
            if figure:
                validation_figure(rows, figure)
                print(f"figure: {figure}")
    else:
        cfg = compose(overrides)
        gpus = int(own["gpus"]) if "gpus" in own else None
        if "batch" in own or "micro_batch" in own:
            gpus = gpus or cfg.parallel.tp * cfg.parallel.pp * max(cfg.parallel.dp, 1)
            mb = int(own["micro_batch"]) if "micro_batch" in own else None
            cfg = with_batch(cfg, int(own.get("batch", cfg.train.batch_size)), gpus, mb)
        pred = pm.predict(cfg, gpus)
        lay = pred.layout
        print(f"{cfg.model.name} on {lay.gpus} x {cfg.hardware.name} (tp {lay.tp}, pp {lay.pp}, vpp {lay.vpp}, "
              f"dp {lay.dp}, zero {lay.zero}{sharding_note(lay)}), batch {cfg.train.batch_size} x {lay.seq}: step {seconds(pred.step_s)}, "
              f"{pred.tokens_per_s:,.0f} tokens/s, MFU {pct(pred.mfu)}\n")
        print(breakdown_table(pred))
    return 0
