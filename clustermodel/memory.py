"""The performance model's memory per GPU: weights, gradients and optimizer states by ZeRO stage,
activations by schedule and recomputation, and what a layer's backward (or the head's) has in
flight at the peak. perfmodel.py prices the step's time and reads its memory from here; the
rehearsal (rehearsal.py) measures the same on the meta device, and tests/test_rehearsal.py holds
the two together.

Counted per rank: the first and the last pipeline rank (the fuller one is the job's), as model.py
and parallelisms/zero.py build them: bf16 weights with fp32 gradient buffers and fp32 master and moments, the
in-flight microbatches of 1F1B or interleaved 1F1B, and under TP the weight-gradient GEMMs
accumulating straight into the gradient buffer (no weight gradient waits in the backward).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import config
import machine
import model as gpt
from clustermodel.layout import JobLayout
from kernels import banded_keys
from parallelisms.zero import REDUCTIONS_IN_FLIGHT


def precision(cfg: config.Config) -> str:
    """bf16 or fp32 (predict() has already decided precision=auto; see resolve_config)."""
    return "fp32" if cfg.precision == "fp32" else "bf16"


def element_bytes(cfg: config.Config) -> int:
    """Bytes of an activation or weight element in the compute dtype."""
    return 2 if precision(cfg) == "bf16" else 4


MATERIALIZED = ("unfused", "reference")  # attention backends that keep the [T, T] probabilities


# --- The block's shapes, as model.Block builds them (GPT: LayerNorm, GeLU MLP of 4h, q k v of h each;
# Llama: RMSNorm, SwiGLU of three h x ffn matrices, k and v of n_kv_heads heads) ---

def stream_shards(cfg: config.Config, tp: int) -> int:
    """Over how many ranks the residual stream (norms, dropout, residual adds, pipeline messages)
    is split: the TP group under sequence parallelism, else none (replicated over TP)."""
    return tp if cfg.parallel.sequence_parallel else 1


def pp_message_shards(cfg: config.Config, tp: int) -> int:
    """Over how many ranks a pipeline message (an activation or its gradient) is split on the wire:
    the stream's shards under sequence parallelism; without it the TP group under
    parallel.pp_scatter_gather (each rank sends 1/tp, the receiver all-gathers it over TP), else none."""
    return tp if cfg.parallel.sequence_parallel or cfg.parallel.pp_scatter_gather else 1


def pp_gathers(cfg: config.Config, tp: int) -> bool:
    """Whether a received pipeline message is all-gathered over TP (scatter/gather without SP)."""
    return tp > 1 and not cfg.parallel.sequence_parallel and cfg.parallel.pp_scatter_gather


def kv_width(m: gpt.ModelConfig) -> int:
    """Features of k (and of v) per token: n_kv_heads heads (grouped-query attention), h without it."""
    return gpt.kv_heads(m) * gpt.head_dim(m)


def swiglu(m: gpt.ModelConfig) -> bool:
    return m.mlp == "swiglu"


def block_matrices(m: gpt.ModelConfig, tp: int = 1) -> Dict[str, Tuple[int, int]]:
    """One block's weight matrices on one TP rank, (output, input) features: the fused q|k|v
    projection and fc_in (SwiGLU: gate and up in one) split by rows, out and fc_out by columns."""
    h, ff = m.d_model, gpt.ffn_width(m)
    return {"qkv": ((h + 2 * kv_width(m)) // tp, h), "out": (h, h // tp),
            "fc1": ((2 if swiglu(m) else 1) * ff // tp, h), "fc2": (h, ff // tp)}


def norm_params(m: gpt.ModelConfig) -> int:
    """A norm's parameters: LayerNorm's weight and bias (without bias: weight), RMSNorm's weight."""
    return m.d_model * (1 + int(m.bias and m.norm == "layernorm"))


def mlp_kept(cfg: config.Config) -> int:
    """Values per token (whole, before TP) the MLP keeps for its backward. GeLU: fc_in's output and
    the GeLU's. SwiGLU: fc_in's output (gate and up), silu(gate) and the product fc_out reads; the
    Triton kernel (kernels.fused=triton) recomputes silu(gate) in its backward. A compiled step's
    is counted as eager code keeps it, as the rehearsal counts it: what inductor recomputes
    instead of keeping is its own choice (an upper bound by ffn values a token)."""
    ff = gpt.ffn_width(cfg.model)
    if not swiglu(cfg.model):
        return 2 * ff
    return (3 if cfg.kernels.fused == "triton" else 4) * ff


def layer_params(m: gpt.ModelConfig, tp: int = 1) -> Tuple[int, int]:
    """(split over TP, replicated) parameters of one block, counted as model.Block builds them."""
    b, whole = int(m.bias), block_matrices(m)
    split = sum(n * k for n, k in whole.values()) // tp + b * (whole["qkv"][0] + whole["fc1"][0]) // tp
    norms = 1 if m.block == "parallel" else 2
    return split, b * 2 * m.d_model + norms * norm_params(m)


def rank_params(m: gpt.ModelConfig, lay: JobLayout) -> Tuple[int, int]:
    """Parameters held by the first and the last pipeline rank (the same rank when pp=1), each
    with its own blocks (uneven chunks: lay.chunks)."""
    split, replicated = layer_params(m, lay.tp)
    body, last_body = (lay.rank_layers(r, m.n_layers) * (split + replicated) for r in (0, lay.pp - 1))
    embed = m.vocab_size * m.d_model // lay.tp
    head = m.vocab_size * m.d_model // lay.tp + norm_params(m)
    return (body + embed + head, body + embed + head) if lay.pp == 1 else (body + embed, last_body + head)


def rank_modules(cfg: config.Config, lay: JobLayout, rank: int) -> List[int]:
    """Parameters of each module pipeline rank `rank` runs, in forward order: the embedding on the
    first rank, its blocks, the final norm with the head on the last."""
    split, replicated = layer_params(cfg.model, lay.tp)
    vocab = cfg.model.vocab_size * cfg.model.d_model // lay.tp
    modules = [vocab] if rank == 0 else []
    modules += [split + replicated] * lay.rank_layers(rank, cfg.model.n_layers)
    return modules + ([vocab + norm_params(cfg.model)] if rank == lay.pp - 1 else [])


def gathered_params(cfg: config.Config, lay: JobLayout, rank: int) -> int:
    """ZeRO-3: parameters a rank holds gathered at its peak. Resharding: the module computing and
    the one prefetched (DP overlap); the head, kept from its forward to its backward, with the last
    block, or under a pipeline, which runs other actions in between, beside any two. Without
    resharding: every module, gathered by the end of the first microbatch's forward and kept to
    the step's last backward."""
    modules = rank_modules(cfg, lay, rank)
    if not lay.reshard:
        return sum(modules)
    kept = 0
    if lay.pp > 1 and rank == lay.pp - 1 and len(modules) > 1:  # a schedule runs other actions between the
        kept, modules = modules[-1], modules[:-1]                   # head's forward and backward: it stays
    if not cfg.parallel.overlap.dp or len(modules) == 1:
        return kept + max(modules)
    return kept + max(a + b for a, b in zip(modules, modules[1:]))


def retires_gradients(cfg: config.Config, lay: JobLayout) -> bool:
    """ZeRO 2/3 with DP overlap and one microbatch, or reducing each microbatch
    (parallel.reduce_each_microbatch): a bucket's full gradient buffer goes as soon as
    its reduce-scatter is in (zero.ZeroDataParallel._retire): a rank holds a few modules' full
    buffers at a time (in_flight_gradients) beside the shards, not its whole gradient."""
    return lay.zero >= 2 and cfg.parallel.overlap.dp and (lay.microbatches == 1 or lay.reduce_each)


def in_flight_gradients(cfg: config.Config, lay: JobLayout, rank: int) -> int:
    """Gradient elements in full buffers at most, when they are retired: the module in backward
    (its buckets fill as its gradients come) and the REDUCTIONS_IN_FLIGHT buckets launched before
    it, whose reduce-scatters may still run (a bucket: parallel.bucket_size elements at most, or
    a module). An upper bound: the code's peak comes early in the backward, nearer one module."""
    modules = rank_modules(cfg, lay, rank)
    largest = max(modules)
    return min(sum(modules), largest + REDUCTIONS_IN_FLIGHT * min(cfg.parallel.bucket_size, largest))


def activation_bytes(cfg: config.Config, tp: int, seq: int) -> float:
    """Bytes one layer keeps per token for its backward (no recomputation); cf. Korthikanti et al.
    2022. Under SP, norm inputs and outputs are split over TP like the heads; without SP, they and
    the dropout masks are whole on every TP rank."""
    m, e = cfg.model, element_bytes(cfg)
    h, kv = m.d_model, kv_width(m)
    norms = 1 if m.block == "parallel" else 2
    # norm in/out, the q k v projection (alive while v, a view of it, is), q and k after RoPE,
    # attention out, the MLP's (mlp_kept). Materialized attention under GQA repeats k and v to
    # every query head first (kernels._repeat_kv) and keeps those copies instead: the projection
    # and k after RoPE then go once the forward is past them.
    heads = 3 * h if cfg.kernels.attention in MATERIALIZED and kv < h else (h + 2 * kv) + (h + kv)
    kept = 2 * norms * h + heads + h + mlp_kept(cfg)
    masks = (1 if m.block == "parallel" else 2) * h if m.dropout else 0   # residual dropout, a byte each
    if stream_shards(cfg, tp) == 1 and tp > 1:  # the norms' inputs and outputs and the masks whole (tp times, over tp)
        kept, masks = kept - 2 * norms * h, tp * (e * 2 * norms * h + masks)
    if cfg.kernels.attention in MATERIALIZED:  # the probabilities (and after dropout, the kept ones and the mask)
        return (e * kept + masks) / tp + square_bytes(cfg) * m.n_heads / tp * seq
    # A fused kernel keeps its own output beside the rearranged copy the output projection reads,
    # and a log-sum-exp per row; the banded kernel also its keys and values as [heads, T, d] copies
    # (its windows are views of them).
    kept += h + (2 * h if cfg.kernels.attention == "banded" and banded_keys(cfg.model.attention.window, cfg.kernels.attention_block, seq) else 0)
    return (e * kept + masks) / tp + 4 * m.n_heads / tp


def recomputed_layers(cfg: config.Config, pp: int, vpp: int) -> Tuple[int, int]:
    """(blocks of a model chunk that recompute in full, blocks of a chunk): a chunk holds
    n_layers/(pp*vpp) blocks, and train.recompute=full recomputes the first train.recompute_layers
    of them (-1: all; parallel.apply_recompute), none under another train.recompute."""
    per_chunk = cfg.model.n_layers // (pp * vpp)
    if cfg.train.recompute != "full":
        return 0, per_chunk
    layers = cfg.train.recompute_layers
    return (per_chunk if layers < 0 else min(layers, per_chunk)), per_chunk


def recomputes_every_layer(cfg: config.Config) -> bool:
    """Full recomputation of every block (train.recompute=full, recompute_layers -1 or a whole chunk)."""
    n, per_chunk = recomputed_layers(cfg, cfg.parallel.pp, cfg.parallel.vpp)
    return cfg.train.recompute == "full" and n == per_chunk


def compiled_keeps_gathered(cfg: config.Config) -> bool:
    """Whether the TP blocks keep their gathered inputs whole: compiled, under TP overlap, without
    full recomputation of every block (compiled_gather_bytes); their backward then gathers nothing
    again (a recomputed block's forward gathers them anew)."""
    return cfg.parallel.overlap.tp in ("chunked", "domino") and not recomputes_every_layer(cfg) and machine.compiles(cfg)


def compiled_gather_bytes(cfg: config.Config, tp: int) -> float:
    """Bytes per token a layer keeps beyond activation_bytes when torch.compile traces its TP
    block: dynamo runs overlap.TPGroup.regather_saved as a no-op, so under TP overlap (chunked, domino)
    each gathered norm output is saved whole, tp times its shard, beside the shard its re-gather
    still holds (overlap.TPGroup.gathered), as the rehearsal of a compiled job counts (overlap.tp=off
    keeps the shard in GatheredLinears, compiled or not; full recomputation keeps none)."""
    if tp == 1 or not compiled_keeps_gathered(cfg):
        return 0.0
    norms = 1 if cfg.model.block == "parallel" else 2
    return element_bytes(cfg) * norms * cfg.model.d_model


def square_bytes(cfg: config.Config) -> int:
    """Bytes per score that materialized attention keeps for its backward: the probabilities, and
    with dropout also the kept probabilities and the byte mask."""
    e = element_bytes(cfg)
    return e + (e + 1 if cfg.model.dropout else 0)


def backward_working_set(cfg: config.Config, lay: JobLayout) -> float:
    """Bytes a layer's backward has in flight on top of what is kept, where the peak falls (in the
    MLP's backward): at tp=1 its weight gradients so far, which parallelisms/zero.py adds to the fp32 buffer
    when the layer's backward ends, there the largest one (under TP the GEMMs accumulate into the
    buffer themselves: none), the gradient through the MLP's wide activation, the pipeline's
    message in and out, and with materialized attention one [T, T] square of gradient. (Measured
    against the rehearsal's ledger: tests/test_rehearsal.py.)"""
    m, e, t, M = cfg.model, element_bytes(cfg), lay.tp, lay.micro_batch * lay.seq
    wide = block_matrices(m)["fc1"][0]  # fc_in's output: GeLU's input, or SwiGLU's gate and up
    weight_grad = 0.0 if fuses_weight_gradients(lay) else e * m.d_model * wide
    work = weight_grad + e * M * wide / t + (2 * e * M * m.d_model / stream_shards(cfg, t) if lay.pp > 1 else 0)
    if cfg.kernels.attention in MATERIALIZED:
        work += e * lay.micro_batch * m.n_heads / t * lay.seq ** 2
    return work


def forward_core_bytes(cfg: config.Config, lay: JobLayout) -> float:
    """Bytes the last layer in flight holds at its forward's peak, in materialized attention's
    softmax (in place of the whole layer it keeps once past it): what the layer keeps before its
    core (its first norm's input and output, the q k v projection, q and k after RoPE, and under
    GQA k and v repeated), the core's scores in the compute dtype and two fp32 squares
    (kernels.attention_unfused), and the pipeline's message in and out. Where a layer keeps little
    beside its squares (no dropout, GQA's narrower k and v), this is where a rank peaks."""
    m, e, t, M = cfg.model, element_bytes(cfg), lay.tp, lay.micro_batch * lay.seq
    h, kv = m.d_model, kv_width(m)
    before = 2 * h + (h + 2 * kv) + (h + kv) + (2 * h if kv < h else 0)
    softmax = lay.micro_batch * m.n_heads / t * lay.seq ** 2 * (e + 8)
    messages = 2 * e * M * h / stream_shards(cfg, t) if lay.pp > 1 else 0.0
    if stream_shards(cfg, t) == 1 and t > 1:  # the first norm's input and output whole
        before -= 2 * h
        messages += 2 * h * e * M
    return e * M * before / t + softmax + messages


def rebuilds_squares(cfg: config.Config) -> bool:
    """Selective recomputation of a materialized attention core: its squares are rebuilt in backward."""
    return cfg.train.recompute == "selective" and cfg.kernels.attention in MATERIALIZED


def rebuilt_core_bytes(cfg: config.Config, lay: JobLayout) -> float:
    """Where rebuilds_squares: bytes a layer's backward has in flight beyond the kept layers as it
    rebuilds its attention core, where the peak falls: the core's softmax (the scores in the
    compute dtype and two fp32 squares, kernels.attention_unfused), the attention output's
    gradient, the pipeline's message in and out, and where the weight gradients wait for the
    layer's end (tp=1) the MLP's and the output projection's; less what the layer's MLP backward
    has freed by then (its wide activations, its dropout mask and, in the sequential block, its
    norm's input and output). (Measured against the rehearsal's ledger: tests/test_rehearsal.py.)"""
    m, e, t, M = cfg.model, element_bytes(cfg), lay.tp, lay.micro_batch * lay.seq
    h, mats = m.d_model, block_matrices(m)
    softmax = lay.micro_batch * m.n_heads / t * lay.seq ** 2 * (e + 8)
    mlp_weights = mats["fc1"][0] * mats["fc1"][1] + mats["fc2"][0] * mats["fc2"][1]
    held = 0.0 if fuses_weight_gradients(lay) else e * (mlp_weights + h * h)
    messages = 2 * e * M * h / stream_shards(cfg, t) if lay.pp > 1 else 0.0
    freed = M * (e * mlp_kept(cfg) + (2 * e * h if m.block != "parallel" else 0) + (h if m.dropout else 0)) / t
    return softmax + e * M * h / t + messages + held - freed


def in_flight_layers(lay: JobLayout, n_layers: int, rank: int) -> float:
    """Layers' worth of one microbatch's activations a pipeline rank holds at its peak: 1F1B's
    warm-up depth p - rank microbatches, interleaved 1F1B's (p-rank-1)*2 + (v-1)*p + 1 chunks (or
    every chunk-forward of the step, m*v, where there are fewer)."""
    if lay.pp == 1:
        return n_layers
    per_rank = lay.rank_layers(rank, n_layers)
    if lay.vpp == 1:
        return min(lay.microbatches, lay.pp - rank) * per_rank
    chunks = min(lay.microbatches * lay.vpp, (lay.pp - rank - 1) * 2 + (lay.vpp - 1) * lay.pp + 1)
    return chunks * per_rank / lay.vpp


def fuses_weight_gradients(lay: JobLayout) -> bool:
    """Whether the weight-gradient GEMMs accumulate into ZeRO's buffer themselves
    (zero.weight_gradient): under TP, whose layers own their backward; at tp=1 nn.Linear's
    backward is autograd's, which hands parallelisms/zero.py a gradient to add."""
    return lay.tp > 1


def fused_weight_params(cfg: config.Config, lay: JobLayout, last: bool = False) -> Tuple[int, int]:
    """(weights of the first (or last) pipeline rank whose gradient GEMM accumulates into ZeRO's
    buffer itself, elements those GEMMs accumulate a microbatch): every block's four matrices
    and the head's, where fuses_weight_gradients. Under TP overlap a block's GEMMs run once a
    piece, each accumulating: the sequence's pieces (chunked) or the batch rows' (domino)."""
    if not fuses_weight_gradients(lay):
        return 0, 0
    m, ov = cfg.model, cfg.parallel.overlap
    head = m.vocab_size * m.d_model // lay.tp if last or lay.pp == 1 else 0
    layers = lay.rank_layers(lay.pp - 1 if last else 0, m.n_layers)
    blocks = layers * sum(n * k for n, k in block_matrices(m).values()) // lay.tp
    pieces = {"chunked": ov.tp_chunks, "domino": min(ov.tp_chunks, lay.micro_batch)}.get(ov.tp, 1)
    return blocks + head, blocks * pieces + head


@dataclass
class Memory:
    """Peak memory of the fullest rank, GiB: rehearsed (rehearsal.py) where a rehearsal of this
    config is remembered, else modelled."""
    weights: float
    grads: float
    optimizer: float
    activations: float
    capacity: Optional[float]
    source: str = "model"

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations

    @property
    def fits(self) -> bool:
        return self.capacity is None or self.total <= self.capacity


def memory(cfg: config.Config, lay: JobLayout, capacity_gib: Optional[float] = None) -> Memory:
    """The fuller of the first and the last pipeline rank: rehearsed where this config was
    (rehearsal.remembered), else memory_of_rank's model."""
    from clustermodel import rehearsal
    measured = [rec["memory"] for rec in rehearsal.remembered(cfg, lay.gpus).values()]
    if measured:
        GiB, m = 2.0 ** 30, max(measured, key=lambda m: m["peak_bytes"])
        return Memory(m["weights_bytes"] / GiB, m["gradients_bytes"] / GiB, m["optimizer_bytes"] / GiB,
                      (m["activations_bytes"] + m["communication_bytes"]) / GiB, capacity_gib, "rehearsal")
    ranks = [memory_of_rank(cfg, lay, last, capacity_gib) for last in (False, True)]
    return max(ranks, key=lambda mem: mem.total)


def memory_of_rank(cfg: config.Config, lay: JobLayout, last: bool = False, capacity_gib: Optional[float] = None) -> Memory:
    """Peak memory of the first (or last) pipeline rank, GiB. bf16: bf16 weights, fp32 gradients,
    fp32 master + two moments (Adam and LAMB alike), the mixed-precision recipe of Megatron-LM and
    ZeRO (parallelisms/zero.py). ZeRO-1 splits the optimizer over DP; ZeRO-2 the gradients too, but only once
    reduced: while microbatches add up the whole gradient buffer is there (in the reduction dtype),
    through the backward, where the peak is; so ZeRO-2's peak is ZeRO-1's (DeepSpeed refuses ZeRO-2
    with pipeline parallelism for this reason). With one microbatch and DP overlap, a bucket's full
    buffer goes once its reduce-scatter is in (retires_gradients). ZeRO-3's gradients and optimizer are ZeRO-2's, its
    weights the modules gathered at the peak (gathered_params). Hybrid sharding divides by its
    shard group, parallel.dp_shard, not dp."""
    e, GiB = element_bytes(cfg), 2.0 ** 30
    m, M = cfg.model, lay.micro_batch * lay.seq
    states = 8 + (4 if precision(cfg) == "bf16" else 0)
    per_layer = (activation_bytes(cfg, lay.tp, lay.seq) + compiled_gather_bytes(cfg, lay.tp)) * M
    rank = lay.pp - 1 if last else 0
    params = rank_params(m, lay)[1 if last else 0]
    grad_bytes = 4 if cfg.parallel.reduce_dtype == "fp32" else 2
    grads = grad_bytes * (in_flight_gradients(cfg, lay, rank) if retires_gradients(cfg, lay) else params)
    optimizer = states * params / (lay.shard if lay.zero >= 1 else 1)  # (hybrid sharding: its shard group)
    layers = in_flight_layers(lay, m.n_layers, rank)
    recomputed, per_chunk = recomputed_layers(cfg, lay.pp, lay.vpp)
    layer_input = M * e * m.d_model / stream_shards(cfg, lay.tp)
    every = recomputed == per_chunk and cfg.train.recompute == "full"
    if every:  # keep each layer's input, rebuild one layer at a time
        # (the rebuilt layer's first norm input is its kept input: counted once)
        acts = layers * layer_input + per_layer - layer_input
    elif cfg.train.recompute == "full":  # each chunk in flight: its first layers' inputs, the rest whole
        # (the peak is at a chunk's first backward, a whole layer's: by the time a recomputed layer
        # is rebuilt, the chunk's whole layers have been freed)
        acts = layers / per_chunk * (recomputed * layer_input + (per_chunk - recomputed) * per_layer)
    elif rebuilds_squares(cfg):  # no layer keeps its squares: one layer at a time rebuilds them
        acts = layers * (per_layer - M * square_bytes(cfg) * m.n_heads / lay.tp * lay.seq)
    else:
        acts = layers * per_layer
    # On top of what is kept: a layer's backward in flight (or its attention core rebuilt), or, on
    # the last rank, the head's: the loss's probabilities over the vocabulary slice (fp32; fused:
    # the logits), their gradient and the head's weight gradient (unless its GEMM accumulates into
    # the buffer), whichever is larger.
    head = 0.0
    if rank == lay.pp - 1:
        vocab = m.vocab_size / lay.tp
        head = M * vocab * (e if cfg.kernels.fused else 4) + e * M * vocab
        head += 0.0 if fuses_weight_gradients(lay) else e * vocab * m.d_model
    core = 0.0
    if cfg.kernels.attention in MATERIALIZED and not every:  # (a chunk's last layer keeps its activations)
        kept = per_layer - (M * square_bytes(cfg) * m.n_heads / lay.tp * lay.seq if rebuilds_squares(cfg) else 0.0)
        core = max(forward_core_bytes(cfg, lay) - kept, rebuilt_core_bytes(cfg, lay) if rebuilds_squares(cfg) else 0.0)
    acts += max(backward_working_set(cfg, lay), head, core)
    if lay.zero >= 2 and lay.pp > 1 and rank < lay.pp - 1 and not retires_gradients(cfg, lay):
        # ZeRO-2 allocates the gradient buffer at the first gradient of the step, by when the
        # first backward has freed about one layer's activations (ZeRO-1 holds it all along; on
        # the last rank the head's weight gradient comes first, before anything is freed).
        acts -= min(per_layer, acts)
    weights = e * params
    if lay.zero == 3:  # the modules gathered at the peak, and the shard's own storage: in bf16 the fp32
        # master (counted with the optimizer: the gather reads it, no bf16 copy is kept), in fp32 itself
        weights = e * gathered_params(cfg, lay, rank) + (0 if precision(cfg) == "bf16" else 4 * params / lay.shard)
    return Memory(weights / GiB, grads / GiB, optimizer / GiB, acts / GiB, capacity_gib)
