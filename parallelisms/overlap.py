"""Communication/computation overlap: the schedules MegaScale (§3.3) and Domino ablate, and the
clock that measures how much communication is left exposed.

Written by hand over async collectives, not left to DDP/FSDP/async-TP, because the ablation must
control when each collective launches and when compute waits for it:

- WaitClock: where each step's time went: the compute stream blocked on communication, by kind,
  "comm" (TP and DP collectives, PP sends) and "bubble" (PP receives: idle until the neighbouring
  stage delivers), and the compute stream's own work. Each rank's clock is its layout's
  (parallel.Layout.clock), which every part that waits is given.
- TPGroup: a TP process group as these collectives use it: the group, the clock their waits are
  timed on, and the activations gathered over it that backward gathers again (parallel.Layout's
  tp_group; the TP layers hold it).
- TP (parallel.overlap.tp, with tp_chunks pieces), on the sequence-parallel block of parallel.py:
  - off (Megatron-LM, the baseline): forward's collectives block; backward launches the
    re-gather of a GEMM's input before its input gradient, and that gradient's reduce-scatter
    before its weight gradient (GatheredLinears).
  - chunked (MegaScale): this rank's sequence slice is cut into pieces. Each piece's all-gather
    is in flight while the previous piece's GEMMs run, and each piece's reduce-scatter while the
    next piece's GEMMs run. Only token-wise work is chunked (QKV, MLP, output projections);
    attention's core sees the whole sequence, reassembled in order.
  - domino (Domino, arXiv 2409.15241): the batch rows are cut into pieces that go through the
    whole block independently; a piece's collective is in flight while the other pieces compute,
    and its wait comes when its turn comes round again.
  In backward the same overlap falls out of autograd: a wait's backward launches the gradient's
  collective and the matching start's backward waits for it, and the engine runs ready nodes
  latest-created first, so the other pieces' backward runs in between.
- DP (parallel.overlap.dp) lives in zero.ZeroDataParallel (its schedule, in its own file).
- PP (parallel.overlap.pp) lives in pipeline.Pipeline.
"""
from __future__ import annotations

import contextlib
import time
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallelisms.zero import gradient_sink, weight_gradient


class WaitClock:
    """Where a rank's step goes, measured the same way on CPU and GPU.

    - step_s: host wall time from start_step() to the step's one host sync (the read of its loss),
      after which everything the step put on the compute stream has run. Throughput uses it.
    - comm_s / bubble_s: time the compute stream stood still waiting for communication (comm:
      TP and DP collectives, PP sends; bubble: PP receives and the slowest rank).
    - compute_s: the compute stream's own span of the step minus those stalls.
    - waits: those stalls summed per label, where `describe` labels them by what they wait for
      ("comm dp", "comm tp", "bubble pp recv": observe/oplog.py's), so a group's own collectives can be
      told from the rest (observe/stragglers.py's link floor: the dp group's, not TP's on the host's loopback).
    On CPU everything blocks, so each is a host clock reading around the wait. On CUDA a wait only
    makes the compute stream wait, so each is a pair of events recorded on that stream (from a
    pool: a 175B step has ~6k TP waits), resolved once at the end of the step, after the sync.
    `events` is the event class (torch.cuda.Event); tests pass a stand-in to run the GPU path on
    CPU."""

    def __init__(self, events=None):
        self.events_class = events
        self._pool, self._used, self.seconds, self.labelled = [], 0, {}, {}
        self._pairs, self._span, self._t0, self._wall0 = [], None, 0.0, 0.0
        self.on_wait = None  # f(kind, wall-clock start, seconds) for each wait: observe/oplog.py's spans
        self.describe = None  # f(kind) -> the wait's label as it is queued (observe/oplog.py: "comm tp", ...)

    def _event(self):
        if self._used == len(self._pool):
            cls = self.events_class or torch.cuda.Event
            self._pool.append(cls(enable_timing=True))
        self._used += 1
        return self._pool[self._used - 1]

    def _on_stream(self, device) -> bool:
        return torch.device(device).type == "cuda" or self.events_class is not None

    def start_step(self, device) -> None:
        """Zero the clock; the step's compute-stream span starts here."""
        self.seconds, self._pairs, self._used, self.labelled = {"comm": 0.0, "bubble": 0.0}, [], 0, {}
        self._t0, self._wall0 = time.perf_counter(), time.time()
        self._span = None
        if self._on_stream(device):
            start = self._event()
            start.record()
            self._span = start

    @contextlib.contextmanager
    def waiting(self, kind: str, device):
        if self._on_stream(device):
            start, end = self._event(), self._event()
            start.record()
            yield
            end.record()
            self._pairs.append((kind, start, end, self.describe(kind) if self.describe else kind))
            return
        t0 = time.perf_counter()
        yield
        seconds = time.perf_counter() - t0
        self.seconds[kind] = self.seconds.get(kind, 0.0) + seconds
        label = self.describe(kind) if self.describe else kind  # on a CPU the wait has just ended
        self.labelled[label] = self.labelled.get(label, 0.0) + seconds
        if self.on_wait is not None:
            self.on_wait(label, time.time() - seconds, seconds)

    def end_step(self, device, host_sync) -> tuple:
        """Ends the step: records its end on the compute stream, runs `host_sync` (the step's one
        read of device values, which waits for the stream) and returns (its result, the figures)."""
        end = None
        if self._span is not None:
            end = self._event()
            end.record()
        value = host_sync()
        step_s = time.perf_counter() - self._t0
        span = step_s
        if end is not None:
            end.synchronize()  # already passed: host_sync waited for the stream
            span = self._span.elapsed_time(end) / 1e3
            for kind, a, b, label in self._pairs:
                seconds = a.elapsed_time(b) / 1e3
                self.seconds[kind] = self.seconds.get(kind, 0.0) + seconds
                self.labelled[label] = self.labelled.get(label, 0.0) + seconds
                if self.on_wait is not None:  # placed on the host's clock from the step's start
                    self.on_wait(label, self._wall0 + self._span.elapsed_time(a) / 1e3, seconds)
        comm, bubble = self.seconds.get("comm", 0.0), self.seconds.get("bubble", 0.0)
        figures = {"step_s": step_s, "comm_s": comm, "bubble_s": bubble, "compute_s": max(0.0, span - comm - bubble),
                   "waits": self.labelled}
        self.start_step("cpu")  # waits outside a step (evaluation, checkpoints) start from zero
        return value, figures


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the next GEMM will read x in: autocast's where it is on (an all-gather then sends
    half the bytes), else x's own. (Autocast has no meta device: a rehearsal's parameters already
    hold the compute dtype.)"""
    kind = x.device.type
    if kind != "meta" and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype


def timed_wait(work, clock: WaitClock, device) -> None:
    with clock.waiting("comm", device):
        work.wait()


# --- Sequence-parallel collectives, async, as autograd pairs ---
# A collective is two autograd nodes: Start launches it and returns the buffer it fills, Wait
# waits and returns the result. Backward reverses them: Wait's backward launches the gradient's
# collective (all-gather <-> reduce-scatter), Start's backward waits for it.

# --- Gathered activations are not kept for backward: Megatron-LM's sequence parallelism ---
# A column-parallel GEMM reads the all-gathered sequence, and autograd would keep that full-length
# copy for the weight gradient: tp times the sharded LayerNorm output, 11 GB per GPU on the
# 175B layout's first stage. As Megatron-LM does, backward gathers it again from the shard instead.
# At overlap.tp=off GatheredLinears (below) keeps the shard itself (Megatron-LM's own way, its
# re-gather launched beside the input gradient's GEMM). The chunked and domino modes do it with
# saved-tensor hooks around the TP block: every GEMM that reads a gathered piece keeps the shard.

class TPGroup:
    """A TP process group as the sequence-parallel collectives use it: `pg` (the process group),
    `size`, the `clock` their waits are timed on, and the gathered activations whose backward
    re-gathers them from their shards (`gathered`: id of a gather output's storage -> (a weak
    reference to that storage, its _Regather); an entry goes when its storage does).
    `keep_gathered_whole` turns regather_saved off (a rehearsal of a compiled job, whose traced
    blocks save their gathered inputs whole)."""

    def __init__(self, pg, size: int, clock: WaitClock):
        self.pg, self.size, self.clock = pg, size, clock
        self.gathered: dict = {}
        self.keep_gathered_whole = False

    def remember_gathered(self, full: torch.Tensor, shard: torch.Tensor) -> "_Regather":
        """full (batch-major [B, size*t, ...], contiguous) was all-gathered from shard
        (sequence-major [t, B, ...]) over this group."""
        storage = full.untyped_storage()
        key, gathered = id(storage), self.gathered
        regather = _Regather(shard, self)
        gathered[key] = (weakref.ref(storage, lambda _, key=key: gathered.pop(key, None)), regather)
        return regather

    def regather_saved(self):
        """The context in which a TP block's forward runs: what it saves of a gathered tensor is the
        shard, gathered again when backward needs it."""
        if torch.compiler.is_compiling() or self.keep_gathered_whole:
            return contextlib.nullcontext()  # dynamo does not trace saved-tensor hooks: the full copy stays
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, t: torch.Tensor):
        entry = self.gathered.get(id(t.untyped_storage()))
        if entry is None or entry[0]() is None:
            return t
        entry[1].pending += 1
        return entry[1], (t.shape, t.stride(), t.storage_offset())


def batch_major(gathered: torch.Tensor) -> torch.Tensor:
    """A sequence-major gather's result [s, B, ...] as the contiguous [B, s, ...] the GEMMs read:
    a GEMM reading the transposed view would copy it anyway, and save its copy for backward,
    which no saved-tensor hook can then tell from any other tensor (with B > 1 every gathered
    input would stay whole for backward). With B = 1 the view is already contiguous: no copy."""
    return gathered.transpose(0, 1).contiguous()


class _Regather:
    """A gathered tensor's shard, gathered again when backward first needs it and shared by every
    saved view of it (PTB's attention and MLP read one gathered input: one re-gather), until the
    last of them has been unpacked. prefetch() launches it early, when the backward of the region
    that read it begins (Pending.after), so it is on the wire while that region's output GEMMs and
    attention run their backward, as the analytical model assumes: a gather launched only when
    the GEMM needs it would leave all of it exposed."""

    def __init__(self, shard: torch.Tensor, group: TPGroup):
        self.shard, self.group, self.pending, self.full, self.inflight = shard.detach(), group, 0, None, None

    def prefetch(self) -> None:
        if self.pending and self.full is None and self.inflight is None:  # still to be unpacked
            out = self.shard.new_empty((self.shard.shape[0] * self.group.size, *self.shard.shape[1:]))
            self.inflight = _InFlight(dist.all_gather_single(out, self.shard, group=self.group.pg, async_op=True),
                                      out, self.shard, self.group, gather=True, remember=False)

    def tensor(self) -> torch.Tensor:
        if self.full is None:
            self.prefetch()
            self.full, self.inflight = self.inflight.wait(), None
        full = self.full
        self.pending -= 1
        if self.pending == 0:
            self.full = None
        return full


def _unpack(saved):
    if isinstance(saved, tuple) and len(saved) == 2 and isinstance(saved[0], _Regather):
        return saved[0].tensor().as_strided(*saved[1])
    return saved


class _InFlight:
    """A launched collective: its work handle, the buffer it fills (sequence-major) and its input,
    kept alive until the wait. A gather's result comes batch-major and contiguous, and is
    remembered for regather_saved unless `remember` is off."""

    def __init__(self, work, out, src, group: TPGroup, gather: bool = False, remember: bool = True):
        self.work, self.out, self.src, self.gather, self.group = work, out, src, gather, group
        self.remember, self.regather = remember, None

    def wait(self) -> torch.Tensor:
        timed_wait(self.work, self.group.clock, self.out.device)
        if not self.gather:
            return self.out.transpose(0, 1)
        full = batch_major(self.out)
        if self.remember:
            self.regather = self.group.remember_gathered(full, self.src)
        return full


def launch_gather(x: torch.Tensor, group: TPGroup, remember: bool = True) -> _InFlight:
    """[B, t, ...] sequence slices -> [B, size*t, ...], rank order along the sequence."""
    xs = x.transpose(0, 1).contiguous()
    out = xs.new_empty((xs.shape[0] * group.size, *xs.shape[1:]))
    return _InFlight(dist.all_gather_single(out, xs, group=group.pg, async_op=True), out, xs, group, True, remember)


def launch_reduce_scatter(x: torch.Tensor, group: TPGroup) -> _InFlight:
    """[B, size*t, ...] partial sums -> this rank's [B, t, ...] slice of their sum."""
    xs = x.transpose(0, 1).contiguous()
    out = xs.new_empty((xs.shape[0] // group.size, *xs.shape[1:]))
    return _InFlight(dist.reduce_scatter_single(out, xs, group=group.pg, async_op=True), out, xs, group)


class _Start(torch.autograd.Function):
    """Forward: launches the collective. Backward: waits for the gradient's."""

    @staticmethod
    def forward(ctx, x, pending):
        ctx.pending = pending
        return pending.launch(x)

    @staticmethod
    def backward(ctx, _):
        return ctx.pending.finish_gradient(), None


class _Wait(torch.autograd.Function):
    """Forward: waits for the collective. Backward: launches the gradient's."""

    @staticmethod
    def forward(ctx, buffer, pending):
        ctx.pending = pending
        return pending.finish()

    @staticmethod
    def backward(ctx, grad):
        return ctx.pending.launch_gradient(grad), None


class Pending:
    """A sequence-parallel collective in flight; wait() gives its result, differentiably. Its two
    autograd nodes (_Start, _Wait) share it and call its steps, which run in this order: launch
    and finish in forward, launch_gradient and finish_gradient in backward (all-gather <->
    reduce-scatter). One collective is on the wire at a time (`inflight`). A reduce-scatter's
    `after` are the gathers whose results fed what it reduces: their re-gathers are prefetched
    when its backward has the gradient."""

    def __init__(self, x: torch.Tensor, group: TPGroup, gather: bool, after: tuple = ()):
        self.group, self.gather, self.after = group, gather, after
        self.inflight, self.regather = None, None
        self.buffer = _Start.apply(x, self)

    def wait(self) -> torch.Tensor:
        out, self.buffer = _Wait.apply(self.buffer, self), None
        return out

    def launch(self, x: torch.Tensor) -> torch.Tensor:
        if self.gather:  # the next GEMM casts anyway: half the bytes
            x = x.to(compute_dtype(x))
        self.inflight = (launch_gather if self.gather else launch_reduce_scatter)(x, self.group)
        return self.inflight.out

    def finish(self) -> torch.Tensor:
        inflight, self.inflight = self.inflight, None
        out = inflight.wait()
        if inflight.regather is not None:  # weak: the saved tensors alone keep it alive
            self.regather = weakref.ref(inflight.regather)
        return out

    def launch_gradient(self, grad: torch.Tensor) -> torch.Tensor:
        self.inflight = (launch_reduce_scatter(grad, self.group) if self.gather
                         else launch_gather(grad, self.group, remember=False))
        return grad.transpose(0, 1)  # (to _Start, which ignores it: the gradient comes from the collective)

    def finish_gradient(self) -> torch.Tensor:
        inflight, self.inflight = self.inflight, None
        grad = inflight.wait()
        for gather in self.after:  # this region's backward begins: its inputs' re-gathers go out
            gather.prefetch_regather()
        return grad

    def prefetch_regather(self) -> None:
        regather = self.regather and self.regather()
        if regather is not None:
            regather.prefetch()


def gather_async(x: torch.Tensor, group: TPGroup) -> Pending:
    return Pending(x, group, gather=True)


def reduce_scatter_async(x: torch.Tensor, group: TPGroup, after: tuple = ()) -> Pending:
    return Pending(x, group, gather=False, after=after)


def interleave(steps: list) -> list:
    """Runs generators round-robin and returns their return values. Each runs until it launches
    a collective and yields its Pending; the others run next, and its wait comes when its turn
    comes round again: as late as this schedule allows."""
    results, pending, live = [None] * len(steps), [None] * len(steps), list(range(len(steps)))
    while live:
        for i in list(live):
            try:
                pending[i] = steps[i].send(None if pending[i] is None else pending[i].wait())
            except StopIteration as stop:
                results[i] = stop.value
                live.remove(i)
    return results


# --- Megatron-LM's sequence-parallel collectives, and its async TP backward (overlap.tp=off) ---
# Activations are [batch, seq, hidden]. Under sequence parallelism each TP rank holds a slice of
# the sequence; the collectives work on dim 0, so the sequence is moved there for the call.

def gather_seq(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    xs = x.transpose(0, 1).contiguous()
    out = xs.new_empty((xs.shape[0] * group.size, *xs.shape[1:]))
    with group.clock.waiting("comm", x.device):
        dist.all_gather_single(out, xs, group=group.pg)
    return batch_major(out)


def reduce_scatter_seq(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    xs = x.transpose(0, 1).contiguous()
    out = xs.new_empty((xs.shape[0] // group.size, *xs.shape[1:]))
    with group.clock.waiting("comm", x.device):
        dist.reduce_scatter_single(out, xs, group=group.pg)
    return out.transpose(0, 1)


class GatheredLinears(torch.autograd.Function):
    """Sequence slices -> all-gathered -> one or more column-parallel GEMMs reading them (PTB's QKV
    and MLP-in share one gather). Megatron-LM's sequence-parallel linear with its async backward
    (LinearWithGradAccumulationAndAsyncCommunication), written by hand because it is the
    ablation's baseline (tp=off) and must hide exactly what Megatron-LM hides: backward
    launches the re-gather of the input and computes the input gradient meanwhile, then launches
    that gradient's reduce-scatter and computes the weight gradients meanwhile. Only the slice
    is kept for backward (11 GB a GPU less on the 175B layout's first stage), unless keep_full
    (full recompute, whose recomputed forward holds the gathered input anyway).
    Called as apply(x, group, keep_full, weight, bias, weight, bias, ...); bias may be None."""

    @staticmethod
    def forward(ctx, x, group, keep_full, *weights_and_biases):
        weights, biases = weights_and_biases[0::2], weights_and_biases[1::2]
        x = x.to(compute_dtype(x))  # the GEMM casts to bf16 anyway: send half the bytes
        full = gather_seq(x, group)
        ctx.group, ctx.keep_full, ctx.has_bias = group, keep_full, [b is not None for b in biases]
        ctx.sinks = [gradient_sink(w) for w in weights]
        ctx.save_for_backward(full if keep_full else x, *weights)
        return tuple(F.linear(full, w, b) for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx, *grads):
        kept, *weights = ctx.saved_tensors
        regather = None if ctx.keep_full else launch_gather(kept, ctx.group, remember=False)
        grads = [g.reshape(-1, g.shape[-1]) for g in grads]  # [tokens, out features]
        input_grad = grads[0] @ weights[0].to(grads[0].dtype)
        for g, w in zip(grads[1:], weights[1:]):  # PTB: MLP-in's is added to QKV's inside its GEMM
            input_grad = torch.addmm(input_grad, g, w.to(g.dtype))
        full = kept if ctx.keep_full else regather.wait()
        reduce_scatter = launch_reduce_scatter(input_grad.view(*full.shape[:-1], -1), ctx.group)
        del input_grad  # the reduce-scatter holds what it sends: one full-sequence buffer less at the peak
        rows = full.reshape(-1, full.shape[-1])
        param_grads = []
        for g, w, has_bias, sink in zip(grads, weights, ctx.has_bias, ctx.sinks):
            param_grads += [weight_gradient(sink, w.dtype, g, rows.to(g.dtype)), g.sum(0).to(w.dtype) if has_bias else None]
        return reduce_scatter.wait(), None, None, *param_grads


# --- MegaScale's chunked overlap: pieces of the sequence through the token-wise GEMMs ---

def chunked_region(h: torch.Tensor, group, pieces: int, pre, mix=None, post=None) -> torch.Tensor:
    """reduce_scatter(post(mix(pre(all_gather(h))))) with the collectives overlapped, for h this
    rank's [B, t, d] sequence slice. pre and post are token-wise (GEMMs), so each runs on one
    gathered piece while another piece's collective is on the wire. pre returns a tuple; mix sees
    its first element over the whole sequence (attention's core), the rest stay in pieces."""
    if mix is None:
        def piece_steps(piece):
            gather = gather_async(piece, group)
            return (yield reduce_scatter_async(pre((yield gather)), group, after=(gather,)))
        return torch.cat(interleave([piece_steps(p) for p in h.chunk(pieces, dim=1)]), dim=1)

    gathers = []

    def gathered(piece):
        gathers.append(gather_async(piece, group))
        return pre((yield gathers[-1]))
    outs = interleave([gathered(p) for p in h.chunk(pieces, dim=1)])
    tp = group.size
    mixed = _as_pieces(mix(_in_order([o[0] for o in outs], tp)), tp, pieces)

    def scattered(j):
        return (yield reduce_scatter_async(post(mixed[j], *outs[j][1:]), group, after=(gathers[j],)))
    return torch.cat(interleave([scattered(j) for j in range(pieces)]), dim=1)


def _in_order(pieces: list, tp: int) -> torch.Tensor:
    """Gathered pieces ([B, tp*c, ...] each: rank 0's j-th piece, rank 1's, ...) -> [B, s, ...] in
    sequence order (rank 0's pieces 0..k-1, then rank 1's, ...)."""
    x = torch.stack(pieces, dim=1)
    b, k, c = x.shape[0], x.shape[1], x.shape[2] // tp
    return x.view(b, k, tp, c, *x.shape[3:]).transpose(1, 2).reshape(b, k * tp * c, *x.shape[3:])


def _as_pieces(x: torch.Tensor, tp: int, k: int) -> list:
    """The inverse of _in_order."""
    b, c = x.shape[0], x.shape[1] // (tp * k)
    x = x.view(b, tp, k, c, *x.shape[2:]).transpose(1, 2)
    return [piece.reshape(b, tp * c, *x.shape[4:]) for piece in x.unbind(1)]
