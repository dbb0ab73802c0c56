"""CUDA_DEVICE_MAX_CONNECTIONS=1 for tensor parallelism on CUDA (launch.set_cuda_connections):
set by train.py's main, where every launch path starts, before anything starts CUDA."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import launch

VAR = "CUDA_DEVICE_MAX_CONNECTIONS"
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("tp,device,want", [(2, "cuda", "1"), (8, "auto", "1"), (1, "cuda", None), (2, "cpu", None)])
def test_one_connection_where_tp_may_run_on_cuda(monkeypatch, tp, device, want):
    monkeypatch.delenv(VAR, raising=False)
    assert launch.set_cuda_connections(tp, device) is None
    assert launch.os.environ.get(VAR) == want


def test_a_users_other_value_is_kept_and_warned_about(monkeypatch):
    monkeypatch.setenv(VAR, "8")
    warning = launch.set_cuda_connections(2, "cuda")
    assert launch.os.environ[VAR] == "8" and f"{VAR}=8" in warning and "tp=2" in warning


def test_too_late_once_cuda_has_started(monkeypatch):
    monkeypatch.delenv(VAR, raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert "set it in the environment" in launch.set_cuda_connections(2, "cuda")
    assert VAR not in launch.os.environ


def test_set_before_the_first_cuda_query_of_the_script(tmp_path):
    """train.py as torchrun, train.sbatch (through torchrun) and the submitit launcher's tasks run
    it: the variable is set when the process first asks CUDA anything (validate's device checks,
    first in the preflight of __main__, again in main)."""
    probe = ("import os, runpy, torch\n"
             "def is_available():\n"
             f"    print('ASKED', os.environ.get('{VAR}'), torch.cuda.is_initialized(), flush=True)\n"
             "    return False\n"
             "torch.cuda.is_available = is_available\n"
             "runpy.run_path('train.py', run_name='__main__')\n")
    env = {k: v for k, v in os.environ.items() if k != VAR}
    args = ["model=tiny", "parallel.tp=2", "hardware.device=auto", f"hydra.run.dir={tmp_path}",
            "logging.wandb.mode=disabled"]
    done = subprocess.run([sys.executable, "-c", probe, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    asked = [line for line in done.stdout.splitlines() if line.startswith("ASKED")]
    assert asked and set(asked) == {"ASKED 1 False"}, (done.stdout, done.stderr[-2000:])
