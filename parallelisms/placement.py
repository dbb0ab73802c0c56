"""Where a rank's pieces sit in the logical tensors a checkpoint stores (checkpoint.py saves and
loads them through torch.distributed.checkpoint).

TP slices a parameter along its split dim (the offset and the number of ranks holding the same
slice: its ShardInfo, sharding.py); ZeRO 1-3 then keeps a flat range of that slice's values
(zero.py), which is up to three rectangles: a partial row, whole rows, a partial row. DTensor
cannot express a flat range of a TP slice, so those rectangles are DCP write items of their own
(Chunks). The same rectangles serve a run at any other layout: DCP reads the overlapping parts.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from parallelisms.sharding import shard_info


class Chunks:
    """This rank's rectangles of one logical tensor of shape `shape`: [(offsets, tensor)], each
    tensor a view into live state (so a load writes in place) or a snapshot's copy."""

    def __init__(self, shape, pieces: list, backing: Optional[torch.Tensor] = None):
        self.shape, self.pieces = torch.Size(shape), [(torch.Size(o), t) for o, t in pieces]
        self.backing = backing  # the local tensor the pieces are views of

    def size(self) -> torch.Size:  # DCP compares it with the saved logical size
        return self.shape

    def tensor_at(self, offsets) -> torch.Tensor:
        return next(t for o, t in self.pieces if o == torch.Size(offsets))

    def __create_chunk_list__(self) -> list:
        return [ChunkStorageMetadata(offsets=o, sizes=t.shape) for o, t in self.pieces]

    def __create_write_items__(self, fqn: str, _obj) -> list:
        return [WriteItem(index=MetadataIndex(fqn, o), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=o, sizes=t.shape),
                                                      properties=TensorProperties.create_from_tensor(t),
                                                      size=self.shape))
                for o, t in self.pieces]


def flat_range_rectangles(shape, lo: int, hi: int) -> list:
    """Elements [lo, hi) of a row-major tensor of `shape` (1-D or 2-D) as rectangles:
    [(offsets, sizes, first flat index)]. 2-D: a partial first row, whole rows, a partial last row."""
    if lo >= hi:
        return []
    if len(shape) == 1:
        return [((lo,), (hi - lo,), lo)]
    cols = shape[1]
    (r0, c0), (r1, c1) = divmod(lo, cols), divmod(hi, cols)
    if r0 == r1:
        return [((r0, c0), (1, c1 - c0), lo)]
    out = []
    if c0:
        out.append(((r0, c0), (1, cols - c0), lo))
        r0 += 1
    if r1 > r0:
        out.append(((r0, 0), (r1 - r0, cols), r0 * cols))
    if c1:
        out.append(((r1, 0), (1, c1), r1 * cols))
    return out


def _logical(p: torch.Tensor, layout) -> tuple:
    """(logical shape, offsets of this TP rank's slice) of model parameter p. A slice that several
    TP ranks hold (a KV group's QKV rows) is written by each, and DCP keeps one copy."""
    info = shard_info(p)
    shape, base = list(p.shape), [0] * p.dim()
    if info.split_dim is not None:
        shape[info.split_dim] *= layout.tp // info.tp_replicas
        base[info.split_dim] = info.offset
    return shape, base


def _place(shape, base, rects, flat: torch.Tensor, start: int) -> Chunks:
    """Chunks of a flat tensor holding elements [start, ...) of a TP slice placed at `base`."""
    pieces = [(tuple(b + o for b, o in zip(base, offs)), flat[first - start:first - start + _numel(sizes)].view(sizes))
              for offs, sizes, first in rects]
    return Chunks(shape, pieces, backing=flat)


def _numel(sizes) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def _whole(shape, base, t: torch.Tensor) -> Chunks:
    return Chunks(shape, [(tuple(base), t)], backing=t)


def model_chunks(engine) -> dict:
    """"model/<name>": this rank's TP slice of every parameter it holds (pipeline stages hold
    different names; DP replicas write the same rectangles, and DCP keeps one of each). In mixed
    precision the model's weights are the optimizer's fp32 masters, each rank its piece: the
    checkpoint holds the same fp32 weights whatever the run's precision. At ZeRO-3 (whose full
    parameters exist only while their module computes) too, in fp32 as well."""
    sharded = engine.zero.mixed or engine.zero.stage == 3
    if not sharded:
        engine.zero.gather_all()  # with DP overlap, the parameters may still be on the wire
    out = {}
    for i, (name, p) in enumerate(engine.named_model_parameters()):
        if sharded:
            out[f"model/{name}"] = _placed(engine, i, engine.zero.shards[i].detach())
        else:
            shape, base = _logical(p, engine.layout)
            out[f"model/{name}"] = _whole(shape, base, p.detach())
    return out


def _placed(engine, i: int, tensor: torch.Tensor) -> Chunks:
    """A tensor shaped like optimizer shard i (the whole parameter at ZeRO-0, a flat range of it
    at ZeRO 1-3), placed in the logical parameter."""
    shape, base = _logical(engine.zero.params[i], engine.layout)
    if engine.zero.stage == 0:
        return _whole(shape, base, tensor)
    lo, hi = engine.zero.shard_ranges[i]
    return _place(shape, base, flat_range_rectangles(engine.zero.params[i].shape, lo, hi), tensor.view(-1), lo)


def optimizer_chunks(engine, optimizer, template: Optional[dict] = None) -> dict:
    """"optim/<name>/<key>": each state tensor placed like its parameter's piece. Scalars (a
    step count) are the same on every rank and saved once. With a template ({key: saved dtype
    and size}), fresh zero tensors to load into."""
    out = {}
    for i, shard in enumerate(engine.zero.shards):
        name = engine.names[i]
        state = optimizer.state.get(shard, {}) if template is None else {
            k.rsplit("/", 1)[1]: torch.zeros(() if len(meta.size) == 0 else shard.shape, dtype=meta.properties.dtype)
            for k, meta in template.items() if k.startswith(f"optim/{name}/")}
        for key, value in state.items():
            fqn = f"optim/{name}/{key}"
            out[fqn] = value if not torch.is_tensor(value) or value.dim() == 0 else _placed(engine, i, value)
    return out
