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

# The published layout (Table 4) and what the paper says of it (section 3.3.2): FSDP not resharded
# after forward under the pipeline, an interleaved schedule whose first chunk holds the embedding
# alone and last chunk the head alone (126 blocks: every other chunk one, at vpp 8), DP and PP
# communication overlapped, flash attention.
LAYOUT = ["model=llama3_405B", "hardware=h100_llama3", "precision=bf16", "train.seq_len=8192", "train.batch_size=2048",
          "parallel.tp=8", "parallel.pp=16", "kernels.attention=flash", "kernels.fused=true",
          "parallel.overlap.dp=true", "parallel.overlap.pp=true", "parallel.reduce_dtype=fp32", "optim.name=adamw"]
INTERLEAVED = ["parallel.vpp=8", "parallel.pp_first_chunk_layers=0", "parallel.pp_last_chunk_layers=0"]
PLAIN = ["parallel.vpp=1", "parallel.pp_first_chunk_layers=7", "parallel.pp_last_chunk_layers=7"]
KEPT = ["parallel.zero_stage=3", "parallel.reshard_after_forward=false"]
FULL = ["train.recompute=full"]
# (name, overrides): Meta's reading first; then what fits (the paper does not say what it
# recomputed); resharding; hybrid sharding within 8 and 64 DP ranks; the plain 1F1B reading
# (first and last stage 7 blocks) with the least recomputation that fits its first rank.
SETTINGS = [
    ("ZeRO-3, kept, vpp 8 (Meta's)", KEPT + INTERLEAVED),
    ("ZeRO-3, kept, vpp 8, full recomputation", KEPT + INTERLEAVED + FULL),
    ("ZeRO-3, resharded, vpp 8, full recomputation", ["parallel.zero_stage=3"] + INTERLEAVED + FULL),
    ("hybrid, shard 8, kept, vpp 8, full recomputation", KEPT + ["parallel.dp_shard=8"] + INTERLEAVED + FULL),
    ("hybrid, shard 64, kept, vpp 8, full recomputation", KEPT + ["parallel.dp_shard=64"] + INTERLEAVED + FULL),
    ("ZeRO-3, kept, vpp 1, 5 of 7-8 layers recomputed", KEPT + PLAIN + FULL + ["train.recompute_layers=5"]),
    ("ZeRO-1, vpp 8, full recomputation (for comparison)", ["parallel.zero_stage=1"] + INTERLEAVED + FULL),
]


def jobs() -> list:
    """(GPUs, name, overrides) of every setting on 8,192 and 16,384 GPUs; shard 64 is all of DP on
    8,192, so not repeated there."""
    return [(gpus, name, LAYOUT + overrides + [f"parallel.dp={gpus // 128}", f"parallel.microbatches={2048 * 128 // gpus}"])
            for gpus in (8192, 16384) for name, overrides in SETTINGS if not ("shard 64" in name and gpus == 8192)]


def row(gpus: int, name: str, overrides: list) -> list:
    cfg = cli.compose(overrides)
    pred = pm.predict(cfg, gpus)
    hw = pm.resolve_hardware(cfg.hardware)
    capacity = machine.tensor_memory_gib(hw)
    cfg = pm.resolve_config(cfg, hw)
    first, last = (memory.memory_of_rank(cfg, pred.layout, end, capacity) for end in (False, True))
    fits = lambda m: f"{m.total:.1f}" + ("" if m.fits else " (over)")
    return [gpus, name, cli.seconds(pred.step_s), cli.pct(pred.mfu), cli.seconds(pred.breakdown.get("param_gather", 0.0)),
            cli.seconds(pred.breakdown["dp_comm"]), cli.seconds(pred.breakdown["bubble"]), fits(first), fits(last)]


def main() -> int:
    rows = [row(*job) for job in jobs()]
    print(markdown_table(["GPUs", "setting", "step time", "MFU", "exposed param gather", "exposed DP", "bubble",
                          "rank 0 GiB", "last rank GiB"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
