"""What a rank's tensor is of its logical parameter (the whole one a single process holds): a
ShardInfo set on the tensor where it is made, read by shard_info.

tensor_parallel.py's plan slices parameters (parallel.py sets each slice's tp_shard_infos entry)
and zero.py cuts them into the optimizer's flat pieces (it sets each piece's); ZeRO's TP sum of
replicas' gradients, the optimizer's weight decay, its norms summed over ranks and the checkpoint's
logical coordinates read them. A tensor with none is a whole parameter, counted once.

The ShardInfo is an attribute of the tensor itself, not an entry in a table: it goes when its
tensor does, holds nothing else alive, and survives whatever keeps the tensor object (the meta
device, .data replaced by ZeRO's flat buffers). A copy is a new tensor with none, as
nn.Parameter's deepcopy and to_empty make.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class ShardInfo:
    # Tensor parallelism: the dim along which this rank holds a slice of the parameter (None: it
    # holds all of it), and where the slice starts along that dim.
    split_dim: Optional[int] = None
    offset: int = 0
    # How many consecutive TP ranks hold this same tensor, each with a partial gradient of it; the
    # gradients are summed over them. tp for the norms and the biases added after a reduce-scatter
    # (every rank sees its slice of the sequence); tp/n_kv_heads for QKV when tp exceeds the KV
    # heads (a KV group's rows on several ranks, each computing some of its query heads); else 1.
    tp_replicas: int = 1
    # Whether each of those replicas' gradients is partial (summed over them). False: every replica
    # computes the whole gradient, as the norms and row-parallel biases without sequence
    # parallelism (each TP rank sees the whole sequence), which a sum would count tp times.
    tp_partial_grad: bool = True
    # The parameter's own ndim, for a flat ZeRO piece of a matrix (weight decay goes by it).
    logical_ndim: Optional[int] = None
    # Whether this tensor's elements count in a norm summed over ranks: False on a copy whose
    # elements another rank of the sum also holds (a TP replica off the first rank of its replicas).
    norm_owner: bool = True


WHOLE = ShardInfo()


def shard_info(tensor: torch.Tensor) -> ShardInfo:
    return getattr(tensor, "shard_info", WHOLE)


def set_shard_info(tensor: torch.Tensor, info: ShardInfo) -> None:
    """Records what `tensor` is, where it is made."""
    tensor.shard_info = info


def tp_summed_replicas(tensor: torch.Tensor) -> int:
    """Over how many TP replicas the tensor's gradient is summed (1: not summed)."""
    info = shard_info(tensor)
    return info.tp_replicas if info.tp_partial_grad else 1
