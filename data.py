"""Data: load a corpus, tokenize, pack into a memory-mapped token file, sample deterministically.
(The full pipeline is being written; this holds the config contract.)"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class DataConfig:
    source: str = "stdlib"        # stdlib | a local file, folder or glob | a Hugging Face hub name
    format: str = "auto"          # auto | text | json | parquet
    text_field: str = "text"
    tokenizer: str = "bpe"        # bytes | bpe | a Hugging Face tokenizer name or path
    bpe_vocab_size: int = 4096
    max_bytes: Optional[int] = None
    val_fraction: float = 0.01
    cache_dir: Optional[str] = None  # None: $MEGAREPRO_CACHE, else ~/.cache/megarepro
    prefetch: int = 2
    pipeline: str = "naive"       # naive | megascale


def check_config(cfg: DataConfig) -> None:
    """Raise config.ConfigError for a bad data setting (e.g. a missing local path)."""
