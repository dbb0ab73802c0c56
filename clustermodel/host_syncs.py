"""Host-to-device copies that stall a step, found without a GPU (the rehearsal's recorder installs
this rule beside its host-read rule, recorder.Recorder).

A copy from host memory to a CUDA device waits for the host unless the source is pinned and the
copy is asked non_blocking: torch copies a pageable source through a staging buffer and, without
non_blocking, synchronises the stream (c10's memcpy_and_sync, which
torch.cuda.set_sync_debug_mode("error") turns into an error). torch.tensor(list, device=cuda) is
such a copy, and so is batch.to(cuda) from a tensor made by numpy. Inside a step each one is a
host sync beyond the step's one read.

The rule names every copy to the recorded device (meta stands in for CUDA) from a CPU tensor that
is not pinned, from Python or numpy data (torch.tensor, torch.as_tensor), or without non_blocking,
with its call site, from the second step on: a tensor made once and kept (a cache filled in the
first step, such as the RoPE tables) is no per-step sync.
"""
from __future__ import annotations

import torch

FACTORIES = ("tensor", "as_tensor")             # torch.<name>(data, ..., device=...)
COPIES = ("to", "cuda", "copy_")                # torch.Tensor.<name>


def steady(step) -> bool:
    """Whether the recorder's step is one the rule applies to: a training step after the first,
    or the evaluation pass (0 is the build, before any step)."""
    return step not in (0, 1)


def _device(value) -> torch.device:
    return torch.get_default_device() if value is None else torch.device(value)


def _problem(source, target: torch.device, non_blocking: bool, device: torch.device) -> str:
    """What is wrong with copying `source` to `target`, or "" when nothing is."""
    if target.type != device.type or device.type == "cpu":
        return ""
    if not isinstance(source, torch.Tensor):
        return "from host data (a Python list or numpy array is pageable memory)"
    if source.device.type != "cpu":
        return ""
    if not source.is_pinned():
        return "from pageable memory"
    return "" if non_blocking else "without non_blocking"


def install(recorder, saved: dict, site) -> None:
    """Puts the rule in front of torch's copies while `recorder` records, keeping the originals in
    `saved` as "Tensor.<name>" and "torch.<name>" (the recorder puts them back on exit)."""
    for name in COPIES:
        saved[f"Tensor.{name}"] = getattr(torch.Tensor, name)
        setattr(torch.Tensor, name, copy(recorder, name, saved[f"Tensor.{name}"], site))
    for name in FACTORIES:
        saved[f"torch.{name}"] = getattr(torch, name)
        setattr(torch, name, factory(recorder, name, saved[f"torch.{name}"], site))


def factory(recorder, name: str, original, site):
    """torch.tensor / torch.as_tensor with the rule in front; site() names the caller's line."""
    def make(data, *args, **kwargs):
        target = kwargs.get("device", args[1] if name == "as_tensor" and len(args) > 1 else None)
        _check(recorder, name, data, _device(target), False, site)
        return original(data, *args, **kwargs)
    return make


def copy(recorder, name: str, original, site):
    """Tensor.to / Tensor.cuda / Tensor.copy_ with the rule in front; site() names the caller's line."""
    def call(self, *args, **kwargs):
        if name == "to":
            target, _, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
            if target is not None:
                _check(recorder, name, self, target, non_blocking, site)
        elif name == "cuda":
            _check(recorder, name, self, torch.device("cuda"), kwargs.get("non_blocking", args[1] if len(args) > 1 else False),
                   site)
        else:
            _check(recorder, name, args[0], self.device, kwargs.get("non_blocking", args[1] if len(args) > 1 else False),
                   site)
        return original(self, *args, **kwargs)
    return call


def _check(recorder, name: str, source, target: torch.device, non_blocking: bool, site) -> None:
    if not steady(recorder.step):
        return
    problem = _problem(source, target, bool(non_blocking), recorder.device)
    if problem:
        recorder.violations.append(f"host-to-device copy ({name}) {problem} at {site()}: a host sync inside a "
                                   f"step (pin the source and copy non_blocking, or make the tensor once)")
