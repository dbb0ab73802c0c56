"""Checkpoints: save and resume everything a run needs to continue bit for bit.

A checkpoint holds model, optimizer, scheduler, data-sampler position and RNG states. Writes are
atomic (a temporary file, then a rename), so a crash mid-save never leaves a file that looks
complete; resume=auto takes the newest complete one.

Layout: <dir>/step_<N>/ holds one file per mesh position that has unique state, and a manifest
written last. `python checkpoint.py export-hf CKPT OUT` writes one as a transformers GPT-NeoX model.
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


# --- Export to Hugging Face transformers: `python checkpoint.py export-hf CKPT OUT` ---
#
# Our GPT is GPT-NeoX's architecture, so a checkpoint becomes a transformers GPTNeoXForCausalLM by
# renaming alone: the same (head, q|k|v, head_dim) QKV rows, rotate-half RoPE with the same
# frequencies, exact-erf GeLU, pre-LN, attention scale 1/sqrt(head_dim), untied head. What differs:
# - HF's parallel residual normalises attention and MLP inputs with two LayerNorms; our PTB shares
#   one, so it is copied into both. Our sequential ln_2 is HF's post_attention_layernorm.
# - HF's LayerNorms and MLP always have biases; with model.bias=false they get zeros, which
#   computes the same. The attention biases follow HF's attention_bias flag.
# - GPT-NeoX has no sliding-window attention, so an SWA model is refused, not exported wrong.
# config.py imports this module, so config, model and transformers are imported inside functions.

HF_LAYER = {"ln_1": "input_layernorm", "ln_2": "post_attention_layernorm", "attn.qkv": "attention.query_key_value",
            "attn.out": "attention.dense", "mlp.fc_in": "mlp.dense_h_to_4h", "mlp.fc_out": "mlp.dense_4h_to_h"}
HF_TOP = {"embed": "gpt_neox.embed_in", "norm": "gpt_neox.final_layer_norm", "head": "lm_head"}


def resolve_complete(path) -> Path:
    """PATH if it is a complete step folder, or the newest complete one in a checkpoints dir. A step
    folder is complete when its manifest exists and every file it lists has the listed size."""
    from config import ConfigError
    path = Path(path)
    fix = "give a step_* folder with a manifest.json, or a checkpoints dir holding one"
    if not path.exists():
        raise ConfigError("CKPT", f"{path} does not exist", fix)
    folder = path if STEP_DIR.search(path.name) else latest(path)
    if folder is None:
        raise ConfigError("CKPT", f"no complete checkpoint (step_*/{MANIFEST}) in {path}", fix)
    if not (folder / MANIFEST).exists():
        raise ConfigError("CKPT", f"{folder} has no {MANIFEST}: an interrupted save", fix)
    files = json.loads((folder / MANIFEST).read_text())["files"]
    if shard_name() not in files:  # the first rank's file, which every layout writes
        raise ConfigError("CKPT", f"{folder}'s manifest lists no {shard_name()}", fix)
    for name, meta in files.items():
        if not (folder / name).exists() or (folder / name).stat().st_size != meta["bytes"]:
            raise ConfigError("CKPT", f"{folder / name} is missing or not the size its manifest lists", fix)
    return folder


def saved_model_config(folder: Path):
    """The ModelConfig the run trained with: train.py stores its resolved config in every shard.
    mmap: only the config is read here, not the weights."""
    from omegaconf import OmegaConf
    from model import ModelConfig
    saved = torch.load(Path(folder) / shard_name(), map_location="cpu", weights_only=False, mmap=True)["config"]["model"]
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), saved))


def hf_neox_config(cfg):
    from transformers import GPTNeoXConfig
    config = GPTNeoXConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, intermediate_size=cfg.mlp_ratio * cfg.d_model,
        hidden_act="gelu",  # exact erf GeLU, as kernels.bias_gelu
        max_position_embeddings=cfg.max_seq_len, layer_norm_eps=cfg.norm_eps, initializer_range=cfg.init_std,
        use_parallel_residual=cfg.block == "parallel", attention_bias=cfg.bias, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta, "partial_rotary_factor": 1.0},
        bos_token_id=None, eos_token_id=None,  # token ids belong to the tokenizer, which is not exported here
        dtype="float32")
    # transformers 4.x reads these keys instead of rope_parameters, and its rotary_pct defaults to 0.25.
    config.rotary_pct, config.rotary_emb_base = 1.0, cfg.rope_theta
    return config


def hf_neox_state(state: dict, cfg) -> dict:
    """Our full state dict (consolidate_model) under GPTNeoXForCausalLM's names."""
    out = {}
    for name, tensor in state.items():
        module, kind = name.rsplit(".", 1)
        if module.startswith("blocks."):
            _, i, sub = module.split(".", 2)
            out[f"gpt_neox.layers.{i}.{HF_LAYER[sub]}.{kind}"] = tensor
        else:
            out[f"{HF_TOP[module]}.{kind}"] = tensor
    d, ffn, dtype = cfg.d_model, cfg.mlp_ratio * cfg.d_model, state["embed.weight"].dtype
    norms = ["gpt_neox.final_layer_norm"]
    for i in range(cfg.n_layers):
        layer = f"gpt_neox.layers.{i}."
        norms += [layer + "input_layernorm", layer + "post_attention_layernorm"]
        if cfg.block == "parallel":  # PTB's one shared LN, cloned: safetensors refuses shared storage
            for kind in ("weight", "bias"):
                if f"{layer}input_layernorm.{kind}" in out:
                    out[f"{layer}post_attention_layernorm.{kind}"] = out[f"{layer}input_layernorm.{kind}"].clone()
        if not cfg.bias:  # HF's MLP always has biases
            out[layer + "mlp.dense_h_to_4h.bias"] = torch.zeros(ffn, dtype=dtype)
            out[layer + "mlp.dense_4h_to_h.bias"] = torch.zeros(d, dtype=dtype)
    for norm in norms:  # and so do its LayerNorms
        out.setdefault(norm + ".bias", torch.zeros(d, dtype=dtype))
    return out


def export_hf(ckpt, out) -> Path:
    """Write CKPT as a transformers GPTNeoXForCausalLM (config.json + safetensors) to OUT. Returns the
    step folder exported. Raises config.ConfigError for an SWA model or an incomplete checkpoint."""
    from config import ConfigError
    from model import GPT
    folder = resolve_complete(ckpt)
    cfg = saved_model_config(folder)
    if cfg.attention.window is not None:
        raise ConfigError("model.attention.window", f"{folder} was trained with sliding-window attention "
                          f"(window={cfg.attention.window}), which transformers' GPT-NeoX does not have, so "
                          f"its logits would differ", "export only models trained with model.attention.window=null")
    # A run with train.compile=true saves its parameters under torch.compile's "_orig_mod." prefix.
    state = {name.removeprefix("_orig_mod."): t for name, t in consolidate_model(folder).items()}
    with torch.device("meta"):
        expected = {name for name, _ in GPT(cfg).named_parameters()}
    if set(state) != expected:
        missing, unknown = sorted(expected - set(state)), sorted(set(state) - expected)
        raise ConfigError("CKPT", f"{folder} does not hold this model's parameters (missing {missing[:3]}, "
                          f"unknown {unknown[:3]})", "export a checkpoint that train.py completed")
    from transformers import GPTNeoXForCausalLM
    with torch.device("meta"):  # no random init: every weight comes from the checkpoint
        hf = GPTNeoXForCausalLM(hf_neox_config(cfg))
    hf.load_state_dict(hf_neox_state(state, cfg), strict=True, assign=True)
    hf.save_pretrained(out)
    return folder


def main(argv: Optional[list] = None) -> None:
    import argparse
    import sys
    from config import ConfigError
    parser = argparse.ArgumentParser(prog="checkpoint.py", description="Checkpoint tools.")
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export-hf", help="write a transformers GPT-NeoX model (config.json + safetensors)")
    export.add_argument("ckpt", help="a step_* folder, or a checkpoints dir (its newest complete checkpoint)")
    export.add_argument("out", help="output folder, for GPTNeoXForCausalLM.from_pretrained")
    args = parser.parse_args(argv)
    try:
        folder = export_hf(args.ckpt, args.out)
    except ConfigError as err:
        print(err, file=sys.stderr)
        sys.exit(2)
    print(f"exported {folder} -> {args.out} (GPTNeoXForCausalLM)")


if __name__ == "__main__":
    main()
