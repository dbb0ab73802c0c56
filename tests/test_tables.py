"""experiments/tables.py and figures.py on hand-written run dirs (no training): the exact tables,
missing / failed / pending rows, the files, refusal to overwrite, and the offline W&B path."""
from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

from experiments import figures, tables

CPU = {"scale": "cpu", "fabric": "loopback"}
EMU = {"scale": "cpu", "fabric": "emulated:2x2@1gbit"}


def final(mfu: float, tokens_per_s: float, step_time: float, **extra) -> dict:
    return {"steps": 10, "loss": 3.0, "first_loss": 6.0, "tokens_per_s": tokens_per_s, "step_time": step_time,
            "tflops_per_device": 0.1, "mfu": mfu, "memory_gib": 1.0, **extra}


# Per-step MFU around a run's value: after 3 warm-up steps, 5 windows of 3 steps whose medians are
# the value -0.2, -0.1, 0, +0.1, +0.2 points. So a run's 95% interval is t(4) * SE = 2.776 * 0.0707 =
# ±0.2 points, and two such runs' difference has ±0.2 too (Welch: df 8, t 2.306, SE 0.1).
WIGGLE = [0.0] * 3 + [d for d in (-0.002, -0.001, 0.0, 0.001, 0.002) for _ in range(3)]


def curve(step_time: float, parts: bool = False, mfu: float | None = None, steps: int = 18) -> list:
    rows = [{"step": s, "loss": 6.0 - 0.3 * s, "step_time": step_time} for s in range(1, steps + 1)]
    rows[-1]["val_loss"] = 3.2
    for r in rows if parts else []:
        r.update(compute_s=0.6 * step_time, exposed_comm_s=0.1 * step_time, bubble_s=0.1 * step_time)
    for r, d in zip(rows, WIGGLE) if mfu is not None else ():
        r["mfu"] = mfu + d
    return rows


def write_run(job: Path, study: dict, status: str, result: dict | None = None, world: int = 1, batch: int = 8,
              rows: list = (), started: str = "2025-01-01T00:00:00", config: dict | None = None,
              layout: dict | None = None, backends: dict | None = None) -> None:
    job.mkdir(parents=True)
    record = {"config": {"train": {"batch_size": batch, "seq_len": 16}, "study": study, **(config or {})},
              "study": study, "status": status, "world_size": world,
              "attempts": [{"started": started, "status": status}]}
    if backends:
        record["backends"] = backends
    if layout:
        record["layout"] = layout
    if result:
        record["final"] = result
    (job / "run.json").write_text(json.dumps(record))
    (job / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_dead_job(job: Path, study: dict, batch: int = 8) -> None:
    """A job that died before train.py wrote run.json: only Hydra's config is there."""
    (job / ".hydra").mkdir(parents=True)
    config = {"train": {"batch_size": batch, "seq_len": 16}, "study": study}
    (job / ".hydra" / "config.yaml").write_text(json.dumps(config))  # JSON is YAML


def ablation_study(step: int, label: str, without=()) -> dict:
    return {"name": "megascale_ablation", "step": step, "label": label, "without": list(without), **CPU}


# run.json's backends as train.py records them: the baseline's unfused attention in fp32 on a CPU,
# and step 6 on a GPU where kernels.attention=auto found no flash-attn.
UNFUSED = {"attention": {"requested": "unfused", "ran": "unfused", "sdpa_kernel": None, "fallback": None},
           "precision": "fp32", "compiled": False, "fused": False, "tf32": None}
AUTO_WITHOUT_FLASH = {"attention": {"requested": "auto", "ran": "sdpa", "sdpa_kernel": "flash_attention",
                                    "fallback": "flash-attn is not installed"},
                      "precision": "bf16", "compiled": True, "fused": True, "tf32": False}


@pytest.fixture
def ablation_dir(tmp_path) -> Path:
    """Steps 0-8 with: two ok, a job that died (2), a pending one (3), a missing one (4), train.py's
    "finished" (7, run without the pending step 3) and "interrupted" (8), a later failed rerun of step 1, and a run with no study."""
    root = tmp_path / "ablation"
    write_run(root / "0", ablation_study(0, "baseline (Megatron-LM)"), "ok", final(0.30, 1000, 0.5),
              rows=curve(0.5, mfu=0.30), backends=UNFUSED)
    write_run(root / "1", ablation_study(1, "+PTB"), "ok", final(0.35, 1200, 0.42, exposed_comm_s=0.05),
              rows=curve(0.42, parts=True, mfu=0.35), backends=UNFUSED)
    write_dead_job(root / "2", ablation_study(2, "+SWA"))
    write_run(root / "3", ablation_study(3, "+TP overlap"), "pending")
    write_run(root / "4", ablation_study(5, "+DP overlap"), "ok", final(0.40, 1400, 0.36, exposed_comm_s=0.02),
              rows=curve(0.36, mfu=0.40))
    write_run(root / "5", ablation_study(6, "+efficient operators"), "ok", final(0.42, 1500, 1 / 3),
              rows=curve(0.33, mfu=0.42), backends=AUTO_WITHOUT_FLASH)
    write_run(root / "6", ablation_study(7, "+misc (data pipeline)", without=[3]), "finished", final(0.4204, 1520, 0.33),
              rows=curve(0.33, mfu=0.4204))  # +0.04 points: inside the noise
    write_run(root / "7", ablation_study(8, "+LAMB (batch x3)"), "interrupted", final(0.50, 4000, 0.5), batch=24,
              rows=curve(0.5, mfu=0.50, steps=10))  # stopped after 10 steps: too few for windows
    write_run(root / "8", ablation_study(1, "+PTB"), "failed", started="2025-01-02T00:00:00")
    write_run(root / "9", {}, "ok", final(0.1, 1, 1.0))
    (root / "multirun.yaml").write_text("hydra: {}\n")
    return root


@pytest.fixture
def scaling_dir(tmp_path) -> Path:
    root = tmp_path / "scaling"
    study = lambda gpus, batch: {"name": "strong_scaling", "step": None, "label": f"gpus={gpus} batch={batch}", **EMU}
    write_run(root / "0", study(2, 16), "ok", final(0.50, 2000, 2.0), world=2, batch=16)
    write_run(root / "1", study(1, 8), "ok", final(0.50, 1000, 1.0), world=1)
    write_run(root / "2", study(2, 8), "ok", final(0.45, 1800, 0.556), world=2)
    write_dead_job(root / "3", study(4, 8))
    write_run(root / "4", study(4, 16), "ok", final(0.45, 3600, 1.11), world=4, batch=16)
    return root


@pytest.fixture
def convergence_dir(tmp_path) -> Path:
    root = tmp_path / "convergence"
    study = lambda label: {"name": "convergence", "step": None, "label": label, **CPU}
    write_run(root / "0", study("AdamW"), "ok", final(0.3, 1000, 0.5, val_loss=3.2), rows=curve(0.5))
    write_run(root / "1", study("LAMB x4"), "ok", final(0.3, 4000, 0.5), batch=32, rows=curve(0.5))
    write_run(root / "2", study("LAMB x3"), "failed")
    return root


ABLATION = """\
Table 3 ablation (megascale_ablation): scale cpu, fabric loopback (5 ok, 1 failed, 1 pending, 1 missing, 1 stopped)

| step | MFU | ΔMFU | tokens/s | step time | exposed comm |
|---|---|---|---|---|---|
| baseline (Megatron-LM) | 30.0% ± 0.2 |  | 1,000 | 0.5 s | n/a |
| +PTB | 35.0% ± 0.2 | +5.0 ± 0.2 | 1,200 | 0.42 s | 0.05 s |
| +SWA | failed |  |  |  |  |
| +TP overlap | pending |  |  |  |  |
| +PP overlap | missing |  |  |  |  |
| +DP overlap | 40.0% ± 0.2 | +5.0 ± 0.2 (vs +PTB) | 1,400 | 0.36 s | 0.02 s |
| +efficient operators | 42.0% ± 0.2 | +2.0 ± 0.2 | 1,500 | 0.333 s | n/a |
| +misc (data pipeline) (without step 3) | 42.0% ± 0.2 | +0.0 ± 0.2 (noise) | 1,520 | 0.33 s | n/a |
| +LAMB (batch x3) (stopped) | 50.0% | +8.0 ± ? (too few steps) | 4,000 | 0.5 s | n/a |

MFU: median over the steps after the first 3, ± its 95% interval from 5 windows of those steps. ΔMFU: MFU points \
against the previous step with a measurement, ± the 95% interval of the difference (Welch); "noise" marks a change \
whose interval holds zero. n/a: the step's switch has nothing to act on in this layout, so the row is not a \
measurement of it. Exposed comm: median per step, n/a where the run did not log it.

pending: the step's switch has not landed yet; the later steps ran without it (their rows say so).

Ran: step 0, step 1: attention unfused, fp32, TF32 n/a, eager; step 5, step 7, step 8: not recorded; step 6: \
attention sdpa (SDPA flash_attention) (auto without flash-attn: flash-attn is not installed), bf16, TF32 off, \
compiled."""

SCALING = """\
Table 2 strong scaling (strong_scaling): scale cpu, fabric emulated:2x2@1gbit (4 ok, 1 failed)

| GPUs | batch | step time | tokens/s | MFU | scaling eff. |
|---|---|---|---|---|---|
| 1 | 8 | 1 s | 1,000 | 50.0% | 100.0% |
| 2 | 8 | 0.556 s | 1,800 | 45.0% | 90.0% |
| 4 | 8 | failed |  |  |  |
| 2 | 16 | 2 s | 2,000 | 50.0% | 100.0% |
| 4 | 16 | 1.11 s | 3,600 | 45.0% | 90.0% |

Scaling efficiency: (tokens/s / GPUs) / (tokens/s / GPUs of the fewest-GPU measured run at the same batch).

Ran (every measured row): not recorded."""

CONVERGENCE = """\
Convergence (convergence): scale cpu, fabric loopback (2 ok, 1 failed)

| variant | tokens seen | final loss | val loss |
|---|---|---|---|
| AdamW | 1.28k | 3.000 | 3.200 |
| LAMB x4 | 5.12k | 3.000 | n/a |
| LAMB x3 | failed |  |  |

Ran (every measured row): not recorded."""


def test_ablation_table_exact(ablation_dir):
    assert tables.ablation_table(tables.load_runs([ablation_dir])) == ABLATION


def test_scaling_and_convergence_tables_exact(scaling_dir, convergence_dir):
    runs = tables.load_runs([scaling_dir, convergence_dir])
    assert tables.scaling_table(runs) == SCALING
    assert tables.convergence_table(runs) == CONVERGENCE


def test_fabrics_are_separate_tables(ablation_dir, tmp_path):
    """MFU over loopback and over an emulated network don't compare: each fabric gets its own table."""
    study = {**ablation_study(0, "baseline (Megatron-LM)"), **EMU}
    write_run(tmp_path / "other" / "0", study, "ok", final(0.2, 900, 0.6))
    built = tables.ablation(tables.load_runs([ablation_dir, tmp_path / "other"]))
    assert [t.title.split(": ", 1)[1].split(" (")[0] for t in built] == [
        "scale cpu, fabric loopback", "scale cpu, fabric emulated:2x2@1gbit"]
    assert [c[1] for c in built[1].cells] == ["20.0%"] + ["missing"] * 8


def test_cli_writes_csv_and_latex_then_refuses(ablation_dir, scaling_dir, tmp_path, capsys):
    out = tmp_path / "results"
    assert tables.main([str(ablation_dir), str(scaling_dir), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert ABLATION in printed and SCALING in printed and "left out (no study in run.json): 1 runs" in printed
    assert sorted(p.name for p in out.iterdir()) == [
        "megascale_ablation.csv", "megascale_ablation.tex", "strong_scaling.csv", "strong_scaling.tex"]
    rows = list(csv.DictReader(open(out / "megascale_ablation.csv")))
    assert [r["status"] for r in rows] == ["ok", "ok", "failed", "pending", "missing", "ok", "ok", "ok", "stopped"]
    assert rows[4]["mfu"] == "" and float(rows[5]["delta_mfu"]) == pytest.approx(0.05)
    assert rows[5]["delta_vs"] == "+PTB" and rows[0]["fabric"] == "loopback"
    tex = (out / "megascale_ablation.tex").read_text()
    assert r"\begin{tabular}{lrrrrr}" in tex and r"$\Delta$MFU" in tex and r"30.0\%" in tex
    assert r"\caption{Table 3 ablation (megascale\_ablation): scale cpu, fabric loopback" in tex
    before = {p: p.read_text() for p in out.iterdir()}
    assert tables.main([str(ablation_dir), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "refusing to overwrite" in err and err.count("\n") == 1
    assert {p: p.read_text() for p in out.iterdir()} == before


def test_default_out_is_the_multirun_dir(scaling_dir, capsys):
    assert tables.main([str(scaling_dir)]) == 0
    assert (scaling_dir / "strong_scaling.csv").exists() and (scaling_dir / "strong_scaling.tex").exists()


def test_bad_inputs_are_one_line_exit_2(tmp_path, capsys, monkeypatch):
    assert tables.main([str(tmp_path / "nope")]) == 2
    (tmp_path / "empty").mkdir()
    assert tables.main([str(tmp_path / "empty")]) == 2
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert tables.main(["--wandb-group", "g", "--out", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and "W&B online" in err[2]
    assert not (tmp_path / "w").exists()


def test_figures_written_then_refused(ablation_dir, convergence_dir, tmp_path, capsys):
    out = tmp_path / "figs"
    assert figures.main([str(ablation_dir), str(convergence_dir), "--out", str(out)]) == 0
    stems = ["loss_convergence_cpu_loopback", "loss_megascale_ablation_cpu_loopback", "mfu_cpu_loopback",
             "step_time_cpu_loopback"]
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{s}.{e}" for s in stems for e in ("png", "pdf"))
    for stem in stems:
        png, pdf = (out / f"{stem}.png").read_bytes(), (out / f"{stem}.pdf").read_bytes()
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000 and pdf.startswith(b"%PDF")
    assert str(out / "mfu_cpu_loopback.png") in capsys.readouterr().out
    assert figures.main([str(ablation_dir), "--out", str(out)]) == 2


def test_step_time_breakdown_parts_or_total(ablation_dir):
    records = tables.ablation(tables.load_runs([ablation_dir]))[0].records
    parts, logged = figures.breakdown(records[1])  # +PTB logged compute / exposed comm / bubble
    assert logged and [n for n, _ in parts] == ["compute", "exposed comm", "pipeline bubble", "other"]
    assert sum(v for _, v in parts) == pytest.approx(0.42)
    assert figures.breakdown(records[0]) == ([("total (no breakdown logged)", 0.5)], False)


# --- What crashes leave in run dirs ---

def test_a_corrupt_metrics_line_is_skipped_and_said(tmp_path, capsys):
    """A crash's partial last line and a garbled one in the middle: tables and figures use the rest,
    and say on stderr which lines they skipped."""
    job = tmp_path / "sweep" / "0"
    write_run(job, ablation_study(0, "baseline (Megatron-LM)"), "ok", final(0.3, 1000, 0.5), rows=curve(0.5, steps=10))
    lines = (job / "metrics.jsonl").read_text().splitlines(keepends=True)
    lines[3] = "{garbled\n"
    (job / "metrics.jsonl").write_text("".join(lines) + '{"step": 11, "loss": 2.')
    assert [r["step"] for r in tables.read_metrics(job)] == [1, 2, 3, 5, 6, 7, 8, 9, 10]
    assert "skipped 2 unreadable line(s) (4, 11)" in capsys.readouterr().err
    assert tables.main([str(tmp_path / "sweep")]) == 0
    assert figures.main([str(tmp_path / "sweep"), "--out", str(tmp_path / "figs")]) == 0
    assert (tmp_path / "figs" / "loss_megascale_ablation_cpu_loopback.png").exists()


def test_a_resumed_run_starts_its_rows_on_a_new_line(tmp_path):
    """metrics.jsonl after a crash mid-write ends in half a row; the next attempt appends whole ones."""
    import config
    import metrics
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 6.0}\n{"step": 2, "lo')
    log = metrics.RunLog(tmp_path, {}, config.WandbConfig(mode="disabled"))
    log.step({"step": 2, "loss": 5.5})
    log.finish("finished", {})
    assert [r["step"] for r in tables.read_metrics(tmp_path)] == [1, 2]


def test_figures_of_a_sweep_whose_jobs_all_crashed_is_one_line(tmp_path, capsys):
    root = tmp_path / "sweep"
    for k in range(3):
        write_dead_job(root / str(k), ablation_study(k, tables.ABLATION_LABELS[k]))
    write_run(root / "3", ablation_study(3, "+TP overlap"), "failed")
    assert figures.main([str(root), "--out", str(tmp_path / "figs")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "none of the 4 runs" in err[0] and "4 failed" in err[0] and "Fix:" in err[0]
    assert not (tmp_path / "figs").exists()


# --- What each step's switch acts on in the run's layout, and over which fabric ---

def mesh(tp: int, pp: int, dp: int) -> dict:
    """run.json's layout for order [dp, pp, tp] (TP on consecutive ranks)."""
    ranks = [{"rank": (d * pp + p) * tp + t, "dp": d, "pp": p, "tp": t}
             for d in range(dp) for p in range(pp) for t in range(tp)]
    return {"tp_size": tp, "pp_size": pp, "dp_size": dp, "ranks": ranks}


def layout_sweep(root: Path, fabric: str, tp: int, pp: int, dp: int, window: int, seq: int = 256) -> Path:
    """The 9 steps of an ablation on one layout, each 1 point above the last."""
    for k in range(9):
        study = {**ablation_study(k, tables.ABLATION_LABELS[k]), "fabric": fabric}
        config = {"train": {"batch_size": 8, "seq_len": seq}, "parallel": {"tp": tp, "pp": pp, "dp": dp},
                  "model": {"attention": {"window": window if k >= 2 else None}}, "study": study}
        write_run(root / str(k), study, "ok", final(0.10 + 0.01 * k, 1000, 0.5), world=tp * pp * dp,
                  rows=curve(0.5, mfu=0.10 + 0.01 * k), config=config, layout=mesh(tp, pp, dp))
    return root


def test_a_switch_with_nothing_to_act_on_is_na_with_its_reason(tmp_path):
    """tp2 on 2 loopback ranks with a window as long as the sequence: SWA, PP overlap and DP overlap
    have nothing to act on. Their rows are n/a, never a number, in the table, CSV and LaTeX; the
    next measured step's ΔMFU says which step it is against; the TP rows say TP ran over loopback."""
    root = layout_sweep(tmp_path / "lo", "loopback", tp=2, pp=1, dp=1, window=256)
    table = tables.ablation(tables.load_runs([root]))[0]
    cells = {row[0].split(" (")[0]: row for row in table.cells}
    for step in ("+SWA", "+PP overlap", "+DP overlap"):
        assert cells[step][1:] == ["n/a", "", "", "", ""], cells[step]
    assert cells["+TP overlap"][2] == "+2.0 ± 0.2 (vs +PTB)"
    assert cells["+efficient operators"][2] == "+3.0 ± 0.2 (vs +TP overlap)"  # steps 4, 5: n/a
    notes = "\n".join(table.notes)
    assert "(b) n/a: SWA: window 256 >= seq_len 256: every key is inside it" in notes
    assert "n/a: PP overlap: pp = 1 in this layout, no pipeline sends to overlap" in notes
    assert "n/a: DP overlap: dp = 1 in this layout" in notes
    assert "(a) TP runs over loopback: gloo's copies and sums take the same CPU cores as the compute" in notes
    assert cells["+PTB"][0] == "+PTB (a)" and "(a)" in [c[0] for c in table.cells if c[0].startswith("+TP")][0]
    records = {r["label"]: r for r in table.records}
    assert records["+PP overlap"]["status"] == "n/a" and records["+PP overlap"]["mfu"] is None
    assert records["+PP overlap"]["na_reason"].startswith("PP overlap: pp = 1")
    rows = list(csv.DictReader(io.StringIO(tables.to_csv([table]))))
    assert [r["status"] for r in rows].count("n/a") == 3 and all(r["mfu"] == "" for r in rows if r["status"] == "n/a")
    assert r"+PP overlap (c) & n/a &" in table.latex()
    # figures: an n/a step has its reason's word where its bar would be, no bar
    assert figures.main([str(root), "--out", str(tmp_path / "figs")]) == 0


def test_each_row_says_over_which_fabric_its_switch_communicates(tmp_path):
    """4 emulated hosts of 2 ranks at tp2 pp2 dp2 (MegaScale's placement: TP inside a host, PP and DP
    across hosts): the TP rows say TP ran over a host's loopback, the PP and DP rows that their
    bytes crossed the emulated links; every step has something to act on."""
    root = layout_sweep(tmp_path / "emu", "emulated:4x2@250mbit", tp=2, pp=2, dp=2, window=64)
    table = tables.ablation(tables.load_runs([root]))[0]
    assert all(r["status"] == "ok" and r["mfu"] is not None for r in table.records[:6])
    notes = "\n".join(table.notes)
    assert "(a) TP runs over loopback inside a host" in notes
    assert "(b) PP crosses the emulated 250mbit links between hosts" in notes
    assert "(c) DP crosses the emulated 250mbit links between hosts" in notes
    labels = [row[0] for row in table.cells[:6]]
    assert labels == ["baseline (Megatron-LM)", "+PTB (a)", "+SWA", "+TP overlap (a)", "+PP overlap (b)",
                      "+DP overlap (c)"]
    assert [row[2] for row in table.cells[1:6]] == ["+1.0 ± 0.2"] * 5
