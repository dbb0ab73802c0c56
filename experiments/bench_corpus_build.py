"""The corpus build's throughput (python -m corpus build): tokens/s at 1 and 2 worker processes.

    python experiments/bench_corpus_build.py                 # 1 GiB of JSON lines, the 4096-token BPE
    python experiments/bench_corpus_build.py --quick         # 4 MiB: checks that the script runs
    python experiments/bench_corpus_build.py --gib 4 --workers 1,2,4,8 --tokenizer gpt2

The corpus is synthetic but real text: the standard library's source, repeated into JSON-lines
files of one document per stdlib file, so it needs no network and any machine makes the same one.
The BPE (data.tokenizer=bpe) is trained once, on data.bpe_sample_bytes of it, and timed apart;
each build then reuses it, so the table times reading, tokenizing and writing shards only, from a
cold cache folder each time (the source files stay in the page cache: the first build reads them
once untimed). Prints the CPU and whether it does bf16 natively, as the other bench_* scripts,
then a Markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the flat repo root
import machine  # noqa: E402
from corpus import build, sources  # noqa: E402
from data import DataConfig  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="corpus size in GiB (default 1)")
    p.add_argument("--quick", action="store_true", help="a 4 MiB corpus: that the script runs, not a measurement")
    p.add_argument("--workers", default="1,2", help="comma-separated worker counts")
    p.add_argument("--tokenizer", default="bpe", help="bpe (trained once, 4096 tokens), bytes, or a HF name")
    p.add_argument("--bpe-sample-mib", type=float, default=100.0, help="the BPE's training sample")
    p.add_argument("--files", type=int, default=32, help="source files (build units of data.shard_bytes each)")
    p.add_argument("--dir", default=None, help="where the corpus and builds go (default: a temporary folder)")
    return p.parse_args(argv)


def write_corpus(folder: Path, total_bytes: int, files: int) -> int:
    """JSON-lines files of stdlib sources, round-robin, up to total_bytes of text; returns the bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    _, paths = sources.stdlib_files()
    texts = [p.read_text(errors="replace") for p in paths[:2000]]
    per_file, written = total_bytes // files, 0
    i = 0
    for k in range(files):
        size = 0
        with open(folder / f"part{k:04d}.jsonl", "w") as f:
            while size < per_file:
                text = texts[i % len(texts)]
                i += 1
                f.write(json.dumps({"text": text}) + "\n")
                size += len(text)
        written += size
    return written


def main(argv=None) -> None:
    args = parse_args(argv)
    total = 4 << 20 if args.quick else int(args.gib * (1 << 30))
    files = 4 if args.quick else args.files
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-corpus-"))
    src = root / "source"
    text_bytes = write_corpus(src, total, files)
    shard_bytes = max(1 << 20, total // files)
    base = dict(source=str(src), tokenizer=args.tokenizer, bpe_vocab_size=4096,
                bpe_sample_bytes=int(args.bpe_sample_mib * (1 << 20)), shard_bytes=shard_bytes)
    print(f"{machine.cpu_model()} | {len(os.sched_getaffinity(0))} cores | native bf16: {machine.native_bf16()} | "
          f"corpus: {text_bytes / 2**20:,.1f} MiB of text in {files} JSON-lines files (stdlib source) | "
          f"tokenizer {args.tokenizer}\n")
    trained = root / "tokenizer"
    bpe_s = 0.0
    if args.tokenizer == "bpe":  # trained once (timed apart), then copied into each build's folder
        cfg = DataConfig(**base, cache_dir=str(trained))
        plan = sources.plan(cfg)
        folder = build.directory(cfg)
        folder.mkdir(parents=True)
        started = time.perf_counter()
        build._tokenizer_spec(cfg, plan, plan.units(), folder)
        bpe_s = time.perf_counter() - started
        print(f"BPE: trained on {min(text_bytes, base['bpe_sample_bytes']) / 2**20:,.1f} MiB in {bpe_s:.1f} s\n")
    for path in src.iterdir():  # into the page cache, so no build pays the first read
        path.read_bytes()
    print("| workers | tokens | build s | tokens/s | MiB/s of text | shards |")
    print("|---|---|---|---|---|---|")
    for workers in (int(w) for w in args.workers.split(",")):
        cfg = DataConfig(**base, cache_dir=str(root / f"w{workers}"))
        folder = build.directory(cfg)
        folder.mkdir(parents=True)
        if args.tokenizer == "bpe":
            shutil.copy(build.directory(DataConfig(**base, cache_dir=str(trained))) / "tokenizer.json", folder)
        started = time.perf_counter()
        manifest = build.build(cfg, workers=workers)
        seconds = time.perf_counter() - started
        print(f"| {workers} | {manifest['tokens']:,} | {seconds:.1f} | {manifest['tokens'] / seconds:,.0f} | "
              f"{text_bytes / 2**20 / seconds:,.1f} | {len(manifest['shards'])} |", flush=True)
        shutil.rmtree(root / f"w{workers}")
    if not args.dir:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
