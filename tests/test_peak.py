"""MFU's peak comes from the GPU the run is on: a hardware config that describes another GPU
(scale=cluster pins a100_cluster) is refused in one line before any rank works, naming the config
of the GPU detected. CUDA is mocked: the check reads only the device's name."""
import json

import pytest
import torch

import config
import machine
from errors import ConfigError

BASE = ["model=tiny", "logging.wandb.mode=disabled"]


def test_the_a100_config_on_an_h100_is_one_line_naming_the_h100_config(gpu_node):
    gpu_node["name"] = "NVIDIA H100 80GB HBM3"
    with pytest.raises(ConfigError) as err:
        config.validate(config.compose(BASE + ["hardware=a100_cluster"]))
    line = str(err.value)
    assert "\n" not in line and "hardware.gpu" in line and "A100" in line and "312" in line and "989" in line
    assert "hardware=h100_cluster" in line, line


def test_the_config_of_the_gpu_detected_passes_and_its_peak_is_the_tables(gpu_node):
    for name, hardware, key in (("NVIDIA A100-SXM4-80GB", "a100_cluster", "A100"), ("NVIDIA H100 80GB HBM3", "h100_cluster", "H100"),
                                ("NVIDIA H200", "h200_cluster", "H200")):
        gpu_node["name"] = name
        cfg = config.compose(BASE + [f"hardware={hardware}"])
        config.validate(cfg)
        assert cfg.hardware.peak_tflops == machine.DEVICE_PEAK_TFLOPS[key]
        assert machine.peak_tflops(torch.device("cuda", 0), torch.bfloat16, cfg.hardware.peak_tflops)[0] == \
            machine.peak_tflops(torch.device("cuda", 0), torch.bfloat16)[0]


def test_a_gpu_without_a_config_of_its_own_is_told_to_drop_the_pin(gpu_node):
    gpu_node["name"] = "NVIDIA H100 PCIe"  # not the SXM part h100_cluster describes: 756, not 989 TFLOP/s
    with pytest.raises(ConfigError) as err:
        config.validate(config.compose(BASE + ["hardware=h100_cluster"]))
    assert "756" in str(err.value) and "hardware.gpu=null hardware.peak_tflops=null" in str(err.value)
    gpu_node["name"] = "NVIDIA H100 80GB HBM3"  # the auto config names no GPU: the table's peak for whatever runs
    config.validate(config.compose(BASE + ["hardware=auto"]))
    assert machine.peak_tflops(torch.device("cuda", 0), torch.bfloat16) == (989.0, "table:H100")


def test_an_fp32_run_divides_by_the_fp32_peak_unless_tf32_is_on(gpu_node, monkeypatch):
    """torch leaves TF32 off for matmuls: an fp32 run on an A100 reaches 19.5 TFLOP/s, not TF32's 156."""
    gpu_node["name"] = "NVIDIA A100-SXM4-80GB"
    cuda, a100 = torch.device("cuda", 0), config.compose(BASE + ["hardware=a100_cluster"]).hardware
    monkeypatch.setattr(machine, "tf32_matmuls", lambda: False)
    assert machine.peak_tflops(cuda, torch.float32) == (19.5, "table:A100 fp32")
    assert machine.peak_tflops(cuda, torch.float32, a100.peak_tflops, a100.peak_tflops_fp32) == (19.5, "config:fp32")
    assert machine.peak_tflops(cuda, torch.bfloat16, a100.peak_tflops, a100.peak_tflops_fp32) == (312.0, "config")
    monkeypatch.setattr(machine, "tf32_matmuls", lambda: True)
    assert machine.peak_tflops(cuda, torch.float32) == (156.0, "table:A100 tf32")
    assert machine.peak_tflops(cuda, torch.float32, a100.peak_tflops, a100.peak_tflops_fp32) == (156.0, "config tf32")


def test_precision_auto_on_a_cpu_follows_the_cached_best_rates_once_a_few_runs_have_measured_them(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGAREPRO_CACHE", str(tmp_path))
    cpu = torch.device("cpu")
    measured = []
    # a measurement's matrices, 2 x 2 whatever size it asks for: the rates are nonsense, the calls not
    monkeypatch.setattr(torch, "randn", lambda *a, **k: measured.append(k["dtype"]) or torch.ones(2, 2, **k))
    for _ in range(machine.REUSED_AFTER):  # the first runs measure both dtypes, each keeping the best
        assert machine.resolve_precision("auto", cpu) in ("bf16", "fp32")
        assert set(measured) == {torch.bfloat16, torch.float32}
        measured.clear()
    cached = json.loads((tmp_path / "cpu_peak.json").read_text())
    assert sorted(cached["samples"].values()) == [machine.REUSED_AFTER] * 2
    key = lambda dtype: next(k for k in cached["samples"] if k.split("|")[3] == str(dtype))
    for faster, slower, want in ((torch.bfloat16, torch.float32, "bf16"), (torch.float32, torch.bfloat16, "fp32")):
        cached[key(faster)], cached[key(slower)] = 2.0, 1.0
        (tmp_path / "cpu_peak.json").write_text(json.dumps(cached))
        assert machine.resolve_precision("auto", cpu) == want and measured == []  # then reused, unmeasured
    machine.measured_cpu_peak(torch.float32)
    assert measured  # MFU's peak measures every run
