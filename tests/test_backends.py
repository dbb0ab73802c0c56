"""What computed a run is recorded and named: run.json's backends (attention backend and SDPA's
kernel, precision, TF32, compiled), the note under the tables (test_tables.py), auto's fallback
said where flash-attn is missing on a GPU, and Table 3's step 6 at the cluster scale asking for
flash-attn by name (a one-line error without it). CUDA is mocked where a GPU would be needed."""
import json

import pytest
import torch

import config
import kernels
from conftest import SMALL, run_train
from errors import ConfigError

SDPA_KERNELS = {name.lower() for name in torch.nn.attention.SDPBackend.__members__} - {"error", "overrideable"}


def test_a_tiny_cpu_runs_json_says_what_computed_it(tmp_path, cache_dir):
    run_train(tmp_path, SMALL + ["train.max_steps=2", "precision=fp32", "model.attention.window=16",
                                 "kernels.attention_block=8"], cache_dir)
    ran = json.loads((tmp_path / "run.json").read_text())["backends"]
    # T=64 >= 2 * (16 + 8): auto takes the banded kernel, whose pieces are SDPA calls with a mask
    assert ran["attention"]["requested"] == "auto" and ran["attention"]["ran"] == "banded"
    assert ran["attention"]["sdpa_kernel"] in SDPA_KERNELS and ran["attention"]["fallback"] is None
    assert ran["precision"] == "fp32" and ran["tf32"] is None and ran["compiled"] is False and ran["fused"] is False


def test_auto_without_flash_attn_on_a_gpu_says_why(monkeypatch):
    """No GPU here: CUDA's answers are stood in for (flash-attn missing; SDPA's kernel choice)."""
    monkeypatch.setattr(kernels, "flash_attn_problem", lambda: ("the flash-attn package is not installed", "fix"))
    monkeypatch.setattr(kernels, "flash_attn_importable", lambda: False)
    monkeypatch.setattr(kernels, "sdpa_kernel", lambda *args: "efficient_attention")
    described = kernels.describe_attention("auto", torch.device("cuda"), torch.bfloat16, 2048, 128, None, 0.0)
    assert described == {"requested": "auto", "ran": "sdpa", "sdpa_kernel": "efficient_attention",
                         "fallback": "the flash-attn package is not installed"}
    on_cpu = kernels.describe_attention("auto", torch.device("cpu"), torch.bfloat16, 2048, 128, None, 0.0)
    assert on_cpu["fallback"] is None  # flash-attn is a GPU's: nothing fell back
    assert kernels.describe_attention("unfused", torch.device("cpu"), torch.float32, 64, 16, None, 0.0) == \
        {"requested": "unfused", "ran": "unfused", "sdpa_kernel": None, "fallback": None}


@pytest.fixture
def a100_node(gpu_node):
    gpu_node["name"] = "NVIDIA A100-SXM4-80GB"
    kernels.flash_attn_problem.cache_clear()
    yield
    kernels.flash_attn_problem.cache_clear()


def test_efficient_operators_on_the_cluster_ask_for_flash_attn_by_name(a100_node, monkeypatch):
    cluster = ["experiment=megascale_ablation", "scale=cluster", "logging.wandb.mode=disabled"]
    attention = {step: config.compose(cluster + [f"ablation.step={step}"]).kernels.attention for step in (0, 2, 5, 6, 8)}
    assert attention == {0: "unfused", 2: "banded", 5: "banded", 6: "flash", 8: "flash"}
    assert config.compose(["experiment=megascale_ablation", "ablation.step=6"]).kernels.attention == "auto"  # cpu scale
    monkeypatch.setitem(__import__("sys").modules, "flash_attn", None)  # not installed: import fails
    with pytest.raises(ConfigError) as err:
        config.validate(config.compose(cluster + ["ablation.step=6"]))
    line = str(err.value)
    assert "\n" not in line and line.startswith("config error: kernels.attention: flash: the flash-attn package "
                                                "(>=2.7,<3) is not installed. Fix:"), line
