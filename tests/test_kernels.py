"""Every fast path of kernels.py against its reference: outputs and gradients.

Attention backends are compared with kernels.attention_reference (itself checked against a
per-token loop in test_model.py). Fused operators (kernels.fused=true: what inductor makes of them
inside a compiled step, so compiled here) are compared with their eager versions. Compiling is what
costs here, so the fused tests use one small shape per dtype.
"""
import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels
import kernels_triton
from model import rope_tables

BLOCK = 16                      # small blocks, so short sequences still have head, middle and tail
T_ODD, T_EVEN = 77, 64          # 77: a last partial block; 64: whole blocks only
WINDOWS = [1, BLOCK - 1, BLOCK, BLOCK + 1, 40, T_ODD, None]
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


HEADS = [(3, 3), (6, 2)]         # (query heads, KV heads): multi-head, and GQA with groups of 3


def qkv(T, dtype, seed=0, heads=(3, 3)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, h, T, 16, generator=g).to(dtype).requires_grad_() for h in (heads[0], heads[1], heads[1])]


def out_and_grads(fn, q, k, v, grad_out):
    out = fn(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), grad_out))


# --- Attention ---

@pytest.mark.parametrize("T", [T_ODD, T_EVEN])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("impl", ["banded", "sdpa", "unfused", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", HEADS)
def test_attention_backend_equals_reference(impl, window, T, dtype, heads):
    q, k, v = qkv(T, dtype, heads=heads)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    # The oracle sees the same (rounded) inputs, in fp32: the error left is the backend's own. With
    # GQA it repeats each KV head for its group (test_gqa_reference_is_each_group_on_its_kv_head).
    ref_inputs = [t.detach().float().requires_grad_() for t in (q, k, v)]
    expected = out_and_grads(lambda a, b, c: kernels.attention_reference(a, b, c, window), *ref_inputs,
                             grad_out.float())
    got = out_and_grads(lambda a, b, c: kernels.attention(a, b, c, window, impl=impl, block=BLOCK), q, k, v,
                        grad_out)
    for name, g, e in zip(("out", "dq", "dk", "dv"), got, expected):
        assert g.dtype == dtype, name
        torch.testing.assert_close(g.float(), e, **TOL[dtype], msg=lambda m: f"{name}: {m}")


def test_gqa_reference_is_each_group_on_its_kv_head():
    """Query head h attends KV head h // (H/H_kv): the oracle with GQA equals multi-head attention
    with each KV head copied for its group."""
    q, k, v = (t.detach() for t in qkv(T_ODD, torch.float32, heads=(6, 2)))
    want = torch.cat([kernels.attention_reference(q[:, 3 * g:3 * g + 3], k[:, g:g + 1].expand(-1, 3, -1, -1),
                                                  v[:, g:g + 1].expand(-1, 3, -1, -1), 40) for g in range(2)], dim=1)
    torch.testing.assert_close(kernels.attention_reference(q, k, v, 40), want)


DROPOUT_IMPLS = ["banded", "sdpa", "unfused", "reference"]


def seeded(fn, seed=0):
    """fn with the global generator reset before every call, so each call draws the same mask."""
    def call(*args):
        torch.manual_seed(seed)
        return fn(*args)
    return call


@pytest.mark.parametrize("impl", DROPOUT_IMPLS)
def test_attention_dropout_is_unbiased(impl):
    """Dropout on the probabilities, rescaled by 1/(1-p), leaves the output's expectation alone:
    the mean over many masks tends to the output without dropout. (Backends draw different
    masks, so they are compared with the reference in expectation, not value by value.)"""
    q, k, v = (t.detach() for t in qkv(T_EVEN, torch.float32))
    exact = kernels.attention_reference(q, k, v, 40)
    torch.manual_seed(0)
    draws = torch.stack([kernels.attention(q, k, v, 40, impl=impl, block=BLOCK, dropout=0.3) for _ in range(400)])
    assert not torch.allclose(draws[0], exact, atol=1e-3)   # it does drop
    error = (draws.mean(0) - exact).norm() / exact.norm()
    assert error < 0.05, error                               # 1/sqrt(400) of one draw's spread, about 0.02


@pytest.mark.parametrize("impl", ["banded", "sdpa"])
def test_attention_dropout_backward_uses_the_forward_mask(impl):
    """The gradient of one seeded draw is the derivative of that draw (gradcheck, float64): the
    backward replays the forward's mask, in SDPA and in every piece of banded's split. (unfused
    computes its softmax in fp32, too coarse for finite differences; the next test checks its
    gradients against the reference's, which are torch's own dropout backward.)"""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    fn = seeded(lambda a, b, c: kernels.attention(a, b, c, 12, impl=impl, block=BLOCK, dropout=0.2))
    # fast mode: u·J·v for random u, v against finite differences, not J entry by entry (~4k forwards, 25 s)
    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-5, fast_mode=True)


def test_unfused_dropout_draws_the_references_mask():
    """Megatron's core attention drops the materialized probabilities exactly as the oracle does
    (same shape, dtype and generator in fp32), so with one seed they agree value for value."""
    q, k, v = qkv(T_ODD, torch.float32)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    ref = out_and_grads(seeded(lambda a, b, c: kernels.attention_reference(a, b, c, 40, dropout=0.25)), q, k, v, grad_out)
    got = out_and_grads(seeded(lambda a, b, c: kernels.attention(a, b, c, 40, impl="unfused", dropout=0.25)), q, k, v, grad_out)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        torch.testing.assert_close(a, b, **TOL[torch.float32], msg=lambda m: f"{name}: {m}")


def test_banded_computes_only_the_band(monkeypatch):
    """The work bound, counted rather than timed: the scores banded asks SDPA for stay within
    T·(W + block) (plus the first blocks' small square), not T², and only the calls whose
    blocks stick out of the window carry a mask."""
    calls = []
    real_sdpa = F.scaled_dot_product_attention

    def counting_sdpa(q, k, v, attn_mask=None, is_causal=False, **kw):
        calls.append((q.shape[:-1].numel() * k.shape[-2], attn_mask is not None, is_causal))
        return real_sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)

    monkeypatch.setattr(kernels.F, "scaled_dot_product_attention", counting_sdpa)
    B, H, T, W, block = 1, 2, 1024, 64, 32
    for kv_heads in (H, 1):  # multi-head, and GQA's groups stacked into the one middle call
        calls.clear()
        q, k, v = torch.randn(B, H, T, 8), torch.randn(B, kv_heads, T, 8), torch.randn(B, kv_heads, T, 8)
        out = kernels.attention_banded(q, k, v, W, block)
        torch.testing.assert_close(out, kernels.attention_reference(q, k, v, W), atol=2e-5, rtol=1e-4)
        scores = sum(n for n, _, _ in calls)
        window_len = -(-(W + block - 1) // 16) * 16
        assert scores <= B * H * (T * window_len + window_len ** 2)
        assert scores < B * H * T * T / 8                 # vs T²/2 for causal SDPA
        assert len(calls) == 2                            # first blocks (causal) + all the rest at once
        assert calls[0][2] and not calls[0][1]            # the first blocks fit the window: no mask


def test_auto_picks_banded_only_where_it_skips_enough():
    q = torch.randn(1, 1, 1024, 8)
    assert kernels.pick_attention_impl(q, None, 128) == "sdpa"
    assert kernels.pick_attention_impl(q, 512, 128) == "sdpa"       # 1024 < 2·(512 + 128)
    assert kernels.pick_attention_impl(q, 256, 128) == "banded"


def test_flash_on_cpu_says_what_to_use_instead():
    q, k, v = qkv(8, torch.bfloat16)
    with pytest.raises(RuntimeError, match="banded or sdpa"):
        kernels.attention(q, k, v, 4, impl="flash")


def test_flash_attn_without_a_window_is_refused_in_one_line_and_auto_falls_back(monkeypatch):
    """flash-attn before 2.3 has no window_size: a TypeError inside the first step. With such a
    version installed, kernels.attention=flash is a config error naming the range and `make gpu`,
    and auto picks another backend."""
    import types
    import config
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(__version__="2.1.2"))
    kernels.flash_attn_problem.cache_clear()
    try:
        assert not kernels.flash_attn_importable()
        cfg = config.compose(["kernels.attention=flash"])
        with pytest.raises(config.ConfigError) as err:
            config.validate(cfg, world=1)
        line = str(err.value)
        assert "\n" not in line and line.startswith("config error: kernels.attention")
        assert "2.1.2" in line and kernels.FLASH_ATTN_RANGE in line and "make gpu" in line
        # 2.6's functions are pybind calls that break torch.compile's graph at every layer; 2.7's are custom ops
        monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(__version__="2.6.3"))
        kernels.flash_attn_problem.cache_clear()
        assert "torch.compile" in kernels.flash_attn_problem()[0]
        monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(__version__="2.7.4.post1"))
        kernels.flash_attn_problem.cache_clear()
        assert kernels.flash_attn_problem() is None
    finally:
        kernels.flash_attn_problem.cache_clear()


def test_whether_flash_attn_can_run_is_a_constant_to_torch_compile():
    """kernels.attention=auto asks at every layer; on CUDA in bf16 (where the question is reached)
    tracing its import of flash_attn broke the graph inside the blocks' loop and sent the whole
    compiled step back to eager. fullgraph=True fails on any break; the cache is cleared so that
    the compiled call is the one that imports."""
    expected = kernels.flash_attn_importable()
    kernels.flash_attn_problem.cache_clear()
    torch._dynamo.reset()
    fn = torch.compile(lambda x: x * 3 if kernels.flash_attn_importable() else x - 1, fullgraph=True, backend="eager")
    assert fn(torch.ones(2)).tolist() == ([3.0, 3.0] if expected else [0.0, 0.0])


def test_the_gpu_extra_pins_the_range_the_code_checks():
    import tomllib
    extra = tomllib.load(open(Path(__file__).resolve().parents[1] / "pyproject.toml", "rb"))
    assert extra["project"]["optional-dependencies"]["gpu"] == [f"flash-attn{kernels.FLASH_ATTN_RANGE}"]


def test_unknown_impl_is_an_error():
    q, k, v = qkv(8, torch.float32)
    with pytest.raises(ValueError, match="unknown attention impl"):
        kernels.attention(q, k, v, impl="tiled")


@pytest.mark.skipif(not (torch.cuda.is_available() and kernels.flash_attn_importable()),
                    reason="flash-attn needs CUDA and the optional flash-attn package")
@pytest.mark.parametrize("window", [1, 63, 64, 65, 300, None])
@pytest.mark.parametrize("heads", HEADS)
def test_flash_equals_reference(window, heads):
    q, k, v = [t.detach().cuda().requires_grad_() for t in qkv(300, torch.bfloat16, heads=heads)]
    grad_out = torch.randn_like(q)
    ref_inputs = [t.detach().float().requires_grad_() for t in (q, k, v)]
    expected = out_and_grads(lambda a, b, c: kernels.attention_reference(a, b, c, window), *ref_inputs,
                             grad_out.float())
    got = out_and_grads(lambda a, b, c: kernels.attention(a, b, c, window, impl="flash"), q, k, v, grad_out)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g.float(), e, **TOL[torch.bfloat16])


# --- Fused operators: the compiled path against the eager one ---

ROWS, HIDDEN, VOCAB = (2, 24), 32, 96


def compiled(fn):
    """fn as a compiled step runs it: kernels.fused=true fuses there, and only there."""
    return torch.compile(fn, dynamic=False, fullgraph=True)


def leaf(*shape, dtype=torch.float32, seed=0, scale=1.0, shift=0.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale + shift).to(dtype).requires_grad_()


def check_same(fn_eager, fn_fused, inputs, norm=None):
    """Fused is as accurate as eager: for every output and every gradient (of the inputs and of
    the norm's parameters, under a random output gradient), its error against the same
    computation in fp64 is at most twice eager's, plus a floor of a few units of the last place
    of fp32. Both round (bf16 outputs, bf16 mean/rstd saved for the backward), only differently,
    so a direct fused-vs-eager comparison would measure the sum of their errors."""
    def run(fn, dtype=None):
        xs = [t.detach().to(dtype or t.dtype).requires_grad_() for t in inputs]
        mod = copy.deepcopy(norm)
        if norm is not None and dtype is not None:
            mod = mod.to(dtype)
        outs = fn(*xs, mod) if norm is not None else fn(*xs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        grads = [torch.randn(o.shape, generator=torch.Generator().manual_seed(7 + i)).to(o.dtype)
                 for i, o in enumerate(outs)]
        wrt = xs + (list(mod.parameters()) if norm is not None else [])
        return [*outs, *torch.autograd.grad(outs, wrt, grads)]
    oracle, eager, fused = run(fn_eager, torch.float64), run(fn_eager), run(fn_fused)
    assert len(fused) == len(eager) == len(oracle)
    for i, (want, e, f) in enumerate(zip(oracle, eager, fused)):
        assert f.dtype == e.dtype and f.shape == e.shape
        err_eager, err_fused = (e.double() - want).abs().max(), (f.double() - want).abs().max()
        floor = 1e-5 * max(1.0, want.abs().max().item())
        assert err_fused <= 2 * err_eager + floor, f"tensor {i}: fused error {err_fused:.3g}, eager {err_eager:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3])
def test_heads_with_rope_equals_the_plain_ops(dtype, group):
    """q and k rotated, v, and the projection's gradient, against the plain ops and autograd's
    backward of them. 5 KV heads, as a TP rank's slice may hold: the count comes from the tensor;
    with GQA each has 3 query heads."""
    B, T, H_kv, D = 2, 12, 5, 8
    cos, sin = rope_tables(T, D, 10000.0, "cpu")
    check_same(lambda x: kernels._heads_then_rope(x, D, cos, sin, group),
               lambda x: kernels.heads_with_rope(x, D, cos, sin, group), [leaf(B, T, (group + 2) * H_kv * D, dtype=dtype)])


@pytest.mark.parametrize("dtype,group", [(torch.float32, 1), (torch.bfloat16, 1), (torch.float32, 3)])
def test_fused_heads_with_rope_equals_the_plain_ops(dtype, group):
    """The heads and rotation inside a compiled step (inductor's one kernel each way of the plain
    ops), forward and backward, against the plain ops in fp64: as accurate as the written-out op.
    5 KV heads, as a TP rank's slice may hold; with GQA each has 3 query heads."""
    B, T, H_kv, D = 2, 12, 5, 8
    cos, sin = rope_tables(T, D, 10000.0, "cpu")
    check_same(lambda x: kernels.heads_with_rope(x, D, cos, sin, group),
               compiled(lambda x: kernels.heads_with_rope(x, D, cos, sin, group)),
               [leaf(B, T, (group + 2) * H_kv * D, dtype=dtype)])


@pytest.mark.parametrize("group", [1, 2])
def test_heads_with_rope_rotates_q_and_k_only(group):
    """Against the definition itself: position t's q and k turned by the angles t * theta^(-2i/D),
    v untouched, in the projection's layout: per KV head g, its `group` query heads (heads
    g·group ...), then k, then v; (head, q|k|v, head_dim) without GQA."""
    B, T, H_kv, D = 1, 6, 2, 4
    cos, sin = rope_tables(T, D, 10000.0, "cpu")
    x = torch.randn(B, T, (group + 2) * H_kv * D)
    q, k, v = kernels.heads_with_rope(x, D, cos, sin, group)
    assert q.shape == (B, group * H_kv, T, D) and k.shape == v.shape == (B, H_kv, T, D)
    rows = x.view(B, T, H_kv, group + 2, D)
    for t in range(T):
        angle = t * 10000.0 ** (-torch.arange(0, D, 2) / D)
        c, s = torch.cos(angle), torch.sin(angle)
        for g in range(H_kv):
            for got, i in [(q[0, g * group + j], j) for j in range(group)] + [(k[0, g], group)]:
                a, b = rows[0, t, g, i, :D // 2], rows[0, t, g, i, D // 2:]
                torch.testing.assert_close(got[t], torch.cat([a * c - b * s, b * c + a * s]), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(v[0, g, t], rows[0, t, g, group + 1])


def layer_norm_module(bias: bool, dtype, rms: bool = False):
    """nn.LayerNorm, or with rms=True nn.RMSNorm (Llama's, which has no bias)."""
    norm = (nn.RMSNorm(HIDDEN, eps=1e-5) if rms else nn.LayerNorm(HIDDEN, bias=bias)).to(dtype)
    with torch.no_grad():  # not the identity init, so the weight and bias gradients matter
        norm.weight.copy_(torch.randn(HIDDEN).to(dtype) * 0.5 + 1)
        if bias and not rms:
            norm.bias.copy_(torch.randn(HIDDEN).to(dtype) * 0.1)
    return norm


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_fused_add_layer_norm(x_dtype):
    """bf16 throughout, and as under autocast: an fp32 residual stream, a bf16 branch output
    and fp32 LayerNorm parameters."""
    inputs = [leaf(*ROWS, HIDDEN, dtype=x_dtype), leaf(*ROWS, HIDDEN, dtype=torch.bfloat16, seed=1)]
    check_same(lambda x, d, n: kernels.add_layer_norm(x, d, n),
               compiled(lambda x, d, n: kernels.add_layer_norm(x, d, n, fused=True)), inputs,
               norm=layer_norm_module(True, x_dtype))


def test_fused_add_rms_norm():
    """Llama's residual add + RMSNorm inside a compiled step, as under autocast: an fp32 residual
    stream, a bf16 branch output and fp32 weights."""
    inputs = [leaf(*ROWS, HIDDEN), leaf(*ROWS, HIDDEN, dtype=torch.bfloat16, seed=1)]
    check_same(lambda x, d, n: kernels.add_layer_norm(x, d, n),
               compiled(lambda x, d, n: kernels.add_layer_norm(x, d, n, fused=True)), inputs,
               norm=layer_norm_module(False, torch.float32, rms=True))


def test_fused_add_layer_norm_returns_the_sum():
    norm = layer_norm_module(True, torch.float32)
    x, delta = torch.randn(*ROWS, HIDDEN), torch.randn(*ROWS, HIDDEN)
    s, h = compiled(lambda a, b: kernels.add_layer_norm(a, b, norm, fused=True))(x, delta)
    torch.testing.assert_close(s, x + delta)
    torch.testing.assert_close(h, F.layer_norm(x + delta, (HIDDEN,), norm.weight, norm.bias, norm.eps))


@pytest.mark.parametrize("dtype,bias", [(torch.bfloat16, True), (torch.float32, False)])
def test_fused_bias_gelu(dtype, bias):
    # The bias is fp32 as under autocast (master weights); the activation comes out of a GEMM.
    inputs = [leaf(*ROWS, 4 * HIDDEN, dtype=dtype, scale=2.0)] + ([leaf(4 * HIDDEN, seed=1)] if bias else [])
    eager = (lambda x, b=None: kernels.bias_gelu(x, b))
    fused = compiled(lambda x, b=None: kernels.bias_gelu(x, b, fused=True))
    check_same(eager, fused, inputs)


@pytest.mark.parametrize("dtype,bias", [(torch.bfloat16, True), (torch.float32, False)])
def test_fused_swiglu(dtype, bias):
    inputs = [leaf(*ROWS, 4 * HIDDEN, dtype=dtype, scale=2.0)] + ([leaf(4 * HIDDEN, seed=1)] if bias else [])
    check_same(lambda x, b=None: kernels.swiglu(x, b),
               compiled(lambda x, b=None: kernels.swiglu(x, b, fused=True)), inputs)


def test_swiglu_is_silu_of_the_gate_times_up_interleaved():
    """fc_in's output pairs gate and up per unit, [g0, u0, g1, u1, ...]: unit j is silu(g_j) * u_j."""
    x, b = torch.randn(5, 16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    z = x + b
    gate, up = z[:, 0::2], z[:, 1::2]
    torch.testing.assert_close(kernels.swiglu(x, b), gate * torch.sigmoid(gate) * up)


def test_bias_gelu_is_exact_erf_gelu():
    x, b = torch.randn(5, 8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    z = x + b
    expected = 0.5 * z * (1 + torch.erf(z / 2 ** 0.5))
    torch.testing.assert_close(kernels.bias_gelu(x, b), expected)
    torch.testing.assert_close(compiled(lambda a, c: kernels.bias_gelu(a, c, fused=True))(x.float(), b.float()),
                               expected.float())


def test_fused_cross_entropy_matches_eager_in_fp32():
    logits = leaf(*ROWS, VOCAB, dtype=torch.bfloat16, scale=4.0)
    targets = torch.randint(0, VOCAB, ROWS, generator=torch.Generator().manual_seed(3))
    eager = kernels.cross_entropy(logits, targets)
    fused = compiled(lambda z, t: kernels.cross_entropy(z, t, fused=True))(logits, targets)
    assert fused.dtype == torch.float32
    # Both upcast before the reductions, so they agree to fp32 rounding.
    torch.testing.assert_close(fused, eager, atol=1e-5, rtol=1e-5)
    by_hand = (torch.logsumexp(logits.double(), -1) - logits.double().gather(-1, targets[..., None])[..., 0]).mean()
    torch.testing.assert_close(fused.double(), by_hand, atol=1e-5, rtol=1e-5)
    (g_eager,) = torch.autograd.grad(eager, logits)
    (g_fused,) = torch.autograd.grad(fused, logits)
    assert g_fused.dtype == torch.bfloat16
    torch.testing.assert_close(g_fused.float(), g_eager.float(), **TOL[torch.bfloat16])


# --- The switches inside the model ---

def test_model_with_every_fast_path_equals_eager_model():
    """kernels.fused=true and kernels.attention=banded change speed, not the maths: the same
    weights give the same loss and gradients as the eager model, both block types, with SWA, for
    GPT's block and Llama's (RMSNorm, SwiGLU, GQA)."""
    from model import GPT, ModelConfig, AttentionConfig
    llama = dict(n_heads=4, n_kv_heads=2, norm="rmsnorm", mlp="swiglu", ffn_hidden_size=48, bias=False)
    for block, shape in (("sequential", {}), ("parallel", {}), ("sequential", llama), ("parallel", llama)):
        cfg = ModelConfig(n_layers=2, d_model=32, vocab_size=64, block=block, attention=AttentionConfig(window=20),
                          **{"n_heads": 2, **shape})
        eager = GPT(cfg)
        eager.init_weights(seed=0)
        fast = GPT(cfg, kernels.KernelsConfig(attention="banded", fused=True, attention_block=16))
        fast.load_state_dict(eager.state_dict())
        tokens = torch.randint(0, 64, (2, 77), generator=torch.Generator().manual_seed(1))
        assert_same_loss_and_grads(eager, fast, tokens, fused=True)


# --- Triton kernels (kernels.fused=triton), run by Triton's interpreter on CPU ---

T_ROWS = (2, 5)  # the interpreter runs each row's program in Python: few rows, so that it takes seconds

needs_triton = pytest.mark.skipif(not kernels.triton_importable(),
                                  reason="triton is not installed (the optional extra: pip install '.[triton]')")


@pytest.fixture
def triton_interpreter(monkeypatch):
    """Triton's interpreter runs the kernels on CPU tensors, on any host. TRITON_INTERPRET=1 must
    also be set when the kernels are built (triton.jit reads it as it wraps each function), so
    the cache of built kernels is cleared before and after.

    The interpreter rounds fp32 -> bf16 toward zero, where compiled Triton rounds to nearest even
    (the default of its casts): left alone, bf16 outputs would carry up to twice eager's rounding
    error, the interpreter's and not the kernel's. So here it rounds as compiled code does."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    if not isinstance(tl.sum, interpreter.InterpretedFunction):
        if torch.cuda.is_available():
            pytest.skip("on a CUDA host triton is imported compiled; tests/test_cuda.py launches these kernels")
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set: tests/conftest.py imports it first, "
                    "for the interpreter; what imported it before?")
    cast = interpreter.InterpreterBuilder.cast_impl

    def cast_to_nearest(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16).view(torch.int16)
            return interpreter.TensorHandle(bits.numpy().view(np.uint16), tl.bfloat16)
        return cast(self, src, dst_type)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "cast_impl", cast_to_nearest)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernels_triton.jit_kernels.cache_clear()
    yield
    assert kernels_triton.jit_kernels.cache_info().currsize, "the Triton kernels never ran"
    kernels_triton.jit_kernels.cache_clear()


@pytest.mark.parametrize("dtype,bias", [(torch.bfloat16, True), (torch.float32, False)])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.usefixtures("triton_interpreter")
@needs_triton
def test_triton_layer_norm(dtype, bias, residual, rms):
    """LayerNorm or RMSNorm, and residual add + either, all in one dtype."""
    norm = layer_norm_module(bias, dtype, rms)
    if residual:
        inputs = [leaf(*T_ROWS, HIDDEN, dtype=dtype, scale=3.0, shift=2.0), leaf(*T_ROWS, HIDDEN, dtype=dtype, seed=1)]
        check_same(lambda x, d, n: kernels.add_layer_norm(x, d, n),
                   lambda x, d, n: kernels.add_layer_norm(x, d, n, fused="triton"), inputs, norm=norm)
    else:
        check_same(lambda x, n: kernels.layer_norm(x, n), lambda x, n: kernels.layer_norm(x, n, fused="triton"),
                   [leaf(*T_ROWS, HIDDEN, dtype=dtype, scale=3.0, shift=2.0)], norm=norm)


@pytest.mark.usefixtures("triton_interpreter")
@needs_triton
def test_triton_add_layer_norm_under_autocast_dtypes():
    """As under autocast: an fp32 residual stream, a bf16 branch output, fp32 LayerNorm parameters."""
    inputs = [leaf(*T_ROWS, HIDDEN), leaf(*T_ROWS, HIDDEN, dtype=torch.bfloat16, seed=1)]
    check_same(lambda x, d, n: kernels.add_layer_norm(x, d, n),
               lambda x, d, n: kernels.add_layer_norm(x, d, n, fused="triton"), inputs,
               norm=layer_norm_module(True, torch.float32))


@pytest.mark.parametrize("dtype,bias", [(torch.bfloat16, True), (torch.float32, False)])
@pytest.mark.usefixtures("triton_interpreter")
@needs_triton
def test_triton_bias_gelu(dtype, bias):
    # 40 rows and 200 columns: partial tiles in both directions (32 x 128 tiles).
    inputs = [leaf(40, 200, dtype=dtype, scale=2.0)] + ([leaf(200, seed=1)] if bias else [])
    check_same(lambda x, b=None: kernels.bias_gelu(x, b), lambda x, b=None: kernels.bias_gelu(x, b, fused="triton"),
               inputs)


@pytest.mark.parametrize("dtype,bias", [(torch.bfloat16, True), (torch.float32, False)])
@pytest.mark.usefixtures("triton_interpreter")
@needs_triton
def test_triton_swiglu(dtype, bias):
    # 40 rows and 100 units (200 columns): partial tiles in both directions (32 x 64 units).
    inputs = [leaf(40, 200, dtype=dtype, scale=2.0)] + ([leaf(200, seed=1)] if bias else [])
    check_same(lambda x, b=None: kernels.swiglu(x, b), lambda x, b=None: kernels.swiglu(x, b, fused="triton"), inputs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.usefixtures("triton_interpreter")
@needs_triton
def test_triton_cross_entropy(dtype, monkeypatch):
    # Blocks of 64 of a vocab of 200: the online log-sum-exp rescales across blocks and the last is partial.
    monkeypatch.setattr(kernels_triton, "_vocab_block", lambda V: 64)
    logits = leaf(*T_ROWS, 200, dtype=dtype, scale=4.0)
    targets = torch.randint(0, 200, T_ROWS, generator=torch.Generator().manual_seed(3))
    check_same(lambda z: kernels.cross_entropy(z, targets), lambda z: kernels.cross_entropy(z, targets, fused="triton"),
               [logits])


@needs_triton
def test_triton_on_cpu_says_what_to_use_instead(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="use kernels.fused=true"):
        kernels.bias_gelu(torch.randn(4, 8), None, fused="triton")


def test_triton_missing_says_what_to_install(monkeypatch):
    monkeypatch.setattr(kernels, "triton_importable", lambda: False)
    with pytest.raises(RuntimeError, match=r"pip install '\.\[triton\]'.*use kernels.fused=true"):
        kernels.layer_norm(torch.randn(4, 8), nn.LayerNorm(8), fused="triton")


def test_fused_switch_values():
    """kernels.fused takes false, true or triton from the command line; anything else is refused."""
    import config
    assert config.compose(["kernels.fused=triton"]).kernels.fused == "triton"
    cfg = config.compose(["kernels.fused=true"])
    assert cfg.kernels.fused is True
    cfg.kernels.fused = "tritn"
    with pytest.raises(config.ConfigError, match="kernels.fused: unknown value 'tritn'"):
        config.validate(cfg, world=1)


@pytest.mark.usefixtures("triton_interpreter")
@needs_triton
@pytest.mark.parametrize("llama", [False, True])
def test_model_with_triton_kernels_equals_eager_model(llama):
    """kernels.fused=triton reaches every fused op of the model: the sequential block runs all four
    (with Llama's block: its RMSNorms and SwiGLU)."""
    from model import GPT, ModelConfig
    cfg = ModelConfig(n_layers=1, n_heads=2, d_model=32, vocab_size=64, block="sequential")
    if llama:
        cfg = ModelConfig(n_layers=1, n_heads=2, n_kv_heads=1, d_model=32, vocab_size=64, norm="rmsnorm",
                          mlp="swiglu", ffn_hidden_size=48, bias=False)
    eager = GPT(cfg)
    eager.init_weights(seed=0)
    fast = GPT(cfg, kernels.KernelsConfig(fused="triton"))
    fast.load_state_dict(eager.state_dict())
    tokens = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(1))
    assert_same_loss_and_grads(eager, fast, tokens, fused="triton")


# Every kernel compiled for an H100 (sm_90) by Triton's own compiler and ptxas, no GPU needed: what
# the interpreter does not check (types, loop-carried values, the closures the kernels live in).
# A fresh process, as triton here was imported for the interpreter.
COMPILE_FOR_GPU = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import kernels_triton
k, f32 = kernels_triton.jit_kernels(), "*fp32"
for t in ("*bf16", "*fp32"):
    for fn, types, consts in [
        (k.layer_norm_fwd, [t, t, f32, f32, t, t, f32, f32, "i32", "fp32"], dict(HAS_DELTA=True, HAS_BIAS=True, RMS=False, BLOCK=1024)),
        (k.layer_norm_bwd, [t, f32, f32, f32, t, t, t, f32, f32, "i32", "i32"], dict(HAS_DSUM=True, RMS=False, BLOCK=1024)),
        (k.layer_norm_fwd, [t, t, f32, f32, t, t, f32, f32, "i32", "fp32"], dict(HAS_DELTA=True, HAS_BIAS=False, RMS=True, BLOCK=1024)),
        (k.layer_norm_bwd, [t, f32, f32, f32, t, t, t, f32, f32, "i32", "i32"], dict(HAS_DSUM=True, RMS=True, BLOCK=1024)),
        (k.swiglu, [t, f32, t, t, f32, "i32", "i32"], dict(HAS_BIAS=True, BACKWARD=False, BLOCK_M=32, BLOCK_N=64)),
        (k.swiglu, [t, f32, t, t, f32, "i32", "i32"], dict(HAS_BIAS=True, BACKWARD=True, BLOCK_M=32, BLOCK_N=64)),
        (k.bias_gelu, [t, f32, t, t, f32, "i32", "i32"], dict(HAS_BIAS=True, BACKWARD=False, BLOCK_M=32, BLOCK_N=128)),
        (k.bias_gelu, [t, f32, t, t, f32, "i32", "i32"], dict(HAS_BIAS=True, BACKWARD=True, BLOCK_M=32, BLOCK_N=128)),
        (k.cross_entropy_fwd, [t, "*i64", f32, f32, "i32"], dict(BLOCK_V=4096)),
        (k.cross_entropy_bwd, [t, "*i64", f32, f32, t, "i32"], dict(BLOCK_V=4096)),
    ]:
        signature = dict(zip(fn.arg_names, types)) | {name: "constexpr" for name in consts}
        triton.compile(ASTSource(fn, signature, consts), target=GPUTarget("cuda", 90, 32))
"""


@needs_triton
def test_triton_kernels_compile_for_gpu():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", COMPILE_FOR_GPU], cwd=Path(__file__).resolve().parents[1], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def assert_same_loss_and_grads(eager, fast, tokens, fused) -> None:
    """The fast model (with kernels.fused=`fused`) gives the eager model's loss and gradients."""
    losses, grads = [], []
    for net, how in ((eager, False), (fast, fused)):
        loss = kernels.cross_entropy(net(tokens[:, :-1]), tokens[:, 1:], fused=how)
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in net.named_parameters()})
    torch.testing.assert_close(losses[1], losses[0], atol=1e-5, rtol=1e-5)
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, atol=1e-5, rtol=1e-4, msg=name)


def test_the_rotation_costs_three_kernels_a_layer_each_way(monkeypatch):
    """What a launch-bound device pays for RoPE, counted as `bench_step --count` counts a step: our
    step at bench_step's launch shape with and without the rotation differs by 3 kernels a layer
    forward (q and k rotated together: a mul and two half-width multiply-adds) and 3 backward, and
    by one Python autograd call a layer each way; one fp32 rank fires no hooks."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "experiments"))  # bench_step's imports
    from experiments import bench_step
    shape = bench_step.SHAPES["launch"]
    counts = {}
    for rope in (True, False):
        step = bench_step.our_stepper(shape, "fp32", False, rope=rope)
        step()  # the first step allocates the optimizer's state
        counts[rope] = bench_step.dispatch_counts(step)
    layers = shape["n_layers"]
    for phase in ("forward", "backward"):
        assert counts[True]["kernels", phase] - counts[False]["kernels", phase] == 3 * layers, phase
        assert counts[True]["python calls", phase] - counts[False]["python calls", phase] == layers, phase
    assert counts[True]["kernels", "optimizer"] == counts[False]["kernels", "optimizer"]
    assert counts[True]["hooks", "backward"] == 0


def test_fused_from_eager_code_dispatches_what_eager_does(monkeypatch):
    """kernels.fused=true costs an eager step nothing: at bench_step's launch shape it dispatches
    the kernels and autograd Python calls of kernels.fused=false, phase by phase, and calls the
    same Python functions but the one check a step that the loss runs eagerly (is_compiling)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "experiments"))  # bench_step's imports
    from experiments import bench_step
    shape = bench_step.SHAPES["launch"]
    counts, frames = {}, {}
    for fused in (False, True):
        step = bench_step.our_stepper(shape, "fp32", False, extra=(f"kernels.fused={str(fused).lower()}",))
        step()  # the first step allocates the optimizer's state
        counts[fused], frames[fused] = bench_step.dispatch_counts(step), bench_step.python_frames(step)
    assert counts[True] == counts[False]
    assert 0 <= frames[True] - frames[False] <= 3, frames
