"""Memory that holds at the paper's scale, counted in bytes on CPU: bf16 weights with fp32 masters
(no weight is cast again per microbatch), pipeline messages in the compute dtype and released
as they complete, ZeRO's flat buckets with no full-size copies, each rank hashing its own
checkpoint files, and the bytes one step puts on the data-parallel link for ZeRO 0, 1 and 2."""
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import config
import parallel
from clustermodel import rehearsal
from conftest import spawn
from model import GPT, ModelConfig

TINY = ModelConfig(n_layers=2, n_heads=4, d_model=64, vocab_size=128)


def build(layout, dtype=torch.float32, **kw) -> parallel.ParallelModel:
    with torch.device("meta"):
        model = GPT(TINY)
    return parallel.build(model, layout, parallel.ParallelConfig(**kw), dtype=dtype, device=torch.device("cpu"), seed=0)


def test_bf16_weights_are_never_cast_again_and_the_masters_are_fp32():
    """Megatron's mixed precision: the module holds bf16 weights, the optimizer fp32 masters; a
    forward under autocast keeps no bf16 copy of any weight for its backward (fp32 weights did:
    one copy per microbatch in flight, ~50 GB at pp8 vpp6 for 175B)."""
    engine = build(parallel.Layout(), dtype=torch.bfloat16)
    params = [p for _, p in engine.named_model_parameters()]
    assert all(p.dtype == torch.bfloat16 for p in params)
    assert all(s.dtype == torch.float32 for s in engine.zero.shards)
    assert sum(b.params.numel() * 2 for b in engine.zero.buckets) == sum(p.numel() * 2 for p in params)
    weights = {id(p.untyped_storage()) for p in params}
    shapes = {tuple(p.shape) for p in params if p.dim() == 2} | {tuple(p.t().shape) for p in params if p.dim() == 2}
    copies = []

    def pack(t):
        if tuple(t.shape) in shapes and id(t.untyped_storage()) not in weights:
            copies.append(tuple(t.shape))
        return t
    tokens = torch.randint(0, 128, (2, 17))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        engine.forward_backward(tokens[:, :-1], tokens[:, 1:], torch.bfloat16)
    assert copies == []


@pytest.mark.parametrize("dp_shard", [4, 2])
def test_zero_buckets_are_flat_and_hold_no_full_size_copies(dp_shard):
    """dp=4, ZeRO-1, fixed-size buckets: every parameter is a view of its bucket's buffer, padded
    at the bucket's end only; each rank's optimizer pieces are views of one fp32 master range
    per bucket (in fp32, of the parameters themselves), a quarter of the parameters; with hybrid
    sharding over pairs (parallel.dp_shard=2) half of them, the optimizer's state with them."""
    layout = parallel.Layout(world=4, dp=4, dp_rank=1, dp_shard=dp_shard)
    for dtype in (torch.float32, torch.bfloat16):
        engine = build(layout, dtype=dtype, zero_stage=1, bucket_size=20_000)
        zero, params = engine.zero, engine.zero.params
        total = sum(p.numel() for p in params)
        assert len(zero.buckets) > 1
        for b in zero.buckets:
            largest = max(params[i].numel() for i in b.indices)
            assert b.numel % dp_shard == 0 and b.numel - sum(params[i].numel() for i in b.indices) < dp_shard
            assert b.numel - largest <= 20_000 + 3 or len(b.indices) == 1             # closed at bucket_size
            for i in b.indices:
                assert params[i].untyped_storage().data_ptr() == b.params.untyped_storage().data_ptr()
        masters = sum(b.master.numel() for b in zero.buckets)
        assert masters == sum(b.shard_numel for b in zero.buckets)
        assert total / dp_shard <= masters < total / dp_shard + dp_shard * len(zero.buckets)
        optimizer = torch.optim.AdamW(zero.shards)
        for shard in zero.shards:
            shard.grad = torch.zeros_like(shard)
        optimizer.step()
        moments = sum(v.numel() for state in optimizer.state.values() for k, v in state.items() if k != "step")
        assert moments == 2 * masters
        for i, piece in enumerate(zero.shards):
            b = zero.buckets[zero.where[i][0]]
            assert piece.untyped_storage().data_ptr() == b.master.untyped_storage().data_ptr()
        if dtype == torch.float32:  # the masters are the parameters' own range
            assert all(b.master.untyped_storage().data_ptr() == b.params.untyped_storage().data_ptr() for b in zero.buckets)
        held = sum(b.params.numel() * b.params.element_size() for b in zero.buckets)
        held += sum(b.master.numel() * 4 for b in zero.buckets if b.master.untyped_storage().data_ptr() !=
                    b.params.untyped_storage().data_ptr())
        assert held == pytest.approx(total * (dtype.itemsize + (4 / dp_shard if dtype != torch.float32 else 0)), rel=0.01)


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_one_step_on_the_dp_link_costs_what_the_formula_says(zero, tmp_path):
    """Bytes rank 0 puts on the wire over DP in one step at dp2 (ring: all-reduce 2(n-1)/n of the
    tensor, reduce-scatter and all-gather (n-1)/n), bf16 weights: ZeRO-0 all-reduces fp32
    gradients (4 B a parameter); ZeRO-1 and 2 reduce-scatter them (2 B) and all-gather the bf16
    parameters (1 B): 3 B, where an earlier ZeRO-1 (fp32 all-reduce, fp32 all-gather) moved 6."""
    cfg = config.compose(["model=tiny", "model.vocab_size=512", "train.seq_len=64", "train.batch_size=8",
                          "precision=bf16", "parallel.dp=2", f"parallel.zero_stage={zero}", "rehearse.ranks=[0]"])
    record = rehearsal.rehearse_rank(cfg, 0, 2, tmp_path)
    buckets = sum(-(-n // 2) * 2 for n in _bucket_sizes(cfg))
    per_param = {0: 4, 1: 3, 2: 3}[zero]
    # (+12 B: the loss and grad-norm all-reduces share the group here, dp being the whole world)
    assert rehearsal.comm_per_step(record)["dp"] == pytest.approx(per_param * buckets, abs=16)


def _bucket_sizes(cfg) -> list:
    layout = parallel.Layout(world=2, dp=2)
    with torch.device("meta"):
        model = GPT(cfg.model)
    engine = parallel.build(model, layout, cfg.parallel, dtype=torch.bfloat16, device=torch.device("meta"))
    return [sum(engine.zero.params[i].numel() for i in b.indices) for b in engine.zero.buckets]


def _pipeline_sends(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = parallel.ParallelConfig(pp=2, microbatches=8)
    layout = parallel.build_layout(cfg, rank, world, torch.device("cpu"))
    engine = build(layout, dtype=torch.bfloat16, pp=2, microbatches=8)
    sent = []
    isend = dist.isend
    dist.isend = lambda t, *a, **k: (sent.append((str(t.dtype), t.numel() * t.element_size())), isend(t, *a, **k))[1]
    tokens = torch.randint(0, 128, (8, 33), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        engine.forward_backward(tokens[:, :-1], tokens[:, 1:], torch.bfloat16)
    Path(out, f"sends{rank}.json").write_text(json.dumps({"sent": sent, "most_held": engine.pipeline.most_held,
                                                         "left": len(engine.pipeline.sends)}))
    dist.destroy_process_group()


def test_pipeline_messages_travel_in_bf16(tmp_path):
    spawn(_pipeline_sends, 2, str(tmp_path))
    for rank in range(2):
        got = json.loads((tmp_path / f"sends{rank}.json").read_text())
        assert len(got["sent"]) == 2 * 8 and {d for d, _ in got["sent"]} == {"torch.bfloat16"}
        assert {b for _, b in got["sent"]} == {32 * 64 * 2}  # one microbatch: [1 row, 32 tokens, 64] in bf16
        assert got["left"] == 0  # all waited for by the step's end


class _Work:
    def __init__(self, done):
        self.done = done

    def is_completed(self):
        return self.done


def test_completed_sends_are_released_at_once():
    """NCCL's works report completion (an event query): a send is dropped, with its tensor, after
    the first compute that finds it complete. (gloo's send works report it only once waited for,
    so on CPU the sends go at the step's end.)"""
    from parallelisms.pipeline import Pipeline
    pipe = Pipeline.__new__(Pipeline)
    pipe.most_held = 0
    pipe.sends = [(_Work(True), torch.ones(3)), (_Work(False), torch.ones(3)), (_Work(True), torch.ones(3))]
    pipe._release_completed()
    assert [w.done for w, _ in pipe.sends] == [False] and pipe.most_held == 3


def _save_and_verify(rank, world, port, out):
    import checkpoint
    from parallelisms import placement
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    hashed, sha = [], checkpoint._sha256
    checkpoint._sha256 = lambda path: (hashed.append(Path(path).name), sha(path))[1]
    folder = Path(out) / "step_00000001"
    state = {f"model/w{rank}": placement.Chunks((4,), [((0,), torch.full((4,), float(rank)))])}
    checkpoint.write_dcp(folder, state, dist.group.WORLD)
    checkpoint.mark_complete_together(folder, dist.group.WORLD)
    dist.barrier()
    saved, hashed[:] = list(hashed), []
    why = checkpoint.problem(folder, group=dist.group.WORLD)
    Path(out, f"hashed{rank}.json").write_text(json.dumps({"saved": saved, "verified": hashed, "why": why}))
    dist.destroy_process_group()


def test_each_rank_hashes_and_verifies_its_share_of_a_checkpoint(tmp_path):
    spawn(_save_and_verify, 2, str(tmp_path))
    zero, one = (json.loads((tmp_path / f"hashed{r}.json").read_text()) for r in (0, 1))
    assert sorted(zero["saved"]) == [".metadata", "__0_0.distcp"] and one["saved"] == ["__1_0.distcp"]
    manifest = json.loads((tmp_path / "step_00000001" / "manifest.json").read_text())["files"]
    assert sorted(manifest) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert zero["why"] is None and one["why"] is None
    assert sorted(zero["verified"] + one["verified"]) == sorted(manifest) and zero["verified"] and one["verified"]
