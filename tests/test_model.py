"""The plain model: shapes, the PTB and SWA definitions, the FLOP accounting, and Llama's block
against transformers' LlamaForCausalLM."""
import math

import pytest
import torch

import export_hf
import kernels
from kernels import apply_rope
from model import GPT, AttentionConfig, ModelConfig, flops_per_token, matmul_params, rope_tables


# Llama's block on the tiny shape: RMSNorm, SwiGLU, 2 KV heads for 4 query heads, no biases.
LLAMA = dict(norm="rmsnorm", mlp="swiglu", n_kv_heads=2, ffn_hidden_size=96, bias=False)


def tiny(**overrides) -> ModelConfig:
    cfg = ModelConfig(n_layers=2, n_heads=4, d_model=64, vocab_size=128, max_seq_len=64)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


@pytest.mark.parametrize("llama", [False, True])
@pytest.mark.parametrize("block", ["sequential", "parallel"])
def test_forward_shapes_and_finite(block, llama):
    model = GPT(tiny(block=block, **(LLAMA if llama else {})))
    model.init_weights(0)
    tokens = torch.randint(0, 128, (3, 17))
    logits = model(tokens)
    assert logits.shape == (3, 17, 128)
    assert torch.isfinite(logits).all()
    # PTB shares one LayerNorm; the sequential block has two.
    assert (model.blocks["0"].ln_2 is None) == (block == "parallel")


@pytest.mark.parametrize("llama", [False, True])
def test_parallel_block_is_x_plus_attn_plus_mlp_of_one_ln(llama):
    model = GPT(tiny(block="parallel", **(LLAMA if llama else {})))
    model.init_weights(1)
    block = model.blocks["0"]
    x = torch.randn(2, 9, 64)
    F = torch.nn.functional
    if llama:
        h = F.rms_norm(x, (64,), block.ln_1.weight, block.ln_1.eps)
    else:
        h = F.layer_norm(x, (64,), block.ln_1.weight, block.ln_1.bias, block.ln_1.eps)
    torch.testing.assert_close(block(x), x + block.attn(h) + block.mlp(h))


@pytest.mark.parametrize("llama", [False, True])
def test_sequential_block_is_pre_ln(llama):
    model = GPT(tiny(**(LLAMA if llama else {})))
    model.init_weights(1)
    block = model.blocks["0"]
    x = torch.randn(2, 9, 64)
    y = x + block.attn(block.ln_1(x))
    torch.testing.assert_close(block(x), y + block.mlp(block.ln_2(y)))


@pytest.mark.parametrize("block", ["sequential", "parallel"])
def test_dropout_drops_each_residual_branch_in_training_only(block):
    """model.dropout: attention probabilities, then each residual branch (PTB: their sum), in the
    order the block draws them; eval mode is the block without dropout."""
    F = torch.nn.functional
    model = GPT(tiny(block=block, dropout=0.2))
    model.init_weights(1)
    blk, x = model.blocks["0"], torch.randn(2, 9, 64)
    torch.manual_seed(3)
    got = blk(x)
    torch.manual_seed(3)
    if block == "parallel":
        h = blk.ln_1(x)
        a = blk.attn(h)                      # draws the attention-probability mask first
        expected = x + F.dropout(a + blk.mlp(h), 0.2)
    else:
        y = x + F.dropout(blk.attn(blk.ln_1(x)), 0.2)
        expected = y + F.dropout(blk.mlp(blk.ln_2(y)), 0.2)
    torch.testing.assert_close(got, expected)
    model.eval()
    plain = GPT(tiny(block=block))
    plain.load_state_dict(model.state_dict())
    torch.testing.assert_close(model(torch.arange(9)[None]), plain(torch.arange(9)[None]))


def test_causality_and_window():
    """Changing a future token never changes earlier logits; with SWA a token W or more positions back
    cannot influence the output of a single-layer model either."""
    torch.manual_seed(0)
    W = 4
    model = GPT(tiny(n_layers=1, attention=AttentionConfig(window=W)))
    model.init_weights(2)
    a = torch.randint(0, 128, (1, 16))
    b = a.clone()
    b[0, 10] = (a[0, 10] + 1) % 128
    la, lb = model(a), model(b)
    torch.testing.assert_close(la[0, :10], lb[0, :10])          # the past is untouched
    torch.testing.assert_close(la[0, 10 + W:], lb[0, 10 + W:])  # out of the window: untouched
    assert not torch.allclose(la[0, 10:10 + W], lb[0, 10:10 + W])


def naive_window_attention(q, k, v, window):
    """One query at a time, over an explicit list of the keys it may see."""
    B, H, T, D = q.shape
    out = torch.zeros_like(q)
    for i in range(T):
        lo = 0 if window is None else max(0, i - window + 1)
        scores = (q[:, :, i:i + 1] @ k[:, :, lo:i + 1].transpose(-1, -2)) / math.sqrt(D)
        out[:, :, i] = (scores.softmax(-1) @ v[:, :, lo:i + 1])[:, :, 0]
    return out


@pytest.mark.parametrize("window", [None, 1, 3, 8, 20])
def test_reference_swa_equals_per_token_loop(window):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 20, 8) for _ in range(3))
    expected = naive_window_attention(q.double(), k.double(), v.double(), window)  # the oracle runs in fp64
    torch.testing.assert_close(kernels.attention_reference(q, k, v, window).double(), expected, rtol=1e-5, atol=1e-6)


def test_rope_rotates_pairs_and_preserves_norm():
    cos, sin = rope_tables(5, 8, 10000.0, "cpu")
    x = torch.randn(1, 1, 5, 8)
    y = apply_rope(x, cos, sin)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(y[..., 0, :], x[..., 0, :])  # position 0 is not rotated
    # Relative positions: <R_m q, R_n k> depends only on m - n.
    q, k = torch.randn(8), torch.randn(8)
    cos, sin = rope_tables(12, 8, 10000.0, "cpu")
    rot = lambda t, pos: apply_rope(t.expand(1, 1, 12, 8), cos, sin)[0, 0, pos]
    torch.testing.assert_close(rot(q, 7) @ rot(k, 4), rot(q, 5) @ rot(k, 2))


def test_rope_tables_are_the_correctly_rounded_angles():
    """Each entry is cos/sin of p·θ^(-2i/d) in double precision, rounded once to fp32: the same on
    every code path (torch's fp32 cos/sin gave another table in some processes, breaking bitwise
    run-to-run reproducibility), and the table is cached, not rebuilt per layer."""
    T, d, theta = 300, 64, 10000.0
    angles = [[p * theta ** (-(2 * (i % (d // 2))) / d) for i in range(d)] for p in range(T)]
    cos, sin = rope_tables(T, d, theta, "cpu")
    assert cos.dtype == torch.float32 and cos.shape == (T, d)
    assert torch.equal(cos, torch.tensor([[math.cos(a) for a in row] for row in angles], dtype=torch.float64).float())
    assert torch.equal(sin, torch.tensor([[math.sin(a) for a in row] for row in angles], dtype=torch.float64).float())
    assert rope_tables(T, d, theta, "cpu")[0] is cos
    # In a compute dtype: the fp32 table rounded once more, made once and cached like it
    low = rope_tables(T, d, theta, "cpu", dtype=torch.bfloat16)
    assert torch.equal(low[0], cos.to(torch.bfloat16)) and torch.equal(low[1], sin.to(torch.bfloat16))
    assert rope_tables(T, d, theta, "cpu", dtype=torch.bfloat16)[1] is low[1]


def test_compiled_model_takes_the_rope_tables_as_constants_in_one_graph_per_length():
    """Inside torch.compile the tables are the cached numpy-built ones, a constant of the graph:
    traced, they became pow/cos/sin evaluated per element of q and k in every layer (a
    sixth of a compiled step). A second sequence length (symbolic) still makes one graph, and
    the compiled forward is the eager one."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layers=2, n_heads=2, d_model=32, vocab_size=64, max_seq_len=64))
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=capture)
    for T in (16, 24):
        x = torch.randint(0, 64, (2, T))
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    trig = {torch.cos, torch.sin, torch.ops.aten.cos.default, torch.ops.aten.sin.default}
    assert len(graphs) == 2, f"{len(graphs)} graphs for 2 lengths: a graph break"
    assert not [n for g in graphs for n in g.graph.nodes if n.target in trig or "cos" in str(n.target)]
    torch._dynamo.reset()


def test_init_is_deterministic_and_scales_residual_projections():
    a, b = GPT(tiny()), GPT(tiny())
    a.init_weights(7)
    b.init_weights(7)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    out_std = a.blocks["0"].attn.out.weight.std().item()
    assert out_std == pytest.approx(0.02 / math.sqrt(2 * 2), rel=0.2)


def test_flops_per_token_175B_matches_megascale_table2():
    cfg = ModelConfig(n_layers=96, n_heads=128, d_model=12288, vocab_size=64000)
    assert matmul_params(cfg) == 12 * 96 * 12288**2 + 64000 * 12288
    assert flops_per_token(cfg, 2048) == pytest.approx(1.077e12, rel=0.005)


def test_llama_block_shapes():
    """GQA's projection holds H query heads and H_kv heads each of k and v; SwiGLU's fc_in both
    gate and up; the norms are RMSNorms without biases, under the GPT block's names."""
    model = GPT(tiny(**LLAMA))
    block, D = model.blocks["0"], 64 // 4
    assert block.attn.qkv.weight.shape == ((4 + 2 * 2) * D, 64) and block.attn.out.weight.shape == (64, 64)
    assert block.mlp.fc_in.weight.shape == (2 * 96, 64) and block.mlp.fc_out.weight.shape == (64, 96)
    assert all(isinstance(n, torch.nn.RMSNorm) for n in (block.ln_1, block.ln_2, model.norm))
    assert not any(name.endswith("bias") for name, _ in model.named_parameters())


def test_llama3_8B_builds_on_meta_with_the_published_size():
    import config
    with torch.device("meta"):
        model = GPT(config.compose(["model=llama3_8B"]).model)
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248


def test_175B_builds_on_meta_with_the_expected_size():
    cfg = ModelConfig(n_layers=96, n_heads=128, d_model=12288, vocab_size=64000)
    with torch.device("meta"):
        model = GPT(cfg)
    n = sum(p.numel() for p in model.parameters())
    # matmul weights + input embedding + biases and LayerNorms
    assert 175e9 < n < 176e9
    assert n > matmul_params(cfg)


# --- Llama's block against transformers' LlamaForCausalLM ---
#
# model.norm=rmsnorm, model.mlp=swiglu and model.n_kv_heads compute what LlamaForCausalLM computes:
# the same weights (export_hf.hf_llama_state cuts our fused QKV and gate/up weights into Llama's
# projections) give the same logits, loss and gradients, in fp32, with grouped-query attention and
# without. transformers is the external oracle: nothing of it is patched; its eager attention
# (softmax in fp32 over the materialized scores) is the implementation compared with.
#
# fp32 throughout. Measured (2 layers, T=48): logits within 3e-6 (|logit| up to 3.4), the loss
# within 5e-7, gradients within 1.4e-7. Where it comes from, layer by layer on the same input: the
# RMSNorms and the GEMMs (fused QKV and gate/up against HF's separate ones) agree bit for bit;
# attention (SDPA's blockwise softmax against HF's eager one) and SwiGLU (SiLU of the strided gate)
# differ by an ulp, ~1e-7; the residual stream carries ~7e-7 after two layers, and the final
# RMSNorm and head scale it to the logits' 3e-6. RoPE's tables differ by 1.7e-6 (HF's angles are
# fp32 products, ours fp64 rounded once), which does not show at this length.
LLAMA_TOL = dict(atol=2e-5, rtol=1e-4)


def llama_tiny(n_kv_heads, bias=False) -> ModelConfig:
    # init_std 0.1 rather than 0.02 so logits are O(1) and the tolerance means something.
    return ModelConfig(n_layers=2, n_heads=4, n_kv_heads=n_kv_heads, d_model=64, vocab_size=128, max_seq_len=64,
                       norm="rmsnorm", mlp="swiglu", ffn_hidden_size=96, bias=bias, rope_theta=500.0,
                       init_std=0.1, norm_eps=1e-5)


def both_models(cfg: ModelConfig):
    """Ours, initialised and with random norm weights (and biases), and LlamaForCausalLM holding the
    same weights."""
    from transformers import LlamaForCausalLM
    ours = GPT(cfg)
    ours.init_weights(0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # init sets these to 1 and 0: random, so a mis-mapped one shows
        for name, p in ours.named_parameters():
            if name.endswith("bias") or "ln_" in name or name.startswith("norm."):
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
    config = export_hf.hf_llama_config(cfg)
    config._attn_implementation = "eager"
    theirs = LlamaForCausalLM(config)
    state = export_hf.hf_llama_state({n: p.detach() for n, p in ours.named_parameters()}, cfg)
    missing, unexpected = theirs.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary_emb" in name for name in missing), (missing, unexpected)
    return ours, theirs


@pytest.mark.parametrize("n_kv_heads, bias", [(4, False), (2, False), (1, True)])  # MHA, GQA, MQA with biases
def test_llama_equals_transformers_llama(n_kv_heads, bias):
    cfg = llama_tiny(n_kv_heads, bias)
    ours, theirs = both_models(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(2))
    logits = ours(tokens)
    loss = kernels.cross_entropy(logits[:, :-1], tokens[:, 1:])
    loss.backward()
    out = theirs(tokens, labels=tokens)  # HF shifts the labels itself
    out.loss.backward()

    hf_grads = dict(theirs.named_parameters())
    grads = export_hf.hf_llama_state({n: p.grad for n, p in ours.named_parameters()}, cfg)
    worst = max(((name, (g - hf_grads[name].grad).abs().max().item()) for name, g in grads.items()), key=lambda x: x[1])
    print(f"n_kv_heads={n_kv_heads} bias={bias}: logits {(logits - out.logits).abs().max():.2e} "
          f"(std {logits.std():.2f}), loss {loss.item():.6f} vs {out.loss.item():.6f}, "
          f"largest gradient difference {worst[1]:.2e} in {worst[0]}")
    assert logits.std() > 0.5
    torch.testing.assert_close(logits, out.logits, **LLAMA_TOL)
    torch.testing.assert_close(loss, out.loss, **LLAMA_TOL)
    for name, g in grads.items():
        torch.testing.assert_close(g, hf_grads[name].grad, **LLAMA_TOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("first, last, vpp, want", [
    (1, -1, 1, [[1], [3]]),                  # pp2: the first stage one block short of the last
    (0, -1, 1, [[0], [4]]),                  # the first stage the embedding alone
    (0, 0, 2, [[0, 2], [2, 0]]),             # pp2 vpp2: the first chunk the embedding, the last the head
])
def test_uneven_chunks_hold_chunk_layers_blocks_and_compute_the_whole_model(first, last, vpp, want):
    """parallel.pp_first/last_chunk_layers: each rank's chunks hold the blocks chunk_layers gives
    their virtual stages, under their global names, and the chunks run in model order (a chunk of
    no block too: the embedding alone, or the final norm and head alone) give the whole model's
    logits and gradients."""
    import copy

    import parallel
    from parallelisms.pipeline import split_for_pipeline
    torch.manual_seed(0)
    base = GPT(tiny(n_layers=4))
    tokens = torch.randint(0, 128, (2, 16))
    cfg = parallel.ParallelConfig(pp=2, vpp=vpp, pp_first_chunk_layers=first, pp_last_chunk_layers=last)
    layers = parallel.chunk_layers(4, cfg)
    ranks = [split_for_pipeline(copy.deepcopy(base), parallel.Layout(pp=2, pp_rank=r), layers) for r in range(2)]
    assert [[len(c.blocks) for c in chunks] for chunks in ranks] == want
    in_order = sorted((c for chunks in ranks for c in chunks), key=lambda c: c.stage)
    assert [int(name) for c in in_order for name in c.blocks] == list(range(4))
    h = tokens
    for chunk in in_order:
        h = chunk(h)
    h.sum().backward()
    whole = copy.deepcopy(base)
    expected = whole(tokens)
    expected.sum().backward()
    assert torch.equal(h, expected)
    grads = {n: p.grad for c in in_order for n, p in c.named_parameters()}
    assert grads.keys() == dict(whole.named_parameters()).keys()
    for name, p in whole.named_parameters():
        assert torch.equal(grads[name], p.grad), name


@pytest.mark.parametrize("pp", [1, 2])
def test_recompute_layers_recomputes_the_first_n_blocks_of_each_chunk_and_changes_no_gradient(pp):
    """train.recompute_layers=1 with recompute=full (Megatron-LM's block method): in one process
    (one chunk of 4 blocks) and in a pp2 layout (two chunks of 2, run one after the other here),
    exactly the first block of each chunk recomputes, and the loss and every gradient equal those
    of no recomputation and of full recomputation."""
    import copy

    import parallel
    from parallelisms.pipeline import split_for_pipeline
    torch.manual_seed(0)
    base = GPT(tiny(n_layers=4))
    tokens = torch.randint(0, 128, (2, 16))

    def run(mode, layers):
        chunks = [c for r in range(pp) for c in split_for_pipeline(copy.deepcopy(base), parallel.Layout(pp=pp, pp_rank=r), [4 // pp] * pp)]
        for chunk in chunks:
            parallel.apply_recompute(chunk, mode, layers)
        h = tokens
        for chunk in chunks:
            h = chunk(h)
        loss = torch.nn.functional.cross_entropy(h.flatten(0, 1), tokens.flatten())
        loss.backward()
        on = [[b.recompute for b in c.blocks.values()] for c in chunks]
        grads = {n: p.grad for c in chunks for n, p in c.named_parameters()}
        return loss.detach(), grads, on

    loss_none, grads_none, _ = run("none", -1)
    loss_full, grads_full, on_full = run("full", -1)
    loss_one, grads_one, on_one = run("full", 1)
    per_chunk = 4 // pp
    assert on_full == [[True] * per_chunk] * pp
    assert on_one == [[True] + [False] * (per_chunk - 1)] * pp
    assert loss_one == loss_none == loss_full
    assert grads_one.keys() == grads_none.keys() == grads_full.keys()
    for name in grads_none:
        assert torch.equal(grads_one[name], grads_none[name]) and torch.equal(grads_one[name], grads_full[name]), name
