"""Checkpoints: save and resume everything a run needs to continue bit for bit.

A checkpoint holds model, optimizer, scheduler, data-sampler position and RNG states. Writes are
atomic (a temporary file, then a rename), so a crash mid-save never leaves a file that looks
complete; resume=auto takes the newest complete one.

Layout: <dir>/step_<N>/ holds one file per mesh position that has unique state, and a manifest
written last.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch


@dataclass
class CheckpointConfig:
    dir: Optional[str] = None     # None: <run dir>/checkpoints
    interval: int = 0             # steps between saves; 0 saves only at the end
    keep: int = 3                 # newest checkpoints kept; older ones are deleted


STEP_DIR = re.compile(r"step_(\d{8})$")
MANIFEST = "manifest.json"


def step_dir(ckpt_dir: Path, step: int) -> Path:
    return Path(ckpt_dir) / f"step_{step:08d}"


def shard_name(pp: int = 0, tp: int = 0, dp: int = 0) -> str:
    """One file per mesh position. Data-parallel replicas hold the same state, so without ZeRO only
    dp rank 0 writes, and every replica reads that file back."""
    return f"pp{pp}_tp{tp}_dp{dp}.pt"


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_shard(ckpt_dir: Path, step: int, name: str, state: dict) -> Path:
    """Write one rank's state atomically into the step's folder."""
    folder = step_dir(ckpt_dir, step)
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / name
    tmp = final.with_name(final.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)  # atomic on POSIX: readers see no file or the whole file
    return final


def mark_complete(ckpt_dir: Path, step: int, keep: int = 0) -> Path:
    """Write the manifest (file names, sizes, sha256) last, once every rank's file is in place: a
    step folder without it is an interrupted save and is never loaded. Then keep the newest `keep`."""
    folder = step_dir(ckpt_dir, step)
    files = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(folder.iterdir()) if p.suffix == ".pt"}
    tmp = folder / f"{MANIFEST}.tmp{os.getpid()}"
    tmp.write_text(json.dumps({"step": step, "files": files}, indent=1))
    os.replace(tmp, folder / MANIFEST)
    if keep > 0:
        for old in complete_checkpoints(ckpt_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return folder


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def complete_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Step folders that have a manifest, in step order."""
    if not Path(ckpt_dir).is_dir():
        return []
    return sorted(p for p in Path(ckpt_dir).iterdir() if STEP_DIR.search(p.name) and (p / MANIFEST).exists())


def latest(ckpt_dir: Path) -> Optional[Path]:
    found = complete_checkpoints(ckpt_dir)
    return found[-1] if found else None


def load_shard(folder: Path, name: str) -> dict:
    # weights_only=False: the state holds RNG tuples and numpy arrays, and we wrote it ourselves.
    return torch.load(Path(folder) / name, map_location="cpu", weights_only=False)


def consolidate_model(folder: Path) -> dict:
    """The full, layout-free model state of a checkpoint: pipeline stages' parameters merged and
    tensor-parallel slices concatenated back along the dim they were split on."""
    from parallel import tp_shard_dim
    files = sorted(Path(folder).glob("pp*_tp*_dp0.pt"))
    pieces: dict = {}
    for f in files:
        tp = int(re.search(r"_tp(\d+)_", f.name).group(1))
        for name, tensor in load_shard(folder, f.name)["model"].items():
            pieces.setdefault(name, {})[tp] = tensor
    full = {}
    for name, by_tp in pieces.items():
        dim = tp_shard_dim(name)
        ordered = [by_tp[t] for t in sorted(by_tp)]
        full[name] = ordered[0] if dim is None else torch.cat(ordered, dim=dim)
    return full
