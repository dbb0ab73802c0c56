"""Checkpoints: sharded, layout-free and optionally asynchronous (MegaScale's two-stage save).

Every rank saves the pieces it holds, in parallel, through torch.distributed.checkpoint (DCP). A
piece is stored at its place in the *logical* tensor (the whole parameter, as one process would
hold it), so a checkpoint does not know the layout that wrote it: a run at any other (tp, pp,
vpp, dp, zero_stage) asks for its own pieces and DCP reads the overlapping parts. That is what
torchtitan #811/#850 and Megatron's optimizer-state resharding ask for.

What a rank holds, in logical coordinates: TP slices a parameter along its split dim (the offset
and the number of ranks holding the same slice, its parallelisms/sharding.py ShardInfo); ZeRO 1-3 then keeps a flat range of that slice's values (parallelisms/zero.py), which is
up to three rectangles: a partial row, whole rows, a partial row. DTensor cannot express a flat
range of a TP slice, so those rectangles are written as DCP write items directly
(parallelisms/placement.py's Chunks).

A checkpoint holds model, optimizer (ZeRO shards included), scheduler, data-sampler position
(counted in sequences, so any dp continues the same stream), every rank's RNG state, and the
resolved config. What is not a tensor is a DCP bytes item holding JSON (our planners write and
read its bytes as they are; DCP's own would pickle them), the RNG's ByteTensors are tensors, and
a "format" item says so (FORMAT): a load unpickles nothing of ours, DCP's .metadata is the one
pickle left. checkpoint.async_save=true (`async` is a Python keyword): a snapshot to host
memory, after which training continues, and a background thread writes it; the next save waits
only if that one is still being written. A manifest (every file's size and sha256) is written
last, by rank 0 once DCP has finished on every rank: a folder without it, or whose files do not
match it, is never loaded; resume=auto takes the newest one that verifies. The newest K are kept.

`python export_hf.py CKPT OUT` writes one as a transformers GPT-NeoX model.
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import random
import re
import shutil
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from errors import ConfigError
from parallelisms.placement import Chunks, model_chunks, optimizer_chunks

log = logging.getLogger("checkpoint")


@dataclass
class CheckpointConfig:
    dir: Optional[str] = None     # None: <run dir>/checkpoints
    interval: int = 0             # steps between saves (and at the end); 0 saves only when a signal stops the run
    keep: int = 3                 # newest complete checkpoints kept; older ones are deleted
    async_save: bool = False      # snapshot to host memory, then write in the background


STEP_DIR = re.compile(r"step_(\d{8})$")
MANIFEST = "manifest.json"
PARTIAL = ".partial"  # a save being written: step_<N>.partial, renamed to step_<N> once complete
REPLACED = ".old"     # a complete save of the same step, moved aside for a moment by publish()


def step_dir(ckpt_dir: Path, step: int) -> Path:
    return Path(ckpt_dir) / f"step_{step:08d}"


def publish(partial: Path, folder: Path) -> None:
    """Put a finished save (its manifest written) in place with a rename, so a step folder is always
    whole: a crash leaves a step_<N>.partial, never a step_<N> with half its files. A folder
    already there (the same step, saved by an earlier attempt) is moved aside first and removed
    after; a crash between the two renames leaves it as step_<N>.old, which recover() puts back."""
    old = folder.with_name(folder.name + REPLACED)
    if folder.exists():
        shutil.rmtree(old, ignore_errors=True)
        folder.rename(old)
    partial.rename(folder)
    shutil.rmtree(old, ignore_errors=True)


def recover(ckpt_dir: Path) -> None:
    """What a crash left mid-save (rank 0, before a run saves): a step moved aside by publish()
    goes back where it was, and unfinished saves are removed (their steps are saved again)."""
    if not Path(ckpt_dir).is_dir():
        return
    for old in sorted(Path(ckpt_dir).glob(f"step_*{REPLACED}")):
        folder = old.with_name(old.name[:-len(REPLACED)])
        if folder.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.rename(folder)
            log.warning("put back %s, which a crash left moved aside", folder)
    for partial in sorted(Path(ckpt_dir).glob(f"step_*{PARTIAL}")):
        log.warning("removing %s: a save that a crash interrupted", partial)
        shutil.rmtree(partial, ignore_errors=True)


def rng_state(device: Optional[torch.device] = None) -> dict:
    """Every generator this rank draws from: the host's, and its own GPU's (only the run's device:
    a restart may see fewer GPUs, or the same GPU under another index). Python's and numpy's
    states as plain lists (JSON), torch's as their ByteTensors."""
    version, words, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": [version, list(words), gauss], "numpy": [kind, keys.tolist(), pos, has_gauss, cached],
             "torch": torch.get_rng_state()}
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: Optional[torch.device] = None) -> None:
    version, words, gauss = state["python"]
    random.setstate((version, tuple(words), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if device is not None and device.type == "cuda" and torch.is_tensor(state.get("cuda")):
        torch.cuda.set_rng_state(state["cuda"], device)


# --- A rank's state as DCP items ---

class Staging:
    """Stage 1 of an asynchronous save: every tensor of a rank's state copied into one host buffer
    (pinned where the state is on a GPU, so the copies are asynchronous DMA), made at the first
    save and reused by every later one. Pinning is a page-locking system call that costs far more
    than the copy, and pinned blocks allocated per piece per save would grow the host's pinned
    pool by a checkpoint's share every save. The caller waits for the previous save's writer
    before staging again: the buffer holds one snapshot at a time."""

    ALIGN = 64  # bytes: every piece starts aligned for any dtype's view

    def __init__(self):
        self.buffer: Optional[torch.Tensor] = None  # uint8, the rank's whole snapshot

    def stage(self, state: dict) -> dict:
        tensors = [t for v in state.values() for t in
                   ([t for _, t in v.pieces] if isinstance(v, Chunks) else [v] if torch.is_tensor(v) else [])]
        sizes = [-(-t.numel() * t.element_size() // self.ALIGN) * self.ALIGN for t in tensors]
        if self.buffer is None or self.buffer.numel() < sum(sizes):
            pin = any(t.device.type == "cuda" for t in tensors)
            self.buffer = None  # the old one goes before the new one is allocated
            self.buffer = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=pin)
        views, offset = {}, 0
        for t, size in zip(tensors, sizes):
            nbytes = t.numel() * t.element_size()
            view = self.buffer[offset:offset + nbytes].view(t.dtype).view(t.shape)
            views[id(t)] = view.copy_(t.detach(), non_blocking=True)
            offset += size
        return {k: Chunks(v.shape, [(o, views[id(t)]) for o, t in v.pieces]) if isinstance(v, Chunks)
                else views[id(v)] if torch.is_tensor(v) else v for k, v in state.items()}


def training_state(step: int, engine, optimizer, scheduler, loader, config: dict) -> dict:
    """Everything a run needs to continue, as DCP keys: tensors (views into live state), and the
    rest as JSON, encoded now (an asynchronous save writes the values of this step)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {**model_chunks(engine), **optimizer_chunks(engine, optimizer),
            "optim/param_groups": _blob(groups), "scheduler": _blob(scheduler.state_dict()),
            "loader": _blob(loader.state_dict()), **rng_items(rank, engine.device),
            "step": _blob(step), "config": _blob(config)}


def rng_items(rank: int, device: Optional[torch.device] = None) -> dict:
    """This rank's generators: rng/<rank> (Python's and numpy's, JSON) and rng/<rank>/torch and
    /cuda (ByteTensors, stored as tensors)."""
    state = rng_state(device)
    tensors = {f"rng/{rank}/{k}": state.pop(k) for k in RNG_TENSORS if k in state}
    return {f"rng/{rank}": _blob(state), **tensors}


RNG_TENSORS = ("torch", "cuda")
FORMAT = 2  # the "format" item: 1 (no item) pickled the non-tensor state, 2 stores it as JSON


def _blob(obj) -> io.BytesIO:
    """A non-tensor value (plain numbers, strings, lists, dicts) as one DCP bytes item: JSON."""
    return io.BytesIO(json.dumps(obj).encode())


def _unblob(value: io.BytesIO) -> object:
    return json.loads(value.getvalue())


class _SavePlanner(DefaultSavePlanner):
    """DCP's planner, finding a Chunks' rectangle by its offsets, and writing a bytes item's bytes
    as they are (DCP's own torch.saves, that is pickles, whatever object it is given)."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex):
        obj = self.state_dict[index.fqn]
        return obj.tensor_at(index.offset) if isinstance(obj, Chunks) else super().lookup_object(index)

    def transform_object(self, write_item: WriteItem, obj):
        if write_item.type != WriteItemType.BYTE_IO:
            return super().transform_object(write_item, obj)
        if not isinstance(obj, io.BytesIO):
            raise TypeError(f"checkpoint item {write_item.index.fqn} is a {type(obj).__name__}: "
                            "save tensors, or other values as checkpoint._blob(value) (JSON)")
        return io.BytesIO(obj.getvalue())


class _LoadPlanner(DefaultLoadPlanner):
    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # Not the default's: its meta-tensor initialisation replaces values of unknown types with None.
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        return obj.tensor_at(index.offset) if isinstance(obj, Chunks) else super().lookup_tensor(index)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        self.state_dict[read_item.dest_index.fqn] = value  # the bytes as stored (DCP's own would unpickle them)


# --- Saving ---

class Saver:
    """Saves through DCP on a gloo group of its own, so that a background save's collectives never
    interleave with training's. With async_save, save() snapshots to host memory and returns; a
    thread writes, then rank 0 writes the manifest and prunes old checkpoints."""

    def __init__(self, ckpt_dir: Path, keep: int = 3, async_save: bool = False, timeout_s: Optional[float] = None):
        self.ckpt_dir, self.keep, self.async_save = Path(ckpt_dir), keep, async_save
        self.distributed = dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        from launch import checkpoint_group
        self.group = checkpoint_group(timeout_s) if self.distributed else None  # no connection made yet
        if self.rank == 0:
            recover(self.ckpt_dir)
        if self.distributed:  # no rank looks for or writes a checkpoint before rank 0 has recovered them
            dist.barrier()     # (the world group's: its connections exist already)
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self.last_step: Optional[int] = None
        self.stall_s: list = []  # per save: how long training waited for it
        self.failed: list = []   # steps whose save failed (the previous checkpoints stay)
        self.write_error: Optional[OSError] = None  # fault_injection.py: a full disk, once
        self.write_delay = 0.0                       # and a slow one
        self.staging = Staging()                     # the asynchronous saves' host buffer

    def save(self, step: int, state: dict) -> None:
        import time
        t0 = time.perf_counter()
        self.wait()  # the next save waits only while the previous one is being written
        self.last_step = step
        if not self.async_save:
            self._write_logging_failure(step, state)
        else:
            staged = self.staging.stage(state)
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the non-blocking copies have landed before training moves on
            self._thread = threading.Thread(target=self._write_in_background, args=(step, staged),
                                            name=f"checkpoint-{step}", daemon=True)
            self._thread.start()
        self.stall_s.append(time.perf_counter() - t0)

    def _write_in_background(self, step: int, state: dict) -> None:
        try:
            self._write_logging_failure(step, state)
        except BaseException as e:  # raised in the training thread at the next wait()
            self._error = e

    def _write_logging_failure(self, step: int, state: dict) -> None:
        """A save that fails on any rank (a full disk: DCP reports every rank's errors to all)
        is logged and its folder removed; training goes on and the next save tries again."""
        error, self.write_error = self.write_error, None
        try:
            self._write(step, state, error)
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            if not _storage_failure(e):
                raise
            self.failed.append(step)
            log.error("checkpoint at step %d failed (%s); keeping the previous ones, training goes on",
                      step, str(e).strip().splitlines()[-1][:200])
            if self.rank == 0:
                partial = step_dir(self.ckpt_dir, step)
                shutil.rmtree(partial.with_name(partial.name + PARTIAL), ignore_errors=True)

    def _write(self, step: int, state: dict, error: Optional[OSError] = None) -> None:
        """Into step_<N>.partial: DCP's files, then the manifest; then rank 0 renames it step_<N>."""
        folder = step_dir(self.ckpt_dir, step)
        partial = folder.with_name(folder.name + PARTIAL)
        written = write_dcp(partial, state, self.group, error=error, delay=self.write_delay)
        mark_complete_together(partial, self.group, written)
        if self.rank == 0:
            publish(partial, folder)
            prune(self.ckpt_dir, self.keep)
            log.info("saved %s", folder)

    def close(self) -> None:
        """The run's end, failed or not: an asynchronous save being written is finished (a crash
        loses no checkpoint; its error, if any, was the training thread's to raise in wait())."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"the background checkpoint save failed: {error}") from error


def _dcp(op, state: dict, **kwargs):
    """dcp.save or dcp.load, in one process when torch.distributed is not initialised (where DCP
    warns that it assumes so: that is the intent here)."""
    single = not dist.is_initialized()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return op(state, no_dist=single, **kwargs)


def _storage_failure(e: BaseException) -> bool:
    """A save that failed in the filesystem on every rank that failed (OSError: a full disk, a
    lost mount), which training survives; anything else is a bug and propagates."""
    if isinstance(e, OSError):
        return True
    failures = getattr(e, "failures", None)
    return bool(failures) and all(isinstance(exc, OSError) for exc, _ in failures.values())


class _Writer(dcp.FileSystemWriter):
    """DCP's file writer, keeping the names of this rank's files, with fault_injection.py's faults (an error, a delay)."""

    def __init__(self, folder: Path, error: Optional[OSError] = None, delay: float = 0.0):
        super().__init__(folder, sync_files=True)
        self.error, self.delay = error, delay
        self.coordinator, self.results = False, None

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        self.coordinator = is_coordinator

    def write_data(self, plan, planner):
        if self.delay:
            import time
            time.sleep(self.delay)
        if self.error is not None:
            raise self.error
        self.results = super().write_data(plan, planner)
        return self.results

    def own_files(self) -> list:
        """This rank's files (__<rank>_<n>.distcp; the coordinator's also .metadata), from its own write
        results: no rank lists a folder of a file per rank, and the metadata dcp.save returns lists
        every rank's files on some torch versions only (2.11 returns it without them)."""
        names = {result.storage_data.relative_path for result in self.results.wait()}
        return sorted(names) + [".metadata"] * self.coordinator


def write_dcp(folder: Path, state: dict, group=None, error: Optional[OSError] = None, delay: float = 0.0) -> list:
    """DCP save by every rank of the group (one process when not distributed), stamped with this
    code's FORMAT; returns the files this rank wrote."""
    folder.mkdir(parents=True, exist_ok=True)
    state = {**state, "format": _blob(FORMAT)}
    writer = _Writer(folder, error, delay)
    _dcp(dcp.save, state, storage_writer=writer, planner=_SavePlanner(), process_group=group)
    return writer.own_files()


def own_files(metadata, rank: int) -> list:
    """The files rank `rank` wrote, from a saved checkpoint's metadata (.metadata)."""
    names = {info.relative_path for info in metadata.storage_data.values()}
    return sorted(n for n in names if n.startswith(f"__{rank}_")) + [".metadata"] * (rank == 0)


def file_digests(folder: Path, names: list) -> dict:
    return {name: {"bytes": (folder / name).stat().st_size, "sha256": _sha256(folder / name)} for name in names}


def mark_complete_together(folder: Path, group=None, written: Optional[list] = None) -> None:
    """Every rank of the group hashes the files it wrote (`written`: their names, as write_dcp
    returns them; None: read from the folder's metadata), at once, and rank 0, alone, gathers the
    digests and writes the manifest: at 175B a checkpoint is ~2 TB, which one rank alone would read
    for longer than the hang and collective timeouts allow."""
    rank = dist.get_rank(group) if group is not None else 0
    if written is None:
        written = own_files(dcp.FileSystemReader(folder).read_metadata(), dist.get_rank() if group is not None else 0)
    mine = file_digests(folder, written)
    everyone = [mine]
    if group is not None:
        everyone = [None] * dist.get_world_size(group) if rank == 0 else None
        dist.gather_object(mine, everyone, dst=0, group=group)
    if rank == 0:
        mark_complete(folder, {k: v for d in everyone for k, v in d.items()})


def mark_complete(folder: Path, files: Optional[dict] = None) -> Path:
    """Write the manifest (every file's size and sha256; `files` when the ranks hashed their own,
    so that no rank lists a folder holding a file per rank) last, atomically: a step folder
    without it is an interrupted save and is never loaded."""
    if files is None:  # one process: every file in the folder (the ranks' own lists, when given, name them all)
        on_disk = [p.name for p in sorted(folder.iterdir()) if p.is_file() and not p.name.startswith(MANIFEST)]
        files = file_digests(folder, on_disk)
    files = dict(sorted(files.items()))
    tmp = folder / f"{MANIFEST}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        step = int(STEP_DIR.search(folder.name.removesuffix(PARTIAL)).group(1))
        f.write(json.dumps({"step": step, "files": files}, indent=1))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / MANIFEST)
    return folder


def prune(ckpt_dir: Path, keep: int) -> None:
    if keep > 0:
        for old in complete_checkpoints(ckpt_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# --- Finding and loading ---

def complete_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Step folders that have a manifest, in step order (not yet verified against it)."""
    if not Path(ckpt_dir).is_dir():
        return []
    return sorted(p for p in Path(ckpt_dir).iterdir() if STEP_DIR.search(p.name) and (p / MANIFEST).exists())


def problem(folder: Path, checksums: bool = True, group=None) -> Optional[str]:
    """Why a step folder must not be loaded, or None: no manifest, or a file missing, of another
    size (truncated), or with another sha256 than the manifest lists. With a process group, every
    rank of it calls this and checks every world-th file (in parallel: a file-system call or two
    per file it checks, not per file of the checkpoint), and one all-reduce of the first failure
    (the manifest's order; -1: the manifest itself) gives every rank the same answer."""
    files, why = _manifest_files(folder)
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    names = list(files or {})
    first = -1 if why else 2 * len(names)  # 2 x (the first failing file's place) + 1 if its checksum failed
    for k in range(rank, len(names) if files else 0, world):
        path, meta = folder / names[k], files[names[k]]
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            size = None
        if size != meta["bytes"] or (checksums and _sha256(path) != meta["sha256"]):
            first = 2 * k + (size == meta["bytes"])
            break
    if group is not None:
        verdict = torch.tensor([first], dtype=torch.int64)
        dist.all_reduce(verdict, op=dist.ReduceOp.MIN, group=group)
        first = int(verdict.item())
    if first == -1:
        return why or f"{folder}'s {MANIFEST} is missing or unreadable on another rank"
    if first == 2 * len(names):
        return None
    path = folder / names[first // 2]
    return (f"{path} does not match its manifest's sha256" if first % 2 else
            f"{path} is missing or not the size its manifest lists (truncated?)")


def _manifest_files(folder: Path) -> tuple:
    """(the manifest's {file: {bytes, sha256}}, None), or (None, why it cannot be used)."""
    if not (folder / MANIFEST).exists():
        return None, f"{folder} has no {MANIFEST}: an interrupted save"
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"]
    except (ValueError, KeyError, TypeError) as err:  # written atomically, so a hand edit or a bad copy
        return None, f"{folder}'s {MANIFEST} is unreadable ({type(err).__name__})"
    if ".metadata" not in files:
        return None, f"{folder}'s manifest lists no DCP .metadata"
    return files, None


def latest(ckpt_dir: Path, group=None) -> Optional[Path]:
    """The newest checkpoint that verifies; broken ones are logged and skipped. With a group, its
    ranks verify together (problem()); they must see the same folders (a shared filesystem)."""
    for folder in reversed(complete_checkpoints(ckpt_dir)):
        why = problem(folder, group=group)
        if why is None:
            return folder
        log.warning("skipping checkpoint: %s", why)
    return None


def saved_keys(folder: Path) -> dict:
    return dcp.FileSystemReader(folder).read_metadata().state_dict_metadata


def _read_alone(folder: Path, state: dict) -> None:
    """Fill `state` from a checkpoint in this process alone, whatever else is running."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=dcp.FileSystemReader(folder), planner=_LoadPlanner(), no_dist=True)


def read_blob(folder: Path, key: str):
    """One non-tensor value (config, step, ...), read by this process alone."""
    state = {"format": io.BytesIO(), key: io.BytesIO()}
    if "format" not in saved_keys(folder):
        check_format(folder, 1, "CKPT")
    _read_alone(folder, state)
    check_format(folder, _unblob(state["format"]), "CKPT")
    return _unblob(state[key])


def check_format(folder: Path, found: int, key: str) -> None:
    """ConfigError (under `key`) for a checkpoint of another format than FORMAT (`found`: its
    "format" item, 1 where it has none): one whose non-tensor state is pickled, or a newer one."""
    if found < FORMAT:
        raise ConfigError(key, f"{folder} is in checkpoint format {found}, whose optimizer, scheduler, data and "
                          f"RNG state are pickled; this version reads format {FORMAT} (JSON) only",
                          "resume=none to start afresh, or continue (or export) it with the commit that saved it")
    if found > FORMAT:
        raise ConfigError(key, f"{folder} is in checkpoint format {found}, newer than this version's {FORMAT}",
                          "use the version of megarepro that saved it")


def load(folder: Path, engine, optimizer, scheduler, loader, group=None) -> int:
    """Load a checkpoint saved at any layout into this one; returns its step. Each rank asks for
    its own pieces (views into its parameters and fresh optimizer-state tensors)."""
    saved = saved_keys(folder)
    if "format" not in saved:
        check_format(folder, 1, "resume")
    rank = dist.get_rank() if dist.is_initialized() else 0
    opt_meta = {k: m for k, m in saved.items() if k.startswith("optim/") and isinstance(m, TensorStorageMetadata)}
    state = {**model_chunks(engine), **optimizer_chunks(engine, optimizer, template=opt_meta)}
    missing = sorted(k for k in state if k not in saved)
    if missing:
        raise ConfigError("resume", f"{folder} has no {missing[0]} (and {len(missing) - 1} more keys): "
                          f"another model?", "resume a checkpoint of this model, or resume=none")
    for key in (k for k in state if k.startswith("model/")):  # logical shapes: the same at any layout
        if tuple(saved[key].size) != tuple(state[key].size()):
            raise ConfigError("resume", f"{folder} holds {key} as {list(saved[key].size)}, this model as "
                              f"{list(state[key].size())}: another model", "resume a checkpoint of this model, or resume=none")
    blobs = ["format", "optim/param_groups", "scheduler", "loader", "step"] + [f"rng/{rank}"] * (f"rng/{rank}" in saved)
    state.update({k: io.BytesIO() for k in blobs})
    state.update(_rng_tensors(saved, rank, engine.device))
    _dcp(dcp.load, state, storage_reader=dcp.FileSystemReader(folder), planner=_LoadPlanner(), process_group=group)
    check_format(folder, _unblob(state["format"]), "resume")
    engine.parameters_loaded()  # re-derive the ZeRO shards from the parameters loaded in place
    _load_optimizer(engine, optimizer, state, _unblob(state["optim/param_groups"]))
    scheduler.load_state_dict(_unblob(state["scheduler"]))
    loader.load_state_dict(_unblob(state["loader"]))
    if f"rng/{rank}" in state:  # a run at another world size keeps its own seeds' streams
        rng = {k.rsplit("/", 1)[1]: v for k, v in state.items() if k.startswith(f"rng/{rank}/")}
        set_rng_state({**_unblob(state[f"rng/{rank}"]), **rng}, engine.device)
    return _unblob(state["step"])


def _rng_tensors(saved: dict, rank: int, device: Optional[torch.device]) -> dict:
    """Fresh tensors for this rank's saved generator states (its GPU's only where it runs on one)."""
    kinds = [k for k in RNG_TENSORS if k != "cuda" or (device is not None and device.type == "cuda")]
    keys = [f"rng/{rank}/{k}" for k in kinds if f"rng/{rank}/{k}" in saved]
    return {k: torch.empty(saved[k].size, dtype=saved[k].properties.dtype) for k in keys}


def _load_optimizer(engine, optimizer, state: dict, groups: list) -> None:
    """Through optimizer.load_state_dict, which puts each state tensor on its parameter's device
    and dtype (and the step where the fused AdamW wants it)."""
    index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    full = optimizer.state_dict()
    full["state"] = {}
    for i, shard in enumerate(engine.zero.shards):
        prefix = f"optim/{engine.names[i]}/"
        own = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        if own:
            full["state"][index[id(shard)]] = {k: v.backing.view(shard.shape) if isinstance(v, Chunks) else v
                                               for k, v in own.items()}
    for group, saved in zip(full["param_groups"], groups):  # JSON gave tuples (betas, trust_clamp) back as lists
        group.update({k: tuple(v) if isinstance(v, list) and k != "param_names" else v
                      for k, v in saved.items() if k != "params"})
    optimizer.load_state_dict(full)


# --- Reading a checkpoint whole, and what model it holds (export_hf.py, sampling, resume) ---

def consolidate_model(folder: Path) -> dict:
    """The full, layout-free model state of a checkpoint, read by this process alone: DCP puts
    every rank's pieces back together into the logical tensors."""
    saved = saved_keys(folder)
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in saved.items() if k.startswith("model/")}
    _read_alone(folder, state)
    return {k.removeprefix("model/"): t for k, t in state.items()}


def resolve_complete(path) -> Path:
    """PATH if it is a step folder that verifies against its manifest, or the newest such folder in
    a checkpoints dir (ConfigError otherwise)."""
    path = Path(path)
    fix = "give a step_* folder with a manifest.json, or a checkpoints dir holding one"
    if not path.exists():
        raise ConfigError("CKPT", f"{path} does not exist", fix)
    folder = path if STEP_DIR.search(path.name) else latest(path)
    if folder is None:
        raise ConfigError("CKPT", f"no complete checkpoint (step_*/{MANIFEST}) in {path}", fix)
    why = problem(folder)
    if why is not None:
        raise ConfigError("CKPT", why, fix)
    return folder


def model_mismatch(folder: Path, model_cfg) -> Optional[str]:
    """Why a checkpoint holds another model than model_cfg (from the config it saved), or None. A
    checkpoint of fewer layers would otherwise load into the first ones and train on."""
    if model_cfg is None or "config" not in saved_keys(folder):
        return None
    from model import identity
    try:
        theirs, ours = identity(saved_model_config(folder)), identity(model_cfg)
    except ConfigError:  # another checkpoint format, which load() refuses in one line
        return None
    differ = [f"{k} {theirs[k]} there, {ours[k]} here" for k in ours if theirs[k] != ours[k]]
    return f"{folder} is another model's checkpoint ({'; '.join(differ)})" if differ else None


def saved_model_config(folder: Path):
    """The ModelConfig the run trained with (train.py saves its resolved config)."""
    from omegaconf import OmegaConf
    from model import ModelConfig
    saved = read_blob(folder, "config")["model"]
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), saved))
