"""experiments/batch_study.py on hand-written run dirs (no training): the best rate per cell, the
seeds' spread, the comparison with AdamW at k=1 within seed noise, and the files it writes."""
from __future__ import annotations

import csv
import itertools
import json
import math
from pathlib import Path

import pytest

from experiments import batch_study

# Final validation losses: AdamW k=1's best rate (x1) gives 5.00 +- 0.01 over seeds; LAMB at k=4
# 5.01 +- 0.01 (within the noise of AdamW k=1); LAMB at k=8 5.30 (worse by far more than it).
SWEEP = {("adamw", 1): {0.5: 5.20, 1.0: 5.00, 2.0: 5.10}, ("lamb", 4): {0.5: 5.40, 1.0: 5.15, 2.0: 5.01},
         ("lamb", 8): {0.5: 5.50, 1.0: 5.30, 2.0: 5.35}}
SEEDS = {("adamw", 1): [5.01, 4.99], ("lamb", 4): [5.00, 5.02], ("lamb", 8): [5.31, 5.29]}


def write(job: Path, optimizer: str, k: int, mult: float, seed: int, val: float) -> None:
    job.mkdir(parents=True)
    batch, steps = 8 * k, 48 // k
    study = {"name": "convergence", "label": f"{optimizer} k={k} lr x{mult:g}", "scale": "cpu", "fabric": "loopback"}
    config = {"convergence": {"variant": "baseline", "optimizer": optimizer, "k": k, "lr_mult": mult},
              "train": {"seed": seed, "lr": 2e-3 * k ** 0.5 * mult, "batch_size": batch, "seq_len": 128}, "study": study}
    (job / "run.json").write_text(json.dumps({"config": config, "study": study, "status": "finished",
                                              "final": {"steps": steps, "loss": val, "val_loss": val},
                                              "attempts": [{"started": "2026-01-01T00:00:00"}]}))
    rows = [{"step": s, "loss": 6.0, **({"val_loss": val + (steps - s) / 100} if s % (steps // 4) == 0 else {})}
            for s in range(1, steps + 1)]
    (job / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def study(tmp_path) -> Path:
    n = 0
    for (optimizer, k), by_mult in SWEEP.items():
        for mult, val in by_mult.items():
            write(tmp_path / "sweep" / str(n), optimizer, k, mult, batch_study.SEEDS[0], val)
            n += 1
    for (optimizer, k), vals in SEEDS.items():
        mult = min(SWEEP[(optimizer, k)], key=SWEEP[(optimizer, k)].get)
        for i, (seed, val) in enumerate(zip(batch_study.SEEDS[1:], vals)):
            write(tmp_path / f"seeds_{optimizer}_k{k}" / str(i), optimizer, k, mult, seed, val)
    return tmp_path


def test_each_cells_best_rate_and_its_seeds_decide(study, capsys):
    found = batch_study.cells(batch_study.tables.load_runs(sorted(p for p in study.iterdir())))
    assert batch_study.best_rates(found) == {("adamw", 1): 1.0, ("lamb", 4): 2.0, ("lamb", 8): 1.0}
    text, records = batch_study.table(found)
    rows = {(r["optimizer"], r["k"]): r for r in records}
    assert rows[("lamb", 4)]["matches_adamw_k1"] == "yes (within seed noise)"
    assert rows[("lamb", 8)]["matches_adamw_k1"] == "no" and rows[("lamb", 8)]["vs_adamw_k1"] == pytest.approx(0.30)
    assert rows[("adamw", 1)]["matches_adamw_k1"] == ""   # the reference itself
    assert rows[("lamb", 4)]["seeds"] == 3 and rows[("lamb", 4)]["val_loss_mean"] == pytest.approx(5.01)
    assert "| lamb | 4 | 32 x 12 | 8.00e-03 (x2) (edge) | x0.5: 5.400 / x1: 5.150 / x2: 5.010 | 5.010 ± 0.010 (3) |" in text


def test_report_appends_its_table_and_writes_the_figures_once(study, capsys):
    assert batch_study.main(["report", str(study)]) == 0
    names = sorted(p.name for p in study.iterdir() if p.is_file())
    assert names == ["batch_study.csv", "batch_study.md"] + sorted(
        f"batch_study_{n}.{e}" for n in ("curves", "final") for e in ("png", "pdf"))
    assert len(list(csv.DictReader(open(study / "batch_study.csv")))) == 3
    assert batch_study.main(["report", str(study)]) == 2     # the CSV and figures are never overwritten
    assert (study / "batch_study.md").read_text().count("## Batch study") == 1   # and a refusal writes nothing
    assert batch_study.main(["report", str(study / "nothing")]) == 2


def test_run_brackets_each_best_rate_then_seeds_it_and_goes_on_where_it_stopped(tmp_path, monkeypatch):
    """run() with the training replaced by a loss surface: AdamW's best rate is x1 at every k (inside
    the sweep); LAMB's is x0.25 (one factor of 2 below the sweep), and at k=8 below x0.125 (past the
    two extensions allowed, so it stays at the edge). Then the seeds go to each cell's best, and a
    second run() finds everything done and runs nothing."""
    def loss(optimizer, k, mult):
        best = 1.0 if optimizer == "adamw" else 0.25 if k < 8 else 0.01
        return 5.0 + 0.1 * k + abs(math.log2(mult / best))

    launched = []

    def fake_multirun(overrides, sweep_dir, extra):
        values = dict(o.split("=", 1) for o in overrides)
        combos = itertools.product(values["convergence.optimizer"].split(","), values["convergence.k"].split(","),
                                   values["convergence.lr_mult"].split(","), values["train.seed"].split(","))
        launched.append(sweep_dir.name)
        for n, (optimizer, k, mult, seed) in enumerate(combos):
            write(sweep_dir / str(n), optimizer, int(k), float(mult), int(seed), loss(optimizer, int(k), float(mult)))
    monkeypatch.setattr(batch_study, "multirun", fake_multirun)
    batch_study.run(tmp_path, [])
    found = batch_study.cells_in(tmp_path)
    best = batch_study.best_rates(found)
    assert {k: best[("adamw", k)] for k in batch_study.KS} == dict.fromkeys(batch_study.KS, 1.0)
    assert {k: best[("lamb", k)] for k in batch_study.KS} == {1: 0.25, 2: 0.25, 3: 0.25, 4: 0.25, 8: 0.125}
    assert launched[:4] == ["sweep", "edge_lamb_x0.25", "edge_lamb_x0.125", "seeds_adamw_k1_x1"]
    assert sorted(found[("lamb", 8)]) == [0.125, 0.25, 0.5, 1.0, 2.0]          # two steps past the sweep, no more
    assert all(set(found[cell][mult]) == set(batch_study.SEEDS) for cell, mult in best.items())
    launched.clear()
    batch_study.run(tmp_path, [])
    assert launched == []
