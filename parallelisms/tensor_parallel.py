"""Tensor parallelism with sequence parallelism (Megatron-LM's split, Korthikanti et al. 2022),
or without it (parallel.sequence_parallel=false: Megatron-LM's TP before SP, Shoeybi et al. 2019,
the residual stream replicated over the TP group), applied from outside to model.py's plain GPT
as one plan.

TP_PLAN maps the module names of a GPT (or of one pipeline chunk of it) to their parallel style,
as torchtitan's parallelize plans map names to ColwiseParallel, RowwiseParallel and
SequenceParallel. apply_tp walks it: each rank keeps its slice of every split parameter, and
where a style runs a module differently, a TP module takes the plain one's place under the same
name, holding the same parameters, so parameter names (and checkpoints) do not depend on the
layout. What other files need to know about a TP slice comes from the same plan: tp_shard_dim
(the dim it splits) and tp_shard_infos (where this rank's slice lies and how many ranks hold
it, which parallel.py sets on each slice as its sharding.ShardInfo: the checkpoint's logical
coordinates, ZeRO's sums of replicated gradients, the norms that count each element once).

The layers are written here by hand rather than taken from torch.distributed.tensor.parallel:
the ablations control when each all-gather and reduce-scatter runs (parallel.overlap.tp: off,
chunked, domino), PTB shares one gather and one reduce-scatter between attention and the MLP,
and backward keeps gathered activations as shards (TPGroup.regather_saved). DTensor's styles put
one collective at each module's boundary and schedule it themselves.
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

import kernels
from parallelisms import overlap
from model import Block, kv_heads
from parallelisms.overlap import TPGroup
from parallelisms.sharding import ShardInfo
from parallelisms.zero import gradient_sink, weight_gradient


@dataclass(frozen=True)
class TPSettings:
    """What the TP modules of one rank run with."""
    group: Optional[TPGroup] = None  # the TP process group, as the sequence-parallel collectives use it
    rank: int = 0
    size: int = 1
    overlap: str = "off"       # parallel.overlap.tp: off | chunked | domino
    pieces: int = 1            # parallel.overlap.tp_chunks
    sequence_parallel: bool = True  # parallel.sequence_parallel; false: the residual stream replicated over TP


# --- Collectives as autograd functions (Megatron's "mappings"; the gather before the
# column-parallel GEMMs, with Megatron-LM's async backward, is overlap.GatheredLinears) ---

class Linear(torch.autograd.Function):
    """F.linear(x, weight, bias) whose backward computes the weight gradient itself, so that it
    accumulates into ZeRO's gradient buffer (zero.weight_gradient). The TP layers' GEMMs that
    do not go through overlap.GatheredLinears (the row-parallel projections; the column-parallel
    ones on TP overlap's pieces) run through it."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        x = x.to(overlap.compute_dtype(x))  # what F.linear would keep under autocast
        ctx.save_for_backward(x, weight)
        ctx.sink, ctx.bias_dtype = gradient_sink(weight), None if bias is None else bias.dtype
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])  # [tokens, out features]
        input_grad = (g @ weight.to(g.dtype)).view(*grad.shape[:-1], -1)
        w_grad = weight_gradient(ctx.sink, weight.dtype, g, x.reshape(-1, x.shape[-1]).to(g.dtype))
        return input_grad, w_grad, None if ctx.bias_dtype is None else g.sum(0).to(ctx.bias_dtype)


def linear(x, weight, bias=None):
    return Linear.apply(x, weight, bias)


class ReduceScatterSeq(torch.autograd.Function):
    """Partial sums over the full sequence -> summed, sequence-sharded; backward all-gathers."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return overlap.reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return overlap.gather_seq(grad, ctx.group), None


# Without sequence parallelism (Megatron-LM before it, Shoeybi et al. 2019) every TP rank holds
# the whole sequence: the column-parallel GEMMs read it as it is and the row-parallel ones'
# partial sums are all-reduced.

def _all_reduce(x, group: TPGroup):
    out = x.clone(memory_format=torch.contiguous_format)
    with group.clock.waiting("comm", x.device):
        dist.all_reduce(out, group=group.pg)
    return out


class CopyToTPRegion(torch.autograd.Function):
    """The whole input into column-parallel GEMMs: identity forward; backward all-reduces its
    gradient, each rank's being partial (Megatron's copy_to_tensor_model_parallel_region)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class ReduceFromTPRegion(torch.autograd.Function):
    """Partial sums -> all-reduced; identity backward (Megatron's reduce_from_tensor_model_parallel_region)."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy over logits split along the vocabulary, never gathering them: each rank
    sends a max, a sum of exponentials and its target logit per token (two all-reduces)."""

    @staticmethod
    def forward(ctx, logits, targets, group: TPGroup, vocab_start):
        ctx.logits_dtype = logits.dtype
        exp = logits.float()  # one fp32 copy, shifted and exponentiated in place (Megatron's does the same)
        v_local = exp.shape[-1]
        row_max = exp.max(dim=-1).values
        with group.clock.waiting("comm", exp.device):
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group.pg)
        exp.sub_(row_max.unsqueeze(-1))
        local_t = targets - vocab_start
        mine = (local_t >= 0) & (local_t < v_local)
        picked = exp.gather(-1, local_t.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1) * mine
        exp.exp_()
        sums = torch.stack([exp.sum(-1), picked])
        with group.clock.waiting("comm", logits.device):
            dist.all_reduce(sums, group=group.pg)
        losses = sums[0].log() - sums[1]
        ctx.save_for_backward(exp.div_(sums[0].unsqueeze(-1)), local_t.clamp(0, v_local - 1), mine)
        return losses.mean()

    @staticmethod
    def backward(ctx, grad):
        softmax, local_t, mine = ctx.saved_tensors
        g = softmax  # d loss_i / d logit = softmax - onehot(target), on the rank that holds the target
        g.scatter_add_(-1, local_t.unsqueeze(-1), -mine.unsqueeze(-1).to(g.dtype))
        return g.mul_(grad / local_t.numel()).to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(logits, targets, tp: TPSettings) -> torch.Tensor:
    """The loss over this rank's [.., V/tp] logits (the vocabulary slice VocabParallelHead gives)."""
    return VocabParallelCrossEntropy.apply(logits, targets, tp.group, tp.rank * logits.shape[-1])


# --- The TP modules that take the plain ones' places ---

class RowParallelLinear(torch.nn.Module):
    """A linear layer holding a slice of its input features (the weight's columns); returns
    partial sums. The bias stays whole and is added by the block after the reduce-scatter, so
    that it is counted once."""

    def __init__(self, weight: torch.nn.Parameter, bias: Optional[torch.nn.Parameter]):
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, x):
        return linear(x, self.weight)

    @classmethod
    def from_plain(cls, linear: torch.nn.Linear, tp: TPSettings) -> "RowParallelLinear":
        return cls(linear.weight, linear.bias)


class KVGroupQKV(torch.nn.Module):
    """QKV where tp exceeds the KV heads: this rank holds the rows of one whole KV group ([its
    query heads, k, v]), as do the other `replicas` ranks sharing the group, and computes its
    share of the query heads (the index-th of `replicas` equal runs) with the group's k and v.
    The gradient of a row it does not compute is zero here; ZeRO sums the group's gradient over
    its replicas (ShardInfo.tp_replicas), so each holds the whole gradient and takes the same step.
    Megatron-LM and torchtitan refuse this layout; vLLM replicates the KV heads for inference."""

    def __init__(self, linear: torch.nn.Linear, q_heads: int, head_dim: int, index: int, replicas: int):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        share = q_heads // replicas * head_dim
        self.q_rows, self.kv_rows = slice(index * share, (index + 1) * share), slice(q_heads * head_dim, None)

    def computed_rows(self) -> tuple:
        """(weight, bias) of the rows this rank computes, as one GEMM's. A new tensor each call,
        so the gradient goes to autograd's .grad (no gradient sink), where ZeRO adds it."""
        def rows(t):
            return None if t is None else torch.cat([t[self.q_rows], t[self.kv_rows]])
        return rows(self.weight), rows(self.bias)

    def forward(self, x):
        return F.linear(x, *self.computed_rows())


class VocabParallelHead(torch.nn.Module):
    """The output projection split along the vocabulary: sequence-sharded input, gathered (without
    SP: the whole sequence), and this rank's slice of the logits."""

    def __init__(self, weight: torch.nn.Parameter, tp: TPSettings):
        super().__init__()
        self.weight, self.group, self.sequence_parallel = weight, tp.group, tp.sequence_parallel

    def forward(self, x):
        if not self.sequence_parallel:
            return linear(CopyToTPRegion.apply(x, self.group), self.weight)
        return overlap.GatheredLinears.apply(x, self.group, False, self.weight, None)[0]

    @classmethod
    def from_plain(cls, linear: torch.nn.Linear, tp: TPSettings) -> "VocabParallelHead":
        return cls(linear.weight, tp)


class VocabParallelEmbedding(torch.nn.Module):
    """Each rank holds a slice of the vocabulary's rows; a token outside it contributes zeros and
    the reduce-scatter both sums the slices and shards the sequence (without SP: an all-reduce)."""

    def __init__(self, weight: torch.nn.Parameter, tp: TPSettings):
        super().__init__()
        self.weight, self.group, self.vocab_start = weight, tp.group, tp.rank * weight.shape[0]
        self.sequence_parallel = tp.sequence_parallel

    def forward(self, tokens):
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        h = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return (ReduceScatterSeq if self.sequence_parallel else ReduceFromTPRegion).apply(h, self.group)

    @classmethod
    def from_plain(cls, embedding: torch.nn.Embedding, tp: TPSettings) -> "VocabParallelEmbedding":
        return cls(embedding.weight, tp)


class SequenceParallelBlock(torch.nn.Module):
    """model.Block on a sequence-sharded residual stream. It takes over the plain block's
    norms, attention and MLP under their own names and runs them with the TP collectives in
    between, scheduled as parallel.overlap.tp says: one after another (off), MegaScale's sequence
    pieces (chunked), or Domino's row pieces that go through the block independently (domino).
    Gathered activations are kept as shards for backward (TPGroup.regather_saved), except under
    full recompute (`recompute`, as model.Block's), whose checkpoint keeps nothing of the block
    and whose saved-tensor hooks must be the innermost ones. Without sequence parallelism
    (TPSettings.sequence_parallel false) the residual stream is whole and replicated over the
    TP group instead (_replicated_block).
    """

    drop = Block.drop  # the residual dropout, as the plain block draws it

    def __init__(self, block: Block, tp: TPSettings):
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = block.ln_1, block.attn, block.ln_2, block.mlp
        self.parallel, self.fused, self.dropout, self.recompute = block.parallel, block.fused, block.dropout, block.recompute
        self.group, self.overlap, self.pieces = tp.group, tp.overlap, tp.pieces
        self.sequence_parallel = tp.sequence_parallel

    @classmethod
    def from_plain(cls, block: Block, tp: TPSettings) -> "SequenceParallelBlock":
        return cls(block, tp)

    def forward(self, x):
        if not self.sequence_parallel:
            return _replicated_block(self, x)
        with contextlib.nullcontext() if self.recompute else self.group.regather_saved():
            if self.overlap == "chunked":
                return _chunked_block(self, x)
            if self.overlap == "domino":
                rows = [_domino_block_steps(self, r) for r in x.chunk(self.pieces, dim=0)]
                return torch.cat(overlap.interleave(rows), dim=0)
            return _megatron_block(self, x)


def _megatron_block(block: SequenceParallelBlock, x):
    """overlap.tp=off, the ablation's baseline: Megatron-LM's sequence-parallel block. Forward's
    collectives block; backward hides what Megatron-LM's does (overlap.GatheredLinears)."""
    g, attn, mlp, keep_full = block.group, block.attn, block.mlp, block.recompute
    h = kernels.layer_norm(x, block.ln_1, fused=block.fused)
    if block.parallel:  # PTB: one gather for QKV and MLP-in, one reduce-scatter of their summed outputs
        qkv, f = overlap.GatheredLinears.apply(h, g, keep_full, *_qkv_weights(attn), mlp.fc_in.weight, None)
        y = ReduceScatterSeq.apply(attn.out(attn.mix(qkv)) + mlp.activate_and_project(f), g)
        return x + block.drop(_add_bias(_add_bias(y, attn.out.bias), mlp.fc_out.bias))
    qkv, = overlap.GatheredLinears.apply(h, g, keep_full, *_qkv_weights(attn))
    a = ReduceScatterSeq.apply(attn.out(attn.mix(qkv)), g)
    x, h = kernels.add_layer_norm(x, block.drop(_add_bias(a, attn.out.bias)), block.ln_2, fused=block.fused)
    f, = overlap.GatheredLinears.apply(h, g, keep_full, mlp.fc_in.weight, None)
    return x + block.drop(_add_bias(ReduceScatterSeq.apply(mlp.activate_and_project(f), g), mlp.fc_out.bias))


def _replicated_block(block: SequenceParallelBlock, x):
    """Megatron-LM's block before sequence parallelism: x is the whole sequence on every TP rank,
    the norms, dropout and residual adds run on all of it, each column-parallel GEMM reads it
    whole and each row-parallel GEMM's partial sums are all-reduced. PTB shares one all-reduce of
    the input gradient and one of the summed outputs."""
    g, attn, mlp = block.group, block.attn, block.mlp
    h = kernels.layer_norm(x, block.ln_1, fused=block.fused)
    if block.parallel:
        f = CopyToTPRegion.apply(h, g)
        y = ReduceFromTPRegion.apply(_attention(attn, f) + _mlp(mlp, f), g)
        return x + block.drop(_add_bias(_add_bias(y, attn.out.bias), mlp.fc_out.bias))
    a = ReduceFromTPRegion.apply(_attention(attn, CopyToTPRegion.apply(h, g)), g)
    x, h = kernels.add_layer_norm(x, block.drop(_add_bias(a, attn.out.bias)), block.ln_2, fused=block.fused)
    m = ReduceFromTPRegion.apply(_mlp(mlp, CopyToTPRegion.apply(h, g)), g)
    return x + block.drop(_add_bias(m, mlp.fc_out.bias))


def _domino_block_steps(block: SequenceParallelBlock, x):
    """Domino's row piece through the block, as a generator that yields at each TP collective
    (overlap.interleave runs it); each reduce-scatter names its gather, to prefetch the re-gather.
    PTB shares one all-gather (its attention and MLP read the same LN output) and one
    reduce-scatter (their outputs are summed before it): half the TP collectives of the
    sequential block (MegaScale §3.1)."""
    g = block.group
    attn_bias, mlp_bias = block.attn.out.bias, block.mlp.fc_out.bias
    gather = overlap.gather_async(kernels.layer_norm(x, block.ln_1, fused=block.fused), g)
    full = yield gather
    if block.parallel:
        y = yield overlap.reduce_scatter_async(_attention(block.attn, full) + _mlp(block.mlp, full), g, after=(gather,))
        return x + block.drop(_add_bias(_add_bias(y, attn_bias), mlp_bias))
    a = yield overlap.reduce_scatter_async(_attention(block.attn, full), g, after=(gather,))
    x, h = kernels.add_layer_norm(x, block.drop(_add_bias(a, attn_bias)), block.ln_2, fused=block.fused)
    gather = overlap.gather_async(h, g)
    full = yield gather
    m = yield overlap.reduce_scatter_async(_mlp(block.mlp, full), g, after=(gather,))
    return x + block.drop(_add_bias(m, mlp_bias))


def _chunked_block(block: SequenceParallelBlock, x):
    """MegaScale's TP overlap: the token-wise GEMMs (QKV, MLP, output projections) run on pieces of
    the sequence while the other pieces' all-gathers and reduce-scatters are on the wire."""
    g, k, attn, mlp = block.group, block.pieces, block.attn, block.mlp
    h = kernels.layer_norm(x, block.ln_1, fused=block.fused)
    if block.parallel:  # PTB: one region; the MLP's partial sums join attention's before the shared reduce-scatter
        y = overlap.chunked_region(h, g, k, pre=lambda f: (_qkv(attn, f), _mlp(mlp, f)), mix=attn.mix,
                                   post=lambda a, m: attn.out(a) + m)
        return x + block.drop(_add_bias(_add_bias(y, attn.out.bias), mlp.fc_out.bias))
    a = overlap.chunked_region(h, g, k, pre=lambda f: (_qkv(attn, f),), mix=attn.mix, post=attn.out)
    x, h = kernels.add_layer_norm(x, block.drop(_add_bias(a, attn.out.bias)), block.ln_2, fused=block.fused)
    return x + block.drop(_add_bias(overlap.chunked_region(h, g, k, pre=lambda f: _mlp(mlp, f)), mlp.fc_out.bias))


def _qkv(attn, x):
    return linear(x, *_qkv_weights(attn))


def _qkv_weights(attn) -> tuple:
    """(weight, bias) of the QKV rows this rank computes: all it holds, or, where it holds a KV
    group that other ranks hold too, its share of the group's query rows with the k and v rows."""
    qkv = attn.qkv
    return qkv.computed_rows() if isinstance(qkv, KVGroupQKV) else (qkv.weight, qkv.bias)


def _attention(attn, x):
    """model.Attention's forward, its QKV GEMM through Linear (the output projection is a
    RowParallelLinear)."""
    return attn.out(attn.mix(_qkv(attn, x)))


def _mlp(mlp, x):
    """model.MLP's forward, its input GEMM through Linear (fc_out is a RowParallelLinear)."""
    return mlp.activate_and_project(linear(x, mlp.fc_in.weight))


def _add_bias(x, bias):
    return x if bias is None else x + bias


# --- The plan ---

@dataclass(frozen=True)
class Style:
    """How TP treats one module: the dim along which each split parameter is sliced, the
    parameters every rank holds whole but gets a partial gradient for (it sees only its slice of
    the sequence: summed over the TP group; without SP it sees all of it, its gradient whole), the TP module that takes the plain one's place
    (None: the plain module runs on its slices), and whether the split runs along whole KV groups
    (QKV: with fewer KV heads than TP ranks, tp/n_kv_heads ranks hold each group, KVGroupQKV)."""
    split: tuple = ()          # (parameter name, dim), ...
    replicated: tuple = ()     # parameter names
    module: Optional[Callable] = None  # (plain module, TPSettings) -> its replacement
    kv_groups: bool = False


# Column-parallel: output features split; the block gathers the sequence-sharded input before it.
# model.py groups the fused weights' rows so that a contiguous slice is whole units: QKV's rows
# per KV head (a slice is whole KV groups, each its query heads with the k and v they share;
# with fewer KV heads than ranks, one group held by tp/n_kv_heads ranks: parallel.validate asks
# that tp divide n_kv_heads or n_kv_heads divide tp), SwiGLU's fc_in rows interleaved per unit
# (a slice holds matching gate and up rows: one GEMM, as GeLU's fc_in).
COLWISE = Style(split=(("weight", 0), ("bias", 0)))
COLWISE_QKV = Style(split=COLWISE.split, kv_groups=True)
# Row-parallel: input features split, partial sums out; the bias is added once, after the
# reduce-scatter.
ROWWISE = Style(split=(("weight", 1),), replicated=("bias",), module=RowParallelLinear.from_plain)
# A LayerNorm or RMSNorm on this rank's slice of the sequence.
SEQUENCE_PARALLEL = Style(replicated=("weight", "bias"))
VOCAB_PARALLEL_EMBEDDING = Style(split=(("weight", 0),), module=VocabParallelEmbedding.from_plain)
VOCAB_PARALLEL_HEAD = Style(split=(("weight", 0),), module=VocabParallelHead.from_plain)
SEQUENCE_PARALLEL_BLOCK = Style(module=SequenceParallelBlock.from_plain)

# Module name patterns ("*": one name component) -> style. Every module that holds a parameter
# must match one (apply_tp refuses a model with others).
TP_PLAN = {
    "embed": VOCAB_PARALLEL_EMBEDDING,
    "blocks.*": SEQUENCE_PARALLEL_BLOCK,
    "blocks.*.ln_1": SEQUENCE_PARALLEL,
    "blocks.*.ln_2": SEQUENCE_PARALLEL,
    "blocks.*.attn.qkv": COLWISE_QKV,
    "blocks.*.attn.out": ROWWISE,
    "blocks.*.mlp.fc_in": COLWISE,
    "blocks.*.mlp.fc_out": ROWWISE,
    "norm": SEQUENCE_PARALLEL,
    "head": VOCAB_PARALLEL_HEAD,
}

_PATTERNS = [(re.compile(re.escape(p).replace(r"\*", r"[^.]+")), style) for p, style in TP_PLAN.items()]


def style_of(module_name: str) -> Optional[Style]:
    """The plan's style for a module (its name inside the GPT; None: not in the plan)."""
    return next((style for pattern, style in _PATTERNS if pattern.fullmatch(module_name)), None)


def tp_shard_dim(name: str) -> Optional[int]:
    """The dim along which the plan splits parameter `name` over the TP group (None: whole)."""
    module, _, param = name.rpartition(".")
    style = style_of(module)
    return None if style is None else dict(style.split).get(param)


def tp_replicas(model: torch.nn.Module, style: Style, tp_size: int) -> int:
    """How many consecutive TP ranks hold the same slice of the style's split parameters: 1,
    except QKV with fewer KV heads than TP ranks (tp/n_kv_heads ranks a KV group)."""
    groups = kv_heads(model.cfg)
    return tp_size // groups if style.kv_groups and tp_size > groups else 1


def tp_shard_infos(model: torch.nn.Module, tp: TPSettings) -> dict:
    """Parameter name -> ShardInfo of this rank's tensor, by the plan, for a model apply_tp has
    sliced (tp.size > 1)."""
    infos = {}
    for name, p in model.named_parameters():
        module, _, param = name.rpartition(".")
        style = style_of(module)
        dim, replicas = dict(style.split).get(param), tp_replicas(model, style, tp.size)
        replicated = param in style.replicated  # without SP every rank sees the whole sequence: whole gradients
        infos[name] = ShardInfo(split_dim=dim, offset=0 if dim is None else tp.rank // replicas * p.shape[dim],
                                tp_replicas=tp.size if replicated else replicas,
                                tp_partial_grad=tp.sequence_parallel or not replicated)
    return infos


def apply_tp(model: torch.nn.Module, tp: TPSettings) -> None:
    """Walks TP_PLAN over `model`: keeps this rank's slice of each split parameter (on the meta
    device: its shape only) and puts each style's TP module in its plain module's place, the
    deepest modules first. Runs before anything hooks the modules it replaces (ZeRO's DP overlap)."""
    unplanned = sorted({n.rpartition(".")[0] for n, _ in model.named_parameters()
                        if style_of(n.rpartition(".")[0]) is None})
    if unplanned:
        raise ValueError(f"modules with parameters but no TP style: {unplanned}; add them to TP_PLAN")
    planned = [(name, module, style_of(name)) for name, module in model.named_modules()]
    for name, module, style in sorted((m for m in planned if m[2] is not None), key=lambda m: -m[0].count(".")):
        replicas = tp_replicas(model, style, tp.size)
        for param, dim in style.split:
            _keep_slice(module, param, dim, tp.rank // replicas, tp.size // replicas)
        if replicas > 1:  # QKV's KV group on several ranks, each computing its share of the query heads
            attn = model.get_submodule(name.rpartition(".")[0])
            attn.qkv = KVGroupQKV(module, attn.group, attn.head_dim, tp.rank % replicas, replicas)
            attn.group //= replicas  # the query heads per KV head in this rank's projections (Attention.mix)
        if style.module is not None:
            if module._forward_pre_hooks or module._forward_hooks:  # they would go with the plain module
                raise ValueError(f"{name} has forward hooks: apply_tp before anything hooks the model")
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, style.module(module, tp))


def _keep_slice(module, name: str, dim: int, rank: int, parts: int) -> None:
    param = getattr(module, name)
    if param is not None:
        setattr(module, name, torch.nn.Parameter(param.detach().chunk(parts, dim)[rank].clone()))
