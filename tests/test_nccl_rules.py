"""NCCL's matching and blocking rules (clustermodel/nccl_rules.py), and the pipeline's plan under them.

Each deadlock a review found in an earlier version of the pipeline is put back as a minimal reproduction (one
shared channel for every message, tags ignored, as NCCL does) and must be caught; the plan of
parallelisms/pipeline.py (a channel per message kind and direction) must pass the same layouts, the paper's
included, training and evaluation, overlap off and on."""
import pytest

from parallelisms import pipeline
from clustermodel.nccl_rules import Op, check, pipeline_programs

SHARED = lambda message: ()  # the earlier version: one process group for every pipeline message


def caught(pp, vpp, microbatches, overlap, backward=True):
    return check(pipeline_programs(pp, vpp, microbatches, overlap, backward, channel=SHARED))


def deadlocked(problems) -> bool:
    return any(p.startswith("deadlock") for p in problems)


# --- the review's findings, put back ---

def test_1f1b_overlap_off_both_ranks_wait_in_a_send():
    problems = caught(pp=2, vpp=1, microbatches=4, overlap=False)
    assert deadlocked(problems)
    # rank 0 posted sA0 sA1 rG0, rank 1 rA0 sG0 rA1: each one's second send waits for a receive
    # queued behind the other's send
    assert "rank 0 op #1 (send to rank 1) sends to rank 1 and waits for rank 1 op #2 (recv from rank 0)" in problems[0]


def test_1f1b_overlap_on_both_ranks_wait_in_a_receive():
    problems = caught(pp=2, vpp=1, microbatches=4, overlap=True)
    assert deadlocked(problems)
    assert "recvs from rank 1 and waits for" in problems[0] and "recvs from rank 0 and waits for" in problems[0]


@pytest.mark.parametrize("overlap", [False, True])
def test_interleaved_pp2_vpp2_is_caught(overlap):
    # one channel for activations and gradients both ways: the order messages arrive in is not
    # the order the receiver consumes them in, and the streams block each other
    assert caught(pp=2, vpp=2, microbatches=4, overlap=overlap)


def test_paper_layout_deadlocks_at_the_end_of_warm_up_with_overlap_off():
    problems = caught(pp=8, vpp=6, microbatches=64, overlap=False)
    assert deadlocked(problems)


@pytest.mark.parametrize("overlap", [False, True])
def test_plain_1f1b_at_pp8_deadlocks(overlap):
    assert deadlocked(caught(pp=8, vpp=1, microbatches=16, overlap=overlap))


def test_evaluation_at_pp2_vpp2_with_overlap_on():
    assert caught(pp=2, vpp=2, microbatches=4, overlap=True, backward=False)


# --- the plan that replaced it ---

GRID = [(pp, vpp, m) for pp in (2, 3, 4, 8) for vpp in (1, 2, 3) for m in ((pp, 2 * pp) if vpp > 1 else (1, 3, 2 * pp))]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("backward", [True, False])
def test_the_plan_runs_under_nccl_rules(overlap, backward):
    for pp, vpp, m in GRID:
        assert check(pipeline_programs(pp, vpp, m, overlap, backward)) == [], (pp, vpp, m)


@pytest.mark.parametrize("overlap", [False, True])
def test_the_paper_layouts_run_under_nccl_rules(overlap):
    assert check(pipeline_programs(8, 6, 64, overlap)) == []     # 175B, Table 3 (dp4)
    assert check(pipeline_programs(8, 6, 192, overlap)) == []    # 175B, Table 3's LAMB step
    assert check(pipeline_programs(35, 3, 70, overlap)) == []    # 530B (conf/parallel/megascale_530B)


@pytest.mark.parametrize("overlap", [False, True])
def test_receives_are_posted_one_compute_ahead_only_with_overlap(overlap):
    steps = pipeline.plan(pp=2, pp_rank=1, vpp=2, microbatches=4, overlap=overlap)
    position = {(s[0], s[1]): k for k, s in enumerate(steps)}
    computes = [s[1] for s in steps if s[0] == "compute"]
    ahead = [("recv", i) in position and position[("recv", i)] < position[("compute", i - 1)] for i in computes[1:]
             if ("recv", i) in position]
    assert ahead and all(ahead) == overlap and any(ahead) == overlap


# --- the rules themselves, on hand-made programs ---

def p2p(op, peer, sig=("f32", (2, 3)), group=(0, 1)):
    return Op(op, group, peer, sig=sig)


def test_fifo_mismatch_is_reported_with_both_call_sites():
    programs = {0: [("post", 0, [Op("send", (0, 1), 1, sig=((4,), "bf16"), site="a.py:1")], False)],
                1: [("post", 0, [Op("recv", (0, 1), 0, sig=((4,), "f32"), site="b.py:2")], False), ("wait", 0)]}
    problems = check(programs)
    assert problems and problems[0].startswith("mismatch") and "a.py:1" in problems[0] and "b.py:2" in problems[0]


def test_a_batched_send_never_meets_an_unbatched_receive():
    programs = {0: [("post", 0, [p2p("send", 1)], True)], 1: [("post", 0, [p2p("recv", 0)], False), ("wait", 0)]}
    assert [p for p in check(programs) if p.startswith("unmatched")]


def test_a_batched_exchange_progresses_together():
    # both ranks send then receive in one group: fine batched, a deadlock as two unbatched ops on
    # the pair's one stream when both send first
    batched = {r: [("post", 0, [p2p("send", 1 - r), p2p("recv", 1 - r)], True), ("wait", 0)] for r in (0, 1)}
    assert check(batched) == []
    single = {r: [("post", 0, [p2p("send", 1 - r)], False), ("post", 1, [p2p("recv", 1 - r)], False), ("wait", 1)]
              for r in (0, 1)}
    assert deadlocked(check(single))


def test_collectives_must_match_in_order_on_every_member():
    ar = lambda n: Op("all_reduce", (0, 1), sig=((n,), "f32"))
    good = {r: [("post", 0, [ar(4)], False), ("wait", 0), ("post", 1, [ar(8)], False), ("wait", 1)] for r in (0, 1)}
    assert check(good) == []
    swapped = {0: good[0], 1: [("post", 0, [ar(8)], False), ("wait", 0), ("post", 1, [ar(4)], False), ("wait", 1)]}
    assert check(swapped)[0].startswith("mismatch: collective 0")
    missing = {0: good[0], 1: good[1][:2]}
    assert check(missing)[0].startswith("unmatched: collective 1")


def test_a_collective_waiting_behind_a_receive_that_needs_it_is_a_deadlock():
    # rank 1 all-reduces only after receiving what rank 0 sends after its own all-reduce: fine.
    # With rank 0 waiting for rank 1's message before it all-reduces, the wait closes.
    ar = Op("all_reduce", (0, 1), sig=((1,), "f32"))
    fine = {0: [("post", 0, [ar], False), ("wait", 0), ("post", 1, [p2p("send", 1, group=("x", 0, 1))], False)],
            1: [("post", 0, [p2p("recv", 0, group=("x", 0, 1))], False), ("post", 1, [ar], False), ("wait", 1)]}
    assert check(fine) == []
    cyclic = {0: [("post", 0, [p2p("recv", 1, group=("x", 0, 1))], False), ("wait", 0), ("post", 1, [ar], False), ("wait", 1)],
              1: [("post", 0, [ar], False), ("wait", 0), ("post", 1, [p2p("send", 0, group=("x", 0, 1))], False)]}
    problems = check(cyclic)
    assert deadlocked(problems) and "all_reduce" in problems[0]
