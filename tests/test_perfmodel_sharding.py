"""The performance model on what shards the data-parallel state and the pipeline unevenly
(clustermodel/sharding_cost.py, memory.py, layout.py): ZeRO-3's gathers and memory, hybrid
sharding's two steps, uneven pipeline chunks, zones, and the plan's search over them. What the
rehearsal of the code says of the same settings: tests/test_rehearsal.py."""
import pytest

from clustermodel import cli
from clustermodel import memory
from clustermodel import perfmodel as pm
from clustermodel import sharding_cost


def _sharded(*overrides):
    """The tiny model on 32 A100s (tp 2, pp 2, dp 8), bf16, with `overrides`."""
    return cli.compose(["model=tiny", "hardware=a100_cluster", "train.seq_len=256", "train.batch_size=32",
                        "precision=bf16", "parallel.tp=2", "parallel.pp=2", "parallel.microbatches=4", *overrides])


def test_zero3_memory_is_zero2s_less_the_bf16_weights_plus_the_gathered_modules():
    """ZeRO-3 keeps ZeRO-2's gradients, optimizer and activations; of the bf16 weights only the modules
    gathered at the peak (with DP overlap the largest two in a row, and on the last pipeline rank
    the head besides, kept from its forward to its backward while the schedule runs others; without
    resharding all of them)."""
    GiB = 2.0 ** 30
    for last in (False, True):
        two = memory.memory_of_rank(_sharded("parallel.zero_stage=2"), pm.layout_of(_sharded("parallel.zero_stage=2"), 32), last)
        cfg = _sharded("parallel.zero_stage=3", "parallel.overlap.dp=true")
        lay = pm.layout_of(cfg, 32)
        three = memory.memory_of_rank(cfg, lay, last)
        modules = memory.rank_modules(cfg, lay, lay.pp - 1 if last else 0)
        head, modules = (modules[-1], modules[:-1]) if last else (0, modules)
        gathered = head + max(a + b for a, b in zip(modules, modules[1:]))
        assert (three.grads, three.optimizer, three.activations) == (two.grads, two.optimizer, two.activations)
        assert three.total == pytest.approx(two.total - two.weights + 2 * gathered / GiB)
        kept = _sharded("parallel.zero_stage=3", "parallel.reshard_after_forward=false")
        assert memory.memory_of_rank(kept, pm.layout_of(kept, 32), last).weights == pytest.approx(two.weights)


def test_zero3_gathers_twice_a_microbatch_with_resharding_and_overlap_hides_some():
    resharded, kept = (pm.predict(_sharded("parallel.zero_stage=3", "parallel.overlap.dp=true",
                                           f"parallel.reshard_after_forward={r}"), 32) for r in ("true", "false"))
    assert resharded.breakdown["param_gather"] > kept.breakdown["param_gather"] > 0
    exposed = pm.predict(_sharded("parallel.zero_stage=3", "parallel.overlap.dp=false"), 32).breakdown["param_gather"]
    assert exposed > resharded.breakdown["param_gather"]
    assert "param_gather" not in pm.predict(_sharded("parallel.zero_stage=2"), 32).breakdown


def test_zero3s_backward_gathers_and_reduce_scatters_share_one_link():
    """Without model parallelism a rank's only traffic is DP's, on one link: its resharding backward's
    gathers and its gradients' reduce-scatters hide behind the same backward, so a link-bound step
    (175B on 1,536 GPUs, a sequence each, as Narayanan et al. ran DeepSpeed's ZeRO-3) lasts at least
    the link's busy time, and reducing every microbatch leaves less of each backward to the gathers."""
    def zero3(*overrides):
        return cli.compose(["model=175B", "hardware=a100_selene", "precision=bf16", "train.seq_len=2048",
                            "train.recompute=full", "parallel.tp=1", "parallel.pp=1", "parallel.zero_stage=3",
                            "parallel.overlap.dp=true", "parallel.reduce_dtype=bf16", *overrides])
    bound = pm.predict(zero3("train.batch_size=1536", "parallel.microbatches=1"), 1536)
    assert bound.step_s >= bound.exposed_comm_s + bound.hidden_comm_s
    once, each = (pm.predict(zero3("train.batch_size=3072", "parallel.microbatches=2",
                                   f"parallel.reduce_each_microbatch={e}"), 1536) for e in ("false", "true"))
    assert each.breakdown["param_gather"] > once.breakdown["param_gather"]


def test_hybrid_sharding_divides_the_optimizer_by_the_shard_group_and_reduces_in_two_steps():
    full, hybrid = (_sharded("parallel.zero_stage=1", f"parallel.dp_shard={s}") for s in (-1, 2))
    mem = [memory.memory_of_rank(c, pm.layout_of(c, 32)) for c in (full, hybrid)]
    assert mem[1].optimizer == pytest.approx(4 * mem[0].optimizer)  # 1/2 of it, not 1/8
    lay = pm.layout_of(hybrid, 32)
    assert (lay.shard, lay.group("dp_shard"), lay.group("dp_replicate")) == (2, (2, 4), (4, 8))
    assert pm.predict(hybrid, 32).breakdown["dp_comm"] != pm.predict(full, 32).breakdown["dp_comm"]
    # with DP overlap the reduce-scatters hide bucket by bucket; the replicas' all-reduce, launched
    # after the backward (parallelisms/zero.py), shows whole
    overlapped = _sharded("parallel.zero_stage=1", "parallel.dp_shard=2", "parallel.overlap.dp=true")
    lay = pm.layout_of(overlapped, 32)
    replicas = sharding_cost.replica_sum(pm.Network(pm.resolve_hardware(overlapped.hardware), lay), lay,
                                         max(memory.rank_params(overlapped.model, lay)) * 4)
    assert 0 < replicas <= pm.predict(overlapped, 32).breakdown["dp_comm"]


def test_uneven_chunks_price_the_busiest_stage_and_each_end_ranks_own_layers():
    """10 blocks at pp=4: ends of 1 leave 4 to each middle rank, the busiest; ends of 2 leave 3 (the
    busiest then an end, 2 blocks and the tiny model's head, about 1.3 blocks' GEMMs)."""
    short_ends, long_ends = (_sharded("model.n_layers=10", "parallel.pp=4", "parallel.microbatches=4",
                                      f"parallel.pp_first_chunk_layers={k}", f"parallel.pp_last_chunk_layers={k}")
                             for k in (1, 2))
    lay = pm.layout_of(short_ends, 32 * 2)
    assert [lay.rank_layers(r, 10) for r in range(4)] == [1, 4, 4, 1]
    assert pm.predict(short_ends, 64).step_s > pm.predict(long_ends, 64).step_s  # the middle's 4 blocks set the pace
    first, last = memory.rank_params(short_ends.model, lay)
    split, replicated = memory.layer_params(short_ends.model, 2)
    assert first - short_ends.model.vocab_size * short_ends.model.d_model // 2 == split + replicated


def test_zones_slow_only_groups_with_few_members_in_a_zone():
    hw = pm.resolve_hardware(cli.compose(["hardware=h100_llama3"]).hardware)
    assert (hw.perfmodel.hosts_per_zone, hw.perfmodel.inter_zone_oversubscription) == (384, 7)
    cfg = cli.compose(["model=tiny", "model.n_heads=8", "model.n_layers=16", "hardware=h100_llama3", "parallel.tp=8",
                       "parallel.pp=16", "parallel.zero_stage=1",
                       "parallel.dp_shard=16", "train.batch_size=64", "train.seq_len=256"])
    net = pm.Network(hw, pm.layout_of(cfg, 8192))
    assert net.crosses_zones("dp") and net.network_hop("dp") == net.inter  # 24 DP ranks a zone: no slowdown
    assert net.network_hop("dp_replicate")[0] == pytest.approx(net.inter[0] / 7)  # replicas 2,048 ranks apart: one a zone
    assert not net.crosses_zones("dp_shard")


def test_plan_tries_llama3s_short_end_chunks_where_the_layers_do_not_divide():
    """126 layers in 16 chunks: 7 and 7 around fourteen of 8; in 128: embedding and head alone; 125
    in 16 has no such split; a 6-layer model on pp 4 is planned with ends of 1 around chunks of 2."""
    assert [cli.uneven_ends(n, c) for n, c in ((126, 16), (126, 128), (126, 14), (125, 16))] == [7, 0, -1, None]
    cfg = cli.compose(["model=llama_tiny", "model.n_layers=6", "hardware=a100_cluster", "train.seq_len=256"])
    plain = [p.layout for p in cli.plan(cfg, 8, 16, include_oom=True) if p.layout.pp == 4 and p.layout.vpp == 1]
    assert plain and all(lay.chunks == (1, 2, 2, 1) for lay in plain)


def test_plan_tries_zero3_and_hybrid_shard_groups():
    assert {(3, -1, False, False), (3, 2, True, False), (1, 4, True, False), (2, -1, True, False)} <= set(cli.sharding_choices(8))
    each = {c for c in cli.sharding_choices(8, reduce_each=True) if c[3]}
    assert each and {c[0] for c in each} == {2, 3} and not any(c[3] for c in cli.sharding_choices(8))
    ranked = cli.plan(_sharded(), 32, 32, include_oom=True)
    assert any(p.layout.zero == 3 for p in ranked) and any(p.layout.shard < p.layout.dp for p in ranked)
