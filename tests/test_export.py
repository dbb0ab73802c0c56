"""export_hf.py: transformers' GPTNeoXForCausalLM, loaded from the export, gives our logits.

transformers is the external oracle here: nothing of it is patched."""
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

import checkpoint
import config
import export_hf
from conftest import ROOT
from model import GPT, AttentionConfig, ModelConfig
from tensor_parallel import tp_shard_dim

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
        state[f"model/{prefix}{n}"] = checkpoint.Chunks(t.shape, pieces)
    folder = checkpoint.step_dir(ckpt_dir, STEP)
    checkpoint.write_dcp(folder, state)
    checkpoint.mark_complete(folder)
    return model


def tiny(**overrides) -> ModelConfig:
    # init_std 0.1 rather than 0.02 so logits are O(1) and the 1e-4 tolerance means something.
    return ModelConfig(n_layers=2, n_heads=4, d_model=64, vocab_size=128, max_seq_len=64, init_std=0.1,
                       rope_theta=500.0, **overrides)


@pytest.mark.parametrize("block,bias,tp,compiled", [
    ("sequential", True, 1, False), ("parallel", True, 1, False),
    ("sequential", False, 2, False), ("parallel", False, 2, True)])
def test_hf_gpt_neox_gives_our_logits(tmp_path, block, bias, tp, compiled):
    from transformers import GPTNeoXForCausalLM
    model = save_like_train(tmp_path / "checkpoints", tiny(block=block, bias=bias), tp, compiled)
    # The checkpoints dir, not a step folder: the export takes its newest complete checkpoint.
    assert export_hf.export_hf(tmp_path / "checkpoints", tmp_path / "hf") == checkpoint.step_dir(tmp_path / "checkpoints", STEP)
    hf, info = GPTNeoXForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    assert hf.config.use_parallel_residual == (block == "parallel")
    tokens = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours, theirs = model.eval()(tokens), hf.eval()(tokens).logits
    diff = (ours - theirs).abs().max().item()
    print(f"{block} bias={bias} tp={tp}: max abs logit diff {diff:.2e} (logit std {ours.std():.2f})")
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
