"""The configuration schema by owner: hardware.* is what training reads, hardware.perfmodel.* what
only the performance model reads; a misspelt or misplaced key is one line naming it; composing
registers the resolvers, importing train.py does not."""
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import config
from clustermodel import cli
from clustermodel.schema import PerfModelHardware

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("override, key", [
    ("hardware.perfmodel.gemm_eficiency=0.5", "hardware.perfmodel.gemm_eficiency"),  # a typo inside the group
    ("hardware.devices_per_host=8", "hardware.devices_per_host"),                    # a model key outside it
])
def test_a_wrong_hardware_key_is_one_line_naming_it(override, key, capsys):
    with pytest.raises(SystemExit) as stop:
        config.preflight([override])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and key in err and "unknown key" in err and "Fix:" in err


def test_each_hardware_file_keeps_the_models_keys_in_its_perfmodel_group():
    """Every conf/hardware file fits the schema, composed as a run composes it (a file may start from
    another through Hydra's defaults list); its training part holds no key of the model's group."""
    for path in sorted((ROOT / "conf" / "hardware").glob("*.yaml")):
        raw = OmegaConf.load(path)
        assert not set(raw) & set(PerfModelHardware.__dataclass_fields__), path.name
        hw = config.compose([f"hardware={path.stem}"]).hardware
        assert isinstance(hw.perfmodel, PerfModelHardware) and hw.name == path.stem
    a100 = config.compose(["hardware=a100_cluster"]).hardware
    assert (a100.peak_tflops, a100.memory_gib, a100.perfmodel.devices_per_host, a100.perfmodel.inter_host_Gbps) == \
        (312, 80, 8, 1600)


def test_a_run_recorded_with_flat_hardware_keys_reads_into_the_group(tmp_path):
    """python -m clustermodel validate reads runs' .hydra/config.yaml: one that names the model's
    keys at hardware's top level has them moved into hardware.perfmodel."""
    saved = OmegaConf.to_container(OmegaConf.structured(config.compose(["hardware=cpu_local"])))
    rates = saved["hardware"].pop("perfmodel")
    saved["hardware"].update(rates, devices_per_host=1, inter_host_Gbps=0.5)
    (tmp_path / ".hydra").mkdir()
    OmegaConf.save(OmegaConf.create(saved), tmp_path / ".hydra" / "config.yaml")
    cfg = cli.run_config(tmp_path)
    assert cfg.hardware.name == "cpu_local" and cfg.hardware.device == "cpu"
    assert (cfg.hardware.perfmodel.devices_per_host, cfg.hardware.perfmodel.inter_host_Gbps) == (1, 0.5)



def test_a_studys_saved_config_reads_with_its_interpolations_where_nothing_composed_first(tmp_path):
    """python -m clustermodel.predicted RUN_DIR reads a megascale_ablation run's .hydra/config.yaml,
    which keeps its ${ablation:...} interpolations, in a process that composed nothing."""
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text(  # as Hydra saves it: the experiment's lines unresolved
        "ablation:\n  step: 3\nmodel:\n  block: ${ablation:1,parallel,sequential}\n"
        "parallel:\n  overlap:\n    tp: ${ablation:4,chunked,off}\n")
    for name in RESOLVERS:
        OmegaConf.clear_resolver(name)
    try:
        cfg = cli.run_config(tmp_path)
    finally:
        config.register()
    assert (cfg.model.block, cfg.parallel.overlap.tp) == ("parallel", "off")  # step 1 is on at step 3, step 4 not


RESOLVERS = ("run_id", "ablation", "ablation_study", "pick", "convergence", "scaling_row")


def test_importing_train_registers_no_resolver_and_composing_does():
    """The YAML's resolvers come from whatever composes (config.register), never from an import."""
    import importlib
    import train
    for name in RESOLVERS:
        OmegaConf.clear_resolver(name)
    try:
        importlib.reload(train)
        assert not any(OmegaConf.has_resolver(name) for name in RESOLVERS)
        config.compose(["experiment=megascale_ablation", "ablation.step=2"])
        assert all(OmegaConf.has_resolver(name) for name in RESOLVERS)
    finally:
        config.register()


@pytest.mark.parametrize("override, key", [
    ("model.norm=batchnorm", "model.norm"),
    ("model.mlp=relu", "model.mlp"),
    ("model.n_kv_heads=3", "model.n_kv_heads"),     # 4 query heads do not split into 3 groups
    ("model.n_kv_heads=0", "model.n_kv_heads"),
    ("model.ffn_hidden_size=0", "model.ffn_hidden_size"),
    ("model.mlp_ratio=0", "model.mlp_ratio"),
    ("model.n_heads=0", "model.n_heads"),
])
def test_a_bad_model_shape_is_one_line_naming_its_key(override, key):
    with pytest.raises(config.ConfigError) as err:
        config.validate(config.compose([override]), world=1)
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"config error: {key}:") and "Fix:" in line


@pytest.mark.parametrize("name, total", [
    ("llama3_8B", 8_030_261_248), ("llama3_70B", 70_553_706_496), ("llama3_405B", 405_853_388_800),
    ("llama2_13B", 13_015_864_320), ("llama2_70B", 68_976_648_192),
])
def test_llama_shapes_have_the_published_parameter_counts(name, total):
    """conf/model/llama2_*, llama3_*: the matmul weights (model.matmul_params: GQA's narrower k and v, SwiGLU's
    three matrices), the input embedding and the RMSNorm weights (two a block, one final) add up to
    the parameter count Meta publishes for each model."""
    from model import matmul_params
    m = config.compose([f"model={name}"]).model
    config.validate(config.compose([f"model={name}", "dry_run=true"]), world=1)
    assert matmul_params(m) + m.vocab_size * m.d_model + (2 * m.n_layers + 1) * m.d_model == total


@pytest.mark.parametrize("overrides, fix", [
    (["train.recompute_layers=1"], "train.recompute=full"),                          # counts layers of full recomputation only
    (["train.recompute=selective", "train.recompute_layers=1"], "train.recompute=full"),
    (["train.recompute=full", "train.recompute_layers=5"], "train.recompute_layers<=4"),  # tiny: 4 layers a chunk
    (["train.recompute=full", "train.recompute_layers=3", "parallel.pp=2"], "train.recompute_layers<=2"),
    (["train.recompute=full", "train.recompute_layers=-2"], "-1"),
    # uneven chunks of 1 and 3: the largest holds 3
    (["train.recompute=full", "train.recompute_layers=4", "parallel.pp=2", "parallel.pp_first_chunk_layers=1"],
     "train.recompute_layers<=3"),
])
def test_recompute_layers_out_of_place_is_one_line_naming_it(overrides, fix):
    with pytest.raises(config.ConfigError) as err:
        config.validate(config.compose(overrides), world=2 if "parallel.pp=2" in overrides else 1)
    line = str(err.value)
    assert "\n" not in line and line.startswith("config error: train.recompute_layers:") and fix in line.split("Fix:")[1]


def test_recompute_layers_within_a_chunk_is_accepted():
    config.validate(config.compose(["train.recompute=full", "train.recompute_layers=2", "parallel.pp=2"]), world=2)
    config.validate(config.compose(["train.recompute=full", "train.recompute_layers=0"]), world=1)
    config.validate(config.compose(["train.recompute=full", "train.recompute_layers=3", "parallel.pp=2",
                                     "parallel.pp_first_chunk_layers=1"]), world=2)


@pytest.mark.parametrize("overrides, world, key", [
    (["parallel.pp=2", "parallel.pp_first_chunk_layers=5"], 2, "parallel.pp_first_chunk_layers"),  # more than 4
    (["parallel.pp=2", "parallel.vpp=2", "parallel.microbatches=2", "parallel.pp_first_chunk_layers=1",
      "parallel.pp_last_chunk_layers=0"], 2, "parallel.pp_first_chunk_layers"),          # 3 left for 2 chunks
    (["parallel.pp=4", "parallel.pp_first_chunk_layers=2", "parallel.pp_last_chunk_layers=2"], 4,
     "parallel.pp_first_chunk_layers"),                                                  # none left for the middle two
    (["parallel.pp_first_chunk_layers=1"], 1, "parallel.pp_first_chunk_layers"),         # one chunk: no first and last
    (["parallel.pp=2", "parallel.pp_last_chunk_layers=-2"], 2, "parallel.pp_first_chunk_layers"),
])
def test_an_impossible_pipeline_split_is_one_line_naming_it(overrides, world, key):
    with pytest.raises(config.ConfigError) as err:
        config.validate(config.compose(overrides), world=world)
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"config error: {key}:") and "Fix:" in line


@pytest.mark.parametrize("overrides, world", [
    (["parallel.zero_stage=1", "parallel.microbatches=2"], 2),           # the gradients are not sharded
    (["parallel.zero_stage=2", "parallel.pp=2", "parallel.microbatches=2"], 2),  # a pipeline's backwards interleave
])
def test_reducing_each_microbatch_needs_zero_2_or_3_without_a_pipeline(overrides, world):
    cfg = config.compose(overrides + ["parallel.reduce_each_microbatch=true"])
    with pytest.raises(config.ConfigError) as err:
        config.validate(cfg, world=world)
    line = str(err.value)
    assert "\n" not in line and line.startswith("config error: parallel.reduce_each_microbatch:") and "Fix:" in line
    config.validate(config.compose(overrides), world=world)  # the layout itself is fine


@pytest.mark.parametrize("overrides", [
    ["parallel.pp=16", "parallel.pp_first_chunk_layers=7", "parallel.pp_last_chunk_layers=7"],
    ["parallel.pp=16", "parallel.vpp=8", "parallel.microbatches=16", "parallel.pp_first_chunk_layers=0",
     "parallel.pp_last_chunk_layers=0"],
])
def test_llama3_405B_pipeline_layouts_split_its_126_layers(overrides):
    """Meta's: 7 layers on the first and last stage and 8 on each other at pp=16; at vpp=8 a chunk
    of the embedding alone, one of the head alone, and one layer in each of the 126 others."""
    import parallel
    cfg = config.compose(["model=llama3_405B", "train.batch_size=16"] + overrides)
    config.validate(cfg, world=16)
    layers = parallel.chunk_layers(cfg.model.n_layers, cfg.parallel)
    assert sum(layers) == 126 and layers[0] == layers[-1] == (7 if cfg.parallel.vpp == 1 else 0)
    assert set(layers[1:-1]) == {8 if cfg.parallel.vpp == 1 else 1}
