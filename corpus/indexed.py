"""The shard format: a token file (.bin) and its index (.idx), as Megatron-LM's indexed datasets.

shard.bin holds the tokens of whole documents, each followed by its end-of-text token, in the
smallest unsigned dtype that holds the vocabulary. shard.idx holds a fixed header, then the
documents' start offsets (int64, one more than the documents: the last is the token count):

    magic    8 bytes  b"MEGAIDX\\0"
    version  uint32
    dtype    uint32   1 = uint16, 2 = uint32
    vocab    uint64   the tokenizer's vocabulary size
    tokens   uint64
    docs     uint64
    max_id   uint64   the largest token id in the shard (ids beyond a model's vocabulary show here)
    checksum 32 bytes blake2b of the .bin's bytes

Opening a shard reads the header and memory-maps the tokens: no byte of the .bin is read.
Verifying the checksum reads every byte, so it is a separate call (verify) that a job makes
where it decides, once. A shard is written to temporary names and renamed, .idx last, so a
killed build leaves either a whole shard or none.
"""
from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path
from typing import Optional

import numpy as np

MAGIC = b"MEGAIDX\0"
VERSION = 1
HEADER = struct.Struct("<8sIIQQQQ32s")
DTYPES = {1: np.dtype(np.uint16), 2: np.dtype(np.uint32)}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}
CHUNK = 1 << 24  # bytes hashed at a time: memory stays bounded however large the shard


class ShardError(ValueError):
    """A shard that is missing, truncated, corrupt or of another vocabulary. str() is one line."""

    def __init__(self, path: Path, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path, self.problem = Path(path), problem


def dtype_for(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id of the vocabulary."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def bin_path(prefix: Path) -> Path:
    return Path(f"{prefix}.bin")


def idx_path(prefix: Path) -> Path:
    return Path(f"{prefix}.idx")


class ShardWriter:
    """Appends documents to prefix.bin (under a temporary name), hashing as it goes; finish()
    writes the index and renames both into place."""

    def __init__(self, prefix: Path, vocab_size: int):
        self.prefix, self.vocab_size = Path(prefix), vocab_size
        self.dtype = dtype_for(vocab_size)
        self._tmp_bin = Path(f"{bin_path(self.prefix)}.tmp{os.getpid()}")
        self._file = open(self._tmp_bin, "wb")
        self._hash = hashlib.blake2b(digest_size=32)
        self._offsets = [0]
        self.tokens, self.max_id = 0, 0

    @property
    def nbytes(self) -> int:
        return self.tokens * self.dtype.itemsize

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Documents given as their concatenated tokens (end-of-text included) and their lengths."""
        tokens = np.ascontiguousarray(tokens, dtype=self.dtype)
        raw = tokens.tobytes()
        self._file.write(raw)
        self._hash.update(raw)
        self._offsets.extend((self.tokens + np.cumsum(lengths)).tolist())
        self.tokens += len(tokens)
        if len(tokens):
            self.max_id = max(self.max_id, int(tokens.max()))

    def finish(self) -> dict:
        """Close, write the index, rename into place; the shard's record for the manifest."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        docs = len(self._offsets) - 1
        checksum = self._hash.digest()
        header = HEADER.pack(MAGIC, VERSION, DTYPE_CODES[self.dtype], self.vocab_size, self.tokens, docs,
                             self.max_id, checksum)
        tmp_idx = Path(f"{idx_path(self.prefix)}.tmp{os.getpid()}")
        with open(tmp_idx, "wb") as f:
            f.write(header)
            f.write(np.asarray(self._offsets, dtype=np.int64).tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(self._tmp_bin, bin_path(self.prefix))
        os.replace(tmp_idx, idx_path(self.prefix))  # last: an .idx in place means a whole shard
        return {"name": self.prefix.name, "tokens": self.tokens, "documents": docs, "max_id": self.max_id,
                "checksum": checksum.hex()}

    def abort(self) -> None:
        self._file.close()
        self._tmp_bin.unlink(missing_ok=True)


def read_header(prefix: Path) -> dict:
    """The .idx header as a dict (one small read). ShardError if missing or malformed."""
    path = idx_path(prefix)
    try:
        with open(path, "rb") as f:
            raw = f.read(HEADER.size)
    except FileNotFoundError:
        raise ShardError(path, "is missing") from None
    if len(raw) < HEADER.size:
        raise ShardError(path, f"is truncated ({len(raw)} of the header's {HEADER.size} bytes)")
    magic, version, code, vocab, tokens, docs, max_id, checksum = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ShardError(path, "is not a shard index (wrong magic bytes)")
    if version != VERSION or code not in DTYPES:
        raise ShardError(path, f"has format version {version}, dtype code {code}; this code reads version {VERSION}")
    return {"version": version, "dtype": DTYPES[code], "vocab_size": vocab, "tokens": tokens, "documents": docs,
            "max_id": max_id, "checksum": checksum.hex()}


def open_tokens(prefix: Path, dtype: np.dtype, tokens: int) -> np.ndarray:
    """The .bin memory-mapped, its size checked against the expected token count (a truncated
    shard is caught here, by the open's fstat, without reading it): an open and an fstat."""
    path = bin_path(prefix)
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise ShardError(path, "is missing") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size != tokens * np.dtype(dtype).itemsize:
            raise ShardError(path, f"holds {size} bytes, not the {tokens * np.dtype(dtype).itemsize} of its "
                                   f"{tokens} tokens (truncated or overwritten)")
        if tokens == 0:
            return np.zeros(0, dtype=dtype)
        return np.memmap(f, dtype=dtype, mode="r", shape=(tokens,))  # the map outlives the file object


class IndexedShard:
    """A shard opened for reading: its header, its tokens (memory-mapped) and its documents'
    offsets (memory-mapped, read only where asked for)."""

    def __init__(self, prefix: Path):
        self.prefix = Path(prefix)
        self.header = read_header(self.prefix)
        self.tokens = open_tokens(self.prefix, self.header["dtype"], self.header["tokens"])

    def __len__(self) -> int:
        return self.header["tokens"]

    @property
    def offsets(self) -> np.ndarray:
        return np.memmap(idx_path(self.prefix), dtype=np.int64, mode="r", offset=HEADER.size,
                         shape=(self.header["documents"] + 1,))

    def document(self, i: int) -> np.ndarray:
        offsets = self.offsets
        return self.tokens[offsets[i]: offsets[i + 1]]


def verify(prefix: Path, vocab_size: Optional[int] = None, checksum: Optional[str] = None) -> dict:
    """Read every byte of the shard: its checksum against its header's (and the manifest's, if
    given), its header's vocabulary against vocab_size, its ids against the vocabulary. Returns
    the header; ShardError on any difference."""
    header = read_header(prefix)
    if vocab_size is not None and header["vocab_size"] != vocab_size:
        raise ShardError(idx_path(prefix), f"was written for a vocabulary of {header['vocab_size']} tokens, "
                                           f"the corpus's tokenizer has {vocab_size} (a shard of another tokenizer)")
    if checksum is not None and header["checksum"] != checksum:
        raise ShardError(idx_path(prefix), "has another checksum than the manifest records (a shard of another build)")
    tokens = open_tokens(prefix, header["dtype"], header["tokens"])
    digest, per_chunk = hashlib.blake2b(digest_size=32), CHUNK // header["dtype"].itemsize
    largest = 0
    for start in range(0, len(tokens), per_chunk):
        chunk = np.asarray(tokens[start: start + per_chunk])
        digest.update(chunk.tobytes())
        largest = max(largest, int(chunk.max()))
    if digest.hexdigest() != header["checksum"]:
        raise ShardError(bin_path(prefix), "fails its checksum (corrupt: a changed or damaged byte)")
    if largest >= header["vocab_size"]:
        raise ShardError(bin_path(prefix), f"holds token id {largest}, beyond its vocabulary of {header['vocab_size']}")
    return header
