"""clustermodel/replay.py: the code's own program (a rehearsal's record) replayed on a machine's rates. Checked
here: the replay's rules on hand-made programs (a blocking collective shows whole, an async one its
excess, one group's collectives run in order, a receive waits for its send), and, on the real
code's rehearsals, that its workload is the analytical model's where both price the same physics
(GEMMs, attention, DP's gradient traffic, the pipeline), and where they part."""
import copy
import dataclasses
import functools
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import config
import machine
from clustermodel import perfmodel as pm
from clustermodel import rehearsal
from clustermodel import replay

GB = 1e9

# --- The rules, on hand-made programs: 1e9 bytes of compute or of transfer take 1 s ---

RATES = pm.Rates(flops=1e12, gemm_eff=1.0, half_dim=0.0, flash_eff=1.0, mem=GB, op=0.0, additive=True)


class WireOfOneGBps:
    lay = SimpleNamespace(tp=2, pp=2, dp=2, group=lambda dim: (2, 1))  # (members, stride) of each dim's groups
    rates = SimpleNamespace(devices_per_host=1, collective_efficiency=None, collective_algo="ring")
    intra = inter = (GB, 0.0)   # groups beyond tp, pp and dp (bytes/s, latency)

    def collective(self, kind, nbytes, dim):
        return nbytes / GB

    def pp_send(self, nbytes):
        return nbytes / GB


def program(*events) -> list:
    """Events with their indices, each with `compute` GB of stream work before it."""
    out = []
    for i, (op, extra, compute) in enumerate(events):
        out.append({"i": i, "step": extra.pop("step", 1), "op": op, "work": {"bytes": compute * GB, "ops": 1 if compute else 0},
                    **extra})
    return out


def all_reduce(gb, async_op):
    return {"group": "dp", "comm": "dp0", "ranks": [0, 9], "bytes": gb * GB, "async": async_op}


def replayed(records, slowdown=0.0) -> replay.Replay:
    run = replay.Replay(records, RATES, WireOfOneGBps(), slowdown)
    run.run()
    return run


def test_a_blocking_collective_shows_whole_an_async_one_its_excess_and_one_group_runs_in_order():
    events = program(
        ("all_reduce", all_reduce(0.5, False), 1.0), ("wait", {"of": 0}, 0.0),      # 1 s, then 0.5 s shown
        ("all_reduce", all_reduce(1.0, True), 0.0), ("wait", {"of": 2}, 0.5),       # 0.5 s of compute beside 1 s
        ("host_read", {}, 0.0),
        ("all_reduce", all_reduce(1.0, True) | {"step": 2}, 0.0),                   # two on one group: in turn
        ("all_reduce", all_reduce(1.0, True) | {"step": 2}, 0.0),
        ("wait", {"of": 6, "step": 2}, 0.0), ("host_read", {"step": 2}, 0.0))
    run = replayed([{"rank": 0, "comm": events}], slowdown=0.5)
    # step 1: compute 1, blocking 0.5; then 0.5 s of compute overlapped for 0.5 s costs 0.25 more,
    # and the wait shows the 1 s collective's remaining 0.25
    assert run.step(1) == pytest.approx({"step_s": 2.5, "comm_s": 0.75, "bubble_s": 0.0, "compute_s": 1.75})
    assert run.step(2) == pytest.approx({"step_s": 2.0, "comm_s": 2.0, "bubble_s": 0.0, "compute_s": 0.0})


def test_a_receive_waits_for_its_send_and_the_wait_is_the_bubble():
    sender = program(("send", {"peer": 1, "bytes": 0.25 * GB, "async": True}, 1.0), ("wait", {"of": 0}, 0.0),
                     ("host_read", {}, 0.0))
    receiver = program(("recv", {"peer": 0, "bytes": 0.25 * GB, "async": True}, 0.0), ("wait", {"of": 0}, 0.0),
                       ("host_read", {}, 1.0))
    run = replayed([{"rank": 0, "comm": sender}, {"rank": 1, "comm": receiver}])
    # the transfer starts when both are posted (1 s), ends at 1.25; the receiver then computes 1 s
    assert run.step(1) == pytest.approx({"step_s": 2.25, "comm_s": 0.0, "bubble_s": 1.25, "compute_s": 1.0})


def test_a_batch_ends_when_its_last_transfer_does():
    """batch_isend_irecv: a send its peer takes at once and a receive whose sender posts 1 s later;
    the wait on the batch lasts until the receive is done."""
    gb = 0.25 * GB
    middle = program(("batch", {"ops": [{"op": "send", "peer": 1, "bytes": gb}, {"op": "recv", "peer": 2, "bytes": gb}],
                                "async": True}, 0.0), ("wait", {"of": 0}, 0.0), ("host_read", {}, 0.0))
    taker = program(("recv", {"peer": 0, "bytes": gb, "async": True}, 0.0), ("wait", {"of": 0}, 0.0), ("host_read", {}, 0.0))
    late = program(("send", {"peer": 0, "bytes": gb, "async": True}, 1.0), ("wait", {"of": 0}, 0.0), ("host_read", {}, 0.0))
    run = replayed([{"rank": 0, "comm": middle}, {"rank": 1, "comm": taker}, {"rank": 2, "comm": late}])
    assert run.ranks[0].step_ends[1] == pytest.approx(1.25)
    assert run.ranks[1].step_ends[1] == pytest.approx(0.25)


def test_a_receive_no_rank_sends_is_named():
    receiver = program(("recv", {"peer": 0, "bytes": GB, "async": True}, 0.0), ("wait", {"of": 0}, 0.0))
    lone_sender = program(("host_read", {}, 0.0))
    with pytest.raises(RuntimeError, match=r"ranks \[1\] wait"):
        replayed([{"rank": 0, "comm": lone_sender}, {"rank": 1, "comm": receiver}])


def test_ranks_that_share_the_cores_compute_faster_while_the_others_wait():
    """Processor sharing: 4 ranks on 2 cores, each at a quarter of the peak while all compute (the
    rates' own share), at half of it while only two do. Ranks 0 and 1 compute 1 s of work and
    ranks 2 and 3 wait for them on a collective first: alone on the cores, 0 and 1 finish in 0.5 s."""
    share = replay.core_sharing(SimpleNamespace(device="cpu", perfmodel=SimpleNamespace(cores=2)), 4)
    assert (share(4), share(2), share(1)) == (1.0, 2.0, 2.0)     # one thread a rank: a core at most
    gb = 0.0  # a collective that costs nothing: only its order matters
    first = lambda r: program(("all_reduce", {"group": "x", "comm": "c", "ranks": [0, 1, 2, 3], "bytes": gb, "async": False}, 1.0),
                              ("wait", {"of": 0}, 0.0), ("host_read", {}, 0.0))
    then = lambda r: program(("all_reduce", {"group": "x", "comm": "c", "ranks": [0, 1, 2, 3], "bytes": gb, "async": False}, 0.0),
                             ("wait", {"of": 0}, 0.0), ("host_read", {}, 1.0))
    records = [{"rank": r, "comm": first(r) if r < 2 else then(r)} for r in range(4)]
    run = replay.Replay(records, RATES, WireOfOneGBps(), 0.0, speed=share)
    run.run()
    assert run.ranks[0].step_ends[1] == pytest.approx(0.5)
    assert run.step(1) == pytest.approx({"step_s": 1.0, "comm_s": 0.5, "bubble_s": 0.0, "compute_s": 0.5})
    # without sharing (a GPU: a device a rank), everyone takes 1 s of compute
    run = replay.Replay(records, RATES, WireOfOneGBps(), 0.0)
    run.run()
    assert run.ranks[0].step_ends[1] == pytest.approx(1.0) and run.ranks[2].step_ends[1] == pytest.approx(2.0)


def test_each_collective_pays_the_host_cost_on_its_stream():
    """Two collectives on one group, each 0.25 s on the wire and 0.1 s of host cost: in turn, so the
    wait on the second ends at 0.7 s; a send pays it too."""
    events = program(("all_reduce", all_reduce(0.25, True), 0.0), ("all_reduce", all_reduce(0.25, True), 0.0),
                     ("send", {"peer": 5, "bytes": 0.25 * GB, "async": True}, 0.0),
                     ("wait", {"of": 1}, 0.0), ("wait", {"of": 2}, 0.0), ("host_read", {}, 0.0))
    run = replay.Replay([{"rank": 0, "comm": events}], RATES, WireOfOneGBps(), 0.0, host_s=0.1)
    run.run()
    assert run.ranks[0].ends == pytest.approx({0: 0.35, 1: 0.7, 2: 0.35})
    assert run.step(1)["step_s"] == pytest.approx(0.7)


def test_the_host_cost_is_this_cpus_median_at_the_ranks_it_was_measured_with(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGAREPRO_CACHE", str(tmp_path))
    cpu = machine.cpu_model()
    runs = [{"2": 0.001, "4": 0.004}, {"2": 0.005, "4": 0.003}, {"2": 0.002, "4": 0.005}]
    lines = [{"sharing": {"collective_beside_gemms_s": r}, "cpu": cpu} for r in runs]
    lines += [{"sharing": {"collective_beside_gemms_s": {"2": 9.0}}, "cpu": "another CPU"}, {"rate_GBps": 0.03, "cpu": cpu}]
    (tmp_path / "comm_calibration.jsonl").write_text("".join(json.dumps(l) + "\n" for l in lines))
    assert machine.collective_host_s(1) is None
    assert machine.collective_host_s(2) == machine.collective_host_s(3) == pytest.approx(0.002)
    assert machine.collective_host_s(8) == pytest.approx(0.004)
    def hw(device, collective_host_us=None):
        return SimpleNamespace(device=device, perfmodel=SimpleNamespace(collective_host_us=collective_host_us))
    assert replay.host_cost(hw("cpu"), 8) == pytest.approx(0.004) and replay.host_cost(hw("cpu"), 1) == 0.0
    assert replay.host_cost(hw("cuda"), 8) == 0.0
    assert replay.host_cost(hw("cpu", 250.0), 8) == pytest.approx(0.00025)


# --- The real code's rehearsals, priced on a fixed machine (no measurement of this one) ---

TINY = ["model=tiny", "train.seq_len=128", "train.batch_size=8", "precision=fp32", "logging.wandb.mode=disabled"]
LAYOUTS = {
    "one": [],
    "tp_off": ["parallel.tp=2"],
    "pp_off": ["parallel.pp=2", "parallel.microbatches=4"],
    "dp_off": ["parallel.dp=2", "parallel.zero_stage=2"],
    "dp_on": ["parallel.dp=2", "parallel.zero_stage=2", "parallel.overlap.dp=true"],
    "unfused": ["parallel.tp=2", "kernels.attention=unfused"],
}


@functools.lru_cache(maxsize=None)
def emulated_cluster_hardware():
    """conf/hardware/emulated_2x2_250mbit, composed once (half a second a compose); callers copy it."""
    return config.compose(["hardware=emulated_2x2_250mbit"]).hardware


def two_hosts_of_one_rank():
    """The emulated cluster's shape (bench_overlap.py's: 2 hosts of 1 rank, 1 gbit), with fixed
    numbers in place of this machine's measurements and calibration."""
    hw = copy.deepcopy(emulated_cluster_hardware())
    fixed = dict(peak_tflops=0.2, peak_tflops_fp32=0.2, memory_GBps=10.0, memory_efficiency=1.0, memory_gib=24.0, intra_host_GBps=1.0,
                 op_overhead_us=10.0, gemm_half_dim=32.0, gemm_efficiency=0.8, flash_efficiency=0.3,
                 gemm_half_dim_fp32=32.0, gemm_efficiency_fp32=0.8, flash_efficiency_fp32=0.3,
                 inter_host_latency_us=200.0, inter_host_efficiency=0.95, p2p_efficiency=1.0, overlap_slowdown=0.2,
                 devices_per_host=1, inter_host_Gbps=1.0, cores=2, collective_host_us=0.0)
    for key, value in fixed.items():
        setattr(pm.owner(hw, key), key, value)
    return pm.resolve_hardware(hw)


@pytest.fixture(scope="module")
def rehearsed(tmp_path_factory):
    """{layout: (cfg, world, records of one rank per pipeline stage)}, rehearsed in this process."""
    out = {}
    for name, overrides in LAYOUTS.items():
        cfg = config.compose(TINY + overrides + ["rehearse.ranks=[0]"])
        world = 2 if overrides else 1
        ranks = replay.stage_ranks(cfg, world)
        folder = tmp_path_factory.mktemp(name)
        out[name] = (cfg, world, [rehearsal.rehearse_rank(cfg, r, world, folder) for r in ranks])
    return out


def priced(rehearsed, name):
    cfg, world, records = rehearsed[name]
    hw = two_hosts_of_one_rank()
    return replay.predict(records, cfg, hw, world), pm.predict(cfg, world, hw), records, cfg, hw, world


def step_events(record):
    return [ev for ev in record["comm"] if ev["step"] == record["steps"]]


@pytest.mark.parametrize("name", ["one", "tp_off", "dp_off"])
def test_the_replayed_gemms_and_attention_are_the_analytical_ones(rehearsed, name):
    """The work stamped on the events is the ledger's (GEMM FLOPs to the FLOP), and priced on one
    machine its GEMMs and attention take what the analytical model gives them (shape for shape)."""
    _, analytical, records, cfg, hw, world = priced(rehearsed, name)
    record = records[0]
    work = [ev["work"] for ev in step_events(record)]
    assert sum(2 * M * N * K * n for w in work for M, N, K, _, n in w["gemm"]) == record["flops"]["per_step"]["gemm"]
    assert sum(w["attention"] for w in work) == record["flops"]["per_step"]["attention"]
    r = pm.Rates.of(hw, "fp32", world)
    gemm = sum(replay.compute_time({"gemm": w["gemm"]}, r) for w in work)
    attention = sum(replay.compute_time({"attention": w["attention"], "attention_ops": w["attention_ops"]}, r) for w in work)
    assert gemm == pytest.approx(analytical.breakdown["gemm"], rel=0.01)
    assert attention == pytest.approx(analytical.breakdown["attention"], rel=0.01)


def test_the_materialized_core_attention_is_priced_as_the_batched_gemms_it_runs(rehearsed):
    """kernels.attention=unfused (the ablation's baseline): its batched products are recorded with
    their shapes, not as fused-attention FLOPs, and the replay prices them as the analytical model
    does, per layer and microbatch QK^T and PV forward and their four gradients: two [T,T,d] and
    four [T,d,T] GEMMs over the rank's heads. (Priced at the fused kernel's efficiency instead, the
    baseline's attention cost ~2x what it measured beside SDPA's on the CPU, at Table 3's +SWA step.)"""
    _, _, records, cfg, hw, world = priced(rehearsed, "unfused")
    record = records[0]
    work = [ev["work"] for ev in step_events(record)]
    bmm_flops = sum(2 * B * M * N * K * n for w in work for B, M, N, K, _, n in w["bmm"])
    assert sum(w["attention"] for w in work) == 0  # no fused attention kernel ran
    # the ledger's attention FLOPs: the products, and the softmax's pointwise ops at one an element
    assert 0.99 * record["flops"]["per_step"]["attention"] < bmm_flops <= record["flops"]["per_step"]["attention"]
    lay, r = pm.layout_of(cfg, world), pm.Rates.of(hw, "fp32", world)
    T, d = lay.seq, cfg.model.d_model // cfg.model.n_heads
    heads = lay.micro_batch * cfg.model.n_heads // lay.tp
    per_layer = 2 * pm.gemm_time(r, T, T, d, heads, 4) + 4 * pm.gemm_time(r, T, d, T, heads, 4)
    microbatches = cfg.train.batch_size // (lay.dp * lay.micro_batch)
    replayed = sum(replay.compute_time({"bmm": w["bmm"]}, r) for w in work)
    assert replayed == pytest.approx(per_layer * (cfg.model.n_layers // lay.pp) * microbatches, rel=0.01)


def test_a_measured_gemm_shape_runs_at_its_measured_speed_in_both_models(rehearsed):
    """hardware.perfmodel.gemm_shapes (machine.gemm_shape_efficiency, measured for a rehearsal's shapes) prices
    a listed shape at its own fraction of peak, an unlisted one by the half-dim model; and the
    analytical model asks for the shapes the rehearsal recorded, so one table serves both."""
    r = dataclasses.replace(RATES, mem=1e18, gemm_shapes={"64x32x16": 0.25})  # compute-bound
    assert pm.gemm_time(r, 64, 32, 16, 1, 4) == pytest.approx(2 * 64 * 32 * 16 / 0.25e12)
    assert pm.gemm_time(r, 64, 32, 8, 1, 4) == pytest.approx(2 * 64 * 32 * 8 / 1e12)
    assert replay.compute_time({"gemm": [[64, 32, 16, 4, 3]]}, r) == pytest.approx(3 * 2 * 64 * 32 * 16 / 0.25e12)
    cfg, world, records = rehearsed["tp_off"]
    hw = two_hosts_of_one_rank()
    shapes = {pm.gemm_key(M, N, K) for ev in step_events(records[0]) for M, N, K, _, _ in ev["work"]["gemm"]}
    hw.perfmodel.gemm_shapes = {key: 0.1 + 0.05 * (i % 7) for i, key in enumerate(sorted(shapes))}  # uneven on purpose
    r = pm.Rates.of(hw, "fp32", world)
    gemm = sum(replay.compute_time({"gemm": ev["work"]["gemm"]}, r) for ev in step_events(records[0]))
    assert gemm == pytest.approx(pm.predict(cfg, world, hw).breakdown["gemm"], rel=0.01)
    assert gemm > 1.5 * sum(replay.compute_time({"gemm": ev["work"]["gemm"]}, pm.Rates.of(two_hosts_of_one_rank(), "fp32", world))
                            for ev in step_events(records[0]))  # the table, not the model, priced them


def test_gemm_shapes_are_measured_once_per_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGAREPRO_CACHE", str(tmp_path))
    threads = torch.get_num_threads()
    table = machine.gemm_shape_efficiency([(256, 64, 64), (64, 256, 64)], torch.float32, 1)
    assert set(table) == {"256x64x64", "64x256x64"} and all(0 < v < 2 for v in table.values())
    monkeypatch.setattr(machine, "_shape_vs_peak", lambda *a: pytest.fail("measured a cached shape again"))
    assert machine.gemm_shape_efficiency([(256, 64, 64)], torch.float32, 1) == {"256x64x64": table["256x64x64"]}
    assert torch.get_num_threads() == threads  # measured at 1 thread, and the process's own count put back


def test_dp_without_overlap_shows_the_analytical_gradient_traffic_and_with_it_hides_most(rehearsed):
    off, analytical_off, *_ = priced(rehearsed, "dp_off")
    on, _, *_ = priced(rehearsed, "dp_on")
    assert off["comm_s"] == pytest.approx(analytical_off.breakdown["dp_comm"], rel=0.05)
    assert on["comm_s"] < 0.5 * off["comm_s"]
    assert on["step_s"] < off["step_s"]


def test_the_pipeline_step_agrees_with_1f1b_and_its_waits_are_the_bubble(rehearsed):
    replayed_step, analytical, records, *_ = priced(rehearsed, "pp_off")
    assert len(records) == 2  # both stages: the first's receives wait on the last's sends
    assert replayed_step["step_s"] == pytest.approx(analytical.step_s, rel=0.05)
    assert replayed_step["bubble_s"] > 0.1 * replayed_step["step_s"]


def test_tp_without_overlap_shows_the_analytical_tp_traffic(rehearsed):
    """overlap.tp=off is Megatron-LM's baseline: blocking forward collectives, and a backward that
    hides the re-gather behind the input gradient's GEMM and that gradient's reduce-scatter
    behind the weight gradient's (overlap.GatheredLinears), as the analytical model prices it.
    (No overlap slowdown here: the replay lengthens the compute under a collective, hiding more
    of it, where the analytical model charges the slowdown as a term of its own.)"""
    cfg, world, records = rehearsed["tp_off"]
    hw = two_hosts_of_one_rank()
    hw.perfmodel.overlap_slowdown = 0.0
    replayed_step, analytical = replay.predict(records, cfg, hw, world), pm.predict(cfg, world, hw)
    assert replayed_step["comm_s"] == pytest.approx(analytical.breakdown["tp_comm"], rel=0.05)
    exposed_if_blocking = sum(replay.comm_time(ev, pm.Network(hw, pm.layout_of(cfg, world)))
                              for ev in step_events(records[0]) if ev["op"] not in ("wait", "host_read", "batch"))
    assert replayed_step["comm_s"] < 0.8 * exposed_if_blocking  # the backward's hidden third


def test_a_kept_rehearsal_from_before_batched_gemms_were_recorded_is_refused(tmp_path):
    """validate keeps each run's rehearsal; one whose segments lack "bmm" priced the materialized
    attention's products as fused-kernel FLOPs, so it is refused with the fix, not replayed."""
    cfg = config.compose(TINY)
    stale = {"rank": 0, "comm": [{"op": "all_reduce", "step": 1, "work": {"gemm": [], "attention": 0, "attention_ops": 0,
                                                                           "bytes": 0, "ops": 0}}]}
    (tmp_path / "rank0.json").write_text(json.dumps(stale))
    with pytest.raises(RuntimeError, match="delete it"):
        replay.rehearse(cfg, two_hosts_of_one_rank(), 1, tmp_path)
