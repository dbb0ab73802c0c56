"""The studies of conf/experiment: they compose and validate at both scales, the ablation's steps
turn on exactly their own switches, pending steps are exactly the switches that have not landed,
and a torchrun multirun of the ablation leaves run dirs that tables.py reads back."""
import functools

import pytest
from omegaconf import OmegaConf

import config
from conftest import SMALL, run_train
from config import ConfigError
from experiments import tables

EXPERIMENTS = sorted(p.stem for p in (config.CONF_DIR / "experiment").glob("*.yaml"))
CLUSTER_VARIANTS = sorted(p.stem[:-len("_cluster")] for p in (config.CONF_DIR / "study_scale").glob("*_cluster.yaml"))
PENDING = config.compose(["experiment=megascale_ablation"]).ablation.pending
# What each step of Table 3 turns on, on top of the step before it (leaf keys of the config).
STEP_SWITCHES = {
    1: {"model.block"},
    2: {"model.attention.window", "kernels.attention"},
    3: {"parallel.overlap.tp"},
    4: {"parallel.overlap.pp"},
    5: {"parallel.overlap.dp"},
    6: {"kernels.fused", "kernels.attention"},
    7: {"data.pipeline"},
    8: {"optim.name", "optim.betas", "optim.eps", "optim.weight_decay", "optim.trust_clamp", "train.batch_size"},
}


def planned_world(cfg) -> int:
    return cfg.parallel.tp * cfg.parallel.pp * max(cfg.parallel.dp, 1)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_and_validates_at_cpu_scale(experiment):
    cfg = config.compose([f"experiment={experiment}", "scale=cpu"])
    config.validate(cfg, planned_world(cfg))
    assert cfg.study.scale == "cpu"


def test_every_study_has_a_cluster_variant():
    assert CLUSTER_VARIANTS == ["convergence", "megascale_ablation", "strong_scaling"]


@pytest.mark.parametrize("experiment", CLUSTER_VARIANTS)
def test_every_cluster_study_checkpoints_periodically_in_the_background(experiment):
    """A job at the paper's scale that fails loses at most checkpoint.interval steps (a preemption
    or a time limit: none, train.py saves where it stops), and a save stalls it only while it is
    copied to host memory."""
    cfg = config.compose([f"experiment={experiment}", "scale=cluster"])
    assert cfg.checkpoint.interval > 0 and cfg.checkpoint.async_save


@pytest.mark.parametrize("step", range(9))
@pytest.mark.parametrize("experiment", ["megascale_ablation"])
def test_cluster_variants_validate_as_a_dry_run(experiment, step):
    cfg = config.compose([f"experiment={experiment}", "scale=cluster", f"ablation.step={step}", "dry_run=true"])
    config.validate(cfg)  # no world given: a dry run plans for the layout's own world size
    assert (cfg.study.scale, cfg.model.name, planned_world(cfg)) == ("cluster", "175B", 256)
    if experiment == "megascale_ablation":  # the paper's setting: batch 256, x3 with LAMB, TP8 PP8 vpp6
        batch = 768 if step == 8 else 256
        assert (cfg.train.batch_size, cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.vpp) == (batch, 8, 8, 6)
        assert cfg.train.batch_size == cfg.parallel.dp * cfg.parallel.microbatches


@pytest.mark.parametrize("row", range(8))
def test_strong_scaling_cluster_rows_are_table_2(row):
    """Each row validates at its own GPU count with the paper's layout and batch, one sequence
    per microbatch; and `--cfg job` style dry runs need no hardware."""
    cfg = config.compose(["experiment=strong_scaling", "scale=cluster", f"scaling.row={row}", "dry_run=true"])
    gpus = cfg.scaling.rows[row]["gpus"]
    config.validate(cfg, gpus)
    dp = gpus // (cfg.parallel.tp * cfg.parallel.pp)
    assert (cfg.model.name, cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.vpp) == ("175B", 8, 8, 6)
    assert cfg.train.batch_size == (768 if gpus <= 1024 else 6144) == dp * cfg.parallel.microbatches
    assert cfg.study.label == f"{gpus} GPUs, batch {cfg.train.batch_size}"


@pytest.mark.parametrize("scale, world", [("cpu", 1), ("cluster", 128)])
def test_convergence_variants_see_the_same_tokens(scale, world):
    """Fig. 10: PTB+SWA changes only the block and window; LAMB takes 4x the batch for a quarter
    of the steps, so every variant's loss-against-tokens curve ends at the same token count."""
    cfgs = {v: config.compose(["experiment=convergence", f"scale={scale}", f"convergence.variant={v}", "dry_run=true"])
            for v in ("baseline", "ptb_swa", "lamb_4x")}
    for cfg in cfgs.values():
        config.validate(cfg, world)
    base, ptb, lamb = cfgs["baseline"], cfgs["ptb_swa"], cfgs["lamb_4x"]
    assert (base.model.block, base.model.attention.window, base.optim.name) == ("sequential", None, "adamw")
    assert (ptb.model.block, ptb.model.attention.window) == ("parallel", base.convergence.window)
    assert (lamb.optim.name, lamb.train.batch_size) == ("lamb", 4 * base.train.batch_size)
    assert len({c.train.batch_size * c.train.max_steps for c in cfgs.values()}) == 1


def resolved(step: int, pending=()) -> dict:
    cfg = config.compose(["experiment=megascale_ablation", f"ablation.step={step}", f"ablation.pending={list(pending)}"])
    return cfg


def leaves(tree, prefix="") -> dict:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in leaves(sub, f"{prefix}{key}.").items()}
    return {prefix[:-1]: tree}


@functools.lru_cache(maxsize=None)
def step_leaves(step: int) -> dict:
    """Every leaf of ablation step `step`'s config (composed once per step: each test reads two)."""
    return leaves(OmegaConf.to_container(OmegaConf.structured(resolved(step))))


@pytest.mark.parametrize("step", range(1, 9))
def test_each_step_turns_on_exactly_its_switches(step):
    ignored = ("study.", "ablation.", "logging.wandb.name")
    before, after = step_leaves(step - 1), step_leaves(step)
    changed = {k for k in after if after[k] != before[k] and not k.startswith(ignored)}
    assert changed == STEP_SWITCHES[step]
    assert after["study.label"] == tables.ABLATION_LABELS[step]


def test_pending_steps_are_exactly_the_switches_validate_refuses():
    """The list in megascale_ablation.yaml cannot go stale: a step is pending if and only if
    turning on its own switch (and no other pending one) is refused as not implemented."""
    refused = set()
    for step in range(9):
        cfg = resolved(step, pending=[k for k in PENDING if k != step])
        try:
            config.validate(cfg, planned_world(cfg))
        except ConfigError as err:
            assert "not implemented" in str(err), err
            refused.add(step)
    assert refused == set(PENDING)


def test_later_steps_record_the_pending_steps_they_lack():
    assert resolved(8, pending=[3, 4, 5]).study.without == [3, 4, 5]
    assert resolved(4, pending=[3, 4, 5]).study.pending and resolved(4, pending=[3, 4, 5]).study.without == [3]
    assert not resolved(2, pending=[3, 4, 5]).study.pending and resolved(2, pending=[3, 4, 5]).study.without == []


def test_torchrun_multirun_gives_measured_and_pending_rows(tmp_path, cache_dir):
    """One multirun over two steps in the same two ranks (the process group outlives the first job):
    step 1 trains and is measured, step 3 (marked pending here, as a switch that has not landed
    would be) is recorded as pending, and tables.py shows both."""
    sweep = tmp_path / "sweep"
    run_train(tmp_path / "unused", ["-m", "experiment=megascale_ablation", "ablation.step=1,3", "ablation.pending=[3]"] + SMALL +
              ["parallel.pp=1", "parallel.dp=1", "train.max_steps=5", f"hydra.sweep.dir={sweep}"], cache_dir, nproc=2)
    runs = {r.step: r for r in tables.load_runs([sweep])}
    assert runs[1].status == "ok" and runs[1].world == 2 and runs[1].final["mfu"] > 0
    assert runs[3].status == "pending" and runs[3].final == {}
    text = tables.ablation_table(list(runs.values()))
    assert "| +TP overlap | pending |" in text and "| +PTB (a) | " in text and "| baseline (Megatron-LM) | missing |" in text
    assert "(a) TP runs over loopback" in text  # where PTB's halved TP collectives went


@pytest.mark.parametrize("argv", [
    ["-m", "experiment=megascale_ablation", "scale=cluster", "ablation.step=range(0,9)"],
    ["-m", "experiment=strong_scaling", "scale=cluster", "scaling.row=range(0,8)"],
    ["-m", "experiment=convergence", "scale=cluster", "convergence.variant=baseline,ptb_swa,lamb_4x"]])
def test_cluster_sweeps_pass_preflight_on_a_login_node(argv):
    """Submitting through the submitit launcher from a machine with no GPU: every job validates
    against the world the launcher will start (nodes x tasks per node), not this process."""
    config.preflight(argv)  # exits 2 with a one-line error on failure


def test_a_submitit_job_whose_layout_needs_other_ranks_fails_preflight(capsys):
    with pytest.raises(SystemExit) as stop:
        config.preflight(["-m", "experiment=megascale_ablation", "scale=cluster", "ablation.step=0",
                          "hydra.launcher.nodes=2"])
    assert stop.value.code == 2
    assert "world size is 16" in capsys.readouterr().err


@pytest.mark.parametrize("optimizer", ["adamw", "lamb"])
def test_the_batch_study_scales_rate_and_warm_up_by_its_rule(optimizer):
    """At k times the batch: k times the sequences for 1/k of the steps (equal tokens), the rate
    times sqrt(k) (optim.batch_scaled_lr) times the sweep's multiple, the warm-up the same tokens,
    and the held-out set the same sequences, evaluated at the same token counts."""
    from experiments import batch_study
    cfgs = {k: config.compose(["experiment=convergence", *batch_study.SCALE, f"convergence.optimizer={optimizer}",
                               f"convergence.k={k}", "convergence.lr_mult=0.5"]) for k in batch_study.KS}
    one = cfgs[1]
    for k, cfg in cfgs.items():
        tokens = cfg.train.batch_size * cfg.train.seq_len
        assert (cfg.optim.name, cfg.train.batch_size, cfg.train.max_steps) == (optimizer, k * one.train.batch_size,
                                                                               one.train.max_steps // k)
        assert cfg.train.lr == pytest.approx(0.5 * k ** 0.5 * getattr(one.convergence, f"{optimizer}_lr"))
        assert abs(cfg.optim.warmup_steps * tokens - cfg.convergence.warmup_tokens) <= tokens / 2  # to the nearest step
        assert cfg.train.eval_interval * k == one.train.eval_interval
        assert cfg.train.eval_batches * cfg.train.batch_size == one.train.eval_batches * one.train.batch_size
        assert cfg.study.label == f"{optimizer} k={k} lr x0.5"
    assert config.compose(["experiment=convergence", "convergence.variant=lamb_4x"]).optim.name == "lamb"


def test_a_convergence_run_whose_evaluations_miss_k1s_token_counts_is_refused():
    with pytest.raises(config.ConfigError, match=r"convergence.steps: .* k=8"):
        config.validate(config.compose(["experiment=convergence", "convergence.k=8"]), world=1)   # 600 / 8 = 75 steps
