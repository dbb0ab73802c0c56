"""export_hf.py: transformers' GPTNeoXForCausalLM (GPT's block) or LlamaForCausalLM (Llama's),
loaded from the export, gives our logits, and a trained model's loss on held-out text.

transformers is the external oracle here: nothing of it is patched."""
import json
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

import checkpoint
from parallelisms import placement
import config
import export_hf
from conftest import ROOT, SMALL, run_train
from model import GPT, AttentionConfig, ModelConfig
from parallelisms.tensor_parallel import tp_shard_dim

STEP = 5


def save_like_train(ckpt_dir, model_cfg: ModelConfig, tp: int = 1, compiled: bool = False) -> GPT:
    """A checkpoint as train.py's save() writes one: the model in TP slices plus the resolved
    config, then the manifest. Biases and norms are made random too (init_weights sets them to 0
    and 1), so a mis-mapped bias or LN shows in the logits."""
    model = GPT(model_cfg)
    model.init_weights(0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "ln_" in name or name.startswith("norm."):
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
    full = {name: p.detach() for name, p in model.named_parameters()}
    resolved = OmegaConf.to_container(OmegaConf.structured(config.Config(model=model_cfg)))
    prefix = "_orig_mod." if compiled else ""  # what train.compile=true puts in front of every name
    state = {"config": checkpoint._blob(resolved), "step": checkpoint._blob(STEP)}
    for n, t in full.items():  # each TP rank's slice as its own piece, as the ranks write them
        dim = tp_shard_dim(n)
        pieces = [((0,) * t.dim(), t.clone())] if dim is None else [
            (tuple(rank * piece.shape[dim] if d == dim else 0 for d in range(t.dim())), piece.clone())
            for rank, piece in enumerate(t.chunk(tp, dim))]
        state[f"model/{prefix}{n}"] = placement.Chunks(t.shape, pieces)
    folder = checkpoint.step_dir(ckpt_dir, STEP)
    checkpoint.write_dcp(folder, state)
    checkpoint.mark_complete(folder)
    return model


def tiny(**overrides) -> ModelConfig:
    # init_std 0.1 rather than 0.02 so logits are O(1) and the 1e-4 tolerance means something.
    return ModelConfig(n_layers=2, n_heads=4, d_model=64, vocab_size=128, max_seq_len=64, init_std=0.1,
                       rope_theta=500.0, **overrides)


LLAMA = dict(norm="rmsnorm", mlp="swiglu", n_kv_heads=2, ffn_hidden_size=96)


@pytest.mark.parametrize("block,bias,tp,compiled,llama", [
    ("sequential", True, 1, False, False), ("parallel", True, 1, False, False),
    ("sequential", False, 2, False, False), ("parallel", False, 2, True, False),
    ("sequential", False, 2, False, True), ("sequential", True, 1, True, True)])
def test_hf_model_gives_our_logits(tmp_path, block, bias, tp, compiled, llama):
    from transformers import AutoModelForCausalLM, GPTNeoXForCausalLM, LlamaForCausalLM
    model = save_like_train(tmp_path / "checkpoints", tiny(block=block, bias=bias, **(LLAMA if llama else {})), tp,
                            compiled)
    # The checkpoints dir, not a step folder: the export takes its newest complete checkpoint.
    assert export_hf.export_hf(tmp_path / "checkpoints", tmp_path / "hf") == checkpoint.step_dir(tmp_path / "checkpoints", STEP)
    hf, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    assert isinstance(hf, LlamaForCausalLM if llama else GPTNeoXForCausalLM)
    if not llama:
        assert hf.config.use_parallel_residual == (block == "parallel")
    tokens = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours, theirs = model.eval()(tokens), hf.eval()(tokens).logits
    diff = (ours - theirs).abs().max().item()
    print(f"{'llama' if llama else 'neox'} {block} bias={bias} tp={tp}: max abs logit diff {diff:.2e} (logit std {ours.std():.2f})")
    assert ours.std() > 0.5
    assert diff <= 1e-4


def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "export_hf.py", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_swa_is_refused_in_one_line(tmp_path):
    save_like_train(tmp_path / "checkpoints", tiny(attention=AttentionConfig(window=8)))
    proc = cli(tmp_path / "checkpoints", tmp_path / "hf")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("config error: model.attention.window:") and "Fix:" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("overrides, key", [
    (dict(LLAMA, block="parallel"), "model.block"),                       # Llama has no PTB
    (dict(LLAMA, attention=AttentionConfig(window=8)), "model.attention.window"),
    (dict(norm="layernorm", mlp="swiglu"), "model.norm"),                 # neither model's block
    (dict(n_kv_heads=2), "model.n_kv_heads"),                             # GPT-NeoX has no GQA
])
def test_what_neither_model_computes_is_refused_in_one_line(tmp_path, capsys, overrides, key):
    save_like_train(tmp_path / "checkpoints", tiny(**overrides))
    with pytest.raises(SystemExit) as exit:
        export_hf.main([str(tmp_path / "checkpoints"), str(tmp_path / "hf")])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.startswith(f"config error: {key}:") and "Fix:" in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "hf").exists()


def test_trained_llama_exports_with_its_held_out_loss(tmp_path, cache_dir):
    """llama_tiny trained a few steps by train.py, exported: LlamaForCausalLM's loss on the held-out
    batches equals the val_loss training logged after its last step (same weights), and its greedy
    generation is our model's."""
    import data
    import sampling
    from transformers import LlamaForCausalLM
    steps, args = 4, [a for a in SMALL if a != "model=tiny"] + ["model=llama_tiny", "precision=fp32"]
    args += [f"train.max_steps={steps}", f"checkpoint.interval={steps}", f"train.eval_interval={steps}",
             "train.eval_batches=2"]
    run_train(tmp_path, args, cache_dir)
    trained = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    val_loss = next(row["val_loss"] for row in trained if row.get("step") == steps and "val_loss" in row)

    folder = export_hf.export_hf(tmp_path / "checkpoints", tmp_path / "hf")
    cfg = config.compose(args)
    cfg.data.cache_dir = str(cache_dir)
    streams = sampling.eval_batches(data.prepare(cfg.data, cfg.train.seq_len), cfg.train.seq_len,
                                    cfg.train.eval_batches, cfg.train.batch_size)
    batches = [sampling.to_device(stream, torch.device("cpu")) for stream in streams]  # (inputs, targets)
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        losses = [torch.nn.functional.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()) for x, y in batches]
    exported = torch.stack(losses).mean().item()
    print(f"llama_tiny after {steps} steps: val_loss {val_loss:.8f} in training, {exported:.8f} exported")
    assert exported == pytest.approx(val_loss, abs=1e-5)

    ours = GPT(checkpoint.saved_model_config(folder)).eval()
    ours.load_state_dict(checkpoint.consolidate_model(folder))
    prompt = batches[0][0][:1, :8]
    generated = hf.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    tokens = prompt
    with torch.no_grad():
        for _ in range(8):
            tokens = torch.cat([tokens, ours(tokens)[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(generated, tokens)


def test_incomplete_checkpoints_are_refused(tmp_path, capsys):
    ckpt = tmp_path / "checkpoints"
    save_like_train(ckpt, tiny())
    folder = checkpoint.step_dir(ckpt, STEP)
    cases = [(tmp_path / "nowhere", "does not exist"), (tmp_path, "no complete checkpoint")]
    (folder / checkpoint.MANIFEST).rename(tmp_path / "manifest.json")  # as if the save was interrupted
    cases += [(folder, "interrupted save"), (ckpt, "no complete checkpoint")]
    for path, problem in cases:
        with pytest.raises(SystemExit) as exit:
            export_hf.main([str(path), str(tmp_path / "hf")])
        err = capsys.readouterr().err
        assert exit.value.code == 2 and err.startswith("config error: CKPT:") and problem in err, err
        assert len(err.strip().splitlines()) == 1
    (tmp_path / "manifest.json").rename(folder / checkpoint.MANIFEST)
    with open(folder / "__0_0.distcp", "ab") as f:  # a truncated or altered file
        f.write(b"x")
    with pytest.raises(SystemExit):
        export_hf.main([str(folder), str(tmp_path / "hf")])
    assert "not the size its manifest lists" in capsys.readouterr().err
