"""train.py end to end: learning, gradient accumulation, dry runs, and bad input (resume: test_checkpoint.py, test_ft.py)."""
import json
from pathlib import Path

import pytest

from conftest import SMALL, read_metrics, run_train


def test_tiny_model_learns_on_the_embedded_corpus(tmp_path, cache_dir):
    measured_peak = [a for a in SMALL if not a.startswith("hardware.peak_tflops")]
    run_train(tmp_path, measured_peak + ["train.max_steps=120", "train.eval_interval=60"], cache_dir)
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 121))
    first, last = sum(r["loss"] for r in rows[:5]) / 5, sum(r["loss"] for r in rows[-5:]) / 5
    assert first > 5.5                # about ln(512) = 6.2 at the start
    assert last < first - 2.0         # a clear fall, not noise
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(vals) == 2 and vals[1] < vals[0]
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["status"] == "finished"
    assert run["final"]["loss"] == rows[-1]["loss"]
    assert run["final"]["tokens_per_s"] > 0 and 0 < run["final"]["mfu"] < 1
    assert run["data"]["python_version"] and run["data"]["content_hash"]
    assert run["flops_per_token"] > 0 and run["config"]["model"]["name"] == "tiny"
    assert run["peak_source"] == "measured" and run["peak_tflops"] > 0


def test_gradient_accumulation_equals_one_big_batch(tmp_path, cache_dir):
    args = SMALL + ["train.max_steps=4", "precision=fp32"]
    run_train(tmp_path / "whole", args, cache_dir)
    run_train(tmp_path / "accum", args + ["parallel.microbatches=4"], cache_dir)
    for a, b in zip(read_metrics(tmp_path / "whole"), read_metrics(tmp_path / "accum")):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)


def test_dry_run_prints_175B_size_without_hardware(tmp_path, cache_dir):
    proc = run_train(tmp_path, ["model=175B", "dry_run=true", "train.seq_len=2048"], cache_dir)
    assert "1.077" in proc.stdout and "FLOPs per token" in proc.stdout
    assert "175" in proc.stdout.split("parameters")[0]


@pytest.mark.parametrize("override, key", [
    ("train.learning_rate=1", "train.learning_rate"),
    ("model.n_heads=3", "model.n_heads"),
    ("model.attention.window=0", "model.attention.window"),
    ("train.seq_len=4096", "train.seq_len"),
    ("data.source=/no/such/corpus.txt", "data.source"),
    ("hardware.device=tpu", "hardware.device"),
    ("model=175b", "model"),
    ("resume=/no/such/checkpoints/step_00000010", "resume"),
    ("ft.hang_timeout=0", "ft.hang_timeout"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, cache_dir, override, key):
    proc = run_train(tmp_path, [override], cache_dir, check=False)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert key in lines[0] and "Fix:" in lines[0]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("value", [-0.1, 1.0])
def test_dropout_outside_0_1_is_a_config_error(value):
    """The same check as above, in-process (each spawned case costs seconds)."""
    import config
    with pytest.raises(config.ConfigError, match="model.dropout"):
        config.validate(config.compose([f"model.dropout={value}"]), world=1)


def _two_jobs_then_exit(rank, world, port, cache, run_dir):
    """One rank of a 2-job multirun in the same processes, as Hydra's basic launcher runs one, then
    the rank's exit (parallel.shutdown, which init_distributed registers at exit)."""
    import gc
    import os
    import threading
    import weakref
    from pathlib import Path
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), MEGAREPRO_CACHE=cache, WANDB_MODE="disabled", HF_DATASETS_OFFLINE="1")
    import config
    import parallel
    import train
    layouts, build = [], parallel.build_layout

    def watched_build(*args, **kwargs):
        layout = build(*args, **kwargs)
        layouts.append(weakref.ref(layout))
        return layout
    parallel.build_layout = watched_build
    cfg = config.compose(SMALL + ["parallel.pp=2", "parallel.microbatches=2", "train.max_steps=2", "precision=fp32",
                                  "checkpoint.interval=1", "checkpoint.async_save=true", "data.pipeline=megascale"])
    report = {}
    for job in (1, 2):
        train.train(cfg, Path(run_dir) / f"rank{rank}_job{job}")
        gc.collect()
        report[f"job{job}_layout_alive"] = layouts[-1]() is not None
    parallel.shutdown()
    tasks = Path(f"/proc/{os.getpid()}/task")
    report["native_threads"] = sorted((t / "comm").read_text().strip() for t in tasks.iterdir())
    report["python_threads"] = [t.name for t in threading.enumerate()]
    (Path(run_dir) / f"exit_{rank}.json").write_text(json.dumps(report))


def test_a_rank_ends_with_every_thread_joined(tmp_path, cache_dir):
    """What issue 19's SIGABRT after "done" came from: the process groups outlived the run (the ZeRO
    hooks' cycle through autograd's C++ hook table kept each job's model and layout, and a cache
    kept the checkpoint's group), so gloo's threads were torn down in interpreter finalization.
    Now each job's model goes when the job ends, and at exit no gloo thread or run thread is left."""
    from conftest import spawn
    spawn(_two_jobs_then_exit, 2, str(cache_dir), str(tmp_path))
    for rank in range(2):
        report = json.loads((tmp_path / f"exit_{rank}.json").read_text())
        assert not report["job1_layout_alive"] and not report["job2_layout_alive"], report
        assert not [t for t in report["native_threads"] if "gloo" in t], report["native_threads"]
        assert report["python_threads"] == ["MainThread"], report["python_threads"]


def _precision_of_rank(rank, world, port, out_dir):
    import torch
    import torch.distributed as dist
    import machine
    import train
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    # Two ranks whose measurements disagree, as ranks measuring side by side under load can.
    machine.resolve_precision = lambda requested, device: "bf16" if rank == 0 else "fp32"
    got = train._agreed_precision("auto", torch.device("cpu"), world)
    (Path(out_dir) / f"rank{rank}").write_text(got)
    dist.destroy_process_group()


def test_precision_auto_is_rank_0s_decision_on_every_rank(tmp_path):
    from conftest import spawn
    spawn(_precision_of_rank, 2, str(tmp_path))
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["bf16", "bf16"]
