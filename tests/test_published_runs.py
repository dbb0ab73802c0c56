"""The performance model against published runs (experiments/data/published_runs.csv, priced by
experiments/validate_published.py): every row converts to a config, the declared fit/held-out split
holds, the framework overhead is fitted on fit rows only, and a run the model cannot express fails
with one line naming its knob."""
import json

import pytest

import machine
from clustermodel import cli
from clustermodel import perfmodel as pm


@pytest.fixture(scope="module")
def published():
    from experiments import validate_published
    return validate_published


def test_published_runs_parse_and_every_row_converts(published):
    """Every row is cited and split, and its measured throughput converts to the project's MFU:
    a figure counted with full recomputation (96 s l h^2 ...) is about 3/4 of it in model FLOPs, an
    MFU counted without (72 s l h^2 ...) about itself."""
    rows = published.read_rows()
    assert len(rows) >= 20 and len({r["source"] for r in rows}) >= 4
    for r in rows:
        assert r["citation"] and r["split"] in ("fit", "held_out", "excluded"), r["run"]
        assert (r["split"] == "excluded") == bool(published.missing_knob(r)), r["run"]
        if not r["flop_formula"]:
            continue
        if r["measured_unit"] == "tokens_per_s_per_gpu":  # priced with the row's model: see the next test
            continue
        mfu = published.published_mfu(r)
        peak = machine.DEVICE_PEAK_TFLOPS[machine.gpu_key(r["gpu"])]
        measured = float(r["measured"]) / (peak if r["measured_unit"] == "tflops_per_gpu" else 100)
        ratio = mfu / measured
        assert ratio == pytest.approx(0.75 if r["flop_formula"] == "megatron_recompute" else 1.0, rel=0.03), r["run"]


def test_a_figure_in_tokens_is_priced_with_the_rows_own_model(published):
    """torchtitan's tokens a second per GPU become the project's MFU through the row's composed model
    (Llama's SwiGLU and grouped-query attention, not GPT's block). torchtitan's own MFU, stated beside
    them, counts 6N over every parameter (the embedding and norms too): recounted so, the figure is
    that MFU within 0.1 point."""
    import model as gpt
    stated = {"Llama 3 8B selective layer": 56.8, "Llama 3 70B full": 51.7, "Llama 2 13B none": 61.1,
              "Llama 2 13B selective layer": 54.1, "Llama 2 70B full": 50.5}
    rows = {r["run"]: r for r in published.read_rows() if r["measured_unit"] == "tokens_per_s_per_gpu"}
    assert set(stated) <= set(rows)
    for run, source_mfu in stated.items():
        m = published.row_config(rows[run])[0].model
        assert m.mlp == "swiglu" and m.norm == "rmsnorm"
        seq = int(rows[run]["seq"])
        every_parameter = 6 * (m.vocab_size * m.d_model + (2 * m.n_layers + 1) * m.d_model)
        recount = (gpt.flops_per_token(m, seq) + every_parameter) / gpt.flops_per_token(m, seq)
        assert 100 * published.published_mfu(rows[run], m) * recount == pytest.approx(source_mfu, abs=0.1), run


def test_published_fit_split_is_honoured(published):
    """At most half of each source's expressible rows are fit, every second one in table order, and the
    committed fit used those rows and Table 2's Megatron-LM column, no held-out row."""
    rows = [r for r in published.read_rows() if r["split"] != "excluded" and r["run"] not in published.HELD_OUT_AFTER_FIT]
    assert all(r["split"] == "held_out" for r in published.read_rows() if r["run"] in published.HELD_OUT_AFTER_FIT)
    fit_runs = set()
    for source in {r["source"] for r in rows}:
        mine = [r for r in rows if r["source"] == source]
        assert [r["split"] for r in mine] == ["held_out" if i % 2 == 0 else "fit" for i in range(len(mine))], source
        fit_runs |= {r["run"] for r in mine if r["split"] == "fit"}
    table2 = [r["gpus"] for r in cli.read_csv("megascale_table2.csv")]
    fit_runs |= {f"175B Megatron-LM@{gpus}" for gpus in table2}
    assert set(json.loads(pm.FIT_FILE.read_text())["row_errors_points"]) == fit_runs


def test_framework_overhead_is_fitted_on_fit_rows_and_applied_to_held_out(published):
    """A framework outside the project's family gets the compute and communication efficiencies its
    fit rows give (one for both from one or two rows; a single row is then matched, several straddle
    theirs), the family 1.0, and a framework with no fit row 1.0."""
    fit = json.loads(pm.FIT_FILE.read_text())
    frameworks = fit["framework_overhead"]
    rows = [r for r in published.read_rows() if r["split"] != "excluded"]
    assert set(frameworks) == {r["framework"] for r in rows if r["split"] == "fit"} - set(published.OWN_FRAMEWORKS)
    for fw in published.OWN_FRAMEWORKS + ("no-such-framework",):
        assert published.framework_overhead(fw) == {"compute": 1.0, "communication": 1.0}
    for fw, overhead in frameworks.items():
        assert set(overhead) == set(published.FRAMEWORK_RATES) and all(0 < e <= 1.5 for e in overhead.values()), fw
        errors = [fit["row_errors_points"][r["run"]] for r in rows if r["split"] == "fit" and r["framework"] == fw]
        assert min(abs(e) for e in errors) < 0.5 and (len(errors) == 1 or min(errors) <= 0 <= max(errors)), fw
        if len(errors) <= 2:  # two parts only where the fit rows outnumber them
            assert overhead["compute"] == overhead["communication"], fw


def test_framework_overhead_slows_what_binds_the_step(published):
    """Each part of a framework's overhead slows the step it binds: at DeepSpeed's fitted overhead,
    its ZeRO-3 at 4 sequences a GPU (384 GPUs) is compute-bound and at 1 (1,536 GPUs) link-bound,
    and halving the compute part slows the first far more, the communication part the second."""
    rows = {r["row"]["run"]: r for r in published.priced_rows(published.all_rows())
            if r["row"]["run"] in ("174.6B@384 ZeRO-3", "174.6B@1536 ZeRO-3")}
    fitted = published.framework_overhead("deepspeed")
    base = {run: published.predict_row(r, overhead=fitted).step_s for run, r in rows.items()}
    for part in published.FRAMEWORK_RATES:
        overhead = {**fitted, part: fitted[part] / 2}
        slower = {run: published.predict_row(r, overhead=overhead).step_s / base[run] for run, r in rows.items()}
        compute_bound, link_bound = slower["174.6B@384 ZeRO-3"], slower["174.6B@1536 ZeRO-3"]
        if part == "compute":
            assert compute_bound > 1.7 and compute_bound > link_bound + 0.4, slower
        else:
            assert link_bound > 1.5 and link_bound > compute_bound + 0.3, slower


def test_unexpressible_published_runs_fail_with_one_line_naming_the_knob(published):
    rows = published.read_rows()
    excluded = [r for r in rows if r["split"] == "excluded"]
    assert excluded
    for r in excluded:
        with pytest.raises(published.NotExpressible) as e:
            published.row_config(r)
        assert "\n" not in str(e.value) and r["run"] in str(e.value), str(e.value)
        assert any(knob in str(e.value) for knob in ("parallel.pp", "parallel.microbatches", "train.recompute")), str(e.value)
    base = next(r for r in rows if r["run"] == "175B")   # Korthikanti et al.'s: SP, selective, TP8 PP8
    assert published.missing_knob({**base, "zero_stage": "3"}) is None  # ZeRO-3 is priced (sharding_cost.py)
    for change, knob in (({"precision": "fp8"}, "precision=fp8"),
                         ({"recompute": "4"}, "train.recompute"), ({"layers": "95"}, "parallel.pp"),
                         ({"pp_scatter_gather": "false"}, "scatter/gather")):
        line = published.missing_knob({**base, **change})
        assert line and knob in line and "\n" not in line, (change, line)


def test_a_published_run_recomputing_n_layers_is_expressible_with_n_stated(published):
    """recompute=full:N (Megatron-LM's --recompute-num-layers N) composes train.recompute_layers=N;
    a count of layers without the method stays not expressible."""
    base = next(r for r in published.read_rows() if r["run"] == "175B")
    cfg, _ = published.row_config({**base, "recompute": "full:2"})
    assert (cfg.train.recompute, cfg.train.recompute_layers) == ("full", 2)
    for value in ("4", "full:", "block"):
        assert published.missing_knob({**base, "recompute": value}), value
