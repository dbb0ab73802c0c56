"""The machine as perfmodel.py and replay.py price on it: conf/hardware resolved (the fit on a GPU
cluster; on a CPU, this machine measured, and an emulated cluster's link from its calibration)
into one rank's rates, and the primitive costs on those rates: a kernel, a GEMM, a memory-bound
op, a collective. perfmodel.py re-exports them (pm.Rates, pm.gemm_time, ...)."""
from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict

import machine
from config import HardwareConfig
from clustermodel.schema import PerfModelHardware
from errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]  # the repository
DATA_DIR = ROOT / "experiments" / "data"
FIT_FILE = DATA_DIR / "perfmodel_fit.json"
FITTED = ("gemm_efficiency", "inter_host_efficiency")
# Measured on a CPU where the config leaves them null: the device's (hardware.*) and the rates'
# (hardware.perfmodel.*), as machine.local_measurements names them.
MEASURED_DEVICE = ("peak_tflops", "peak_tflops_fp32", "memory_gib")
MEASURED_RATES = ("memory_GBps", "memory_efficiency", "op_overhead_us", "gemm_half_dim", "gemm_efficiency",
                  "flash_efficiency", "intra_host_GBps", "inter_host_Gbps")
MEASURED = MEASURED_DEVICE + MEASURED_RATES
# Measured on a CPU too; elsewhere None means the bf16 value (Rates.of).
MEASURED_FP32 = ("gemm_half_dim_fp32", "gemm_efficiency_fp32", "flash_efficiency_fp32")


def owner(hw: HardwareConfig, key: str):
    """What holds hardware key `key`: hw for the device's keys, hw.perfmodel for the rest."""
    return hw if key in HardwareConfig.__dataclass_fields__ else hw.perfmodel


def config_key(key: str) -> str:
    """The override that sets `key`, for error messages: hardware.<key> or hardware.perfmodel.<key>."""
    return f"hardware.{key}" if key in HardwareConfig.__dataclass_fields__ else f"hardware.perfmodel.{key}"


# --- Hardware: conf/hardware completed by the fit, or on a CPU by measuring this machine ---

def fitted_constants(name: str = "") -> Dict[str, float]:
    """The constants experiments/fit_perfmodel.py fitted, with those it fitted for hardware `name`
    alone (a cluster whose network it has runs of: per_hardware) in their place; a GPU cluster
    that leaves one null takes it as is."""
    if not FIT_FILE.exists():
        return {}
    fit = json.loads(FIT_FILE.read_text())
    return {**fit["constants"], **fit.get("per_hardware", {}).get(name, {})}


def resolve_hardware(hw: HardwareConfig) -> HardwareConfig:
    """A copy of hw with every number the model needs filled in, and device=auto decided (cuda or
    cpu, as train.py decides it on this machine); ConfigError if a number can't be filled in."""
    hw = copy.deepcopy(hw)  # its perfmodel group too: filled in below
    on_cpu = hw.device == "cpu" or (hw.device == "auto" and not _cuda_available())
    hw.device = "cpu" if on_cpu else "cuda"
    if on_cpu and hw.perfmodel == PerfModelHardware():
        hw.perfmodel = this_cpu()  # a CPU that names no rates of its own (hardware=auto or cpu) is this one
    rates = hw.perfmodel
    if on_cpu and rates.cores is None:
        rates.cores = machine.cores()
    if not on_cpu:
        for key, value in fitted_constants(hw.name).items():
            if getattr(rates, key, 0) is None:
                setattr(rates, key, value)
    if on_cpu and rates.inter_host_efficiency is None:
        calibrated_link(rates)
    missing = [k for k in MEASURED + FITTED if getattr(owner(hw, k), k) is None]
    if missing and on_cpu:
        measured = machine.local_measurements()
        for key in missing + [k for k in MEASURED_FP32 if getattr(rates, k) is None]:
            setattr(owner(hw, key), key, measured.get(key))
        missing = [k for k in missing if getattr(owner(hw, k), k) is None]
    if missing:
        raise ConfigError(config_key(missing[0]), f"unknown for hardware={hw.name}",
                          "set it, or use hardware=a100_cluster, h100_cluster, h200_cluster or cpu_local")
    return hw


def this_cpu() -> PerfModelHardware:
    """conf/hardware/cpu_local.yaml's rates: this machine, its nulls measured (or cached) on first use."""
    from omegaconf import OmegaConf
    local = OmegaConf.load(ROOT / "conf" / "hardware" / "cpu_local.yaml").perfmodel
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(PerfModelHardware), local))


CALIBRATED_KIND = "all_reduce"  # the link's efficiency is gloo's all-reduce bus bandwidth over its rate


def calibrated_link(rates: PerfModelHardware) -> None:
    """An emulated cluster's link (conf/hardware/emulated_*): gloo's bandwidth there as a fraction of
    the tbf rate, and its latency per ring step, from experiments/calibrate_comm.py's newest run at
    that rate on this CPU (a microbenchmark, not a run being predicted). Fills rates in place."""
    rate = rates.inter_host_Gbps
    found = machine.link_calibration(rate) if rate else None
    if found is None:
        raise ConfigError("hardware.perfmodel.inter_host_efficiency", f"no calibration of a {rate} Gbit/s link "
                          "on this CPU", f"run `sudo python experiments/calibrate_comm.py --links "
                          f"{(rate or 0) * 1000:g}mbit` once (it is cached), or set the efficiency")
    fits = found["fits"]
    fit = fits[CALIBRATED_KIND]
    rates.inter_host_efficiency = fit["GBps"] * 8 / rate
    if rates.inter_host_latency_us is None:
        rates.inter_host_latency_us = fit["latency_us"]
    if rates.p2p_efficiency is None and "send" in fits:
        rates.p2p_efficiency = fits["send"]["GBps"] * 8 / rate
    if rates.overlap_slowdown is None and "overlap" in found:
        rates.overlap_slowdown = found["overlap"]["overlap_slowdown"]
    if not rates.collective_efficiency:
        rates.collective_efficiency = {k: fits[k]["GBps"] / fit["GBps"] for k in ("all_gather", "reduce_scatter") if k in fits}
    for key in ("p2p_efficiency", "overlap_slowdown"):
        if getattr(rates, key) is None:
            raise ConfigError(f"hardware.perfmodel.{key}", f"the calibration of the {rate} Gbit/s link predates it",
                              f"rerun `sudo python experiments/calibrate_comm.py --links {rate * 1000:g}mbit`")


def _cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


@dataclass
class Rates:
    """The resolved hardware as the cost functions use it, for one rank of a given layout."""
    flops: float            # peak FLOP/s of the run's dtype (a CPU's ranks share the host's)
    gemm_eff: float
    half_dim: float
    flash_eff: float
    mem: float              # achieved bytes/s of a streaming kernel
    op: float               # fixed seconds per op
    additive: bool          # CPU: the fixed cost adds to the work; GPU: launches overlap execution
    gemm_shapes: Dict[str, float] = field(default_factory=dict)  # measured fraction of peak by "MxNxK"

    @classmethod
    def of(cls, hw: HardwareConfig, precision: str, ranks: int) -> "Rates":
        # A CPU job's ranks all run on this machine, an emulated cluster's hosts included: they
        # share its measured peak and bandwidth (calibrate_comm.py --sharing measures how evenly),
        # one thread a rank (torchrun's and emucluster's OMP_NUM_THREADS=1), so at most a core each.
        # This is every rank computing at once; replay.py gives a rank more while others wait.
        p = hw.perfmodel
        share = max(ranks, p.cores or 1) if hw.device == "cpu" and ranks > 1 else 1
        peak = hw.peak_tflops if precision == "bf16" else hw.peak_tflops_fp32
        gemm_eff, half_dim, flash_eff = (_of_dtype(p, key, precision) for key in
                                         ("gemm_efficiency", "gemm_half_dim", "flash_efficiency"))
        return cls(peak * 1e12 / share, gemm_eff, half_dim, flash_eff,
                   p.memory_GBps * 1e9 * p.memory_efficiency / share, p.op_overhead_us * 1e-6,
                   hw.device == "cpu", dict(p.gemm_shapes or {}))


def _of_dtype(rates: PerfModelHardware, key: str, precision: str) -> float:
    """rates.<key>, or for an fp32 run its <key>_fp32 where the hardware has one."""
    fp32 = getattr(rates, key + "_fp32") if precision != "bf16" else None
    return getattr(rates, key) if fp32 is None else fp32


# --- Primitive costs: a kernel, a GEMM, a memory-bound op, a collective ---

def _kernel(r: Rates, seconds: float, ops: float = 1) -> float:
    return seconds + ops * r.op if r.additive else max(seconds, ops * r.op)


def gemm_time(r: Rates, M: float, N: float, K: float, count: int = 1, elem: int = 2) -> float:
    """[M,K] @ [K,N], `count` times in one kernel: a roofline whose compute side loses speed on small
    dims (tile and wave quantization, modelled as d / (d + half_dim) per dim), or runs at the
    fraction of peak measured for this shape where r has one."""
    measured = r.gemm_shapes.get(gemm_key(M, N, K)) if count == 1 and r.gemm_shapes else None
    shape = M / (M + r.half_dim) * N / (N + r.half_dim) * K / (K + r.half_dim)
    efficiency = measured if measured is not None else r.gemm_eff * shape
    compute = 2 * M * N * K * count / (r.flops * efficiency)
    memory = elem * (M * K + K * N + M * N) * count / r.mem
    return _kernel(r, max(compute, memory))


def gemm_key(M: float, N: float, K: float) -> str:
    return f"{round(M)}x{round(N)}x{round(K)}"


def stream_time(r: Rates, nbytes: float, ops: float = 1) -> float:
    """A memory-bound op (norm, activation, cast, softmax) that moves nbytes."""
    return _kernel(r, nbytes / r.mem, ops)


def collective_time(kind: str, nbytes: float, n: int, bandwidth: float, latency: float,
                    algo: str = "ring") -> float:
    """The textbook alpha-beta cost (Thakur, Rabenseifner & Gropp 2005) of one collective over n
    ranks. nbytes is the whole buffer: what all_gather returns, what reduce_scatter and all_reduce
    take. A ring takes n-1 steps, a tree (recursive halving/doubling, or NCCL's double binary
    tree) log2(n); both move (n-1)/n of the buffer per rank, all_reduce twice."""
    if n <= 1:
        return 0.0
    steps = n - 1 if algo == "ring" else math.ceil(math.log2(n))
    one_pass = steps * latency + (n - 1) / n * nbytes / bandwidth
    return 2 * one_pass if kind == "all_reduce" else one_pass
