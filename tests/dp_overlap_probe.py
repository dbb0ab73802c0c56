"""Run under torchrun with 2 ranks: ZeRO-2 with DP overlap for 3 steps on random tokens, checking
at every module's forward that its parameters are this step's, i.e. equal to an independent
all-gather of the pieces the optimizer just updated (Megatron-LM #950: a bucket waited for at
the wrong module lets a layer compute with last step's weights).

    torchrun --nproc_per_node 2 tests/dp_overlap_probe.py [correct|split|misordered]

Prints one JSON line on rank 0: the largest stale difference seen (infinite where a module ran
before its bucket's gather was waited for: the gather writes the parameters in place, so what it
reads then is a race), how many parameters were
checked, how far the weights moved over the run (so a zero difference is not vacuous), and the
error that stopped the run, if any.
"split" makes buckets smaller than a block, so each block waits for several.
"misordered" shifts every bucket's wait one module later, the #950 bug, to show the check sees it.
"""
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import optim  # noqa: E402
import launch  # noqa: E402
import parallel  # noqa: E402
from model import GPT, ModelConfig  # noqa: E402
from optim import OptimConfig  # noqa: E402


def misordered(build):
    """Each module's wait registered at the next module (the last keeps its own)."""
    def shifted(self, params):
        modules = build(self, params)
        hooks = [m[1] for m in modules[1:]] + [modules[-1][1]]
        return [(m[0], hook, *m[2:]) for m, hook in zip(modules, hooks)]
    return shifted


def main(mode: str) -> None:
    if mode == "misordered":
        parallel.ParallelModel._forward_modules = misordered(parallel.ParallelModel._forward_modules)
    rank, world = launch.init_distributed(torch.device("cpu"), "gloo")
    cfg = parallel.ParallelConfig(zero_stage=2)
    cfg.overlap.dp = True
    if mode == "split":  # buckets smaller than a block: each block's forward waits for several
        cfg.bucket_size = 5000
    layout = parallel.build_layout(cfg, rank, world, torch.device("cpu"))
    model = GPT(ModelConfig(n_layers=3, d_model=64, n_heads=4, vocab_size=128))
    model.init_weights(0)
    engine = parallel.build(model, layout, cfg)
    optimizer = optim.build_optimizer(engine.named_optimizer_parameters(), OptimConfig(), 1e-2, norm_group=engine.norm_group)
    zero = engine.zero
    worst, checked, unwaited = [0.0], [0], [0]

    def check(module, *_):
        for p in module.parameters(recurse=True):
            i = next(i for i, q in enumerate(zero.params) if q is p)
            b, k = zero.where[i]
            bucket = zero.buckets[b]
            if b not in zero.current:  # computing before its gather was waited for: stale by
                unwaited[0] += 1        # definition, whether or not the bytes happen to be there
                continue
            table = torch.empty(world * bucket.shard_numel)
            dist.all_gather_single(table, bucket.master.detach().clone())
            want = table[bucket.offsets[k]:bucket.offsets[k] + p.numel()].view_as(p)
            worst[0] = max(worst[0], (p.detach() - want).abs().max().item())
            checked[0] += 1

    chunk = engine.chunks[0]
    modules = [chunk.embed, *chunk.blocks.values()]
    for m in modules:  # registered after ParallelModel's hooks, so each check runs after the wait
        m.register_forward_pre_hook(check)

    def check_tail(*_):  # the final norm runs as a function (no hook): check it and the head before it
        check(chunk.norm)
        check(chunk.head)
    list(chunk.blocks.values())[-1].register_forward_hook(check_tail)

    start = {n: p.detach().clone() for n, p in engine.named_model_parameters()}
    g = torch.Generator().manual_seed(rank)
    error = None
    try:
        for _ in range(3):
            tokens = torch.randint(0, 128, (4, 33), generator=g)
            engine.forward_backward(tokens[:, :-1], tokens[:, 1:], torch.float32)
            engine.finish_gradients(1.0)
            engine.optimizer_step(optimizer)
        engine.forward_backward(tokens[:, :-1], tokens[:, 1:], torch.float32, backward=False)  # step 3's weights
    except RuntimeError as err:  # a late wait overwrites weights autograd saved: torch may catch it too
        error = str(err).splitlines()[0]
    moved = max((p.detach() - start[n]).abs().max().item() for n, p in engine.named_model_parameters())
    if rank == 0:
        stale = float("inf") if unwaited[0] else worst[0]
        print(json.dumps({"mode": mode, "stale": stale, "checked": checked[0], "moved": moved, "error": error}),
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "correct")
