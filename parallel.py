"""Parallelism, applied from outside to the plain model of model.py (torchtitan-style).

This file owns the process group set-up (env:// under torchrun or srun, device and backend
detection), the device mesh, and the functions that shard the model.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist


@dataclass
class OverlapConfig:
    tp: str = "off"          # off | chunked | domino
    tp_chunks: int = 2
    pp: bool = False
    dp: bool = False


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    vpp: int = 1             # virtual pipeline stages per rank (interleaved 1F1B when > 1)
    dp: int = -1             # -1: whatever the world size leaves, world / (tp * pp)
    zero_stage: int = 0      # 0: replicated optimizer | 1: sharded optimizer state | 2: + sharded grads
    microbatches: int = 1    # per optimizer step and DP rank: pipeline microbatches, or accumulation
    order: str = "dp,pp,tp"  # mesh dims, outermost first: TP innermost = consecutive ranks = one host
    reduce_dtype: str = "fp32"
    overlap: OverlapConfig = field(default_factory=OverlapConfig)


def data_parallel_size(cfg: ParallelConfig, world: int) -> int:
    return cfg.dp if cfg.dp > 0 else max(1, world // (cfg.tp * cfg.pp))


def validate(cfg, world: int) -> None:
    """Layout checks against the model, batch and world size; each failure is one ConfigError."""
    from config import ConfigError
    p, m, t = cfg.parallel, cfg.model, cfg.train
    for key in ("tp", "pp", "vpp", "microbatches"):
        if getattr(p, key) < 1:
            raise ConfigError(f"parallel.{key}", f"{getattr(p, key)} < 1", "use a positive degree")
    dp = data_parallel_size(p, world)
    if p.tp * p.pp * dp != world:
        raise ConfigError("parallel", f"tp*pp*dp = {p.tp}*{p.pp}*{dp} = {p.tp * p.pp * dp} but the world size is {world}",
                          "launch tp*pp*dp processes, or set parallel.dp=-1 to derive dp from the world size")
    if sorted(p.order.split(",")) != ["dp", "pp", "tp"]:
        raise ConfigError("parallel.order", f"{p.order!r} is not an order of dp, pp, tp",
                          "use a comma-separated order of dp,pp,tp, outermost first")
    if p.zero_stage not in (0, 1, 2):
        raise ConfigError("parallel.zero_stage", f"{p.zero_stage}", "use 0, 1 or 2")
    if p.reduce_dtype not in ("fp32", "bf16"):
        raise ConfigError("parallel.reduce_dtype", f"{p.reduce_dtype!r}", "use fp32 or bf16")
    if m.n_heads % p.tp or m.d_model % p.tp or m.vocab_size % p.tp:
        raise ConfigError("parallel.tp", f"tp={p.tp} must divide model.n_heads={m.n_heads}, d_model={m.d_model} "
                          f"and vocab_size={m.vocab_size}", "choose tp that divides all three")
    if p.tp > 1 and t.seq_len % p.tp:
        raise ConfigError("train.seq_len", f"sequence parallelism splits seq_len={t.seq_len} over tp={p.tp}",
                          "use a seq_len divisible by parallel.tp")
    if m.n_layers % (p.pp * p.vpp):
        raise ConfigError("parallel.pp", f"pp*vpp={p.pp * p.vpp} does not divide model.n_layers={m.n_layers}",
                          "choose pp and vpp whose product divides the layer count")
    if t.batch_size % (dp * p.microbatches):
        raise ConfigError("train.batch_size", f"{t.batch_size} is not divisible by dp*microbatches={dp}*{p.microbatches}",
                          "use a global batch that is a multiple of dp*parallel.microbatches")
    if p.overlap.tp not in ("off", "chunked", "domino"):
        raise ConfigError("parallel.overlap.tp", f"unknown value {p.overlap.tp!r}", "use off, chunked or domino")
    unimplemented = [(k, v) for k, v in (("parallel.tp", p.tp > 1), ("parallel.pp", p.pp > 1),
                                          ("parallel.vpp", p.vpp > 1), ("parallel.zero_stage", p.zero_stage > 0),
                                          ("parallel.overlap.tp", p.overlap.tp != "off"),
                                          ("parallel.overlap.pp", p.overlap.pp), ("parallel.overlap.dp", p.overlap.dp))
                     if v and k not in IMPLEMENTED]
    if unimplemented:
        key = unimplemented[0][0]
        raise ConfigError(key, "not implemented yet in this version", f"leave {key} at its default")


# Switches whose code has landed; validate() refuses the others rather than ignore them.
IMPLEMENTED: set = set()


# --- Process group and device ---

def pick_device(requested: str = "auto") -> torch.device:
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", 0))))
    return torch.device("cpu")


def init_distributed(device: torch.device, backend: str = "auto", timeout_s: Optional[float] = None) -> tuple[int, int]:
    """Join the job's process group if launched by torchrun or srun; returns (rank, world).
    Under srun the env:// variables are filled from SLURM's, so no torchrun is needed inside it."""
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ and int(os.environ.get("SLURM_NTASKS", 1)) > 1:
        os.environ["RANK"] = os.environ["SLURM_PROCID"]
        os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
        os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
        os.environ.setdefault("MASTER_ADDR", _slurm_first_host())
        os.environ.setdefault("MASTER_PORT", str(20000 + int(os.environ.get("SLURM_JOB_ID", 0)) % 20000))
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world == 1:
        return 0, 1
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kwargs = {} if timeout_s is None else {"timeout": __import__("datetime").timedelta(seconds=timeout_s)}
    dist.init_process_group(backend=backend, init_method="env://", **kwargs)
    return dist.get_rank(), dist.get_world_size()


def _slurm_first_host() -> str:
    nodes = os.environ.get("SLURM_JOB_NODELIST", "127.0.0.1")
    try:
        import subprocess
        return subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True, text=True,
                              check=True).stdout.split()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return nodes.split(",")[0]
