"""Data: the job's side of the corpus. It is built offline (corpus/, `python -m corpus build`) into
shards this module memory-maps; sampling.py decides which sequences each rank reads.

The pipeline, top to bottom:
1. Source. `stdlib` (the running Python's standard-library source: on every machine, no network),
   local text/json(l)/parquet files (a file, a folder or a glob), or a Hugging Face hub dataset.
2. Tokenizer. `bytes` (UTF-8 bytes + one end-of-text token), `bpe` (a byte-level BPE trained on
   a sample of the corpus with the `tokenizers` library) or any Hugging Face tokenizer.
3. Build (corpus/build.py). Documents are tokenized, each followed by the end-of-text token, into
   shards (corpus/indexed.py) under a folder the data.* keys name, with a manifest written last.
4. Pack. The shards, in the manifest's order, are one token stream. Sequence i of length T is
   tokens[i*T : i*T + T + 1]: the model reads the first T tokens and predicts the last T. The
   stream does not depend on T, so runs with different sequence lengths share one build. The
   last val_fraction of the stream is held out.
5. Sample (sampling.py). A seeded sampler picks each step's sequences, each DP rank its slice of
   the global batch, resumable to the sequence.

A one-process run builds its corpus on first use (and again when the source changed). A job of
more than one rank never builds: a rank finds its build by the data.* keys alone, reads its
manifest and memory-maps its shards (a stat and an open each), and stops with the build command
where there is none.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import numpy as np

from corpus import build, indexed, sources, tokenizer as tokenizers
from corpus.sources import FORMATS, local_files, source_kind  # noqa: F401 (data.source_kind, as before)
from corpus.tokenizer import EOT, BPETokenizer, ByteTokenizer, HFTokenizer  # noqa: F401
from errors import ConfigError

log = logging.getLogger(__name__)


@dataclass
class BlendSource:
    """One entry of data.sources: a source as data.source takes it, its weight (normalised with the
    others'), and the per-source settings that differ from data.*'s (None: data.*'s)."""
    source: str = "???"
    weight: float = 1.0
    subset: Optional[str] = None
    split: Optional[str] = None
    text_field: Optional[str] = None
    format: Optional[str] = None


@dataclass
class DataConfig:
    source: str = "stdlib"        # stdlib | a local file, folder or glob | a Hugging Face hub name
    format: str = "auto"          # auto | text | json | parquet  (local files; auto goes by extension)
    text_field: str = "text"      # the column holding the text (json, parquet, hub datasets)
    tokenizer: str = "bpe"        # bytes | bpe | a Hugging Face tokenizer name or path
    bpe_vocab_size: int = 4096
    # No cap by default: the whole stdlib (31.5 MB of Python 3.11 source, 9.4M tokens) trains its BPE
    # and tokenizes within the first `make demo`'s time budget.
    max_bytes: Optional[int] = None
    val_fraction: float = 0.01
    cache_dir: Optional[str] = None  # None: $MEGAREPRO_CACHE, else ~/.cache/megarepro
    prefetch: int = 2             # batches prepared ahead, with asynchronous prefetch
    # Table 3 step 7 is ONE switch, as the paper names it: data.pipeline=megascale turns on both of
    # its data-loading optimisations. Each also has its own switch, unset (null) = as data.pipeline
    # says, so that one can be measured without the other (e.g. data.pipeline=naive
    # data.tp_shared=true) while the ablation step stays a single override.
    pipeline: str = "naive"       # naive | megascale
    prefetch_async: Optional[bool] = None  # prepare the next batches in the background while a step computes
    tp_shared: Optional[bool] = None       # one reader per TP group, broadcasting the batch to the others
    subset: Optional[str] = None  # hub datasets: the configuration name (load_dataset's `name`)
    split: str = "train"          # hub datasets: the split to read; val is carved from its tail
    # A weighted blend (corpus/blend.py), e.g. [{source: a, weight: 0.3}, {source: b, weight: 0.7}];
    # empty: data.source alone. Each entry is a source as data.source takes it, sharing data.*'s
    # tokenizer and val_fraction; training draws each source at its weight.
    sources: List[BlendSource] = field(default_factory=list)
    # The build (corpus/build.py):
    revision: Optional[str] = None      # hub datasets: the revision (a tag, branch or commit) to read
    bpe_sample_bytes: int = 1_000_000_000  # the BPE trains on this much text, spread over the corpus
    shard_bytes: int = 1 << 30          # a shard's tokens stop at this size; a build unit reads this much source


PIPELINES = ("naive", "megascale")


# --- Validation: cheap checks only, never the network, O(1) file-system calls ---

def check_config(cfg: DataConfig, world: int = 1) -> None:
    """Raise ConfigError for a bad data setting found without loading anything. A local source's
    files are listed only where no build of it exists and one process would build it: a rank of
    a larger job reads the build's manifest and nothing else (build_problem)."""
    for key, value, allowed in (("data.format", cfg.format, FORMATS), ("data.pipeline", cfg.pipeline, PIPELINES)):
        if value not in allowed:
            raise ConfigError(key, f"unknown value {value!r}", f"use one of: {', '.join(allowed)}")
    if not 0.0 <= cfg.val_fraction < 1.0:
        raise ConfigError("data.val_fraction", f"{cfg.val_fraction} is outside [0, 1)",
                          "use a fraction such as 0.01 (0 disables the held-out split)")
    for key, value in (("data.max_bytes", cfg.max_bytes), ("data.bpe_sample_bytes", cfg.bpe_sample_bytes),
                       ("data.shard_bytes", cfg.shard_bytes)):
        if value is not None and value < 1:
            raise ConfigError(key, f"{value} < 1", "use a positive byte count" + (", or null for no cap" if key == "data.max_bytes" else ""))
    if cfg.prefetch < 0:
        raise ConfigError("data.prefetch", f"{cfg.prefetch} < 0", "use 0 (synchronous) or a positive depth")
    if cfg.prefetch_async and cfg.prefetch == 0:
        raise ConfigError("data.prefetch", "0 with data.prefetch_async=true prefetches nothing",
                          "use a depth >= 1, or data.prefetch_async=false")
    if not cfg.text_field:
        raise ConfigError("data.text_field", "is empty", "name the column that holds the text, e.g. text")
    _check_tokenizer(cfg)
    if source_kind(cfg.source) == "local" and world == 1 and not (build.directory(cfg) / build.MANIFEST).exists():
        files = local_files(cfg.source)
        if not files:
            raise ConfigError("data.source", f"{cfg.source!r} is not a hub name and matches no local file",
                              "give an existing file, folder or glob, a hub dataset name, or stdlib")
        sources.local_format(cfg.format, files)


def data_parts(cfg: DataConfig) -> tuple[bool, bool]:
    """(prefetch asynchronously, one reader per TP group): each as its own switch says, or, unset,
    as data.pipeline says (megascale: both). Prefetching needs a depth (data.prefetch > 0)."""
    megascale = cfg.pipeline == "megascale"
    prefetch_async = megascale if cfg.prefetch_async is None else cfg.prefetch_async
    tp_shared = megascale if cfg.tp_shared is None else cfg.tp_shared
    return prefetch_async and cfg.prefetch > 0, tp_shared


def _check_tokenizer(cfg: DataConfig) -> None:
    if cfg.tokenizer == "bpe":
        # 256 byte symbols + the end-of-text token come first; merges fill the rest.
        if not 257 <= cfg.bpe_vocab_size <= 2**31:
            raise ConfigError("data.bpe_vocab_size", f"{cfg.bpe_vocab_size} is outside [257, 2^31]",
                              "use at least 257 (the byte alphabet plus end-of-text), e.g. 4096")
    elif cfg.tokenizer != "bytes" and source_kind(cfg.tokenizer) == "local" and not Path(cfg.tokenizer).expanduser().exists():
        raise ConfigError("data.tokenizer", f"{cfg.tokenizer!r} is not bytes, bpe, a hub name or an existing path",
                          "use bytes, bpe, a Hugging Face tokenizer name (e.g. gpt2) or a saved tokenizer folder")


def build_problem(cfg: DataConfig, world: int, model_vocab: int) -> Optional[str]:
    """The one line that stops a job before any rank works, or None: a job of more than one rank
    whose corpus is not built, or a build whose vocabulary or token ids exceed the model's.
    One open of the manifest per rank."""
    try:
        manifest = build.read_manifest(build.directory(cfg), cfg)
    except ConfigError as err:  # damaged: one process builds it again
        return None if world == 1 else str(err)
    if manifest is None:
        if world == 1:
            return None  # one process builds on first use
        return str(not_built(cfg, world))
    if manifest["vocab_size"] > model_vocab or manifest["max_id"] >= model_vocab:
        return (f"config error: model.vocab_size: {model_vocab} is smaller than the corpus's vocabulary of "
                f"{manifest['vocab_size']} (largest token id {manifest['max_id']}, {build.directory(cfg)}). "
                f"Fix: set model.vocab_size>={max(manifest['vocab_size'], manifest['max_id'] + 1)}")
    return None


def not_built(cfg: DataConfig, world: int) -> ConfigError:
    return ConfigError("data.source", f"no complete build of {cfg.source!r} in {build.directory(cfg)}, and a job of "
                       f"{world} ranks never builds", f"build it first: {build.command(cfg)}")


# --- The built corpus, memory-mapped ---

class TokenStream:
    """Several shards' tokens as one read-only stream: len, slices (views) and reads of a range."""

    def __init__(self, arrays: list, lo: int = 0, hi: Optional[int] = None):
        self.arrays = arrays
        self.starts = np.concatenate([[0], np.cumsum([len(a) for a in arrays])]).astype(np.int64)
        self.lo, self.hi = lo, int(self.starts[-1]) if hi is None else hi
        self.dtype, self.itemsize = arrays[0].dtype, arrays[0].dtype.itemsize

    def __len__(self) -> int:
        return self.hi - self.lo

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                return self.read(0, len(self))[key]
            return TokenStream(self.arrays, self.lo + start, self.lo + max(start, stop))
        i = int(key) + (len(self) if int(key) < 0 else 0)
        return self.read(i, i + 1)[0]

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of this stream, across shard boundaries."""
        start, stop = self.lo + start, self.lo + stop
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        parts = []
        while start < stop:
            a, offset = self.arrays[first], start - int(self.starts[first])
            take = min(stop - start, len(a) - offset)
            parts.append(a[offset: offset + take])
            start, first = start + take, first + 1
        return np.concatenate(parts) if len(parts) != 1 else np.asarray(parts[0])

    def __array__(self, dtype=None, copy=None):
        out = self.read(0, len(self))
        return out if dtype is None else out.astype(dtype)

    def astype(self, dtype) -> np.ndarray:
        return np.asarray(self).astype(dtype)

    def max(self) -> int:
        return max(int(np.max(self.read(s, min(s + (1 << 24), len(self))))) for s in range(0, len(self), 1 << 24))


class Rows:
    """[num_sequences, seq_len + 1] over a TokenStream: rows[indices] reads just those rows."""

    def __init__(self, stream: TokenStream, seq_len: int, n: int):
        self.stream, self.seq_len, self.n = stream, seq_len, n
        self.shape = (n, seq_len + 1)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, indices) -> np.ndarray:
        T, rows = self.seq_len, np.asarray(indices)
        if rows.size and (rows.min() < 0 or rows.max() >= self.n):  # past the split: the next split's tokens
            raise IndexError(f"row {int(rows.max() if rows.max() >= self.n else rows.min())} is outside [0, {self.n})")
        if np.isscalar(indices):
            return self.stream.read(int(indices) * T, int(indices) * T + T + 1)
        return np.stack([self.stream.read(i * T, i * T + T + 1) for i in np.asarray(indices).tolist()]) \
            if len(indices) else np.zeros((0, T + 1), self.stream.dtype)

    def astype(self, dtype) -> np.ndarray:
        return self[np.arange(self.n)].astype(dtype)


class Corpus:
    """A built corpus: its shards memory-mapped as one token stream; train is its head, val its tail."""

    def __init__(self, path: Path, manifest: dict, val_fraction: float):
        self.path, self.manifest = Path(path), manifest
        self.vocab_size = int(manifest["vocab_size"])
        self.eot_id = int(manifest["eot_id"])
        self.shards = [s["name"] for s in manifest["shards"]]
        dtype = np.dtype(manifest["dtype"])
        try:  # a stat and an open (the memory map) per shard; a truncated one is caught by its size
            arrays = [indexed.open_tokens(self.path / s["name"], dtype, s["tokens"]) for s in manifest["shards"]]
        except indexed.ShardError as err:
            raise self._damaged(err) from None
        tokens = arrays[0] if len(arrays) == 1 else TokenStream(arrays)
        n = int(manifest["tokens"])
        # The held-out split is the stream's tail (as in nanoGPT), so val_fraction can change
        # without re-tokenizing. It may start mid-document; every token belongs to one split only.
        n_val = int(n * val_fraction)
        self.train, self.val = tokens[: n - n_val], tokens[n - n_val:]
        self.meta = dict(manifest["meta"], tokenizer=manifest["tokenizer"], vocab_size=self.vocab_size,
                         eot_id=self.eot_id, dtype=manifest["dtype"], max_id=manifest["max_id"],
                         **{k: manifest[k] for k in ("documents", "tokens", "text_bytes")},
                         shards=len(self.shards), cache_path=str(self.path), build=manifest["command"],
                         val_fraction=val_fraction, train_tokens=n - n_val, val_tokens=n_val)
        self._tokenizer = None

    def _damaged(self, err: indexed.ShardError) -> ConfigError:
        return ConfigError("data.source", f"shard {err.path} {err.problem}",
                           f"rebuild the corpus: rm -r {self.path} && {self.manifest['command']}")

    def split(self, name: str):
        if name not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', not {name!r}")
        return self.train if name == "train" else self.val

    def num_sequences(self, split: str, seq_len: int) -> int:
        return max(0, (len(self.split(split)) - 1) // seq_len)

    def sequences(self, split: str, seq_len: int):
        """[num_sequences, seq_len + 1], read-only: row i is tokens[i*T : i*T + T + 1].
        Consecutive rows overlap by one token, the target of one row's last input."""
        tokens, n = self.split(split), self.num_sequences(split, seq_len)
        if isinstance(tokens, TokenStream):
            return Rows(tokens, seq_len, n)
        return np.lib.stride_tricks.as_strided(tokens, shape=(n, seq_len + 1),
                                               strides=(seq_len * tokens.itemsize, tokens.itemsize), writeable=False)

    def verify(self, rank: int = 0, world: int = 1) -> None:
        """Read this rank's share of the shards (every world-th from rank) in full, once: checksums,
        vocabulary, token ids. A shard that passes gets a marker of its size and time, so the next
        start of the job costs a stat and a read per shard, not the corpus's bytes."""
        for shard in self.manifest["shards"][rank::world]:
            prefix = self.path / shard["name"]
            marker = Path(f"{prefix}.verified")
            try:
                stat = os.stat(indexed.bin_path(prefix))
                seal = f"{stat.st_size} {stat.st_mtime_ns} {shard['checksum']}"
                if _read_text(marker) == seal:
                    continue
                indexed.verify(prefix, self.vocab_size, shard["checksum"])
            except (indexed.ShardError, FileNotFoundError) as err:
                raise self._damaged(err if isinstance(err, indexed.ShardError)
                                    else indexed.ShardError(indexed.bin_path(prefix), "is missing")) from None
            try:
                marker.write_text(seal)
            except OSError:  # a read-only cache: verified again next time
                pass

    def decode(self, ids) -> str:
        if self._tokenizer is None:
            self._tokenizer = tokenizers.load(self.manifest["tokenizer"], self.path)
        return self._tokenizer.decode(ids)


def _read_text(path: Path) -> Optional[str]:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


def open_built(cfg: DataConfig, world: int = 2) -> Corpus:
    """The built corpus of cfg, never building (as a rank of a larger job opens it)."""
    manifest = build.read_manifest(build.directory(cfg), cfg)
    if manifest is None:
        raise not_built(cfg, world)
    return Corpus(build.directory(cfg), manifest, cfg.val_fraction)


def prepare(cfg: DataConfig, seq_len: int, world: int = 1) -> Corpus:
    """The corpus for cfg. One process (world 1) builds it on first use, or again when the source
    changed, under a lock (concurrent one-process runs build it once); a rank of a larger job
    opens the build, which must exist (ConfigError naming the build command otherwise)."""
    check_config(cfg, world)
    folder = build.directory(cfg)
    if world > 1:
        manifest, reused = build.read_manifest(folder, cfg), True
        if manifest is None:
            raise not_built(cfg, world)
    else:
        manifest, reused = _usable_manifest(cfg, folder), True
    if manifest is None:
        folder.parent.mkdir(parents=True, exist_ok=True)
        with build.locked(folder.parent / f"{folder.name}.lock"):  # double-checked: the first builds
            manifest = _usable_manifest(cfg, folder)
            if manifest is None:
                manifest, reused = build.build(cfg), False
    corpus = Corpus(folder, manifest, cfg.val_fraction)
    corpus.meta["reused"] = reused
    _check_size(corpus, cfg, seq_len)
    return corpus


def _usable_manifest(cfg: DataConfig, folder: Path) -> Optional[dict]:
    """The manifest of a build of the source as it is now, else None (one process builds again)."""
    try:
        manifest = build.read_manifest(folder, cfg)
    except ConfigError:  # damaged: rebuilt
        return None
    return manifest if manifest is not None and manifest["source"] == sources.plan(cfg).identity else None


def _check_size(corpus: Corpus, cfg: DataConfig, seq_len: int) -> None:
    if corpus.num_sequences("train", seq_len) < 1:
        raise ConfigError("data.source", f"the training split has {len(corpus.train)} tokens, fewer than one "
                          f"sequence of train.seq_len={seq_len} plus its target",
                          "use a larger corpus (or max_bytes), or a shorter train.seq_len")
    if cfg.val_fraction > 0 and corpus.num_sequences("val", seq_len) < 1:
        need = (seq_len + 1) / max(1, corpus.meta["tokens"])
        raise ConfigError("data.val_fraction", f"the held-out split has {len(corpus.val)} tokens, fewer than one "
                          f"sequence of train.seq_len={seq_len} plus its target",
                          f"use data.val_fraction>={need:.4g}, or 0 to disable evaluation")
