"""Operators the model calls, each with an eager reference and (where it pays) a faster path.

Switches: kernels.attention=auto|flash|banded|sdpa|unfused|reference and
kernels.fused=false|true|triton.
The eager reference always stays, so tests can compare every fast path with it.

Attention takes q [B, H, T, D] and k, v [B, H_kv, T, D], returns [B, H, T, D], and is always
causal. With grouped-query attention (GQA) H_kv divides H and query head h reads KV head
h // (H / H_kv), the layout model.Attention's projection has; every backend takes it (SDPA's
enable_gqa, flash-attn's own, the unfused ones repeat k and v as Megatron-LM does). With a sliding window W, query i
attends key j iff i - W < j <= i: W keys, the query's own position included, so W=1 is "attend to
yourself only" and any W >= T is plain causal attention. window=None means full causal. Every
backend obeys exactly this rule (flash-attn spells it window_size=(W-1, 0)):
- flash:     flash-attn's kernel (CUDA, bf16/fp16, the optional `gpu` extra). Skips masked tiles.
- banded:    blockwise PyTorch (below); does O(T·(W+block)) work instead of O(T²). CPU and GPU.
- sdpa:      one SDPA call with a [T, T] mask; correct but computes every masked score.
- unfused:   Megatron-LM's core attention before FlashAttention: the [T, T] scores and
             probabilities materialized in the compute dtype, softmax in fp32. MegaScale's
             baseline (Table 3 steps 0-1, Table 2's Megatron-LM column); FlashAttention-2 is
             its "efficient operators" step.
- reference: naive softmax(QKᵀ)V in fp32, the oracle.
- auto:      flash where it can run, else banded where the window skips enough, else sdpa.

kernels.fused=true fuses inside a compiled step (train.compile=true; auto compiles on CUDA):
there inductor turns each elementwise chain (residual add + LayerNorm or RMSNorm, bias + GeLU or
SwiGLU, the heads with RoPE) into one read-and-write pass forward and one backward, with its neighbours, and the loss
takes the form whose fp32 upcast stays in registers (_cross_entropy). From eager code it runs the
eager ops, so that it costs nothing there: a kernel inductor builds can only be called through
Python wrappers. A torch.compile'd function per op pays dynamo's frame evaluation and
AOTAutograd's autograd.Function and runtime wrappers on every call, 173 Python function calls for
an add + LayerNorm forward and backward against eager's 16 (with each op so compiled, a step at
bench_step's launch shape calls 1,976 against 649); a graph compiled ahead
(torch._inductor.standalone_compile) still runs behind AOTAutograd's runtime wrapper (26 calls
forward, 40 backward), and a torch.library.custom_op around it adds ~43 more a call forward and
backward, an autograd.Function ~9. So eager code calls no inductor kernel, and the Triton kernels
below stay behind autograd.Functions rather than custom ops.

kernels.fused=triton runs hand-written Triton kernels from eager code (CUDA, the optional
`triton` extra, kernels_triton.py): residual add + LayerNorm or RMSNorm, bias + GeLU and SwiGLU
forward and backward,
and the cross-entropy, each one pass over its rows, each behind one autograd.Function. Inside a
compiled step inductor fuses the same ops itself. Triton is imported on first use; on CPU it runs
only in its interpreter (TRITON_INTERPRET=1), which is how the tests check it against the eager
reference. Elsewhere, like kernels.attention=flash, the switch is a one-line error naming what to use.
"""
from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

import kernels_triton


@dataclass
class KernelsConfig:
    attention: str = "auto"   # auto | flash | banded | sdpa | reference
    # LayerNorm or RMSNorm (+residual), bias+GeLU or SwiGLU, and cross-entropy: false (eager) |
    # true (fused by inductor inside a compiled step, train.compile; eager ops from eager code) |
    # triton (Triton kernels, CUDA). Any, not bool: OmegaConf has no bool-or-str type, so config.validate checks the value
    # against FUSED_IMPLS.
    fused: Any = False
    # Query rows per block of the banded backend: it computes T·(W + block) scores, so smaller is
    # less waste, until per-block overheads win. 128 is the fastest on a CPU (experiments/bench_kernels.py).
    attention_block: int = 128


ATTENTION_IMPLS = ("auto", "flash", "banded", "sdpa", "unfused", "reference")
FUSED_IMPLS = (False, True, "triton")
DEFAULT_BLOCK = KernelsConfig.attention_block


# --- Attention ---

def window_mask(T: int, window: Optional[int], device) -> torch.Tensor:
    """Boolean [T, T] mask, True where query i may attend key j: j <= i and i - j < window."""
    return band_mask(T, T, 0, window, device)


def band_mask(n_q: int, n_k: int, q_offset: int, window: Optional[int], device) -> torch.Tensor:
    """Boolean [n_q, n_k] mask for queries at positions q_offset + a and keys at positions b:
    True where i - window < j <= i (no lower bound when window is None)."""
    i = torch.arange(q_offset, q_offset + n_q, device=device)[:, None]
    j = torch.arange(n_k, device=device)[None, :]
    allowed = j <= i
    if window is not None:
        allowed = allowed & (i - j < window)
    return allowed


def attention_reference(q, k, v, window: Optional[int] = None, dropout: float = 0.0) -> torch.Tensor:
    """Naive softmax attention, [B, H, T, D] in and out. The oracle for every other backend, so it
    shares no code with them (attention_unfused included; test_model checks it per token)."""
    k, v = _repeat_kv(q, k), _repeat_kv(q, v)
    scores = (q.float() @ k.float().transpose(-1, -2)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~window_mask(q.shape[-2], window, q.device), float("-inf"))
    return (F.dropout(scores.softmax(-1), dropout) @ v.float()).to(q.dtype)


def attention_unfused(q, k, v, window: Optional[int] = None, dropout: float = 0.0) -> torch.Tensor:
    """softmax(QKᵀ/√d)V with every score of the [T, T] square materialized, as Megatron-LM's core
    attention (a batched GEMM, its fused scale-mask-softmax kernel, a batched GEMM): the GEMMs run
    in q's dtype, the softmax in fp32, the probabilities go back to q's dtype for the second GEMM.
    Dropout on the probabilities is one more pass over the square each way, plus its mask. What
    backward keeps per score is Megatron's too: the probabilities in q's dtype, a byte of mask and
    the dropped probabilities (5 bytes in bf16; autograd's fp32 softmax and dtype-sized mask kept 8).
    GQA: k and v repeated to q's heads first, as Megatron-LM's core attention does."""
    k, v = _repeat_kv(q, k), _repeat_kv(q, v)
    scores = q @ k.transpose(-1, -2)
    probs = _ScaledMaskedSoftmax.apply(scores, window_mask(q.shape[-2], window, q.device), q.shape[-1] ** -0.5)
    if dropout:
        probs = torch.native_dropout(probs, dropout, True)[0]  # keeps a bool mask, as CUDA's F.dropout does
    return probs @ v


def _repeat_kv(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """GQA's k or v [B, H_kv, T, D] with each head repeated for its H/H_kv query heads: [B, H, T, D]."""
    group = q.shape[1] // kv.shape[1]
    return kv if group == 1 else kv.repeat_interleave(group, dim=1)


def _gqa(q: torch.Tensor, k: torch.Tensor) -> bool:
    return q.shape[1] != k.shape[1]


class _ScaledMaskedSoftmax(torch.autograd.Function):
    """softmax(scale·x, masked) computed in fp32, returned in x's dtype; backward from that output
    alone (Megatron's fused scale-mask-softmax: y·(g - Σ g·y), times the scale)."""

    @staticmethod
    def forward(ctx, scores, allowed, scale):
        probs = (scores.float() * scale).masked_fill(~allowed, float("-inf")).softmax(-1).to(scores.dtype)
        ctx.save_for_backward(probs)
        ctx.scale = scale
        return probs

    @staticmethod
    def backward(ctx, grad):
        # In the probabilities' dtype, in place, the row sums accumulated in fp32: the backward's
        # transients are one square of the dtype at a time (in fp32 they would be four, the
        # largest thing alive at the backward's peak), as in Megatron's kernel, which keeps none.
        (probs,) = ctx.saved_tensors
        rows = (grad * probs).sum(-1, keepdim=True, dtype=torch.float32).to(grad.dtype)
        return torch.sub(grad, rows).mul_(probs).mul_(ctx.scale), None, None


def attention_sdpa(q, k, v, window: Optional[int] = None, dropout: float = 0.0) -> torch.Tensor:
    """One SDPA call. Full causal uses is_causal, which lets the kernel skip the upper triangle;
    a window needs an explicit mask, and then every score of the [T, T] square is computed. GQA:
    SDPA's enable_gqa, which reads each KV head for its group of query heads without copying it."""
    T, gqa = q.shape[-2], _gqa(q, k)
    if window is None or window >= T:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=window_mask(T, window, q.device), dropout_p=dropout,
                                          enable_gqa=gqa)


def mean_keys(T: int, window: Optional[int]) -> float:
    """Keys a query attends to, averaged over positions: (T+1)/2 causal, about W with a window.
    A kernel that skips masked tiles (flash-attn) scores this many per query."""
    W = min(window or T, T)
    return (W * T - W * (W - 1) / 2) / T


def banded_keys(window: Optional[int], block: int, T: int) -> Optional[float]:
    """Keys per query the banded kernel scores (kernels.attention_banded), averaged over queries:
    the middle query blocks of `block` rows each score a window of block + window - 1 keys rounded up
    to 16, the extra ones masked; the first blocks (whose window would start before key 0) are one
    SDPA call of their own (kernels.attention_sdpa): with an explicit [head, head] mask, every
    score, where the window is shorter than they are, else causal; and a last partial block its
    window's tail. None where it falls back to SDPA (no window, one that covers the sequence, or
    no middle block)."""
    if window is None or window >= T:
        return None
    window_len = -(-(block + window - 1) // 16) * 16
    lead = window_len - block
    head = min(T, -(-lead // block) * block)
    n_mid = (T - head) // block
    if n_mid == 0:
        return None
    tail = T - head - n_mid * block
    head_keys = head if window < head else mean_keys(head, None)
    scored = head * head_keys + n_mid * block * window_len + tail * (lead + tail)
    return scored / T


def attention_flash(q, k, v, window: Optional[int] = None, dropout: float = 0.0) -> torch.Tensor:
    """flash-attn (Dao et al.). Its layout is [B, T, H, D]; its window is (left, right) keys; it
    takes GQA's fewer k and v heads as they are."""
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError(f"kernels.attention=flash needs CUDA tensors in bf16/fp16, got {q.dtype} on "
                           f"{q.device.type}; use kernels.attention=banded or sdpa on this device")
    problem = flash_attn_problem()
    if problem:
        raise RuntimeError(f"kernels.attention=flash: {problem[0]}. Fix: {problem[1]}")
    from flash_attn import flash_attn_func
    left = -1 if window is None else window - 1
    out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                          dropout_p=dropout, causal=True, window_size=(left, 0))
    return out.transpose(1, 2)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def attention_banded(q, k, v, window: Optional[int] = None, block: int = DEFAULT_BLOCK,
                     dropout: float = 0.0) -> torch.Tensor:
    """Sliding-window attention that computes only the key blocks inside the window.

    Queries are cut into blocks of `block` rows. Block c (rows [c·block, (c+1)·block)) needs keys
    [c·block - W + 1, (c+1)·block): a window of block + W - 1 keys that starts `lead` >= W - 1 keys
    before the block (we round the window up to a multiple of 16 keys, which GEMMs and the GPU
    mask kernels like, and mask the extra ones). Seen from its own block every window has the same
    band pattern, so the middle blocks all run as ONE batched SDPA call with ONE shared
    [block, window] mask: K and V are unfolded into overlapping windows, a strided view with no
    copy (autograd's unfold_backward sums the window gradients back). Two pieces don't fit the
    pattern and get their own small call: the first blocks, whose window would start before key
    0, and a last partial block when T is not a multiple of `block`.

    Work: T·(block + W) scores instead of the T²/2 of causal SDPA, so the speed-up over it is
    about T / (2·(W + block)). The mask covers every score of the middle call, also those of
    keys all of a block's queries see. Masking only where needed does not pay: three calls per
    window (the masked left edge, the unmasked interior, the block's own keys causal) of SDPA's
    CPU flash kernel, merged by their log-sum-exps, with the kernel's backward per piece. At
    s=8192, W=256-1024, 1 thread (experiments/bench_band_split.py), the mask costs 0-4% of the
    single call; the split runs at 0.75-0.93x of it in fp32 (what precision=auto trains in on a
    CPU without native bf16) and 1.02-1.06x in bf16: three calls, the merge and the pieces'
    gradient copies cost about what the mask's one add per score does.

    GQA: the G = H/H_kv query heads of a KV head read the same windows of keys, so the middle call
    stacks their query blocks, [G·block] rows against one window and the mask repeated G times:
    one call over B·H_kv windows, which SDPA's kernels take whether or not they support GQA.
    """
    B, H, T, D = q.shape
    H_kv = k.shape[1]
    group = H // H_kv
    if window is None or window >= T:
        return attention_sdpa(q, k, v, window, dropout)
    window_len = _round_up(block + window - 1, 16)
    lead = window_len - block                  # keys before the block's first query, >= W - 1
    head = min(T, _round_up(lead, block))       # queries whose window would start before key 0
    n_mid = (T - head) // block
    mid_end = head + n_mid * block
    if n_mid == 0:
        return attention_sdpa(q, k, v, window, dropout)

    outs = [attention_sdpa(q[:, :, :head], k[:, :, :head], v[:, :, :head], window, dropout)] if head else []

    # [B*H_kv, T, D] with a uniform stride over B*H_kv, so that the unfolded windows reshape as a
    # view. (For q, k, v sliced out of a fused QKV projection this is the one copy, O(T·D).)
    kf, vf = k.reshape(B * H_kv, T, D), v.reshape(B * H_kv, T, D)
    # band_mask with q_offset=lead: query a of a block is at position lead + a of its window.
    mask = band_mask(block, window_len, lead, window, q.device)
    mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))

    def windows(x):  # [B*H_kv, n_mid, window_len, D], overlapping, a view of x
        return x[:, head - lead: mid_end].unfold(1, window_len, block).transpose(-1, -2)

    # [B*H_kv, n_mid, G*block, D]: a block's rows of the group's G query heads (a view when G = 1)
    q_mid = q[:, :, head:mid_end].reshape(B, H_kv, group, n_mid, block, D).transpose(2, 3)
    q_mid = q_mid.reshape(B * H_kv, n_mid, group * block, D)
    out = F.scaled_dot_product_attention(q_mid, windows(kf), windows(vf), attn_mask=mask.repeat(group, 1),
                                         dropout_p=dropout)
    # back to [B, H, n_mid*block, D]: a view on CPU when G = 1; CUDA's SDPA may lay it out otherwise
    outs.append(out.reshape(B, H_kv, n_mid, group, block, D).transpose(2, 3).reshape(B, H, n_mid * block, D))

    if mid_end < T:  # the last, partial block: the top rows and leftmost columns of the same mask
        n_tail = T - mid_end
        keys = slice(mid_end - lead, T)
        outs.append(F.scaled_dot_product_attention(q[:, :, mid_end:], k[:, :, keys], v[:, :, keys],
                                                   attn_mask=mask[:n_tail, :lead + n_tail], dropout_p=dropout,
                                                   enable_gqa=group > 1))
    return torch.cat(outs, dim=2)


# flash-attn has a sliding window (window_size) from 2.3.0. From 2.7.0 its functions are torch
# custom ops (torch.library.custom_op, flash_attn::_flash_attn_forward/_backward, PR
# Dao-AILab/flash-attention#1139): torch.compile keeps them in its graph, where 2.3-2.6's pybind
# calls break the graph at every layer's attention. 3.x is another API. pyproject.toml's `gpu`
# extra pins the same range.
FLASH_ATTN_RANGE = ">=2.7,<3"


@functools.lru_cache(maxsize=None)
def flash_attn_problem() -> Optional[tuple]:
    """(why, fix) when kernels.attention=flash cannot run here, None when it can. Cached: a failed
    import is retried from scratch every time, once per layer per step."""
    try:
        import flash_attn
    except ImportError:
        return (f"the flash-attn package ({FLASH_ATTN_RANGE}) is not installed",
                "`make gpu` on a CUDA host, or kernels.attention=auto|banded|sdpa")
    version = tuple(int(part) for part in re.findall(r"\d+", flash_attn.__version__)[:2])
    if not (2, 7) <= version < (3, 0):
        return (f"flash-attn {flash_attn.__version__} is installed, and this code needs {FLASH_ATTN_RANGE} (sliding "
                f"windows, and functions torch.compile keeps in its graph)",
                "`make gpu` installs one; kernels.attention=auto runs without it")
    return None


@torch.compiler.assume_constant_result
def flash_attn_importable() -> bool:
    """flash-attn imports and is a version this code can call (else auto picks another backend).
    A constant to torch.compile: every layer asks it (kernels.attention=auto on CUDA in bf16), and
    tracing into the cached import would break the graph inside the blocks' loop and send the
    whole compiled step back to eager (train.compile=true at 0.86x of eager on an H200)."""
    return flash_attn_problem() is None


def pick_attention_impl(q, window: Optional[int], block: int = DEFAULT_BLOCK) -> str:
    """What impl="auto" runs: flash where it can, else banded once it skips enough, else sdpa."""
    return choose_attention(q.is_cuda, q.dtype, q.shape[-2], window, block)


def choose_attention(is_cuda: bool, dtype: torch.dtype, T: int, window: Optional[int], block: int = DEFAULT_BLOCK) -> str:
    if is_cuda and dtype in (torch.float16, torch.bfloat16) and flash_attn_importable():
        return "flash"
    # Banded does about T·(W + block) work; masked SDPA T² and causal SDPA T²/2. Below 2·(W + block)
    # the saving is too small to pay for the extra calls and the copy of K and V.
    if window is not None and T >= 2 * (window + block):
        return "banded"
    return "sdpa"


def describe_attention(impl: str, device: torch.device, dtype: torch.dtype, T: int, head_dim: int,
                       window: Optional[int], dropout: float, block: int = DEFAULT_BLOCK) -> dict:
    """Which attention a run's layers call, for run.json and the tables: the backend (impl="auto"
    resolved as pick_attention_impl resolves it), the SDPA kernel torch dispatches the sdpa and
    banded backends' calls to (torch._fused_sdp_choice on a one-head stand-in of the run's shape,
    dtype and mask: flash_attention, efficient_attention, cudnn_attention or math), and why auto did
    not take flash on a GPU, where it would have ("fallback")."""
    ran = choose_attention(device.type == "cuda", dtype, T, window, block) if impl == "auto" else impl
    fallback = None
    if impl == "auto" and ran != "flash" and device.type == "cuda":
        problem = flash_attn_problem()
        fallback = f"{problem[0]}" if problem else f"flash-attn needs bf16/fp16, the run computes in {dtype}"
    kernel = sdpa_kernel(device, dtype, T, head_dim, window, dropout) if ran in ("sdpa", "banded") else None
    return {"requested": impl, "ran": ran, "sdpa_kernel": kernel, "fallback": fallback}


def sdpa_kernel(device: torch.device, dtype: torch.dtype, T: int, head_dim: int, window: Optional[int],
                dropout: float) -> str:
    """The kernel torch's SDPA dispatches attention_sdpa's call to on this device (the banded
    backend's calls carry a mask too): torch's own choice for a one-head stand-in."""
    q = torch.zeros(1, 1, T, head_dim, dtype=dtype, device=device)
    masked = window is not None and window < T
    mask = window_mask(T, window, device) if masked else None
    return SDPBackend(torch._fused_sdp_choice(q, q, q, mask, dropout, not masked)).name.lower()


def attention(q, k, v, window: Optional[int] = None, impl: str = "auto",
              block: int = DEFAULT_BLOCK, dropout: float = 0.0) -> torch.Tensor:
    """Causal attention with an optional sliding window, [B, H, T, D] in and out. `block` is the
    banded backend's query block size; `dropout` the probability of dropping an attention
    probability (training only: the caller passes 0 in eval). Every backend applies it inside its
    softmax(QKᵀ)V, so dropout changes which random numbers are drawn between backends, never what
    they compute in expectation; at 0 every backend equals the reference."""
    if impl == "auto":
        impl = pick_attention_impl(q, window, block)
    if impl == "flash":
        return attention_flash(q, k, v, window, dropout)
    if impl == "banded":
        return attention_banded(q, k, v, window, block, dropout)
    if impl == "sdpa":
        return attention_sdpa(q, k, v, window, dropout)
    if impl == "unfused":
        return attention_unfused(q, k, v, window, dropout)
    if impl == "reference":
        return attention_reference(q, k, v, window, dropout)
    raise ValueError(f"unknown attention impl {impl!r}; use one of {ATTENTION_IMPLS}")


# --- Attention's inputs: the heads of the QKV projection, q and k rotated (RoPE) ---

def heads_with_rope(qkv: torch.Tensor, head_dim: int, cos: torch.Tensor, sin: torch.Tensor,
                    group: int = 1) -> tuple:
    """[B, T, (H + 2·H_kv)·D] projections, rows grouped per KV head as (kv head, [its `group` =
    H/H_kv query heads, k, v], head_dim) -> q [B, H, T, D], k and v [B, H_kv, T, D]; with group=1
    (no GQA) that is (head, q|k|v, head_dim). q and k rotated by RoPE (GPT-NeoX layout, the two halves rotated: apply_rope, the
    reference) with the fp32 cos/sin tables [T, D] rounded to qkv's dtype.

    Written out rather than left to autograd (one layer at bench_step's default shape, fp32, forward
    and backward: 7.5 ms on a 2-core CPU against autograd's 14-18.6 ms). Autograd's rotation builds
    the rotated copy with a neg, a cat and two muls, and its backward zero-fills and copies each half's slice, then stacks q, k and v's
    gradients and copies them back into the projection's layout. Here q and k are rotated
    together, a mul and two half-width multiply-adds over both; backward, one copy gathers dq and
    dk, the same three ops write their inverse rotation straight into the projection's layout,
    and one copy writes dv. Inside a compiled model the same layouts go to inductor in plain
    pointwise ops (_HeadsWithRopeTraced), one kernel each way: the written-out op's in-place
    half-width multiply-adds run at ~1 GB/s on a CPU, and out= ops do not compile."""
    if torch.compiler.is_compiling():
        return _HeadsWithRopeTraced.apply(qkv, head_dim, cos, sin, group)
    return _HeadsWithRope.apply(qkv, head_dim, cos, sin, group)


def _heads(qkv: torch.Tensor, head_dim: int, group: int = 1) -> torch.Tensor:
    """[B, T, (H + 2·H_kv)·D] -> [B, T, H_kv, group + 2, D] (a view): the head count comes from the
    tensor, so under TP a rank's slice of the KV groups works alike."""
    B, T, _ = qkv.shape
    return qkv.view(B, T, -1, group + 2, head_dim)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The reference rotation of x [..., T, D] by the tables [T, D]: x * cos + (-x2, x1) * sin, each
    half written out. Compiled (kernels.fused, or a compiled model), this form is one vectorized
    pass; the same sum with the rotated copy built by cat([-x2, x1]) compiles to a kernel 2-4x
    slower (q and k forward 2.80 against 0.73 ms at bench_step's default shape, fp32)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    c1, c2, s1, s2 = cos[..., :half], cos[..., half:], sin[..., :half], sin[..., half:]
    return torch.cat([x1 * c1 - x2 * s1, x2 * c2 + x1 * s2], dim=-1)


def _heads_then_rope(qkv, head_dim, cos, sin, group: int = 1):
    """heads_with_rope's reference: plain ops, autograd's backward."""
    heads = _heads(qkv, head_dim, group).transpose(1, 2)  # [B, H_kv, T, group + 2, D]
    q = heads[:, :, :, :group].permute(0, 1, 3, 2, 4).flatten(1, 2)
    k, v = heads[:, :, :, group], heads[:, :, :, group + 1]
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def _rotate(x, cos, sin, out, sign: float = 1.0):
    """out = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1), written into out. With
    sign=-1 the inverse rotation, which is also the backward of the forward one: its Jacobian is
    an orthogonal block matrix, so the gradient is the transposed (inverse) rotation of the
    upstream gradient."""
    half = x.shape[-1] // 2
    torch.mul(x, cos, out=out)
    out[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-sign)
    out[..., half:].addcmul_(x[..., :half], sin[..., half:], value=sign)
    return out


class _HeadsWithRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, head_dim, cos, sin, group):
        heads = _heads(qkv, head_dim, group)
        cos, sin = cos.to(qkv.dtype), sin.to(qkv.dtype)  # no copies when the tables come in qkv's dtype
        ctx.save_for_backward(cos, sin)
        ctx.shape, ctx.group = heads.shape, group
        cos, sin = cos[:, None, None], sin[:, None, None]
        B, T, H_kv, _, D = heads.shape
        if group == 1:
            # q and k rotated together, into one buffer whose halves are each laid out [B, T, H, D], as
            # the projection and flash-attn have it (a view swaps H and T): three kernels for both
            qk = heads.new_empty(2, B, T, H_kv, D)
            _rotate(heads[:, :, :, :2], cos, sin, qk.permute(1, 2, 3, 0, 4))
            q, k = qk.unbind(0)
        else:  # GQA: q's heads are not evenly spaced among k's, so each gets its buffer and rotation
            q, k = heads.new_empty(B, T, H_kv, group, D), heads.new_empty(B, T, H_kv, 1, D)
            _rotate(heads[:, :, :, :group], cos, sin, q)
            _rotate(heads[:, :, :, group:group + 1], cos, sin, k)
            q, k = q.flatten(2, 3), k.squeeze(3)
        return q.transpose(1, 2), k.transpose(1, 2), heads[:, :, :, -1].transpose(1, 2)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        cos, sin = ctx.saved_tensors
        cos, sin, group = cos[:, None, None], sin[:, None, None], ctx.group
        grad = torch.empty(ctx.shape, dtype=cos.dtype, device=cos.device)  # the projection's layout
        # (an output left unused gets zeros: autograd's default)
        if group == 1:
            dqk = torch.stack([dq.transpose(1, 2), dk.transpose(1, 2)], dim=3)  # [B, T, H, 2, D]
            _rotate(dqk, cos, sin, grad[:, :, :, :2], sign=-1.0)
        else:
            _rotate(dq.transpose(1, 2).unflatten(2, (-1, group)), cos, sin, grad[:, :, :, :group], sign=-1.0)
            _rotate(dk.transpose(1, 2)[:, :, :, None], cos, sin, grad[:, :, :, group:group + 1], sign=-1.0)
        grad[:, :, :, -1].copy_(dv.transpose(1, 2))
        B, T = ctx.shape[:2]
        return grad.view(B, T, -1), None, None, None, None


def _rotation_tables(cos, sin, dtype):
    """[T, D] tables -> cos and the signed sines of the rotation and of its inverse, [T, 1, 1, D]:
    x * cos + roll(x, D/2) * sin_signed is x * cos + (-x2, x1) * sin, one pointwise pass with no
    cat of halves (a cat inside the backward's cat makes inductor write intermediate buffers)."""
    cos, sin = cos.to(dtype), sin.to(dtype)
    half = cos.shape[-1] // 2
    forward = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
    inverse = torch.cat([sin[:, half:], -sin[:, :half]], dim=-1)  # the transposed rotation
    return cos[:, None, None], forward[:, None, None], inverse[:, None, None]


class _HeadsWithRopeTraced(torch.autograd.Function):
    """_HeadsWithRope's layouts and backward in plain pointwise ops, traced by torch.compile: q and
    k rotated together into one [B, T, H, 2, D] buffer, the projection's layout (a view makes each
    [B, H, T, D], as v is); backward, one pass writing the projection's gradient, q and k's inverse
    rotation beside v's gradient. Autograd's derived backward of _heads_then_rope assembles the same
    gradient from slice_backward pieces and a stack of q, k and v's [B, H, T, D] gradients, which
    inductor writes to an intermediate buffer: on an H200 (bf16, nanoGPT's GPT-2 124M shape) the
    compiled step runs at 0.97x nanoGPT's with this and 0.94-0.95x with the plain ops, 1.01x without
    RoPE (experiments/results/bench_step.md). The rotation uses roll, not a cat of halves: a cat
    inside the backward's cat makes inductor write each rotated gradient before copying it. On a CPU
    inductor's C++ loops do not vectorize roll's indexing, and the plain ops compile 1.25x faster
    there (bf16, one thread); a CPU runs eager by default (train.compile=auto)."""

    @staticmethod
    def forward(ctx, qkv, head_dim, cos, sin, group):
        heads = _heads(qkv, head_dim, group)
        cos, forward, inverse = _rotation_tables(cos, sin, qkv.dtype)
        ctx.save_for_backward(cos, inverse)
        ctx.group = group
        qk = heads[:, :, :, :group + 1]
        qk = qk * cos + qk.roll(head_dim // 2, dims=-1) * forward
        q, k = qk[:, :, :, :group].flatten(2, 3), qk[:, :, :, group]
        return q.transpose(1, 2), k.transpose(1, 2), heads[:, :, :, -1].transpose(1, 2)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        cos, inverse = ctx.saved_tensors
        dq = dq.transpose(1, 2).unflatten(2, (-1, ctx.group))  # [B, T, H_kv, group, D]
        dk, dv = (g.transpose(1, 2)[:, :, :, None] for g in (dk, dv))  # [B, T, H_kv, 1, D]
        half = dv.shape[-1] // 2
        grad = torch.cat([g * cos + g.roll(half, dims=-1) * inverse for g in (dq, dk)] + [dv], dim=3)
        return grad.flatten(2), None, None, None, None


# --- Fused elementwise operators and the loss ---
#
# The functions below are what a compiled step fuses, written so that inductor's one pass each
# way computes what eager computes. They take tensors (weights, bias), not modules.

def _bias_gelu(x, bias):
    # The bias joins in x's dtype, as it would inside the GEMM (nn.Linear under autocast), so a
    # bf16 activation stays bf16 instead of being promoted to fp32 by an fp32 master bias.
    if bias is not None:
        x = x + bias.to(x.dtype)
    return F.gelu(x)  # exact erf GeLU, GPT-NeoX's "gelu"


def _swiglu(x, bias):
    # fc_in's rows interleave gate and up per unit (model.MLP), so its output pairs them: [g0, u0, ...]
    if bias is not None:
        x = x + bias.to(x.dtype)
    gate, up = x.unflatten(-1, (-1, 2)).unbind(-1)
    return F.silu(gate) * up


def _cross_entropy(logits, targets):
    # logsumexp - target logit, in fp32. Compiled, the upcast happens in registers inside the two
    # reductions, so the fp32 copy of [N, V] logits that eager F.cross_entropy needs never exists,
    # and the backward (softmax - one-hot) is one pass that writes the gradient in logits' dtype.
    # The vocab-parallel version (parallel.py, TP > 1) needs the same three quantities across
    # ranks: the max and the sum of exp all-reduced over the TP group (max, then sum), and the
    # target logit taken on the rank whose vocab shard holds it (masked gather + all-reduce sum);
    # its backward stays local: softmax of the local shard minus the one-hot where the target lives.
    logits = logits.flatten(0, -2).float()
    target_logit = logits.gather(-1, targets.flatten()[:, None]).squeeze(-1)
    return (torch.logsumexp(logits, dim=-1) - target_logit).mean()


def layer_norm(x: torch.Tensor, norm: nn.LayerNorm | nn.RMSNorm, fused=False) -> torch.Tensor:
    """norm(x), for GPT's LayerNorm and Llama's RMSNorm alike. fused: a value of
    KernelsConfig.fused (False, True or "triton"), for every function here.

    A lone LayerNorm is already one ATen kernel forward and one backward, so there is nothing to
    fuse; on a CPU inductor's LayerNorm loops run at 0.40-0.70x of ATen's (1 thread, bf16 and fp32,
    experiments/bench_kernels.py). RMSNorm is one kernel each way on CUDA (aten::_fused_rms_norm),
    a few elementwise ops on a CPU. Only Triton replaces either from eager code; inside a compiled
    step inductor fuses them."""
    if _use_triton(fused, x):
        return kernels_triton.TritonLayerNorm.apply(x, None, norm.weight, *_norm_args(norm, x))
    return _norm(x, norm)


def _norm_args(norm: nn.Module, x: torch.Tensor) -> tuple:
    """The Triton norm's (bias, eps, rms) for an nn.LayerNorm or nn.RMSNorm (whose eps=None means
    the dtype's machine epsilon, as torch's)."""
    rms = isinstance(norm, nn.RMSNorm)
    eps = norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps
    return (None if rms else norm.bias), eps, rms


def _norm(x: torch.Tensor, norm: nn.LayerNorm | nn.RMSNorm) -> torch.Tensor:
    """norm(x), in x's dtype where x and the weights share a low-precision one. CUDA's autocast runs
    layer_norm in fp32: it casts a bf16 input and bf16 weights up (a kernel each, each way) and
    returns fp32, which the next GEMM casts down again. ATen's bf16 LayerNorm computes in fp32
    already and rounds its output once, as that cast would, so it runs outside autocast here. (On
    a CPU, autocast leaves layer_norm in the input's dtype: nothing to undo.)"""
    if x.is_cuda and x.dtype == norm.weight.dtype != torch.float32 and torch.is_autocast_enabled("cuda"):
        with torch.autocast("cuda", enabled=False):
            return norm(x)
    return norm(x)


def add_layer_norm(x: torch.Tensor, delta: torch.Tensor, norm: nn.LayerNorm | nn.RMSNorm, fused=False):
    """Residual add then LayerNorm or RMSNorm: returns (x + delta, norm(x + delta)). Inside a
    compiled step inductor fuses the two, whatever fused says."""
    if _use_triton(fused, x):
        return kernels_triton.TritonLayerNorm.apply(x, delta, norm.weight, *_norm_args(norm, x))
    x = x + delta
    return x, _norm(x, norm)


def bias_gelu(x: torch.Tensor, bias: Optional[torch.Tensor], fused=False) -> torch.Tensor:
    """GeLU(x + bias); inside a compiled step inductor fuses the two, whatever fused says. Without
    a bias (model.bias=false) there is nothing to fuse: ATen's GeLU is one kernel each way, and
    inductor's lone GeLU runs at 0.70x of it on a CPU (forward and backward of [2048, 1536] fp32,
    6.01 against 4.19 ms; bench_step's default MLP)."""
    if _use_triton(fused, x):
        return kernels_triton.TritonBiasGelu.apply(x, bias)
    return _bias_gelu(x, bias)


def swiglu(x: torch.Tensor, bias: Optional[torch.Tensor], fused=False) -> torch.Tensor:
    """SwiGLU of fc_in's output (+ bias), gate and up interleaved [..., 2F] -> silu(gate) * up
    [..., F]. Inside a compiled step inductor fuses it into one pass each way, whatever fused says;
    eager runs a SiLU and a product (and their backward), Triton one kernel each way."""
    if _use_triton(fused, x):
        return kernels_triton.TritonSwiGLU.apply(x, bias)
    return _swiglu(x, bias)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, fused=False) -> torch.Tensor:
    """Mean token cross-entropy, computed in fp32 whatever the logits' dtype. fused=true inside a
    compiled step, and on meta tensors (a rehearsal, which stands for a GPU's compiled step): the
    form inductor fuses into two reductions (_cross_entropy); from eager code, ATen's."""
    if _use_triton(fused, logits):
        return kernels_triton.TritonCrossEntropy.apply(logits.flatten(0, -2), targets.flatten()).mean()
    if fused and (torch.compiler.is_compiling() or logits.is_meta):
        return _cross_entropy(logits, targets)
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten())


# --- Triton kernels (kernels.fused=triton): when they run; the kernels are in kernels_triton.py ---

@functools.lru_cache(maxsize=None)
def triton_importable() -> bool:
    """Cached, as flash_attn_importable: asked on every call of every fused op."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _use_triton(fused, x: torch.Tensor) -> bool:
    """True for fused="triton" where Triton can run; where it cannot, a one-line error naming what
    to use instead (as for kernels.attention=flash)."""
    if fused != "triton" or torch.compiler.is_compiling():  # in a compiled model inductor fuses it
        return False
    if not triton_importable():
        raise RuntimeError("kernels.fused=triton needs the triton package (pip install '.[triton]' on a CUDA "
                           "host); use kernels.fused=true instead")
    if not (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        raise RuntimeError(f"kernels.fused=triton needs CUDA tensors, got {x.device.type} (on CPU Triton runs only "
                           "in its interpreter, TRITON_INTERPRET=1, for tests); use kernels.fused=true on this device")
    return True
