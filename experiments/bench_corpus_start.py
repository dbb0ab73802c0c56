"""A job's start on a corpus of many shards: each rank's file-system calls and its time to open the
corpus, then a real 2-rank job's time to its first step, on 1 shard against 1,000.

    python experiments/bench_corpus_start.py                  # 1,000 shards; worlds 2 and 12,288
    python experiments/bench_corpus_start.py --shards 100 --launches 1

A rank of a W-rank job checks the build (the manifest), opens the corpus (an open and an fstat per
shard, which it memory-maps) and verifies every W-th shard's checksum on the first start (a marker
per shard after it, so a later start reads none). The calls are counted as tests/test_data.py
counts them (an audit hook on open, os.stat and os.fstat wrapped) and set beside
clustermodel/rank_costs.corpus_start_fs_calls. The corpus is small documents of the standard
library's text (JSON lines) in bytes tokens, cut into shards of data.shard_bytes.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import data  # noqa: E402
import machine  # noqa: E402
from clustermodel import rank_costs  # noqa: E402

calls: list = []
counting = False


def count_calls() -> None:
    """Record every open, stat and fstat while `counting`."""
    for name in ("stat", "fstat"):
        real = getattr(os, name)
        setattr(os, name, lambda *a, _real=real, _name=name, **k: (
            calls.append((_name, a[0])) if counting else None) or _real(*a, **k))
    sys.addaudithook(lambda event, args: calls.append(("open", args[0])) if event == "open" and counting else None)


def open_as_rank(cfg, rank: int, world: int) -> tuple[int, float]:
    """(file-system calls, seconds) of one rank's corpus start in a world-rank job."""
    global counting
    calls.clear()
    counting, start = True, time.perf_counter()
    assert data.build_problem(cfg, world, cfg_vocab(cfg)) is None
    data.check_config(cfg, world)
    data.prepare(cfg, seq_len=256, world=world).verify(rank, world)
    seconds, counting = time.perf_counter() - start, False
    return len(calls), seconds


def write_documents(path: Path, count: int) -> Path:
    """count JSON-lines documents of ~1.5 KB of the standard library's text each (a shard ends at a
    document's end, so small documents let a corpus of a few MB make a thousand shards)."""
    import sysconfig
    text = Path(sysconfig.get_paths()["stdlib"], "argparse.py").read_text()
    with path.open("w") as f:
        for i in range(count):
            start = (i * 1499) % (len(text) - 1500)
            f.write(json.dumps({"text": text[start:start + 1500]}) + "\n")
    return path


def cfg_vocab(cfg) -> int:
    return 257 if cfg.tokenizer == "bytes" else cfg.bpe_vocab_size


def first_step_seconds(cache: Path, cfg, run_dir: Path) -> float:
    """A 2-rank torchrun of the tiny model on the built corpus: launch to step 1's metrics line."""
    args = ["model=tiny", "data.tokenizer=bytes", "model.vocab_size=257", f"data.shard_bytes={cfg.shard_bytes}",
            f"data.source={cfg.source}",
            "train.max_steps=1", "train.eval_interval=0", "train.seq_len=256", "train.batch_size=8",
            "logging.wandb.mode=disabled", "logging.progress=false", "checkpoint.interval=0",
            f"checkpoint.dir={run_dir}/ckpt", f"hydra.run.dir={run_dir}"]
    env = dict(os.environ, MEGAREPRO_CACHE=str(cache), OMP_NUM_THREADS="1", HF_DATASETS_OFFLINE="1")
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
                    *args], cwd=ROOT, env=env, check=True, capture_output=True, timeout=600)
    assert json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", type=int, default=1000)
    p.add_argument("--worlds", default="2,12288")
    p.add_argument("--launches", type=int, default=3, help="2-rank jobs per corpus, for the median time to step 1")
    args = p.parse_args()
    print(f"{machine.cpu_model()} | {len(os.sched_getaffinity(0))} cores | native bf16: {machine.native_bf16()}")
    cache = Path(tempfile.mkdtemp(prefix="corpus-start-"))
    source = write_documents(cache / "docs.jsonl", args.shards * 20)
    base = data.DataConfig(source=str(source), tokenizer="bytes", cache_dir=str(cache))
    one = data.prepare(base, seq_len=256)
    token_bytes = one.meta["tokens"] * np.dtype(one.manifest["dtype"]).itemsize
    many_cfg = data.DataConfig(**{**base.__dict__, "shard_bytes": max(1, token_bytes // args.shards)})
    many = data.prepare(many_cfg, seq_len=256)
    shards = many.meta["shards"]
    print(f"corpus: {one.meta['tokens']:,} tokens; 1 shard, and {shards} shards of {many_cfg.shard_bytes:,} bytes")
    count_calls()
    print("\n| world | rank | start | fs calls | rank_costs | seconds |\n|---|---|---|---|---|---|")
    for world in (int(w) for w in args.worlds.split(",")):
        for rank in (0, world - 1):
            for start in ("first", "later"):  # the first verifies the rank's shards; later ones find markers
                n, seconds = open_as_rank(many_cfg, rank, world)
                print(f"| {world:,} | {rank:,} | {start} | {n:,} | {rank_costs.corpus_start_fs_calls(shards, rank, world):,} "
                      f"| {seconds:.3f} |")
    print("\n| corpus | 2-rank launch to step 1, s (median of runs) |\n|---|---|")
    for label, cfg in (("1 shard", base), (f"{shards} shards", many_cfg)):
        times = [first_step_seconds(cache, cfg, cache / f"run-{label.split()[0]}-{i}") for i in range(args.launches)]
        print(f"| {label} | {statistics.median(times):.2f} ({', '.join(f'{t:.2f}' for t in times)}) |")


if __name__ == "__main__":
    main()
