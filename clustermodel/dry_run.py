"""The dry run (`python train.py dry_run=true ...`): size, FLOPs and memory per GPU of any
config, with no hardware, from the performance model's memory and the rehearsals remembered."""
from __future__ import annotations

import torch

import config
from clustermodel import memory, perfmodel, rehearsal
from model import GPT, count_params, flops_per_token, matmul_params


def report(cfg: config.Config) -> None:
    """Size, FLOPs and memory per GPU of a config, with no hardware: the first and last pipeline
    rank's memory as rehearsed (rehearse.ranks=[...] measures it; remembered per config), else as
    clustermodel/memory.py models it (weights, gradients, optimizer and activations)."""
    with torch.device("meta"):
        model = GPT(cfg.model)
    n = count_params(model)
    p = cfg.parallel
    fpt = flops_per_token(cfg.model, cfg.train.seq_len)
    print(f"model {cfg.model.name}: {n:,} parameters ({n / 1e9:.2f}B), N (matmul) = {matmul_params(cfg.model):,}")
    print(f"FLOPs per token (6N + 12·L·h·T, T={cfg.train.seq_len}): {fpt:.4e}")
    print(f"FLOPs per step (batch {cfg.train.batch_size}): {fpt * cfg.train.batch_size * cfg.train.seq_len:.4e}")
    world = p.tp * p.pp * p.dp if p.dp > 0 else config.world_size()  # dp -1: derived from the world, as validate derives it
    lay = perfmodel.layout_of(cfg, world)
    measured = rehearsal.remembered(cfg, world)
    for last in (False, True):
        rank = lay.pp * lay.tp * lay.dp - 1 if last else 0
        if rank in measured:
            m, how = measured[rank]["memory"], f"rehearsed (rank {rank})"
            parts = {k: m[f"{k}_bytes"] / 2**30 for k in ("weights", "gradients", "optimizer")}
            parts["activations"] = (m["activations_bytes"] + m["communication_bytes"]) / 2**30
        else:
            mem = memory.memory_of_rank(cfg, lay, last)
            how = f"modelled (rehearse.ranks=[{','.join(map(str, sorted({0, world - 1})))}] measures it)"
            parts = {"weights": mem.weights, "gradients": mem.grads, "optimizer": mem.optimizer, "activations": mem.activations}
        split = ", ".join(f"{k} {v:,.1f}" for k, v in parts.items())
        print(f"{'last' if last else 'first'} pipeline rank at tp={p.tp} pp={p.pp} dp={lay.dp} zero={p.zero_stage}: "
              f"{sum(parts.values()):,.1f} GiB ({split}), {how}")
        if lay.pp == 1:
            break
