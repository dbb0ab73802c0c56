"""Pipeline parallelism: this rank's model chunks, the 1F1B and interleaved-1F1B schedules, and
the executor that runs them with point-to-point sends between stages.

parallel.overlap.pp decides when a receive is posted (MegaScale §3.3). Sends always go out
asynchronously and are waited for at the end of the step; a transfer cannot complete before
its receive is posted (gloo and NCCL alike).
- off: a receive is posted when the compute that needs it is next, and blocks it: every
  transfer is exposed at the receiver.
- on: the receive for the next compute is posted before the current compute starts, so the
  transfer runs under it, in warm-up, steady phase and cool-down alike.
(Megatron's non-overlapped schedule couples each send with the next receive in one batched
exchange and waits for both; done with one receive per exchange, that hung interleaved 1F1B on
gloo here, so off keeps the sends asynchronous and differs from on only in when receives go out.)
Time blocked on a receive is the bubble (idle until the neighbouring stage delivers, and the
transfer itself when it is not hidden); time blocked on sends is exposed communication.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from overlap import CLOCK


def split_for_pipeline(model: torch.nn.Module, layout: Layout, vpp: int) -> list:
    """This rank's model chunks. Virtual stage s = v*pp + pp_rank holds layers [s*k, (s+1)*k):
    rank r gets stages r, r+pp, ... (Megatron's interleaving). Blocks keep their global index."""
    import copy
    stages = layout.pp * vpp
    per_stage = len(model.blocks) // stages
    chunks = []
    for v in range(vpp):
        stage = v * layout.pp + layout.pp_rank
        chunk = copy.deepcopy(model) if vpp > 1 or layout.pp > 1 else model
        for name in list(chunk.blocks):
            if not stage * per_stage <= int(name) < (stage + 1) * per_stage:
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


class Pipeline:
    """Runs this rank's chunks over a list of microbatches. Every message carries a tag naming
    (microbatch, stage, direction), so the two directions of a link (interleaving wraps the last
    rank back to the first) never mix."""

    def __init__(self, chunks: list, layout, overlap: bool = False):
        self.chunks, self.layout, self.overlap = chunks, layout, overlap
        self.stages = layout.pp * len(chunks)
        self.group = layout.group("pp")
        self.device = next(chunks[0].parameters()).device
        self.sends: list = []

    def _peer(self, stage: int) -> int:
        return dist.get_global_rank(self.group, stage % self.layout.pp)

    def _tag(self, mb: int, stage: int, backward: bool) -> int:
        return (mb * self.stages + stage) * 2 + int(backward)

    def _send_op(self, tensor, stage_to: int, mb: int, backward: bool) -> tuple:
        return dist.isend, tensor.contiguous(), self._peer(stage_to), self._tag(mb, stage_to, backward)

    def _post(self, action, shape) -> tuple:
        """Posts the receive `action` needs before it can compute: ([work], buffer), or ([], None)."""
        kind, mb, c = action
        stage = self.chunks[c].stage
        if kind == "F" and stage > 0:
            peer_stage, backward = stage - 1, False
        elif kind == "B" and stage < self.stages - 1:
            peer_stage, backward = stage + 1, True
        else:
            return [], None
        buf = torch.empty(shape, dtype=torch.float32, device=self.device)
        return self._start([(dist.irecv, buf, self._peer(peer_stage), self._tag(mb, stage, backward))]), buf

    def _start(self, ops: list) -> list:
        """Posts (isend|irecv, tensor, peer, tag) operations; their works, in order."""
        return [fn(tensor, peer, group=self.group, tag=tag) for fn, tensor, peer, tag in ops]

    def run(self, inputs: list, targets: list, loss_fn, autocast_dtype, backward: bool = True) -> float:
        """Forward (and backward) over all microbatches; returns the summed mean loss on the last
        stage, 0 elsewhere. Losses are divided by the microbatch count so gradients accumulate
        to the mean over the whole batch."""
        m = len(inputs)
        order = (pipeline_order(self.layout.pp, self.layout.pp_rank, len(self.chunks), m) if backward
                 else [("F", mb, c) for mb in range(m) for c in range(len(self.chunks))])
        b, t = inputs[0].shape[0], inputs[0].shape[1] // self.layout.tp
        shape = (b, t, self.chunks[0].cfg.d_model)
        saved, total = {}, 0.0
        incoming = self._post(order[0], shape)
        for i, action in enumerate(order):
            works, received = incoming if incoming is not None else self._post(action, shape)
            with CLOCK.waiting("bubble", self.device):
                for work in works:
                    work.wait()
            # on: the next receive goes out before this compute; off: when the next compute starts
            nxt = order[i + 1] if i + 1 < len(order) else None
            incoming = self._post(nxt, shape) if self.overlap and nxt is not None else None
            result = self._compute(action, received, inputs, targets, loss_fn, autocast_dtype, backward, saved)
            if isinstance(result, float):
                total += result
            elif result is not None:  # keep the tensor with its work: nothing else holds it until gloo reads it
                self.sends += [(work, result[1]) for work in self._start([result])]
        with CLOCK.waiting("comm", self.device):
            for work, _ in self.sends:
                work.wait()
        self.sends.clear()
        return total

    def _compute(self, action, received, inputs, targets, loss_fn, autocast_dtype, backward, saved):
        """Runs one action. Returns the operation that sends its result on, the loss (a float) on the
        last stage's forward, or None."""
        kind, mb, c = action
        chunk = self.chunks[c]
        stage = chunk.stage
        if kind == "F":
            x = inputs[mb] if stage == 0 else received.requires_grad_(backward)
            with torch.autocast(x.device.type, dtype=autocast_dtype, enabled=autocast_dtype != torch.float32), \
                    torch.set_grad_enabled(backward):
                y = chunk(x)
            if backward:
                saved[(mb, c)] = x, y
            if stage == self.stages - 1:
                loss = loss_fn(y, targets[mb]) / len(inputs)
                if backward:
                    saved[(mb, c)] = x, loss
                return loss.item()
            return self._send_op(y.detach().float(), stage + 1, mb, False)
        x, y = saved.pop((mb, c))
        torch.autograd.backward(y, None if stage == self.stages - 1 else received)
        return None if stage == 0 else self._send_op(x.grad, stage - 1, mb, True)
