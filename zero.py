"""Data parallelism with ZeRO stages 0, 1 and 2, and MegaScale's DP overlap (parallel.overlap.dp).

Written over plain collectives rather than DDP/FSDP2 because the DP-overlap ablation must control
when each bucket's reduce-scatter and all-gather launches. Each parameter is sharded on its own
(its flattened, zero-padded values split into dp equal pieces, FSDP2-style), never a flat buffer
mixing tensors, so that LAMB's per-tensor norms stay exact under ZeRO.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from overlap import CLOCK, timed_wait


class ZeroDataParallel:
    """Gradients are averaged and (ZeRO-1/2) parameters re-gathered per bucket. Without DP overlap
    one bucket holds every parameter and both happen between backward and forward. With
    parallel.overlap.dp a bucket is one module's parameters (the embedding, each block, the final
    norm with the head): its reduction launches from a hook as soon as backward has produced its
    last gradient, and its all-gather from the forward pre-hook of the bucket before it (the
    first at the end of the previous step), so launches follow the order compute needs the data.
    ParallelModel registers the forward hooks, at the module each bucket's wait must precede
    (a wait at the wrong module is Megatron-LM #950: a layer computing with last step's weights)."""

    def __init__(self, params: list, layout: Layout, stage: int, reduce_dtype: torch.dtype,
                 buckets: list, microbatches: int = 1, overlap: bool = False):
        self.params, self.layout, self.stage, self.reduce_dtype = params, layout, stage, reduce_dtype
        self.group, self.buckets, self.overlap = layout.group("dp"), buckets, overlap
        dp, r = layout.dp, layout.dp_rank
        self.shard_sizes = [-(-p.numel() // dp) for p in params]
        self.shards = []
        for p, size in zip(params, self.shard_sizes):
            if stage == 0:
                shard = p  # the optimizer updates the (replicated) parameter itself
            else:
                flat = torch.zeros(size * dp, dtype=p.dtype, device=p.device)
                flat[:p.numel()] = p.detach().flatten()
                shard = torch.nn.Parameter(flat[r * size:(r + 1) * size].clone())
                shard._logical_ndim = p.ndim  # a flat shard of a matrix is still a matrix's (weight decay)
            # LAMB and gradient clipping sum squared norms over ranks: count each element once.
            tp_owner = not getattr(p, "_tp_replicated", False) or layout.tp_rank == 0
            shard._norm_owner = tp_owner and (stage > 0 or layout.dp_rank == 0)
            self.shards.append(shard)
        self.reducing, self.gathering = {}, {}  # bucket -> collective in flight
        self.current = set(range(len(buckets)))  # buckets whose full parameters are this step's
        self.grads_due = [0] * len(buckets)
        if overlap:
            self.expected = [len(b) * microbatches for b in buckets]
            for b, bucket in enumerate(buckets):
                for i in bucket:
                    params[i].register_post_accumulate_grad_hook(lambda _, b=b: self._grad_ready(b))

    # Gradients

    def _grad_ready(self, b: int) -> None:
        self.grads_due[b] += 1
        if self.grads_due[b] == self.expected[b]:
            self._launch_reduction(b)

    def _launch_reduction(self, b: int) -> None:
        """TP-sum the bucket's replicated gradients (LayerNorms, row-parallel biases: each TP rank
        saw a slice of the sequence), then launch its DP all-reduce (stages 0, 1) or its
        reduce-scatter straight into each rank's gradient shards (stage 2, which frees the full
        gradients at once)."""
        idx = self.buckets[b]
        grads = [self.params[i].grad if self.params[i].grad is not None else torch.zeros_like(self.params[i])
                 for i in idx]
        replicated = [g for i, g in zip(idx, grads) if getattr(self.params[i], "_tp_replicated", False)]
        if self.layout.tp > 1 and replicated:
            flat = torch.cat([g.flatten() for g in replicated])
            with CLOCK.waiting("comm", flat.device):
                dist.all_reduce(flat, group=self.layout.group("tp"))
            for g, piece in zip(replicated, flat.split([g.numel() for g in replicated])):
                g.copy_(piece.view_as(g))
        dp, work = self.layout.dp, None
        if self.stage < 2:
            buf = torch.cat([g.flatten().to(self.reduce_dtype) for g in grads])
            if dp > 1:
                work = dist.all_reduce(buf, group=self.group, async_op=True)
        else:  # rows = ranks; rank r receives the concatenation of the bucket's shards r
            table = torch.cat([self._pad(g.to(self.reduce_dtype), self.shard_sizes[i]) for i, g in zip(idx, grads)], dim=1)
            buf = table.new_empty(table.shape[1])
            if dp > 1:
                work = dist.reduce_scatter_single(buf, table.flatten(), group=self.group, async_op=True)
            else:
                buf.copy_(table[0])
            for i in idx:
                self.params[i].grad = None
        self.reducing[b] = (work, buf, grads)

    def _finish_reduction(self, b: int) -> None:
        work, buf, grads = self.reducing.pop(b)
        if work is not None:
            timed_wait(work, buf.device)
        buf.div_(self.layout.dp)
        idx = self.buckets[b]
        if self.stage == 2:
            for i, piece in zip(idx, buf.split([self.shard_sizes[i] for i in idx])):
                self.shards[i].grad = piece.to(self.shards[i].dtype)
            return
        for i, g, piece in zip(idx, grads, buf.split([g.numel() for g in grads])):
            g.copy_(piece.view_as(g))
            if self.stage == 1:
                self.shards[i].grad = self._pad(g, self.shard_sizes[i])[self.layout.dp_rank]
            else:
                self.params[i].grad = g

    def reduce_gradients(self) -> None:
        """After backward: launch what the hooks have not, then wait for every bucket."""
        for b in range(len(self.buckets)):
            if b not in self.reducing:
                self._launch_reduction(b)
        for b in range(len(self.buckets)):
            self._finish_reduction(b)
        self.grads_due = [0] * len(self.buckets)

    def _pad(self, t: torch.Tensor, size: int) -> torch.Tensor:
        """[dp, size] view of t's values, zero-padded at the end."""
        flat = torch.zeros(size * self.layout.dp, dtype=t.dtype, device=t.device)
        flat[:t.numel()] = t.flatten()
        return flat.view(self.layout.dp, size)

    # Parameters

    @torch.no_grad()
    def launch_gather(self, b: int) -> None:
        """Launch bucket b's all-gather of the updated shards (stages 1, 2), unless under way."""
        if self.stage == 0 or b >= len(self.buckets) or b in self.gathering or b in self.current:
            return  # (the later microbatches' forwards, or a pipeline's, find it current)
        mine = torch.cat([self.shards[i].detach() for i in self.buckets[b]])
        table = mine.new_empty(self.layout.dp * mine.numel())
        work = None
        if self.layout.dp > 1:
            work = dist.all_gather_single(table, mine, group=self.group, async_op=True)
        else:
            table.copy_(mine)
        self.gathering[b] = (work, table)

    @torch.no_grad()
    def wait_gather(self, b: int) -> None:
        """Bucket b's parameters are this step's once this returns."""
        if b not in self.gathering:
            return
        work, table = self.gathering.pop(b)
        self.current.add(b)
        if work is not None:
            timed_wait(work, table.device)
        idx = self.buckets[b]
        for i, piece in zip(idx, table.view(self.layout.dp, -1).split([self.shard_sizes[i] for i in idx], dim=1)):
            self.params[i].copy_(piece.flatten()[:self.params[i].numel()].view_as(self.params[i]))

    def before_forward(self, b: int) -> None:
        """The forward pre-hook of bucket b: wait for its parameters, prefetch the next bucket's."""
        self.wait_gather(b)
        self.launch_gather(b + 1)

    def after_step(self) -> None:
        """After the optimizer: with overlap, prefetch the first bucket (the hooks chain the rest);
        without, gather everything now."""
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
