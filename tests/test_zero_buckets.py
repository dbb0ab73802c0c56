"""ZeRO's buckets alone (parallelisms/zero.py), on 2 gloo ranks against one unsharded copy of the same model:
each rank's shards receive the average of both ranks' gradients (reduce-scatter, or all-reduce at
ZeRO-0), and the all-gather rebuilds every parameter from the updated shards, with and without DP
overlap, ZeRO stages 0, 1 and 2. Buckets are small enough that shards cut parameters in two and
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


def _buckets_against_reference(rank, world, port, out):
    import parallel
    from parallelisms.zero import ZeroDataParallel, plan_buckets
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    layout = parallel.build_layout(parallel.ParallelConfig(), rank, world, torch.device("cpu"))
    errors = {}
    for stage in (0, 1, 2):
        for overlap in (False, True):
            torch.manual_seed(0)
            model = TwoLinears()
            reference = copy.deepcopy(model)
            params = list(model.parameters())
            modules = [([0, 1], model.a.register_forward_pre_hook), ([2, 3], model.b.register_forward_pre_hook)]
            buckets = plan_buckets([m for m, _ in modules], params, bucket_size=40, per_module=overlap)
            zero = ZeroDataParallel(params, layout, stage, torch.float32, buckets, MICROBATCHES, overlap=overlap)
            zero.attach(modules)
            fused, take = [], zero.fused_view
            zero.fused_view = lambda i: fused.append(i) or take(i)
            worst_grad = worst_param = 0.0
            launched = []  # buckets whose reduction backward launched (DP overlap: all, fused arrivals counted)
            for step in range(STEPS):
                for k in range(MICROBATCHES):
                    x, y = batch(rank, step, k)
                    (torch.nn.functional.mse_loss(model(x), y) / MICROBATCHES).backward()
                    zero.backward_done()
                launched.append(len(zero.reducing))
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
                worst_param = max(worst_param, max((p - q).abs().max().item()
                                                   for p, q in zip(params, reference.parameters())))
            errors[f"zero{stage}{'_overlap' if overlap else ''}"] = {
                "grad": worst_grad, "param": worst_param, "buckets": len(zero.buckets),
                "split": sum(0 < hi - lo < p.numel() for p, (lo, hi) in zip(params, zero.shard_ranges)) if stage else 0,
                "fused": fused, "launched": launched}
    Path(out, f"rank{rank}.json").write_text(json.dumps(errors))
    dist.destroy_process_group()


def test_buckets_average_gradients_and_rebuild_parameters_like_one_process(tmp_path):
    spawn(_buckets_against_reference, 2, str(tmp_path))
    for rank in range(2):
        errors = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(errors) == 6
        for name, e in errors.items():
            assert e["grad"] < 1e-6 and e["param"] < 1e-6, (rank, name, e)
            assert e["buckets"] >= 2
            assert e["fused"] == [2] * (STEPS * MICROBATCHES), (name, e)  # b.weight, into the buffer each microbatch
            assert e["launched"] == [e["buckets"] if name.endswith("overlap") else 0] * STEPS, (name, e)
            if name.startswith(("zero1", "zero2")):
                assert e["split"] > 0, (name, e)  # some parameter straddles the ranks' shards
