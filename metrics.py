"""What a run measures and where it goes: throughput, MFU, memory; metrics.jsonl, run.json, W&B.

metrics.jsonl (one JSON object per step) and run.json are the source of truth for every table the
project prints. W&B is only a sink: a run never fails because W&B is unreachable.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import torch
from omegaconf import OmegaConf

log = logging.getLogger(__name__)

def memory_gib(device: torch.device) -> float:
    """Peak memory: max allocated on CUDA; peak resident set size of the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is in KiB on Linux


def memory_reserved(device: torch.device) -> dict:
    """On CUDA, the caching allocator's peak reservation beside memory_gib's peak allocation: their
    difference is its fragmentation, what conf/hardware's memory_headroom_gib must allow for.
    Nothing on CPU, where there is no such allocator (run.json says n/a)."""
    if device.type != "cuda":
        return {}
    return {"memory_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30}


def dynamo_counters() -> dict:
    """What torch.compile made of the run, for run.json: graph breaks (each reason's first line and
    its count), recompiles (each guard that failed), frames and graphs compiled. A break or a
    recompile in the step is where compiled code runs slower, or holds other memory, than traced."""
    import torch._dynamo
    counters = torch._dynamo.utils.counters
    breaks = {}
    for reason, n in counters["graph_break"].items():
        key = reason.strip().splitlines()[0][:200]
        breaks[key] = breaks.get(key, 0) + n
    recompiles = [m.recompile_reason.strip().splitlines()[0][:200] for m in torch._dynamo.utils.get_compilation_metrics()
                  if getattr(m, "recompile_reason", None)]
    return {"graph_breaks": sum(breaks.values()), "graph_break_reasons": breaks, "recompiles": len(recompiles),
            "recompile_reasons": recompiles[:20], "frames": counters["frames"]["ok"],
            "unique_graphs": counters["stats"]["unique_graphs"]}


class StepMeter:
    """Turns a step's wall time into tokens/s, TFLOP/s per device and MFU (PaLM/MegaScale formula)."""

    def __init__(self, tokens_per_step: int, flops_per_token: float, world: int, peak: float):
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self.world, self.peak = world, peak

    def __call__(self, step_time: float) -> dict:
        tokens_per_s = self.tokens_per_step / step_time
        tflops = tokens_per_s * self.flops_per_token / self.world / 1e12
        return {"step_time": step_time, "tokens_per_s": tokens_per_s,
                "tflops_per_device": tflops, "mfu": tflops / self.peak}


def atomic_write(path: Path, text: str) -> None:
    """Write to a temporary file, then rename: a reader or a crash never sees half a file."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def git_commit() -> Optional[str]:
    try:
        here = Path(__file__).resolve().parent
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def versions() -> dict:
    import importlib.metadata as md
    found = {"python": sys.version.split()[0], "torch": torch.__version__}
    for pkg in ("hydra-core", "wandb", "datasets", "tokenizers", "transformers", "numpy"):
        try:
            found[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return found


class RunLog:
    """Rank 0's record of a run: metrics.jsonl (appended, never overwritten: a resumed run adds to it),
    run.json (config, provenance, one entry per attempt, final metrics) and the W&B sink."""

    def __init__(self, run_dir: Path, record: dict, wandb_cfg, enabled: bool = True):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.wandb = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        if _ends_mid_line(self.run_dir / "metrics.jsonl"):  # a crash mid-write: this run's rows start on a line of their own
            self.jsonl.write("\n")
        self.record = self._load_previous() | record
        self.record.setdefault("attempts", []).append({"started": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                                       "started_unix": time.time(), "status": "running"})
        self._write_record()
        self.wandb = _start_wandb(wandb_cfg, self.run_dir, record)

    def _load_previous(self) -> dict:
        path = self.run_dir / "run.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def _write_record(self) -> None:
        atomic_write(self.run_dir / "run.json", json.dumps(self.record, indent=2, default=str))

    def update(self, **fields) -> None:
        if self.enabled:
            self.record.update(fields)
            self._write_record()

    def step(self, metrics: dict) -> None:
        if not self.enabled:
            return
        # a restarted run logs again the steps after its checkpoint: "attempt" tells the copies apart
        self.jsonl.write(json.dumps({**metrics, "attempt": len(self.record["attempts"]) - 1}) + "\n")
        if self.wandb is not None:
            try:
                self.wandb.log({k: v for k, v in metrics.items() if k != "step" and not _records(v)},
                               step=metrics["step"])
            except Exception as err:  # a sink must never stop training
                log.warning("W&B logging failed, continuing without it: %s", err)
                self.wandb = None

    def finish(self, status: str, final: dict) -> None:
        if not self.enabled:
            return
        self.record["attempts"][-1].update(status=status, ended=time.strftime("%Y-%m-%dT%H:%M:%S"))
        self.record.update(status=status, final=final)
        self._write_record()
        self.jsonl.close()
        if self.wandb is not None:
            try:
                self.wandb.summary.update(final)
                self.wandb.finish()
            except Exception as err:
                log.warning("W&B finish failed: %s", err)


def record_pending(cfg, run_dir: Path, world_size: int) -> None:
    """A study row whose switch has not landed yet (ablation.pending): its run.json says so, so the
    table shows "pending" in its place, and no process trains or joins a process group. Rank 0
    writes it (torchrun's RANK, else srun's SLURM_PROCID)."""
    if int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0))) != 0:
        return
    record = {"config": OmegaConf.to_container(OmegaConf.structured(cfg)), "git": git_commit(),
              "study": dataclasses.asdict(cfg.study), "world_size": world_size}
    run_log = RunLog(run_dir, record, dataclasses.replace(cfg.logging.wandb, mode="disabled"))
    run_log.finish("pending", {})
    print(f"pending: {cfg.study.label} (step {cfg.study.step}) has no switch yet; recorded in {run_dir}", flush=True)


def _ends_mid_line(path: Path) -> bool:
    with open(path, "rb") as f:
        if f.seek(0, os.SEEK_END) == 0:
            return False
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"


def _start_wandb(cfg, run_dir: Path, record: dict):
    if cfg.mode == "disabled":
        return None
    try:
        import wandb
        return wandb.init(mode=cfg.mode, project=cfg.project, entity=cfg.entity, group=cfg.group,
                          name=cfg.name, tags=list(cfg.tags), dir=str(run_dir), config=record.get("config"),
                          settings=wandb.Settings(silent=True, init_timeout=60))
    except Exception as err:
        log.warning("W&B unavailable (%s); metrics.jsonl still has everything", str(err).splitlines()[0][:200])
        return None


# --- A run's figures: each step's breakdown, the final metrics, the last line ---

def breakdown(timing: dict) -> dict:
    """Where this rank's step went (overlap.WaitClock): the compute stream blocked on collectives
    and sends (exposed communication), blocked on pipeline receives or on the slowest rank (bubble
    or idle), and its own work (compute, including the optimizer and the data loader's share)."""
    return {"exposed_comm_s": timing["comm_s"], "bubble_s": timing["bubble_s"], "compute_s": timing["compute_s"]}


def summarize(history: list, step: int) -> dict:
    """Final metrics: the last loss, and throughput as the median over steps after the first few
    (the first steps pay for warm-up and allocation, and the median is robust to a noisy machine)."""
    if not history:
        return {"steps": step}
    timed = history[min(3, len(history) - 1):]
    median = lambda key: sorted(r[key] for r in timed)[len(timed) // 2]
    final = {"steps": step, "loss": history[-1]["loss"], "first_loss": history[0]["loss"],
             "tokens_per_s": median("tokens_per_s"), "step_time": median("step_time"),
             "tflops_per_device": median("tflops_per_device"), "mfu": median("mfu"),
             "exposed_comm_s": median("exposed_comm_s"), "bubble_s": median("bubble_s"),
             "compute_s": median("compute_s"),
             "memory_gib": history[-1]["memory_gib"],
             "memory_reserved_gib": history[-1].get("memory_reserved_gib", "n/a")}  # n/a: no caching allocator (CPU)
    vals = [r["val_loss"] for r in history if "val_loss" in r]
    if vals:
        final["val_loss"] = vals[-1]
    return final


def final_line(final: dict, cfg) -> str:
    if "loss" not in final:
        return f"done: nothing to do (already at step {final['steps']} of {cfg.train.max_steps})"
    val = f" | val loss {final['val_loss']:.3f}" if "val_loss" in final else ""
    return (f"done: {final['steps']} steps | loss {final['first_loss']:.3f} -> {final['loss']:.3f}{val} | "
            f"{final['tokens_per_s']:,.0f} tokens/s | {final['tflops_per_device']:.3f} TFLOP/s per device | "
            f"MFU {100 * final['mfu']:.1f}%")


def _records(value) -> bool:
    """A list of dicts (metrics.jsonl's straggler verdicts): W&B gets their scalars instead."""
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict)


# --- Figures as tables show them (experiments/tables.py's studies, clustermodel/cli.py's predictions) ---

def markdown_table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    lines = ["| " + " | ".join(map(str, headers)) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return "\n".join(lines)


def pct(x: Optional[float], signed: bool = False) -> str:
    return "" if x is None else (f"{100 * x:+.1f}" if signed else f"{100 * x:.1f}%")


def seconds(x: float) -> str:
    return f"{x:.3g} s" if x < 10 else f"{x:.1f} s"
