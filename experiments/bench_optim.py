"""Optimizer step time: our LAMB against torch's AdamW, on a model's parameters.

    python experiments/bench_optim.py                      # tiny and small shapes, 10 timed steps
    python experiments/bench_optim.py --models tiny --steps 30

Parameters and grads are fp32 (the master copy a bf16 run keeps), built from model.GPT so the
tensor count and sizes are the real ones. Each optimizer gets warm-up steps (state allocation,
first-touch page faults) that are not timed, then the median of --steps timed steps is reported.
LAMB runs single-process (no norm_group), so the column shows its compute cost only: the extra
read of p and u for the two norms and the per-tensor scaling. Prints a Markdown table.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the flat repo root
import optim  # noqa: E402
from model import GPT, ModelConfig  # noqa: E402

SHAPES = {  # the tiny default and conf/model/small.yaml
    "tiny": ModelConfig(),
    "small": ModelConfig(name="small", n_layers=12, n_heads=12, d_model=768, vocab_size=50304),
}
OPTIMIZERS = {  # table label -> OptimConfig.name (adamw-fused: torch's fused AdamW, for scale)
    "adamw (foreach)": "adamw",
    "adamw (fused)": "adamw-fused",
    "lamb": "lamb",
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny,small", help=f"comma-separated, from {', '.join(SHAPES)}")
    p.add_argument("--steps", type=int, default=10, help="timed steps per optimizer (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    return p.parse_args(argv)


def build(label: str, named_params) -> torch.optim.Optimizer:
    kind = OPTIMIZERS[label]
    if kind == "adamw-fused":  # not reachable from the config: the fused kernel is the lower bound
        cfg = optim.OptimConfig()
        return torch.optim.AdamW(optim.param_groups(named_params, cfg), lr=1e-3, betas=tuple(cfg.betas),
                                 eps=cfg.eps, weight_decay=cfg.weight_decay, fused=True)
    cfg = optim.OptimConfig(name=kind, trust_clamp=[0.01, 10.0] if kind == "lamb" else None)
    return optim.build_optimizer(named_params, cfg, lr=1e-3)


def time_steps(opt: torch.optim.Optimizer, steps: int, warmup: int) -> float:
    for _ in range(warmup):
        opt.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for name in args.models.split(","):
        torch.manual_seed(0)
        model = GPT(SHAPES[name])  # fp32 parameters
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        n_params = sum(p.numel() for p in model.parameters())
        n_tensors = len(list(model.parameters()))
        baseline = None
        for label in OPTIMIZERS:
            opt = build(label, model.named_parameters())
            seconds = time_steps(opt, args.steps, args.warmup)
            baseline = baseline or seconds
            rows.append((name, n_params, n_tensors, label, seconds, baseline))
            del opt
            gc.collect()
        del model
        gc.collect()

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.steps} steps "
          f"after {args.warmup} warm-up steps, fp32 params and grads\n")
    print("| model | params | tensors | optimizer | step ms | ns / param | vs adamw (foreach) |")
    print("|---|---:|---:|---|---:|---:|---:|")
    for name, n_params, n_tensors, label, seconds, baseline in rows:
        print(f"| {name} | {n_params / 1e6:.1f}M | {n_tensors} | {label} | {seconds * 1e3:.1f} | "
              f"{seconds / n_params * 1e9:.2f} | {seconds / baseline:.2f}x |")


if __name__ == "__main__":
    main()
