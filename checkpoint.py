"""Checkpoints: save and resume everything a run needs to continue bit for bit.

A checkpoint holds model, optimizer, scheduler, data-sampler position and RNG states. Writes are
atomic (a temporary file, then a rename), so a crash mid-save never leaves a file that looks
complete; resume=auto takes the newest complete one.
"""
from __future__ import annotations

import os
import random
import re
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


NAME = re.compile(r"step_(\d{8})\.pt$")


def path_for(ckpt_dir: Path, step: int) -> Path:
    return Path(ckpt_dir) / f"step_{step:08d}.pt"


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


def save(ckpt_dir: Path, step: int, state: dict, keep: int = 0) -> Path:
    """Write state atomically as step_<step>.pt and prune to the newest `keep` (0 keeps all)."""
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    final = path_for(ckpt_dir, step)
    tmp = final.with_name(final.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)  # atomic on POSIX: readers see the old state or the whole new file
    if keep > 0:
        for old in complete_checkpoints(ckpt_dir)[:-keep]:
            old.unlink(missing_ok=True)
    return final


def complete_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Checkpoint files in step order. Temporary files of an interrupted save never match."""
    if not Path(ckpt_dir).is_dir():
        return []
    return sorted(p for p in Path(ckpt_dir).iterdir() if NAME.search(p.name))


def latest(ckpt_dir: Path) -> Optional[Path]:
    found = complete_checkpoints(ckpt_dir)
    return found[-1] if found else None


def load(path: Path) -> dict:
    # weights_only=False: the state holds RNG tuples and numpy arrays, and we wrote it ourselves.
    return torch.load(path, map_location="cpu", weights_only=False)
