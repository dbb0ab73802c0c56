"""What a run measures and where it goes: throughput, MFU, memory; metrics.jsonl, run.json, W&B.

metrics.jsonl (one JSON object per step) and run.json are the source of truth for every table the
project prints. W&B is only a sink: a run never fails because W&B is unreachable.
"""
from __future__ import annotations

import json
import logging
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import torch

log = logging.getLogger(__name__)

# Dense bf16 peak TFLOP/s per device (vendor datasheets, no sparsity). Matched by substring of the
# CUDA device name, longest key first, so "H100" does not shadow "H100 PCIe".
DEVICE_PEAK_TFLOPS = {
    "A100": 312.0, "A800": 312.0, "H100 PCIe": 756.0, "H100": 989.0, "H800": 989.0, "H200": 989.0,
    "GH200": 989.0, "B200": 2250.0, "L40S": 362.0, "L4": 121.0, "A10G": 125.0, "A10": 125.0,
    "V100": 125.0, "MI300X": 1307.0, "MI250X": 383.0,
}


def cache_dir() -> Path:
    path = Path(os.environ.get("MEGAREPRO_CACHE", Path.home() / ".cache" / "megarepro"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def peak_tflops(device: torch.device, dtype: torch.dtype, override: Optional[float] = None) -> tuple[float, str]:
    """Peak FLOP/s per device that MFU divides by, and where the number came from."""
    if override:
        return float(override), "config"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key in sorted(DEVICE_PEAK_TFLOPS, key=len, reverse=True):
            if key in name:
                scale = 1.0 if dtype == torch.bfloat16 else 0.5  # TF32 tensor cores run at half the bf16 rate
                return DEVICE_PEAK_TFLOPS[key] * scale, f"table:{key}"
        log.warning("unknown GPU %r: set hardware.peak_tflops for a meaningful MFU", name)
        return float("nan"), "unknown"
    return measured_cpu_peak(dtype), "measured"


def measured_cpu_peak(dtype: torch.dtype, max_size: int = 2048, reps: int = 5) -> float:
    """A CPU has no datasheet peak that torch reaches, so MFU on CPU divides by the best matmul
    rate measured on this machine at this thread count. The size grows until one matmul takes
    ~50 ms, which bounds the cost (well under a second) even where a dtype is emulated (bf16
    without AVX512-BF16/AMX runs ~1000x slower than fp32). Shared machines are noisy, and a peak
    measured under load would inflate MFU forever, so every run measures again and the cache keeps
    the best rate seen on this machine."""
    key = f"{platform.node()}|{_cpu_model()}|{torch.get_num_threads()}t|{dtype}|torch{torch.__version__}"
    path = cache_dir() / "cpu_peak.json"
    known = json.loads(path.read_text()) if path.exists() else {}
    size, best = 128, 0.0
    while True:
        a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
        a @ b  # warm-up
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t0)
        best = max(best, 2 * size**3 / min(times) / 1e12)
        if size >= max_size or min(times) > 0.05:
            break
        size *= 2
    if best > known.get(key, 0.0):
        known[key] = best
        _atomic_write(path, json.dumps(known, indent=1))
    return known[key]


def resolve_precision(precision: str, device: torch.device) -> str:
    """precision=auto: bf16 on CUDA, and on a CPU only where bf16 matmuls are not slower than fp32
    (AVX512-BF16 or AMX). On an AVX2-only CPU bf16 is emulated and ~1000x slower, so fp32 it is."""
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bf16"
    return "bf16" if measured_cpu_peak(torch.bfloat16) >= measured_cpu_peak(torch.float32) else "fp32"


def _cpu_model() -> str:
    try:
        return next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def memory_gib(device: torch.device) -> float:
    """Peak memory: max allocated on CUDA; peak resident set size of the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is in KiB on Linux


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


def _atomic_write(path: Path, text: str) -> None:
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
        self.record = self._load_previous() | record
        self.record.setdefault("attempts", []).append({"started": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                                       "started_unix": time.time(), "status": "running"})
        self._write_record()
        self.wandb = _start_wandb(wandb_cfg, self.run_dir, record)

    def _load_previous(self) -> dict:
        path = self.run_dir / "run.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def _write_record(self) -> None:
        _atomic_write(self.run_dir / "run.json", json.dumps(self.record, indent=2, default=str))

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
                self.wandb.log({k: v for k, v in metrics.items() if k != "step"}, step=metrics["step"])
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
