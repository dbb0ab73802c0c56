"""Data parallelism with ZeRO stages 0, 1 and 2, mixed precision's fp32 master weights, and
MegaScale's DP overlap (parallel.overlap.dp).

Written over plain collectives rather than DDP/FSDP2 because the DP-overlap ablation must control
when each bucket's reduce-scatter and all-gather launches, and LAMB must see pieces of whole
parameters. Megatron-LM's distributed optimizer is the model:

- Buckets are flat buffers. Each holds whole parameters (in the order forward uses them), padded
  at its end only, to a multiple of dp; the model's parameters are views into its parameter
  buffer, so an all-gather writes them in place. A bucket closes at `bucket_size` elements; with
  DP overlap every module (the embedding, each block, the final norm with the head) starts a new
  one, so each module's forward can wait for its own parameters.
- Gradients accumulate, microbatch after microbatch, into the bucket's gradient buffer in the
  reduction dtype (a hook adds each parameter's grad and frees it). ZeRO-0 all-reduces the buffer;
  ZeRO-1 and 2 reduce-scatter it, each rank receiving the sum of its own range; ZeRO-2 allocates
  the buffer when the bucket's first gradient arrives and frees it once reduced.
- Rank r owns the range [r*S/dp, (r+1)*S/dp) of a bucket of S elements. Its piece of a parameter
  is the part of the parameter inside that range: a contiguous flat slice, possibly empty, never a
  mix of parameters, so LAMB's per-tensor norms stay exact (optim.py). The optimizer updates these
  pieces (`shards`): at ZeRO-0, whole parameters.
- Mixed precision (precision=bf16): the model's parameters are bf16 and the optimizer's pieces are
  fp32 master copies; after the step each rank casts its pieces into its range of the bf16
  buffer, and the all-gather moves bf16. With fp32 parameters the pieces are views into the
  parameter buffer itself: no copy at all.
- One rank (dp = tp = 1) at ZeRO-0 in fp32 has nothing to reduce and no master copy: the
  gradients stay where autograd puts them (param.grad, which the optimizer reads), as in plain
  PyTorch. Copying them into the buffer, then zeroing it, cost ~10 ms of a 1.4 s step at
  bench_step's default shape (experiments/bench_step.py).
Nothing here holds a full-size copy of the gradients or parameters besides the buffers.
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from overlap import CLOCK, timed_wait
from sharding import describe, shard_info

DEFAULT_BUCKET_SIZE = 40_000_000  # elements, Megatron-LM's --ddp-bucket-size


class Bucket:
    """A flat run of parameters: their offsets, this rank's range, the buffers."""

    def __init__(self, indices: list, params: list, dp: int, dp_rank: int):
        self.indices = indices
        self.offsets, total = [], 0
        for i in indices:
            self.offsets.append(total)
            total += params[i].numel()
        self.numel = -(-total // dp) * dp
        self.shard = self.numel // dp
        self.lo, self.hi = dp_rank * self.shard, (dp_rank + 1) * self.shard
        self.params: torch.Tensor = None    # flat, the parameters' dtype: the model's weights view into it
        self.grads: torch.Tensor = None     # flat, the reduction dtype (ZeRO-2: only while reducing)
        self.master: torch.Tensor = None    # fp32, this rank's range (ZeRO 1/2) or everything (ZeRO-0)
        self.arrived = 0                    # gradients accumulated this step (DP overlap)

    def piece(self, k: int, n: int) -> tuple:
        """(lo, hi): which of the k-th parameter's n flat elements fall in this rank's range (lo == hi
        when none do)."""
        start = self.offsets[k]
        lo = min(max(self.lo - start, 0), n)
        return lo, max(lo, min(self.hi - start, n))


class ZeroDataParallel:
    """DP reductions and ZeRO sharding over buckets (see the module docstring). ParallelModel
    registers the forward hooks that wait for a bucket's parameters before the module that reads
    them (a wait at the wrong module is Megatron-LM #950: a layer computing with last step's
    weights)."""

    def __init__(self, params: list, layout, stage: int, reduce_dtype: torch.dtype, buckets: list,
                 microbatches: int = 1, overlap: bool = False):
        self.params, self.layout, self.stage, self.reduce_dtype = params, layout, stage, reduce_dtype
        self.group, self.overlap, self.microbatches = layout.group("dp"), overlap, microbatches
        self.dtype = params[0].dtype
        self.mixed = self.dtype != torch.float32
        dp, r = layout.dp, layout.dp_rank
        self.buckets = [Bucket(_replicated_last(b, params), params, dp, r) for b in buckets]
        self.where = {}  # parameter index -> (bucket, position in it)
        for b, bucket in enumerate(self.buckets):
            for k, i in enumerate(bucket.indices):
                self.where[i] = (b, k)
            self._flatten(bucket)
        self.pieces = [None if stage == 0 else self._bucket_of(i).piece(self.where[i][1], p.numel())
                       for i, p in enumerate(params)]
        self.shards = [self._optimizer_piece(i) for i in range(len(params))]
        self.reducing, self.gathering = {}, {}  # bucket -> collective in flight
        self.current = set(range(len(self.buckets)))  # buckets whose parameters are this step's
        # The hooks reach this object through a weak reference. A strong one closes a cycle through
        # autograd's C++ hook table, which Python's collector cannot see: the model, its buffers and
        # the layout's process groups would outlive the run (a multirun would keep every job's
        # model) and be torn down only during interpreter finalization, where gloo's worker threads
        # abort the process ("terminate called without an active exception").
        self.autograd_keeps_grads = layout.dp == 1 and layout.tp == 1 and stage == 0 and not self.mixed
        if self.autograd_keeps_grads:  # the optimizer's pieces are the parameters, their .grad autograd's
            return
        owner = weakref.ref(self)
        for i, p in enumerate(params):
            p.register_post_accumulate_grad_hook(lambda param, i=i: owner()._accumulate(i, param))

    # Layout

    def _bucket_of(self, i: int) -> Bucket:
        return self.buckets[self.where[i][0]]

    @torch.no_grad()
    def _flatten(self, bucket: Bucket) -> None:
        """Moves the bucket's parameters into one flat buffer (each becomes a view of it) and, where
        the optimizer needs its own fp32 copy, makes it."""
        device = self.params[bucket.indices[0]].device
        bucket.params = torch.zeros(bucket.numel, dtype=self.dtype, device=device)
        for k, i in enumerate(bucket.indices):
            p = self.params[i]
            view = bucket.params[bucket.offsets[k]:bucket.offsets[k] + p.numel()]
            view.copy_(p.detach().flatten())
            p.data = view.view_as(p)
        if self.mixed:
            span = bucket.params if self.stage == 0 else bucket.params[bucket.lo:bucket.hi]
            bucket.master = span.float()
        elif self.stage > 0:
            bucket.master = bucket.params[bucket.lo:bucket.hi]  # the optimizer updates the parameters in place

    def _optimizer_piece(self, i: int) -> torch.Tensor:
        """What the optimizer updates for parameter i: the parameter (fp32, ZeRO-0), its fp32 master
        (bf16, ZeRO-0), or this rank's flat piece of it (ZeRO 1/2), as a view into the bucket."""
        p, (b, k) = self.params[i], self.where[i]
        bucket = self.buckets[b]
        if self.stage == 0:
            if not self.mixed:
                piece = p
            else:
                piece = torch.nn.Parameter(bucket.master[bucket.offsets[k]:bucket.offsets[k] + p.numel()].view_as(p))
        else:
            lo, hi = self.pieces[i]
            start = bucket.offsets[k] + lo - bucket.lo
            piece = torch.nn.Parameter(bucket.master[start:start + hi - lo])
            describe(piece, logical_ndim=p.ndim)  # a flat piece of a matrix is still a matrix's (weight decay)
        # LAMB and gradient clipping sum squared norms over ranks: count each element once.
        tp_owner = not shard_info(p).tp_replicated or self.layout.tp_rank == 0
        describe(piece, norm_owner=tp_owner and (self.stage > 0 or self.layout.dp_rank == 0))
        return piece

    # Gradients

    def _grad_buffer(self, bucket: Bucket) -> torch.Tensor:
        if bucket.grads is None:  # ZeRO-2, the bucket's first gradient of the step
            bucket.grads = torch.zeros(bucket.numel, dtype=self.reduce_dtype, device=bucket.params.device)
        return bucket.grads

    @torch.no_grad()
    def _accumulate(self, i: int, param: torch.Tensor) -> None:
        """Adds a parameter's fresh gradient into its bucket's buffer and frees it; with DP overlap,
        launches the bucket's reduction once every gradient of every microbatch is in."""
        b, k = self.where[i]
        bucket = self.buckets[b]
        start = bucket.offsets[k]
        self._grad_buffer(bucket)[start:start + param.numel()].add_(param.grad.flatten())
        param.grad = None
        bucket.arrived += 1
        if self.overlap and bucket.arrived == len(bucket.indices) * self.microbatches:
            self._launch_reduction(b)

    def _launch_reduction(self, b: int) -> None:
        """TP-sum the bucket's replicated gradients (LayerNorms, row-parallel biases: each TP rank
        saw a slice of the sequence; they sit at the bucket's end), then launch its DP all-reduce
        (ZeRO-0) or reduce-scatter into this rank's range (ZeRO 1/2)."""
        bucket = self.buckets[b]
        grads = self._grad_buffer(bucket)
        replicated = [i for i in bucket.indices if shard_info(self.params[i]).tp_replicated]
        if self.layout.tp > 1 and replicated:
            start = bucket.offsets[bucket.indices.index(replicated[0])]
            with CLOCK.waiting("comm", grads.device):
                dist.all_reduce(grads[start:], group=self.layout.group("tp"))
        work, out = None, grads
        if self.stage > 0:  # in place: this rank's range of the buffer receives its sum
            out = grads[bucket.lo:bucket.hi]
            if self.layout.dp > 1:
                work = dist.reduce_scatter_single(out, grads, group=self.group, async_op=True)
        elif self.layout.dp > 1:
            work = dist.all_reduce(grads, group=self.group, async_op=True)
        self.reducing[b] = (work, out)

    def _finish_reduction(self, b: int) -> None:
        work, out = self.reducing.pop(b)
        if work is not None:
            timed_wait(work, out.device)
        if self.layout.dp > 1:
            out.div_(self.layout.dp)
        bucket = self.buckets[b]
        if self.stage == 2:  # the full buffer goes; this rank's range stays
            out, bucket.grads = out.clone(), None
        grads = out if out.dtype == torch.float32 else out.float()
        for k, i in enumerate(bucket.indices):
            piece, p = self.shards[i], self.params[i]
            if self.stage == 0:
                start = bucket.offsets[k]
                piece.grad = grads[start:start + p.numel()].view_as(p)
            else:
                lo, hi = self.pieces[i]
                start = bucket.offsets[k] + lo - bucket.lo
                piece.grad = grads[start:start + hi - lo]

    def reduce_gradients(self) -> None:
        """After backward: launch what the hooks have not, then wait for every bucket."""
        if self.autograd_keeps_grads:
            return
        for b in range(len(self.buckets)):
            if b not in self.reducing:
                self._launch_reduction(b)
        for b in range(len(self.buckets)):
            self._finish_reduction(b)
        for bucket in self.buckets:
            bucket.arrived = 0

    # Parameters

    @torch.no_grad()
    def launch_gather(self, b: int) -> None:
        """Launch bucket b's all-gather of the updated pieces, straight into the parameters
        (ZeRO 1/2), unless under way or current."""
        if self.stage == 0 or b >= len(self.buckets) or b in self.gathering or b in self.current:
            return  # (the later microbatches' forwards, or a pipeline's, find it current)
        bucket = self.buckets[b]
        mine = bucket.params[bucket.lo:bucket.hi]  # in place, in the parameters' dtype: bf16 on the wire
        if self.mixed:
            mine.copy_(bucket.master)
        work = None
        if self.layout.dp > 1:
            work = dist.all_gather_single(bucket.params, mine, group=self.group, async_op=True)
        self.gathering[b] = (work, mine)

    @torch.no_grad()
    def wait_gather(self, b: int) -> None:
        """Bucket b's parameters are this step's once this returns."""
        if b not in self.gathering:
            return
        work, _ = self.gathering.pop(b)
        self.current.add(b)
        if work is not None:
            timed_wait(work, self.buckets[b].params.device)

    def before_forward(self, buckets: list) -> None:
        """The forward pre-hook of a module whose parameters are in `buckets`: wait for them (those
        no earlier hook prefetched are gathered now: a module larger than bucket_size spans
        several), and prefetch the bucket after."""
        for b in buckets:
            self.launch_gather(b)
            self.wait_gather(b)
        self.launch_gather(buckets[-1] + 1)

    @torch.no_grad()
    def after_step(self) -> None:
        """After the optimizer: zero the gradient buffers; ZeRO-0 in mixed precision casts the
        master weights back; ZeRO 1/2 prefetch the first bucket with overlap (the hooks chain the
        rest), or gather everything now without."""
        for bucket in self.buckets:
            if bucket.grads is not None:
                bucket.grads.zero_()
            if self.stage == 0 and self.mixed:
                bucket.params.copy_(bucket.master)
        if self.stage == 0:
            return
        self.current.clear()
        if self.overlap:
            self.launch_gather(0)
        else:
            self.gather_all()

    def gather_all(self) -> None:
        for b in range(len(self.buckets)):
            self.launch_gather(b)
        for b in range(len(self.buckets)):
            self.wait_gather(b)

    @torch.no_grad()
    def parameters_loaded(self) -> None:
        """After a checkpoint load. In mixed precision it wrote the fp32 masters (checkpoint.py
        saves them as the model's weights): cast them into the bf16 parameters. In fp32 it wrote
        the parameters, which the pieces are views of: nothing to do."""
        if not self.mixed:
            return
        for bucket in self.buckets:
            span = bucket.params if self.stage == 0 else bucket.params[bucket.lo:bucket.hi]
            span.copy_(bucket.master)
        if self.stage > 0:
            self.current.clear()
            self.gather_all()


def _replicated_last(indices: list, params: list) -> list:
    """The bucket's order: TP-replicated parameters last, so their TP all-reduce is one call on
    the buffer's tail."""
    return ([i for i in indices if not shard_info(params[i]).tp_replicated]
            + [i for i in indices if shard_info(params[i]).tp_replicated])


def plan_buckets(modules: list, params: list, bucket_size: int, per_module: bool) -> list:
    """Buckets of parameter indices: runs of whole parameters in the order of `modules` (each a
    list of parameter indices, in forward order), closed once they reach bucket_size elements
    and, with per_module (DP overlap), at every module's end."""
    buckets, current, size = [], [], 0
    for module in modules:
        for i in module:
            if current and size + params[i].numel() > bucket_size:
                buckets.append(current)
                current, size = [], 0
            current.append(i)
            size += params[i].numel()
        if per_module and current:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets
