"""Operators the model calls, each with an eager reference and (where it pays) a faster path.

Switches: kernels.attention=auto|flash|banded|sdpa|reference and kernels.fused=true|false.
The eager reference always stays, so tests can compare every fast path with it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class KernelsConfig:
    attention: str = "auto"   # auto | flash | banded | sdpa | reference
    fused: bool = False       # fused LayerNorm(+residual), bias+GeLU, cross-entropy


ATTENTION_IMPLS = ("auto", "flash", "banded", "sdpa", "reference")


def window_mask(T: int, window: Optional[int], device) -> torch.Tensor:
    """Boolean [T, T] mask, True where query i may attend key j: j <= i and i - j < window."""
    i = torch.arange(T, device=device)[:, None]
    j = torch.arange(T, device=device)[None, :]
    allowed = j <= i
    if window is not None:
        allowed = allowed & (i - j < window)
    return allowed


def attention_reference(q, k, v, window: Optional[int] = None) -> torch.Tensor:
    """Naive softmax attention, [B, H, T, D] in and out. The oracle for every other backend."""
    scores = (q.float() @ k.float().transpose(-1, -2)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~window_mask(q.shape[-2], window, q.device), float("-inf"))
    return (scores.softmax(-1) @ v.float()).to(q.dtype)


def attention(q, k, v, window: Optional[int] = None, impl: str = "auto") -> torch.Tensor:
    if impl == "reference":
        return attention_reference(q, k, v, window)
    if window is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=window_mask(q.shape[-2], window, q.device))


def layer_norm(x: torch.Tensor, norm: nn.LayerNorm, fused: bool = False) -> torch.Tensor:
    return norm(x)


def add_layer_norm(x: torch.Tensor, delta: torch.Tensor, norm: nn.LayerNorm, fused: bool = False):
    """Residual add then LayerNorm: returns (x + delta, LN(x + delta))."""
    x = x + delta
    return x, norm(x)


def bias_gelu(x: torch.Tensor, bias: Optional[torch.Tensor], fused: bool = False) -> torch.Tensor:
    return F.gelu(x if bias is None else x + bias)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """Mean token cross-entropy, computed in fp32 whatever the logits' dtype."""
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten())
