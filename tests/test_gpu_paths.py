"""The CUDA and SLURM-on-GPU paths, checked on CPU where their logic does not need a GPU: the
wait clock's event path (through a stand-in event), the device a SLURM task picks, the first host
of a hostlist without scontrol, and the RNG state of the run's own GPU."""
import contextlib
import time

import pytest
import torch

import checkpoint
import launch
from parallelisms.overlap import WaitClock


class StandInEvent:
    """torch.cuda.Event's interface on the host clock: record() stamps, elapsed_time() in ms."""
    created = 0

    def __init__(self, enable_timing=False):
        assert enable_timing
        StandInEvent.created += 1
        self.stamp = None

    def record(self, stream=None):
        self.stamp = time.perf_counter()

    def synchronize(self):
        assert self.stamp is not None, "synchronize on an event that was never recorded"

    def elapsed_time(self, end) -> float:
        return (end.stamp - self.stamp) * 1e3


def one_step(clock, device, read=lambda: "loss", spans=None):
    """A step of 40 ms of communication, 30 ms of compute and a 20 ms bubble. `spans` collects each
    phase's duration as the test measures it: (inside, outside) the clock's wait, since a loaded
    machine oversleeps by tens of ms and only these bounds hold whatever the load."""
    spans = {} if spans is None else spans

    def timed(kind, seconds):
        outer = time.perf_counter()
        context = clock.waiting(kind, device) if kind != "compute" else contextlib.nullcontext()
        with context:
            inner = time.perf_counter()
            time.sleep(seconds)
            inside = time.perf_counter() - inner
        spans[kind] = (inside, time.perf_counter() - outer)

    start = time.perf_counter()
    clock.start_step(device)
    timed("comm", 0.04)
    timed("compute", 0.03)
    timed("bubble", 0.02)
    result = clock.end_step(device, read)
    spans["step"] = time.perf_counter() - start
    return result


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_clock_means_the_same_on_both_paths(device):
    clock = WaitClock(events=StandInEvent if device == "cuda" else None)
    spans = {}
    value, figures = one_step(clock, device, spans=spans)
    assert value == "loss"
    for kind in ("comm", "bubble"):  # the clock's wait lies between the sleep and the whole with-block
        inside, outside = spans[kind]
        assert inside <= figures[f"{kind}_s"] <= outside, (kind, spans, figures)
    waits_inside = spans["comm"][0] + spans["bubble"][0]
    assert spans["compute"][0] <= figures["compute_s"] <= spans["step"] - waits_inside, (spans, figures)
    assert figures["step_s"] >= figures["comm_s"] + figures["bubble_s"] + figures["compute_s"] - 1e-6
    assert figures["step_s"] <= spans["step"]


def test_the_event_path_reuses_its_events_and_reads_after_the_host_sync():
    StandInEvent.created = 0
    clock = WaitClock(events=StandInEvent)
    one_step(clock, "cuda")
    first = StandInEvent.created
    for _ in range(3):
        one_step(clock, "cuda")
    assert first == 6 and StandInEvent.created == first  # start, end and a pair per wait, pooled
    order = []
    clock.start_step("cuda")
    clock.end_step("cuda", lambda: order.append(clock._pool[1].stamp is not None))
    assert order == [True]  # the end event is recorded before the host waits for the stream


def test_a_slurm_task_that_sees_one_gpu_uses_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("SLURM_LOCALID", "5")
    assert launch.pick_device("cuda") == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert launch.pick_device("cuda") == torch.device("cuda", 5)


@pytest.mark.parametrize("nodelist,first", [
    ("gpu[001-032]", "gpu001"), ("gpu[001,003]", "gpu001"), ("gpu[003,007],cpu1", "gpu003"),
    ("node7", "node7"), ("a1,b2", "a1"), ("rack[2-3]-n[08-09,11]", "rack2-n08"), ("h[10-11]x", "h10x")])
def test_first_host_of_a_hostlist_without_scontrol(nodelist, first):
    assert launch.first_host(nodelist) == first


def test_rng_state_keeps_only_the_run_device(monkeypatch):
    asked, restored = [], []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: asked.append(device) or torch.zeros(4, dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: restored.append(device))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: pytest.fail("saved every visible GPU"))
    state = checkpoint.rng_state(torch.device("cuda", 3))
    assert asked == [torch.device("cuda", 3)] and torch.is_tensor(state["cuda"])
    checkpoint.set_rng_state(state, torch.device("cuda", 0))  # a restart that sees one GPU
    assert restored == [torch.device("cuda", 0)]
    assert "cuda" not in checkpoint.rng_state(torch.device("cpu"))
