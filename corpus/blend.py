"""Weighted blends of corpora and the training stream's index, built once and memory-mapped by every rank.

The training stream is a sequence of global samples; position p (counted in sequences over all
ranks) names one row of one source. Two things decide it, as in Megatron-LM's BlendedDataset and
GPTDataset:
- which source: each position goes to the source whose realised share lags its weight most
  (argmax over sources of weight * max(p, 1) - samples drawn so far, the first source on a tie).
  No randomness: after any prefix of n samples a two-source blend has drawn each source within one
  sample of weight * n (with more sources the error stays about that size).
- which row of it: a source's k-th sample is row k % n of its epoch k // n, each epoch a
  permutation seeded by (seed, source, epoch); a source with fewer rows than its share of the
  run repeats, each pass in a new order.

SampleIndex writes the rows of the first `samples` positions (what training needs: max_steps x
global batch) to one .npy file in the data cache, int32 unless the sources hold 2^31 rows or more,
temp file then rename, keyed by what decides its bytes; every rank maps it read-only, so a rank
holds the pages of the slices it reads, not a permutation of the corpus. Each position depends on
nothing after it (the source rule looks back only, each epoch has its own seed), so the index for
more samples starts with the index for fewer: a resumed run with a smaller global batch or more
steps, which reads past the end, maps a longer index (built by the first rank to get there, under
a file lock) and continues the same stream.

Weights are taken as written (0.3 is 3/10) and kept exact as integer shares where those need at
most a million units in all, else rounded to millionths of the total; integer arithmetic, so every
machine draws the same stream. The source rule then repeats with a period of at most a million
positions, which is what makes the index for hundreds of millions of samples cheap to build.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
from fractions import Fraction
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from corpus.build import locked
from errors import ConfigError

WEIGHT_UNITS = 10**6   # weights are realised to 1/WEIGHT_UNITS of their total
INDEX_VERSION = 1      # bump when the stream an index describes changes
CHUNK = 1 << 22        # positions built at a time: bounds the builder's scratch memory


# --- The source of each position ---

def weight_units(weights: Sequence[float]) -> tuple:
    """The weights as integer shares with no common divisor: (0.3, 0.7) -> (3, 7), (2, 6) -> (1, 3).
    Exact where the shares have a common denominator of at most WEIGHT_UNITS, else rounded to
    shares of WEIGHT_UNITS (largest remainders). Raises ValueError for a share below one unit."""
    exact = [Fraction(repr(float(w))) for w in weights]  # as written: 0.3 is 3/10, not the nearest double
    scale = functools.reduce(math.lcm, (f.denominator for f in exact))
    units = [int(f * scale) for f in exact]
    if sum(units) > WEIGHT_UNITS * functools.reduce(math.gcd, units):
        shares = [u / sum(units) * WEIGHT_UNITS for u in units]
        units = [math.floor(x) for x in shares]
        for j in sorted(range(len(units)), key=lambda j: units[j] - shares[j])[: WEIGHT_UNITS - sum(units)]:
            units[j] += 1
    if min(units) < 1:
        raise ValueError(f"a weight below 1/{WEIGHT_UNITS} of the total: {list(weights)}")
    divisor = functools.reduce(math.gcd, units)
    return tuple(u // divisor for u in units)


@functools.lru_cache(maxsize=16)
def _pattern(units: tuple, limit: int) -> tuple:
    """(head, period): position p draws source head[p] for p < len(head), then
    period[(p - len(head)) % len(period)]; period is None if the rule did not repeat within
    `limit` positions (then head covers them). Exact integer arithmetic: lags scaled by sum(units)."""
    k, q = len(units), sum(units)
    dtype = np.uint8 if k <= 256 else np.uint16
    if k == 1:
        return np.zeros(0, dtype), np.zeros(1, dtype)
    drawn, picks, checkpoint = [0] * k, [], None
    for p in range(limit):
        if p >= 1 and (p - 1) % q == 0:  # from p = 1 on, the lags alone decide what comes next
            lags = tuple(units[j] * p - q * drawn[j] for j in range(k))
            if lags == checkpoint:
                return np.array(picks[: p - q], dtype), np.array(picks[p - q:], dtype)
            checkpoint = lags
        n = max(p, 1)
        best, source = units[0] * n - q * drawn[0], 0
        for j in range(1, k):
            lag = units[j] * n - q * drawn[j]
            if lag > best:
                best, source = lag, j
        drawn[source] += 1
        picks.append(source)
    return np.array(picks, dtype), None


def sources_of(units: tuple, start: int, stop: int) -> np.ndarray:
    """The source of each position in [start, stop)."""
    if len(units) == 1:
        return np.zeros(stop - start, np.uint8)
    head, period = _pattern(units, 2 + 64 * sum(units))
    if period is None and stop > len(head):  # (never seen: the rule repeats within a few periods)
        head, period = _pattern(units, stop)
    positions = np.arange(start, stop, dtype=np.int64)
    out = np.empty(stop - start, head.dtype)
    inside = positions < len(head)
    out[inside] = head[positions[inside]]
    if period is not None:
        out[~inside] = period[(positions[~inside] - len(head)) % len(period)]
    return out


# --- The rows ---

def row_dtype(total_rows: int) -> np.dtype:
    return np.dtype(np.int32 if total_rows < 2**31 else np.int64)


def _epoch(seed: int, source: int, n_sources: int, epoch: int, n: int, dtype) -> np.ndarray:
    # One source keeps the single corpus's order (seed, epoch), which runs before blending read.
    key = [seed, epoch] if n_sources == 1 else [seed, source, epoch]
    return np.random.default_rng(key).permutation(np.arange(n, dtype=dtype))


def build_rows(sizes: Sequence[int], units: tuple, seed: int, out: np.ndarray) -> None:
    """Fill out[p] with the row (sources numbered one after another) of stream position p."""
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(out.dtype)
    drawn, epochs = [0] * len(sizes), {}
    for start in range(0, len(out), CHUNK):
        stop = min(len(out), start + CHUNK)
        src = sources_of(units, start, stop) if len(sizes) > 1 else None
        for j, n in enumerate(sizes):
            where = slice(start, stop) if src is None else start + np.flatnonzero(src == j)
            m = stop - start if src is None else len(where)
            rows, done = np.empty(m, out.dtype), 0
            while done < m:
                epoch, offset = divmod(drawn[j] + done, n)
                if epochs.get(j, (None,))[0] != epoch:
                    epochs[j] = (epoch, _epoch(seed, j, len(sizes), epoch, n, out.dtype))
                take = min(m - done, n - offset)
                rows[done: done + take] = epochs[j][1][offset: offset + take]
                done += take
            out[where] = rows + offsets[j]
            drawn[j] += m


class SampleIndex:
    """The training stream: rows(start, count) are the rows of positions [start, start + count).
    With a cache directory the index is a file there, built once and memory-mapped; without
    one (tests, small tools) it is built in this process's memory."""

    def __init__(self, sizes: Sequence[int], weights: Sequence[float], seed: int, samples: int,
                 cache_dir: Optional[Path] = None, names: Sequence[str] = ()):
        if not sizes or min(sizes) < 1:
            raise ValueError(f"sources of {list(sizes)} sequences: there is nothing to sample")
        if seed < 0:
            raise ValueError(f"seed={seed} must be >= 0")
        self.sizes, self.units, self.seed = tuple(int(n) for n in sizes), weight_units(weights), int(seed)
        self.names, self.cache_dir = tuple(names), None if cache_dir is None else Path(cache_dir)
        self.num_sequences = sum(self.sizes)
        self.dtype = row_dtype(self.num_sequences)
        self.samples, self.array, self.path = 0, None, None
        self._load(max(1, int(samples)))

    @property
    def stream(self) -> Optional[list]:
        """What the stream is besides (seed, num_sequences), for a checkpoint: None for one source."""
        if len(self.sizes) == 1:
            return None
        return [[name, unit, size] for name, unit, size in zip(self.names or [""] * len(self.sizes), self.units, self.sizes)]

    def rows(self, start: int, count: int) -> np.ndarray:
        if start + count > self.samples:  # past what the run was sized for: the same stream, longer
            self._load(max(start + count, 2 * self.samples))
        return np.array(self.array[start: start + count])

    def _key(self, samples: int) -> str:
        described = {"version": INDEX_VERSION, "names": self.names, "sizes": self.sizes, "units": self.units,
                     "seed": self.seed, "samples": samples}
        return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:20]

    def _load(self, samples: int) -> None:
        if self.cache_dir is None:
            self.array = np.empty(samples, self.dtype)
            build_rows(self.sizes, self.units, self.seed, self.array)
        else:
            self.path = self.cache_dir / f"sample-index-{self._key(samples)}.npy"
            if not self.path.exists():  # double-checked: whoever takes the lock first builds
                self.cache_dir.mkdir(parents=True, exist_ok=True)
                with locked(self.path.with_suffix(".lock")):
                    if not self.path.exists():
                        self._write(samples)
            self.array = np.load(self.path, mmap_mode="r")
        self.samples = samples

    def _write(self, samples: int) -> None:
        tmp = self.path.with_name(f"{self.path.name}.tmp{os.getpid()}")
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=self.dtype, shape=(samples,))
        build_rows(self.sizes, self.units, self.seed, out)
        out.flush()
        del out
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


def held_out_rows(sizes: Sequence[int], units: tuple, total: int) -> np.ndarray:
    """`total` rows of the held-out splits (numbered source after source): each position's source
    by the blend's rule, and a source's picks spread evenly over its split (repeating only if it
    is smaller). The same on every call and every rank."""
    src = sources_of(units, 0, total) if len(sizes) > 1 else np.zeros(total, np.uint8)
    out, offset = np.empty(total, np.int64), 0
    for j, n in enumerate(sizes):
        where = np.flatnonzero(src == j)
        m = len(where)
        out[where] = offset + ((np.arange(m) * n) // max(m, 1) if m <= n else np.arange(m) % n)
        offset += n
    return out


# --- A blend of prepared corpora, read as one ---

class ConcatRows:
    """The [rows, seq_len + 1] views of several corpora as one: row i of source j is row
    offsets[j] + i. Indexing with an array gathers from each source in turn."""

    def __init__(self, parts: list):
        self.parts = parts
        self.offsets = np.cumsum([0] + [len(p) for p in parts])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, indices) -> np.ndarray:
        indices = np.asarray(indices, dtype=np.int64)
        source = np.searchsorted(self.offsets, indices, side="right") - 1
        out = np.zeros((len(indices), self.parts[0].shape[1]), np.int64)
        for j, part in enumerate(self.parts):
            picked = source == j
            if picked.any():
                rows = part[indices[picked] - self.offsets[j]]
                out = out.astype(rows.dtype, copy=False)  # the sources' token dtype (one tokenizer: one dtype)
                out[picked] = rows
        return out


class BlendedCorpus:
    """Prepared corpora (data.Corpus) blended by weight, with the Corpus interface the loaders use.
    Each source keeps its own held-out tail (data.val_fraction of its tokens)."""

    def __init__(self, corpora: list, weights: Sequence[float]):
        first = corpora[0]
        for c in corpora[1:]:
            if (c.vocab_size, c.eot_id, c.meta.get("tokenizer")) != (first.vocab_size, first.eot_id, first.meta.get("tokenizer")):
                raise ConfigError("data.sources", f"{c.meta.get('source')!r} was tokenized unlike {first.meta.get('source')!r}",
                                  "give the blend one data.tokenizer")
        self.corpora, self.weights, self.units = list(corpora), tuple(weights), weight_units(weights)
        self.vocab_size, self.eot_id = first.vocab_size, first.eot_id
        self.names = [c.path.name for c in corpora]
        self.meta = {"blend": [dict(c.meta, weight=w) for c, w in zip(corpora, weights)],
                     "vocab_size": first.vocab_size, "eot_id": first.eot_id, "tokenizer": first.meta.get("tokenizer"),
                     "tokens": sum(int(c.meta["tokens"]) for c in corpora)}

    def sizes(self, split: str, seq_len: int) -> list:
        return [c.num_sequences(split, seq_len) for c in self.corpora]

    def num_sequences(self, split: str, seq_len: int) -> int:
        return sum(self.sizes(split, seq_len))

    def sequences(self, split: str, seq_len: int) -> ConcatRows:
        return ConcatRows([c.sequences(split, seq_len) for c in self.corpora])

    def decode(self, ids) -> str:
        return self.corpora[0].decode(ids)


def shares(corpus, split: str, seq_len: int) -> tuple:
    """(each source's sequences, weight units, cache names) of a corpus, blended or not."""
    if isinstance(corpus, BlendedCorpus):
        return corpus.sizes(split, seq_len), corpus.units, corpus.names
    return [corpus.num_sequences(split, seq_len)], (1,), [corpus.path.name]


def sample_index(corpus, seq_len: int, seed: int, samples: int, cache_dir: Optional[Path]) -> SampleIndex:
    """The training stream's index over a corpus (one data.Corpus or a BlendedCorpus)."""
    sizes, units, names = shares(corpus, "train", seq_len)
    return SampleIndex(sizes, units, seed, samples, cache_dir, names)


# --- Configuration ---

def source_configs(cfg) -> list:
    """One data config per source: data.sources' entries over the shared data.* settings, or the
    config itself when data.sources is empty."""
    if not cfg.sources:
        return [cfg]
    overrides = lambda s: {k: v for k, v in dataclasses.asdict(s).items() if k != "weight" and v is not None}
    return [dataclasses.replace(cfg, sources=[], **overrides(s)) for s in cfg.sources]


def combine(corpora: list, cfg):
    """The corpus training reads: the one prepared corpus, or the blend of data.sources."""
    return corpora[0] if not cfg.sources else BlendedCorpus(corpora, [s.weight for s in cfg.sources])


def check_config(cfg, check_source: Callable) -> None:
    """data.sources' one-line errors, found without loading anything; check_source is data.check_config."""
    if not cfg.sources:
        return
    if cfg.tokenizer == "bpe" and len(cfg.sources) > 1:
        raise ConfigError("data.tokenizer", "bpe trains one tokenizer per corpus, so blended sources would not share "
                          "token ids", "use bytes or a Hugging Face tokenizer (e.g. gpt2) with data.sources")
    for i, (s, one) in enumerate(zip(cfg.sources, source_configs(cfg))):
        if not (isinstance(s.weight, (int, float)) and math.isfinite(s.weight) and s.weight > 0):
            raise ConfigError(f"data.sources[{i}].weight", f"{s.weight} is not a positive number",
                              "give every source a positive weight (weights are normalised to shares)")
        try:
            check_source(one)
        except ConfigError as err:  # the same check as data.source's, named by the entry
            head, _, fix = str(err).partition(". Fix: ")
            raise ConfigError(f"data.sources[{i}]" + err.key.removeprefix("data"), head.split(f"{err.key}: ", 1)[-1],
                              fix) from None
    try:
        weight_units([s.weight for s in cfg.sources])
    except ValueError:
        raise ConfigError("data.sources", "a weight is below a millionth of their total",
                          f"raise it, or drop the source (weights: {[s.weight for s in cfg.sources]})") from None
