"""Parallelism, applied from outside to the plain model of model.py (torchtitan-style).

This file owns the device mesh, the functions that shard the model, the pieces of the training
step over the sharded model (ParallelModel.forward_backward, finish_gradients, optimizer_step) and
the ranks' agreement on its loss (agree), which train.py and clustermodel/rehearsal.py both run in
the same order. Joining the job's process group is launch.py's.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Callable, ContextManager, List, Optional

import torch
import torch.distributed as dist

from observe import spans
from errors import ConfigError
from model import ffn_width, kv_heads
from parallelisms.overlap import TPGroup, WaitClock
from parallelisms.pipeline import Pipeline, around, autocast, split_for_pipeline
from parallelisms.sharding import set_shard_info
from parallelisms.tensor_parallel import TPSettings, apply_tp, tp_shard_infos, vocab_parallel_cross_entropy
from parallelisms.zero import DEFAULT_BUCKET_SIZE, ZeroDataParallel, plan_buckets


@dataclass
class OverlapConfig:
    tp: str = "off"          # off | chunked | domino
    tp_chunks: int = 2
    pp: bool = False
    dp: bool = False


@dataclass
class ParallelConfig:
    tp: int = 1
    # Sequence parallelism (Korthikanti et al. 2022) under TP: each TP rank holds a slice of the
    # residual stream's sequence. false: Megatron-LM's TP before it, the stream replicated.
    sequence_parallel: bool = True
    pp: int = 1
    # Pipeline messages without SP: each TP rank sends 1/tp of the activation (or its gradient) and
    # the receiving stage all-gathers it over TP (Megatron-LM's scatter/gather, its default). Under
    # SP each rank sends its slice of the sequence anyway: no effect there, as in Megatron-LM.
    pp_scatter_gather: bool = True
    vpp: int = 1             # virtual pipeline stages per rank (interleaved 1F1B when > 1)
    # Layers of the model's first chunk (pipeline rank 0's first, its stage at vpp=1) and of its
    # last (rank pp-1's last); -1: n_layers/(pp*vpp) like every chunk. The other chunks share the
    # rest evenly. Llama 3 405B's 126 layers at pp=16: 7 and 7 (Meta's first and last stage one
    # layer short, for the embedding and the head), or 0 and 0 at vpp=8 (a chunk of the embedding
    # alone, one of the head alone). Megatron-LM's --decoder-first/last-pipeline-num-layers.
    pp_first_chunk_layers: int = -1
    pp_last_chunk_layers: int = -1
    dp: int = -1             # -1: whatever the world size leaves, world / (tp * pp)
    zero_stage: int = 0      # 0: replicated optimizer | 1: sharded optimizer state | 2: + sharded grads | 3: + params
    # Hybrid sharding (FSDP's HSDP; Megatron-LM's distributed-optimizer instances): ZeRO shards over
    # groups of dp_shard consecutive DP ranks and replicates across the dp/dp_shard groups (gradients
    # reduce-scattered in the shard group, then all-reduced across replicas). -1: all of dp.
    dp_shard: int = -1
    # ZeRO-3: free a module's gathered parameters after its forward and gather them again for its
    # backward (true, FSDP's default), or keep them from its first forward of the step to its last
    # backward (false: one gather a step, whatever the microbatches; Llama 3's choice under PP).
    reshard_after_forward: bool = True
    # ZeRO 2/3 without a pipeline: reduce-scatter each microbatch's gradients and add them to the
    # shard (true: DeepSpeed's ZeRO-2/3 and FSDP2's default; a full gradient buffer a bucket lives
    # for one microbatch's backward), or accumulate the whole buffer over the step's microbatches
    # and reduce once (false: Megatron-LM's distributed optimizer; torch's pipelining with FSDP2).
    reduce_each_microbatch: bool = False
    microbatches: int = 1    # per optimizer step and DP rank: pipeline microbatches, or accumulation
    # Mesh dims, outermost first. TP innermost makes a TP group consecutive ranks, i.e. one host
    # (NVLink); PP next (within a zone); DP outermost (across zones): topology-aware placement.
    order: List[str] = field(default_factory=lambda: ["dp", "pp", "tp"])
    # Gradients reduce in fp32, as Megatron-LM's default for bf16 (accumulate_allreduce_grads_in_fp32;
    # --grad-reduce-in-bf16 is its bf16 switch, parallel.reduce_dtype=bf16 here).
    reduce_dtype: str = "fp32"
    bucket_size: int = DEFAULT_BUCKET_SIZE   # elements per DP bucket (Megatron-LM's --ddp-bucket-size)
    overlap: OverlapConfig = field(default_factory=OverlapConfig)


def data_parallel_size(cfg: ParallelConfig, world: int) -> int:
    return cfg.dp if cfg.dp > 0 else max(1, world // (cfg.tp * cfg.pp))


def chunk_layers(n_layers: int, cfg: ParallelConfig) -> list:
    """Blocks of each of the model's pp*vpp chunks, in model order (virtual stage s on pipeline rank
    s % pp): the first and last as parallel.pp_first/last_chunk_layers say (-1: even), the others
    sharing the rest evenly. One ConfigError where they cannot."""
    chunks = cfg.pp * cfg.vpp
    first, last = cfg.pp_first_chunk_layers, cfg.pp_last_chunk_layers
    if first == -1 and last == -1:
        if n_layers % chunks:
            raise ConfigError("parallel.pp", f"pp*vpp={chunks} does not divide model.n_layers={n_layers}",
                              "choose pp and vpp whose product divides the layer count, or set "
                              "parallel.pp_first_chunk_layers and pp_last_chunk_layers")
        return [n_layers // chunks] * chunks
    if chunks < 2 or min(first, last) < -1:
        raise ConfigError("parallel.pp_first_chunk_layers", f"{first} and {last} with pp*vpp={chunks}",
                          "use them with pp*vpp >= 2, each -1 or a count of layers")
    inner = chunks - 2
    ends = [x for x in (first, last) if x >= 0]
    rest = n_layers - sum(ends)
    evenly = chunks - len(ends)  # chunks that share `rest`: the middle ones, and an end left at -1
    if rest < 0 or (evenly and rest % evenly) or (not evenly and rest) or (inner and evenly and rest // evenly == 0):
        raise ConfigError("parallel.pp_first_chunk_layers",
                          f"first {first} and last {last} leave {rest} of model.n_layers={n_layers} layers "
                          f"for {evenly} chunks (pp*vpp={chunks}), which must share them evenly, at least one each",
                          "choose first and last chunk layers that leave a multiple of the other chunks' number")
    each = rest // evenly if evenly else 0
    return [first if first >= 0 else each] + [each] * inner + [last if last >= 0 else each]


def rank_layers_most(cfg) -> int:
    """The most blocks one pipeline rank holds (virtual stages r, r+pp, ... on rank r)."""
    chunks, pp = chunk_layers(cfg.model.n_layers, cfg.parallel), cfg.parallel.pp
    return max(sum(chunks[r::pp]) for r in range(pp))


def validate(cfg, world: int, run: bool = True) -> None:
    """Layout checks against the model, batch and world size (and, for a run, what only a run
    needs: the overlap switches' chunk counts, dropout's limit without SP; the performance model
    prices those anyway); each failure is one ConfigError."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    for key in ("tp", "pp", "vpp", "microbatches"):
        if getattr(p, key) < 1:
            raise ConfigError(f"parallel.{key}", f"{getattr(p, key)} < 1", "use a positive degree")
    dp = data_parallel_size(p, world)
    if p.tp * p.pp * dp != world:
        raise ConfigError("parallel", f"tp*pp*dp = {p.tp}*{p.pp}*{dp} = {p.tp * p.pp * dp} but the world size is {world}",
                          "launch tp*pp*dp processes, or set parallel.dp=-1 to derive dp from the world size")
    if sorted(p.order) != ["dp", "pp", "tp"]:
        raise ConfigError("parallel.order", f"{list(p.order)} is not an order of dp, pp, tp",
                          "list all three, outermost first, e.g. parallel.order=[dp,pp,tp]")
    if p.zero_stage not in (0, 1, 2, 3):
        raise ConfigError("parallel.zero_stage", f"{p.zero_stage}", "use 0, 1, 2 or 3")
    if p.zero_stage == 3:
        if t.compile:
            raise ConfigError("train.compile", "true with parallel.zero_stage=3 is not supported yet (its "
                              "gather and free hooks run eager)", "use train.compile=false or auto (eager at ZeRO-3)")
    if p.dp_shard != -1 and (p.dp_shard < 1 or dp % p.dp_shard):
        raise ConfigError("parallel.dp_shard", f"{p.dp_shard} does not divide dp={dp}",
                          "use a divisor of the data-parallel size, or -1 to shard over all of it")
    if 1 <= p.dp_shard < dp and p.zero_stage == 0:
        raise ConfigError("parallel.dp_shard", f"{p.dp_shard} with parallel.zero_stage=0, which shards nothing",
                          "use parallel.zero_stage=1, 2 or 3, or parallel.dp_shard=-1")
    if p.reduce_each_microbatch and (p.zero_stage < 2 or p.pp > 1):
        raise ConfigError("parallel.reduce_each_microbatch", f"true with zero_stage={p.zero_stage} and pp={p.pp}: "
                          "only ZeRO 2/3 shard the gradients, and a pipeline interleaves its microbatches' backwards",
                          "use parallel.zero_stage=2 or 3 without pipeline parallelism, or set it false")
    if p.reduce_dtype not in ("fp32", "bf16"):
        raise ConfigError("parallel.reduce_dtype", f"{p.reduce_dtype!r}", "use fp32 or bf16")
    if m.n_heads % p.tp or m.d_model % p.tp or m.vocab_size % p.tp:
        raise ConfigError("parallel.tp", f"tp={p.tp} must divide model.n_heads={m.n_heads}, d_model={m.d_model} "
                          f"and vocab_size={m.vocab_size}", "choose tp that divides all three")
    if kv_heads(m) % p.tp and p.tp % kv_heads(m):  # a rank holds whole KV groups, or a share of one group's query heads
        raise ConfigError("parallel.tp", f"tp={p.tp} neither divides model.n_kv_heads={kv_heads(m)} nor is a multiple "
                          "of it, and a rank holds whole KV groups or one group shared evenly",
                          "choose parallel.tp that divides model.n_kv_heads or is a multiple of it")
    if ffn_width(m) % p.tp:
        raise ConfigError("parallel.tp", f"tp={p.tp} does not divide the MLP's width "
                          f"model.ffn_hidden_size={ffn_width(m)}", "choose tp that divides model.ffn_hidden_size")
    if p.tp > 1 and p.sequence_parallel and t.seq_len % p.tp:
        raise ConfigError("train.seq_len", f"sequence parallelism splits seq_len={t.seq_len} over tp={p.tp}",
                          "use a seq_len divisible by parallel.tp")
    if p.tp > 1 and not p.sequence_parallel and p.overlap.tp != "off":
        raise ConfigError("parallel.overlap.tp", f"{p.overlap.tp} overlaps sequence parallelism's all-gathers and "
                          "reduce-scatters, which parallel.sequence_parallel=false replaces by all-reduces",
                          "use parallel.overlap.tp=off or parallel.sequence_parallel=true")
    per_chunk = max(chunk_layers(m.n_layers, p))
    if t.recompute_layers > per_chunk:
        raise ConfigError("train.recompute_layers", f"{t.recompute_layers} layers but the largest model chunk "
                          f"holds {per_chunk} (parallel.chunk_layers)",
                          f"use train.recompute_layers<={per_chunk}, or -1 for every layer")
    if p.vpp > 1 and p.microbatches % p.pp:
        raise ConfigError("parallel.microbatches", f"interleaved 1F1B walks microbatches in groups of pp={p.pp}, "
                          f"and {p.microbatches} is not a multiple", "use a multiple of parallel.pp microbatches")
    if t.batch_size % (dp * p.microbatches):
        raise ConfigError("train.batch_size", f"{t.batch_size} is not divisible by dp*microbatches={dp}*{p.microbatches}",
                          "use a global batch that is a multiple of dp*parallel.microbatches")
    if run:
        validate_overlap(cfg, dp)
        # Replicated over TP, the stream's dropout would need one mask on every TP rank (Megatron-LM's
        # RNG tracker); each rank draws its own here (train.seed_generators).
        if p.tp > 1 and not p.sequence_parallel and m.dropout > 0:
            raise ConfigError("model.dropout", f"{m.dropout} with parallel.sequence_parallel=false: the replicated stream's "
                              "dropout masks would differ across TP ranks", "use model.dropout=0 or parallel.sequence_parallel=true")


def validate_overlap(cfg, dp: int) -> None:
    """The overlap switches against the layout: a run checks them; the performance model prices
    any chunk count."""
    p, t = cfg.parallel, cfg.train
    if p.overlap.tp not in ("off", "chunked", "domino"):
        raise ConfigError("parallel.overlap.tp", f"unknown value {p.overlap.tp!r}", "use off, chunked or domino")
    k = p.overlap.tp_chunks
    if p.tp > 1 and p.overlap.tp == "chunked" and (k < 1 or t.seq_len % (p.tp * k)):
        raise ConfigError("parallel.overlap.tp_chunks", f"chunked cuts each rank's seq_len/tp = {t.seq_len}/{p.tp} "
                          f"tokens into {k} pieces", "use a chunk count that divides seq_len/tp")
    rows = t.batch_size // (dp * p.microbatches)
    if p.tp > 1 and p.overlap.tp == "domino" and (k < 1 or rows % k):
        raise ConfigError("parallel.overlap.tp_chunks", f"domino cuts each microbatch's {rows} rows "
                          f"(batch_size/(dp*microbatches)) into {k} pieces", "use a chunk count that divides the rows")


# --- Layout: where this rank sits in the (dp, pp, tp) mesh ---

@dataclass
class Layout:
    rank: int = 0
    world: int = 1
    dp: int = 1
    dp_rank: int = 0
    pp: int = 1
    pp_rank: int = 0
    tp: int = 1
    tp_rank: int = 0
    # Hybrid sharding: ZeRO's shard group, dp_shard consecutive DP ranks (None: all of dp). The
    # dp/dp_shard groups replicate each other: dp_replicate_rank says which of them this rank's is.
    dp_shard: Optional[int] = None
    mesh: Optional[object] = None          # torch DeviceMesh, or None for a single process
    # The mesh with dp split into (dp_replicate, dp_shard): only where 1 <= dp_shard < dp
    zero_mesh: Optional[object] = field(default=None, repr=False)
    setup_seconds: float = 0.0             # time to build every process group
    group_options: Optional[object] = None  # the backend's options every group gets (its timeout)
    pp_channels: dict = field(default_factory=dict)  # pipeline messages: (kind, direction) -> group
    clock: WaitClock = field(default_factory=WaitClock)  # where this rank's step goes: every wait is timed on it
    _tp_group: Optional[TPGroup] = field(default=None, repr=False)
    _tp_replica_groups: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.dp_shard is None:
            self.dp_shard = self.dp

    @property
    def dp_shard_rank(self) -> int:
        return self.dp_rank % self.dp_shard

    @property
    def dp_replicate(self) -> int:
        return self.dp // self.dp_shard

    @property
    def dp_replicate_rank(self) -> int:
        return self.dp_rank // self.dp_shard

    def group(self, dim: str):
        """The process group of one mesh dimension, or of ZeRO's split of dp: dp_shard, dp_replicate
        (None when single-process, and dp_replicate without hybrid sharding, where it is one rank).
        Without hybrid sharding dp_shard is the dp group itself: no group of its own."""
        if self.mesh is None:
            return None
        if dim in ("dp_shard", "dp_replicate"):
            if self.zero_mesh is not None:
                return self.zero_mesh.get_group(dim)
            return self.mesh.get_group("dp") if dim == "dp_shard" else None
        return self.mesh.get_group(dim)

    @property
    def tp_group(self) -> TPGroup:
        """The TP group as the sequence-parallel collectives use it (overlap.TPGroup), one a rank."""
        if self._tp_group is None:
            self._tp_group = TPGroup(self.group("tp"), self.tp, self.clock)
        return self._tp_group

    def tp_replica_group(self, replicas: int):
        """The process group of this rank's run of `replicas` consecutive TP ranks, which hold the
        same tensor and sum its gradient (sharding's ShardInfo.tp_replicas): the TP group itself
        when replicas == tp. The first call makes every TP group's runs, as DeviceMesh makes its
        groups: every rank must make it, at the same point and in the same order (NCCL's rule)."""
        if replicas == self.tp or self.mesh is None:
            return self.group("tp")
        if replicas not in self._tp_replica_groups:
            names = self.mesh.mesh_dim_names
            tp_groups = self.mesh.mesh.movedim(names.index("tp"), -1).reshape(-1, self.tp)
            runs = tp_groups.reshape(-1, replicas).tolist()
            self._tp_replica_groups[replicas], _ = dist.new_subgroups_by_enumeration(
                runs, timeout=None if self.group_options is None else self.group_options._timeout)
        return self._tp_replica_groups[replicas]

    def coordinates(self) -> dict:
        return {"rank": self.rank, "dp": self.dp_rank, "pp": self.pp_rank, "tp": self.tp_rank}

    def all_coordinates(self) -> list:
        """Every rank's coordinates, for run.json (one all_gather_object at start-up)."""
        if self.world == 1:
            return [self.coordinates()]
        found = [None] * self.world
        dist.all_gather_object(found, self.coordinates())
        return found


def build_layout(cfg: ParallelConfig, rank: int, world: int, device: torch.device,
                 timeout_s: Optional[float] = None) -> Layout:
    """One DeviceMesh over the dims in cfg.order (outermost first). init_device_mesh creates every
    dimension's groups in one pass with no per-group global barrier: MegaScale cut process-group
    set-up on 2,048 GPUs from 1047 s to under 5 s by avoiding exactly those barriers. With NCCL
    and a device bound at init (launch.init_distributed), each dimension is one ncclCommSplit of
    the world's communicator. Every group gets the world's timeout (timeout_s): new_group's own
    default is torch's (10 min for NCCL, 30 for gloo), whatever the world group was given."""
    import time
    dp = data_parallel_size(cfg, world)
    sizes = {"dp": dp, "pp": cfg.pp, "tp": cfg.tp}
    layout = Layout(rank=rank, world=world, dp=dp, pp=cfg.pp, tp=cfg.tp,
                    dp_shard=cfg.dp_shard if cfg.dp_shard > 0 else dp)
    if world == 1:
        return layout
    from torch.distributed.device_mesh import init_device_mesh
    names = tuple(cfg.order)
    layout.group_options = group_options(timeout_s)
    # A dimension over every rank is the world group itself (init_device_mesh reuses it unless
    # given options), so only the smaller ones get the options.
    override = {n: layout.group_options for n in names if layout.group_options is not None and sizes[n] < world}
    t0 = time.perf_counter()
    layout.mesh = init_device_mesh(device.type, tuple(sizes[n] for n in names), mesh_dim_names=names,
                                   backend_override=override or None)
    if cfg.pp > 1:
        layout.pp_channels = _pipeline_channels(layout.mesh, names, timeout_s)
    if layout.dp_shard < dp:
        layout.zero_mesh = _hybrid_sharding_mesh(layout)
    layout.setup_seconds = time.perf_counter() - t0
    coords = layout.mesh.get_coordinate()
    for name, coord in zip(names, coords):
        setattr(layout, f"{name}_rank", coord)
    return layout


def _hybrid_sharding_mesh(layout: Layout):
    """The mesh with its dp dim split in place into (dp_replicate, dp_shard), dp_shard innermost:
    DP coordinate d is shard rank d % dp_shard of replica d // dp_shard. DeviceMesh makes the two
    new dims' groups (the others are the mesh's own), every rank all of them in the same order;
    a rank joins one of each."""
    options = layout.group_options
    override = None if options is None else {"dp_replicate": options, "dp_shard": options}
    return layout.mesh._unflatten("dp", (layout.dp_replicate, layout.dp_shard), ("dp_replicate", "dp_shard"),
                                  backend_override=override)


def group_options(timeout_s: Optional[float]):
    """The default backend's options carrying `timeout_s` (None: torch's defaults; the rehearsal's
    fake backend takes none)."""
    backend = dist.get_backend()
    if timeout_s is None or backend not in ("nccl", "gloo"):
        return None
    options = dist.ProcessGroupNCCL.Options() if backend == "nccl" else dist.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=timeout_s)
    return options


def _pipeline_channels(mesh, names: tuple, timeout_s: Optional[float] = None) -> dict:
    """One process group per kind of pipeline message and direction, over the same ranks as the
    mesh's pp groups (parallelisms/pipeline.py says why NCCL needs them apart). The mesh's own pp group carries
    activations to the next rank; three copies carry the rest. Every rank creates every copy, in
    the same order, as DeviceMesh does for its own groups."""
    pp_dim = names.index("pp")
    grid = mesh.mesh.movedim(pp_dim, -1).reshape(-1, mesh.mesh.shape[pp_dim]).tolist()
    channels = {("A", "up"): mesh.get_group("pp")}
    for key in (("A", "down"), ("G", "up"), ("G", "down")):
        channels[key], _ = dist.new_subgroups_by_enumeration(
            grid, timeout=None if timeout_s is None else datetime.timedelta(seconds=timeout_s))
    return channels


def tp_settings(layout: Layout, cfg: ParallelConfig) -> TPSettings:
    return TPSettings(group=layout.tp_group, rank=layout.tp_rank, size=layout.tp, overlap=cfg.overlap.tp,
                      pieces=cfg.overlap.tp_chunks, sequence_parallel=cfg.sequence_parallel)


def apply_recompute(model: torch.nn.Module, mode: str, layers: int = -1) -> None:
    """full: store only each block's input and recompute the block in backward. selective: recompute
    only attention's core (Korthikanti et al. 2022), whose activations are the largest per FLOP.
    layers (full only): how many of the chunk's blocks recompute, its first ones, the rest keeping
    their activations (Megatron-LM's block method, per model chunk; a chunk of fewer blocks, under
    parallel.pp_first/last_chunk_layers, recomputes all of them); -1: every block.
    The model runs torch.utils.checkpoint where its switches say (Block.recompute,
    Attention.recompute_core), which dynamo traces into a compiled graph; a TP block takes its
    plain block's switch, so TP and recompute apply in either order."""
    blocks = list(model.blocks.values())
    for i, block in enumerate(blocks):
        if mode == "full":
            block.recompute = layers < 0 or i < layers
        elif mode == "selective":
            block.attn.recompute_core = True


def parallelize(chunk: torch.nn.Module, layout: Layout, cfg: ParallelConfig, recompute: str = "none",
                recompute_layers: int = -1) -> None:
    """TP, then activation recomputation, in place (torchtitan's order)."""
    if layout.tp > 1:
        apply_tp(chunk, tp_settings(layout, cfg))
    if recompute != "none":
        apply_recompute(chunk, recompute, recompute_layers)


# --- This rank's share of the model, and the collectives its training step needs ---

class ParallelModel:
    """The model as this rank holds it: TP shards, PP chunks, ZeRO optimizer shards. A training step
    calls forward_backward, finish_gradients, then optimizer_step, whatever the layout."""

    def __init__(self, model: torch.nn.Module, layout: Layout, cfg: ParallelConfig, recompute: str = "none",
                 fused: bool = False, dtype: torch.dtype = torch.float32, device=None, seed: int = 0,
                 recompute_layers: int = -1):
        """model: built on the meta device (or real, for tests). Nothing is materialized before it
        is cut to this rank's chunks and TP slices; then only those are, on `device`, initialized
        from `seed` (model.init_weights: the same values as one process would hold), unless
        `device` is meta too (a rehearsal). dtype: the parameters' dtype (bf16 under
        precision=bf16: Megatron's mixed precision, with fp32 master weights in parallelisms/zero.py, so no
        microbatch casts the weights again)."""
        self.layout, self.cfg, self.fused = layout, cfg, fused
        # compile() of a step without pipeline or TP: the microbatch's forward and loss as one graph
        self.compiled_loss: Optional[Callable] = None
        self._cuda_graphs = False  # compile(mode="reduce-overhead"): the compiled step replays CUDA graphs
        # Hooks around each unit of compute: the whole forward and backward without a pipeline, each
        # pipeline action with one. Each is called with `backward` (False in evaluation) and returns a
        # context manager; the first is the outermost. Set once, before the first step (train.py:
        # the straggler detector's timing, the slow:/spike: faults).
        self.around_compute: List[Callable[[bool, Optional[tuple]], ContextManager]] = []
        on_meta = next(model.parameters()).is_meta
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        # Split first: TP and recompute apply to the modules each chunk really holds.
        self.chunks = split_for_pipeline(model, layout, chunk_layers(len(model.blocks), cfg))
        for chunk in self.chunks:
            parallelize(chunk, layout, cfg, recompute, recompute_layers)
            _materialize(chunk, layout, cfg, dtype, self.device if on_meta else None, seed)
        named = self.named_model_parameters()
        self.names = [n for n, _ in named]
        params = [p for _, p in named]
        reduce_dtype = torch.float32 if cfg.reduce_dtype == "fp32" else torch.bfloat16
        modules = self._forward_modules(params)
        buckets = plan_buckets([m[0] for m in modules], params, cfg.bucket_size,
                               per_module=cfg.overlap.dp or cfg.zero_stage == 3)  # ZeRO-3 frees module by module
        self.zero = ZeroDataParallel(params, layout, cfg.zero_stage, reduce_dtype, buckets, cfg.microbatches,
                                     overlap=cfg.overlap.dp, reshard_after_forward=cfg.reshard_after_forward,
                                     each_microbatch=cfg.reduce_each_microbatch)
        self.zero.attach(modules)
        self.pipeline = Pipeline(self.chunks, layout, overlap=cfg.overlap.pp,
                                 after_backward=self.zero.backward_done,
                                 sequence_parallel=cfg.sequence_parallel,
                                 scatter_gather=cfg.pp_scatter_gather) if layout.pp > 1 else None
        self.norm_group = _norm_group(layout)

    def _forward_modules(self, params: list) -> list:
        """The modules in the order forward first uses their parameters, each with the registration
        of the hook that must run before that use and of the one after its forward (where ZeRO-3
        frees them): the embedding and each block wait in their own pre-hook; the final norm (run
        as a function, so it has no hook of its own) and the head wait in the post-hook of the
        last block, before the norm reads its weights (in a chunk of no block, the chunk's own
        pre-hook), and stay gathered for their backward, which comes next (FSDP keeps its root's
        the same way)."""
        index = {id(p): i for i, p in enumerate(params)}
        modules = []
        for chunk in self.chunks:
            blocks = list(chunk.blocks.values())
            if chunk.embed is not None:
                modules.append(([index[id(chunk.embed.weight)]], chunk.embed.register_forward_pre_hook,
                                chunk.embed.register_forward_hook))
            for block in blocks:
                modules.append(([index[id(p)] for p in block.parameters()], block.register_forward_pre_hook,
                                block.register_forward_hook))
            tail = [index[id(p)] for m in (chunk.norm, chunk.head) if m is not None for p in m.parameters()]
            if tail:  # kept gathered from its forward to its backward (False: no reshard_after_forward)
                modules.append((tail, _before_tail(chunk),
                                chunk.head.register_forward_hook if chunk.head is not None else None, False))
        return modules

    def compile(self, **options) -> str:
        """train.compile=true. Without pipeline or TP stages: one graph of the microbatch's forward
        and loss (so inductor fuses the head's GEMM output into the cross-entropy, and AOTAutograd
        compiles their backward with it). Otherwise every chunk in place (nn.Module.compile), the
        loss eager: the pipeline schedule calls the chunks, and TP's vocab-parallel loss holds
        collectives. Either way the modules stay those the DP hooks and the checkpoint's parameter
        names were given. Returns what was compiled, for the log line."""
        self.zero.mark_hooks_traced()
        if self.pipeline is None and self.layout.tp == 1:
            self.compiled_loss = torch.compile(self._forward_and_loss, **options)
            self._cuda_graphs = options.get("mode") == "reduce-overhead"
            return "forward, loss and backward, one graph"
        for chunk in self.chunks:
            chunk.compile(**options)
        return "each chunk's forward and backward (the loss eager)"

    def microbatch_loss(self, x, y):
        """One microbatch's loss (no pipeline): the compiled graph where compile() made one, else eager."""
        if self.compiled_loss is not None:
            return self.compiled_loss(x, y)
        return self._forward_and_loss(x, y)

    def _forward_and_loss(self, x, y):
        return self.loss_fn(self.chunks[0](x), y)

    def named_model_parameters(self) -> list:
        seen, named = set(), []
        for chunk in self.chunks:
            for name, p in chunk.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    named.append((name, p))
        return named

    def named_optimizer_parameters(self) -> list:
        """What the optimizer updates: the parameters (ZeRO-0) or this rank's shards of them."""
        return list(zip(self.names, self.zero.shards))

    def loss_fn(self, logits, targets):
        if self.layout.tp > 1:
            return vocab_parallel_cross_entropy(logits, targets, tp_settings(self.layout, self.cfg))
        import kernels
        return kernels.cross_entropy(logits, targets, fused=self.fused)

    def forward_backward(self, inputs, targets, autocast_dtype, backward: bool = True) -> torch.Tensor:
        """Loss of this rank's batch (mean over microbatches), gradients accumulated. Returns the
        loss on the last pipeline stage and 0 elsewhere, as a 0-d tensor on the device: the host
        reads it once per step, with everything else it reads (train.py)."""
        for chunk in self.chunks:
            if chunk.training != backward:  # (train() walks every module: once per switch, not per step)
                chunk.train(backward)
        xs, ys = inputs.chunk(self.cfg.microbatches), targets.chunk(self.cfg.microbatches)
        if self.pipeline is not None:
            loss = self.pipeline.run(list(xs), list(ys), self.loss_fn, autocast_dtype, backward, self.around_compute)
            if self.zero.stage == 3:  # (evaluation leaves the tails gathered)
                self.zero.release()
            return loss
        with around(self.around_compute, backward):
            return self._accumulate(xs, ys, autocast_dtype, backward)

    def _accumulate(self, xs, ys, autocast_dtype, backward: bool) -> torch.Tensor:
        """Forward (and backward) of each microbatch in turn, gradients accumulated; the summed loss."""
        total = None  # (one microbatch: its loss as it is, no zeros, no division by 1, no add)
        for mb, (x, y) in enumerate(zip(xs, ys)):
            if self._cuda_graphs:  # each microbatch a new replay: the last one's outputs are used up
                torch.compiler.cudagraph_mark_step_begin()
            with autocast(x.device, autocast_dtype), torch.set_grad_enabled(backward), \
                    spans.segment(spans.action_name(("F", mb, 0)), x.device):
                loss = self.microbatch_loss(x, y)
                loss = loss / len(xs) if len(xs) > 1 else loss
            if backward:
                with spans.segment(spans.action_name(("B", mb, 0)), x.device):
                    loss.backward()
                self.zero.backward_done()
            self.zero.microbatch_done(backward, last=mb == len(xs) - 1)
            kept = loss.detach().clone() if self._cuda_graphs else loss.detach()  # a replay reuses its outputs' memory
            total = kept if total is None else total + kept
        return total

    def finish_gradients(self, max_norm: float) -> torch.Tensor:
        """TP then DP reductions, then clipping by the global norm over every shard of every
        parameter, each element counted once, on the device with no host read. Returns the norm
        before clipping (a 0-d tensor)."""
        import optim
        self.zero.reduce_gradients()
        shards = [s for s in self.zero.shards if s.grad is not None]
        squares = optim.grad_squares(shards, self.device)
        if self.layout.world > 1:
            with self.layout.clock.waiting("comm", self.device):
                dist.all_reduce(squares)
        norm = squares.sqrt()
        optim.scale_grads_(shards, norm, max_norm)
        return norm

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The update from the finished gradients, then ZeRO's parameter all-gather (and the
        gradient buffers zeroed for the next step)."""
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        for p in self.zero.params:
            p.grad = None
        self.zero.after_step()

    def parameters_loaded(self) -> None:
        """After a checkpoint load: the parameters and the optimizer's shards agree again."""
        self.zero.parameters_loaded()


def _before_tail(chunk: torch.nn.Module) -> Callable:
    """The registration of the hook that runs just before `chunk`'s final norm reads its weights:
    its last block's forward hook, or with no block (parallel.pp_last_chunk_layers=0) the chunk's
    own forward pre-hook, its input then going straight to the norm. (The embedding cannot come
    before the norm in the same chunk: a model of pp*vpp >= 2 chunks has them apart.)"""
    blocks = list(chunk.blocks.values())
    return blocks[-1].register_forward_hook if blocks else chunk.register_forward_pre_hook


def _materialize(chunk: torch.nn.Module, layout: Layout, cfg: ParallelConfig, dtype: torch.dtype,
                 device: Optional[torch.device], seed: int) -> None:
    """This rank's chunk in `dtype`; if it was built on the meta device, its parameters on `device`,
    initialized (not on meta: a rehearsal keeps shapes only) with the values one process would
    hold (device None: the chunk holds its values already). Then each TP slice gets its
    sharding.ShardInfo, after to_empty, which makes new parameters."""
    chunk.to(dtype)  # on meta first: the shard is materialized in its own dtype, never in fp32
    infos = tp_shard_infos(chunk, tp_settings(layout, cfg)) if layout.tp > 1 else {}
    if device is not None:
        chunk.to_empty(device=device)
        if device.type != "meta":
            chunk.init_weights(seed, slices={n: (i.split_dim, i.offset) for n, i in infos.items()
                                             if i.split_dim is not None})
    for name, p in chunk.named_parameters():
        if name in infos:
            set_shard_info(p, infos[name])


def _norm_group(layout: Layout):
    """LAMB's per-tensor norms are summed over the ranks holding pieces of the same tensors: the
    dp x tp ranks of one pipeline stage (other stages hold other tensors)."""
    if layout.world == 1 or layout.mesh is None:  # (no mesh: a shard built alone, experiments/build_rank.py)
        return None
    if layout.pp == 1:
        return dist.group.WORLD
    return layout.mesh["dp", "tp"]._flatten("dp_tp", backend_override=layout.group_options).get_group()


def build(model: torch.nn.Module, layout: Layout, cfg: ParallelConfig, recompute: str = "none",
          fused: bool = False, dtype: torch.dtype = torch.float32, device=None, seed: int = 0,
          recompute_layers: int = -1) -> ParallelModel:
    return ParallelModel(model, layout, cfg, recompute, fused, dtype, device, seed, recompute_layers)


# --- The ranks' agreement on the step's loss: train.py runs it, and clustermodel/rehearsal.py
# rehearses the very same code ---

def agree(loss: torch.Tensor, stop: bool, layout, grad_norm: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Sum the loss over ranks (it lives on the last pipeline stage, on each of its tp ranks: the
    reader divides by dp*tp) and the stop flag over all ranks, in one all-reduce on the device:
    every rank must stop at the same step or the others hang in a collective. The grad norm (the
    same on every rank already) rides along, so the host reads all three at once."""
    # The flag is filled on the device (a kernel argument), not copied there from host memory.
    t = torch.stack([loss.float(), torch.full((), float(stop), dtype=torch.float32, device=loss.device)])
    if layout.world > 1:
        with layout.clock.waiting("bubble", loss.device):  # mostly waiting for the slowest rank (a pipeline's last stage)
            dist.all_reduce(t)
    return t if grad_norm is None else torch.cat([t, grad_norm.float().reshape(1)])


def read_agreed(agreed: torch.Tensor, layout) -> tuple:
    """The host read of agree's result: (mean loss, stop flag[, grad norm])."""
    with spans.segment("agreed read"):  # the host's wait for the step's device work
        values = agreed.tolist()
    values[0] /= layout.dp * layout.tp
    values[1] = values[1] > 0
    return tuple(values)
