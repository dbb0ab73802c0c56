"""The three kinds of tokenizer behind one small interface (encode_batch, decode, vocab_size,
eot_id): UTF-8 bytes, a byte-level BPE trained on a sample of the corpus, or any Hugging Face
tokenizer by name or path."""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterable

import numpy as np

from errors import ConfigError

EOT = "<|endoftext|>"


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


def identity(cfg) -> dict:
    """What determines the tokenizer: its kind and settings, or a saved tokenizer's files."""
    if cfg.tokenizer == "bytes":
        return {"kind": "bytes"}
    if cfg.tokenizer == "bpe":  # trained on a sample of the corpus, which the build's key covers
        return {"kind": "bpe", "vocab_size": cfg.bpe_vocab_size, "sample_bytes": cfg.bpe_sample_bytes}
    path = Path(cfg.tokenizer).expanduser()
    if path.exists():  # a saved tokenizer: its files are its identity
        digest = hashlib.sha256()
        for p in sorted(path.rglob("*") if path.is_dir() else [path], key=str):
            if p.is_file():
                digest.update(p.name.encode() + b"\0" + p.read_bytes())
        return {"kind": "hf", "path": str(path.resolve()), "sha256": digest.hexdigest()}
    return {"kind": "hf", "name": cfg.tokenizer}


def load(spec: dict, folder: Path):
    """The tokenizer a built corpus records (its manifest's `tokenizer`), from its folder."""
    if spec["kind"] == "bytes":
        return ByteTokenizer()
    if spec["kind"] == "bpe":
        return BPETokenizer.load(Path(folder) / "tokenizer.json")
    return HFTokenizer(spec.get("path") or spec["name"])


def encode(tokenizer, texts: list[str]) -> tuple[np.ndarray, np.ndarray, int]:
    """A batch of documents as (their tokens concatenated, each followed by end-of-text, as
    uint32; each document's length; the batch's UTF-8 bytes)."""
    ids = tokenizer.encode_batch(texts)
    lengths = np.fromiter((len(d) + 1 for d in ids), dtype=np.int64, count=len(ids))
    out = np.empty(int(lengths.sum()), dtype=np.uint32)
    ends = np.cumsum(lengths)
    for doc, end, n in zip(ids, ends.tolist(), lengths.tolist()):
        out[end - n: end - 1] = doc
        out[end - 1] = tokenizer.eot_id
    return out, lengths, sum(len(t.encode("utf-8")) for t in texts)
