"""Llama 3 405B at Meta's published layouts (Dubey et al. 2024, arXiv 2407.21783, Table 4: TP8 PP16,
DP64 on 8,192 H100s and DP128 on 16,384, seq 8192, 2,048 sequences a step), priced on
conf/hardware/h100_llama3.yaml under each way the code can run its FSDP: step time, MFU, and the
memory of pipeline rank 0 and of the last rank, each against the GPU's tensor memory (80 GB less
memory_headroom_gib).

    python experiments/predict_llama3_405b.py          # the Markdown table (~10 s)
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import machine  # noqa: E402
from clustermodel import cli  # noqa: E402
from clustermodel import memory  # noqa: E402
from clustermodel import perfmodel as pm  # noqa: E402
from metrics import markdown_table  # noqa: E402

LAYOUT = ["model=llama3_405B", "hardware=h100_llama3", "precision=bf16", "train.seq_len=8192", "train.batch_size=2048",
          "parallel.tp=8", "parallel.pp=16", "kernels.attention=flash", "kernels.fused=true",
          "parallel.overlap.dp=true", "parallel.overlap.pp=true", "parallel.reduce_dtype=fp32"]
# (name, overrides): the validation row's reading of Meta's FSDP (one gather a step: the code's ZeRO-2),
# the code's ZeRO-3 without and with resharding, at interleaving 8 with 0-layer end chunks, and
# without interleaving (the first and last stage 7 blocks).
INTERLEAVED = ["parallel.vpp=8", "parallel.pp_first_chunk_layers=0", "parallel.pp_last_chunk_layers=0"]
PLAIN = ["parallel.vpp=1", "parallel.pp_first_chunk_layers=7", "parallel.pp_last_chunk_layers=7"]
SETTINGS = [
    ("ZeRO-2 (FSDP kept through the step), vpp 8", ["parallel.zero_stage=2", *INTERLEAVED]),
    ("ZeRO-3 reshard_after_forward=false, vpp 8", ["parallel.zero_stage=3", "parallel.reshard_after_forward=false", *INTERLEAVED]),
    ("ZeRO-3 resharding, vpp 8", ["parallel.zero_stage=3", *INTERLEAVED]),
    ("ZeRO-2 (FSDP kept through the step), vpp 1", ["parallel.zero_stage=2", *PLAIN]),
    ("ZeRO-3 reshard_after_forward=false, vpp 1", ["parallel.zero_stage=3", "parallel.reshard_after_forward=false", *PLAIN]),
    ("ZeRO-2 (FSDP kept through the step), vpp 8, selective recomputation", ["parallel.zero_stage=2", "train.recompute=selective", *INTERLEAVED]),
    ("ZeRO-2 (FSDP kept through the step), vpp 8, full recomputation", ["parallel.zero_stage=2", "train.recompute=full", *INTERLEAVED]),
]


def row(name: str, overrides: list, gpus: int) -> list:
    dp = gpus // 128
    cfg = cli.compose(LAYOUT + overrides + [f"parallel.dp={dp}", f"parallel.microbatches={2048 // dp}"])
    pred = pm.predict(cfg, gpus)
    hw = pm.resolve_hardware(cfg.hardware)
    capacity = machine.tensor_memory_gib(hw)
    cfg = pm.resolve_config(cfg, hw)
    first, last = (memory.memory_of_rank(cfg, pred.layout, end, capacity) for end in (False, True))
    fits = lambda m: f"{m.total:.1f}" + ("" if m.fits else " (over)")
    return [gpus, name, cli.seconds(pred.step_s), cli.pct(pred.mfu), cli.seconds(pred.breakdown.get("param_gather", 0.0)),
            cli.seconds(pred.breakdown["dp_comm"]), cli.seconds(pred.breakdown["bubble"]), fits(first), fits(last)]


def main() -> int:
    rows = [row(name, overrides, gpus) for gpus in (8192, 16384) for name, overrides in SETTINGS]
    print(markdown_table(["GPUs", "setting", "step time", "MFU", "exposed param gather", "exposed DP", "bubble",
                          "rank 0 GiB", "last rank GiB"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
