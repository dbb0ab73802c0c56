"""Observability (oplog.py): the op log and spans every rank writes with its heartbeat, and the
root of a hang named from them. One real torchrun job on 2 gloo pipeline ranks serves the
injected faults that restart it: a skipped collective in the first attempt, a rank busy outside
communication in the second, and the third finishes the run from the newest checkpoint."""
import json
import os
import subprocess
import sys

import pytest

from observe import hangs, heartbeat, oplog, timeline
from conftest import ROOT, SMALL, read_metrics, run_train, train_env

STEPS = 5
# attempt 0: rank 1 skips step 3's first collective; attempt 1: rank 0 hangs after step 4
FAULTS = "skip:1@3,hang:0@4#1"


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory, cache_dir):
    run_dir = tmp_path_factory.mktemp("observe")
    args = SMALL + ["parallel.pp=2", "parallel.microbatches=2", f"train.max_steps={STEPS}", "checkpoint.interval=2",
                    "ft.hang_timeout=3", "ft.heartbeat_interval=0.1", "observe.stall_s=1", "train.gc_interval=1",
            f"hydra.run.dir={run_dir}"]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "--max-restarts=2", "train.py"] + args, cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env=train_env(cache_dir, MEGAREPRO_FAULT=FAULTS, OMP_NUM_THREADS=1))
    events = [json.loads(line) for line in (run_dir / "faults.jsonl").read_text().splitlines()]
    return proc, run_dir, events


def _root(events, attempt):
    roots = [e["root"] for e in events if e["event"] == "hang_detected" and e["attempt"] == attempt and "root" in e]
    assert len(roots) == 1, events  # rank 0 alone localizes
    return roots[0]


def test_a_skipped_collective_names_that_rank_op_group_and_sequence_number_then_the_job_resumes(faulty_run):
    proc, run_dir, events = faulty_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in read_metrics(run_dir)][-1] == STEPS
    root = _root(events, 0)
    # What the healthy rank waits in, read from its own last snapshot of that attempt
    healthy = json.loads((hangs.snapshot_dir(run_dir, 0) / "rank0.json").read_text())
    waiting = hangs._blocked(healthy)
    assert waiting is not None and waiting[timeline.STEP] == 3
    assert (root["rank"], root["reason"], root["coords"]["pp"]) == (1, "skipped", 1)
    assert (root["op"], root["group"], root["seq"]) == (waiting[timeline.OP], waiting[timeline.GROUP],
                                                        waiting[timeline.SEQ])
    assert root["op"] == "all_reduce" and root["site"] == waiting[timeline.SITE]
    assert "hang started at rank 1" in proc.stdout + proc.stderr
    # Found at observe.stall_s (1 s in the wait), not at ft.hang_timeout (3 s without progress)
    (event,) = [e for e in events if e["attempt"] == 0 and "root" in e]
    assert event["early"] and event["idle_s"] < 3


def test_a_hung_rank_is_reported_busy_outside_communication_with_its_stack(faulty_run):
    proc, run_dir, events = faulty_run
    root = _root(events, 1)
    assert (root["rank"], root["reason"]) == (0, "busy"), root  # not certain: found at the hang timeout
    (event,) = [e for e in events if e["attempt"] == 1 and "root" in e]
    assert not event["early"] and event["idle_s"] >= 3
    assert any(line.startswith("fault_injection.py:") and line.endswith("after_step") for line in root["stack"]), root["stack"]
    assert root["op"] == "recv" and root["dim"] == "pp"  # what rank 1 waits in: rank 0's activations
    assert [a["status"] for a in json.loads((run_dir / "run.json").read_text())["attempts"]][-1] == "finished"


def test_every_snapshot_says_who_wrote_it_and_holds_the_ops_and_spans(faulty_run):
    _, run_dir, _ = faulty_run
    snap = json.loads((hangs.snapshot_dir(run_dir, 2) / "rank1.json").read_text())
    assert (snap["rank"], snap["attempt"], snap["coords"]) == (1, 2, {"rank": 1, "dp": 0, "pp": 1, "tp": 0})
    assert snap["host"] and snap["pid"] != os.getpid() and snap["stack"]
    ops = [dict(zip(snap["fields"], e)) for e in snap["ops"]]
    recvs = [o for o in ops if o["op"] == "recv"]
    assert recvs and all(o["peer"] == 0 and o["post"] <= o["wait"] <= o["done"] for o in recvs)
    numbers = [o["pair_seq"] for o in recvs if o["group"] == recvs[0]["group"]]
    assert numbers == list(range(1, len(numbers) + 1)) and len(numbers) >= 2  # one per microbatch
    sites = {o["site"].split(" ")[-1] for o in ops}
    assert {"agree", "finish_gradients", "_post"} <= sites  # the project's lines that posted them
    per_group = {}
    for o in ops:
        if o["peer"] is None:
            per_group.setdefault(o["group"], []).append(o["seq"])
    assert all(seqs == list(range(seqs[0], seqs[0] + len(seqs))) for seqs in per_group.values())
    kinds = {(s[0], s[1]) for s in snap["spans"]}
    assert {("phase", "data"), ("phase", "compute"), ("segment", "gc"), ("segment", "checkpoint save"),
            ("segment", "agreed read")} <= kinds
    # Each wait named by what it waits for; rank 1, the last stage, receives activations and sends gradients
    assert {("wait", "bubble pp recv"), ("wait", "comm pp send"), ("wait", "comm optimizer"),
            ("wait", "bubble agree")} <= kinds
    # Forward and backward of every microbatch of every step, each once
    steps = {s[2] for s in snap["spans"] if s[0] == "phase" and s[1] == "compute"}
    passes = sorted((s[2], s[1]) for s in snap["spans"] if s[0] == "segment" and s[1].split()[0] in ("forward", "backward"))
    assert passes == sorted((step, f"{kind} c0 mb{mb}") for step in steps for kind in ("forward", "backward")
                            for mb in range(2))
    assert all(s[4] >= 0 for s in snap["spans"] if s[0] != "phase")


# --- localize, on hand-made snapshots ---

def _snap(rank, step, ops, seq=None, pairs=None, members=None, **extra):
    return {"rank": rank, "host": "elsewhere", "pid": 1, "coords": {"rank": rank}, "step": step, "phase": "compute",
            "ops": ops, "seq": seq or {}, "pairs": pairs or {}, "members": members or {"g": ["range", 0, 3, 1]},
            "stack": [f"train.py:1 rank{rank}"], **extra}


def _op(op, seq, site, nbytes=4, done=None, group="g", peer=None, pair_seq=None, step=7):
    return [group, "dp", seq, op, nbytes, "float32", peer, pair_seq, site, step, 1.0, 1.0, done]


def test_a_different_size_at_the_same_sequence_number_names_the_odd_rank_and_both_sites():
    waiting = [_op("all_reduce", 4, "optim.py:9 step")]
    snaps = {0: _snap(0, 7, waiting, {"g": 4}), 2: _snap(2, 7, waiting, {"g": 4}),
             1: _snap(1, 7, [_op("all_reduce", 4, "parallelisms/zero.py:5 reduce", nbytes=8)], {"g": 4})}
    root = hangs.localize(snaps)
    assert (root["rank"], root["reason"], root["seq"]) == (1, "mismatch", 4)
    assert root["sites"] == ["optim.py:9 step", "parallelisms/zero.py:5 reduce"]


def test_a_wait_for_cycle_is_reported_as_one():
    snaps = {0: _snap(0, 7, [_op("recv", 0, "parallelisms/pipeline.py:1 _post", peer=1, pair_seq=3)], members={}),
             1: _snap(1, 7, [_op("recv", 0, "parallelisms/pipeline.py:1 _post", peer=0, pair_seq=3)], members={})}
    root = hangs.localize(snaps)
    assert root["reason"] == "cycle" and "rank 0" in root["detail"] and "rank 1" in root["detail"]


def test_a_missing_snapshot_is_a_dead_rank():
    snaps = {0: _snap(0, 7, [_op("all_reduce", 4, "optim.py:9 step")], {"g": 4}), 1: None}
    root = hangs.localize(snaps)
    assert (root["rank"], root["reason"], root["seq"]) == (1, "dead", 4)


def test_the_op_log_is_a_bounded_ring_with_a_running_hash_per_group(monkeypatch):
    """Wrapped in-process on a 1-rank gloo group: sequence numbers, bytes, the ring's bound, and a
    hash that depends on (op, bytes, dtype) and their order."""
    import torch
    import torch.distributed as dist
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        hashes, original = [], dist.all_reduce
        for order in ((4, 8), (8, 4)):
            rec = oplog.Recorder(oplog.ObserveConfig(ring=3), 0, {"rank": 0}, {})
            rec.install()
            try:
                for n in order + (1, 1):
                    dist.all_reduce(torch.ones(n))
                dist.all_reduce(torch.ones(2), async_op=True).wait()
            finally:
                rec.uninstall()
            ops = list(rec.ops)
            assert len(ops) == 3 and [e[timeline.SEQ] for e in ops] == [3, 4, 5]
            assert [e[timeline.BYTES] for e in ops] == [4, 4, 8] and all(e[timeline.DONE] for e in ops)
            assert ops[0][timeline.SITE].startswith("test_observe.py:")
            hashes.append(rec.hash[ops[0][timeline.GROUP]])
        assert hashes[0] != hashes[1]
        assert dist.all_reduce is original  # uninstalled
        swapped = []  # the same two same-size ops from two lines, in either order: only the call site differs
        for first in (True, False):
            rec = oplog.Recorder(oplog.ObserveConfig(), 0, {"rank": 0}, {})
            rec.install()
            try:
                for turn in (first, not first):
                    if turn:
                        dist.all_reduce(torch.ones(4))
                    else:
                        dist.all_reduce(torch.ones(4))
            finally:
                rec.uninstall()
            swapped.append(list(rec.hash.values())[0])
        assert swapped[0] != swapped[1]
    finally:
        dist.destroy_process_group()


def test_the_op_log_and_the_rehearsals_recorder_share_one_interposer(monkeypatch):
    """Both register with observe/comms.py: torch.distributed is patched once, each handler sees a
    call with the same call site, the newest first, and the last one out puts the functions back."""
    import torch
    import torch.distributed as dist
    import parallel
    from clustermodel.recorder import Recorder
    from observe import comms
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        original = dist.all_reduce
        layout = parallel.build_layout(parallel.ParallelConfig(), 0, 1, torch.device("cpu"))
        oplog_recorder = oplog.Recorder(oplog.ObserveConfig(), 0, {"rank": 0}, {})
        oplog_recorder.install()
        try:
            interposed = dist.all_reduce
            assert interposed is not original and interposed.__wrapped__ is original
            with Recorder(layout, torch.device("cpu"), fake=False) as rehearsal:
                assert dist.all_reduce is interposed and comms.HANDLERS[1] == oplog_recorder.intercept
                x = torch.ones(4)
                dist.all_reduce(x)
            assert dist.all_reduce is interposed
        finally:
            oplog_recorder.uninstall()
        assert dist.all_reduce is original and not comms.HANDLERS
        (posted,) = [e for e in rehearsal.events if e["op"] == "all_reduce"]
        (logged,) = oplog_recorder.ops
        assert posted["site"] == logged[timeline.SITE] and x.tolist() == [1.0] * 4  # called through once
        assert posted["site"].startswith("test_observe.py:") and posted["site"].endswith("_share_one_interposer")
        # The rehearsal's fake mode calls nothing through: the op log below it sees nothing
        oplog_recorder = oplog.Recorder(oplog.ObserveConfig(), 0, {"rank": 0}, {})
        oplog_recorder.install()
        try:
            with Recorder(layout, torch.device("cpu"), fake=True) as rehearsal:
                dist.all_reduce(torch.ones(4), async_op=True).wait()
        finally:
            oplog_recorder.uninstall()
        assert [e["op"] for e in rehearsal.events] == ["all_reduce", "wait"] and not oplog_recorder.ops
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("sizes, swapped", [((4, 4), True), ((4, 8), False)])
def test_a_swap_fault_whose_step_has_no_pair_is_reported(sizes, swapped, monkeypatch, tmp_path, caplog):
    """swap:0@1 on a group taken for one of two ranks: two same-size all-reduces from two lines are
    posted in swapped order; two of different sizes go out in order, and as the step ends a warning
    says that nothing was swapped and faults.jsonl records it."""
    import torch
    import torch.distributed as dist
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        rec = oplog.Recorder(oplog.ObserveConfig(), 0, {"rank": 0}, {}, swap_step=1, run_dir=tmp_path)
        rec.members[dist.group.WORLD.group_name] = ["range", 0, 2, 1]  # as if it had two ranks
        rec.install()
        try:
            rec.mark(1, "compute")
            dist.all_reduce(torch.ones(sizes[0]))
            dist.all_reduce(torch.ones(sizes[1]))
            rec.mark(2, "data")
            dist.all_reduce(torch.ones(2))
        finally:
            rec.uninstall()
    finally:
        dist.destroy_process_group()
    posted = [(e[timeline.BYTES] // 4, e[timeline.SITE].split()[0]) for e in rec.ops]
    first, second = [site for _, site in posted[:2]]
    assert first != second and posted[2][0] == 2
    events = [json.loads(line) for line in (tmp_path / "faults.jsonl").read_text().splitlines()] \
        if (tmp_path / "faults.jsonl").exists() else []
    if swapped:
        assert rec.swapped == 1 and int(first.split(":")[1]) > int(second.split(":")[1])  # the later line first
        assert not events and "swapped nothing" not in caplog.text
    else:
        assert rec.swapped is False and [size for size, _ in posted] == [4, 8, 2]  # in order
        (event,) = events
        assert (event["event"], event["rank"], event["step"], event["swapped"]) == ("injected_swap", 0, 1, False)
        assert "swap:0@1 swapped nothing" in caplog.text and event["detail"] in caplog.text


def _free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]



# --- python oplog.py RUN_DIR ---

def test_the_diagnosis_names_the_last_hang_and_the_trace_is_valid(faulty_run):
    _, run_dir, events = faulty_run
    out = subprocess.run([sys.executable, "-m", "observe", str(run_dir)], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    diagnosis = json.loads((run_dir / "observe" / "diagnosis.json").read_text())
    assert diagnosis["attempt"] == 2 and diagnosis["ranks"] == [0, 1]
    hang = diagnosis["hang"]
    assert (hang["rank"], hang["reason"], hang["attempt"]) == (0, "busy", 1)
    assert [h["rank"] for h in diagnosis["hangs"]] == [1, 0] and "rank 1, skipped" in out.stdout
    events = json.loads((run_dir / "observe" / "trace.json").read_text())["traceEvents"]
    threads = {e["tid"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert threads == {0, 1} and {e["tid"] for e in events if e["ph"] == "X"} == {0, 1}
    assert all(e["dur"] >= 0 for e in events if e["ph"] == "X")  # each slice is a begin with its end
    starts = sorted(e["id"] for e in events if e["ph"] == "s")
    assert starts and starts == sorted(e["id"] for e in events if e["ph"] == "f")  # every flow paired
    sends = [e for e in events if e["ph"] == "X" and e["name"].startswith("send")]
    assert sends and len(starts) >= len(sends)  # each send linked to its receive, and the collectives too
    assert (run_dir / "observe" / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_replays_predicted_track_lies_beside_each_rank_and_the_trace_stays_valid(faulty_run, capsys):
    """python -m clustermodel.predicted RUN_DIR: the run rehearsed (one rank per stage), its replay's steady step
    laid at each measured step of each rank, in the trace and the figure."""
    from clustermodel import predicted
    from observe import timeline
    from clustermodel import cli, perfmodel as pm, replay
    _, run_dir, _ = faulty_run
    predicted.main([str(run_dir)])
    assert "rank 1, skipped" in capsys.readouterr().out  # oplog.py's report, redrawn with the track
    stages = json.loads((run_dir / "observe" / "predicted.json").read_text())["stages"]
    cfg = cli.run_config(run_dir)  # hardware=auto: this CPU
    hw = pm.resolve_hardware(cfg.hardware)
    step_s = replay.predict(replay.rehearse(cfg, hw, 2, run_dir / "rehearsal"), cfg, hw, 2)["step_s"]
    assert sorted(stages) == ["0", "1"]
    for segments in stages.values():  # the whole replayed step, compute and waits end to end, no gap
        ends = [start + seconds for _, _, start, seconds in segments]
        assert segments[0][2] == pytest.approx(0.0, abs=1e-9)
        assert all(nxt[2] == pytest.approx(end, abs=1e-9) for nxt, end in zip(segments[1:], ends))
        assert ends[-1] == pytest.approx(step_s, rel=1e-6)  # the replay's own step time
        assert {"compute", "bubble pp recv"} <= {name for _, name, _, _ in segments}
    diagnosis = json.loads((run_dir / "observe" / "diagnosis.json").read_text())
    assert diagnosis["predicted_track"] == [0, 1]
    events = json.loads((run_dir / "observe" / "trace.json").read_text())["traceEvents"]
    snaps = {r: json.loads((hangs.snapshot_dir(run_dir, 2) / f"rank{r}.json").read_text()) for r in (0, 1)}
    for rank, snap in snaps.items():
        tid = timeline.PREDICTED_TID + rank
        assert any(e["ph"] == "M" and e.get("tid") == tid and e["args"].get("name") == f"rank {rank} predicted"
                   for e in events)
        measured = sorted({s[2] for s in snap["spans"] if s[:2] == ["phase", "data"]})
        mine = [e for e in events if e["ph"] == "X" and e.get("tid") == tid]
        assert measured and len(mine) == len(measured) * len(stages[str(snap["coords"]["pp"])])
        assert sorted({e["args"]["step"] for e in mine}) == measured
        mine.sort(key=lambda e: e["ts"])
        assert all(b["ts"] >= a["ts"] + a["dur"] - 1.0 for a, b in zip(mine, mine[1:]))  # no overlap (us rounding)
    assert all(e["dur"] >= 0 for e in events if e["ph"] == "X")
    assert sorted(e["id"] for e in events if e["ph"] == "s") == sorted(e["id"] for e in events if e["ph"] == "f")
    drawn = timeline.figure(snaps, timeline.clock_offsets(snaps)[0], run_dir / "observe" / "check.png",
                            timeline.lay_predicted(snaps, stages))
    assert list(drawn) == ["rank 0", "rank 0 predicted", "rank 1", "rank 1 predicted"]
    assert {"forward", "backward", "wait bubble"} <= set(drawn["rank 1"]) and drawn["rank 1 predicted"]["compute"]


def test_clock_offsets_injected_into_synthetic_logs_are_recovered_within_a_millisecond():
    import random
    rng = random.Random(0)
    truth = {0: 0.0, 1: 0.0371, 2: -0.0123, 3: 0.25}  # rank 3 shares no group with rank 0: found through rank 2
    groups = {"a": [0, 1, 2], "b": [2, 3]}
    snaps = {r: {"ops": []} for r in truth}
    for seq in range(1, 40):
        for name, members in groups.items():
            end = 100.0 + seq * 0.01 + rng.random() * 0.001
            for r in members:
                snaps[r]["ops"].append(_op("all_reduce", seq, "x.py:1 f", group=name,
                                           done=end + truth[r] + rng.uniform(-2e-4, 2e-4)))
    from observe import timeline
    offsets, residual = timeline.clock_offsets(snaps)
    assert set(offsets) == set(truth)
    assert all(abs(offsets[r] - truth[r]) < 1e-3 for r in truth), offsets
    assert residual < 5e-4


def test_a_snapshot_holds_a_mesh_groups_ranks_in_four_items_whatever_its_size():
    assert oplog.as_range(list(range(12288))) == ["range", 0, 12288, 1]
    assert oplog.as_range([4, 6, 8]) == ["range", 4, 9, 2]
    assert list(hangs.ranks_of(["range", 4, 9, 2])) == [4, 6, 8]
    assert list(hangs.ranks_of(oplog.as_range([3]))) == [3]
    assert oplog.as_range([0, 1, 4, 5]) == [0, 1, 4, 5] == hangs.ranks_of([0, 1, 4, 5])


def test_snapshots_keep_the_heartbeats_bound_even_while_the_first_step_posts_ops(monkeypatch, tmp_path):
    """An op log that changes at every op is written at most every ft.hang_timeout/10 s, during the
    first step too (which the heartbeat file itself may rewrite at every change), and its last
    state once more when the heartbeat closes."""
    import time
    cfg = heartbeat.FTConfig(hang_timeout=2.0, first_step_timeout=30, heartbeat_interval=0.01)
    recorder = oplog.Recorder(oplog.ObserveConfig(), 0, {"rank": 0}, {})
    writes, write = [], recorder.write
    monkeypatch.setattr(recorder, "write", lambda *a, **k: (writes.append(time.monotonic()), write(*a, **k)))
    beat = heartbeat.Heartbeat(tmp_path, 0, 1, cfg, observer=recorder)
    try:
        beat.progress(1, "compute")
        start = time.monotonic()
        while time.monotonic() - start < 1.0:  # the first step: ops, no progress
            recorder.version += 1
            time.sleep(0.005)
        assert 1 <= len(writes) <= 1.0 / 0.2 + 1, len(writes)
        # (the bound holds between the heartbeat files' writes, each just before its snapshot: a loaded
        # machine may delay one snapshot's start by some ms more than the next's, far less than 0.1 s)
        assert all(b - a >= 0.1 for a, b in zip(writes, writes[1:]))
    finally:
        recorder.version += 1
        beat.close()
    snap = json.loads((hangs.snapshot_dir(tmp_path, 0) / "rank0.json").read_text())
    assert (snap["rank"], snap["step"], snap["phase"]) == (0, 1, "compute") and len(writes) >= 2


# --- a desync, found before it hangs ---

@pytest.fixture(scope="module")
def swapped_run(tmp_path_factory, cache_dir):
    """2 TP ranks; rank 1 posts two same-size all-gathers of step 2 in swapped order. gloo completes
    both (the data is wrong, the loss may go to nan): nothing hangs, and only the hashes can tell."""
    run_dir = tmp_path_factory.mktemp("swap")
    args = SMALL + ["parallel.tp=2", "train.max_steps=8", "ft.hang_timeout=3", "ft.heartbeat_interval=0.1",
                    "observe.desync_every=1"]
    # forked ranks (tests/forked.py): no restart to exercise, and no Python start-up per rank to pay
    proc = run_train(run_dir, args, cache_dir, nproc=2, check=False, MEGAREPRO_FAULT="swap:1@2")
    events = [json.loads(line) for line in (run_dir / "faults.jsonl").read_text().splitlines()]
    return proc, run_dir, events


def test_a_swap_of_two_same_size_collectives_is_reported_without_a_hang(swapped_run):
    proc, run_dir, events = swapped_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not [e for e in events if e["event"] == "hang_detected"]
    (event,) = [e for e in events if e["event"] == "desync"]  # once per group
    desync = event["desync"]
    # The first sequence number at which the two ranks' own snapshots differ, and both call sites
    rings = [{e[timeline.SEQ]: e for e in json.loads((hangs.snapshot_dir(run_dir, 0) / f"rank{r}.json").read_text())
              ["ops"] if e[timeline.PEER] is None and e[timeline.DIM] == "tp"} for r in (0, 1)]
    first = min(seq for seq in rings[0]
                if seq in rings[1] and rings[0][seq][timeline.SITE] != rings[1][seq][timeline.SITE])
    assert (desync["rank"], desync["dim"], desync["seq"], desync["step"]) == (1, "tp", first, 2)
    assert desync["sites"] == [rings[0][first][timeline.SITE], rings[1][first][timeline.SITE]]
    assert desync["sites"][0] != desync["sites"][1] and desync["ops"][0] == desync["ops"][1]
    assert desync["bytes"][0] == desync["bytes"][1]  # the same size: gloo pairs them silently
    assert rings[1][first + 1][timeline.SITE] == desync["sites"][0]  # swapped: rank 1 posted rank 0's next
    assert "desync on rank 1" in proc.stdout + proc.stderr
    out = subprocess.run([sys.executable, "-m", "observe", str(run_dir)], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    diagnosis = json.loads((run_dir / "observe" / "diagnosis.json").read_text())
    assert diagnosis["hang"] is None and [d["seq"] for d in diagnosis["desync"]] == [first]


def _ring(rank, sites, group="g"):
    """A hand-made ring of all-reduces of 4 bytes from `sites`, hashed as the recorder hashes them."""
    import zlib
    ops, running = [], 0
    for seq, site in enumerate(sites, 1):
        running = zlib.crc32(f"all_reduce:4:float32:{site}".encode(), running)
        ops.append(_op("all_reduce", seq, site, group=group, done=1.0) + [running])
    return ops


def _recorder(rank, sites, members):
    rec = oplog.Recorder(oplog.ObserveConfig(desync_every=2), rank, {"rank": rank}, {})
    rec.ops.extend(_ring(rank, sites))
    rec.members = {"g": members}
    return rec


@pytest.mark.parametrize("odd", [1, 0])
def test_the_desync_check_bisects_to_the_first_differing_op_and_names_the_odd_rank(tmp_path, monkeypatch, odd):
    """Through a real c10d store: every rank sets its (seq, hash), the group's lowest rank reads its
    members' once every desync_every beats and bisects against the odd rank's snapshot ring."""
    import torch.distributed as dist
    monkeypatch.setattr(oplog, "attempt", lambda: 0)
    good = [f"a.py:{n} f" for n in range(1, 41)]
    bad = good[:22] + [good[23], good[22]] + good[24:]  # #23 and #24 swapped
    members = ["range", 0, 3, 1]
    recs = [_recorder(r, bad if r == odd else good, members) for r in range(3)]
    store = dist.HashStore()
    for beat in (1, 2):  # beat 2 compares, but no snapshot holds the odd ring yet: nothing to bisect
        assert [rec.check_desync(tmp_path, store) for rec in reversed(recs)] == [[], [], []], beat
    for rec in recs:
        rec.write(tmp_path)
    assert [rec.check_desync(tmp_path, store) for rec in reversed(recs)] == [[], [], []]  # beat 3 of 4
    found = [rec.check_desync(tmp_path, store) for rec in reversed(recs)]
    assert found[:2] == [[], []] and len(found[2]) == 1  # only rank 0, the group's lowest, reads
    report = found[2][0]
    assert (report["rank"], report["seq"], report["group"]) == (odd, 23, "g")
    assert report["sites"] == ([good[22], bad[22]] if odd else [bad[22], good[22]])
    assert recs[0].check_desync(tmp_path, store) == [] and recs[0].check_desync(tmp_path, store) == []  # once
    (event,) = [json.loads(line) for line in (tmp_path / "faults.jsonl").read_text().splitlines()]
    assert event["event"] == "desync" and event["desync"] == report


def test_an_early_stall_verdict_within_the_snapshots_age_is_refused_before_any_rank_works():
    import config
    from errors import ConfigError
    with pytest.raises(ConfigError, match="observe.stall_s"):
        config.validate(config.compose(["ft.hang_timeout=900", "observe.stall_s=60"]))
    config.validate(config.compose(["ft.hang_timeout=900", "observe.stall_s=120"]))
    config.validate(config.compose(["ft.hang_timeout=900", "observe.stall_s=0"]))


def test_the_desync_check_leaves_out_groups_larger_than_its_bound():
    """A large job's world group is not published or read (its reader would fetch a key per rank)."""
    from pathlib import Path
    import torch.distributed as dist
    store = dist.HashStore()
    rec = oplog.Recorder(oplog.ObserveConfig(desync_every=1, desync_max_group=4), 0, {"rank": 0}, {})
    rec.members = {"tp": ["range", 0, 4, 1], "world": ["range", 0, 4096, 1]}
    rec.ops.append(["tp", "tp", 0, "all_reduce", 4, "float32", None, None, "a.py:1", 1, 0.0, 0.0, 0.0, 7])
    rec.ops.append(["world", "dp", 0, "all_reduce", 4, "float32", None, None, "a.py:2", 1, 0.0, 0.0, 0.0, 9])
    assert rec.check_desync(Path("."), store) == []
    prefix = f"observe/desync/{heartbeat.attempt()}/"
    assert store.check([f"{prefix}tp/0"]) and not store.check([f"{prefix}world/0"])


def test_the_figure_draws_each_ranks_spans_by_kind_and_a_wait_still_unfinished(tmp_path):
    """A hand-made hang: rank 0 waits in a receive from t=2 until its snapshot at t=7; rank 1 ran a
    forward and a backward and is busy. Each drawn once, on aligned clocks."""
    from observe import timeline
    recv = ["g", "pp", 0, "recv", 4, "float32", 1, 1, "parallelisms/pipeline.py:9 _post", 1, 1.5, 2.0, None, None]
    snaps = {0: {"time": 7.0, "ops": [recv], "spans": [["wait", "bubble pp recv", 1, 1.0, 0.5]]},
             1: {"time": 7.0, "ops": [], "spans": [["segment", "forward c0 mb0", 1, 1.0, 0.4],
                                                   ["segment", "backward c0 mb0", 1, 1.5, 0.6],
                                                   ["phase", "compute", 1, 1.0, None]]}}
    drawn = timeline.figure(snaps, {0: 0.0, 1: 0.0}, tmp_path / "t.png")
    assert drawn == {"rank 0": {"wait bubble": 1, "waiting (unfinished)": 1}, "rank 1": {"forward": 1, "backward": 1}}
    assert (tmp_path / "t.png").stat().st_size > 1000
