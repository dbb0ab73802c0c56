"""The build: a corpus tokenized once, offline, into shards a job memory-maps.

    python -m corpus build [data.* overrides] [--workers N] [--shard i/n] [--merge]

The data.* keys are train.py's (composed with Hydra the same way), so a build and the job that
trains on it name the same corpus with the same overrides. The built corpus is a folder under the
data cache named by those keys alone, so a rank finds it with no look at the source:

    <cache>/corpus/<source>-<tokenizer>-<key>/
        source.json                  what its files were made from (names, sizes, mtimes; hub name, revision)
        tokenizer.json               the BPE, trained on a sample (data.bpe_sample_bytes) of the corpus
        shard_00000_000.{bin,idx}    unit 0's tokens (corpus/indexed.py), split at data.shard_bytes
        unit_00000.json              unit 0 done: its shards' counts and checksums
        manifest.json                the whole corpus, complete; written last

Units (corpus/sources.py) are built in order, each by the build job that owns it (all of them,
or every n-th with --shard i/n) and each a few shards. A killed build keeps its finished units
and redoes the rest. Tokenizing runs on --workers processes over batches of documents, their
results taken back in order, so the bytes do not depend on the workers; at most 2 x workers
batches are in flight, so memory does not grow with the corpus.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import shlex
import time
from collections import deque
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

import numpy as np

from errors import ConfigError

from . import indexed, sources, tokenizer as tokenizers

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
MANIFEST = "manifest.json"
# The data.* keys that determine a build's bytes; they name its folder. (val_fraction, prefetch
# and pipeline are the job's: one build serves every split and loader.)
BUILD_KEYS = ("source", "format", "text_field", "subset", "split", "revision", "tokenizer", "bpe_vocab_size",
              "bpe_sample_bytes", "max_bytes", "shard_bytes")
BATCH_CHARS = 1 << 22  # characters of documents per tokenizer batch


def cache_root(cfg) -> Path:
    root = cfg.cache_dir or os.environ.get("MEGAREPRO_CACHE") or "~/.cache/megarepro"
    return Path(root).expanduser()


def build_key(cfg) -> dict:
    key = {k: getattr(cfg, k) for k in BUILD_KEYS}
    if sources.source_kind(cfg.source) == "local":  # the same files, named from any working dir
        key["source"] = os.path.abspath(os.path.expanduser(cfg.source))
    return {"version": FORMAT_VERSION, **key}


def directory(cfg) -> Path:
    """The built corpus's folder: from the config alone, no file-system call but one stat."""
    key = hashlib.sha256(json.dumps(build_key(cfg), sort_keys=True).encode()).hexdigest()
    tok = cfg.tokenizer if cfg.tokenizer in ("bytes", "bpe") else Path(cfg.tokenizer).name
    name = re.sub(r"[^\w.-]+", "_", f"{Path(cfg.source).name}-{tok}")[:48]
    return cache_root(cfg) / "corpus" / f"{name}-{key[:16]}"


def command(cfg, defaults=None) -> str:
    """The build command for cfg: its build keys that differ from the defaults."""
    defaults = type(cfg)() if defaults is None else defaults  # the schema's (data.DataConfig's) defaults
    args = [f"data.{k}={'null' if getattr(cfg, k) is None else getattr(cfg, k)}"
            for k in BUILD_KEYS + ("cache_dir",) if getattr(cfg, k) != getattr(defaults, k)]
    return " ".join(["python -m corpus build"] + [shlex.quote(a) for a in args])


def read_manifest(folder: Path, cfg=None) -> Optional[dict]:
    """The complete manifest, None where there is none; a ConfigError (one line naming the file
    and the fix) where it is unreadable or not complete."""
    path = Path(folder) / MANIFEST
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    fix = f"rebuild it: {command(cfg)}" if cfg is not None else "rebuild the corpus (python -m corpus build)"
    try:
        manifest = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError("data.source", f"the corpus manifest {path} is unreadable ({err.msg if hasattr(err, 'msg') else err}: "
                          f"truncated or damaged)", fix) from None
    if not isinstance(manifest, dict) or manifest.get("complete") is not True or "shards" not in manifest:
        raise ConfigError("data.source", f"the corpus manifest {path} is not a complete build's", fix)
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ConfigError("data.source", f"the corpus in {folder} has format {manifest.get('format_version')}, "
                          f"this code reads {FORMAT_VERSION}", fix)
    return manifest


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _write_json(path: Path, obj) -> None:
    _write_atomic(path, json.dumps(obj, indent=1).encode())


def _read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


@contextmanager
def locked(path: Path):
    """An exclusive flock on path: held until released, dropped by the kernel if the process dies,
    honoured across hosts on NFSv4 and Lustre, where a SLURM array's jobs share the cache."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# --- Tokenizing on worker processes, in order ---

_worker_tokenizer = None


def _start_worker(spec: dict, folder: str) -> None:
    global _worker_tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: the workers are the parallelism
    _worker_tokenizer = tokenizers.load(spec, Path(folder))


def _encode_in_worker(texts: list) -> tuple:
    return tokenizers.encode(_worker_tokenizer, texts)


def encoded(batches: Iterable[list], spec: dict, folder: Path, workers: int) -> Iterator[tuple]:
    """encode() of each batch, in the batches' order, on `workers` processes (this one if 1)."""
    if workers <= 1:
        tok = tokenizers.load(spec, folder)
        for batch in batches:
            yield tokenizers.encode(tok, batch)
        return
    import multiprocessing
    with multiprocessing.get_context("fork").Pool(workers, _start_worker, (spec, str(folder))) as pool:
        pending = deque()
        for batch in batches:
            pending.append(pool.apply_async(_encode_in_worker, (batch,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def batches(documents: Iterable[str], max_chars: int = BATCH_CHARS) -> Iterator[list]:
    batch, size = [], 0
    for text in documents:
        batch.append(text)
        size += len(text)
        if size >= max_chars or len(batch) >= 4096:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


# --- The build ---

def _prepare_folder(folder: Path, plan: sources.Plan) -> None:
    """Under the folder's lock: a folder built from another state of the source is emptied."""
    recorded = _read_json(folder / "source.json")
    if recorded is not None and recorded != plan.identity:
        log.info("corpus: the source changed since %s was built: rebuilding it", folder)
        for path in folder.iterdir():
            if path.name != "build.lock":
                path.unlink()
    if recorded != plan.identity:
        _write_json(folder / "source.json", plan.identity)


def _tokenizer_spec(cfg, plan: sources.Plan, units: list, folder: Path) -> dict:
    """The tokenizer's identity; a BPE is trained here, once, on a sample of every unit."""
    spec = tokenizers.identity(cfg)
    if spec["kind"] == "bpe" and not (folder / "tokenizer.json").exists():
        quota = max(1, cfg.bpe_sample_bytes // len(units))
        log.info("corpus: training a %d-token byte-level BPE on up to %d bytes of %s", cfg.bpe_vocab_size,
                 cfg.bpe_sample_bytes, cfg.source)
        bpe = tokenizers.BPETokenizer.train(_sample(cfg, plan, units, quota), cfg.bpe_vocab_size)
        _write_atomic(folder / "tokenizer.json", bpe.tok.to_str().encode())
    tok = tokenizers.load(spec, folder)
    return {**spec, "vocab_size": tok.vocab_size, "eot_id": int(tok.eot_id)}


def _sample(cfg, plan: sources.Plan, units: list, quota: int) -> Iterator[str]:
    """The head of each unit, up to quota UTF-8 bytes of it: a sample spread over the corpus."""
    for unit in units:
        yield from sources.capped(sources.documents(cfg, plan, unit), quota)


def build_unit(cfg, plan: sources.Plan, index: int, unit: sources.Unit, spec: dict, folder: Path, workers: int,
               on_batch: Callable[[int, int], None] = lambda tokens, text_bytes: None) -> dict:
    """Tokenize one unit into shards of at most data.shard_bytes, then write its record."""
    counts: dict = {}
    shards, writer, piece = [], None, 0
    totals = {"documents": 0, "tokens": 0, "text_bytes": 0}
    docs = sources.documents(cfg, plan, unit, counts)
    try:
        for tokens, lengths, text_bytes in encoded(batches(docs), spec, folder, workers):
            ends, first = np.cumsum(lengths), 0
            while first < len(lengths):  # whole documents, a new shard where the next would overflow
                if writer is None:
                    writer = indexed.ShardWriter(folder / f"shard_{index:05d}_{piece:03d}", spec["vocab_size"])
                base = int(ends[first - 1]) if first else 0
                room = (cfg.shard_bytes - writer.nbytes) // writer.dtype.itemsize
                last = int(np.searchsorted(ends, base + room, side="right"))
                if last == first and writer.tokens:  # the next document starts the next shard
                    shards.append(writer.finish())
                    writer, piece = None, piece + 1
                    continue
                last = max(last, first + 1)  # a document larger than a shard is a shard alone
                writer.add(tokens[base: ends[last - 1]], lengths[first: last])
                first = last
                if writer.nbytes >= cfg.shard_bytes:
                    shards.append(writer.finish())
                    writer, piece = None, piece + 1
            totals["documents"] += len(lengths)
            totals["tokens"] += len(tokens)
            totals["text_bytes"] += text_bytes
            on_batch(len(tokens), text_bytes)
        if writer is not None:
            shards.append(writer.finish())
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    record = {"unit": index, "source": plan.identity, "shards": shards, **totals,
              **({"source_bytes": counts["source_bytes"], "content_sha256": counts["content_sha256"]}
                 if "source_bytes" in counts else {})}
    _write_json(folder / f"unit_{index:05d}.json", record)
    return record


def _unit_record(folder: Path, index: int, plan: sources.Plan) -> Optional[dict]:
    record = _read_json(folder / f"unit_{index:05d}.json")
    return record if record is not None and record.get("source") == plan.identity else None


def build(cfg, workers: int = 1, shard: Optional[tuple] = None, progress: bool = False) -> Optional[dict]:
    """Build cfg's corpus (its units `shard` = (i, n) owns: every n-th from the i-th), then, if
    this job built all of it, its manifest. Returns the manifest, or None for one --shard job."""
    folder = directory(cfg)
    folder.mkdir(parents=True, exist_ok=True)
    plan = sources.plan(cfg)
    try:
        existing = read_manifest(folder, cfg)
    except ConfigError:  # a damaged manifest: this build writes it again
        existing = None
    if existing is not None and existing["source"] == plan.identity:
        log.info("corpus: %s is built already", folder)
        return existing
    units = plan.units()
    if shard is not None and shard[1] > 1 and cfg.max_bytes is not None:
        raise ConfigError("data.max_bytes", "a capped corpus is one stream, built by one job",
                          "build it without --shard, or without data.max_bytes")
    with locked(folder / "build.lock"):
        _prepare_folder(folder, plan)
        spec = _tokenizer_spec(cfg, plan, units, folder)
    mine = [k for k in range(len(units)) if shard is None or k % shard[1] == shard[0]]
    todo = [k for k in mine if _unit_record(folder, k, plan) is None]
    bar = Progress(sum(units[k].size for k in todo), len(mine) - len(todo), len(mine), progress)
    for k in todo:
        build_unit(cfg, plan, k, units[k], spec, folder, workers, bar.batch)
        bar.unit_done(units[k].size)
    bar.close()
    if shard is not None and shard[1] > 1:
        log.info("corpus: units %s of %d built in %s; `--merge` writes the manifest once all are", mine[:3] +
                 (["..."] if len(mine) > 3 else []), len(units), folder)
        return None
    return merge(cfg, plan, units, spec)


def merge(cfg, plan: Optional[sources.Plan] = None, units: Optional[list] = None, spec: Optional[dict] = None) -> dict:
    """The manifest, from every unit's record: written last, so its presence means complete."""
    folder = directory(cfg)
    plan = plan or sources.plan(cfg)
    units = units if units is not None else plan.units()
    if spec is None:
        if _read_json(folder / "source.json") != plan.identity:
            raise ConfigError("data.source", f"{folder} holds no build of this source as it is now",
                              f"build it first: {command(cfg)} --shard i/n for each i")
        spec = _tokenizer_spec(cfg, plan, units, folder)
    records = [_unit_record(folder, k, plan) for k in range(len(units))]
    missing = [k for k, r in enumerate(records) if r is None]
    if missing:
        raise ConfigError("data.source", f"{len(missing)} of the {len(units)} units of {folder} are not built "
                          f"(unit {missing[0]} first)", f"run the build jobs that own them: {command(cfg)} --shard i/n")
    shards = [s for r in records for s in r["shards"]]
    totals = {k: sum(r[k] for r in records) for k in ("documents", "tokens", "text_bytes")}
    if totals["documents"] == 0:
        raise ConfigError("data.source", f"{cfg.source!r} contains no text", "point data.source at a non-empty corpus")
    meta = dict(plan.meta)
    if plan.kind == "stdlib":  # a sha256 of the bytes read (one unit), or of the units' sha256s
        hashes = [r["content_sha256"] for r in records]
        meta.update(files=totals["documents"], bytes=sum(r["source_bytes"] for r in records),
                    content_hash=hashes[0] if len(hashes) == 1 else hashlib.sha256("".join(hashes).encode()).hexdigest())
    manifest = {"format_version": FORMAT_VERSION, "build": build_key(cfg), "source": plan.identity, "meta": meta,
                "tokenizer": {k: v for k, v in spec.items() if k not in ("vocab_size", "eot_id")},
                "vocab_size": spec["vocab_size"], "eot_id": spec["eot_id"],
                "dtype": indexed.dtype_for(spec["vocab_size"]).name,
                "max_id": max((s["max_id"] for s in shards), default=0), **totals,
                "shards": shards, "command": command(cfg), "complete": True}
    _write_json(folder / MANIFEST, manifest)
    log.info("corpus: %d documents, %d tokens (%.2f bytes/token) in %d shards: %s", totals["documents"],
             totals["tokens"], totals["text_bytes"] / max(1, totals["tokens"]), len(shards), folder)
    return manifest


class Progress:
    """tqdm over the source bytes to tokenize, with tokens/s; silent without a terminal."""

    def __init__(self, total_bytes: int, done_units: int, units: int, enabled: bool):
        self.bar, self.started, self.tokens = None, time.perf_counter(), 0
        if enabled:
            from tqdm import tqdm
            self.bar = tqdm(total=total_bytes or None, unit="B", unit_scale=True, desc=f"build ({done_units}/{units} units done)",
                            dynamic_ncols=True)
        self._unit_bytes, self.units, self.done = 0, units, done_units

    def batch(self, tokens: int, text_bytes: int) -> None:
        self.tokens += tokens
        if self.bar is not None:
            self.bar.update(text_bytes)
            self._unit_bytes += text_bytes
            self.bar.set_postfix(tok_s=f"{self.tokens / max(1e-9, time.perf_counter() - self.started):,.0f}", refresh=False)

    def unit_done(self, size: int) -> None:
        self.done += 1
        if self.bar is not None:  # the unit's source bytes, exactly (its text bytes differ: markup, compression)
            self.bar.update(max(0, size - self._unit_bytes))
            self._unit_bytes = 0
            self.bar.set_description(f"build ({self.done}/{self.units} units done)")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
