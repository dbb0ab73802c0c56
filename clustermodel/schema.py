"""The cluster model's part of the configuration schema: the machine as the performance model
prices it (hardware.perfmodel) and the rehearsal's switches (rehearse).

A leaf: config.py assembles these into the root it composes, as it does every module's own
switches, and nothing here imports the training code or config.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional


@dataclass
class PerfModelHardware:
    """What only clustermodel/ (perfmodel.py, replay.py) reads of a machine: its hosts, links,
    latencies and the efficiencies its kernels and collectives reach. The training run reads none
    of it. None: measured on this machine (cpu_local), fitted (experiments/fit_perfmodel.py) or
    taken from a link's calibration (rates.resolve_hardware); the efficiencies are fractions of
    the spec numbers."""
    devices_per_host: int = 1
    cores: Optional[int] = None               # CPU: the cores a job's ranks share (None: this machine's)
    intra_host_GBps: Optional[float] = None   # per device, one direction (NVLink)
    inter_host_Gbps: Optional[float] = None   # per host, all NICs together
    memory_GBps: Optional[float] = None       # device memory bandwidth (HBM; the host's DRAM on CPU)
    intra_host_latency_us: float = 10.0       # one step of a collective inside a host
    inter_host_latency_us: Optional[float] = 20.0  # one step of a collective, or one message, across hosts
    op_overhead_us: Optional[float] = 5.0     # per kernel: a GPU launch, or a CPU eager dispatch + autograd
    gemm_half_dim: Optional[float] = 32.0     # a GEMM dim of this size runs at half speed (tiles, waves)
    gemm_efficiency: Optional[float] = None   # fraction of peak a large GEMM reaches
    flash_efficiency: Optional[float] = 0.5   # fraction of peak a fused attention kernel reaches
    # The same three for fp32 runs, where they differ (a CPU with AMX or AVX512-BF16 runs bf16 GEMMs
    # on other units, with another size profile); None: the bf16 values.
    gemm_half_dim_fp32: Optional[float] = None
    gemm_efficiency_fp32: Optional[float] = None
    flash_efficiency_fp32: Optional[float] = None
    # A GEMM's speed by shape ("MxNxK" of [M,K] @ [K,N], the run's dtype) as a fraction of peak,
    # where it was measured (machine.gemm_shape_efficiency, for the shapes a rehearsal records);
    # a shape not listed takes the half-dim model above.
    gemm_shapes: Dict[str, float] = field(default_factory=dict)
    memory_efficiency: Optional[float] = 0.8  # fraction of memory_GBps a streaming kernel reaches (None: measured)
    intra_host_efficiency: float = 0.75       # collective bus bandwidth / link rate inside a host
    inter_host_efficiency: Optional[float] = None  # the same for large collectives across hosts
    p2p_efficiency: Optional[float] = 0.8     # the same for pipeline point-to-point messages
    # A collective's bus bandwidth relative to all_reduce's where the library's algorithm differs
    # (gloo's reduce_scatter costs a whole all-reduce, 0.5: experiments/results/perfmodel_validation.md);
    # NCCL's are alike: empty.
    collective_efficiency: Dict[str, float] = field(default_factory=dict)
    overlap_slowdown: Optional[float] = 0.1   # compute slows by this fraction of the comm it hides
    # What each collective or send costs the host beside compute (replay.py). None: 0 on a GPU; on
    # a CPU, this machine's `calibrate_comm.py --sharing` (its ranks' threads must be scheduled).
    collective_host_us: Optional[float] = None
    loader_step_s: float = 0.0                # host time the naive data loader adds to every step
    # The same with one reader per TP group and no prefetch (data.tp_shared alone). None: not
    # measured apart, loader_step_s is charged (an upper bound: one reader contends with no other).
    loader_step_shared_s: Optional[float] = None
    collective_algo: str = "ring"             # ring | tree (hierarchical: inside hosts, then across)
    # A third network level: zones (pods) of this many hosts with full bisection inside and the
    # aggregation layer between them oversubscribed by this factor (Meta's Llama 3 cluster: 3,072
    # GPUs a zone, 1:7). None: one zone, the network is two-level.
    hosts_per_zone: Optional[int] = None
    inter_zone_oversubscription: Optional[float] = None


@dataclass
class RehearseConfig:
    """rehearse.*: chosen ranks of a job of any size run on this machine (rehearsal.py)."""
    ranks: List[int] = field(default_factory=list)  # ranks of the job to rehearse; empty: a normal run
    rank: int = -1                # set by the parent in each rank's own process
    record: bool = False          # a real run records its first `steps` steps the same way (<run dir>/comm/)
    # Before a SLURM submission (the submitit launcher, experiments/slurm/submit.py): rank 0 of each
    # job, one step; a job that cannot be built, breaks NCCL's rules or overflows the GPU fails on
    # the login node instead of after the queue. On at scale=cluster.
    precheck: bool = False
    world: int = -1               # the job's world size; -1: tp*pp*dp of the layout (dp must be set)
    steps: int = 2
    nccl_rules: bool = True       # enforce NCCL's rules on what the ranks post (nccl_rules.py)
    # What every rank's tensors must fit in. None: the hardware's tensor memory (its memory_gib
    # less memory_headroom_gib, conf/hardware), or 80 GiB where the hardware names no memory.
    capacity_gib: Optional[float] = None
    out: Optional[str] = None     # where rank<r>/rehearsal.json go; None: the run dir
    parallel_ranks: int = 2       # rehearsals run at once (each is one process)

    @property
    def rehearsing(self) -> bool:
        """Whether this run rehearses (the parent, rehearse.ranks, or one rank, rehearse.rank)."""
        return bool(self.ranks) or self.rank >= 0


def rehearsed_world(cfg) -> Optional[int]:
    """The rehearsed job's world size: rehearse.world, else the layout's tp*pp*dp (None if dp=-1)."""
    if cfg.rehearse.world > 0:
        return cfg.rehearse.world
    p = cfg.parallel
    return p.tp * p.pp * p.dp if p.dp > 0 else None
