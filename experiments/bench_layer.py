"""One transformer layer's forward and backward at one TP rank's slice, timed on this device, as
TFLOP/s against the device's peak and against perfmodel's compute time for that layer.

    python experiments/bench_layer.py --device cuda                  # GPT-3 175B's TP8 slice, bf16
    python experiments/bench_layer.py --device cpu --d-model 256 --heads 8 --tp 2 --seq 128 --dtype fp32   # a smoke run (priced as on an H100)

The layer is model.Block with each parameter that tensor parallelism splits cut to rank 0's slice
(tensor_parallel.tp_shard_dim): the rank's four GEMMs, attention over its heads (kernels.attention=auto:
flash-attn where it runs, else SDPA) and the elementwise ops, without the collectives, which
perfmodel.layer_time prices apart. Its LayerNorms see the whole sequence, where sequence
parallelism gives each rank 1/tp of it (elementwise: a small overcount). FLOPs are MegaScale's
(the 6N + 12·L·h·T of model.flops_per_token, one layer's share, over tp): what the MFU counts.
Default: GPT-3 175B (d 12288, 96 heads of 128) at TP 8, sequence 2048, micro-batch 1, bf16, with
conf/model/175B.yaml's dropout, priced on conf/hardware/h100_cluster.yaml.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import config  # noqa: E402
from clustermodel import perfmodel as pm  # noqa: E402
from model import Block  # noqa: E402
from parallelisms.tensor_parallel import tp_shard_dim  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def layer_config(args):
    return config.compose(["model=175B", f"model.d_model={args.d_model}", f"model.n_heads={args.heads}",
                           f"model.max_seq_len={args.seq}", f"train.seq_len={args.seq}", f"parallel.tp={args.tp}",
                           "parallel.pp=1", f"train.batch_size={args.micro_batch}", "parallel.microbatches=1",
                           f"precision={args.dtype}", f"hardware={args.hardware}"])


def sliced_block(cfg, tp: int, dtype: torch.dtype, device) -> Block:
    """model.Block holding rank 0's TP slice of each split parameter: cut on the meta device, then
    made on `device` in `dtype` (random weights: the values do not change the time)."""
    with torch.device("meta"):
        block = Block(cfg.model, cfg.kernels)
    for name, module in list(block.named_modules()):
        for pname in ("weight", "bias"):
            dim = tp_shard_dim(f"blocks.0.{name}.{pname}")  # (the plan names a block's modules inside the GPT)
            if dim is not None and getattr(module, pname, None) is not None:
                setattr(module, pname, torch.nn.Parameter(getattr(module, pname).detach().chunk(tp, dim)[0].clone()))
    block = block.to(dtype).to_empty(device=device).train()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02)
    return block


def timed(fn, device, reps: int, warmup: int) -> list:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        out.append(time.perf_counter() - start)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=12288)
    p.add_argument("--heads", type=int, default=96)
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    p.add_argument("--hardware", default="h100_cluster", help="conf/hardware/ entry perfmodel prices the layer on")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    cfg = layer_config(args)
    torch.manual_seed(0)
    block = sliced_block(cfg, args.tp, dtype, device)
    x = torch.randn(args.micro_batch, args.seq, args.d_model, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)

    def forward_backward():
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            y = block(x)
        y.backward(grad)
        block.zero_grad(set_to_none=True)
        x.grad = None
    seconds = statistics.median(timed(forward_backward, device, args.reps, args.warmup))

    lay = pm.layout_of(cfg, args.tp)
    hw = pm.resolve_hardware(cfg.hardware)
    priced = pm.resolve_config(cfg, hw)
    rates, net = pm.Rates.of(hw, pm.precision(priced), lay.gpus), pm.Network(hw, lay)
    fwd, bwd, _ = pm.layer_time(priced, lay, rates, net)
    compute = ("gemm", "attention", "elementwise")
    predicted = sum(part.get(k, 0.0) for part in (fwd, bwd) for k in compute)
    h, M = args.d_model, args.micro_batch * args.seq
    flops = (6 * 12 * h * h + 12 * h * args.seq) * M / args.tp  # MegaScale's per-token count, one layer, one rank
    peak = hw.peak_tflops if dtype == torch.bfloat16 else hw.peak_tflops_fp32
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{name} | torch {torch.__version__} | {args.dtype} | d {h}, {args.heads} heads, tp {args.tp} "
          f"({args.heads // args.tp} heads a rank), seq {args.seq}, micro-batch {args.micro_batch}, attention "
          f"{cfg.kernels.attention}, dropout {cfg.model.dropout} | priced on {hw.name} (peak {peak:g} TFLOP/s)\n")
    print("| measured ms | TFLOP/s | of peak | perfmodel compute ms (gemm / attention / elementwise) | perfmodel / measured |")
    print("|---:|---:|---:|---|---:|")
    split = " / ".join(f"{sum(part.get(k, 0.0) for part in (fwd, bwd)) * 1e3:.2f}" for k in compute)
    print(f"| {seconds * 1e3:.2f} | {flops / seconds / 1e12:.0f} | {flops / seconds / 1e12 / peak:.0%} | "
          f"{predicted * 1e3:.2f} ({split}) | {predicted / seconds:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
