"""Pipeline parallelism: this rank's model chunks, the 1F1B and interleaved-1F1B schedules, and
the executor that runs them with point-to-point messages between stages.

NCCL's rules decide how messages travel (clustermodel/nccl_rules.py checks them): tags are ignored, sends and
receives match first-in first-out per pair of ranks and communicator, and an unbatched send or
receive blocks its stream, shared by both directions of a pair, until the peer posts its side. A
single channel carrying activations one way and gradients the other therefore deadlocks 1F1B at
pp=2 (each rank's next receive queues behind a send the other has not received yet), and, at
pp=2 with interleaving, activations and gradients travelling the same way arrive in an order the
receiver does not consume them in. So each kind of message (activations, gradients) in each
direction (to a higher or a lower pp rank: interleaving wraps the last rank round to the first)
has a process group of its own (Layout.pp_channels). Each stream then carries one sender's
messages of one kind to one receiver, produced and consumed in the same order (the schedule
walks (microbatch, chunk) in one order on every rank), so no order of posting can block: the
receiver only ever waits for the message it needs next. (Megatron-LM instead pairs each send with
the next receive in one batched exchange both ends agree on; that shares one stream per rank,
where a receive posted ahead blocks the sends behind it, which is why its overlap mode switches
batching off.) The same holds on gloo, where tags are not used either, so the CPU tests run
NCCL's matching rule.

parallel.overlap.pp decides when a receive is posted (MegaScale §3.3). Sends go out as soon as
their tensor is computed, asynchronously; each is released with its tensor once complete (NCCL's
works report completion; gloo's only once waited for, so on CPU they go at the step's end).
- off: a receive is posted when the compute that needs it is next, and blocks it: every
  transfer is exposed at the receiver.
- on: the receive for the next compute is posted before the current compute starts, so the
  transfer runs under it, in warm-up, steady phase and cool-down alike.
Time blocked on a receive is the bubble (idle until the neighbouring stage delivers, and the
transfer itself when it is not hidden); time blocked on sends is exposed communication.
Messages travel in the dtype of the residual stream (the parameters' dtype: bf16 under
precision=bf16), the dtype the next stage computes in.

Scatter/gather (parallel.pp_scatter_gather, Narayanan et al. 2021 §4.1): without sequence
parallelism every TP rank of a stage holds the whole activation (and the whole input gradient), so
each sends only its 1/tp of it (a contiguous slice of the flattened tensor) to its peer of the next
stage, and the receiving stage all-gathers the slices over its TP group (NVLink) before it computes:
tp times fewer bytes between stages. The gather runs at the receive's wait, which every rank of a TP
group reaches in the same order (they follow the same plan). Under sequence parallelism each rank
already sends its slice of the sequence and the switch changes nothing.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.distributed as dist

from observe import spans


def autocast(device: torch.device, dtype: torch.dtype):
    """Autocast to `dtype` on the device's type, or nothing for fp32 and on the meta device (a
    rehearsal: autocast has no meta dispatch, and the parameters hold the compute dtype already)."""
    if dtype == torch.float32 or device.type == "meta":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def around(hooks: list, backward: bool, action: Optional[tuple] = None):
    """One context of every hook around a unit of compute (ParallelModel.around_compute), the first
    the outermost; nothing without hooks. Each hook is called hook(backward, action): the pipeline
    action ((kind, microbatch, chunk)) the unit is, or None for a whole forward and backward."""
    if not hooks:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    for hook in hooks:
        stack.enter_context(hook(backward, action))
    return stack


def split_for_pipeline(model: torch.nn.Module, layout: Layout, layers: list) -> list:
    """This rank's model chunks. `layers`: the blocks of each of the pp*vpp virtual stages, in
    model order (parallel.chunk_layers); stage s = v*pp + pp_rank holds the next layers[s] blocks
    after those of the stages before it: rank r gets stages r, r+pp, ... (Megatron's
    interleaving). Blocks keep their global index. A stage may hold no block: the first then runs
    the embedding alone, the last the final norm and head alone."""
    import copy
    stages, vpp = len(layers), len(layers) // layout.pp
    starts = [sum(layers[:s]) for s in range(stages + 1)]
    chunks = []
    for v in range(vpp):
        stage = v * layout.pp + layout.pp_rank
        chunk = copy.deepcopy(model) if stages > 1 else model
        for name in list(chunk.blocks):
            if not starts[stage] <= int(name) < starts[stage + 1]:
                del chunk.blocks[name]
        if stage != 0:
            chunk.embed = None
        if stage != stages - 1:
            chunk.norm, chunk.head = None, None
        chunk.stage = stage
        chunks.append(chunk)
    return chunks


def pipeline_order(pp: int, rank: int, vpp: int, microbatches: int) -> list:
    """(kind, microbatch, chunk) actions of 1F1B (vpp=1) or interleaved 1F1B (vpp>1) on one rank.
    Warm-up runs enough forwards to fill the pipe, the steady phase alternates one forward and one
    backward, cool-down drains the backwards. Interleaving walks microbatches in groups of pp
    through each chunk in turn, so a rank's bubble shrinks by vpp: (pp-1)/(m*vpp)."""
    total = microbatches * vpp

    def chunk(k, forward):
        c = (k // pp) % vpp
        return c if forward else vpp - 1 - c

    def microbatch(k):
        return (k // (pp * vpp)) * pp + k % pp

    warmup = min(total, pp - rank - 1 if vpp == 1 else (pp - rank - 1) * 2 + (vpp - 1) * pp)
    order = [("F", k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [("F", warmup + k), ("B", k)]
    order += [("B", k) for k in range(total - warmup, total)]
    return [(kind, microbatch(k), chunk(k, kind == "F")) for kind, k in order]


class Message:
    """One activation ("A", into stage `stage`) or gradient ("G", into stage `stage`) of a microbatch."""

    def __init__(self, kind: str, mb: int, stage: int, src: int, dst: int):
        self.kind, self.mb, self.stage, self.src, self.dst = kind, mb, stage, src, dst

    def channel(self) -> tuple:
        return self.kind, "up" if self.src < self.dst else "down"


def messages(action: tuple, pp_rank: int, pp: int, vpp: int) -> tuple:
    """(what `action` receives before it computes, what it sends after), each a Message or None.
    Virtual stage s lives on pp rank s % pp."""
    kind, mb, c = action
    stages, s = pp * vpp, c * pp + pp_rank
    if kind == "F":
        need = Message("A", mb, s, (s - 1) % pp, pp_rank) if s > 0 else None
        give = Message("A", mb, s + 1, pp_rank, (s + 1) % pp) if s < stages - 1 else None
    else:
        need = Message("G", mb, s, (s + 1) % pp, pp_rank) if s < stages - 1 else None
        give = Message("G", mb, s - 1, pp_rank, (s - 1) % pp) if s > 0 else None
    return need, give


def schedule(pp: int, pp_rank: int, vpp: int, microbatches: int, backward: bool) -> list:
    """This rank's actions: 1F1B or interleaved 1F1B when training, every forward in order when
    evaluating (microbatch by microbatch, each through this rank's chunks in turn)."""
    if backward:
        return pipeline_order(pp, pp_rank, vpp, microbatches)
    return [("F", mb, c) for mb in range(microbatches) for c in range(vpp)]


def plan(pp: int, pp_rank: int, vpp: int, microbatches: int, overlap: bool, backward: bool = True) -> list:
    """The order in which this rank posts its receives, waits, computes and sends, one op each:
    [("recv", i, Message) | ("wait", i) | ("compute", i, action) | ("send", i, Message)], i the
    action's index. Pipeline.run follows it op by op; nccl_rules checks it for every rank."""
    order = schedule(pp, pp_rank, vpp, microbatches, backward)
    io = [messages(a, pp_rank, pp, vpp) for a in order]
    ops, posted = [], set()
    for i, action in enumerate(order):
        ahead = [i, i + 1] if overlap and i + 1 < len(order) else [i]
        for j in ahead:
            if io[j][0] is not None and j not in posted:
                ops.append(("recv", j, io[j][0]))
                posted.add(j)
        if io[i][0] is not None:
            ops.append(("wait", i))
        ops.append(("compute", i, action))
        if io[i][1] is not None:
            ops.append(("send", i, io[i][1]))
    return ops


class Pipeline:
    """Runs this rank's chunks over a list of microbatches, following plan()."""

    def __init__(self, chunks: list, layout, overlap: bool = False, after_backward=None, sequence_parallel: bool = True,
                 scatter_gather: bool = True):
        """after_backward: called after each chunk's backward (ZeRO adds the gradients no module's
        own backward added, zero.ZeroDataParallel.backward_done). sequence_parallel: the stages
        send this rank's slice of the sequence (else all of it, or with scatter_gather this rank's
        1/tp of it, all-gathered over TP on receipt)."""
        self.chunks, self.layout, self.overlap = chunks, layout, overlap
        self.seq_shards = layout.tp if sequence_parallel else 1
        self.pieces = layout.tp if scatter_gather and not sequence_parallel else 1  # slices a message is sent in
        self.after_backward = after_backward or (lambda: None)
        self.stages = layout.pp * len(chunks)
        self.channels = layout.pp_channels  # {(kind, direction): process group}
        self.group = layout.group("pp")
        self.device = next(chunks[0].parameters()).device
        self.sends: list = []  # (work, tensor) in flight: gloo reads the tensor until complete
        self.most_held = 0     # the most sends held at once (tests: they are released as they complete)

    def _peer(self, pp_rank: int) -> int:
        return dist.get_global_rank(self.group, pp_rank)

    def run(self, inputs: list, targets: list, loss_fn, autocast_dtype, backward: bool = True,
            around_compute: list = ()) -> torch.Tensor:
        """Forward (and backward) over all microbatches; returns the summed mean loss (a 0-d tensor
        on the device, read by the caller once per step) on the last stage, 0 elsewhere. Losses are
        divided by the microbatch count so gradients accumulate to the mean over the whole batch.
        around_compute: the hooks around each action's compute (ParallelModel.around_compute)."""
        m, vpp = len(inputs), len(self.chunks)
        b, t = inputs[0].shape[0], inputs[0].shape[1] // self.seq_shards
        shape, dtype = (b, t, self.chunks[0].cfg.d_model), next(self.chunks[0].parameters()).dtype
        saved, received, total = {}, {}, torch.zeros((), device=self.device)
        for op in plan(self.layout.pp, self.layout.pp_rank, vpp, m, self.overlap, backward):
            if op[0] == "recv":
                buf = torch.empty(shape, dtype=dtype, device=self.device)
                piece = buf if self.pieces == 1 else buf.new_empty(buf.numel() // self.pieces)
                received[op[1]] = (self._post(dist.irecv, piece, op[2], op[2].src), buf, piece)
            elif op[0] == "wait":
                work, buf, piece = received[op[1]]
                with self.layout.clock.waiting("bubble", self.device):
                    work.wait()
                if piece is not buf:
                    with self.layout.clock.waiting("comm", self.device):
                        dist.all_gather_single(buf.view(-1), piece, group=self.layout.group("tp"))
            elif op[0] == "compute":
                buf = received.pop(op[1], (None, None, None))[1]
                with spans.segment(spans.action_name(op[2]), self.device), around(around_compute, backward, op[2]):
                    out = self._compute(op[2], buf, inputs, targets, loss_fn, autocast_dtype, backward, saved)
                if out is not None and out.dim() == 0:
                    total += out
                self._release_completed()
            else:
                tensor = out.detach().to(dtype).contiguous()
                if self.pieces > 1:  # this rank's slice, alone, so the whole tensor is not held in flight
                    tensor = tensor.view(-1).chunk(self.pieces)[self.layout.tp_rank].clone()
                self.sends.append((self._post(dist.isend, tensor, op[2], op[2].dst), tensor))
        with self.layout.clock.waiting("comm", self.device):
            for work, _ in self.sends:
                work.wait()
        self.sends.clear()
        return total

    def _post(self, fn, tensor, message: Message, peer_pp_rank: int):
        return fn(tensor, self._peer(peer_pp_rank), group=self.channels[message.channel()])

    def _release_completed(self) -> None:
        """Drops the sends that have completed, so a step holds only the messages still in flight."""
        self.most_held = max(self.most_held, len(self.sends))
        self.sends = [(w, t) for w, t in self.sends if not w.is_completed()]

    def _compute(self, action, received, inputs, targets, loss_fn, autocast_dtype, backward, saved):
        """Runs one action. Returns what it sends on (a forward's output, a backward's input
        gradient), the loss (0-d) on the last stage's forward, or None."""
        kind, mb, c = action
        chunk = self.chunks[c]
        stage = chunk.stage
        if kind == "F":
            x = inputs[mb] if stage == 0 else received.requires_grad_(backward)
            with autocast(x.device, autocast_dtype), torch.set_grad_enabled(backward):
                y = chunk(x)
            if stage == self.stages - 1:
                loss = loss_fn(y, targets[mb]) / len(inputs)
                if backward:
                    saved[(mb, c)] = x, loss
                return loss.detach()
            if backward:
                saved[(mb, c)] = x, y
            return y
        x, y = saved.pop((mb, c))
        torch.autograd.backward(y, None if stage == self.stages - 1 else received)
        self.after_backward()
        return None if stage == 0 else x.grad
