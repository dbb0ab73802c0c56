"""Optimizers and the learning-rate schedule. (Being written; this holds the config contract.)"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class OptimConfig:
    name: str = "adamw"                       # adamw | lamb
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    exclude_bias_and_norm: bool = True        # from weight decay (and, for LAMB, the trust ratio)
    trust_clamp: Optional[List[float]] = None # LAMB: clamp ‖p‖/‖u‖ into [lo, hi]; DeepSpeed uses [0.01, 10]
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1                 # cosine decays to lr * min_lr_ratio at max_steps
