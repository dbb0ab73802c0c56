"""A GPT decoder as MegaScale trains it: pre-LN LayerNorm, GeLU MLP of width 4h, rotary
positions, causal attention. Or Llama's block (model.norm=rmsnorm, model.mlp=swiglu,
model.n_kv_heads): RMSNorm, a SwiGLU MLP and grouped-query attention (GQA), as transformers'
LlamaForCausalLM computes it (tests/test_model.py).

Two switches belong to the ablation:
- block=sequential|parallel. The parallel transformer block (PTB, as in GPT-J and PaLM) computes
  y = x + Attn(LN(x)) + MLP(LN(x)) with one shared LN, so attention and MLP read the same input.
- attention.window=null|W: sliding-window attention (SWA). Each token sees itself and the W-1
  tokens before it, in every attention backend of kernels.py.

This file holds no collectives and no process groups. parallel.py shards this model from outside
(torchtitan-style; parallelisms/tensor_parallel.py's plan names its modules), which is why the fused weights'
rows are grouped so that a contiguous slice of them is a whole set of units, and why blocks live
in a ModuleDict (a pipeline stage deletes the blocks it doesn't own and every parameter keeps its
name, so checkpoints stay layout-free):
- attn.qkv: rows grouped per KV head as (kv head, [its n_heads/n_kv_heads query heads, then k,
  then v], head_dim). Without GQA that is (head, q|k|v, head_dim), GPT-NeoX's and Megatron's
  layout; a TP shard of the rows is a whole set of KV groups (with more TP ranks than KV heads,
  each rank holds its group's whole block and computes its share of the query heads).
- mlp.fc_in with SwiGLU: gate and up in one GEMM, rows interleaved per unit as (unit, gate|up),
  [g0, u0, g1, u1, ...]; a TP shard of the rows holds matching gate/up pairs. The MLP computes
  fc_out(silu(gate) * up).
The norms keep their names (ln_1, ln_2, norm) whichever kind they are.
"""
from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

import kernels
from kernels import KernelsConfig


@dataclass
class AttentionConfig:
    # SWA window W: query i sees keys j with i - W < j <= i (W counts the token itself).
    # None means full causal attention.
    window: Optional[int] = None


@dataclass
class ModelConfig:
    name: str = "tiny"
    n_layers: int = 4
    n_heads: int = 4
    d_model: int = 256
    vocab_size: int = 4096
    max_seq_len: int = 1024       # longest sequence the config promises to support
    block: str = "sequential"     # sequential | parallel (PTB)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    mlp_ratio: int = 4
    # The MLP's inner width; None: mlp_ratio * d_model. With swiglu it is the width of each of the
    # gate and up projections (Llama's intermediate_size).
    ffn_hidden_size: Optional[int] = None
    norm: str = "layernorm"       # layernorm (GPT) | rmsnorm (Llama)
    mlp: str = "gelu"             # gelu (GPT) | swiglu (Llama: fc_out(silu(gate) * up))
    # Grouped-query attention: heads of k and v, each shared by n_heads/n_kv_heads query heads.
    # None: n_heads (multi-head attention); 1: multi-query attention.
    n_kv_heads: Optional[int] = None
    rope_theta: float = 10000.0
    bias: bool = True             # Megatron's GPT and GPT-NeoX have biases; PaLM and Llama have none
    norm_eps: float = 1e-5
    init_std: float = 0.02
    # Dropout on the attention probabilities and on each residual branch (attention, MLP; PTB's
    # sum), training only. 0 as in nanoGPT's and most LLM pretraining; Megatron-LM defaults to 0.1
    # for both (--attention-dropout, --hidden-dropout), which the 175B/530B configs follow.
    dropout: float = 0.0


def ffn_width(cfg: ModelConfig) -> int:
    """The MLP's inner width (with swiglu: of each of gate and up)."""
    return cfg.ffn_hidden_size if cfg.ffn_hidden_size is not None else cfg.mlp_ratio * cfg.d_model


def kv_heads(cfg: ModelConfig) -> int:
    """The heads of k and v (grouped-query attention); n_heads without it."""
    return cfg.n_kv_heads if cfg.n_kv_heads is not None else cfg.n_heads


def head_dim(cfg: ModelConfig) -> int:
    return cfg.d_model // cfg.n_heads


def identity(cfg: ModelConfig) -> dict:
    """What makes a checkpoint another model's: its parameters' shapes, or what they mean (the
    widths resolved, so a checkpoint saved before ffn_hidden_size and n_kv_heads existed matches)."""
    return {"n_layers": cfg.n_layers, "d_model": cfg.d_model, "n_heads": cfg.n_heads, "vocab_size": cfg.vocab_size,
            "ffn_width": ffn_width(cfg), "kv_heads": kv_heads(cfg), "norm": cfg.norm, "mlp": cfg.mlp, "bias": cfg.bias}


def rope_tables(seq_len: int, head_dim: int, theta: float, device, max_seq_len: Optional[int] = None,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [T, head_dim], GPT-NeoX layout (rotate the two halves), rounded to fp32 and
    then to `dtype` (the compute dtype: q and k's), once per dtype and device, not in every layer.

    Built in numpy's fp64 and rounded once: torch's CPU cos/sin (fp32 and fp64 alike) can return a
    different table on their first call in a process under load, and a run computes the table
    once, so two runs of one config would not write identical checkpoints; numpy's are
    single-threaded and always the same. Cached: every layer of every step asks for the same
    table. Inside torch.compile the table of max_seq_len positions is a constant of the graph,
    sliced to T: traced, the numpy calls would become torch's pow, cos and sin fused into the
    rotation's kernels and evaluated per element of q and k in every layer; and a constant of T
    itself would break the graph once T turns symbolic (a second sequence length)."""
    if torch.compiler.is_compiling():
        longest = seq_len if isinstance(seq_len, int) and seq_len > (max_seq_len or 0) else max_seq_len
        cos, sin = _constant_rope_tables(longest, head_dim, theta, device, dtype)
        return cos[:seq_len], sin[:seq_len]
    with torch.inference_mode(False):  # so that a table first made in an eval pass can be saved for backward
        return _cached_rope_tables(seq_len, head_dim, theta, device, dtype)


def _rope_tables(seq_len: int, head_dim: int, theta: float, device,
                 dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.outer(np.arange(seq_len, dtype=np.float64), inv_freq)
    angles = np.concatenate([angles, angles], axis=-1)
    return tuple(torch.from_numpy(f(angles)).float().to(dtype).to(device) for f in (np.cos, np.sin))


_cached_rope_tables = functools.lru_cache(maxsize=16)(_rope_tables)


@torch.compiler.assume_constant_result  # on a plain function: dynamo traces through lru_cache's wrapper
def _constant_rope_tables(seq_len: int, head_dim: int, theta: float, device,
                          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return _cached_rope_tables(seq_len, head_dim, theta, device, dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: KernelsConfig):
        super().__init__()
        self.head_dim = head_dim(cfg)
        self.group = cfg.n_heads // kv_heads(cfg)  # query heads per KV head
        self.window = cfg.attention.window
        self.rope_theta, self.max_seq_len = cfg.rope_theta, cfg.max_seq_len
        self.impl, self.block_size = ops.attention, ops.attention_block
        self.dropout = cfg.dropout
        # Rows grouped per KV head as (kv head, [group q heads, k, v], head_dim) (the docstring above):
        # a tensor-parallel shard of the rows is a whole set of KV groups (or one group's block).
        self.qkv = nn.Linear(cfg.d_model, (cfg.n_heads + 2 * kv_heads(cfg)) * self.head_dim, bias=cfg.bias)
        self.out = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.recompute_core = False  # train.recompute=selective (parallel.apply_recompute)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.mix(self.qkv(x)))

    def mix(self, qkv: torch.Tensor) -> torch.Tensor:
        """[B, T, (H + 2·H_kv)·D] projections -> [B, T, d] attention output before the output
        projection: the only part that needs the whole sequence (TP overlap chunks the token-wise rest)."""
        B, T, _ = qkv.shape
        cos, sin = rope_tables(T, self.head_dim, self.rope_theta, qkv.device, self.max_seq_len, qkv.dtype)
        # The head count comes from qkv, not the config: under TP this rank holds a slice.
        q, k, v = kernels.heads_with_rope(qkv, self.head_dim, cos, sin, self.group)  # kernels.apply_rope on q and k
        if self.recompute_core:  # stored: q, k, v; the core's activations are recomputed in backward
            o = torch.utils.checkpoint.checkpoint(self.core, q, k, v, use_reentrant=False)
        else:
            o = self.core(q, k, v)
        return o.transpose(1, 2).reshape(B, T, -1)

    def core(self, q, k, v):
        """softmax(QK^T)V: the part selective recomputation re-runs instead of storing (its
        activations grow with s^2 for full attention and are cheap to recompute)."""
        return kernels.attention(q, k, v, window=self.window, impl=self.impl, block=self.block_size,
                                 dropout=self.dropout if self.training else 0.0)


class MLP(nn.Module):
    """GeLU: fc_out(gelu(fc_in(x))). SwiGLU: fc_in computes gate and up in one GEMM, its rows
    interleaved per unit (the docstring above), and fc_out(silu(gate) * up)."""

    def __init__(self, cfg: ModelConfig, ops: KernelsConfig):
        super().__init__()
        self.fused = ops.fused
        self.swiglu = cfg.mlp == "swiglu"
        width = ffn_width(cfg)
        self.fc_in = nn.Linear(cfg.d_model, 2 * width if self.swiglu else width, bias=cfg.bias)
        self.fc_out = nn.Linear(width, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The bias is left out of the GEMM so the fused kernel can add it inside the activation.
        return self.activate_and_project(F.linear(x, self.fc_in.weight))

    def activate_and_project(self, h: torch.Tensor) -> torch.Tensor:
        """fc_in's GEMM output, without its bias -> the MLP's output (TP runs fc_in's GEMM itself)."""
        activate = kernels.swiglu if self.swiglu else kernels.bias_gelu
        return self.fc_out(activate(h, self.fc_in.bias, fused=self.fused))


def build_norm(cfg: ModelConfig) -> nn.Module:
    """GPT's LayerNorm (with a bias where model.bias) or Llama's RMSNorm (which has none)."""
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: KernelsConfig):
        super().__init__()
        self.parallel = cfg.block == "parallel"
        self.fused = ops.fused
        self.ln_1 = build_norm(cfg)
        self.attn = Attention(cfg, ops)
        # PTB shares one norm between attention and MLP; the sequential block has two.
        self.ln_2 = None if self.parallel else build_norm(cfg)
        self.mlp = MLP(cfg, ops)
        self.dropout = cfg.dropout
        self.recompute = False  # train.recompute=full (parallel.apply_recompute): see GPT.forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel:
            h = kernels.layer_norm(x, self.ln_1, fused=self.fused)
            return x + self.drop(self.attn(h) + self.mlp(h))
        x, h = kernels.add_layer_norm(x, self.drop(self.attn(kernels.layer_norm(x, self.ln_1, fused=self.fused))),
                                      self.ln_2, fused=self.fused)
        return x + self.drop(self.mlp(h))

    def drop(self, branch: torch.Tensor) -> torch.Tensor:
        """Dropout on a residual branch before it joins the stream (Megatron's bias-dropout-add).
        PTB drops the sum of its two branches: under TP they are summed before the one
        reduce-scatter they share, and the mask is drawn after it (parallelisms/tensor_parallel.py)."""
        if not (self.dropout and self.training):
            return branch
        return torch.native_dropout(branch, self.dropout, True)[0]  # a bool mask kept, as CUDA's F.dropout


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Optional[KernelsConfig] = None):
        """ops: which operator implementations to run (kernels.py); the eager defaults if None.
        They change speed, never the maths: every implementation equals the reference."""
        super().__init__()
        ops = ops or KernelsConfig()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleDict({str(i): Block(cfg, ops) for i in range(cfg.n_layers)})
        self.norm = build_norm(cfg)
        # Untied output projection, as in GPT-NeoX and Megatron with untied embeddings.
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.fused = ops.fused

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] -> logits [B, T, V]. A pipeline stage may lack embed or head (set to None):
        it then takes or returns hidden states instead."""
        h = self.embed(tokens) if self.embed is not None else tokens
        for block in self.blocks.values():
            # Full recomputation stores only the block's input and runs it again in backward.
            h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False) if block.recompute else block(h)
        if self.head is None:
            return h
        return self.head(kernels.layer_norm(h, self.norm, fused=self.fused))

    @torch.no_grad()
    def init_weights(self, seed: Optional[int] = None, slices: Optional[dict] = None) -> None:
        """GPT-2/Megatron init: N(0, 0.02), with the residual projections scaled by 1/sqrt(2L) so the
        residual stream's variance does not grow with depth; biases 0, norm weights 1.

        Layout-free and local: a weight is drawn slice by slice along one axis, slice i from its
        own generator seeded by (seed, parameter name, i), so a module holding only part of a
        parameter (a pipeline stage, or a tensor-parallel slice: `slices` maps its name to
        (dim, index of its first slice along dim)) draws exactly its part, with one slice in
        memory on top, and gets the values one process would hold. The axis is the one tensor
        parallelism splits: rows, except the output projections (attn.out, mlp.fc_out), which are
        drawn column by column. Runs after to_empty() for a meta-built model, on any device (drawn
        on the CPU, so every device gets the same numbers)."""
        seed = 0 if seed is None else seed
        std, L = self.cfg.init_std, self.cfg.n_layers
        for name, p in self.named_parameters():
            if name.endswith("bias") or ".ln_" in name or name.startswith("norm."):
                p.fill_(1.0 if name.endswith("weight") else 0.0)
                continue
            projection = name.endswith(("attn.out.weight", "mlp.fc_out.weight"))
            axis = 1 if projection else 0
            dim, offset = (slices or {}).get(name, (axis, 0))
            if dim != axis:
                raise ValueError(f"{name} is a slice along dim {dim}, but is drawn along dim {axis}")
            _draw_normal(p, name, seed, std / math.sqrt(2 * L) if projection else std, axis, offset)


def _draw_normal(p: torch.Tensor, name: str, seed: int, std: float, axis: int, offset: int) -> None:
    """Fill p with N(0, std²), slice i along `axis` from a generator seeded by (seed, name, i +
    offset), where offset is the index of p's first slice in the whole parameter."""
    base = int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:7], "little")
    view = p.movedim(axis, 0)
    gen = torch.Generator(device="cpu")
    rows = max(1, (1 << 22) // max(1, view[0].numel()))  # staged ~16 MB at a time on the way to the device
    for first in range(0, view.shape[0], rows):
        block = torch.empty((min(rows, view.shape[0] - first), *view.shape[1:]), dtype=torch.float32)
        for j in range(block.shape[0]):
            gen.manual_seed(base + offset + first + j)
            block[j].normal_(0.0, std, generator=gen)
        view[first:first + block.shape[0]].copy_(block)


# --- Accounting: parameters and FLOPs, from the config alone (works for 175B on no hardware) ---

def matmul_params(cfg: ModelConfig) -> int:
    """N in MegaScale's 6N + 12·L·h·T: the weights that take part in GEMMs, i.e. every block's
    attention and MLP matrices (12·L·h² for GPT at mlp_ratio 4) plus the output projection V·h.
    Attention: q and the output projection h x h each, k and v h x (n_kv_heads·head_dim) each (GQA
    makes them smaller); MLP: two h x ffn matrices with GeLU, three with SwiGLU (gate, up, down).
    The input embedding is a lookup, not a GEMM, and biases and norms are negligible, so none is
    counted. With this N the 175B config gives 1.077e12 FLOPs/token, as the Megatron rows of
    Table 2 imply."""
    h, kv = cfg.d_model, kv_heads(cfg) * head_dim(cfg)
    attention = 2 * h * h + 2 * h * kv
    mlp = (3 if cfg.mlp == "swiglu" else 2) * h * ffn_width(cfg)
    return cfg.n_layers * (attention + mlp) + cfg.vocab_size * h


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward) by the PaLM/MegaScale formula 6N + 12·L·h·T.
    The attention term counts dense attention over T even with SWA, as the paper's MFU does, so
    SWA's saving shows up as a higher MFU; GQA leaves it unchanged (every query head still scores
    T keys and mixes T values)."""
    return 6 * matmul_params(cfg) + 12 * cfg.n_layers * cfg.d_model * seq_len


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
