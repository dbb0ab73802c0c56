"""The performance model's studies, their Markdown tables and its command line. The model itself is
perfmodel.py; this is a second file only to keep each under ~700 lines. Run it as perfmodel.py:

  python perfmodel.py ablation [scale=cluster|cpu] [overrides]   Table 3, predicted, paper beside it
  python perfmodel.py scaling [overrides]                        Table 2, both columns
  python perfmodel.py 530b                                       the 530B model, batch = GPUs
  python perfmodel.py plan model=175B gpus=1024 batch=768        layouts ranked by predicted MFU
  python perfmodel.py validate [--remeasure] [RUN_DIR ...]       cpu_local prediction vs measurement
  python perfmodel.py [predict] [overrides] [gpus=N] [batch=B]   one config, with its breakdown
  python perfmodel.py experiment=megascale_ablation scale=cluster   the same as `ablation`
"""
from __future__ import annotations

import copy
import csv
import json
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import config
import perfmodel as pm
from config import ConfigError
# Table 3's row names and the number formats: one definition, shared with the tables of measured runs.
from experiments.tables import ABLATION_LABELS, markdown_table, pct, seconds

# --- The paper's runs, as configs (the assumptions behind them: perfmodel.py's docstring) ---

MEGATRON = ["hardware=a100_cluster", "train.seq_len=2048", "parallel.tp=8", "parallel.zero_stage=1",
            "kernels.attention=reference", "kernels.fused=false", "data.pipeline=naive", "optim.name=adamw"]
LAYOUTS = {"175B": ["model=175B", "parallel.pp=8", "parallel.vpp=6"],     # Table 1
           "530B": ["model=530B", "parallel.pp=35", "parallel.vpp=3"]}

# The cumulative ablation of Table 3: (step, overrides on top of the previous step, batch multiplier).
# The step names come from experiments/tables.py, in the same order (strict zip: a step added there
# and not here, or the other way round, fails at import).
ABLATION_STEPS: List[Tuple[str, List[str], int]] = [(name, overrides, factor) for name, (overrides, factor) in zip(
    ABLATION_LABELS, [
        ([], 1),                                                                  # baseline (Megatron-LM)
        (["model.block=parallel"], 1),                                            # +PTB
        (["model.attention.window={window}", "kernels.attention=banded"], 1),     # +SWA
        (["parallel.overlap.tp=chunked"], 1),                                     # +TP overlap
        (["parallel.overlap.pp=true"], 1),                                        # +PP overlap
        (["parallel.overlap.dp=true", "parallel.zero_stage=2"], 1),               # +DP overlap
        (["kernels.fused=true", "kernels.attention=flash"], 1),                   # +efficient operators
        (["data.pipeline=megascale"], 1),                                         # +misc (data pipeline)
        (["optim.name=lamb"], 3),                                                 # +LAMB (batch x3)
    ], strict=True)]
# Table 2's MegaScale column: every switch but LAMB, which only comes with a larger batch (Table 2
# keeps the batch), and with flash attention rather than the banded kernel of the SWA step.
MEGASCALE = [o for _, step, _ in ABLATION_STEPS for o in step if o not in ("kernels.attention=banded", "optim.name=lamb")]
SCALES = {  # base overrides, GPUs, batch, micro-batch (None: keep parallel.microbatches)
    "cluster": (LAYOUTS["175B"] + MEGATRON, 256, 256, 1),
    "cpu": (["model=tiny", "hardware=cpu_local", "train.seq_len=256"], 1, 16, None),
}


def megascale(overrides: Sequence[str], seq_len: int = 2048) -> List[str]:
    """MegaScale's switches, with the SWA window at a quarter of the sequence (the paper gives none)."""
    return [o.format(window=seq_len // 4) for o in overrides]


def compose(overrides: Sequence[str]) -> config.Config:
    return config.compose(list(overrides))


def with_overrides(cfg: config.Config, overrides: Sequence[str]) -> config.Config:
    """cfg with key=value overrides merged (typed and checked like Hydra's, without recomposing)."""
    from omegaconf import OmegaConf
    if not overrides:
        return cfg
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cfg), OmegaConf.from_dotlist(list(overrides))))


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
    """Table 3: [(step, config, prediction)], each step on top of the previous one."""
    base, default_gpus, batch, micro_batch = SCALES[scale]
    gpus = gpus or default_gpus
    cfg = compose(base + [f"train.batch_size={batch}"] + list(overrides))  # the caller's overrides win
    cfg = with_batch(cfg, cfg.train.batch_size, gpus, micro_batch)
    hw = pm.resolve_hardware(cfg.hardware)
    results = []
    for name, step, factor in ABLATION_STEPS:
        cfg = with_overrides(cfg, [o.format(window=cfg.train.seq_len // 4) for o in step])
        if factor != 1:  # a larger batch of the same micro-batches: more of them per step
            cfg = copy.deepcopy(cfg)
            cfg.train.batch_size *= factor
            cfg.parallel.microbatches *= factor
        results.append((name, cfg, pm.predict(cfg, gpus, hw)))
    return results


def strong_scaling(overrides: Sequence[str] = ()):
    """Table 2: {setting: [(paper row, prediction)]} for the Megatron-LM and the MegaScale columns."""
    rows = read_csv("megascale_table2.csv")
    out = {}
    for setting, extra in (("Megatron-LM", []), ("MegaScale", megascale(MEGASCALE))):
        base = compose(LAYOUTS["175B"] + MEGATRON + extra + list(overrides))
        hw = pm.resolve_hardware(base.hardware)
        out[setting] = [(row, pm.predict(with_batch(base, int(row["batch"]), int(row["gpus"]), 1), int(row["gpus"]), hw))
                        for row in rows]
    return out


def predict_530b(gpu_counts: Sequence[int] = (2240, 4480, 11200), overrides: Sequence[str] = ()):
    """The 530B model of Table 1 at batch = GPUs: {setting: [(gpus, prediction)]}."""
    out = {}
    for setting, extra in (("Megatron-LM", []), ("MegaScale", megascale(MEGASCALE))):
        base = compose(LAYOUTS["530B"] + MEGATRON + extra + list(overrides))
        hw = pm.resolve_hardware(base.hardware)
        out[setting] = [(g, pm.predict(with_batch(base, g, g, 1), g, hw)) for g in gpu_counts]
    return out


def plan(cfg: config.Config, gpus: int, batch: int, micro_batch: int = 1, include_oom: bool = False):
    """Every valid (tp, pp, vpp, dp, zero) layout of cfg on `gpus` devices at a global batch, with
    cfg's technique switches, ranked by predicted MFU. Layouts that overflow memory are left out
    unless include_oom; TP stays inside a host."""
    hw = pm.resolve_hardware(cfg.hardware)
    m, L = cfg.model, cfg.model.n_layers
    tps = [t for t in (1, 2, 4, 8, 16) if t <= hw.devices_per_host and m.n_heads % t == 0]
    ranked = []
    for tp in tps:
        for pp in (p for p in range(1, L + 1) if L % p == 0 and gpus % (tp * p) == 0):
            dp = gpus // (tp * pp)
            if batch % (dp * micro_batch):
                continue
            microbatches = batch // (dp * micro_batch)
            for vpp in (v for v in range(1, 9) if (L // pp) % v == 0 and (v == 1 or (pp > 1 and microbatches % pp == 0))):
                for zero in (0, 1, 2):
                    c = copy.deepcopy(cfg)
                    c.parallel.tp, c.parallel.pp, c.parallel.vpp, c.parallel.dp = tp, pp, vpp, -1
                    c.parallel.zero_stage, c.parallel.microbatches, c.train.batch_size = zero, microbatches, batch
                    try:
                        pred = pm.predict(c, gpus, hw)
                    except ConfigError:
                        continue
                    if include_oom or pred.memory.fits:
                        ranked.append(pred)
    return sorted(ranked, key=lambda p: -p.mfu)


# --- Markdown tables of predictions (markdown_table, pct, seconds: experiments/tables.py) ---

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
        if paper_key:
            mfu = float(row[f"{paper_key}_mfu"])
            cells += [seconds(float(row[f"{paper_key}_iter_s"])), pct(mfu), pct(pred.mfu - mfu, True)]
        rows.append(cells)
    headers = ["GPUs", "batch", "step time", "tokens/s", "MFU", "scaling eff."]
    return markdown_table(headers + (["paper step", "paper MFU", "error (pts)"] if paper_key else []), rows)


def plan_table(ranked, top: int = 15) -> str:
    rows = [[i + 1, p.layout.tp, p.layout.pp, p.layout.vpp, p.layout.dp, p.layout.zero,
             f"{p.layout.micro_batch}x{p.layout.microbatches}", seconds(p.step_s), pct(p.mfu),
             pct(p.breakdown["bubble"] / p.step_s), f"{p.memory.total:.1f}" + ("" if p.memory.fits else " (OOM)")]
            for i, p in enumerate(ranked[:top])]
    return markdown_table(["#", "tp", "pp", "vpp", "dp", "zero", "micro-batch x m", "step time", "MFU",
                           "bubble", "memory GiB"], rows)


def breakdown_table(pred) -> str:
    rows = [[k, seconds(v), pct(v / pred.step_s)] for k, v in pred.breakdown.items() if v > 0]
    mem = pred.memory
    rows += [[f"memory: {k}", f"{getattr(mem, k):.2f} GiB", ""] for k in ("weights", "grads", "optimizer", "activations")]
    rows.append(["memory: total", f"{mem.total:.2f} GiB", "fits" if mem.fits else f"OVER {mem.capacity:.0f} GiB"])
    return markdown_table(["part", "per step", "share"], rows)


# --- Validation against this machine ---

def measure_tiny_step(batch: int = 16, seq: int = 256, repeats: int = 5) -> Dict[str, float]:
    """Seconds (best of `repeats`, like the hardware numbers) of the tiny model's forward+backward,
    and of a whole step with AdamW, bf16 autocast on this CPU: what cpu_local should predict."""
    import torch
    import kernels
    import model as gpt
    torch.manual_seed(0)
    cfg = gpt.ModelConfig()
    net = gpt.GPT(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, foreach=True)

    def forward_backward():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = kernels.cross_entropy(net(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()

    def step():
        forward_backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"forward_backward_s": pm._best_time(lambda: (forward_backward(), net.zero_grad()), repeats),
            "step_s": pm._best_time(step, repeats)}


def validate_cpu(remeasure: bool = False) -> Dict[str, float]:
    pm.local_measurements(remeasure)
    measured = measure_tiny_step()
    cfg = compose(SCALES["cpu"][0] + ["train.batch_size=16"])
    pred = pm.predict(cfg, 1)
    fb = pred.step_s - pred.breakdown["optimizer"] - pred.breakdown["data"]
    return {"measured_forward_backward_s": measured["forward_backward_s"], "predicted_forward_backward_s": fb,
            "forward_backward_error": fb / measured["forward_backward_s"] - 1,
            "measured_step_s": measured["step_s"], "predicted_step_s": pred.step_s,
            "step_error": pred.step_s / measured["step_s"] - 1}


STEP_TIME_KEYS = ("step_time_s", "step_time", "time_s", "dt_s", "dt")


def compare_with_runs(run_dirs: Sequence[str], hardware: str = "cpu_local", gpus: Optional[int] = None):
    """Predicted against measured step time of finished runs: each dir holds Hydra's
    .hydra/config.yaml and metrics.jsonl (one JSON object per step, with a step time under one of
    STEP_TIME_KEYS, and optionally `world_size`). The first fifth of the steps is skipped (warm-up,
    compilation). Returns [{run, measured_s, predicted_s, error}]."""
    from omegaconf import OmegaConf
    hw = compose([f"hardware={hardware}"]).hardware
    out = []
    for run in map(Path, run_dirs):
        schema = OmegaConf.structured(config.Config)
        cfg = OmegaConf.to_object(OmegaConf.merge(schema, OmegaConf.load(run / ".hydra" / "config.yaml")))
        cfg.hardware = hw
        lines = [json.loads(l) for l in open(run / "metrics.jsonl") if l.strip()]
        key = next((k for k in STEP_TIME_KEYS if any(k in l for l in lines)), None)
        if key is None:
            raise ValueError(f"{run}/metrics.jsonl has none of {STEP_TIME_KEYS}")
        times = [l[key] for l in lines if key in l]
        measured = statistics.median(times[len(times) // 5:])
        world = gpus or next((l["world_size"] for l in lines if "world_size" in l), None)
        predicted = pm.predict(cfg, world).step_s
        out.append({"run": str(run), "measured_s": measured, "predicted_s": predicted, "error": predicted / measured - 1})
    return out


# --- Command line ---

COMMANDS = ("predict", "ablation", "scaling", "530b", "plan", "validate")
OWN_KEYS = ("gpus", "batch", "micro_batch", "scale", "top", "experiment")


def parse(argv: Sequence[str]):
    command, own, overrides, flags = "predict", {}, [], set()
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
    experiment = own.pop("experiment", "")
    if experiment.startswith("megascale_ablation"):
        command = "ablation"
    elif experiment.startswith(("megascale_scaling", "strong_scaling")):
        command = "scaling"
    elif experiment:
        overrides.append(f"experiment={experiment}")
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
    if command == "ablation":
        scale = own.get("scale", "cluster")
        if scale not in SCALES:
            raise ConfigError("scale", f"unknown value {scale!r}", f"use one of: {', '.join(SCALES)}")
        results = ablation(overrides, scale, int(own["gpus"]) if "gpus" in own else None)
        lay = results[0][2].layout
        print(f"Table 3 ablation, predicted: {results[0][1].model.name} on {lay.gpus} x {results[0][1].hardware.name}, "
              f"batch {results[0][1].train.batch_size} (x3 at LAMB), seq {lay.seq}\n")
        print(ablation_table(results, paper_ablation() if scale == "cluster" and not overrides else None))
    elif command == "scaling":
        for setting, results in strong_scaling(overrides).items():
            key = "megatron" if setting == "Megatron-LM" else "megascale"
            print(f"\nTable 2 strong scaling, 175B, {setting} settings, predicted (paper beside)\n")
            print(scaling_table(results, None if overrides else key))
    elif command == "530b":
        for setting, results in predict_530b(overrides=overrides).items():
            print(f"\n530B (TP8 PP35 vpp3, seq 2048, batch = GPUs), {setting} settings, predicted\n")
            print(scaling_table([({"gpus": g, "batch": g}, p) for g, p in results], per_batch=False))
            print("memory per GPU: " + ", ".join(f"{p.memory.total:.1f} GiB" for _, p in results))
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
            ["tiny fwd+bwd (16x256, bf16)", seconds(result["measured_forward_backward_s"]),
             seconds(result["predicted_forward_backward_s"]), pct(result["forward_backward_error"], True) + "%"],
            ["tiny step with AdamW", seconds(result["measured_step_s"]), seconds(result["predicted_step_s"]),
             pct(result["step_error"], True) + "%"]]))
        for r in compare_with_runs(overrides) if overrides else []:
            print(f"{r['run']}: measured {seconds(r['measured_s'])}, predicted {seconds(r['predicted_s'])}, "
                  f"error {pct(r['error'], True)}%")
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
              f"dp {lay.dp}, zero {lay.zero}), batch {cfg.train.batch_size} x {lay.seq}: step {seconds(pred.step_s)}, "
              f"{pred.tokens_per_s:,.0f} tokens/s, MFU {pct(pred.mfu)}\n")
        print(breakdown_table(pred))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
