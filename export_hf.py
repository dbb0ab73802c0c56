"""Export a checkpoint as a transformers model: `python export_hf.py CKPT OUT`. GPT's block
(LayerNorm, GeLU) becomes a GPTNeoXForCausalLM, Llama's (RMSNorm, SwiGLU, GQA) a LlamaForCausalLM.

Our GPT is GPT-NeoX's architecture, so a checkpoint becomes a transformers GPTNeoXForCausalLM by
renaming alone: the same (head, q|k|v, head_dim) QKV rows, rotate-half RoPE with the same
frequencies, exact-erf GeLU, pre-LN, attention scale 1/sqrt(head_dim), untied head. What differs:
- HF's parallel residual normalises attention and MLP inputs with two LayerNorms; our PTB shares
  one, so it is copied into both. Our sequential ln_2 is HF's post_attention_layernorm.
- HF's LayerNorms and MLP always have biases; with model.bias=false they get zeros, which
  computes the same. The attention biases follow HF's attention_bias flag.
- GPT-NeoX has no sliding-window attention, so an SWA model is refused, not exported wrong.
Llama's block is LlamaForCausalLM's: rotate-half RoPE (HF's layout of Llama's q and k), SiLU-gated
MLP, RMSNorm without bias, untied head, biases as its attention_bias and mlp_bias flags. Our fused
weights are cut into its separate ones: qkv's rows per KV head (its query heads, k, v) into
q_proj, k_proj and v_proj; fc_in's interleaved (unit, gate|up) rows into gate_proj and up_proj.
LlamaForCausalLM has neither PTB nor sliding windows: such a model is refused, as is any mix
(LayerNorm with SwiGLU, RMSNorm with GeLU, GPT's block with GQA) that neither model computes.
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
from model import GPT, ffn_width, head_dim, kv_heads

HF_LAYER = {"ln_1": "input_layernorm", "ln_2": "post_attention_layernorm", "attn.qkv": "attention.query_key_value",
            "attn.out": "attention.dense", "mlp.fc_in": "mlp.dense_h_to_4h", "mlp.fc_out": "mlp.dense_4h_to_h"}
HF_TOP = {"embed": "gpt_neox.embed_in", "norm": "gpt_neox.final_layer_norm", "head": "lm_head"}


def hf_neox_config(cfg):
    from transformers import GPTNeoXConfig
    config = GPTNeoXConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, intermediate_size=ffn_width(cfg),
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
    d, ffn, dtype = cfg.d_model, ffn_width(cfg), state["embed.weight"].dtype
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


def hf_llama_config(cfg):
    from transformers import LlamaConfig
    return LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=kv_heads(cfg), head_dim=head_dim(cfg),
        intermediate_size=ffn_width(cfg), hidden_act="silu", max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps, initializer_range=cfg.init_std, attention_bias=cfg.bias, mlp_bias=cfg.bias,
        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        bos_token_id=None, eos_token_id=None, pad_token_id=None,  # the tokenizer's, not exported here
        dtype="float32")


LLAMA_LAYER = {"ln_1": "input_layernorm", "ln_2": "post_attention_layernorm", "attn.out": "self_attn.o_proj",
               "mlp.fc_out": "mlp.down_proj"}
LLAMA_TOP = {"embed": "model.embed_tokens", "norm": "model.norm", "head": "lm_head"}


def hf_llama_state(state: dict, cfg) -> dict:
    """Our full state dict (or any dict under its names: gradients too) under LlamaForCausalLM's
    names, the fused QKV and gate/up weights cut into Llama's separate projections."""
    group = cfg.n_heads // kv_heads(cfg)
    out = {}
    for name, tensor in state.items():
        module, kind = name.rsplit(".", 1)
        if not module.startswith("blocks."):
            out[f"{LLAMA_TOP[module]}.{kind}"] = tensor
            continue
        _, i, sub = module.split(".", 2)
        layer = f"model.layers.{i}."
        if sub == "attn.qkv":  # rows (kv head, [group q heads, k, v], head_dim)
            rows = tensor.unflatten(0, (kv_heads(cfg), group + 2, head_dim(cfg)))
            for proj, part in (("q_proj", rows[:, :group]), ("k_proj", rows[:, group]), ("v_proj", rows[:, group + 1])):
                out[f"{layer}self_attn.{proj}.{kind}"] = part.reshape(-1, *tensor.shape[1:]).contiguous()
        elif sub == "mlp.fc_in":  # rows (unit, gate|up)
            rows = tensor.unflatten(0, (-1, 2))
            out[f"{layer}mlp.gate_proj.{kind}"] = rows[:, 0].contiguous()
            out[f"{layer}mlp.up_proj.{kind}"] = rows[:, 1].contiguous()
        else:
            out[f"{layer}{LLAMA_LAYER[sub]}.{kind}"] = tensor
    return out


def hf_model_kind(cfg, folder="this model") -> str:
    """'llama' or 'gpt_neox': the transformers model that computes what cfg's does. Raises
    ConfigError, naming the key, for a model neither computes (so it is not exported wrong)."""
    llama = cfg.norm == "rmsnorm" and cfg.mlp == "swiglu"
    name = "Llama" if llama else "GPT-NeoX"

    def refuse(key, what, fix):
        raise ConfigError(key, f"{folder} was trained with {what}, which transformers' {name} does not have, so "
                          "its logits would differ", fix)
    if not llama and (cfg.norm, cfg.mlp) != ("layernorm", "gelu"):
        refuse("model.norm", f"norm={cfg.norm} with mlp={cfg.mlp}", "export norm=layernorm with mlp=gelu (GPT-NeoX) "
               "or norm=rmsnorm with mlp=swiglu (Llama)")
    if cfg.attention.window is not None:
        refuse("model.attention.window", f"sliding-window attention (window={cfg.attention.window})",
               "export only models trained with model.attention.window=null")
    if llama and cfg.block == "parallel":
        refuse("model.block", "the parallel block (PTB)", "export Llama's block only with model.block=sequential")
    if not llama and kv_heads(cfg) != cfg.n_heads:
        refuse("model.n_kv_heads", f"grouped-query attention (n_kv_heads={cfg.n_kv_heads})",
               "export GQA models with Llama's block (norm=rmsnorm, mlp=swiglu)")
    return "llama" if llama else "gpt_neox"


def export_hf(ckpt, out) -> Path:
    """Write CKPT as a transformers GPTNeoXForCausalLM or LlamaForCausalLM (config.json +
    safetensors) to OUT. Returns the step folder exported. Raises ConfigError for a model neither
    computes (hf_model_kind) or an incomplete checkpoint."""
    folder = resolve_complete(ckpt)
    cfg = saved_model_config(folder)
    kind = hf_model_kind(cfg, folder)
    # A run with train.compile=true saves its parameters under torch.compile's "_orig_mod." prefix.
    state = {name.removeprefix("_orig_mod."): t for name, t in consolidate_model(folder).items()}
    with torch.device("meta"):
        expected = {name for name, _ in GPT(cfg).named_parameters()}
    if set(state) != expected:
        missing, unknown = sorted(expected - set(state)), sorted(set(state) - expected)
        raise ConfigError("CKPT", f"{folder} does not hold this model's parameters (missing {missing[:3]}, "
                          f"unknown {unknown[:3]})", "export a checkpoint that train.py completed")
    from transformers import GPTNeoXForCausalLM, LlamaForCausalLM
    with torch.device("meta"):  # no random init: every weight comes from the checkpoint
        hf = LlamaForCausalLM(hf_llama_config(cfg)) if kind == "llama" else GPTNeoXForCausalLM(hf_neox_config(cfg))
    hf.load_state_dict((hf_llama_state if kind == "llama" else hf_neox_state)(state, cfg), strict=True, assign=True)
    hf.save_pretrained(out)
    return folder


def main(argv: Optional[list] = None) -> None:
    parser = argparse.ArgumentParser(prog="export_hf.py", description=__doc__.splitlines()[0])
    parser.add_argument("ckpt", help="a step_* folder, or a checkpoints dir (its newest complete checkpoint)")
    parser.add_argument("out", help="output folder, for GPTNeoXForCausalLM or LlamaForCausalLM.from_pretrained")
    args = parser.parse_args(argv)
    try:
        folder = export_hf(args.ckpt, args.out)
    except ConfigError as err:
        print(err, file=sys.stderr)
        sys.exit(2)
    kind = hf_model_kind(saved_model_config(folder))
    print(f"exported {folder} -> {args.out} ({'LlamaForCausalLM' if kind == 'llama' else 'GPTNeoXForCausalLM'})")

if __name__ == "__main__":
    main()
