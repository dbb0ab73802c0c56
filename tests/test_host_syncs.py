"""The rehearsal's host-to-device copy rule (clustermodel/host_syncs.py): a copy to the device from pageable
memory, or without non_blocking, inside a step is named with its call site; LAMB's trust-ratio
indices and agree's stop flag, once built from host lists every step, are caught when put back."""
from types import SimpleNamespace

import torch

import optim
import parallel
from clustermodel import host_syncs
from clustermodel.recorder import _site
from test_rehearsal import TINY_3D, rehearse_here, violations


def copies(found: list) -> list:
    return [v for v in found if v.startswith("host-to-device copy")]


def recorder(step=2):
    return SimpleNamespace(step=step, device=torch.device("meta"), violations=[])


def test_the_rule_names_pageable_and_blocking_copies_to_the_device_from_the_second_step(monkeypatch):
    rec = recorder()
    monkeypatch.setattr(torch.Tensor, "to", host_syncs.copy(rec, "to", torch.Tensor.to, _site))
    monkeypatch.setattr(torch.Tensor, "copy_", host_syncs.copy(rec, "copy_", torch.Tensor.copy_, _site))
    monkeypatch.setattr(torch, "tensor", host_syncs.factory(rec, "tensor", torch.tensor, _site))
    batch = torch.zeros(2, 8, dtype=torch.long)
    on_device = batch.to("meta")                        # the loader's old copy: pageable, blocking
    batch.to("meta", non_blocking=True)                 # non_blocking from pageable memory still waits
    torch.empty(2, 8, dtype=torch.long, device="meta").copy_(batch)
    torch.tensor([0, 1, 2], device="meta")              # a host list
    assert [v.split(" at ")[0] for v in rec.violations] == [
        "host-to-device copy (to) from pageable memory", "host-to-device copy (to) from pageable memory",
        "host-to-device copy (copy_) from pageable memory", "host-to-device copy (tensor) from host data "
        "(a Python list or numpy array is pageable memory)"]
    assert all("test_host_syncs.py" in v for v in rec.violations), rec.violations
    rec.violations.clear()
    on_device.to(torch.int32), on_device.to("meta"), batch.to(torch.int32), torch.tensor([1.0])  # no host-to-device copy
    rec.step = 1                                        # the first step may fill a cache
    batch.to("meta"), torch.tensor([0, 1], device="meta")
    assert rec.violations == []


def test_lamb_and_agree_copy_nothing_from_the_host_inside_a_step(tmp_path):
    found = violations(rehearse_here(TINY_3D + ["optim=lamb"], [0, 7], tmp_path))
    assert copies(found) == [], found


def test_lambs_trust_ratio_indices_from_host_lists_every_step_are_named(monkeypatch, tmp_path):
    """LAMB's old trust ratio: index, owner and slot tensors built with torch.tensor(list, device=...) every step."""
    monkeypatch.setattr(optim.Lamb, "_on_device", lambda self, values, device: torch.tensor(values, device=device))
    found = copies(violations(rehearse_here(TINY_3D + ["optim=lamb"], [0], tmp_path)))
    assert found and all(v.startswith("host-to-device copy (tensor) from host data") for v in found), found


def test_agrees_stop_flag_copied_from_the_host_is_named(monkeypatch, tmp_path):
    agree = parallel.agree

    def old_agree(loss, stop, layout, grad_norm=None):
        torch.tensor(float(stop), device=loss.device)   # the flag as agree once built it
        return agree(loss, stop, layout, grad_norm)
    monkeypatch.setattr(parallel, "agree", old_agree)
    found = copies(violations(rehearse_here(TINY_3D, [7], tmp_path)))
    assert any("test_host_syncs.py" in v and "old_agree" in v for v in found), found
