"""The pipeline alone (parallelisms/pipeline.py), primitive by primitive, in a few seconds: its plan of sends and
receives against NCCL's rules and its own bookkeeping, and 1F1B and interleaved 1F1B on 2 gloo
ranks against the unsplit model in one process (the same loss, the same gradients). The
whole-run layouts (tests/test_parallel.py: pp2_vpp2, pp2_dp2, ...) run train.py with these
pieces in place; this file is where a change to the schedule or the executor is tested alone."""
import json
from pathlib import Path
from collections import Counter, defaultdict

import pytest
import torch

from parallelisms import pipeline
from clustermodel.nccl_rules import check, pipeline_programs
from conftest import spawn

# (pp, vpp, microbatches): plain 1F1B and interleaved, with fewer and more microbatches than a
# warm-up needs (interleaving needs a multiple of pp).
PLANS = [(2, 1, 1), (2, 1, 4), (2, 2, 2), (2, 2, 4), (3, 1, 5), (3, 2, 6), (4, 2, 8), (4, 3, 4)]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("backward", [True, False])
@pytest.mark.parametrize("pp, vpp, m", PLANS)
def test_every_rank_computes_each_action_once_after_what_it_needs(pp, vpp, m, overlap, backward):
    """Each rank computes every (microbatch, chunk) forward once (and backward once, after the
    forward, when training); a receive is posted before its wait and the wait before its compute;
    a send follows the compute that produced it."""
    for rank in range(pp):
        steps = pipeline.plan(pp, rank, vpp, m, overlap, backward)
        computes = [s[2] for s in steps if s[0] == "compute"]
        want = {(kind, mb, c) for kind in ("FB" if backward else "F") for mb in range(m) for c in range(vpp)}
        assert Counter(computes) == Counter(want), (pp, rank)
        if backward:
            assert all(computes.index(("F", mb, c)) < computes.index(("B", mb, c)) for _, mb, c in want)
        where = {(s[0], s[1]): k for k, s in enumerate(steps)}
        for (kind, i), k in where.items():
            if kind == "wait":
                assert where[("recv", i)] < k < where[("compute", i)], (pp, rank, i)
            if kind == "send":
                assert where[("compute", i)] < k, (pp, rank, i)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("backward", [True, False])
@pytest.mark.parametrize("pp, vpp, m", PLANS)
def test_each_channel_carries_its_messages_in_the_order_they_are_received(pp, vpp, m, overlap, backward):
    """NCCL matches sends and receives first-in first-out per pair of ranks and communicator, tags
    ignored: on every channel (a message kind, a direction) the receiver posts its receives for
    exactly the messages the sender sends it, in the sender's order; every activation goes to the
    next virtual stage and every gradient to the previous one. nccl_rules then finds no deadlock
    and no mismatch."""
    sent, received = defaultdict(list), defaultdict(list)
    for rank in range(pp):
        for step in pipeline.plan(pp, rank, vpp, m, overlap, backward):
            if step[0] in ("send", "recv"):
                msg = step[2]
                assert (msg.src if step[0] == "send" else msg.dst) == rank
                assert msg.dst == msg.stage % pp and msg.src == (msg.stage - 1 if msg.kind == "A" else msg.stage + 1) % pp
                assert msg.kind == "A" or backward
                key = (msg.src, msg.dst, msg.channel())
                (sent if step[0] == "send" else received)[key].append((msg.kind, msg.mb, msg.stage))
    assert sent == received
    boundaries = pp * vpp - 1  # messages of one microbatch: one activation (and one gradient) per boundary
    assert sum(map(len, sent.values())) == m * boundaries * (2 if backward else 1)
    assert check(pipeline_programs(pp, vpp, m, overlap, backward)) == []


# --- the executor on 2 gloo ranks against the unsplit model ---

SCHEDULES = [(1, False), (1, True), (2, False), (2, True)]  # (vpp, parallel.overlap.pp): 1F1B and interleaved
MICROBATCHES = 4


def _tiny_model():
    from model import GPT, ModelConfig
    model = GPT(ModelConfig(n_layers=4, n_heads=2, d_model=32, vocab_size=64, max_seq_len=16))
    model.init_weights(0)
    return model


def _tokens():
    return torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(0))


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


def _pipelined_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    """One gloo rank: the unsplit model's loss and gradients in this process, then each schedule's
    on this rank's chunks; writes how far apart they are."""
    import torch.distributed as dist
    import parallel
    import torch.nn.functional as F
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    tokens = _tokens()
    x, y = tokens[:, :-1], tokens[:, 1:]
    reference = _tiny_model()
    loss = F.cross_entropy(reference(x).flatten(0, 1), y.flatten())
    loss.backward()
    want = {name: p.grad for name, p in reference.named_parameters()}
    with torch.no_grad():
        want_eval = F.cross_entropy(reference(x).flatten(0, 1), y.flatten()).item()
    layout = parallel.build_layout(parallel.ParallelConfig(pp=2), rank, world, torch.device("cpu"))
    found = {}
    for vpp, overlap in SCHEDULES:
        cfg = parallel.ParallelConfig(pp=2, vpp=vpp, microbatches=MICROBATCHES)
        cfg.overlap.pp = overlap
        engine = parallel.build(_tiny_model(), layout, cfg)
        got = engine.forward_backward(x, y, torch.float32)
        engine.finish_gradients(float("inf"))
        grads = {name: piece.grad for name, piece in engine.named_optimizer_parameters()}
        got_eval = engine.forward_backward(x, y, torch.float32, backward=False)
        last = layout.pp_rank == layout.pp - 1
        found[f"vpp{vpp}_overlap{int(overlap)}"] = {
            "loss": [got.item(), loss.item()] if last else [got.item(), 0.0],
            "eval_loss": [got_eval.item(), want_eval] if last else [got_eval.item(), 0.0],
            "grads": {name: _relative_error(g, want[name]) for name, g in grads.items()},
            "stages": sorted(chunk.stage for chunk in engine.chunks), "sends_held": engine.pipeline.most_held}
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps({"names": sorted(want), "found": found}))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipelined")
    spawn(_pipelined_rank, 2, str(out))
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize("vpp, overlap", SCHEDULES)
def test_the_pipeline_gives_the_unsplit_models_loss_and_gradients(pipelined, vpp, overlap):
    """pp=2 (1F1B) and pp=2 x vpp=2 (interleaved), overlap off and on, 4 microbatches: the last
    stage's loss (training and evaluation) is the unsplit model's, the first stage's is 0, every
    parameter lives on exactly one rank, and its gradient is the unsplit model's (fp32, 1e-5
    relative: only the order of the microbatches' sums differs)."""
    runs = [rank["found"][f"vpp{vpp}_overlap{int(overlap)}"] for rank in pipelined]
    assert runs[0]["loss"][0] == 0.0 and runs[0]["eval_loss"][0] == 0.0
    assert runs[1]["loss"][0] == pytest.approx(runs[1]["loss"][1], rel=1e-6)
    assert runs[1]["eval_loss"][0] == pytest.approx(runs[1]["eval_loss"][1], rel=1e-6)
    assert [run["stages"] for run in runs] == ([[0], [1]] if vpp == 1 else [[0, 2], [1, 3]])
    held = [set(run["grads"]) for run in runs]
    assert not held[0] & held[1] and held[0] | held[1] == set(pipelined[0]["names"])
    for run in runs:
        for name, error in run["grads"].items():
            assert error < 1e-5, (name, error)
