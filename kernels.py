"""Operators the model calls, each with an eager reference and (where it pays) a faster path.

Switches: kernels.attention=auto|flash|banded|sdpa|reference and kernels.fused=true|false.
The eager reference always stays, so tests can compare every fast path with it.

Attention takes and returns [B, H, T, D] and is always causal. With a sliding window W, query i
attends key j iff i - W < j <= i: W keys, the query's own position included, so W=1 is "attend to
yourself only" and any W >= T is plain causal attention. window=None means full causal. Every
backend obeys exactly this rule (flash-attn spells it window_size=(W-1, 0)):
- flash:     flash-attn's kernel (CUDA, bf16/fp16, the optional `gpu` extra). Skips masked tiles.
- banded:    blockwise PyTorch (below); does O(T·(W+block)) work instead of O(T²). CPU and GPU.
- sdpa:      one SDPA call with a [T, T] mask; correct but computes every masked score.
- reference: naive softmax(QKᵀ)V in fp32, the oracle.
- auto:      flash where it can run, else banded where the window skips enough, else sdpa.

Fused operators (kernels.fused=true) are the eager functions below run through torch.compile:
inductor turns each into one read-and-write pass forward and one backward, where eager PyTorch
makes a pass per op. The functions are compiled lazily, once, the first time they are called.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class KernelsConfig:
    attention: str = "auto"   # auto | flash | banded | sdpa | reference
    fused: bool = False       # fused LayerNorm(+residual), bias+GeLU, cross-entropy
    # Query rows per block of the banded backend: it computes T·(W + block) scores, so smaller is
    # less waste, until per-block overheads win. 128 measured best on CPU (experiments/bench_kernels.py).
    attention_block: int = 128


ATTENTION_IMPLS = ("auto", "flash", "banded", "sdpa", "reference")
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


def attention_reference(q, k, v, window: Optional[int] = None) -> torch.Tensor:
    """Naive softmax attention, [B, H, T, D] in and out. The oracle for every other backend."""
    scores = (q.float() @ k.float().transpose(-1, -2)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~window_mask(q.shape[-2], window, q.device), float("-inf"))
    return (scores.softmax(-1) @ v.float()).to(q.dtype)


def attention_sdpa(q, k, v, window: Optional[int] = None) -> torch.Tensor:
    """One SDPA call. Full causal uses is_causal, which lets the kernel skip the upper triangle;
    a window needs an explicit mask, and then every score of the [T, T] square is computed."""
    T = q.shape[-2]
    if window is None or window >= T:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=window_mask(T, window, q.device))


def attention_flash(q, k, v, window: Optional[int] = None) -> torch.Tensor:
    """flash-attn (Dao et al.). Its layout is [B, T, H, D]; its window is (left, right) keys."""
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError(f"kernels.attention=flash needs CUDA tensors in bf16/fp16, got {q.dtype} on "
                           f"{q.device.type}; use kernels.attention=banded or sdpa on this device")
    try:
        from flash_attn import flash_attn_func
    except ImportError as err:
        raise RuntimeError("kernels.attention=flash needs the flash-attn package (pip install '.[gpu]' "
                           "on a CUDA host); use kernels.attention=banded or sdpa instead") from err
    left = -1 if window is None else window - 1
    out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                          causal=True, window_size=(left, 0))
    return out.transpose(1, 2)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def attention_banded(q, k, v, window: Optional[int] = None, block: int = DEFAULT_BLOCK) -> torch.Tensor:
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
    about T / (2·(W + block)). Why not three calls per block (unmasked middle, masked edges)?
    Merging them needs each call's log-sum-exp and a custom backward; the mask costs one add per
    score, less than the waste it would save.
    """
    B, H, T, D = q.shape
    if window is None or window >= T:
        return attention_sdpa(q, k, v, window)
    window_len = _round_up(block + window - 1, 16)
    lead = window_len - block                  # keys before the block's first query, >= W - 1
    head = min(T, _round_up(lead, block))       # queries whose window would start before key 0
    n_mid = (T - head) // block
    mid_end = head + n_mid * block
    if n_mid == 0:
        return attention_sdpa(q, k, v, window)

    outs = [attention_sdpa(q[:, :, :head], k[:, :, :head], v[:, :, :head], window)] if head else []

    # [B*H, T, D] with a uniform stride over B*H, so that the unfolded windows reshape as a view.
    # (For q, k, v sliced out of a fused QKV projection this is the one copy, O(T·D).)
    kf, vf = k.reshape(B * H, T, D), v.reshape(B * H, T, D)
    # band_mask with q_offset=lead: query a of a block is at position lead + a of its window.
    mask = band_mask(block, window_len, lead, window, q.device)
    mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))

    def windows(x):  # [B*H, n_mid, window_len, D], overlapping, a view of x
        return x[:, head - lead: mid_end].unfold(1, window_len, block).transpose(-1, -2)

    q_mid = q[:, :, head:mid_end].reshape(B * H, n_mid, block, D)
    out = F.scaled_dot_product_attention(q_mid, windows(kf), windows(vf), attn_mask=mask)
    outs.append(out.view(B, H, n_mid * block, D))

    if mid_end < T:  # the last, partial block: the top rows and leftmost columns of the same mask
        n_tail = T - mid_end
        keys = slice(mid_end - lead, T)
        outs.append(F.scaled_dot_product_attention(q[:, :, mid_end:], k[:, :, keys], v[:, :, keys],
                                                   attn_mask=mask[:n_tail, :lead + n_tail]))
    return torch.cat(outs, dim=2)


@functools.lru_cache(maxsize=None)
def flash_attn_importable() -> bool:
    """Cached: a failed import is retried from scratch every time, once per layer per step."""
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def _flash_available(q) -> bool:
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and flash_attn_importable()


def pick_attention_impl(q, window: Optional[int], block: int = DEFAULT_BLOCK) -> str:
    """What impl="auto" runs: flash where it can, else banded once it skips enough, else sdpa."""
    if _flash_available(q):
        return "flash"
    # Banded does about T·(W + block) work; masked SDPA T² and causal SDPA T²/2. Below 2·(W + block)
    # the saving is too small to pay for the extra calls and the copy of K and V.
    if window is not None and q.shape[-2] >= 2 * (window + block):
        return "banded"
    return "sdpa"


def attention(q, k, v, window: Optional[int] = None, impl: str = "auto",
              block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """Causal attention with an optional sliding window, [B, H, T, D] in and out. `block` is the
    banded backend's query block size."""
    if impl == "auto":
        impl = pick_attention_impl(q, window, block)
    if impl == "flash":
        return attention_flash(q, k, v, window)
    if impl == "banded":
        return attention_banded(q, k, v, window, block)
    if impl == "sdpa":
        return attention_sdpa(q, k, v, window)
    if impl == "reference":
        return attention_reference(q, k, v, window)
    raise ValueError(f"unknown attention impl {impl!r}; use one of {ATTENTION_IMPLS}")


# --- Fused elementwise operators and the loss ---
#
# Each eager function below is the reference AND the source of its fused version: the fused path
# is the same code compiled by inductor, so the two can only differ by rounding. They take
# tensors (weights, bias), not modules, so one compiled graph serves every layer: a module
# argument would make dynamo guard on its identity and recompile per layer.

class _Compiled:
    """fn compiled by torch.compile on first call, one static graph per input shape.

    dynamic=False: a training run calls each op on one or two shapes (train, eval), and the
    static graphs ran ~30% faster than one dynamic-shape graph here (LayerNorm + residual, bf16,
    CPU); each new shape costs a compile (2-4 s on CPU). dynamic=None would be worse than either:
    after the second shape it swaps in a dynamic graph that then also serves the first."""

    def __init__(self, fn: Callable):
        self.fn, self.compiled = fn, None

    def __call__(self, *args):
        if torch.compiler.is_compiling():  # inside a compiled model: let the outer graph fuse it
            return self.fn(*args)
        if self.compiled is None:
            self.compiled = torch.compile(self.fn, dynamic=False)
        return self.compiled(*args)


def _layer_norm(x, weight, bias, eps: float):
    return F.layer_norm(x, weight.shape, weight, bias, eps)


def _add_layer_norm(x, delta, weight, bias, eps: float):
    x = x + delta
    return x, F.layer_norm(x, weight.shape, weight, bias, eps)


def _bias_gelu(x, bias):
    # The bias joins in x's dtype, as it would inside the GEMM (nn.Linear under autocast), so a
    # bf16 activation stays bf16 instead of being promoted to fp32 by an fp32 master bias.
    if bias is not None:
        x = x + bias.to(x.dtype)
    return F.gelu(x)  # exact erf GeLU, GPT-NeoX's "gelu"


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


_layer_norm_fused = _Compiled(_layer_norm)
_add_layer_norm_fused = _Compiled(_add_layer_norm)
_bias_gelu_fused = _Compiled(_bias_gelu)
_cross_entropy_fused = _Compiled(_cross_entropy)


def layer_norm(x: torch.Tensor, norm: nn.LayerNorm, fused: bool = False) -> torch.Tensor:
    if not fused:
        return norm(x)
    return _layer_norm_fused(x, norm.weight, norm.bias, norm.eps)


def add_layer_norm(x: torch.Tensor, delta: torch.Tensor, norm: nn.LayerNorm, fused: bool = False):
    """Residual add then LayerNorm: returns (x + delta, LN(x + delta))."""
    if not fused:
        x = x + delta
        return x, norm(x)
    return _add_layer_norm_fused(x, delta, norm.weight, norm.bias, norm.eps)


def bias_gelu(x: torch.Tensor, bias: Optional[torch.Tensor], fused: bool = False) -> torch.Tensor:
    return (_bias_gelu_fused if fused else _bias_gelu)(x, bias)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """Mean token cross-entropy, computed in fp32 whatever the logits' dtype."""
    if not fused:
        return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten())
    return _cross_entropy_fused(logits, targets)
