"""Export a checkpoint as a transformers GPT-NeoX model: `python export_hf.py CKPT OUT`.

Our GPT is GPT-NeoX's architecture, so a checkpoint becomes a transformers GPTNeoXForCausalLM by
renaming alone: the same (head, q|k|v, head_dim) QKV rows, rotate-half RoPE with the same
frequencies, exact-erf GeLU, pre-LN, attention scale 1/sqrt(head_dim), untied head. What differs:
- HF's parallel residual normalises attention and MLP inputs with two LayerNorms; our PTB shares
  one, so it is copied into both. Our sequential ln_2 is HF's post_attention_layernorm.
- HF's LayerNorms and MLP always have biases; with model.bias=false they get zeros, which
  computes the same. The attention biases follow HF's attention_bias flag.
- GPT-NeoX has no sliding-window attention, so an SWA model is refused, not exported wrong.
transformers is imported where it is used: a slow import, needed by nothing else here.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

import torch

from checkpoint import consolidate_model, resolve_complete, saved_model_config
from errors import ConfigError
from model import GPT

HF_LAYER = {"ln_1": "input_layernorm", "ln_2": "post_attention_layernorm", "attn.qkv": "attention.query_key_value",
            "attn.out": "attention.dense", "mlp.fc_in": "mlp.dense_h_to_4h", "mlp.fc_out": "mlp.dense_4h_to_h"}
HF_TOP = {"embed": "gpt_neox.embed_in", "norm": "gpt_neox.final_layer_norm", "head": "lm_head"}


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
    step folder exported. Raises ConfigError for an SWA model or an incomplete checkpoint."""
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
    parser = argparse.ArgumentParser(prog="export_hf.py", description=__doc__.splitlines()[0])
    parser.add_argument("ckpt", help="a step_* folder, or a checkpoints dir (its newest complete checkpoint)")
    parser.add_argument("out", help="output folder, for GPTNeoXForCausalLM.from_pretrained")
    args = parser.parse_args(argv)
    try:
        folder = export_hf(args.ckpt, args.out)
    except ConfigError as err:
        print(err, file=sys.stderr)
        sys.exit(2)
    print(f"exported {folder} -> {args.out} (GPTNeoXForCausalLM)")

if __name__ == "__main__":
    main()
