"""What a rank's tensor is of its logical parameter (the whole one a single process holds), kept
in one registry that every file reads.

tensor_parallel.py's plan slices parameters and zero.py cuts them into the optimizer's flat
pieces; ZeRO's TP sum of replicas' gradients, the optimizer's weight decay and its norms summed over ranks each need to
know what a tensor is a part of (parallel.py describes the TP slices, zero.py the pieces), and the
TP layers' backward where a weight's gradient accumulates (zero.py describes its buckets' views). A tensor with
no entry is a whole parameter, counted once.

Keyed by the tensor object, weakly (torch's WeakIdKeyDictionary): an entry goes when its tensor
does, and holds no reference that could keep a model alive.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary


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
    # Where a backward that computes this parameter's gradient itself (the TP layers' weight GEMMs,
    # overlap.weight_gradient) accumulates it instead of handing autograd a .grad: ZeRO's
    # zero.GradientSink, whose take() gives the parameter's view of its gradient buffer (None:
    # autograd's .grad, as for any other tensor).
    grad_sink: Optional[object] = None


WHOLE = ShardInfo()
_INFO = WeakIdKeyDictionary()


def shard_info(tensor: torch.Tensor) -> ShardInfo:
    return _INFO.get(tensor, WHOLE)


def tp_summed_replicas(tensor: torch.Tensor) -> int:
    """Over how many TP replicas the tensor's gradient is summed (1: not summed)."""
    info = shard_info(tensor)
    return info.tp_replicas if info.tp_partial_grad else 1


def describe(tensor: torch.Tensor, info: Optional[ShardInfo] = None, **fields) -> None:
    """Record what `tensor` is (`info`, else its current entry), with `fields` changed."""
    _INFO[tensor] = dataclasses.replace(info if info is not None else shard_info(tensor), **fields)
