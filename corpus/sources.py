"""What a corpus is made of: its source's kind, its identity (without reading its bytes), the
units a build splits it into, and each unit's documents, read lazily.

A unit is a run of whole source files (local files, the standard library's) or one data file of a
hub dataset. Units are built independently, one shard or more each, so the build's output does
not depend on how its units are spread over worker processes or SLURM array jobs. A capped
source (data.max_bytes) is one unit: its cap runs over the whole stream.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import platform
import re
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

from errors import ConfigError

FORMATS = ("auto", "text", "json", "parquet")
_BY_EXTENSION = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}  # anything else is text
COMPRESSION = (".gz", ".bz2", ".xz", ".zst", ".lz4")
_DATA_SUFFIXES = (".txt", ".text", ".md", ".py", ".csv", ".json", ".jsonl", ".parquet") + COMPRESSION
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


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


def file_format(path: Path) -> str:
    name = path.name.lower()
    for suffix in COMPRESSION:
        name = name.removesuffix(suffix)
    return _BY_EXTENSION.get(Path(name).suffix, "text")


def local_format(fmt: str, files: list[Path]) -> str:
    if fmt != "auto":
        return fmt
    formats = sorted({file_format(p) for p in files})
    if len(formats) > 1:
        raise ConfigError("data.format", f"data.source mixes {' and '.join(formats)} files",
                          "set data.format explicitly or narrow data.source to one kind of file")
    return formats[0]


def stdlib_files() -> tuple[Path, list[Path]]:
    """The standard library's *.py files, in the order of their paths. Installed packages are not
    the standard library, and their folders are not even walked. Symlinked folders are followed."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for folder, dirs, names in os.walk(root, followlinks=True):
        dirs[:] = [d for d in dirs if d not in ("site-packages", "dist-packages")]
        found.extend(Path(folder) / n for n in names if n.endswith(".py"))
    return root, sorted(found, key=lambda p: p.relative_to(root).as_posix())


@dataclass
class Unit:
    files: list = field(default_factory=list)  # local or stdlib files, in stream order
    hub_shard: Optional[int] = None            # a hub dataset's data file (of hub_shards)
    hub_shards: int = 1
    size: int = 0                              # source bytes, for the progress bar (0: unknown)


@dataclass
class Plan:
    kind: str
    identity: dict                 # what the built corpus was made from; compared, never hashed from bytes
    meta: dict                     # what run.json records about the source
    units: Callable[[], list]      # the units (a hub dataset is asked for its files only when building)
    fmt: str = "text"
    field: str = "text"


def identity_of(cfg) -> tuple[dict, dict, list]:
    """(identity, meta, files) of cfg's source: file names, sizes and modification times, or the
    hub's name and revision. Reads no byte of the source."""
    kind = source_kind(cfg.source)
    if kind == "hub":
        ident = {"kind": "hub", "name": cfg.source, "subset": cfg.subset, "split": cfg.split,
                 "revision": cfg.revision, "field": cfg.text_field, "max_bytes": cfg.max_bytes}
        return ident, {"source": cfg.source, "subset": cfg.subset, "split": cfg.split, "revision": cfg.revision,
                       "text_field": cfg.text_field}, []
    if kind == "stdlib":
        root, files = stdlib_files()
        names = [p.relative_to(root).as_posix() for p in files]
        meta = {"source": "stdlib", "stdlib_path": str(root), "python_version": platform.python_version(),
                "python_implementation": platform.python_implementation()}
    else:
        files = local_files(cfg.source)
        if not files:
            raise ConfigError("data.source", f"{cfg.source!r} is not a hub name and matches no local file",
                              "give an existing file, folder or glob, a hub dataset name, or stdlib")
        names = [str(p.resolve()) for p in files]
        meta = {"source": cfg.source}
    stats = [p.stat() for p in files]
    listing = hashlib.sha256(json.dumps([[n, s.st_size, s.st_mtime_ns] for n, s in zip(names, stats)]).encode())
    ident = {"kind": kind, "files": len(files), "bytes": sum(s.st_size for s in stats), "listing": listing.hexdigest(),
             "max_bytes": cfg.max_bytes, **({k: meta[k] for k in ("python_version", "python_implementation")}
                                            if kind == "stdlib" else {})}
    return ident, meta, list(zip(files, (s.st_size for s in stats)))


def plan(cfg) -> Plan:
    ident, meta, files = identity_of(cfg)
    kind = ident["kind"]
    if kind == "hub":
        return Plan(kind, ident, meta, lambda: _hub_units(cfg), "hub", cfg.text_field)
    fmt = "text" if kind == "stdlib" else local_format(cfg.format, [p for p, _ in files])
    field_name = "text" if fmt == "text" else cfg.text_field
    ident.update(format=fmt, field=field_name)
    meta.update(format=fmt, text_field=field_name) if kind == "local" else None
    units = [Unit(files=[p for p, _ in files], size=sum(s for _, s in files))] if cfg.max_bytes is not None \
        else _group(files, cfg.shard_bytes)
    return Plan(kind, ident, meta, lambda: units, fmt, field_name)


def _group(files: list, target: int) -> list:
    """Consecutive files in units of about `target` source bytes (a larger file is a unit alone)."""
    units, current = [], Unit()
    for path, size in files:
        if current.files and current.size + size > target:
            units.append(current)
            current = Unit()
        current.files.append(path)
        current.size += size
    if current.files:
        units.append(current)
    return units


def _hub_dataset(cfg):
    import datasets
    try:
        return datasets.load_dataset(cfg.source, cfg.subset, split=cfg.split, revision=cfg.revision, streaming=True)
    except Exception as err:  # offline, a typo, a gated dataset: all end the build the same way
        reason = (str(err).strip().splitlines() or [""])[0][:200]
        raise ConfigError("data.source", f"could not load hub dataset {cfg.source!r} ({type(err).__name__}: {reason})",
                          "check the name and the network (or HF_DATASETS_OFFLINE), or use a local path or stdlib") from err


def _hub_units(cfg) -> list:
    if cfg.max_bytes is not None:
        return [Unit()]
    n = max(1, getattr(_hub_dataset(cfg), "n_shards", 1) or 1)
    return [Unit(hub_shard=k, hub_shards=n) for k in range(n)]


# --- Documents ---

def documents(cfg, p: Plan, unit: Unit, counts: Optional[dict] = None) -> Iterator[str]:
    """The unit's documents, read one file (or one hub record batch) at a time. counts, if given,
    gathers source_bytes and (stdlib) a sha256 of the raw bytes."""
    counts = {} if counts is None else counts
    if p.kind == "stdlib":
        docs = _stdlib_documents(unit.files, cfg.max_bytes, counts)
    elif p.kind == "local":
        docs = capped((d for path in unit.files for d in _file_documents(path, p.fmt, p.field)), cfg.max_bytes)
    else:
        docs = capped(_hub_documents(cfg, unit), cfg.max_bytes)
    yield from docs


def _stdlib_documents(files: list, max_bytes: Optional[int], counts: dict) -> Iterator[str]:
    # The corpus is the first max_bytes bytes of the files' concatenation. A few stdlib files are
    # deliberately not UTF-8 (encoding tests); they enter with U+FFFD.
    digest, total = hashlib.sha256(), 0
    for path in files:
        raw = path.read_bytes()
        if max_bytes is not None:
            raw = raw[: max_bytes - total]
        digest.update(raw)
        total += len(raw)
        counts["source_bytes"], counts["content_sha256"] = total, digest.hexdigest()
        yield raw.decode("utf-8", errors="replace")
        if max_bytes is not None and total >= max_bytes:
            return


def _open(path: Path, mode: str = "rb"):
    import fsspec
    return fsspec.open(str(path), mode, compression="infer").open()


def _file_documents(path: Path, fmt: str, field_name: str) -> Iterator[str]:
    if fmt == "text":  # one file is one document
        with _open(path) as f:
            text = f.read().decode("utf-8", errors="replace")
        if text:
            yield text
    elif fmt == "json":
        yield from _json_documents(path, field_name)
    else:
        yield from _parquet_documents(path, field_name)


def _json_documents(path: Path, field_name: str) -> Iterator[str]:
    with _open(path) as f:
        first = f.read(1)
        while first.isspace():
            first = f.read(1)
        if first == b"[":  # one JSON array rather than JSON lines: read whole
            records = _parsed(path, 1, first + f.read())
        else:
            records = (_parsed(path, n, line) for n, line in enumerate(_lines(first, f), 1) if line.strip())
        for i, record in enumerate(records):
            if not isinstance(record, dict) or field_name not in record:
                columns = ", ".join(record) if isinstance(record, dict) else type(record).__name__
                raise ConfigError("data.text_field", f"no column {field_name!r}; the dataset has {columns}",
                                  f"set data.text_field to the column that holds the text ({path}, record {i})")
            text = record[field_name]
            if isinstance(text, str) and text:
                yield text


def _parsed(path: Path, line: int, raw: bytes):
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError("data.source", f"{path}, line {line}, is not JSON ({getattr(err, 'msg', err)})",
                          "fix or remove the file (a truncated copy?), or set data.format to what it holds") from None


def _lines(first: bytes, f) -> Iterable[bytes]:
    line = first + f.readline()
    while line:
        yield line
        line = f.readline()


def _parquet_documents(path: Path, field_name: str) -> Iterator[str]:
    import pyarrow.parquet as pq
    import pyarrow
    with _open(path) as f:
        try:
            table = pq.ParquetFile(f)
        except (pyarrow.ArrowException, OSError) as err:
            raise ConfigError("data.source", f"{path} is not a readable parquet file ({str(err).splitlines()[0][:120]})",
                              "fix or remove the file (a truncated copy?), or set data.format to what it holds") from None
        if field_name not in table.schema_arrow.names:
            raise ConfigError("data.text_field", f"no column {field_name!r}; the dataset has "
                              f"{', '.join(table.schema_arrow.names)}", f"set data.text_field to the column that holds the text ({path})")
        for batch in table.iter_batches(columns=[field_name], batch_size=1024):
            yield from (t for t in batch.column(0).to_pylist() if isinstance(t, str) and t)


def _hub_documents(cfg, unit: Unit) -> Iterator[str]:
    ds = _hub_dataset(cfg)
    if unit.hub_shard is not None and unit.hub_shards > 1:
        ds = ds.shard(num_shards=unit.hub_shards, index=unit.hub_shard, contiguous=True)
    for i, record in enumerate(ds):
        if cfg.text_field not in record:
            raise ConfigError("data.text_field", f"no column {cfg.text_field!r}; the dataset has {', '.join(record)}",
                              "set data.text_field to the column that holds the text")
        text = record[cfg.text_field]
        if isinstance(text, str) and text:
            yield text


def capped(documents: Iterable[str], max_bytes: Optional[int]) -> Iterator[str]:
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
