"""What sharding the data-parallel state costs: ZeRO-3's parameter gathers (their time, their
exposure and the gathered parameters a rank holds) and hybrid sharding's two-step gradient
reduction (parallel.dp_shard), as parallelisms/zero.py runs them. perfmodel.py adds these to the
step it prices; memory.py counts the gathered parameters.

ZeRO-3 (parallel.zero_stage=3): every module (the embedding, each block, the final norm with the
head) gathers its parameters over the shard group (the compute dtype on the wire) before its
forward, frees them after it unless parallel.reshard_after_forward=false, gathers them again
before its backward and frees them at its end. The final norm and head stay gathered from their
forward to their backward. With DP overlap the next module's gather is prefetched behind the
current module's compute (the previous module's in backward): one module deep
(memory.gathered_params counts what that holds).

Gathers a step, per module: 2m with resharding (each microbatch's forward and backward; the head
m), one without: a module stays gathered from its first forward of the step to its last backward
(the step's last microbatch's), as torch's pipelining runs FSDP2 with reshard_after_forward=False.

Hybrid sharding (dp_shard < dp): gradients reduce-scatter inside the shard group of dp_shard
consecutive DP ranks, then the 1/dp_shard shard is all-reduced across the dp/dp_shard replicas;
ZeRO-1/2's updated parameters are all-gathered inside the shard group.

DP overlap (dp_overlap_exposed): what of the buckets' reduce-scatters and all-gathers, a bucket per
module, the compute around them hides; perfmodel.dp_time prices a step's with it.
"""
from __future__ import annotations

from typing import List, Tuple

import config
from clustermodel.layout import JobLayout
from clustermodel.memory import element_bytes, layer_params, norm_params


def shard_dim(lay: JobLayout) -> str:
    """The mesh group ZeRO shards over: all of dp, or the hybrid shard group."""
    return "dp_shard" if lay.shard < lay.dp else "dp"


def gradient_reduction(net, lay: JobLayout, nbytes: float) -> float:
    """Seconds to reduce `nbytes` of gradients over DP (the reduce-scatter half of ZeRO-0's
    all-reduce, priced as before): over dp, or under hybrid sharding a reduce-scatter in the
    shard group and an all-reduce of its 1/dp_shard result across the replicas."""
    return shard_reduction(net, lay, nbytes) + replica_sum(net, lay, nbytes)


def shard_reduction(net, lay: JobLayout, nbytes: float) -> float:
    """The reduce-scatter of `nbytes` of gradients in ZeRO's shard group (all of dp without hybrid
    sharding): what DP overlap launches bucket by bucket in the backward."""
    return net.collective("reduce_scatter", nbytes, shard_dim(lay) if lay.zero else "dp")


def replica_sum(net, lay: JobLayout, nbytes: float) -> float:
    """Hybrid sharding's all-reduce of each rank's 1/dp_shard of `nbytes` across its replicas (none
    without it). parallelisms/zero.py launches it after the backward, bucket by bucket as each
    reduce-scatter is waited for: DP overlap does not hide it."""
    if lay.shard == lay.dp or lay.zero == 0:
        return 0.0
    return net.collective("all_reduce", nbytes / lay.shard, "dp_replicate")


def parameter_gather(net, lay: JobLayout, nbytes: float) -> float:
    """Seconds of the post-step all-gather of `nbytes` of parameters (ZeRO-0's all-reduce's second
    half; ZeRO-1/2's updated shards): none at ZeRO-3, which gathers each module at use."""
    if lay.zero == 3:
        return 0.0
    return net.collective("all_gather", nbytes, shard_dim(lay) if lay.zero else "dp")


def _gathers_exposed(gathers: List[float], windows: List[float], overlap: bool) -> float:
    """Exposed seconds of gathers run in order, each prefetched behind the compute window before
    it (a first window of 0: nothing to hide behind), or all exposed without overlap."""
    if not overlap:
        return sum(gathers)
    return sum(max(0.0, g - w) for g, w in zip(gathers, windows))


def zero3_gathers(cfg: config.Config, lay: JobLayout, net, rank: int,
                  layer_fwd: float, layer_bwd: float) -> Tuple[float, float]:
    """(exposed, total) seconds a microbatch of pipeline rank `rank` spends on ZeRO-3's gathers
    (per step: times lay.microbatches). Forward: each chunk's modules in order, each behind the
    previous module's forward (a chunk's first has nothing before it: other chunks and
    microbatches run in between; the embedding's lookup hides nothing). Backward (resharding):
    in reverse, each behind the next module's backward; the head stays gathered. There the gathers
    share the link with the gradient reduce-scatters DP overlap launches behind the same backward
    (dp_overlap_exposed prices those against the whole backward): in a microbatch that reduces (the
    last, or each with parallel.reduce_each_microbatch) a gather hides behind what of a block's
    backward the block's reduce-scatter leaves, so a link-bound backward shows both. Without
    resharding a module is gathered once a step, by the first microbatch's forward: a
    microbatch's share is 1/m of that."""
    e, overlap = element_bytes(cfg), cfg.parallel.overlap.dp
    ag = lambda n: net.collective("all_gather", n * e, shard_dim(lay))
    split, replicated = layer_params(cfg.model, lay.tp)
    block = ag(split + replicated)
    vocab = cfg.model.vocab_size * cfg.model.d_model // lay.tp
    grad_bytes = 4 if cfg.parallel.reduce_dtype == "fp32" else 2
    reduced = shard_reduction(net, lay, (split + replicated) * grad_bytes) if overlap else 0.0
    reducing = reductions_a_step(cfg, lay) / lay.microbatches  # the share of microbatches that reduce
    exposed = total = 0.0
    for k, layers in enumerate(lay.rank_chunks(rank, cfg.model.n_layers)):
        first_chunk, last_chunk = rank == 0 and k == 0, rank == lay.pp - 1 and k == lay.vpp - 1
        fwd = ([ag(vocab)] if first_chunk else []) + [block] * layers
        fwd_windows = [0.0] + [0.0 if first_chunk and i == 0 else layer_fwd for i in range(len(fwd) - 1)]
        if last_chunk:
            fwd, fwd_windows = fwd + [ag(vocab + norm_params(cfg.model))], fwd_windows + [layer_fwd if layers else 0.0]
        exposed += _gathers_exposed(fwd, fwd_windows, overlap)
        total += sum(fwd)
        if lay.reshard:  # backward, in reverse: the blocks, then the embedding (the head is kept)
            bwd = [block] * layers + ([ag(vocab)] if first_chunk else [])
            # (the last chunk's last block is prefetched behind the head's backward, priced as a layer's)
            bwd_windows = [layer_bwd if last_chunk and layers else 0.0] + [layer_bwd] * (len(bwd) - 1)
            shared = [max(0.0, w - reduced) for w in bwd_windows]
            exposed += (reducing * _gathers_exposed(bwd, shared, overlap)
                        + (1 - reducing) * _gathers_exposed(bwd, bwd_windows, overlap))
            total += sum(bwd)
    if not lay.reshard:
        return exposed / lay.microbatches, total / lay.microbatches
    return exposed, total


def reductions_a_step(cfg: config.Config, lay: JobLayout) -> int:
    """Reduce-scatters of each bucket a step: one, or each microbatch's (parallel.reduce_each_microbatch)."""
    return lay.microbatches if lay.reduce_each else 1


def dp_overlap_exposed(lay: JobLayout, layers: int, layer_fwd: float, layer_bwd: float,
                       layer_comm: Tuple[float, float], end_comm: Tuple[float, float], end: str) -> Tuple[float, float]:
    """(exposed, total) seconds of DP overlap's collectives on the pipeline rank holding `end`
    (embedding: the first; head: the last), one DP stream running them in launch order.
    Backward: a module's reduce-scatter launches once its last microbatch's backward ends and hides
    behind the backward still to run. Interleaved 1F1B runs chunk v-1's last group of min(p, m)
    microbatches, then chunk v-2's, ..., chunk 0's, so chunk j's last gradient arrives j groups of
    chunk-steps before the end; the first rank's embedding, reduced last, shows whole.
    Forward: after the optimizer the first module's all-gather launches; each module's forward waits
    for its own and launches the next one's, so a gather shows where it outlasts the forward it
    prefetches behind: one layer's, or before a chunk's first layer the group of chunk-steps between
    that chunk's first microbatch and the one before."""
    v, group = lay.vpp, min(lay.pp, lay.microbatches)
    per_chunk = max(1, layers // v)  # (uneven chunks: their mean, at least one block)
    chunk_bwd, chunk_fwd = per_chunk * layer_bwd, per_chunk * layer_fwd
    (layer_rs, layer_ag), (end_rs, end_ag) = layer_comm, end_comm
    # backward: (compute still to run when the bucket launches, its reduce-scatter), in launch order
    launches = [(i * layer_bwd + j * group * chunk_bwd, layer_rs) for j in reversed(range(v)) for i in reversed(range(per_chunk))]
    if end == "head":
        launches.insert(0, (chunk_bwd + (v - 1) * group * chunk_bwd, end_rs))
    else:
        launches.append((0.0, end_rs))
    total_bwd = launches[0][0] + layer_bwd
    done = 0.0
    for remaining, seconds in launches:
        done = max(done, total_bwd - remaining) + seconds
    exposed = max(0.0, done - total_bwd)
    # forward: (the compute the gather prefetches behind, its all-gather), in forward order
    gathers = [(layer_fwd if i else chunk_fwd * group - (per_chunk - 1) * layer_fwd, layer_ag)
               for j in range(v) for i in range(per_chunk)]
    gathers[0] = (0.0, layer_ag)
    if end == "embedding":  # gathered first; its forward, a lookup, hides nothing of the next
        gathers.insert(0, (0.0, end_ag))
    else:
        gathers.append((layer_fwd, end_ag))
    exposed += sum(max(0.0, seconds - window) for window, seconds in gathers)
    total = sum(s for _, s in launches) + sum(s for _, s in gathers)
    return exposed, total
