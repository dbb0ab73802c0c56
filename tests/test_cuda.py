"""The GPU paths on a GPU. CI has none, so these skip there; on a CUDA host run them in a process of
their own, `pytest tests/test_cuda.py` (tests/test_kernels.py imports triton for its CPU
interpreter, which a real kernel launch must not see).

What CPU tests can only stand in for: the Triton kernels compiled and launched (kernels.fused=triton),
the fused ops inside a compiled step (kernels.fused=true) and every attention backend on CUDA tensors, each
against an fp64 oracle; the model on CUDA against the same model on CPU; and train.py on one GPU,
bf16, eager, compiled and with the Triton kernels, saving and resuming (CUDA RNG state, DCP from
device tensors, the CUDA-event step clock)."""
import copy
import json

import pytest
import torch
import torch.nn as nn

import checkpoint
from parallelisms import placement
import kernels
import kernels_triton
from conftest import SMALL, read_metrics, run_train
from model import rope_tables

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = "cuda"


@pytest.fixture(autouse=True)
def exact_matmuls():
    """fp32 means fp32: TF32 GEMMs would be the error measured, not the kernels'."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def leaf(*shape, dtype=torch.float32, seed=0, scale=1.0, shift=0.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale + shift).to(dtype).to(CUDA).requires_grad_()


def outputs_and_grads(fn, inputs, module=None, dtype=None):
    xs = [t.detach().to(dtype or t.dtype).requires_grad_() for t in inputs]
    mod = copy.deepcopy(module)
    if module is not None and dtype is not None:
        mod = mod.to(dtype)
    outs = fn(*xs, mod) if module is not None else fn(*xs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = [torch.randn(o.shape, generator=torch.Generator().manual_seed(7 + i)).to(o.dtype).to(CUDA)
             for i, o in enumerate(outs)]
    wrt = xs + (list(mod.parameters()) if module is not None else [])
    return [*outs, *torch.autograd.grad(outs, wrt, grads)]


def assert_as_accurate(eager, fast, inputs, module=None):
    """fast's error against eager's maths in fp64 is at most twice eager's own, plus a few units of
    fp32's last place, for every output and every gradient (as tests/test_kernels.py on CPU)."""
    oracle = outputs_and_grads(eager, inputs, module, torch.float64)
    for i, (want, e, f) in enumerate(zip(oracle, outputs_and_grads(eager, inputs, module),
                                         outputs_and_grads(fast, inputs, module))):
        assert f.dtype == e.dtype and f.shape == e.shape, i
        err_eager, err_fast = (e.double() - want).abs().max().item(), (f.double() - want).abs().max().item()
        floor = 1e-5 * max(1.0, want.abs().max().item())
        assert err_fast <= 2 * err_eager + floor, f"tensor {i}: fast error {err_fast:.3g}, eager {err_eager:.3g}"


def layer_norm_module(hidden, dtype, rms=False):
    """nn.LayerNorm, or with rms=True Llama's nn.RMSNorm (no bias)."""
    norm = (nn.RMSNorm(hidden, eps=1e-5) if rms else nn.LayerNorm(hidden)).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden) * 0.5 + 1)
        if not rms:
            norm.bias.copy_(torch.randn(hidden) * 0.1)
    return norm.to(CUDA)


# Rows of a real microbatch and GPT-3's widths: several programs per row block, partial tiles.
ROWS, HIDDEN, VOCAB = (4, 500), 1536, 50304


@pytest.mark.parametrize("fused", [True, "triton"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_ops_on_cuda_are_as_accurate_as_eager(fused, dtype):
    if fused == "triton" and not kernels.triton_importable():
        pytest.skip("triton is not installed")
    # fused=true fuses inside a compiled step only: compiled here, as there
    fast = (lambda fn: torch.compile(fn, dynamic=False)) if fused is True else (lambda fn: fn)
    x, delta = leaf(*ROWS, HIDDEN, dtype=dtype, scale=3.0, shift=2.0), leaf(*ROWS, HIDDEN, dtype=dtype, seed=1)
    for rms in (False, True):  # GPT's LayerNorm, Llama's RMSNorm
        norm = layer_norm_module(HIDDEN, dtype, rms)
        assert_as_accurate(lambda a, n: kernels.layer_norm(a, n),
                           fast(lambda a, n: kernels.layer_norm(a, n, fused=fused)), [x], norm)
        assert_as_accurate(lambda a, d, n: kernels.add_layer_norm(a, d, n),
                           fast(lambda a, d, n: kernels.add_layer_norm(a, d, n, fused=fused)), [x, delta], norm)
    h, bias = leaf(*ROWS, 4 * HIDDEN, dtype=dtype, scale=2.0), leaf(4 * HIDDEN, seed=2)
    assert_as_accurate(lambda a, b: kernels.bias_gelu(a, b), fast(lambda a, b: kernels.bias_gelu(a, b, fused=fused)),
                       [h, bias])
    assert_as_accurate(lambda a, b: kernels.swiglu(a, b), fast(lambda a, b: kernels.swiglu(a, b, fused=fused)),
                       [h, bias])
    logits = leaf(2, 300, VOCAB, dtype=dtype, scale=4.0)
    targets = torch.randint(0, VOCAB, (2, 300), generator=torch.Generator().manual_seed(3)).to(CUDA)
    assert_as_accurate(lambda z: kernels.cross_entropy(z, targets),
                       fast(lambda z: kernels.cross_entropy(z, targets, fused=fused)), [logits])
    head_dim = 128  # GPT-3's; 12 heads at this width
    cos, sin = rope_tables(ROWS[1], head_dim, 10000.0, CUDA)
    assert_as_accurate(lambda x: kernels.heads_with_rope(x, head_dim, cos, sin),
                       fast(lambda x: kernels.heads_with_rope(x, head_dim, cos, sin)),
                       [leaf(*ROWS, 3 * HIDDEN, dtype=dtype, seed=4)])
    # GQA: 12 query heads, 3 KV heads (groups of 4)
    assert_as_accurate(lambda x: kernels.heads_with_rope(x, head_dim, cos, sin, 4),
                       fast(lambda x: kernels.heads_with_rope(x, head_dim, cos, sin, 4)),
                       [leaf(*ROWS, (12 + 2 * 3) * head_dim, dtype=dtype, seed=5)])
    if fused == "triton":
        assert kernels_triton.jit_kernels.cache_info().currsize, "the Triton kernels never ran"


TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def test_layer_norm_with_bf16_weights_stays_bf16_under_autocast():
    """CUDA's autocast would run layer_norm in fp32 (input and weights cast up, the output cast
    down by the next GEMM); with bf16 weights kernels.layer_norm runs it in bf16, one rounding of
    the fp32 result, forward and backward within one bf16 step of it."""
    norm = nn.LayerNorm(256).to(CUDA, torch.bfloat16)
    x = leaf(64, 256, dtype=torch.bfloat16)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = kernels.layer_norm(x, norm)
    assert y.dtype == torch.bfloat16
    x32 = x.detach().float().requires_grad_()
    want = nn.functional.layer_norm(x32, (256,), norm.weight.float(), norm.bias.float())
    torch.testing.assert_close(y.float(), want, atol=2 ** -7, rtol=2 ** -7)
    grad = torch.randn_like(want)
    y.backward(grad.to(torch.bfloat16))
    want.backward(grad)
    torch.testing.assert_close(x.grad.float(), x32.grad, atol=2 ** -5, rtol=2 ** -6)


@pytest.mark.parametrize("window", [None, 1, 100, 256])
@pytest.mark.parametrize("impl", ["sdpa", "banded", "unfused", "auto", "flash"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kv_heads", [4, 2])  # multi-head; GQA, 2 query heads per KV head
def test_attention_on_cuda_equals_the_reference(impl, window, dtype, kv_heads):
    """As tests/test_kernels.py on CPU: output and gradients against the reference in fp32 on the
    same (rounded) inputs, so what is left is the backend's own error."""
    if impl == "flash" and not (dtype == torch.bfloat16 and kernels.flash_attn_importable()):
        pytest.skip("flash-attn: bf16 only, and the optional package (make gpu)")
    q, k, v = (leaf(2, heads, 300, 64, dtype=dtype, seed=s) for s, heads in enumerate((4, kv_heads, kv_heads)))
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(9)).to(dtype).to(CUDA)
    expected = outputs_and_grads_of(lambda a, b, c: kernels.attention_reference(a, b, c, window),
                                    [t.detach().float() for t in (q, k, v)], grad_out.float())
    got = outputs_and_grads_of(lambda a, b, c: kernels.attention(a, b, c, window, impl=impl, block=64), [q, k, v],
                               grad_out)
    for name, g, e in zip(("out", "dq", "dk", "dv"), got, expected):
        assert g.dtype == dtype, name
        torch.testing.assert_close(g.float(), e, **TOL[dtype], msg=lambda m: f"{name}: {m}")


def outputs_and_grads_of(fn, inputs, grad_out):
    xs = [t.detach().requires_grad_() for t in inputs]
    out = fn(*xs)
    return (out, *torch.autograd.grad(out, xs, grad_out))


@pytest.mark.parametrize("llama", [False, True])
@pytest.mark.parametrize("block", ["sequential", "parallel"])
def test_the_model_on_cuda_equals_the_model_on_cpu(block, llama):
    """fp32, the same weights: one loss and one set of gradients, up to the order of the sums."""
    from model import GPT, ModelConfig, AttentionConfig
    shape = dict(norm="rmsnorm", mlp="swiglu", n_kv_heads=2, ffn_hidden_size=352, bias=False) if llama else {}
    cfg = ModelConfig(n_layers=2, n_heads=4, d_model=128, vocab_size=512, block=block,
                      attention=AttentionConfig(window=48), **shape)
    cpu = GPT(cfg)
    cpu.init_weights(seed=0)
    gpu = copy.deepcopy(cpu).to(CUDA)
    tokens = torch.randint(0, 512, (2, 129), generator=torch.Generator().manual_seed(1))
    results = []
    for net, device in ((cpu, "cpu"), (gpu, CUDA)):
        t = tokens.to(device)
        loss = kernels.cross_entropy(net(t[:, :-1]), t[:, 1:])
        loss.backward()
        results.append((loss.detach().cpu(), {n: p.grad.cpu() for n, p in net.named_parameters()}))
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-5, rtol=1e-5)
    for name, g in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], g, atol=1e-5, rtol=1e-4, msg=name)


RUN = SMALL + ["train.max_steps=12"]
# What a GPU run may drift from the CPU's in 12 steps: fp32 sums in another order; bf16 rounds too.
DRIFT = {"fp32": 1e-3, "bf16": 3e-2}


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory, cache_dir) -> list:
    """The same 12 steps on this host's CPU in fp32: the losses a GPU run should reproduce (the
    corpus is this Python's stdlib, so the reference must come from the same host)."""
    run_dir = tmp_path_factory.mktemp("cpu")
    run_train(run_dir, RUN + ["hardware.device=cpu", "precision=fp32"], cache_dir, launch="real")
    return [r["loss"] for r in read_metrics(run_dir)]


@pytest.mark.parametrize("precision, switches", [
    ("fp32", ["train.compile=false"]), ("bf16", ["train.compile=false"]),
    ("bf16", ["train.compile=true", "kernels.fused=true"]), ("bf16", ["train.compile=false", "kernels.fused=triton"]),
    ("bf16", []), ("bf16", ["train.compile_mode=reduce-overhead"])],
    ids=["fp32", "bf16", "bf16-compiled", "bf16-triton", "bf16-default", "bf16-cudagraphs"])
def test_train_py_on_one_gpu_follows_the_cpu_run_and_resumes(precision, switches, cpu_run, tmp_path, cache_dir):
    """train.py on one GPU takes the CPU run's steps (the same weights, data and maths), saves on
    the device at step 6 and a run resumed from there continues it."""
    if "kernels.fused=triton" in switches and not kernels.triton_importable():
        pytest.skip("triton is not installed")
    args = RUN + ["hardware.device=cuda", f"precision={precision}"] + switches
    straight = tmp_path / "straight"
    run_train(straight, args + ["checkpoint.interval=6"], cache_dir, launch="real")
    losses = [r["loss"] for r in read_metrics(straight)]
    assert losses == pytest.approx(cpu_run, rel=DRIFT[precision]), f"GPU {losses}\nCPU {cpu_run}"
    record = json.loads((straight / "run.json").read_text())
    assert record["status"] == "finished" and record["device"].startswith("cuda") and record["precision"] == precision
    if "train.compile=false" not in switches:  # the step as one graph (the default compiles on CUDA): a
        # break sends it back to eager (flash-attn's import did)
        assert record["final"]["compiled_graphs"] == 1, record["final"]["compiled_graphs"]
    resumed = tmp_path / "resumed"
    run_train(resumed, args + [f"resume={checkpoint.step_dir(straight / 'checkpoints', 6)}"], cache_dir, launch="real")
    assert [r["loss"] for r in read_metrics(resumed)] == pytest.approx(losses[6:], rel=DRIFT[precision] / 3)


def test_async_saves_stage_gpu_state_into_one_pinned_buffer(tmp_path):
    """Asynchronous saves of GPU tensors copy them (non-blocking) into one pinned host buffer, made
    at the first save and reused; each checkpoint holds its own step's values, though training
    changes the GPU tensors while the previous snapshot is written."""
    weight = torch.arange(12.0, device="cuda").view(3, 4)
    saver = checkpoint.Saver(tmp_path, keep=0, async_save=True)
    buffers = []
    for step in (1, 2):
        saver.save(step, {"model/w": placement.Chunks((3, 4), [((0, 0), weight)])})
        buffers.append(saver.staging.buffer)
        weight.mul_(10)
    saver.wait()
    assert buffers[0] is buffers[1] and buffers[0].is_pinned()
    for step, scale in ((1, 1.0), (2, 10.0)):
        back = {"model/w": placement.Chunks((3, 4), [((0, 0), torch.zeros(3, 4))])}
        checkpoint._read_alone(checkpoint.step_dir(tmp_path, step), back)
        assert torch.equal(back["model/w"].pieces[0][1], torch.arange(12.0).view(3, 4) * scale)
