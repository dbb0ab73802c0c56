"""Optimizers and the learning-rate schedule: torch's AdamW, our LAMB, warm-up then cosine.

LAMB is written here rather than taken from DeepSpeed or apex because its trust ratio needs the
norm of each *logical* parameter, and under tensor parallelism or ZeRO a rank holds only a shard.
DeepSpeed's LAMB takes the norm of whatever buffer it is handed, which is wrong under ZeRO
(deepspeedai/DeepSpeed#88, open since 2020). The contract with parallel.py:

- every tensor the optimizer sees is a piece of exactly one logical parameter (ZeRO shards each
  parameter on its own along dim 0, zero-padded; never a flat buffer that mixes parameters);
- a piece's ShardInfo (parallelisms/sharding.py) may say `norm_owner=False` when it is a replica of elements
  another rank of the norm group also holds (a LayerNorm weight replicated over TP is owned by
  tp-rank 0 only), so summing partial squared norms over the group counts each element once;
- the ranks of the norm group hold the same parameter list in the same order (the same model
  code, sharded), so the i-th entry of the packed norm vector means the same parameter on each.

The same ownership rule gives the global gradient norm for clipping (clip_grad_norm_ below).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Iterable, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from errors import ConfigError
from parallelisms.overlap import WaitClock
from parallelisms.sharding import shard_info


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
    # LAMB, with exclude_bias_and_norm: True still applies the trust ratio to biases and norm
    # weights (apex's NVLAMB); False gives them r = 1, as You et al.'s BERT code does.
    lamb_trust_bias_and_norm: bool = False


NAMES = ("adamw", "lamb")


def check_config(cfg: OptimConfig) -> None:
    """Raise ConfigError for a bad optim setting."""
    if cfg.name not in NAMES:
        raise ConfigError("optim.name", f"unknown value {cfg.name!r}", f"use one of: {', '.join(NAMES)}")
    if len(cfg.betas) != 2 or not all(0.0 <= b < 1.0 for b in cfg.betas):
        raise ConfigError("optim.betas", f"{list(cfg.betas)}", "give two values in [0, 1), e.g. [0.9, 0.95]")
    if cfg.eps <= 0:
        raise ConfigError("optim.eps", f"{cfg.eps} <= 0", "use a small positive eps, e.g. 1e-8")
    if cfg.weight_decay < 0:
        raise ConfigError("optim.weight_decay", f"{cfg.weight_decay} < 0", "use a weight decay >= 0")
    if cfg.trust_clamp is not None and (len(cfg.trust_clamp) != 2 or not 0 < cfg.trust_clamp[0] <= cfg.trust_clamp[1]):
        raise ConfigError("optim.trust_clamp", f"{cfg.trust_clamp}",
                          "give [lo, hi] with 0 < lo <= hi (DeepSpeed: [0.01, 10]), or null for no clamp")
    if cfg.warmup_steps < 0:
        raise ConfigError("optim.warmup_steps", f"{cfg.warmup_steps} < 0", "use 0 or more warm-up steps")
    if not 0.0 <= cfg.min_lr_ratio <= 1.0:
        raise ConfigError("optim.min_lr_ratio", f"{cfg.min_lr_ratio} is outside [0, 1]", "use a ratio in [0, 1]")


# --- Parameter groups ---

def is_bias_or_norm(name: str, p: torch.Tensor) -> bool:
    """Biases and normalization weights: 1-D tensors, or named so. A ZeRO shard is a flat piece of
    its parameter, so parallelisms/zero.py records the parameter's own ndim in its ShardInfo."""
    parts = name.split(".")
    ndim = shard_info(p).logical_ndim or p.ndim
    return ndim < 2 or name.endswith("bias") or any(s.startswith("ln_") or "norm" in s for s in parts)


def param_groups(named_params: Iterable[tuple[str, nn.Parameter]], cfg: OptimConfig) -> list[dict]:
    """Decay and no-decay groups (the no-decay one only with cfg.exclude_bias_and_norm).

    Each group holds (name, param) pairs, so the optimizer's state_dict records param_names.
    `trust_ratio` is read by Lamb and ignored by AdamW. Both groups are always present, even if one
    is empty, so every rank and every pipeline stage has the same group layout.
    Call it on unflattened parameters (dim-0 shards keep their rank, a flattened weight would not).
    """
    named = [(n, p) for n, p in named_params if p.requires_grad]
    if not cfg.exclude_bias_and_norm:
        return [{"params": named, "weight_decay": cfg.weight_decay, "trust_ratio": True}]
    no_decay = [(n, p) for n, p in named if is_bias_or_norm(n, p)]
    decay = [(n, p) for n, p in named if not is_bias_or_norm(n, p)]
    return [{"params": decay, "weight_decay": cfg.weight_decay, "trust_ratio": True},
            {"params": no_decay, "weight_decay": 0.0, "trust_ratio": cfg.lamb_trust_bias_and_norm}]


def build_optimizer(named_params, cfg: OptimConfig, lr: float, norm_group=None,
                    clock: Optional[WaitClock] = None) -> torch.optim.Optimizer:
    """AdamW (torch's fused kernel) or Lamb over param_groups(). norm_group matters to LAMB only: the
    process group whose ranks together hold each logical parameter once (see the module doc);
    clock the rank's WaitClock (parallel.Layout.clock), which times LAMB's one all-reduce."""
    # torch refuses an empty named group; ranks that share a LAMB norm group hold the same
    # parameter names, so they drop the same groups and their norm vectors still line up.
    groups = [g for g in param_groups(named_params, cfg) if g["params"]]
    if cfg.name == "adamw":
        # The fused kernel (CPU and CUDA): the update rule of foreach, in fewer, faster kernels. It
        # has no meta kernel, so a rehearsal (clustermodel/rehearsal.py) steps the same state with foreach.
        on_meta = any(p.is_meta for g in groups for _, p in g["params"])
        return torch.optim.AdamW(groups, lr=lr, betas=tuple(cfg.betas), eps=cfg.eps,
                                 weight_decay=cfg.weight_decay, fused=not on_meta, foreach=on_meta or None)
    if cfg.name == "lamb":
        return Lamb(groups, lr=lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay,
                    trust_clamp=cfg.trust_clamp, norm_group=norm_group, clock=clock)
    raise ValueError(f"unknown optimizer {cfg.name!r}; use one of {NAMES}")


# --- LAMB ---

class Lamb(torch.optim.Optimizer):
    r"""LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning", Algorithm 2), per
    logical tensor p with gradient g at step t (t counts this tensor's updates, from 1):

        m_t = β1·m_{t-1} + (1-β1)·g               v_t = β2·v_{t-1} + (1-β2)·g²
        m̂ = m_t / (1 - β1^t)                       v̂ = v_t / (1 - β2^t)
        u = m̂ / (sqrt(v̂) + eps) + wd·p
        r = ‖p‖ / ‖u‖        if the group has trust_ratio=True and ‖p‖ > 0 and ‖u‖ > 0
            then clamped into trust_clamp = [lo, hi] when that is set
        r = 1                otherwise (no trust ratio for the group, or a zero norm; not clamped)
        p ← p - lr·r·u

    ‖·‖ are L2 norms of the whole logical tensor, whatever piece of it this rank holds: with a
    norm_group, each rank computes ‖p_piece‖² and ‖u_piece‖² of every tensor of every trust-ratio
    group (zero for pieces whose ShardInfo has `norm_owner=False`, or with no grad this step), packs them into
    one fp32 vector [2, n_tensors] and sums it with ONE all_reduce per step over norm_group. The
    vector's layout comes from the parameter list, not from which grads exist, so ranks agree on
    it; a tensor with no grad is not updated. Zero padding (p = 0, g = 0) contributes nothing.
    (Replication that is the same for every element of a tensor scales ‖p‖ and ‖u‖ alike and
    cancels in r; the owner flag is what keeps r exact when it is uneven, and what the global
    gradient norm of clip_grad_norm_ needs in every case.)

    Group options: lr, betas, eps, weight_decay, trust_ratio (bool), trust_clamp ((lo, hi) or None).
    Everything runs as foreach ops; all parameters are expected on one device.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, trust_clamp=None, norm_group=None, clock: Optional[WaitClock] = None):
        # eps > 0, not >= 0: zero padding has v = 0, and eps = 0 would make its u = 0/0 = NaN,
        # which the norm all_reduce would then spread to every rank's trust ratio.
        if lr < 0 or eps <= 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"bad Lamb hyperparameters: lr={lr} betas={betas} eps={eps} wd={weight_decay}")
        if trust_clamp is not None:
            trust_clamp = (float(trust_clamp[0]), float(trust_clamp[1]))
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        trust_ratio=True, trust_clamp=trust_clamp)
        super().__init__(params, defaults)
        # A ProcessGroup is no hyperparameter: kept off the groups so state_dict() stays plain data.
        self.norm_group, self.clock = norm_group, clock or WaitClock()  # (untimed without the rank's clock)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = [self._moments_and_update(group) for group in self.param_groups]
        ratios = self._trust_ratios(work)
        for group, (params, updates, _), ratio in zip(self.param_groups, work, ratios):
            if not params:
                continue
            if ratio is not None:
                torch._foreach_mul_(updates, list(ratio.unbind()))
            torch._foreach_add_(params, updates, alpha=-group["lr"])
        return loss

    def _moments_and_update(self, group) -> tuple[list, list, list]:
        """Advance m and v of the group's tensors that have a grad; return (params, u, slots):
        the tensors, their updates u (before the trust ratio), and their index in the group."""
        beta1, beta2 = group["betas"]
        params, grads, exp_avgs, exp_avg_sqs, steps, slots = [], [], [], [], [], []
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("Lamb does not support sparse gradients")
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"].item())
            slots.append(i)
        if not params:
            return [], [], []
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        # m̂ / (sqrt(v̂) + eps) = m / d with d = (sqrt(v) + eps·sqrt(bc2)) · bc1 / sqrt(bc2): the bias
        # corrections are per-tensor scalars, and u is built in place in ONE buffer per tensor.
        # On CPU the buffer is kept between steps (not in state_dict): a fresh temporary there is
        # pages to fault in on every step. Elsewhere it is a temporary, so that it does not add to
        # the backward's peak (a rank's memory peaks with its activations, not in the optimizer).
        sqrt_bc2 = [math.sqrt(1 - beta2 ** t) for t in steps]
        updates = self._update_buffers(params)
        torch._foreach_copy_(updates, exp_avg_sqs)
        torch._foreach_sqrt_(updates)
        torch._foreach_add_(updates, [group["eps"] * s for s in sqrt_bc2])
        torch._foreach_mul_(updates, [(1 - beta1 ** t) / s for s, t in zip(sqrt_bc2, steps)])
        torch._foreach_reciprocal_(updates)
        torch._foreach_mul_(updates, exp_avgs)
        if group["weight_decay"] != 0:
            torch._foreach_add_(updates, params, alpha=group["weight_decay"])
        return params, updates, slots

    def _update_buffers(self, params: list) -> list:
        if params[0].device.type != "cpu":  # the caching allocator makes a temporary free, and a kept
            return [torch.empty_like(p) for p in params]  # buffer would sit through the activations' peak
        buffers = self.__dict__.setdefault("_updates", {})
        for p in params:
            if p not in buffers or buffers[p].shape != p.shape:
                buffers[p] = torch.empty_like(p, memory_format=torch.preserve_format)
        return [buffers[p] for p in params]

    def _on_device(self, values: tuple, device) -> torch.Tensor:
        """`values` as a tensor on `device`, made once. torch.tensor(list, device=cuda) copies from
        pageable host memory and waits for the copy (a host sync), and the slots with grads and the
        owner flags are the same every step, so the tensor is kept, keyed by its values."""
        made = self.__dict__.setdefault("_device_constants", {})
        key = (values, str(device))
        if key not in made:
            made[key] = torch.tensor(values, device=device)
        return made[key]

    def _trust_ratios(self, work) -> list[Optional[torch.Tensor]]:
        """Per group: a vector of r for its tensors with grads, or None where r = 1 throughout."""
        trusting = [g["trust_ratio"] for g in self.param_groups]
        n_slots = [len(g["params"]) if t else 0 for g, t in zip(self.param_groups, trusting)]
        if sum(n_slots) == 0:
            return [None] * len(self.param_groups)
        live = [(params, updates, [sum(n_slots[:k]) + s for s in slots])
                for k, (params, updates, slots) in enumerate(work) if trusting[k] and params]
        device = next(g["params"][0].device for g, n in zip(self.param_groups, n_slots) if n)
        squares = torch.zeros(2, sum(n_slots), dtype=torch.float32, device=device)
        if live:
            params = [p for ps, _, _ in live for p in ps]
            updates = [u for _, us, _ in live for u in us]
            index = self._on_device(tuple(i for _, _, idx in live for i in idx), device)
            owner = self._on_device(tuple(float(shard_info(p).norm_owner) for p in params), device)
            p_norms = torch.stack(torch._foreach_norm(params, 2, dtype=torch.float32))
            u_norms = torch.stack(torch._foreach_norm(updates, 2, dtype=torch.float32))
            squares[:, index] = torch.stack([p_norms, u_norms]).square() * owner
        if self.norm_group is not None:
            with self.clock.waiting("comm", squares.device):
                dist.all_reduce(squares, group=self.norm_group)
        p_norm, u_norm = squares.sqrt().unbind()

        ratios, offset = [], 0
        for k, group in enumerate(self.param_groups):
            params, _, slots = work[k]
            if not trusting[k] or not params:
                ratios.append(None)
                offset += n_slots[k]
                continue
            idx = self._on_device(tuple(s + offset for s in slots), device)
            pn, un = p_norm[idx], u_norm[idx]
            r = pn / un
            if group["trust_clamp"] is not None:
                r = r.clamp(*group["trust_clamp"])
            ratios.append(torch.where((pn > 0) & (un > 0), r, torch.ones_like(r)))
            offset += n_slots[k]
        return ratios


# --- Gradient clipping with the same ownership rule ---

@torch.no_grad()
def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float, norm_group=None,
                    clock: Optional[WaitClock] = None) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ for sharded parameters: the global L2 norm of all grads, each
    logical element counted once (pieces whose ShardInfo has `norm_owner=False` add nothing), summed with one
    all_reduce over norm_group. Scales grads by max_norm / (norm + 1e-6) when the norm exceeds
    max_norm, as torch does. Returns the total norm (an fp32 0-d tensor) on every rank; nothing is
    read by the host."""
    params = [p for p in params if p.grad is not None]
    squares = grad_squares(params, params[0].device if params else torch.device("cpu"))
    if norm_group is not None:
        with (clock or WaitClock()).waiting("comm", squares.device):
            dist.all_reduce(squares, group=norm_group)
    total = squares.sqrt()
    scale_grads_(params, total, max_norm)
    return total


def grad_squares(params: list, device) -> torch.Tensor:
    """This rank's share of the squared global gradient norm: the owned pieces' grads, in one
    foreach pass, as an fp32 0-d tensor on `device` (to be summed over the ranks)."""
    owned = [p.grad for p in params if p.grad is not None and shard_info(p).norm_owner]
    if not owned:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack(torch._foreach_norm(owned, 2, dtype=torch.float32)).square().sum()


def scale_grads_(params: list, total: torch.Tensor, max_norm: float) -> None:
    """Multiplies every grad by min(1, max_norm / (total + 1e-6)), on the device."""
    grads = [p.grad for p in params if p.grad is not None]
    if grads and math.isfinite(max_norm):
        scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(grads, scale.to(grads[0].dtype))


# --- Learning-rate schedule ---

def lr_lambda(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """The lr multiplier for the optimizer step with 0-based index `step` (LambdaLR passes the
    number of scheduler.step() calls so far). Linear warm-up reaching 1 on the last warm-up step,
    so step 0 already moves the weights, then a cosine from 1 at step warmup_steps down to
    min_lr_ratio at step max_steps, flat after that."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if step >= max_steps:
        return min_lr_ratio
    progress = (step - warmup_steps) / (max_steps - warmup_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def batch_scaled_lr(lr: float, k: float) -> float:
    """The peak learning rate at k times the batch that `lr` was chosen at: square-root scaling,
    for LAMB and AdamW alike. LAMB: the rule of You et al. 2019 ("Large Batch Optimization for Deep
    Learning", ICLR'20) for its BERT runs, the learning rate growing with the square root of the
    batch and the warm-up fixed in epochs, i.e. in tokens (warmup_steps_for_tokens). AdamW: the
    square-root rule is the one for adaptive optimizers (Malladi et al. 2022, "On the SDEs and
    Scaling Rules for Adaptive Gradient Algorithms"); linear scaling (Goyal et al. 2017) is SGD's."""
    return lr * math.sqrt(k)


def warmup_steps_for_tokens(tokens: int, tokens_per_step: int) -> int:
    """Warm-up counted in tokens, as steps of this batch: a k-times batch warms up in k-times fewer steps."""
    return max(1, round(tokens / tokens_per_step))


def build_scheduler(optimizer, cfg: OptimConfig, max_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    # A partial, not a lambda or a callable object: LambdaLR's state_dict then stores no schedule
    # parameters, so a resumed run follows its own (possibly changed) config, not the checkpoint's.
    schedule = functools.partial(lr_lambda, warmup_steps=cfg.warmup_steps, max_steps=max_steps,
                                 min_lr_ratio=cfg.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
