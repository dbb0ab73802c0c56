"""optim.py: LAMB against a formula-by-formula numpy reference, sharded LAMB on 2 and 4 gloo ranks
against single-process LAMB, the clamp and exclusion switches, AdamW's groups, the LR schedule."""
import io
import math
import sys
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import optim  # noqa: E402
from parallelisms import sharding  # noqa: E402
from model import GPT, ModelConfig  # noqa: E402

import forked  # noqa: E402


# --- LAMB, one tensor at a time, in float64 numpy ---

def numpy_lamb(p, grads, lr, beta1, beta2, eps, wd, trust, clamp=None):
    """Apply LAMB to one logical tensor p for each gradient in grads; return the final p."""
    p = p.astype(np.float64)
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        g = g.astype(np.float64)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        m_hat = m / (1 - beta1 ** t)
        v_hat = v / (1 - beta2 ** t)
        u = m_hat / (np.sqrt(v_hat) + eps) + wd * p
        p_norm = np.sqrt(np.sum(p * p))
        u_norm = np.sqrt(np.sum(u * u))
        r = 1.0
        if trust and p_norm > 0 and u_norm > 0:
            r = p_norm / u_norm
            if clamp is not None:
                r = min(max(r, clamp[0]), clamp[1])
        p = p - lr * r * u
    return p


@pytest.mark.parametrize("exclude, trust_bias, bias_wd, bias_trust", [
    (True, False, 0.0, False),   # default: the bias has neither weight decay nor a trust ratio
    (True, True, 0.0, True),     # NVLAMB-style: no weight decay, but the trust ratio
    (False, False, 0.1, True),   # no exclusion: the bias is treated like the weight
])
def test_lamb_two_tensors_match_numpy(exclude, trust_bias, bias_wd, bias_trust):
    rng = np.random.default_rng(0)
    w0 = rng.normal(size=(2, 3)).astype(np.float32)
    b0 = (0.1 * rng.normal(size=3)).astype(np.float32)
    w_grads = [rng.normal(size=(2, 3)).astype(np.float32) for _ in range(3)]
    b_grads = [rng.normal(size=3).astype(np.float32) for _ in range(3)]
    cfg = optim.OptimConfig(name="lamb", betas=[0.9, 0.99], eps=1e-6, weight_decay=0.1,
                            exclude_bias_and_norm=exclude, lamb_trust_bias_and_norm=trust_bias)
    w, b = nn.Parameter(torch.from_numpy(w0.copy())), nn.Parameter(torch.from_numpy(b0.copy()))
    opt = optim.build_optimizer([("fc.weight", w), ("fc.bias", b)], cfg, lr=0.1)
    assert isinstance(opt, optim.Lamb)
    for gw, gb in zip(w_grads, b_grads):
        w.grad, b.grad = torch.from_numpy(gw), torch.from_numpy(gb)
        opt.step()

    expect_w = numpy_lamb(w0, w_grads, 0.1, 0.9, 0.99, 1e-6, wd=0.1, trust=True)
    expect_b = numpy_lamb(b0, b_grads, 0.1, 0.9, 0.99, 1e-6, wd=bias_wd, trust=bias_trust)
    np.testing.assert_allclose(w.detach().numpy(), expect_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(b.detach().numpy(), expect_b, rtol=1e-5, atol=1e-6)
    # The reference is sensitive to the switches: the other treatment of the bias lands elsewhere.
    other = numpy_lamb(b0, b_grads, 0.1, 0.9, 0.99, 1e-6, wd=0.1 - bias_wd, trust=not bias_trust)
    assert np.abs(other - expect_b).max() > 1e-3


def test_lamb_first_step_by_hand():
    # Step 1: m̂ = g and v̂ = g², so u = g/(|g|+eps) + wd·p; with p = (3, 4) and g = (1, -1), wd = 0.5:
    # u = (1 + 1.5, -1 + 2) = (2.5, 1), ‖p‖ = 5, ‖u‖ = sqrt(7.25), r = 5/sqrt(7.25).
    p = nn.Parameter(torch.tensor([[3.0, 4.0]]))
    p.grad = torch.tensor([[1.0, -1.0]])
    optim.Lamb([p], lr=0.01, betas=(0.9, 0.999), eps=1e-12, weight_decay=0.5).step()
    r = 5 / math.sqrt(7.25)
    torch.testing.assert_close(p.detach(), torch.tensor([[3 - 0.01 * r * 2.5, 4 - 0.01 * r * 1.0]]))


@pytest.mark.parametrize("scale, clamp, expected_r", [
    (10.0, None, 10.0),          # ‖p‖ = 40, ‖u‖ = 4: r = 10
    (10.0, (0.01, 2.0), 2.0),    # clamped from above
    (1e-3, None, 1e-3),
    (1e-3, (0.01, 10.0), 0.01),  # clamped from below (DeepSpeed's bounds)
    (0.0, (0.01, 0.5), 1.0),     # ‖p‖ = 0: r = 1, and the fallback is not clamped
])
def test_trust_ratio_clamp(scale, clamp, expected_r):
    p = nn.Parameter(torch.full((4, 4), scale))
    p.grad = torch.ones(4, 4)  # step 1 with wd = 0: u = 1/(1+eps) everywhere, ‖u‖ ≈ 4
    optim.Lamb([p], lr=0.1, eps=1e-12, weight_decay=0.0, trust_clamp=clamp).step()
    torch.testing.assert_close(p.detach(), torch.full((4, 4), scale - 0.1 * expected_r), rtol=1e-6, atol=1e-7)


def test_zero_update_leaves_param_unchanged():
    p = nn.Parameter(torch.full((3,), 2.0))
    p.grad = torch.zeros(3)
    optim.Lamb([p], lr=0.1, weight_decay=0.0, trust_clamp=(0.01, 10.0)).step()
    assert torch.equal(p.detach(), torch.full((3,), 2.0))


def test_param_groups_of_the_model():
    model = GPT(ModelConfig(n_layers=2, d_model=32, n_heads=2, vocab_size=64))
    named = dict(model.named_parameters())
    groups = optim.param_groups(model.named_parameters(), optim.OptimConfig(name="lamb"))
    decay, no_decay = ({n for n, _ in g["params"]} for g in groups)
    assert decay == {n for n, p in named.items() if p.ndim == 2}
    assert decay >= {"embed.weight", "head.weight", "blocks.0.attn.qkv.weight", "blocks.1.mlp.fc_out.weight"}
    assert no_decay == {n for n, p in named.items() if n.endswith("bias") or ".ln_" in n or n.startswith("norm.")}
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert [g["trust_ratio"] for g in groups] == [True, False]
    # Classification is by name too, so a bias reshaped by sharding is still a bias.
    assert optim.is_bias_or_norm("blocks.0.attn.qkv.bias", torch.zeros(4, 4))
    assert not optim.is_bias_or_norm("blocks.0.attn.qkv.weight", torch.zeros(4, 4))
    one = optim.param_groups(model.named_parameters(), optim.OptimConfig(exclude_bias_and_norm=False))
    assert len(one) == 1 and len(one[0]["params"]) == len(named) and one[0]["weight_decay"] == 0.1


def test_adamw_decays_only_weights():
    model = GPT(ModelConfig(n_layers=1, d_model=32, n_heads=2, vocab_size=64))
    opt = optim.build_optimizer(model.named_parameters(), optim.OptimConfig(), lr=0.1)
    assert type(opt) is torch.optim.AdamW and opt.defaults["fused"]
    assert "blocks.0.mlp.fc_in.bias" in opt.param_groups[1]["param_names"]  # names reach the state_dict
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # zero grads: Adam's step is 0, only decoupled decay p ← p·(1 - lr·wd) remains
    for n, p in model.named_parameters():
        factor = 1.0 if (n.endswith("bias") or ".ln_" in n or n.startswith("norm.")) else 1 - 0.1 * 0.1
        torch.testing.assert_close(p.detach(), before[n] * factor, rtol=1e-6, atol=0)


def test_lr_lambda_shape():
    f = lambda s: optim.lr_lambda(s, warmup_steps=10, max_steps=110, min_lr_ratio=0.1)  # noqa: E731
    assert f(0) == pytest.approx(0.1)          # the first step already moves the weights
    assert f(9) == pytest.approx(1.0)          # end of warm-up
    assert f(10) == pytest.approx(1.0)         # cosine starts at the peak
    assert f(60) == pytest.approx(0.55)        # cosine midpoint: (1 + min) / 2
    assert f(110) == pytest.approx(0.1)        # min_lr_ratio at max_steps
    assert f(500) == pytest.approx(0.1)
    decay = [f(s) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(decay, decay[1:]))
    assert optim.lr_lambda(0, 0, 100, 0.0) == 1.0 and optim.lr_lambda(100, 0, 100, 0.0) == 0.0


def test_scheduler_follows_lambda_and_resumes():
    cfg = optim.OptimConfig(warmup_steps=4, min_lr_ratio=0.2)

    def build():
        p = nn.Parameter(torch.zeros(2))
        opt = optim.build_optimizer([("w", torch.nn.Parameter(torch.zeros(2, 2))), ("b", p)], cfg, lr=1e-3)
        return opt, optim.build_scheduler(opt, cfg, max_steps=20)

    opt, sched = build()
    for _ in range(7):
        opt.step()
        sched.step()
    assert sched.get_last_lr() == pytest.approx([1e-3 * optim.lr_lambda(7, 4, 20, 0.2)] * 2)
    buf = io.BytesIO()
    torch.save(sched.state_dict(), buf)
    opt2, sched2 = build()
    sched2.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    opt.step(), sched.step(), opt2.step(), sched2.step()
    assert sched2.get_last_lr() == sched.get_last_lr()
    assert [g["lr"] for g in opt2.param_groups] == [g["lr"] for g in opt.param_groups]


def test_lamb_state_dict_resume_is_exact():
    torch.manual_seed(0)
    grads = [(torch.randn(3, 4), torch.randn(4)) for _ in range(5)]
    cfg = optim.OptimConfig(name="lamb", trust_clamp=[0.01, 10.0])

    def build(w0, b0):
        w, b = nn.Parameter(w0.clone()), nn.Parameter(b0.clone())
        return w, b, optim.build_optimizer([("w", w), ("b", b)], cfg, lr=0.01)

    w0, b0 = torch.randn(3, 4), torch.randn(4)
    w, b, opt = build(w0, b0)
    for i, (gw, gb) in enumerate(grads):
        w.grad, b.grad = gw, gb
        opt.step()
        if i == 2:
            buf = io.BytesIO()
            torch.save({"w": w.detach().clone(), "b": b.detach().clone(), "opt": opt.state_dict()}, buf)
    saved = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    w2, b2, opt2 = build(saved["w"], saved["b"])
    opt2.load_state_dict(saved["opt"])
    for gw, gb in grads[3:]:
        w2.grad, b2.grad = gw, gb
        opt2.step()
    assert torch.equal(w2, w) and torch.equal(b2, b)


@pytest.mark.parametrize("field, value", [("name", "sgd"), ("betas", [0.9]), ("trust_clamp", [2.0, 1.0]),
                                          ("min_lr_ratio", 1.5), ("eps", 0.0)])
def test_check_config_rejects(field, value):
    from config import ConfigError  # optim.check_config raises the config module's error
    cfg = optim.OptimConfig(**{field: value})
    with pytest.raises(ConfigError, match=f"optim.{field}"):
        optim.check_config(cfg)
    optim.check_config(optim.OptimConfig(name="lamb", trust_clamp=[0.01, 10.0]))


# --- Sharded LAMB: pieces of logical tensors on 2 and 4 gloo ranks vs. one process ---

STEPS = 4
LR, BETAS, EPS = 0.05, (0.9, 0.99), 1e-6
GROUPS = [  # (tensor names, group options)
    (["w_pad", "w_tp", "w_rep", "w_skip", "w_partial"], dict(weight_decay=0.1, trust_ratio=True)),
    (["ln", "b_pad"], dict(weight_decay=0.0, trust_ratio=True, trust_clamp=(0.5, 2.0))),
    (["b_some"], dict(weight_decay=0.0, trust_ratio=False)),
]
ZERO_SHARDED = ("w_pad", "w_skip", "b_pad")  # dim-0 shards over all ranks, zero padded


def full_tensors() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"w_pad": torch.randn(7, 5, generator=g), "w_tp": torch.randn(8, 6, generator=g),
            "w_rep": torch.randn(4, 4, generator=g), "w_skip": torch.randn(3, 4, generator=g),
            "ln": 1 + 0.1 * torch.randn(6, generator=g), "b_pad": 0.1 * torch.randn(5, generator=g),
            "b_some": 0.1 * torch.randn(3, generator=g), "w_partial": torch.randn(6, 4, generator=g)}


def full_grads(step: int, full: dict) -> dict:
    """The same on every rank. None marks a tensor without a grad at this step."""
    g = torch.Generator().manual_seed(100 + step)
    grads = {n: torch.randn(t.shape, generator=g) * (1 + i) for i, (n, t) in enumerate(full.items())}
    if step == 1:
        grads["w_skip"] = None
    if step % 2 == 0:
        grads["b_some"] = None
    return grads


def piece(name: str, t: torch.Tensor, rank: int, world: int) -> tuple[torch.Tensor, bool]:
    """This rank's piece of the logical tensor t, and whether it owns the piece's norm."""
    if name in ZERO_SHARDED:
        rows = -(-t.shape[0] // world)
        padded = torch.zeros((rows * world,) + t.shape[1:])
        padded[:t.shape[0]] = t
        return padded[rank * rows:(rank + 1) * rows].clone(), True
    if name == "w_tp":  # mesh dp × tp with tp = 2: column shards over tp, replicated over dp
        return t.chunk(2, dim=1)[rank % 2].clone(), rank // 2 == 0
    if name == "w_partial":
        # Replication that is the same for every element cancels in ‖p‖/‖u‖, so only an uneven one
        # shows that non-owned pieces are left out: rank 0 owns it all, rank r > 0 copies r rows.
        return (t.clone(), True) if rank == 0 else (t[:rank].clone(), False)
    return t.clone(), rank == 0  # replicated on every rank, owned by rank 0


def sharded_worker(rank: int, world: int, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    full = full_tensors()
    params = {}
    for name, t in full.items():
        data, owner = piece(name, t, rank, world)
        params[name] = nn.Parameter(data)
        if not owner:  # owners get no ShardInfo: the default must count
            sharding.set_shard_info(params[name], sharding.ShardInfo(norm_owner=False))
    opt = optim.Lamb([dict(params=[params[n] for n in names], **o) for names, o in GROUPS],
                     lr=LR, betas=BETAS, eps=EPS, norm_group=dist.group.WORLD)
    real, calls = dist.all_reduce, []

    def counting_all_reduce(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counting_all_reduce
    per_step = []
    try:
        for step in range(STEPS):
            grads = full_grads(step, full)
            for name, p in params.items():
                p.grad = None if grads[name] is None else piece(name, grads[name], rank, world)[0]
            before = len(calls)
            opt.step()
            per_step.append(len(calls) - before)
        grads = full_grads(STEPS, full)
        for name, p in params.items():
            p.grad = None if grads[name] is None else piece(name, grads[name], rank, world)[0]
        grad_norm = optim.clip_grad_norm_(params.values(), 1.0, norm_group=dist.group.WORLD)
    finally:
        dist.all_reduce = real
    torch.save({"params": {n: p.detach() for n, p in params.items()},
                "grads": {n: p.grad for n, p in params.items()},
                "per_step": per_step, "reduced_numel": calls[:STEPS], "grad_norm": grad_norm},
               f"{tmp}/rank{rank}.pt")
    dist.destroy_process_group()


def reassemble(name: str, pieces: list, shape) -> torch.Tensor:
    world = len(pieces)
    if name in ZERO_SHARDED:
        whole = torch.cat(pieces, dim=0)
        assert torch.all(whole[shape[0]:] == 0), f"{name}: zero padding moved"
        return whole[:shape[0]]
    if name == "w_partial":
        for r in range(1, world):
            assert torch.equal(pieces[r], pieces[0][:r])
        return pieces[0]
    if name == "w_tp":
        for r in range(2, world):  # dp replicas stay identical to their owner
            assert torch.equal(pieces[r], pieces[r % 2])
        return torch.cat(pieces[:2], dim=1)
    for p in pieces[1:]:
        assert torch.equal(p, pieces[0]), f"{name}: replicas diverged"
    return pieces[0]


def reference_run(full: dict, lamb_groups=GROUPS):
    params = {n: nn.Parameter(t.clone()) for n, t in full.items()}
    opt = optim.Lamb([dict(params=[params[n] for n in names], **o) for names, o in lamb_groups],
                     lr=LR, betas=BETAS, eps=EPS)
    for step in range(STEPS):
        for name, g in full_grads(step, full).items():
            params[name].grad = g
        opt.step()
    return params


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_lamb_matches_single_process(world, tmp_path):
    forked.context()  # ranks forked from the preloaded server (tests/forked.py), not fresh interpreters
    mp.start_processes(sharded_worker, args=(world, str(tmp_path)), nprocs=world, start_method="forkserver")
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(world)]
    full = full_tensors()
    expected = reference_run(full)
    for name, t in full.items():
        got = reassemble(name, [res["params"][name] for res in results], t.shape)
        torch.testing.assert_close(got, expected[name].detach(), rtol=1e-6, atol=1e-6, msg=name)

    # One all_reduce per step, of the [2, n_tensors in trust-ratio groups] vector.
    n_trust = sum(len(names) for names, o in GROUPS if o["trust_ratio"])
    for res in results:
        assert res["per_step"] == [1] * STEPS
        assert res["reduced_numel"] == [2 * n_trust] * STEPS

    # The test can tell: norms of the local pieces alone (what DeepSpeed's LAMB does under ZeRO)
    # move rank 0's shard of w_pad elsewhere.
    local = reference_run({n: piece(n, t, 0, world)[0] for n, t in full.items()})
    rows = local["w_pad"].shape[0]
    assert (local["w_pad"].detach() - expected["w_pad"].detach()[:rows]).abs().max() > 1e-4

    # Owner-aware gradient clipping equals torch's on the whole tensors.
    grads = {n: g.clone() for n, g in full_grads(STEPS, full).items() if g is not None}
    whole = [nn.Parameter(torch.zeros_like(g)) for g in grads.values()]
    for p, g in zip(whole, grads.values()):
        p.grad = g
    expect_norm = torch.nn.utils.clip_grad_norm_(whole, 1.0)
    assert expect_norm > 1.0  # so clipping really scaled
    for res in results:
        torch.testing.assert_close(res["grad_norm"], expect_norm, rtol=1e-6, atol=0)
    for (name, t), p in zip(grads.items(), whole):
        got = reassemble(name, [res["grads"][name] for res in results], t.shape)
        torch.testing.assert_close(got, p.grad, rtol=1e-6, atol=1e-7, msg=name)
