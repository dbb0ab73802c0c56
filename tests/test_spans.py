"""Named segments (observe/spans.py) and the wait spans oplog.py labels with what they wait for, on the
host-clock path and the CUDA-event path (through test_gpu_paths' stand-in event). A real 2-rank
pipeline run's spans are checked in test_observe.py."""
import time

import pytest

from observe import oplog
from observe import spans
from parallelisms.overlap import WaitClock
from test_gpu_paths import StandInEvent


class _Work:
    def wait(self, timeout=None):
        time.sleep(0.02)
        return True


@pytest.fixture
def recorder():
    rec = oplog.Recorder(oplog.ObserveConfig(), 0, {"rank": 0}, {})
    rec.members.update({"tp": ["range", 0, 2, 1], "pp": ["range", 0, 2, 1], "dp": ["range", 0, 2, 1]})
    rec.dims.update({"tp": "tp", "pp": "pp", "dp": "dp"})
    spans.SINK = rec
    yield rec
    spans.SINK, spans.DEVICE = None, None


def _waited(rec, op, group, peer=None, site=None):
    entry = rec.post(op, [], None if group is None else _Group(group), peer, site=site)
    oplog._Watched(_Work(), entry, rec).wait()


class _Group:
    def __init__(self, name):
        self.group_name = name


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_each_wait_is_named_by_the_op_it_waits_for_on_both_paths(recorder, device):
    clock = WaitClock(events=StandInEvent if device == "cuda" else None)
    clock.on_wait, clock.describe = recorder.wait_span, recorder.wait_label
    clock.start_step(device)
    waits = [("comm", "all_reduce", "tp", None, "parallel.py:9 forward", "comm tp"),
             ("comm", "reduce_scatter", "dp", None, "parallelisms/zero.py:9 reduce_gradients", "comm dp"),
             ("bubble", "recv", "pp", 1, "parallelisms/pipeline.py:9 _post", "bubble pp recv"),
             ("comm", "send", "pp", 1, "parallelisms/pipeline.py:9 _post", "comm pp send"),
             ("comm", "all_reduce", "tp", None, "optim.py:9 trust_ratios", "comm optimizer"),
             ("comm", "all_reduce", "tp", None, "parallel.py:9 finish_gradients", "comm optimizer"),
             ("bubble", "all_reduce", "tp", None, "parallel.py:9 agree", "bubble agree")]
    for kind, op, group, peer, site, _ in waits:
        with clock.waiting(kind, device):
            _waited(recorder, op, group, peer, site)
    with clock.waiting("comm", device):  # a wait with no op of the log in it keeps the clock's kind
        time.sleep(0.001)
    _, figures = clock.end_step(device, lambda: None)
    labels = [s[1] for s in recorder.spans if s[0] == "wait"]
    assert labels == [w[-1] for w in waits] + ["comm"]
    assert all(0.015 < s[4] < 1.0 for s in recorder.spans if s[0] == "wait" and s[1] != "comm")
    assert figures["comm_s"] > 5 * 0.015 and figures["bubble_s"] > 2 * 0.015  # the clock's sums are as before
    # and per label: the dp group's own waits apart from TP's (stragglers.group_wait's link floor)
    assert set(figures["waits"]) == {w[-1] for w in waits} | {"comm"}
    assert 0.015 < figures["waits"]["comm dp"] < figures["comm_s"] - 0.015
    assert sum(figures["waits"].values()) == pytest.approx(figures["comm_s"] + figures["bubble_s"])


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_segment_times_the_work_inside_it_on_both_paths(recorder, device):
    if device == "cuda":
        spans.DEVICE = spans.DeviceSegments(StandInEvent)
    recorder.mark(3, "compute")
    outer = time.time()
    with spans.segment(spans.action_name(("B", 1, 2)), device):
        inner = time.perf_counter()
        time.sleep(0.03)
        inside = time.perf_counter() - inner
    outside = time.time() - outer
    recorder.mark(4, "data")  # the next step: the device's events are read after the step's host sync
    (segment,) = [s for s in recorder.spans if s[0] == "segment"]
    kind, name, step, start, seconds = segment
    assert (name, step) == ("backward c2 mb1", 3)
    assert inside <= seconds <= outside and outer - 0.01 <= start <= outer + outside
    with spans.segment("gc"):  # no device: the host's clock
        pass
    assert recorder.spans[-1][:3] == ["segment", "gc", 4]


def test_no_segment_is_kept_while_no_run_records():
    assert spans.SINK is None and spans.segment("gc", "cuda") is spans.NULL
