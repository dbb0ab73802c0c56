"""A few training steps' host-side pieces on a GPU under torch.cuda.set_sync_debug_mode("error"):
LAMB's update (trust ratios over two parameter groups), gradient clipping, the loader's batch
copied to the device, and agree's loss-and-stop vector. Any copy or read that waits for the GPU
raises. The first step runs outside the mode: it makes LAMB's state and its kept index tensors.

    python experiments/host_sync_check.py            # on a CUDA host (experiments/gpu_check.sh)
    python experiments/host_sync_check.py --device cpu   # the same steps without the check

The rehearsal finds the same defects without a GPU (clustermodel/host_syncs.py); this confirms them on one.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import optim  # noqa: E402
import parallel  # noqa: E402
import sampling  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    device = torch.device(args.device)
    on_cuda = device.type == "cuda"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 256), nn.LayerNorm(256), nn.GELU(), nn.Linear(256, 64)).to(device)
    cfg = optim.OptimConfig(name="lamb", betas=[0.9, 0.999], eps=1e-6, weight_decay=0.01, trust_clamp=[0.01, 10.0])
    optimizer = optim.build_optimizer(model.named_parameters(), cfg, lr=1e-3)
    rows = np.random.default_rng(0).integers(0, 64, size=(8, 17))
    layout = SimpleNamespace(world=1, dp=1, tp=1)
    for step in range(1, args.steps + 1):
        checked = on_cuda and step > 1
        if checked:
            torch.cuda.set_sync_debug_mode("error")
        try:
            stream = sampling._rows_to_stream(rows, torch.uint16, pin_memory=on_cuda)  # the loader's batch (pinned on CUDA)
            inputs, _ = sampling.to_device(stream, device)
            # token ids as features: no embedding, whose CUDA backward reads a count back (a sync of torch's own)
            x = inputs.float() / 64
            loss = model(x).square().mean()
            loss.backward()
            norm = optim.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            agreed = parallel.agree(loss.detach(), False, layout, norm)
        finally:
            if checked:
                torch.cuda.set_sync_debug_mode("default")
        loss_value, stop, grad_norm = parallel.read_agreed(agreed, layout)  # the step's one host read
        print(f"step {step}: loss {loss_value:.4f} grad norm {grad_norm:.4f} stop {stop}"
              f"{' (sync debug mode: error)' if checked else ''}")
    print(f"host_sync_check: {args.steps - 1 if on_cuda else 0} step(s) ran with no host sync "
          f"{'(checked)' if on_cuda else '(not checked: no CUDA device)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
