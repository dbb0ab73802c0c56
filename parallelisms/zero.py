"""Data parallelism with ZeRO stages 0 to 3, mixed precision's fp32 master weights, and
MegaScale's DP overlap (parallel.overlap.dp).

Written over plain collectives rather than DDP/FSDP2 because the DP-overlap ablation must control
when each bucket's reduce-scatter and all-gather launches, and LAMB must see whole parameters'
shards. Megatron-LM's distributed optimizer is the model. Its words, used throughout:

- bucket: a flat run of whole parameters (in the order forward uses them), padded at its end
  only, to a multiple of dp (of dp_shard under hybrid sharding, below). The model's parameters
  are views into the bucket's parameter buffer, so an all-gather writes them in place. A bucket
  closes at `bucket_size` elements; with DP overlap every module (the embedding, each block, the
  final norm with the head) also closes one, so each module's forward can wait for its own
  parameters.
- shard: what one rank owns. A bucket's shard is the rank's 1/dp range of it, [r*S/dp, (r+1)*S/dp)
  of a bucket of S elements (hybrid sharding: 1/dp_shard, r the rank in its shard group); a
  parameter's shard is the part of the parameter inside that range: a contiguous flat slice,
  possibly empty, never a mix of parameters, so LAMB's per-tensor norms stay exact (optim.py).
  The optimizer updates the parameters' shards (`shards`; at ZeRO-0 the whole parameters).
- gradient buffer: the bucket's gradients in the reduction dtype, accumulated microbatch after
  microbatch. Where the code owns a weight's backward (the TP layers' GEMMs) the
  weight-gradient GEMM accumulates straight into the weight's view of it, as Megatron-LM's
  gradient-accumulation fusion does (weight_gradient, into the parameter's GradientSink): no
  gradient in the parameters' dtype is written and read again. Every other gradient (biases,
  norms, the embedding, any weight at tp=1) is added when its module's backward ends, in one foreach add a
  bucket, and freed (so it waits at most that long), not one Python hook and one add a
  parameter. ZeRO-0 all-reduces the buffer; ZeRO-1 and 2 reduce-scatter it, each rank receiving
  the sum of its shard; ZeRO-2 allocates it when the bucket's first gradient arrives and frees
  it once reduced.
- master: with precision=bf16 the model's parameters are bf16 and the optimizer's shards are
  fp32 master copies; after the step each rank casts its shards into its range of the bf16
  buffer, and the all-gather moves bf16. With fp32 parameters the shards are views into the
  parameter buffer itself: no copy at all.

The schedule (ZeroDataParallel's methods after attach(), in this order) runs each step: before each module's
forward, wait for its buckets' all-gather and launch the next bucket's; after each module's
backward, add its gradients into their buckets (one foreach add a module and bucket; the fused
weights' are there already) and, with DP overlap, launch a bucket's reduction once its last
gradient of the last microbatch is in; after backward, reduce what has not been launched and
hand the optimizer its shards' gradients; after the optimizer, zero the buffers and launch the
first bucket's all-gather (DP overlap) or gather them all.

ZeRO-3 (fully sharded, FSDP's schedule on these buckets): every module closes its buckets, and a
bucket's full parameter buffer exists only while its module computes. The module's forward
pre-hook gathers it (with DP overlap, prefetching the next module's); its forward hook frees it
(release: the buffer's storage resized to nothing under the parameters' views, which stay
valid, autograd's saved references to them too, and see the next gather's values) unless
reshard_after_forward is off, and hooks its output's gradient, so that the module's backward
begins by gathering it again (with DP overlap, prefetching the previous module's); the end of
its backward (add_gradients) frees it. With reshard_after_forward off a module stays gathered
from its first forward of the step to its last backward (the last microbatch's): one gather a
step, whatever the microbatches, as torch's pipelining runs FSDP2 with reshard_after_forward=False
(it reshards after the last backward only) and Llama 3 trained under pipeline parallelism. The
final norm and head, whose backward usually comes right after their forward, stay gathered in
between, as FSDP keeps its root (their output is hooked too: a pipeline schedule may run another
microbatch's backward between). The shard lives in
storage of its own (the fp32 master), which the gather reads, so between steps a rank holds only
its shards; gradients are ZeRO-2's.

One rank (dp = tp = 1) at ZeRO-0 in fp32 has nothing to reduce and no master copy: the gradients
stay where autograd puts them (param.grad, which the optimizer reads), as in plain PyTorch.

Hybrid sharding (parallel.dp_shard, FSDP2's HSDP, Megatron-LM's distributed-optimizer
instances): ZeRO 1-3 shard each bucket over a shard group of dp_shard consecutive DP ranks, whose
dp/dp_shard copies replicate each other. A bucket's gradients are reduce-scattered in the shard
group, then each shard all-reduced over its replicas (the replicate group: the ranks of the same
shard rank), then divided by dp; the all-gather stays within the shard group. Without it
(dp_shard = dp) the shard group is the dp group and there is no replicate step.

Nothing here holds a full-size copy of the gradients or parameters besides the buffers (ZeRO-3:
while a module computes). At ZeRO 2/3 a bucket's full gradient buffer goes once its
reduce-scatter is in (_retire), REDUCTIONS_IN_FLIGHT at most waiting: with one microbatch and DP
overlap, during the backward; with several, the buffers accumulate until the last microbatch,
unless each microbatch is reduced (each_microbatch: its reductions into the shard, `summed`,
waited for at its end).
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Optional

import torch
import torch.distributed as dist

from parallelisms.sharding import WHOLE, set_shard_info, shard_info, tp_summed_replicas

DEFAULT_BUCKET_SIZE = 40_000_000  # elements, Megatron-LM's --ddp-bucket-size
# ZeRO 2/3: reduce-scatters in flight before the oldest is waited for and its full gradient buffer
# freed (FSDP2 likewise keeps the previous reduce-scatter's buffers while the next one runs).
REDUCTIONS_IN_FLIGHT = 2


class Bucket:
    """A flat run of whole parameters: their offsets, this rank's shard of it, the buffers."""

    def __init__(self, indices: list, params: list, shards: int, shard_rank: int):
        self.indices = indices
        self.offsets, total = [], 0
        for i in indices:
            self.offsets.append(total)
            total += params[i].numel()
        self.numel = -(-total // shards) * shards
        self.shard_numel = self.numel // shards
        self.shard_start, self.shard_end = shard_rank * self.shard_numel, (shard_rank + 1) * self.shard_numel
        self.params: torch.Tensor = None    # flat, the parameters' dtype: the model's weights view into it
        self.grads: torch.Tensor = None     # flat, the reduction dtype (ZeRO 2/3: only while reducing)
        self.grad_views: list = None        # each parameter's view of `grads`, shaped as the parameter
        self.master: torch.Tensor = None    # fp32, this rank's shard (ZeRO 1-3; at 3 its own storage) or all (ZeRO-0)
        self.arrived = 0                    # gradients added this step (DP overlap launches at the last)
        # The TP-summed tail (_replicas_last): (start, end, replicas) of each run of parameters
        # whose gradients are summed over the same number of TP replicas.
        self.replica_runs = []
        for k, i in enumerate(indices):
            replicas = tp_summed_replicas(params[i])
            if replicas == 1:
                continue
            if self.replica_runs and self.replica_runs[-1][2] == replicas:
                self.replica_runs[-1][1] = self.offsets[k] + params[i].numel()
            else:
                self.replica_runs.append([self.offsets[k], self.offsets[k] + params[i].numel(), replicas])

    def param_shard(self, k: int, n: int) -> tuple:
        """(lo, hi): which of the k-th parameter's n flat elements fall in this rank's shard (lo == hi
        when none do)."""
        start = self.offsets[k]
        lo = min(max(self.shard_start - start, 0), n)
        return lo, max(lo, min(self.shard_end - start, n))


class _BackwardDone(torch.autograd.Function):
    """Marks a module's input (or, for the final norm and head, the last block's output): its
    backward runs once the gradient there is complete, that is once every gradient of the module's
    parameters has been accumulated (autograd runs a parameter's accumulation before any node that
    became ready with it). FSDP2 detects a module's end of backward the same way."""

    @staticmethod
    def forward(ctx, x, schedule, module):
        ctx.schedule, ctx.module = schedule, module
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.schedule.add_gradients(ctx.module)
        return grad, None, None


class GradientSink:
    """Where a backward that computes parameter i's gradient itself accumulates it (weight_gradient):
    take() gives the parameter's view of its bucket's gradient buffer and counts the gradient as
    arrived when the module's backward ends. ZeroDataParallel.attach sets one on each parameter,
    as its `grad_sink`. Holds the schedule weakly: the schedule holds the parameters, and a
    parameter keeps no schedule (nor its buffers) alive."""

    def __init__(self, schedule: "ZeroDataParallel", i: int):
        self.schedule, self.i = weakref.ref(schedule), i

    def take(self):
        schedule = self.schedule()
        return None if schedule is None else schedule.fused_view(self.i)


def gradient_sink(weight: torch.Tensor) -> Optional[GradientSink]:
    """Where the weight's gradient accumulates, if not in autograd's .grad: its GradientSink, asked
    in forward, of the parameter itself (what backward finds saved may be another tensor object: a
    checkpoint's recomputation). None while dynamo traces: a compiled backward returns its gradients."""
    return None if torch.compiler.is_compiling() else getattr(weight, "grad_sink", None)


def weight_gradient(sink, dtype: torch.dtype, grad: torch.Tensor, rows: torch.Tensor):
    """A linear layer's weight gradient, grad^T @ rows ([tokens, out]^T @ [tokens, in]), as the TP
    layers' backward computes it. Where the weight has a sink (gradient_sink's) the GEMM
    accumulates into its view of the gradient buffer, Megatron-LM's gradient-accumulation fusion:
    no gradient in the weight's dtype is written, read back and added. It returns None then
    (autograd gets no .grad), else the gradient in the weight's dtype. No switch turns it off: it
    changes no result beyond the rounding of the sum (bf16 on a CPU: none at all) and is none of
    the paper's ablations."""
    view = None if sink is None else sink.take()
    if view is None:
        return (grad.t() @ rows).to(dtype)
    if view.dtype == grad.dtype:  # fp32 parameters (or a bf16 buffer for bf16 ones): C += A @ B
        view.addmm_(grad.t(), rows)
    elif view.dtype == torch.float32 and view.device.type != "cpu":  # bf16 GEMM, fp32 accumulator (CUDA; meta stands in)
        torch.addmm(view, grad.t(), rows, out_dtype=torch.float32, out=view)
    else:  # a CPU has no kernel for a bf16 GEMM accumulating in fp32: the product, then an add, as unfused
        view.add_((grad.t() @ rows).to(dtype))
    return None


class ZeroDataParallel:
    """DP reductions and ZeRO sharding over buckets (see the module docstring), and the schedule
    that runs them. attach() hooks it onto the model's modules; the methods below it are the
    step's, in the order they run."""

    def __init__(self, params: list, layout, stage: int, reduce_dtype: torch.dtype, buckets: list,
                 microbatches: int = 1, overlap: bool = False, reshard_after_forward: bool = True,
                 each_microbatch: bool = False):
        self.params, self.layout, self.stage, self.reduce_dtype = params, layout, stage, reduce_dtype
        # ZeRO 2/3: reduce-scatter each microbatch's gradients into the shard (parallel.reduce_each_microbatch)
        self.each_microbatch = each_microbatch and stage >= 2 and microbatches > 1
        self.per_reduction = 1 if self.each_microbatch else microbatches  # microbatches a reduction sums
        self.reshard_after_forward = reshard_after_forward
        self.group, self.overlap, self.microbatches = layout.group("dp"), overlap, microbatches
        if stage == 0 and layout.dp_shard != layout.dp:
            raise ValueError(f"hybrid sharding (dp_shard={layout.dp_shard} of dp={layout.dp}) at ZeRO-0, "
                             "which shards nothing")
        # Hybrid sharding: the shards are 1/dp_shard of a bucket, over the shard group; each
        # replica of it sums its shard with theirs (without it: the dp group, and no replicas).
        self.shard_group, self.replicate_group = layout.group("dp_shard"), layout.group("dp_replicate")
        self.clock = layout.clock
        self.dtype = params[0].dtype
        self.mixed = self.dtype != torch.float32
        self.buckets = [Bucket(_replicas_last(b, params), params, layout.dp_shard, layout.dp_shard_rank)
                        for b in buckets]
        for replicas in sorted({tp_summed_replicas(p) for p in params} - {1}):
            layout.tp_replica_group(replicas)  # made now, on every rank in the same order (NCCL's rule)
        self.where = {}  # parameter index -> (bucket, position in it)
        for b, bucket in enumerate(self.buckets):
            for k, i in enumerate(bucket.indices):
                self.where[i] = (b, k)
            self._flatten(bucket)
        self.shard_ranges = [None if stage == 0 else self.buckets[self.where[i][0]].param_shard(self.where[i][1], p.numel())
                             for i, p in enumerate(params)]
        self.shards = [self._shard_of(i) for i in range(len(params))]  # what the optimizer updates
        self.reducing, self.gathering = {}, {}  # bucket -> collective in flight
        self.unretired: list = []  # ZeRO 2/3: buckets whose reduce-scatter is launched, oldest first
        self.summed: dict = {}     # ZeRO 2/3: bucket -> this rank's shard of the reductions landed this step
        self.current = set(range(len(self.buckets)))  # buckets whose parameters are this step's
        if stage == 3:  # between steps a rank holds its shards only
            self.release()
        self.modules: list = []    # each hooked module's parameter indices (attach)
        self.backwards: list = []  # ZeRO-3: each module's backwards this step (kept gathered until its last)
        self.module_buckets: list = []  # each hooked module's buckets
        self.unmarked = set()      # modules whose backward no _BackwardDone marks (their input needs no gradient)
        self.hooks_traced = False  # the forward is compiled: its hooks are traced and mark nothing (mark_hooks_traced)
        self.fused = set()         # parameters whose backward accumulated into the buffer since their module's end
        self.autograd_keeps_grads = layout.dp == 1 and layout.tp == 1 and stage == 0 and not self.mixed

    # --- The buckets: each parameter a view of its bucket, each shard a view for the optimizer ---

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
            span = bucket.params if self.stage == 0 else bucket.params[bucket.shard_start:bucket.shard_end]
            bucket.master = span.float()
        elif self.stage == 3:  # the shard outlives the full buffer: its own storage
            bucket.master = bucket.params[bucket.shard_start:bucket.shard_end].clone()
        elif self.stage > 0:
            bucket.master = bucket.params[bucket.shard_start:bucket.shard_end]  # the optimizer updates the parameters in place

    def _shard_of(self, i: int) -> torch.Tensor:
        """Parameter i's shard, what the optimizer updates: the parameter (fp32, ZeRO-0), its fp32
        master (bf16, ZeRO-0), or the flat part of it in this rank's bucket shard (ZeRO 1-3), as a
        view into the bucket."""
        p, (b, k) = self.params[i], self.where[i]
        bucket = self.buckets[b]
        info = WHOLE
        if self.stage == 0:
            if not self.mixed:
                shard, info = p, shard_info(p)
            else:
                shard = torch.nn.Parameter(bucket.master[bucket.offsets[k]:bucket.offsets[k] + p.numel()].view_as(p))
        else:
            lo, hi = self.shard_ranges[i]
            start = bucket.offsets[k] + lo - bucket.shard_start
            shard = torch.nn.Parameter(bucket.master[start:start + hi - lo])
            info = dataclasses.replace(info, logical_ndim=p.ndim)  # a flat shard of a matrix is still a matrix's
        # LAMB and gradient clipping sum squared norms over ranks: count each element once (a
        # shard's replicas under hybrid sharding: the first replica's).
        tp_owner = self.layout.tp_rank % shard_info(p).tp_replicas == 0
        owner = tp_owner and (self.layout.dp_replicate_rank if self.stage > 0 else self.layout.dp_rank) == 0
        set_shard_info(shard, dataclasses.replace(info, norm_owner=owner))
        return shard

    def _grad_views(self, b: int) -> list:
        bucket = self.buckets[b]
        if b in self.unretired:  # the previous microbatch's reduction still reads the buffer
            self.unretired.remove(b)
            self._retire(b)
        if bucket.grads is None:  # ZeRO-2, the bucket's first gradient of the step (or microbatch)
            bucket.grads = torch.zeros(bucket.numel, dtype=self.reduce_dtype, device=bucket.params.device)
            bucket.grad_views = None
        if bucket.grad_views is None:
            bucket.grad_views = [bucket.grads[o:o + self.params[i].numel()].view_as(self.params[i])
                                 for o, i in zip(bucket.offsets, bucket.indices)]
        return bucket.grad_views

    # --- The schedule ---

    def attach(self, modules: list) -> None:
        """Hooks the schedule onto the model. `modules`: (parameter indices, the registration of the
        forward hook that runs before their first use[, the registration of a forward hook of the
        module itself, or None]), in forward order (parallel.py's _forward_modules). Each hook
        waits for the module's buckets (DP overlap, ZeRO-3; a wait at the wrong module is
        Megatron-LM #950: a layer computing with last step's weights) and marks the module's end
        of backward, where its gradients are added (_BackwardDone). At ZeRO-3 the module's own
        forward hook frees its buckets and hooks its output's gradient, where its backward begins."""
        if self.autograd_keeps_grads:  # the optimizer's shards are the parameters, their .grad autograd's
            return
        for m, (indices, register, *after) in enumerate(modules):
            buckets = sorted({self.where[i][0] for i in indices})
            self.modules.append(indices)
            self.backwards.append(0)
            self.module_buckets.append(buckets)
            register(self._hook(m, buckets))
            if self.stage == 3 and after and after[0] is not None:
                after[0](self._after_hook(m, buckets, reshard=after[1] if len(after) > 1 else True))
        for i, p in enumerate(self.params):
            p.grad_sink = GradientSink(self, i)

    def _hook(self, m: int, buckets: list):
        def before_module(module, args, *output):  # a forward pre-hook, or (the tail's) a forward hook
            if self.overlap or self.stage == 3:
                self.before_forward(buckets)
            if torch.compiler.is_compiling() or not torch.is_grad_enabled():
                return None
            x = output[0] if output else args[0]
            if not (torch.is_tensor(x) and x.requires_grad):
                self.unmarked.add(m)  # the embedding: its tokens need no gradient
                return None
            marked = _BackwardDone.apply(x, self, m)
            return marked if output else (marked, *args[1:])
        return before_module

    def _after_hook(self, m: int, buckets: list, reshard: bool = True):
        def after_module(module, args, output):  # ZeRO-3: a forward hook of the module itself
            if not torch.is_grad_enabled():
                self.release(buckets)  # evaluation: no backward will need them
                return None
            if self.reshard_after_forward and reshard:
                self.release(buckets)
            if torch.is_tensor(output) and output.requires_grad:  # a hook on the gradient of the output runs
                output.register_hook(lambda grad: self.before_backward(m))  # before the module's backward
            return None
        return after_module

    def before_forward(self, buckets: list) -> None:
        """Step 1, before a module whose parameters are in `buckets`: wait for them (those no
        earlier module prefetched are gathered now: a module larger than bucket_size spans
        several), and with DP overlap prefetch the bucket after."""
        for b in buckets:
            self.launch_gather(b)
            self.wait_gather(b)
        if self.overlap:
            self.launch_gather(buckets[-1] + 1)

    def before_backward(self, m: int) -> None:
        """ZeRO-3, before module m's backward (the hook on its output's gradient): its buckets gathered again
        (reshard_after_forward) and, with DP overlap, the previous module's prefetched."""
        for b in self.module_buckets[m]:
            self.launch_gather(b)
            self.wait_gather(b)
        if self.overlap and m > 0:
            for b in self.module_buckets[m - 1]:
                self.launch_gather(b)

    def fused_view(self, i: int) -> torch.Tensor:
        """Parameter i's view of its gradient buffer, for its backward's weight-gradient GEMM to
        accumulate into (GradientSink.take); it counts as arrived at its module's end (under a
        compiled forward, whose hooks mark none, at backward_done). A GEMM that dynamo traces
        returns its gradient instead (gradient_sink)."""
        b, k = self.where[i]
        self.fused.add(i)
        return self._grad_views(b)[k]

    @torch.no_grad()
    def add_gradients(self, m: int) -> None:
        """Step 2, after module m's backward: add its parameters' fresh gradients into their buckets'
        gradient buffers, one foreach add a bucket, and free them; count them and the gradients
        its backward accumulated there itself (fused_view) as arrived; with DP overlap, launch a
        bucket's reduction once every gradient of every microbatch is in."""
        fresh, arrived = {}, {}
        for i in self.modules[m]:
            has_grad = self.params[i].grad is not None
            if has_grad or i in self.fused:
                b = self.where[i][0]
                arrived[b] = arrived.get(b, 0) + 1
                if has_grad:
                    fresh.setdefault(b, []).append(i)
        self.fused.difference_update(self.modules[m])
        for b, n in arrived.items():
            if b in fresh:
                self._add(b, fresh[b])
            self.buckets[b].arrived += n
            if self.overlap and self.buckets[b].arrived == len(self.buckets[b].indices) * self.per_reduction:
                self._launch_reduction(b)
        if self.stage == 3 and (arrived or m not in self.unmarked):  # its backward is over: only the shard
            self.backwards[m] += 1                                     # stays (kept: after the step's last)
            if self.reshard_after_forward or self.backwards[m] >= self.microbatches:
                self.release(self.module_buckets[m])

    def _add(self, b: int, indices: list) -> None:
        """Parameters' fresh gradients into bucket b's buffer, in one foreach add, and freed."""
        views = self._grad_views(b)
        torch._foreach_add_([views[self.where[i][1]] for i in indices], [self.params[i].grad for i in indices])
        for i in indices:
            self.params[i].grad = None

    def mark_hooks_traced(self) -> None:
        """The forward is compiled (ParallelModel.compile): dynamo traces the modules' hooks, so none
        marks its backward, and backward_done adds every module's gradients."""
        self.hooks_traced = True

    def backward_done(self) -> None:
        """Step 3, after each backward call (a microbatch, or a pipeline chunk's): add what no module
        marked: the embedding's gradient, or, when the forward is compiled, every module's. (A
        pipeline chunk's backward without the embedding brings it no gradient: add_gradients
        then counts no backward of it.)"""
        if self.autograd_keeps_grads:
            return
        for m in range(len(self.modules)) if self.hooks_traced else sorted(self.unmarked):
            self.add_gradients(m)

    def reduce_gradients(self) -> None:
        """Step 4, after the last microbatch: launch the reductions not yet launched, then wait for
        every bucket's and hand the optimizer its shards' gradients."""
        if self.autograd_keeps_grads:
            return
        for b, bucket in enumerate(self.buckets):
            if bucket.arrived < len(bucket.indices) * self.microbatches:  # a parameter no loss reached,
                self._add_stragglers(b)                                   # or a gradient marked late
            fresh = self.each_microbatch and bucket.grads is not None and b not in self.unretired
            if b not in self.reducing or fresh:  # (reducing each microbatch: the last one's, unless launched)
                self._launch_reduction(b)
        if self.stage > 0 and self.layout.dp_replicate > 1:
            for b in range(len(self.buckets)):
                self._launch_replica_sum(b)
        for b in range(len(self.buckets)):
            self._finish_reduction(b)
        self.unretired.clear()
        self.summed.clear()
        for bucket in self.buckets:
            bucket.arrived = 0
        self.fused.clear()
        self.backwards = [0] * len(self.modules)

    @torch.no_grad()
    def _add_stragglers(self, b: int) -> None:
        late = [i for i in self.buckets[b].indices if self.params[i].grad is not None]
        if late:
            self._add(b, late)

    def _launch_reduction(self, b: int) -> None:
        """Sum the bucket's TP-replicated gradients over their replicas (norms, row-parallel
        biases: each TP rank saw a slice of the sequence; QKV's KV group shared by several ranks:
        each computed some of its query heads; they sit at the bucket's end), then launch its DP
        all-reduce (ZeRO-0) or reduce-scatter into this rank's shard (ZeRO 1-3)."""
        bucket = self.buckets[b]
        self._grad_views(b)
        if self.each_microbatch:  # the next microbatch's gradients count afresh
            bucket.arrived = 0
        grads = bucket.grads
        for start, end, replicas in bucket.replica_runs:
            with self.clock.waiting("comm", grads.device):
                dist.all_reduce(grads[start:end], group=self.layout.tp_replica_group(replicas))
        work, out = None, grads
        if self.stage > 0:  # in place: this rank's shard of the buffer receives its shard group's sum
            out = grads[bucket.shard_start:bucket.shard_end]
            if self.layout.dp_shard > 1:
                work = dist.reduce_scatter_single(out, grads, group=self.shard_group, async_op=True)
        elif self.layout.dp > 1:
            work = dist.all_reduce(grads, group=self.group, async_op=True)
        self.reducing[b] = (work, out)
        if self.stage >= 2:  # with DP overlap, in backward: the full buffers go as their reductions land
            self.unretired.append(b)
            if len(self.unretired) > REDUCTIONS_IN_FLIGHT:
                self._retire(self.unretired.pop(0))

    def _retire(self, b: int) -> None:
        """ZeRO 2/3: wait for bucket b's reduce-scatter and keep only this rank's shard of its sum;
        the full gradient buffer goes. Within a step's last backward (DP overlap) this keeps
        REDUCTIONS_IN_FLIGHT full buffers past the module computing, not the whole model's; the
        replica sum, the division and the hand-over to the optimizer follow in reduce_gradients."""
        bucket = self.buckets[b]
        if bucket.grads is None:  # retired already
            return
        work, out = self.reducing[b]
        if work is not None:
            with self.clock.waiting("comm", out.device):
                work.wait()
        summed = self.summed.get(b)  # an earlier microbatch's (parallel.reduce_each_microbatch)
        self.summed[b] = out.clone() if summed is None else summed.add_(out)
        self.reducing[b] = (None, self.summed[b])
        bucket.grads, bucket.grad_views = None, None

    def _launch_replica_sum(self, b: int) -> None:
        """Hybrid sharding: once bucket b's reduce-scatter is in, launch the sum of this rank's
        shard over its replicas (the ranks of the same shard rank in the other shard groups).
        Chained here, in reduce_gradients after backward, bucket after bucket: each bucket's
        all-reduce is on the wire while the next bucket's reduce-scatter is waited for. Launching
        it from backward as each reduce-scatter completes would need a poll, and ranks could then
        launch the replicate and shard groups' collectives in different orders."""
        if self.stage >= 2:  # this rank's shard of the step's reductions, every microbatch's
            self._retire(b)
        work, out = self.reducing[b]
        if work is not None:
            with self.clock.waiting("comm", out.device):
                work.wait()
        self.reducing[b] = (dist.all_reduce(out, group=self.replicate_group, async_op=True), out)

    def _finish_reduction(self, b: int) -> None:
        if self.stage >= 2:  # the full buffer goes; this rank's shard stays
            self._retire(b)
        work, out = self.reducing.pop(b)
        if work is not None:
            with self.clock.waiting("comm", out.device):
                work.wait()
        if self.layout.dp > 1:
            out.div_(self.layout.dp)
        bucket = self.buckets[b]
        grads = out if out.dtype == torch.float32 else out.float()
        for k, i in enumerate(bucket.indices):
            shard, p = self.shards[i], self.params[i]
            if self.stage == 0:
                start = bucket.offsets[k]
                shard.grad = grads[start:start + p.numel()].view_as(p)
            else:
                lo, hi = self.shard_ranges[i]
                start = bucket.offsets[k] + lo - bucket.shard_start
                shard.grad = grads[start:start + hi - lo]

    @torch.no_grad()
    def after_step(self) -> None:
        """Step 5, after the optimizer: zero the gradient buffers; ZeRO-0 in mixed precision casts
        the master weights back; ZeRO 1/2 prefetch the first bucket with overlap (before_forward
        chains the rest), or gather everything now without; ZeRO-3 gathers nothing until a
        module's forward asks."""
        for bucket in self.buckets:
            if bucket.grads is not None:
                bucket.grads.zero_()
            if self.stage == 0 and self.mixed:
                bucket.params.copy_(bucket.master)
        if self.stage == 0:
            return
        self.current.clear()
        if self.stage == 3:  # each module gathers its own at its forward
            return
        if self.overlap:
            self.launch_gather(0)
        else:
            self.gather_all()

    @torch.no_grad()
    def launch_gather(self, b: int) -> None:
        """Launch bucket b's all-gather of the updated shards, straight into the parameters
        (ZeRO 1/2), unless under way or current."""
        if self.stage == 0 or b >= len(self.buckets) or b in self.gathering or b in self.current:
            return  # (the later microbatches' forwards, or a pipeline's, find it current)
        bucket = self.buckets[b]
        if self.stage == 3:  # the full buffer exists again, gathered from the shard's own storage
            if bucket.params.untyped_storage().nbytes() == 0:
                _resize_storage(bucket.params, bucket.numel * bucket.params.element_size())
            mine = bucket.master.to(self.dtype)  # (fp32: the master itself)
            if self.layout.dp_shard == 1:
                bucket.params.copy_(mine)
        else:
            mine = bucket.params[bucket.shard_start:bucket.shard_end]  # in place, in the parameters' dtype: bf16 on the wire
            if self.mixed:
                mine.copy_(bucket.master)
        work = None
        if self.layout.dp_shard > 1:  # within the shard group: every replica holds the same shards
            work = dist.all_gather_single(bucket.params, mine, group=self.shard_group, async_op=True)
        self.gathering[b] = (work, mine)

    @torch.no_grad()
    def wait_gather(self, b: int) -> None:
        """Bucket b's parameters are this step's once this returns."""
        if b not in self.gathering:
            return
        work, _ = self.gathering.pop(b)
        self.current.add(b)
        if work is not None:
            with self.clock.waiting("comm", self.buckets[b].params.device):
                work.wait()

    @torch.no_grad()
    def release(self, buckets: Optional[list] = None) -> None:
        """ZeRO-3: free the buckets' full parameter buffers (all of them by default), as FSDP
        does: the storage shrinks to nothing under the parameters' views, which stay valid (as
        do autograd's saved references to them) and see the next gather's values."""
        for b in range(len(self.buckets)) if buckets is None else buckets:
            if b in self.gathering:
                self.wait_gather(b)
            self.current.discard(b)
            _resize_storage(self.buckets[b].params, 0)

    def microbatch_done(self, backward: bool, last: bool) -> None:
        """After a microbatch without a pipeline (which releases once its schedule is done). ZeRO-3:
        only the shards stay, but with reshard_after_forward off until the step's last backward.
        Reducing each microbatch: without DP overlap launch its reductions now, bucket by bucket
        (those of a bucket some parameter of which got no gradient too), and wait for them all, as
        FSDP2 does at the end of each backward (the last microbatch's: reduce_gradients)."""
        if self.each_microbatch and backward and not last:
            if not self.overlap:
                for b, bucket in enumerate(self.buckets):
                    self._add_stragglers(b)
                    if bucket.grads is not None and b not in self.unretired:
                        self._launch_reduction(b)
            while self.unretired:  # all in by the next microbatch, as FSDP2 waits at each backward's end
                self._retire(self.unretired.pop(0))
        if self.stage == 3 and (self.reshard_after_forward or last or not backward):
            self.release()

    def gather_all(self) -> None:
        for b in range(len(self.buckets)):
            self.launch_gather(b)
        for b in range(len(self.buckets)):
            self.wait_gather(b)

    @torch.no_grad()
    def parameters_loaded(self) -> None:
        """After a checkpoint load. In mixed precision it wrote the fp32 masters (checkpoint.py
        saves them as the model's weights): cast them into the bf16 parameters. In fp32 it wrote
        the parameters, which the shards are views of: nothing to do."""
        if self.stage == 3:  # the masters (fp32: the shards themselves) hold them; gathered at use
            self.release()
            return
        if not self.mixed:
            return
        for bucket in self.buckets:
            span = bucket.params if self.stage == 0 else bucket.params[bucket.shard_start:bucket.shard_end]
            span.copy_(bucket.master)
        if self.stage > 0:
            self.current.clear()
            self.gather_all()


def _resize_storage(t: torch.Tensor, nbytes: int) -> None:
    """Resize t's storage in place, as FSDP2 does, through the dispatcher's op (a plain
    UntypedStorage.resize_ is invisible to a TorchDispatchMode: the rehearsal's memory ledger
    follows ZeRO-3's frees and gathers through this one)."""
    torch.ops.inductor.resize_storage_bytes_(t, nbytes)


def _replicas_last(indices: list, params: list) -> list:
    """The bucket's order: TP-replicated parameters last, by their number of replicas, so that
    the sum over each set of replicas is one call on a run of the buffer's tail."""
    return sorted(indices, key=lambda i: tp_summed_replicas(params[i]))  # stable: forward order within


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
