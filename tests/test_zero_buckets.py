"""ZeRO's buckets alone (parallelisms/zero.py), on 2 gloo ranks against one unsharded copy of the same model:
each rank's shards receive the average of both ranks' gradients (reduce-scatter, or all-reduce at
ZeRO-0), and the all-gather rebuilds every parameter from the updated shards, with and without DP
overlap, ZeRO stages 0 to 3 (at 3 each module gathers its parameters for its forward and its
backward and frees them after each). Buckets are small enough that shards cut parameters in two and
the last is padded. The second layer's GEMM is a TP layer's (tensor_parallel.Linear), whose
backward accumulates the weight gradient straight into its bucket: DP overlap launches a bucket
only once those arrivals are in too."""
import copy
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from conftest import spawn

MICROBATCHES, LR, STEPS = 2, 0.5, 2


class AccumulatingLinear(torch.nn.Linear):
    """nn.Linear through tensor_parallel's Linear, as the TP layers run their GEMMs."""

    def forward(self, x):
        from parallelisms.tensor_parallel import linear
        return linear(x, self.weight, self.bias)


class TwoLinears(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(5, 7), AccumulatingLinear(7, 3)  # 42 and 24 parameters

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def batch(rank: int, step: int, microbatch: int) -> tuple:
    g = torch.Generator().manual_seed(100 * step + 10 * rank + microbatch)
    return torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)


def reference_step(model: TwoLinears, step: int, world: int) -> list:
    """One unsharded step over every rank's microbatches: the averaged gradients, then the update."""
    model.zero_grad()
    for rank in range(world):
        for k in range(MICROBATCHES):
            x, y = batch(rank, step, k)
            (torch.nn.functional.mse_loss(model(x), y) / (MICROBATCHES * world)).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    return grads


def _logged_collectives(log: list) -> None:
    """Every DP collective ZeRO launches, appended to `log` as (name, ranks of its group)."""
    for name in ("all_reduce", "reduce_scatter_single", "all_gather_single"):
        original = getattr(dist, name)

        def logged(*args, _f=original, _name=name, group=None, **kwargs):
            log.append((_name, dist.get_process_group_ranks(group or dist.group.WORLD)))
            return _f(*args, group=group, **kwargs)
        setattr(dist, name, logged)


def _buckets_against_reference(rank, world, port, out, dp_shard=-1):
    import parallel
    from parallelisms.zero import ZeroDataParallel, plan_buckets
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    layout = parallel.build_layout(parallel.ParallelConfig(dp_shard=dp_shard), rank, world, torch.device("cpu"))
    collectives = []
    _logged_collectives(collectives)
    errors = {}
    variants = [(stage, overlap, each) for stage in ((0, 1, 2, 3) if dp_shard == -1 else (1, 2, 3))
                for overlap in (False, True) for each in ((False, True) if stage >= 2 else (False,))]
    for stage, overlap, each in variants:
        torch.manual_seed(0)
        model = TwoLinears()
        reference = copy.deepcopy(model)
        params = list(model.parameters())
        modules = [([0, 1], model.a.register_forward_pre_hook, model.a.register_forward_hook),
                   ([2, 3], model.b.register_forward_pre_hook, model.b.register_forward_hook)]
        buckets = plan_buckets([m[0] for m in modules], params, bucket_size=40, per_module=overlap or stage == 3)
        zero = ZeroDataParallel(params, layout, stage, torch.float32, buckets, MICROBATCHES, overlap=overlap,
                                each_microbatch=each)
        zero.attach(modules)
        fused, take = [], zero.fused_view
        zero.fused_view = lambda i: fused.append(i) or take(i)
        worst_grad = worst_param = 0.0
        launched = []  # buckets whose reduction backward launched (DP overlap: all, fused arrivals counted)
        full = []  # buckets whose full gradient buffer is still there after backward
        for step in range(STEPS):
            for k in range(MICROBATCHES):
                x, y = batch(rank, step, k)
                (torch.nn.functional.mse_loss(model(x), y) / MICROBATCHES).backward()
                zero.backward_done()
                zero.microbatch_done(True, last=k == MICROBATCHES - 1)
            launched.append(len(zero.reducing))
            full.append(sum(b.grads is not None for b in zero.buckets))
            zero.reduce_gradients()
            want = reference_step(reference, step, world)
            for i, shard in enumerate(zero.shards):
                lo, hi = zero.shard_ranges[i] or (0, params[i].numel())
                expected = want[i].flatten()[lo:hi]
                worst_grad = max(worst_grad, (shard.grad.flatten() - expected).abs().max().item() if hi > lo else 0.0)
            with torch.no_grad():  # the optimizer: each rank updates its shards only
                for shard in zero.shards:
                    shard -= LR * shard.grad
            for p in params:
                p.grad = None
            zero.after_step()
            with torch.no_grad():
                model(torch.zeros(1, 5))  # the forward whose hooks wait for (and, overlapping, chain) the gathers
            held = sum(b.params.untyped_storage().nbytes() for b in zero.buckets)
            if stage == 3:  # each module freed its parameters after its forward: gather them to compare
                assert held == 0, held
                zero.gather_all()
            worst_param = max(worst_param, max((p - q).abs().max().item()
                                               for p, q in zip(params, reference.parameters())))
            if stage == 3:
                zero.release()
        errors[f"zero{stage}{'_overlap' if overlap else ''}{'_each' if each else ''}"] = {
            "grad": worst_grad, "param": worst_param, "buckets": len(zero.buckets),
            "split": sum(0 < hi - lo < p.numel() for p, (lo, hi) in zip(params, zero.shard_ranges)) if stage else 0,
            "fused": fused, "launched": launched, "full": full, "shard_numel": [b.shard_numel for b in zero.buckets],
            "numel": [b.numel for b in zero.buckets], "collectives": sorted({(n, tuple(g)) for n, g in collectives}),
            "reduce_scatters": sum(n == "reduce_scatter_single" for n, _ in collectives)}
        collectives.clear()
    Path(out, f"rank{rank}.json").write_text(json.dumps(errors))
    dist.destroy_process_group()


def full_buffers_after_backward(name: str, buckets: int) -> int:
    """ZeRO 2/3 with DP overlap frees a bucket's full gradient buffer once its reduce-scatter is in,
    keeping REDUCTIONS_IN_FLIGHT; otherwise every bucket's is there until the reductions after backward."""
    from parallelisms.zero import REDUCTIONS_IN_FLIGHT
    return min(buckets, REDUCTIONS_IN_FLIGHT) if name.startswith(("zero2", "zero3")) and "_overlap" in name else buckets


def expected_reduce_scatters(name: str, buckets: int) -> int:
    """A bucket's reduce-scatters a step: one, or with parallel.reduce_each_microbatch one a microbatch."""
    return 0 if name.startswith("zero0") else buckets * STEPS * (MICROBATCHES if name.endswith("_each") else 1)


def test_buckets_average_gradients_and_rebuild_parameters_like_one_process(tmp_path):
    spawn(_buckets_against_reference, 2, str(tmp_path))
    for rank in range(2):
        errors = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(errors) == 12
        for name, e in errors.items():
            assert e["grad"] < 1e-6 and e["param"] < 1e-6, (rank, name, e)
            assert e["buckets"] >= 2
            assert e["fused"] == [2] * (STEPS * MICROBATCHES), (name, e)  # b.weight, into the buffer each microbatch
            launched = "_overlap" in name or name.endswith("_each")  # (each: the earlier microbatches' too)
            assert e["launched"] == [e["buckets"] if launched else 0] * STEPS, (name, e)
            assert e["reduce_scatters"] == expected_reduce_scatters(name, e["buckets"]), (name, e)
            assert e["full"] == [full_buffers_after_backward(name, e["buckets"])] * STEPS, (name, e)
            if name.startswith(("zero1", "zero2", "zero3")):
                assert e["split"] > 0, (name, e)  # some parameter straddles the ranks' shards
            # over the dp group only (dp_shard=-1: no replicate step)
            ops = {"all_reduce"} if name.startswith("zero0") else {"reduce_scatter_single", "all_gather_single"}
            assert {(n, tuple(g)) for n, g in e["collectives"]} == {(op, (0, 1)) for op in ops}, (name, e)


def test_hybrid_sharding_shards_over_pairs_and_sums_over_replicas(tmp_path):
    """parallel.dp_shard=2 at dp=4 (FSDP2's HSDP), ZeRO 1 to 3 with and without DP overlap: each
    rank's shard is half a bucket; its gradient is the average over all four ranks (reduce-scatter
    in its pair of consecutive ranks, then all-reduce with the rank of the same shard rank in the
    other pair), and the all-gather within the pair rebuilds every parameter. No DP collective
    goes over all four ranks."""
    spawn(_buckets_against_reference, 4, str(tmp_path), 2)
    for rank in range(4):
        errors = json.loads((tmp_path / f"rank{rank}.json").read_text())
        pair, replicas = [rank - rank % 2, rank - rank % 2 + 1], [rank % 2, rank % 2 + 2]
        assert len(errors) == 10
        for name, e in errors.items():
            assert e["grad"] < 1e-6 and e["param"] < 1e-6, (rank, name, e)
            assert e["split"] > 0 and all(n % 2 == 0 and s == n // 2 for n, s in zip(e["numel"], e["shard_numel"]))
            launched = "_overlap" in name or name.endswith("_each")
            assert e["launched"] == [e["buckets"] if launched else 0] * STEPS, (name, e)
            assert e["reduce_scatters"] == expected_reduce_scatters(name, e["buckets"]), (name, e)
            assert e["full"] == [full_buffers_after_backward(name, e["buckets"])] * STEPS, (name, e)
            assert {(n, tuple(g)) for n, g in e["collectives"]} == {
                ("reduce_scatter_single", tuple(pair)), ("all_reduce", tuple(replicas)),
                ("all_gather_single", tuple(pair))}, (rank, name, e["collectives"])


def test_what_a_parameter_is_and_where_its_gradient_goes_stay_on_it_on_meta():
    """On the meta device, as a rehearsal builds a rank: a parameter's ShardInfo stays on it through
    ZeRO's flattening (its .data becomes a view of the bucket), each ZeRO-1 shard says it is a flat
    piece of a matrix, each parameter's gradient sink gives its view of the bucket's gradient
    buffer, and a copy of a parameter is a new, whole tensor with no sink."""
    import parallel
    from parallelisms import sharding
    from parallelisms.zero import ZeroDataParallel, gradient_sink, plan_buckets
    layout = parallel.build_layout(parallel.ParallelConfig(), 0, 1, torch.device("meta"))
    with torch.device("meta"):
        model = TwoLinears()
    params = list(model.parameters())
    tp_slice = sharding.ShardInfo(split_dim=0, offset=3)
    sharding.set_shard_info(params[2], tp_slice)
    modules = [([0, 1], model.a.register_forward_pre_hook), ([2, 3], model.b.register_forward_pre_hook)]
    zero = ZeroDataParallel(params, layout, 1, torch.float32, plan_buckets([m for m, _ in modules], params, 40, False))
    zero.attach(modules)
    assert sharding.shard_info(params[2]) == tp_slice and sharding.shard_info(params[3]) == sharding.WHOLE
    assert [sharding.shard_info(s).logical_ndim for s in zero.shards] == [2, 1, 2, 1]
    for i, p in enumerate(params):
        b, k = zero.where[i]
        view = gradient_sink(p).take()
        assert view.device.type == "meta" and view.shape == p.shape and view._base is zero.buckets[b].grads
    copied = copy.deepcopy(params[2])
    assert sharding.shard_info(copied) == sharding.WHOLE and gradient_sink(copied) is None


def _storage_between_steps(rank, world, port, out):
    """Per ZeRO stage: the parameter storage a rank holds before and after a step (every distinct
    storage under the model's parameters and the optimizer's shards, as allocated: nbytes), and
    the most buckets whose full buffer existed at once when a block's forward or backward ran."""
    import parallel
    from model import GPT, ModelConfig
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    tokens = torch.randint(0, 128, (4, 17), generator=torch.Generator().manual_seed(0))
    found = {}
    for stage in (1, 3):
        cfg = parallel.ParallelConfig(zero_stage=stage)
        layout = parallel.build_layout(cfg, rank, world, torch.device("cpu"))
        model = GPT(ModelConfig(n_layers=4, n_heads=4, d_model=64, vocab_size=128))
        model.init_weights(0)
        engine = parallel.build(model, layout, cfg)
        optimizer = torch.optim.AdamW(engine.zero.shards, lr=1e-3)

        def held() -> int:
            storages = {}
            for t in list(engine.zero.params) + list(engine.zero.shards):
                s = t.untyped_storage()
                storages[s.data_ptr() if s.nbytes() else id(s)] = s.nbytes()
            return sum(storages.values())

        resident = []
        count = lambda *_: resident.append(sum(b.params.untyped_storage().nbytes() > 0 for b in engine.zero.buckets))
        for block in engine.chunks[0].blocks.values():  # after the schedule's own hooks: its gather
            block.register_forward_pre_hook(count)
            block.register_full_backward_hook(count)
        before = held()
        engine.forward_backward(tokens[:, :-1], tokens[:, 1:], torch.float32)
        engine.finish_gradients(1.0)
        engine.optimizer_step(optimizer)
        found[stage] = {"before": before, "after": held(), "most_resident": max(resident),
                        "buckets": len(engine.zero.buckets),
                        "model": 4 * sum(p.numel() for p in engine.zero.params),
                        "padded_shards": 4 * sum(b.shard_numel for b in engine.zero.buckets)}
    Path(out, f"rank{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()


def test_zero3_holds_only_its_shards_between_steps(tmp_path):
    """ZeRO-3 at dp=2: between steps a rank's parameter storage is its shards (half the model plus
    each bucket's padding); ZeRO-1 holds every parameter whole. During a step a block computes with
    its own bucket gathered and the others freed (the tail's, head and norm, stays gathered from its
    forward to its backward, FSDP's root): at most two full buffers at once."""
    spawn(_storage_between_steps, 2, str(tmp_path))
    for rank in range(2):
        found = json.loads(Path(tmp_path, f"rank{rank}.json").read_text())
        one, three = found["1"], found["3"]
        print(f"rank {rank}: model {one['model']} B; between steps ZeRO-1 {one['after']} B, ZeRO-3 {three['after']} B "
              f"(shards {three['padded_shards']} B), most buckets gathered at once {three['most_resident']} of {three['buckets']}")
        assert one["before"] == one["after"] >= one["model"]
        assert three["before"] == three["after"] == three["padded_shards"]
        assert three["padded_shards"] <= one["model"] / 2 + 4 * three["buckets"]
        assert three["most_resident"] <= 2 < three["buckets"]
