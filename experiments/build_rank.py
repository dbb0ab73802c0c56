"""Build one rank's share of a model for real, on this machine's CPU, as train.py does (meta
device, cut to the rank's pipeline chunks and TP slices, only those materialized and initialized,
then ZeRO's buffers and fp32 masters), and compare the process's peak RSS with the bytes the shard
should hold. No process group: a layout of any size is built for the rank asked.

    python experiments/build_rank.py [model=175B parallel=megascale_175B parallel.dp=4 precision=bf16 rank=0]

Prints the CPU, the shard's bytes (weights, fp32 masters), the peak RSS before and after, their
ratio, and the largest parameter (the one transient the build may hold on top).
"""
from __future__ import annotations

import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import config  # noqa: E402
import machine  # noqa: E402
import parallel  # noqa: E402
from model import GPT  # noqa: E402

DEFAULTS = ["model=175B", "parallel=megascale_175B", "parallel.dp=4", "precision=bf16", "train.seq_len=2048"]


def rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def layout_for(cfg, rank: int) -> parallel.Layout:
    """This rank's coordinates in the (dp, pp, tp) mesh of cfg.parallel.order, without a mesh."""
    p = cfg.parallel
    sizes = {"dp": p.dp, "pp": p.pp, "tp": p.tp}
    coords, rest = {}, rank
    for name in reversed(list(p.order)):
        coords[name], rest = rest % sizes[name], rest // sizes[name]
    return parallel.Layout(rank=rank, world=p.dp * p.pp * p.tp, dp=p.dp, pp=p.pp, tp=p.tp,
                           dp_rank=coords["dp"], pp_rank=coords["pp"], tp_rank=coords["tp"],
                           dp_shard=p.dp_shard if p.dp_shard > 0 else p.dp)


def main(argv: list) -> None:
    rank = int(next((a.split("=")[1] for a in argv if a.startswith("rank=")), 0))
    cfg = config.compose(DEFAULTS + [a for a in argv if not a.startswith("rank=")])
    layout = layout_for(cfg, rank)
    dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float32
    print(f"CPU: {machine.cpu_model()} | building rank {rank} of {layout.world}: {cfg.model.name} at tp{layout.tp} "
          f"pp{layout.pp} vpp{cfg.parallel.vpp} dp{layout.dp} zero{cfg.parallel.zero_stage}, {dtype}", flush=True)
    before = rss_gib()
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = GPT(cfg.model, cfg.kernels)
    engine = parallel.build(model, layout, cfg.parallel, recompute=cfg.train.recompute,
                            recompute_layers=cfg.train.recompute_layers, dtype=dtype,
                            device=torch.device("cpu"), seed=cfg.train.seed)
    seconds = time.perf_counter() - t0
    weights = sum(b.params.numel() * b.params.element_size() for b in engine.zero.buckets)
    masters = sum(b.master.numel() * 4 for b in engine.zero.buckets
                  if b.master is not None and b.master.untyped_storage().data_ptr() != b.params.untyped_storage().data_ptr())
    largest = max(p.numel() for p in engine.zero.params) * 4  # drawn slice by slice: at most this, usually a slice
    shard = (weights + masters) / 2**30
    peak = rss_gib()
    print(f"shard: {weights / 2**30:.2f} GiB weights + {masters / 2**30:.2f} GiB fp32 masters = {shard:.2f} GiB "
          f"({sum(p.numel() for p in engine.zero.params) / 1e9:.2f}e9 parameters)")
    print(f"peak RSS: {before:.2f} GiB before the build, {peak:.2f} GiB after ({seconds:.0f} s): "
          f"{peak / shard:.2f}x the shard, {(peak - before) / shard:.2f}x counting only the build; "
          f"largest parameter {largest / 2**30:.2f} GiB in fp32")


if __name__ == "__main__":
    main(sys.argv[1:])
