"""The whole configuration schema, its validation, and the one-line errors for bad input.

Each module owns the dataclass of its own switches (model.ModelConfig, parallel.ParallelConfig,
kernels.KernelsConfig, ...; the cluster model's, rehearse and hardware.perfmodel, in
clustermodel/schema.py); this file assembles them into the root that Hydra composes from conf/.
Because the root is a structured config, an unknown key is an error, never a silent default.

Bad input stops the run before any rank does work: one line naming the key and the fix, exit 2.
"""
from __future__ import annotations

import datetime
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional, Tuple

from omegaconf import OmegaConf

from checkpoint import CheckpointConfig
from errors import ConfigError, fail  # defined in errors.py, a leaf; config.ConfigError still names it
from observe.heartbeat import FTConfig
from data import DataConfig
from kernels import ATTENTION_IMPLS, FUSED_IMPLS, KernelsConfig
from model import ModelConfig
from observe.oplog import ObserveConfig
from optim import OptimConfig
from parallel import ParallelConfig
from clustermodel.schema import PerfModelHardware, RehearseConfig, rehearsed_world

CONF_DIR = Path(__file__).resolve().parent / "conf"


@dataclass
class TrainConfig:
    max_steps: int = 300
    batch_size: int = 16          # global batch, in sequences
    seq_len: int = 256
    lr: float = 2e-3
    grad_clip: float = 1.0        # max global gradient norm; 0 disables clipping
    seed: int = 1337
    eval_interval: int = 100      # steps between held-out evaluations; 0 disables
    eval_batches: int = 4
    recompute: str = "none"       # none | selective | full activation recomputation
    # with recompute=full: how many blocks of each model chunk a rank holds recompute, its first
    # ones (Megatron-LM's --recompute-method block --recompute-num-layers); -1: every block
    recompute_layers: int = -1
    # torch.compile the model: true, false, or null (auto, the default): compiled on CUDA, eager on
    # CPU, the faster of the two where each was measured (experiments/results/bench_step.md)
    compile: Optional[bool] = None
    # torch.compile's mode for the compiled step: default, or reduce-overhead, which records it as
    # CUDA graphs (a graph launch instead of a launch per kernel) where a step is launch-bound.
    # CUDA only: elsewhere the step compiles as default, and the log line says so.
    compile_mode: str = "default"
    gc_interval: int = 100        # Python's GC off during steps, run on every rank each N steps; 0: Python's own


@dataclass
class HardwareConfig:
    """The machine a run is on: the device and backend it trains with, the peak FLOP/s its MFU
    divides by and the memory its tensors fit in; and, in `perfmodel`, what only the performance
    model reads of it (clustermodel/schema.py). One conf/hardware/<machine>.yaml holds both.
    Unknown values stay None and are measured or looked up."""
    name: str = "auto"
    device: str = "auto"                  # auto | cpu | cuda
    backend: str = "auto"                 # auto | gloo | nccl
    keep_freed_memory: bool = True        # CPU: glibc's malloc reuses freed blocks (machine.keep_freed_memory)
    peak_tflops: Optional[float] = None   # dense peak per device for the run's dtype (CUDA: bf16's; TF32 takes half)
    peak_tflops_fp32: Optional[float] = None  # an fp32 run's peak on CUDA without TF32 (None: the device table's)
    # The GPU this config describes (a key of machine.DEVICE_PEAK_TFLOPS: A100, H100, ...): a run
    # on another GPU is refused (its MFU would divide by this one's peak). None: any device.
    gpu: Optional[str] = None
    memory_gib: Optional[float] = None    # per device, as sold (80 for an "80 GB" A100 or H100)
    # What of memory_gib tensors cannot use: what CUDA never shows, the CUDA context and library
    # workspaces, NCCL's buffers, the caching allocator's fragmentation. Derived, with its sources,
    # in conf/hardware/a100_cluster.yaml; machine.tensor_memory_gib() is what a rehearsal and
    # perfmodel fit a rank's tensors in.
    memory_headroom_gib: float = 0.0
    perfmodel: PerfModelHardware = field(default_factory=PerfModelHardware)


@dataclass
class WandbConfig:
    mode: str = "offline"         # online | offline | disabled
    project: str = "megarepro"
    entity: Optional[str] = None
    group: Optional[str] = None
    name: Optional[str] = None
    tags: List[str] = field(default_factory=list)


@dataclass
class LoggingConfig:
    interval: int = 10            # steps between log lines (metrics.jsonl gets every step)
    progress: bool = True         # progress bar on rank 0
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class StudyConfig:
    """Which study and row a run belongs to, for experiments/tables.py and the W&B group. Set by
    the conf/experiment presets; a plain run leaves it empty."""
    name: Optional[str] = None    # megascale_ablation | strong_scaling | convergence
    step: Optional[int] = None    # the ablation step (Table 3 numbering, 0 = baseline)
    label: Optional[str] = None   # the table's row name, e.g. "+PTB"
    scale: str = "cpu"            # cpu | cluster (conf/scale/)
    fabric: str = "loopback"      # loopback | emulated:<hosts>x<ranks>@<rate> | cluster
    pending: bool = False         # this row's switch has not landed: record the run as pending, train nothing
    without: List[int] = field(default_factory=list)  # earlier steps left out of this cumulative row (pending)


@dataclass
class AblationConfig:
    """MegaScale's Table 3 as one knob: conf/experiment/megascale_ablation.yaml names each step's
    switch as ${ablation:K,on,off}, so `ablation.step=K` turns on steps 1..K and the multirun
    `ablation.step=range(0,9)` is the whole table. A step listed in `pending` (its switch has not
    landed; tests/test_experiments.py checks the list against what validate() refuses) is
    recorded as pending, never faked, and the later steps run without it."""
    step: int = 0
    pending: List[int] = field(default_factory=list)
    window: int = 512             # the SWA step's window (the paper gives none; a quarter of its 2048)
    batch: int = 16               # the global batch of steps 0-7
    lamb_batch: int = 48          # step 8: LAMB with the batch tripled (256 -> 768 in the paper)


@dataclass
class ScalingConfig:
    """MegaScale's Table 2: `rows` lists the (GPUs, nodes, batch, microbatches) of each row
    (conf/study_scale/strong_scaling_<scale>.yaml) and `row` picks one, so the multirun
    `scaling.row=range(0,N)` is the table."""
    row: int = 0
    rows: List[Any] = field(default_factory=list)


@dataclass
class ConvergenceConfig:
    """Fig. 10 and the batch study around it (conf/experiment/convergence.yaml). variant: the
    model, baseline or ptb_swa (PTB + SWA); lamb_4x names the paper's setting, LAMB at k=4. The
    batch study sweeps optimizer x k (the batch multiple, at equal tokens: batch*k sequences for
    steps/k steps) x lr_mult (the sweep around optim.batch_scaled_lr's rate) x train.seed;
    experiments/batch_study.py runs it and reads it."""
    variant: str = "baseline"
    window: int = 512
    batch: int = 16               # sequences per step at k=1
    steps: int = 1000             # steps at k=1; steps/k at k
    optimizer: str = "adamw"      # adamw | lamb
    k: int = 1                    # batch multiple
    lr_mult: float = 1.0          # times the rule's rate for this k
    adamw_lr: float = 2e-3        # peak rates at k=1
    lamb_lr: float = 2e-3
    warmup_tokens: int = 81920    # the warm-up in tokens, the same at every k (20 steps of 16 x 256)
    evals: int = 10               # held-out evaluations per run, at the same tokens for every k
    eval_sequences: int = 32      # the held-out set, the same sequences for every k


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    ft: FTConfig = field(default_factory=FTConfig)
    observe: ObserveConfig = field(default_factory=ObserveConfig)
    study: StudyConfig = field(default_factory=StudyConfig)
    ablation: AblationConfig = field(default_factory=AblationConfig)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    convergence: ConvergenceConfig = field(default_factory=ConvergenceConfig)
    rehearse: RehearseConfig = field(default_factory=RehearseConfig)
    precision: str = "auto"       # auto | bf16 (autocast, fp32 master weights) | fp32; auto: bf16 where it is fast
    resume: str = "auto"          # auto (newest complete checkpoint, if any) | none | PATH
    dry_run: bool = False         # build on the meta device, print size/FLOPs/memory, exit


def run_id() -> str:
    """A name for this run that every rank of one job agrees on, and that a restart keeps, so
    the run dir (and its checkpoints, for resume=auto) is the same across ranks and restarts."""
    if os.environ.get("MEGAREPRO_RUN_ID"):
        return os.environ["MEGAREPRO_RUN_ID"]
    if os.environ.get("SLURM_JOB_ID"):
        array = os.environ.get("SLURM_ARRAY_TASK_ID")
        return f"slurm-{os.environ.get('SLURM_ARRAY_JOB_ID', os.environ['SLURM_JOB_ID'])}" + (f"_{array}" if array else "")
    if os.environ.get("TORCHELASTIC_RUN_ID", "none") != "none":
        return "torchrun-" + os.environ["TORCHELASTIC_RUN_ID"][:8]
    started = datetime.datetime.now()
    if "LOCAL_RANK" in os.environ:  # under torchrun: its agent, our parent, started once for all ranks
        started = _process_start_time(os.getppid()) or started
    return started.strftime("%Y-%m-%d_%H-%M-%S")


def _process_start_time(pid: int) -> Optional[datetime.datetime]:
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(int(l.split()[1]) for l in open("/proc/stat") if l.startswith("btime"))
        return datetime.datetime.fromtimestamp(boot + ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, StopIteration, IndexError):
        return None


def register() -> None:
    """Register the schema with Hydra and the resolvers the YAML uses (${run_id:}, ${ablation:...},
    ...). Idempotent. Whatever composes a config calls it first (compose, launcher_world, train.py's
    entry point); importing a module registers nothing."""
    from hydra.core.config_store import ConfigStore
    store = ConfigStore.instance()
    if "schema.yaml" not in store.repo:  # storing converts the schema anew: 0.1 s a compose
        store.store(name="schema", node=Config)
    if not OmegaConf.has_resolver("run_id"):
        OmegaConf.register_new_resolver("run_id", run_id, use_cache=True)
    if not OmegaConf.has_resolver("ablation"):
        OmegaConf.register_new_resolver("ablation", ablation_switch)
        OmegaConf.register_new_resolver("ablation_study", ablation_study)
        # ${pick:key,{k1: v1, k2: v2},default}: a study variant's value of a setting
        OmegaConf.register_new_resolver("pick", lambda key, table, default: table.get(key, default))
        # ${convergence:lr}: what a convergence job trains with (convergence_setting)
        OmegaConf.register_new_resolver("convergence", convergence_setting)
        # ${scaling_row:batch}: a value of the strong-scaling row scaling.row picks
        OmegaConf.register_new_resolver("scaling_row", lambda key, *, _root_: _root_.scaling.rows[_root_.scaling.row][key])


def ablation_switch(step: int, on: Any, off: Any, *, _root_) -> Any:
    """${ablation:K,on,off}: `on` when the run's ablation.step reaches step K and K is not pending."""
    a = _root_.ablation
    return on if a.step >= step and step not in a.pending else off


# The cumulative steps of Table 3, in order; the single definition (experiments/tables.py and clustermodel/cli.py import it).
ABLATION_LABELS: Tuple[str, ...] = (
    "baseline (Megatron-LM)", "+PTB", "+SWA", "+TP overlap", "+PP overlap", "+DP overlap",
    "+efficient operators", "+misc (data pipeline)", "+LAMB (batch x3)")

def ablation_study(what: str, *, _root_) -> Any:
    """${ablation_study:label|pending|without}: the run's Table 3 row, for run.json and W&B."""
    a = _root_.ablation
    if what == "label":
        return ABLATION_LABELS[a.step] if 0 <= a.step < len(ABLATION_LABELS) else f"step {a.step}"
    if what == "pending":
        return a.step in a.pending
    return [k for k in a.pending if k < a.step]


def convergence_setting(what: str, base: Any = None, *, _root_) -> Any:
    """${convergence:optimizer|k|batch_size|max_steps|lr|warmup_steps|eval_interval|eval_batches|label}, and
    ${convergence:times_k,N}: the values a convergence job trains with. Every k sees the same
    tokens; the rate follows optim.batch_scaled_lr and the warm-up is fixed in tokens."""
    import optim
    # Hydra resolves these once while merging the experiment's YAML alone (to see whether a value
    # is None), where the schema's defaults are not there yet: hence the defaults here.
    c = ConvergenceConfig(**{k: v for k, v in OmegaConf.to_container(_root_.convergence).items()
                             if k in ConvergenceConfig.__dataclass_fields__})
    seq_len = OmegaConf.select(_root_, "train.seq_len", default=TrainConfig.seq_len)
    optimizer, k = ("lamb", 4) if c.variant == "lamb_4x" else (c.optimizer, c.k)
    if what == "lr":
        return optim.batch_scaled_lr({"adamw": c.adamw_lr, "lamb": c.lamb_lr}[optimizer], k) * c.lr_mult
    if what == "label":  # Fig. 10's names for its three runs; the batch study's cells otherwise
        if (c.optimizer, c.k, c.lr_mult) == ("adamw", 1, 1.0):
            return c.variant
        return f"{optimizer} k={k} lr x{c.lr_mult:g}" + ("" if c.variant in ("baseline", "lamb_4x") else f" {c.variant}")
    return {"optimizer": optimizer, "k": k, "batch_size": c.batch * k, "max_steps": c.steps // k,
            "times_k": None if base is None else int(base) * k,
            "warmup_steps": optim.warmup_steps_for_tokens(c.warmup_tokens, c.batch * k * seq_len),
            "eval_interval": max(1, c.steps // k // c.evals),
            "eval_batches": max(1, c.eval_sequences // (c.batch * k))}[what]


def world_size() -> int:
    """This process's world: torchrun's WORLD_SIZE, else srun's SLURM_NTASKS, else 1."""
    for var in ("WORLD_SIZE", "SLURM_NTASKS"):
        if os.environ.get(var):
            return int(os.environ[var])
    return 1


COMPILE_MODES = ("default", "reduce-overhead")


def _check_cuda_graphs(cfg: Config) -> None:
    """train.compile_mode=reduce-overhead records the one-graph step (forward, loss and backward of
    a microbatch): it needs a compiled step, and pipeline or tensor parallelism compile chunk by
    chunk, with their schedule and collectives between the graphs."""
    if cfg.train.compile is False:
        raise ConfigError("train.compile_mode", "reduce-overhead records the compiled step, and train.compile=false "
                          "compiles none", "set train.compile=true (or leave it auto: compiled on CUDA), or "
                          "train.compile_mode=default")
    if cfg.parallel.tp > 1 or cfg.parallel.pp > 1:
        raise ConfigError("train.compile_mode", f"reduce-overhead with parallel.tp={cfg.parallel.tp}, "
                          f"parallel.pp={cfg.parallel.pp}: CUDA graphs are recorded for the one-graph step only",
                          "use train.compile_mode=default with pipeline or tensor parallelism")


def validate(cfg: Config, world: Optional[int] = None, remote: bool = False) -> None:
    """Every check that can fail before training starts, by kind: each key's value, the study's
    settings, this machine's devices, the paths the run reads, then the layout on the run's world
    and the settings data.py and optim.py own. Raises ConfigError. remote: the job will run
    elsewhere (a SLURM launcher's nodes), so this machine's devices and paths do not matter."""
    check_choices(cfg)
    check_values(cfg)
    check_studies(cfg)
    remote = remote or cfg.rehearse.rehearsing  # a rehearsal needs none of the job's hardware or paths
    if not (cfg.dry_run or remote):  # a dry run needs no hardware
        check_devices(cfg)
    if not remote:  # a launcher's nodes may see other paths
        check_paths(cfg)
    import data
    import optim
    import parallel
    from corpus import blend
    job = job_world(cfg, world)
    parallel.validate(cfg, job)
    data.check_config(cfg.data, job)  # a job of several ranks: O(1) file-system calls per rank
    blend.check_config(cfg.data, lambda source: data.check_config(source, job))  # data.sources, each as data.source
    optim.check_config(cfg.optim)


def check_choices(cfg: Config) -> None:
    """Every switch that takes one of a few names."""
    _choice("model.block", cfg.model.block, ("sequential", "parallel"))
    _choice("model.norm", cfg.model.norm, ("layernorm", "rmsnorm"))
    _choice("model.mlp", cfg.model.mlp, ("gelu", "swiglu"))
    _choice("precision", cfg.precision, ("auto", "bf16", "fp32"))
    _choice("hardware.device", cfg.hardware.device, ("auto", "cpu", "cuda"))
    _choice("hardware.backend", cfg.hardware.backend, ("auto", "gloo", "nccl"))
    _choice("kernels.attention", cfg.kernels.attention, ATTENTION_IMPLS)
    _choice("kernels.fused", cfg.kernels.fused, FUSED_IMPLS)
    _choice("train.recompute", cfg.train.recompute, ("none", "selective", "full"))
    _choice("train.compile_mode", cfg.train.compile_mode, COMPILE_MODES)
    _choice("logging.wandb.mode", cfg.logging.wandb.mode, ("online", "offline", "disabled"))


def check_values(cfg: Config) -> None:
    """Each number on its own, or against another key of the same config: the model's shape,
    counts and intervals, the fault-tolerance timeouts."""
    m, t = cfg.model, cfg.train
    for key, value in (("model.n_heads", m.n_heads), ("model.d_model", m.d_model), ("model.vocab_size", m.vocab_size)):
        if value < 1:
            raise ConfigError(key, f"{value} < 1", "use a positive value")
    if m.d_model % m.n_heads:
        raise ConfigError("model.n_heads", f"{m.n_heads} heads do not divide d_model={m.d_model}",
                          "choose n_heads that divides model.d_model")
    if (m.d_model // m.n_heads) % 2:
        raise ConfigError("model.n_heads", f"head dim {m.d_model // m.n_heads} is odd and rotary needs it even",
                          "choose n_heads so that d_model/n_heads is even")
    check_model_widths(m)
    if t.recompute_layers != -1 and t.recompute != "full":
        raise ConfigError("train.recompute_layers", f"{t.recompute_layers} with train.recompute={t.recompute}: only full "
                          "recomputation counts layers", "add train.recompute=full, or drop train.recompute_layers (-1)")
    if t.recompute_layers < -1:
        raise ConfigError("train.recompute_layers", f"{t.recompute_layers} < -1",
                          "use -1 (every layer) or a number of layers per model chunk >= 0")
    if t.compile_mode == "reduce-overhead":
        _check_cuda_graphs(cfg)
    if cfg.kernels.attention_block < 1:
        raise ConfigError("kernels.attention_block", f"{cfg.kernels.attention_block} < 1",
                          "use a positive query block size, e.g. 128")
    if m.attention.window is not None and m.attention.window < 1:
        raise ConfigError("model.attention.window", f"window {m.attention.window} < 1",
                          "use a window >= 1, or null for full causal attention")
    if not 0 <= m.dropout < 1:
        raise ConfigError("model.dropout", f"{m.dropout} is not a probability in [0, 1)",
                          "use 0 (off) or e.g. 0.1 (Megatron-LM's default)")
    if t.seq_len > m.max_seq_len:
        raise ConfigError("train.seq_len", f"{t.seq_len} is longer than model.max_seq_len={m.max_seq_len}",
                          f"use train.seq_len<={m.max_seq_len} or raise model.max_seq_len")
    for key, value in (("train.seq_len", t.seq_len), ("train.batch_size", t.batch_size),
                       ("train.max_steps", t.max_steps), ("model.n_layers", m.n_layers)):
        if value < 1:
            raise ConfigError(key, f"{value} < 1", "use a positive value")
    for key, value in (("ft.straggler_interval", cfg.ft.straggler_interval), ("train.gc_interval", t.gc_interval),
                       ("checkpoint.interval", cfg.checkpoint.interval), ("checkpoint.keep", cfg.checkpoint.keep)):
        if value < 0:
            raise ConfigError(key, f"{value} < 0", "use 0 (off) or a positive number of steps")
    check_timeouts(cfg)


def check_model_widths(m: ModelConfig) -> None:
    """Grouped-query attention's KV heads and the MLP's width (model.kv_heads, model.ffn_width)."""
    if m.n_kv_heads is not None and m.n_kv_heads < 1:
        raise ConfigError("model.n_kv_heads", f"{m.n_kv_heads} < 1", "use 1 (multi-query) to model.n_heads, or null (= n_heads)")
    if m.n_kv_heads is not None and m.n_heads % m.n_kv_heads:
        raise ConfigError("model.n_kv_heads", f"{m.n_kv_heads} KV heads do not divide n_heads={m.n_heads} into "
                          "equal query groups", "choose n_kv_heads that divides model.n_heads, or null (= n_heads)")
    if m.ffn_hidden_size is not None and m.ffn_hidden_size < 1:
        raise ConfigError("model.ffn_hidden_size", f"{m.ffn_hidden_size} < 1",
                          "use a positive width, or null for mlp_ratio * d_model")
    if m.mlp_ratio < 1:
        raise ConfigError("model.mlp_ratio", f"{m.mlp_ratio} < 1", "use a positive ratio, e.g. 4")


def check_timeouts(cfg: Config) -> None:
    """Fault tolerance's timeouts, and the observer's stall verdict against the snapshots' age."""
    for key, value in (("ft.collective_timeout", cfg.ft.collective_timeout), ("ft.hang_timeout", cfg.ft.hang_timeout),
                       ("ft.heartbeat_interval", cfg.ft.heartbeat_interval)):
        if value <= 0:
            raise ConfigError(key, f"{value} <= 0", "use a positive number of seconds")
    if 0 < cfg.observe.stall_s <= cfg.ft.hang_timeout / 10:  # snapshots are up to hang_timeout/10 s old
        raise ConfigError("observe.stall_s", f"{cfg.observe.stall_s} s is within the snapshots' age, "
                          f"ft.hang_timeout/10 = {cfg.ft.hang_timeout / 10:g} s, so an early verdict could read stale state",
                          f"use observe.stall_s above {cfg.ft.hang_timeout / 10:g}, or 0 (only at the hang timeout)")


def check_studies(cfg: Config) -> None:
    """The study presets' own knobs: Table 3's step, the convergence study's evaluation grid."""
    if cfg.study.name == "convergence":
        c, k = cfg.convergence, cfg.convergence.k if cfg.convergence.variant != "lamb_4x" else 4
        if c.steps % k or (c.steps // k) % c.evals:
            raise ConfigError("convergence.steps", f"{c.steps} steps at k={k} are not {c.evals} evaluations at the "
                              f"token counts of k=1's", f"choose steps divisible by k x convergence.evals "
                              f"({k * c.evals})")
    if not 0 <= cfg.ablation.step <= 8:
        raise ConfigError("ablation.step", f"{cfg.ablation.step} is not a step of Table 3",
                          "use 0 (baseline) to 8 (+LAMB), or the multirun ablation.step=range(0,9)")


def check_devices(cfg: Config) -> None:
    """This machine's devices against what the run asks for: a visible GPU for device=cuda, at most
    one rank per GPU, the GPU the hardware config describes, FlashAttention where it is asked for."""
    if cfg.hardware.device in ("cuda", "auto"):
        import torch
        import launch
        launch.set_cuda_connections(cfg.parallel.tp, cfg.hardware.device)  # CUDA reads it when it starts: below
        if cfg.hardware.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("hardware.device", "cuda was asked for but no CUDA device is visible",
                              "use hardware.device=cpu (or auto) on this machine")
        if torch.cuda.is_available():
            visible = torch.cuda.device_count()
            sharing = launch.gpu_sharing_problem(launch.ranks_on_this_node(), visible,
                                                   torchrun=bool(os.environ.get("LOCAL_WORLD_SIZE")))
            if sharing:
                raise ConfigError("hardware.device", sharing, f"start at most {visible} rank(s) per node, one per "
                                  f"GPU (torchrun --nproc_per_node, srun --ntasks-per-node), or hardware.device=cpu")
            import machine
            problem = cfg.hardware.gpu and machine.other_gpu_problem(
                cfg.hardware, torch.cuda.get_device_name(launch.pick_device("cuda")))
            if problem:
                raise ConfigError("hardware.gpu", *problem)
    if cfg.kernels.attention == "flash":
        import kernels
        problem = kernels.flash_attn_problem()
        if problem:
            raise ConfigError("kernels.attention", f"flash: {problem[0]}", problem[1])


def check_paths(cfg: Config) -> None:
    """The files the run reads before it starts: the checkpoint resume= names."""
    if cfg.resume not in ("auto", "none"):
        from checkpoint import MANIFEST
        if not (Path(cfg.resume) / MANIFEST).is_file():
            raise ConfigError("resume", f"{cfg.resume} is not a complete checkpoint (no {MANIFEST})",
                              "give a checkpoints/step_* folder, or resume=auto|none")


def job_world(cfg: Config, world: Optional[int] = None) -> int:
    """The world size the layout is checked on: a rehearsal's (rehearse.world or the layout's, its
    ranks checked against it); the given one (a launcher's); a dry run's layout, which names it
    (no processes to count); else this process's (WORLD_SIZE, SLURM_NTASKS, or 1)."""
    if cfg.rehearse.rehearsing:
        return _rehearsal_world(cfg)
    if world is not None:
        return world
    planned = cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.dp
    return planned if cfg.dry_run and cfg.parallel.dp > 0 else world_size()


def _rehearsal_world(cfg: Config) -> int:
    """The world a rehearsal plays (rehearse.world, else the layout's tp*pp*dp), its ranks checked."""
    world = rehearsed_world(cfg)
    if world is None:
        raise ConfigError("rehearse.world", "parallel.dp=-1 leaves the job's world size unknown",
                          "set rehearse.world=<GPUs> or parallel.dp")
    bad = [r for r in list(cfg.rehearse.ranks) + [cfg.rehearse.rank] if r >= world]
    if bad:
        raise ConfigError("rehearse.ranks", f"rank {bad[0]} is not in a world of {world}", f"use ranks 0..{world - 1}")
    if cfg.rehearse.steps < 1:
        raise ConfigError("rehearse.steps", f"{cfg.rehearse.steps} < 1", "rehearse at least one step (2 shows the steady state)")
    return world


def _choice(key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(key, f"unknown value {value!r}", f"use one of: {', '.join(map(str, allowed))}")


def to_object(dict_cfg) -> Config:
    return OmegaConf.to_object(dict_cfg)


# --- Turning composition errors into one line ---

def describe_composition_error(err: Exception) -> str:
    """Hydra and OmegaConf report a bad override over several lines; keep the one that matters."""
    text = f"{err}\n{err.__cause__ or ''}"
    missing_group = re.search(r"Could not find '([^/']+)/([^']+)'", text)
    if missing_group:
        group, option = missing_group.groups()
        options = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
        return (f"config error: {group}={option}: no such option. "
                f"Fix: use one of: {', '.join(options) or '(none)'}")
    key = re.search(r"full_key: (\S+)", text) or re.search(r"Key '([^']+)'", text)
    if re.search(r"Key '[^']+' (is )?not in", text) or "Could not append" in text:
        name = key.group(1) if key else "?"
        return f"config error: {name}: unknown key. Fix: check its spelling; `python train.py --cfg job` lists every key"
    value_error = re.search(r"(Value '[^\n]*)", text)
    if key and value_error:
        return f"config error: {key.group(1)}: {value_error.group(1)}. Fix: give a value of the right type"
    return "config error: " + " ".join(text.split())[:300]


def compose(overrides: List[str]) -> Config:
    """Compose the config as train.py's Hydra entry point would, outside of a Hydra run."""
    from hydra import compose as hydra_compose, initialize_config_dir
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return to_object(hydra_compose(config_name="config", overrides=overrides))


HYDRA_OVERRIDE = ("hydra.", "hydra/", "+hydra", "++hydra", "~hydra")


def job_overrides(argv: List[str]) -> List[List[str]]:
    """The override lists of every job a command line launches (one, or a multirun's product)."""
    overrides = [a for a in argv if not a.startswith("-") and not a.startswith(HYDRA_OVERRIDE)]
    if "-m" not in argv and "--multirun" not in argv:
        return [overrides]
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    parsed = OverridesParser.create().parse_overrides(overrides)
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def preflight(argv: List[str], remote_world: Optional[int] = None) -> list:
    """Compose and validate every job of this command line; on bad input print one line, exit 2.
    Returns [(overrides, config, world)] of the jobs (world: a SLURM launcher's ranks, else None).
    remote_world: the jobs will run elsewhere on that many ranks (experiments/slurm/submit.py)."""
    if any(a in argv for a in ("--help", "-h", "--hydra-help", "--info", "-i", "--cfg", "-c", "--shell-completion")):
        return []
    try:
        jobs = job_overrides(argv)
    except Exception as err:  # a malformed override string
        fail(describe_composition_error(err))
    hydra_args = [a for a in argv if a.startswith(HYDRA_OVERRIDE)]
    checked = []
    for overrides in jobs:
        try:
            cfg = compose(overrides)
            world = launcher_world(overrides + hydra_args) if "-m" in argv or "--multirun" in argv else remote_world
        except Exception as err:
            fail(describe_composition_error(err))
        try:
            validate(cfg, world, remote=world is not None)
        except ConfigError as err:
            fail(str(err))
        checked.append((overrides, cfg, world))
    return checked


def launcher_world(overrides: List[str]) -> Optional[int]:
    """The ranks a SLURM launcher (submitit) will start for this job, nodes x tasks per node; None
    where they come from the environment (torchrun, srun, one process)."""
    from hydra import compose as hydra_compose, initialize_config_dir
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        launcher = hydra_compose(config_name="config", overrides=overrides, return_hydra_config=True).hydra.launcher
    if "SlurmLauncher" not in str(launcher.get("_target_", "")):
        return None
    return int(launcher.nodes) * int(launcher.tasks_per_node)



if __name__ == "__main__":
    # `python config.py --world N OVERRIDES...`: compose and validate a job as its N ranks will, on
    # the host that launches them (experiments/slurm/train.sbatch, before srun), so a layout that
    # does not fit N ranks is one line before any rank starts. Exit 0 and a line of what was checked.
    import argparse
    parser = argparse.ArgumentParser(description="Check a job's config for a launch of N ranks.")
    parser.add_argument("--world", type=int, required=True, help="the ranks the launch will start")
    known, rest = parser.parse_known_args()
    register()
    jobs = preflight(rest, remote_world=known.world)
    print(f"preflight: {len(jobs)} job(s) valid on {known.world} ranks")
