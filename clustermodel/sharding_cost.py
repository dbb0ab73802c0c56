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
    in reverse, each behind the next module's backward; the head stays gathered. Without
    resharding a module is gathered once a step, by the first microbatch's forward: a
    microbatch's share is 1/m of that."""
    e, overlap = element_bytes(cfg), cfg.parallel.overlap.dp
    ag = lambda n: net.collective("all_gather", n * e, shard_dim(lay))
    split, replicated = layer_params(cfg.model, lay.tp)
    block = ag(split + replicated)
    vocab = cfg.model.vocab_size * cfg.model.d_model // lay.tp
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
            exposed += _gathers_exposed(bwd, bwd_windows, overlap)
            total += sum(bwd)
    if not lay.reshard:
        return exposed / lay.microbatches, total / lay.microbatches
    return exposed, total
