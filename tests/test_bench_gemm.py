"""experiments/bench_gemm.py: the shapes it times are every shape perfmodel prices by shape, and what
it writes loads into a hardware config whose gemm_time then runs at the measured fraction."""
import copy

import pytest
from omegaconf import OmegaConf

import config
from clustermodel import cli
from clustermodel import perfmodel as pm
from experiments import bench_gemm


def gemm_seconds(cfg, gpus, hw):
    """A layer's and the head's GEMM seconds, forward and backward, as perfmodel prices them on hw."""
    cfg = pm.resolve_config(cfg, hw)
    lay = pm.layout_of(cfg, gpus)
    r, net = pm.Rates.of(hw, pm.precision(cfg), lay.gpus), pm.Network(hw, lay)
    fwd, bwd, _ = pm.layer_time(cfg, lay, r, net)
    _, (head_f, head_b) = pm.ends_time(cfg, lay, r, net)
    return sum(part["gemm"] for part in (fwd, bwd, head_f, head_b))


@pytest.mark.parametrize("step", [0, cli.MEGASCALE_STEP])  # unchunked TP; chunked in 4
def test_the_sweep_covers_every_gemm_the_model_prices_by_shape(step):
    """With each listed shape measured, the half-dim model's efficiency no longer moves the GEMMs."""
    cfg = cli.study_config([cli.ABLATION, f"ablation.step={step}"], "cluster")
    shapes = bench_gemm.priced_shapes(cfg, None)
    M, N, K = 2048 // cfg.parallel.overlap.tp_chunks if step else 2048, 3 * 12288 // 8, 12288
    assert (M, N, K) in shapes and (N, K, 2048) in shapes  # QKV forward (a chunk's rows), its weight gradient
    hw = pm.resolve_hardware(cfg.hardware)
    hw.perfmodel.gemm_shapes = {pm.gemm_key(*s): 0.5 for s in shapes}
    other = copy.deepcopy(hw)
    other.perfmodel.gemm_efficiency /= 2
    assert gemm_seconds(cfg, None, hw) == pytest.approx(gemm_seconds(cfg, None, other), rel=1e-12)
    hw.perfmodel.gemm_shapes = {}
    assert gemm_seconds(cfg, None, hw) < gemm_seconds(cfg, None, other)


def test_a_cpu_sweep_loads_into_the_hardware_and_prices_its_shapes(tmp_path):
    bench_gemm.main(["--device", "cpu", "--dtype", "fp32", "--shapes", "64x32x48,32x32x32",
                     "--reps", "2", "--warmup", "1", "--out", str(tmp_path)])
    (path,) = tmp_path.glob("gemm_shapes_*.yaml")
    fragment = OmegaConf.load(path)
    assert fragment.device_name.startswith("cpu") and set(fragment.perfmodel.gemm_shapes) == {"64x32x48", "32x32x32"}
    hw = config.compose(["hardware=cpu_local"]).hardware
    merged = OmegaConf.merge(OmegaConf.structured(hw), {"perfmodel": fragment.perfmodel})  # the schema's check
    hw = pm.resolve_hardware(OmegaConf.to_object(merged))
    r = pm.Rates.of(hw, "fp32", 1)
    measured = fragment.perfmodel.gemm_shapes["64x32x48"]
    assert 0 < measured < 2
    compute = 2 * 64 * 32 * 48 / (r.flops * measured)
    memory = 4 * (64 * 48 + 48 * 32 + 64 * 32) / r.mem
    assert pm.gemm_time(r, 64, 32, 48, 1, 4) == pytest.approx(max(compute, memory) + r.op)
