"""Data: load a corpus, tokenize it, pack it into a memory-mapped token file, sample deterministically.

The pipeline, top to bottom:
1. Source. `stdlib` (the running Python's standard-library source: on every machine, no network),
   local text/json(l)/parquet files (a file, a folder or a glob), or a Hugging Face hub dataset.
2. Tokenizer. `bytes` (UTF-8 bytes + one end-of-text token), `bpe` (a byte-level BPE trained on
   the corpus with the `tokenizers` library) or any Hugging Face tokenizer, by name or local path.
3. Pack. Documents are joined into one token stream, each followed by the end-of-text token, and
   written once to tokens.bin. Sequence i of length T is tokens[i*T : i*T + T + 1]: the model reads
   the first T tokens and predicts the last T. The file does not depend on T, so runs with
   different sequence lengths share it. The last val_fraction of the stream is held out.
4. Sample (sampling.py). A seeded sampler picks each step's sequences, each DP rank its slice of
   the global batch, and loaders hand them to the training loop, resumable to the sequence.

The packed corpus is cached under a hash of everything that determines its bytes. torchrun ranks
call prepare() together: one builds under a file lock, the others wait and reuse its result.
"""
from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import logging
import os
import platform
import re
import sysconfig
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

import numpy as np

from errors import ConfigError

log = logging.getLogger(__name__)


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


EOT = "<|endoftext|>"
# Bump when the packed layout or the tokenization changes, so old cache entries are not reused.
FORMAT_VERSION = 1
FORMATS = ("auto", "text", "json", "parquet")
PIPELINES = ("naive", "megascale")
_BY_EXTENSION = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}  # anything else is text
_COMPRESSION = (".gz", ".bz2", ".xz", ".zst", ".lz4")
_DATA_SUFFIXES = (".txt", ".text", ".md", ".py", ".csv", ".json", ".jsonl", ".parquet") + _COMPRESSION
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


# --- Validation: cheap checks only, never the network ---

def check_config(cfg: DataConfig) -> None:
    """Raise ConfigError for a bad data setting found without loading anything."""
    for key, value, allowed in (("data.format", cfg.format, FORMATS), ("data.pipeline", cfg.pipeline, PIPELINES)):
        if value not in allowed:
            raise ConfigError(key, f"unknown value {value!r}", f"use one of: {', '.join(allowed)}")
    if not 0.0 <= cfg.val_fraction < 1.0:
        raise ConfigError("data.val_fraction", f"{cfg.val_fraction} is outside [0, 1)",
                          "use a fraction such as 0.01 (0 disables the held-out split)")
    if cfg.max_bytes is not None and cfg.max_bytes < 1:
        raise ConfigError("data.max_bytes", f"{cfg.max_bytes} < 1", "use a positive byte count, or null for no cap")
    if cfg.prefetch < 0:
        raise ConfigError("data.prefetch", f"{cfg.prefetch} < 0", "use 0 (synchronous) or a positive depth")
    if cfg.prefetch_async and cfg.prefetch == 0:
        raise ConfigError("data.prefetch", "0 with data.prefetch_async=true prefetches nothing",
                          "use a depth >= 1, or data.prefetch_async=false")
    if not cfg.text_field:
        raise ConfigError("data.text_field", "is empty", "name the column that holds the text, e.g. text")
    _check_tokenizer(cfg, ConfigError)
    kind = source_kind(cfg.source)
    if kind == "local":
        files = local_files(cfg.source)
        if not files:
            raise ConfigError("data.source", f"{cfg.source!r} is not a hub name and matches no local file",
                              "give an existing file, folder or glob, a hub dataset name, or stdlib")
        _local_format(cfg, files)


def data_parts(cfg: DataConfig) -> tuple[bool, bool]:
    """(prefetch asynchronously, one reader per TP group): each as its own switch says, or, unset,
    as data.pipeline says (megascale: both). Prefetching needs a depth (data.prefetch > 0)."""
    megascale = cfg.pipeline == "megascale"
    prefetch_async = megascale if cfg.prefetch_async is None else cfg.prefetch_async
    tp_shared = megascale if cfg.tp_shared is None else cfg.tp_shared
    return prefetch_async and cfg.prefetch > 0, tp_shared


def _check_tokenizer(cfg: DataConfig, ConfigError) -> None:
    if cfg.tokenizer == "bpe":
        # 256 byte symbols + the end-of-text token come first; merges fill the rest.
        if not 257 <= cfg.bpe_vocab_size <= 2**31:
            raise ConfigError("data.bpe_vocab_size", f"{cfg.bpe_vocab_size} is outside [257, 2^31]",
                              "use at least 257 (the byte alphabet plus end-of-text), e.g. 4096")
    elif cfg.tokenizer != "bytes" and source_kind(cfg.tokenizer) == "local" and not Path(cfg.tokenizer).expanduser().exists():
        raise ConfigError("data.tokenizer", f"{cfg.tokenizer!r} is not bytes, bpe, a hub name or an existing path",
                          "use bytes, bpe, a Hugging Face tokenizer name (e.g. gpt2) or a saved tokenizer folder")


def source_kind(value: str) -> str:
    """'stdlib', 'local' or 'hub'. An existing path is local; otherwise a value shaped like a hub
    name ('org/name' or a bare word) without a data-file extension is hub; anything else is local."""
    if value == "stdlib":
        return "stdlib"
    if os.path.exists(os.path.expanduser(value)):
        return "local"
    if _HUB_NAME.match(value) and not value.lower().endswith(_DATA_SUFFIXES):
        return "hub"
    return "local"


def local_files(source: str) -> list[Path]:
    """The files a local source names (a file, every non-hidden file under a folder, or a glob),
    in sorted order, which is the order their documents enter the token stream."""
    path = Path(source).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        found = [p for p in path.rglob("*") if not any(part.startswith(".") for part in p.relative_to(path).parts)]
    else:
        found = [Path(p) for p in glob.glob(str(path), recursive=True)]
    return sorted((p for p in found if p.is_file()), key=str)


def _file_format(path: Path) -> str:
    name = path.name.lower()
    for suffix in _COMPRESSION:
        name = name.removesuffix(suffix)
    return _BY_EXTENSION.get(Path(name).suffix, "text")


def _local_format(cfg: DataConfig, files: list[Path]) -> str:
    if cfg.format != "auto":
        return cfg.format
    formats = sorted({_file_format(p) for p in files})
    if len(formats) > 1:
        raise ConfigError("data.format", f"data.source mixes {' and '.join(formats)} files",
                          "set data.format explicitly or narrow data.source to one kind of file")
    return formats[0]


# --- Sources: what the corpus is (its identity, for the cache key) and its documents ---

@dataclass
class Source:
    identity: dict                           # everything that determines the documents, hashable as JSON
    meta: dict                               # what run.json records about the source
    documents: Callable[[], Iterator[str]]   # a fresh pass over the documents (BPE needs two)


def _stdlib_source(max_bytes: Optional[int]) -> Source:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(_stdlib_files(root), key=lambda p: p.relative_to(root).as_posix())
    # The corpus is the first max_bytes bytes of the files' concatenation; the hash covers exactly
    # those bytes, so two machines with the same Python agree on it (and on the cache key).
    chunks, total, digest = [], 0, hashlib.sha256()
    for p in files:
        raw = p.read_bytes()
        if max_bytes is not None:
            raw = raw[: max_bytes - total]
        chunks.append(raw)
        digest.update(raw)
        total += len(raw)
        if max_bytes is not None and total >= max_bytes:
            break
    content_hash = digest.hexdigest()
    # Where a document ends is part of the corpus too (an end-of-text token goes there).
    boundaries = hashlib.sha256(np.array([len(c) for c in chunks], np.int64).tobytes()).hexdigest()
    meta = {"source": "stdlib", "stdlib_path": str(root), "python_version": platform.python_version(),
            "python_implementation": platform.python_implementation(), "files": len(chunks),
            "bytes": total, "content_hash": content_hash}
    # A few stdlib files are deliberately not UTF-8 (encoding tests); they enter with U+FFFD.
    return Source({"kind": "stdlib", "sha256": content_hash, "boundaries": boundaries}, meta,
                  lambda: (c.decode("utf-8", errors="replace") for c in chunks))


def _stdlib_files(root: Path) -> Iterator[Path]:
    """The standard library's *.py files. Installed packages are not the standard library, and
    their folders are not even walked (site-packages can hold far more files than the library
    itself: a second of every run's start-up on rank 0). Symlinked folders are followed, as
    Path.rglob does."""
    skip = {"site-packages", "dist-packages"}
    for folder, dirs, names in os.walk(root, followlinks=True):
        dirs[:] = [d for d in dirs if d not in skip]
        yield from (Path(folder) / n for n in names if n.endswith(".py"))


def _local_source(cfg: DataConfig, hf_cache: Path) -> Source:
    files = local_files(cfg.source)
    fmt = _local_format(cfg, files)
    digest = hashlib.sha256()
    for p in files:  # the raw bytes, not mtimes: a touched but unchanged file keeps its cache
        digest.update(f"{p.stat().st_size}:".encode())
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    content_hash = digest.hexdigest()
    field = "text" if fmt == "text" else cfg.text_field  # the text builder always names it "text"
    identity = {"kind": "local", "sha256": content_hash, "format": fmt, "field": field, "max_bytes": cfg.max_bytes}
    meta = {"source": cfg.source, "format": fmt, "text_field": field, "files": len(files), "content_hash": content_hash}

    def documents() -> Iterator[str]:
        import datasets
        # sample_by="document": one file is one document, not one line.
        options = {"sample_by": "document"} if fmt == "text" else {}
        ds = datasets.load_dataset(fmt, data_files=[str(p) for p in files], split="train",
                                   cache_dir=str(hf_cache), **options)
        return _capped(_column(ds, field, "data.text_field"), cfg.max_bytes)
    return Source(identity, meta, documents)


def _hub_source(cfg: DataConfig, hf_cache: Path) -> Source:
    # Keyed by name, not by content: checking the hub for a new revision on every start (from every
    # rank) costs a network round trip. Delete the cache entry to pick up an updated dataset.
    identity = {"kind": "hub", "name": cfg.source, "subset": cfg.subset, "split": cfg.split,
                "field": cfg.text_field, "max_bytes": cfg.max_bytes}
    meta = {"source": cfg.source, "subset": cfg.subset, "split": cfg.split, "text_field": cfg.text_field}

    def documents() -> Iterator[str]:
        import datasets
        try:
            ds = datasets.load_dataset(cfg.source, cfg.subset, split=cfg.split, cache_dir=str(hf_cache))
        except Exception as err:  # offline, a typo, a gated dataset: all end the run the same way
            reason = (str(err).strip().splitlines() or [""])[0][:200]
            raise ConfigError("data.source", f"could not load hub dataset {cfg.source!r} ({type(err).__name__}: {reason})",
                              "check the name and the network (or HF_DATASETS_OFFLINE), or use a local path or stdlib") from err
        meta["fingerprint"] = getattr(ds, "_fingerprint", None)
        return _capped(_column(ds, cfg.text_field, "data.text_field"), cfg.max_bytes)
    return Source(identity, meta, documents)


def _column(ds, field: str, key: str) -> Iterator[str]:
    if field not in ds.column_names:
        raise ConfigError(key, f"no column {field!r}; the dataset has {', '.join(ds.column_names)}",
                          "set data.text_field to the column that holds the text")
    for batch in ds.select_columns([field]).iter(batch_size=1024):
        yield from (text for text in batch[field] if isinstance(text, str) and text)


def _capped(documents: Iterable[str], max_bytes: Optional[int]) -> Iterator[str]:
    """The documents up to max_bytes UTF-8 bytes in all; the last one cut at a character boundary."""
    total = 0
    for text in documents:
        if max_bytes is None:
            yield text
            continue
        raw = text.encode("utf-8")
        if total + len(raw) >= max_bytes:
            yield raw[: max_bytes - total].decode("utf-8", errors="ignore")
            return
        total += len(raw)
        yield text


def open_source(cfg: DataConfig, cache_root: Path) -> Source:
    kind = source_kind(cfg.source)
    if kind == "stdlib":
        return _stdlib_source(cfg.max_bytes)
    hf_cache = cache_root / "hf-datasets"
    return _local_source(cfg, hf_cache) if kind == "local" else _hub_source(cfg, hf_cache)


# --- Tokenizers: the three kinds behind one small interface ---

class ByteTokenizer:
    """UTF-8 bytes are tokens 0..255; the end-of-text token is 256."""
    vocab_size, eot_id = 257, 256

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def decode(self, ids) -> str:
        pieces = [EOT.encode() if i == self.eot_id else bytes([i]) for i in np.asarray(ids).tolist()]
        return b"".join(pieces).decode("utf-8", errors="replace")


class BPETokenizer:
    """A byte-level BPE (GPT-2's scheme) from the `tokenizers` library."""

    def __init__(self, tok):
        tok.encode_special_tokens = True  # a literal "<|endoftext|>" in a document is text, not a boundary
        self.tok = tok
        self.vocab_size = tok.get_vocab_size()
        self.eot_id = tok.token_to_id(EOT)

    @classmethod
    def train(cls, documents: Iterable[str], vocab_size: int) -> "BPETokenizer":
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOT],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tok.train_from_iterator(documents, trainer=trainer)
        return cls(tok)

    @classmethod
    def load(cls, path: Path) -> "BPETokenizer":
        from tokenizers import Tokenizer
        return cls(Tokenizer.from_file(str(path)))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # encode_batch_fast skips the character offsets, which nothing here reads.
        return [e.ids for e in self.tok.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self.tok.decode(np.asarray(ids).tolist(), skip_special_tokens=False)


class HFTokenizer:
    """Any tokenizer transformers' AutoTokenizer loads, by hub name or local folder."""

    def __init__(self, name_or_path: str):
        from transformers import AutoTokenizer
        self.tok = AutoTokenizer.from_pretrained(name_or_path)
        self.vocab_size = len(self.tok)
        self.eot_id = self.tok.eos_token_id
        if self.eot_id is None:
            raise ConfigError("data.tokenizer", f"{name_or_path!r} has no end-of-text (eos) token to separate documents",
                              "use a tokenizer with an eos token, or bpe")
        self.backend = getattr(self.tok, "backend_tokenizer", None)
        if self.backend is not None:
            self.backend.encode_special_tokens = True

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if self.backend is not None:
            return [e.ids for e in self.backend.encode_batch_fast(texts, add_special_tokens=False)]
        return self.tok(texts, add_special_tokens=False, split_special_tokens=True, verbose=False)["input_ids"]

    def decode(self, ids) -> str:
        return self.tok.decode(np.asarray(ids).tolist(), skip_special_tokens=False)


def _tokenizer_identity(cfg: DataConfig) -> dict:
    if cfg.tokenizer == "bytes":
        return {"kind": "bytes"}
    if cfg.tokenizer == "bpe":
        return {"kind": "bpe", "vocab_size": cfg.bpe_vocab_size}  # trained on the corpus, which the key covers
    path = Path(cfg.tokenizer).expanduser()
    if path.exists():  # a saved tokenizer: its files are its identity
        digest = hashlib.sha256()
        for p in sorted(path.rglob("*") if path.is_dir() else [path], key=str):
            if p.is_file():
                digest.update(p.name.encode() + b"\0" + p.read_bytes())
        return {"kind": "hf", "path": str(path.resolve()), "sha256": digest.hexdigest()}
    return {"kind": "hf", "name": cfg.tokenizer}


# --- The packed corpus ---

class Corpus:
    """A packed token stream, memory-mapped: train is its head, val its tail."""

    def __init__(self, path: Path, meta: dict, val_fraction: float):
        self.path = Path(path)
        self.vocab_size = int(meta["vocab_size"])
        self.eot_id = int(meta["eot_id"])
        n = int(meta["tokens"])
        tokens = np.memmap(self.path / "tokens.bin", dtype=np.dtype(meta["dtype"]), mode="r", shape=(n,))
        # The held-out split is the stream's tail (as in nanoGPT), so val_fraction can change
        # without re-tokenizing. It may start mid-document; every token belongs to one split only.
        n_val = int(n * val_fraction)
        self.train, self.val = tokens[: n - n_val], tokens[n - n_val:]
        self.meta = dict(meta, cache_path=str(self.path), val_fraction=val_fraction,
                         train_tokens=n - n_val, val_tokens=n_val)
        self._tokenizer = None

    def split(self, name: str) -> np.ndarray:
        if name not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', not {name!r}")
        return self.train if name == "train" else self.val

    def num_sequences(self, split: str, seq_len: int) -> int:
        return max(0, (len(self.split(split)) - 1) // seq_len)

    def sequences(self, split: str, seq_len: int) -> np.ndarray:
        """A read-only [num_sequences, seq_len + 1] view: row i is tokens[i*T : i*T + T + 1].
        Consecutive rows overlap by one token, the target of one row's last input."""
        tokens = self.split(split)
        return np.lib.stride_tricks.as_strided(tokens, shape=(self.num_sequences(split, seq_len), seq_len + 1),
                                               strides=(seq_len * tokens.itemsize, tokens.itemsize), writeable=False)

    def decode(self, ids) -> str:
        if self._tokenizer is None:
            kind = self.meta["tokenizer"]["kind"]
            if kind == "bytes":
                self._tokenizer = ByteTokenizer()
            elif kind == "bpe":
                self._tokenizer = BPETokenizer.load(self.path / "tokenizer.json")
            else:
                self._tokenizer = HFTokenizer(self.meta["tokenizer"].get("path") or self.meta["tokenizer"]["name"])
        return self._tokenizer.decode(ids)


def cache_root(cfg: DataConfig) -> Path:
    root = cfg.cache_dir or os.environ.get("MEGAREPRO_CACHE") or "~/.cache/megarepro"
    return Path(root).expanduser()


def prepare(cfg: DataConfig, seq_len: int, known: Optional[str] = None) -> Corpus:
    """The packed corpus for cfg, built on first use and cached. Safe to call from every rank at once.
    known: the cache entry another rank found for the same cfg (Corpus.path.name). Where this
    machine's cache holds it complete, it is opened without reading the source again: hashing the
    whole corpus on every one of 256 ranks is 256 full reads of shared storage."""
    check_config(cfg)
    root = cache_root(cfg)
    entries = root / "data"
    if known is not None and _read_meta(entries / known) is not None:
        corpus = Corpus(entries / known, _read_meta(entries / known), cfg.val_fraction)
        corpus.meta["reused"] = True
        _check_size(corpus, cfg, seq_len)
        return corpus
    entries.mkdir(parents=True, exist_ok=True)
    source = open_source(cfg, root)
    tokenizer = _tokenizer_identity(cfg)
    key = _digest({"version": FORMAT_VERSION, "source": source.identity, "tokenizer": tokenizer})
    name = re.sub(r"[^\w.-]+", "_", f"{Path(cfg.source).name}-{tokenizer['kind']}")[:48]
    entry = entries / f"{name}-{key[:16]}"
    meta, reused = _read_meta(entry), True
    if meta is None:  # double-checked: whoever gets the lock first builds, the rest find its result
        with _locked(entries / f"{entry.name}.lock"):
            meta = _read_meta(entry)
            if meta is None:
                meta, reused = _build(entry, cfg, source, tokenizer, key), False
    corpus = Corpus(entry, meta, cfg.val_fraction)
    corpus.meta["reused"] = reused
    _check_size(corpus, cfg, seq_len)
    return corpus


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _read_meta(entry: Path) -> Optional[dict]:
    try:  # meta.json is written last, so its presence means the entry is complete
        return json.loads((entry / "meta.json").read_text())
    except FileNotFoundError:
        return None


@contextmanager
def _locked(path: Path):
    # flock: held by this process until closed, released by the kernel if the process dies, and
    # honoured across hosts on NFSv4 and Lustre, where multi-node jobs share a cache.
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _write_atomic(path: Path, write: Callable) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _build(entry: Path, cfg: DataConfig, source: Source, tokenizer_identity: dict, key: str) -> dict:
    entry.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    kind = tokenizer_identity["kind"]
    if kind == "bytes":
        tokenizer = ByteTokenizer()
    elif kind == "bpe":
        log.info("data: training a %d-token byte-level BPE on %s", cfg.bpe_vocab_size, cfg.source)
        tokenizer = BPETokenizer.train(source.documents(), cfg.bpe_vocab_size)
        _write_atomic(entry / "tokenizer.json", lambda f: f.write(tokenizer.tok.to_str().encode()))
    else:
        tokenizer = HFTokenizer(cfg.tokenizer)
    trained = time.perf_counter()
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    counts = {"documents": 0, "tokens": 0, "text_bytes": 0}

    def write_tokens(f) -> None:
        for batch in _batches(source.documents(), max_chars=1 << 22):
            for ids in tokenizer.encode_batch(batch):
                np.append(np.asarray(ids, dtype=dtype), dtype(tokenizer.eot_id)).tofile(f)
                counts["tokens"] += len(ids) + 1
            counts["documents"] += len(batch)
            counts["text_bytes"] += sum(len(t.encode("utf-8")) for t in batch)
    log.info("data: tokenizing %s into %s", cfg.source, entry)
    _write_atomic(entry / "tokens.bin", write_tokens)
    if counts["documents"] == 0:
        raise ConfigError("data.source", f"{cfg.source!r} contains no text", "point data.source at a non-empty corpus")
    done = time.perf_counter()
    meta = {**source.meta, **counts, "tokenizer": {**tokenizer_identity, "vocab_size": tokenizer.vocab_size},
            "vocab_size": tokenizer.vocab_size, "eot_id": int(tokenizer.eot_id), "dtype": np.dtype(dtype).name,
            "max_bytes": cfg.max_bytes, "cache_key": key, "format_version": FORMAT_VERSION,
            "tokenizer_seconds": round(trained - started, 2), "tokenize_seconds": round(done - trained, 2)}
    _write_atomic(entry / "meta.json", lambda f: f.write(json.dumps(meta, indent=1).encode()))
    log.info("data: %d documents, %d tokens (%.2f bytes/token) in %.1f s", counts["documents"], counts["tokens"],
             counts["text_bytes"] / max(1, counts["tokens"]), done - started)
    return meta


def _batches(documents: Iterable[str], max_chars: int) -> Iterator[list[str]]:
    """Groups of documents for encode_batch, which spreads one group over all cores."""
    batch, size = [], 0
    for text in documents:
        batch.append(text)
        size += len(text)
        if size >= max_chars or len(batch) >= 4096:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


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
