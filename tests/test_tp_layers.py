"""Each tensor-parallel primitive of parallelisms/tensor_parallel.py against its unsharded torch reference, on 2
gloo ranks, forward and backward: the column- and row-parallel linear layers with sequence
parallelism (the sequence sharded around them, as the blocks run them) and without (the input
whole on every rank), the vocab-parallel embedding, and the vocab-parallel head with its loss.
Every rank's output and gradients must be its slice of the reference's (fp32, within 1e-5
relative). The layout matrix (tests/test_parallel.py) checks the same layers inside whole runs;
these check one at a time, in a few seconds, on one spawn of two ranks. Where ZeRO gives a weight
a view of its gradient buffer, the layers' weight-gradient GEMM accumulates into it: over two
microbatches that equals the unfused accumulation (each gradient in the weight's dtype, added).
"""
import json
import os

import pytest
import torch
import torch.nn.functional as F

from conftest import spawn

TOL = 1e-5
B, T, D, OUT, VOCAB = 2, 8, 16, 24, 32
PRIMITIVES = ["column_sp", "column_sp_keep_full", "column", "row_sp", "row", "vocab_embedding", "vocab_head_and_loss"]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def reference(module, inputs: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """The unsharded module's output, its gradients left on its parameters (and inputs)."""
    out = module(inputs)
    (out * grad_out).sum().backward()
    return out.detach()


def seq_slice(t: torch.Tensor, tp) -> torch.Tensor:
    return t.chunk(tp.size, dim=1)[tp.rank]


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_()


def column_parallel(tp, sequence_parallel: bool, keep_full: bool = False) -> float:
    """Output features split (weight and bias rows). With SP the input is this rank's sequence
    slice, gathered inside (overlap.GatheredLinears, as the blocks call it); without, the whole
    input goes through the plain nn.Linear on its slices, and its input gradient is partial."""
    import torch.distributed as dist
    from parallelisms import overlap
    from parallelisms.tensor_parallel import COLWISE
    ref, x, gy = torch.nn.Linear(D, OUT), torch.randn(B, T, D, requires_grad=True), torch.randn(B, T, OUT)
    want = reference(ref, x, gy)
    dims = dict(COLWISE.split)
    w = leaf(ref.weight.chunk(tp.size, dims["weight"])[tp.rank])
    b = leaf(ref.bias.chunk(tp.size, dims["bias"])[tp.rank])
    cols = slice(tp.rank * w.shape[0], (tp.rank + 1) * w.shape[0])
    xs = leaf(seq_slice(x, tp) if sequence_parallel else x)
    if sequence_parallel:
        y, = overlap.GatheredLinears.apply(xs, tp.group, keep_full, w, b)
    else:
        y = F.linear(xs, w, b)
    (y * gy[..., cols]).sum().backward()
    x_grad = xs.grad
    if not sequence_parallel:
        dist.all_reduce(x_grad, group=tp.group.pg)
    return max(relative_error(y, want[..., cols]),
               relative_error(x_grad, seq_slice(x.grad, tp) if sequence_parallel else x.grad),
               relative_error(w.grad, ref.weight.grad[cols]), relative_error(b.grad, ref.bias.grad[cols]))


def row_parallel(tp, sequence_parallel: bool) -> float:
    """Input features split (weight columns), partial sums out. With SP they are reduce-scattered
    over the sequence and the whole bias added after, its gradient partial (a TP-replicated
    parameter); without, all-reduced (Megatron's row-parallel linear: identity backward)."""
    import torch.distributed as dist
    from parallelisms.tensor_parallel import ROWWISE, ReduceScatterSeq, RowParallelLinear
    ref, h, gy = torch.nn.Linear(OUT, D), torch.randn(B, T, OUT, requires_grad=True), torch.randn(B, T, D)
    want = reference(ref, h, gy)
    plain = torch.nn.Linear(OUT // tp.size, D)
    plain.weight = torch.nn.Parameter(ref.weight.detach().chunk(tp.size, dict(ROWWISE.split)["weight"])[tp.rank].clone())
    plain.bias = torch.nn.Parameter(ref.bias.detach().clone())
    layer = RowParallelLinear.from_plain(plain, tp)
    rows = slice(tp.rank * layer.weight.shape[1], (tp.rank + 1) * layer.weight.shape[1])
    hs = leaf(h[..., rows])
    partial = layer(hs)
    if sequence_parallel:
        y = ReduceScatterSeq.apply(partial, tp.group) + layer.bias
        gy, want = seq_slice(gy, tp), seq_slice(want, tp)
    else:
        summed = partial.detach().clone()
        dist.all_reduce(summed, group=tp.group.pg)
        y = partial + (summed - partial.detach()) + layer.bias
    (y * gy).sum().backward()
    bias_grad = layer.bias.grad
    if sequence_parallel:
        dist.all_reduce(bias_grad, group=tp.group.pg)
    return max(relative_error(y, want), relative_error(hs.grad, h.grad[..., rows]),
               relative_error(layer.weight.grad, ref.weight.grad[:, rows]), relative_error(bias_grad, ref.bias.grad))


def vocab_embedding(tp) -> float:
    """The vocabulary's rows split; out comes this rank's slice of the sequence, summed."""
    from parallelisms.tensor_parallel import VOCAB_PARALLEL_EMBEDDING, VocabParallelEmbedding
    ref, tokens, gy = torch.nn.Embedding(VOCAB, D), torch.randint(0, VOCAB, (B, T)), torch.randn(B, T, D)
    want = reference(ref, tokens, gy)
    plain = torch.nn.Embedding(VOCAB // tp.size, D)
    plain.weight = torch.nn.Parameter(ref.weight.detach().chunk(tp.size, dict(VOCAB_PARALLEL_EMBEDDING.split)["weight"])[tp.rank].clone())
    layer = VocabParallelEmbedding.from_plain(plain, tp)
    y = layer(tokens)
    (y * seq_slice(gy, tp)).sum().backward()
    rows = slice(tp.rank * layer.weight.shape[0], (tp.rank + 1) * layer.weight.shape[0])
    return max(relative_error(y, seq_slice(want, tp)), relative_error(layer.weight.grad, ref.weight.grad[rows]))


def vocab_head_and_loss(tp) -> float:
    """The output projection's vocabulary rows split, on this rank's sequence slice, into the
    vocab-parallel cross-entropy: the loss and its gradients against F.cross_entropy's."""
    from parallelisms.tensor_parallel import VOCAB_PARALLEL_HEAD, VocabParallelHead, vocab_parallel_cross_entropy
    ref, x = torch.nn.Linear(D, VOCAB, bias=False), torch.randn(B, T, D, requires_grad=True)
    targets = torch.randint(0, VOCAB, (B, T))
    want = F.cross_entropy(ref(x).flatten(0, 1), targets.flatten())
    want.backward()
    plain = torch.nn.Linear(D, VOCAB // tp.size, bias=False)
    plain.weight = torch.nn.Parameter(ref.weight.detach().chunk(tp.size, dict(VOCAB_PARALLEL_HEAD.split)["weight"])[tp.rank].clone())
    head = VocabParallelHead.from_plain(plain, tp)
    xs = leaf(seq_slice(x, tp))
    loss = vocab_parallel_cross_entropy(head(xs), targets, tp)
    loss.backward()
    rows = slice(tp.rank * head.weight.shape[0], (tp.rank + 1) * head.weight.shape[0])
    return max(relative_error(loss, want), relative_error(xs.grad, seq_slice(x.grad, tp)),
               relative_error(head.weight.grad, ref.weight.grad[rows]))


class BufferSink:
    """zero.GradientSink as the layers' backward sees it (zero.weight_gradient): take() gives a
    gradient buffer's view."""

    def __init__(self, view: torch.Tensor):
        self.view = view

    def take(self) -> torch.Tensor:
        return self.view


FUSED = {"column_sp_fp32": ("column_sp", torch.float32), "column_sp_bf16": ("column_sp", torch.bfloat16),
         "row_sp_fp32": ("row_sp", torch.float32), "row_sp_bf16": ("row_sp", torch.bfloat16)}


def fused_accumulation(tp, layer: str, dtype: torch.dtype) -> float:
    """A column-parallel (overlap.GatheredLinears) or row-parallel (RowParallelLinear) layer's weight
    gradient accumulated by its own GEMM into an fp32 buffer over two microbatches, against the
    same layer unfused: each microbatch's gradient left on .grad in the weight's dtype and added
    into a buffer, as parallelisms/zero.py adds the other gradients. fp32: the GEMM's C += A @ B; bf16 on a CPU:
    the product, then the add, so exactly the unfused sums. inf if the fused weight got a .grad."""
    from parallelisms import overlap
    from parallelisms.tensor_parallel import RowParallelLinear
    torch.manual_seed(1)
    column = layer == "column_sp"
    shape = (OUT // tp.size, D) if column else (D, OUT // tp.size)
    weight = torch.randn(shape).to(dtype)
    fused, plain = leaf(weight), leaf(weight)
    sums = {"fused": torch.zeros(shape), "plain": torch.zeros(shape)}
    fused.grad_sink = BufferSink(sums["fused"])  # as ZeroDataParallel.attach sets a parameter's
    for _ in range(2):
        x = torch.randn(B, T // tp.size if column else T, shape[1]).to(dtype)
        gy = torch.randn(B, T, shape[0]).to(dtype)
        for name, w in (("fused", fused), ("plain", plain)):
            y = overlap.GatheredLinears.apply(x, tp.group, False, w, None)[0] if column else RowParallelLinear(w, None)(x)
            (y * gy).sum().backward()
            if w.grad is not None:
                if name == "fused":
                    return float("inf")
                sums[name].add_(w.grad)
                w.grad = None
    return relative_error(sums["fused"], sums["plain"])


# The sequence-parallel block against model.Block, in each TP overlap mode: GPT's (LayerNorm, GeLU)
# and Llama's (RMSNorm, SwiGLU, grouped-query attention with a KV head per rank at tp2), also as
# PTB (one gather and one reduce-scatter shared by attention and the MLP), and multi-query
# attention, whose one KV head both ranks hold (each computing two of the four query heads).
GPT_BLOCK = dict(n_layers=1, n_heads=4, d_model=32, vocab_size=64)
LLAMA_BLOCK = dict(GPT_BLOCK, norm="rmsnorm", mlp="swiglu", ffn_hidden_size=24, n_kv_heads=2, bias=False)
MQA_BLOCK = dict(LLAMA_BLOCK, n_kv_heads=1, bias=True)
SHAPES = {"gpt": GPT_BLOCK, "llama": LLAMA_BLOCK, "llama_ptb": dict(LLAMA_BLOCK, block="parallel"),
          "mqa": MQA_BLOCK, "mqa_ptb": dict(MQA_BLOCK, block="parallel")}
BLOCKS = {f"{model}_block_{mode}": (shape, mode) for model, shape in SHAPES.items() for mode in ("off", "chunked", "domino")}
# Without sequence parallelism (parallel.sequence_parallel=false): the whole sequence on each rank,
# sequential and PTB, and multi-query attention (a KV group on both ranks, its rows still summed).
BLOCKS.update({f"{model}_block_no_sp": (SHAPES[model], "off", False) for model in ("gpt", "llama", "llama_ptb", "mqa")})
BLOCKS["gpt_ptb_block_no_sp"] = (dict(GPT_BLOCK, block="parallel"), "off", False)


def sequence_parallel_block(tp, shape: dict, mode: str, sequence_parallel: bool = True) -> float:
    """apply_tp's SequenceParallelBlock on this rank's slice of the sequence against the plain
    block on all of it: its output and input gradient are this rank's slices of the reference's,
    each split parameter's gradient its slice (the plan's dim), and each replicated one's (the
    norms', a shared KV group's: summed by ZeRO in a run) summed over its replicas (at tp2 the
    TP group) the whole gradient. Without sequence parallelism the slice is the whole sequence
    and the norms' and biases' gradients are whole on each rank, not summed (tp_summed_replicas)."""
    import copy
    import torch.distributed as dist
    from parallelisms import tensor_parallel as tpl
    from model import GPT, ModelConfig
    torch.manual_seed(2)
    ref = GPT(ModelConfig(**shape))
    ref.init_weights(0)
    for name, p in ref.named_parameters():  # norm weights and biases off their init, to be seen
        if p.dim() == 1:
            p.data.add_(0.1 * torch.randn_like(p))
    model = copy.deepcopy(ref)
    tp = tpl.TPSettings(group=tp.group, rank=tp.rank, size=tp.size, overlap=mode, pieces=2,
                        sequence_parallel=sequence_parallel)
    tpl.apply_tp(model, tp)
    x, gy = torch.randn(B, T, shape["d_model"], requires_grad=True), torch.randn(B, T, shape["d_model"])
    want = reference(ref.blocks["0"], x, gy)
    mine = (lambda t: seq_slice(t, tp)) if sequence_parallel else (lambda t: t)
    xs = leaf(mine(x))
    y = model.blocks["0"](xs)
    (y * mine(gy)).sum().backward()
    errors = [relative_error(y, mine(want)), relative_error(xs.grad, mine(x.grad))]
    infos, wanted = tpl.tp_shard_infos(model, tp), dict(ref.named_parameters())
    for name, p in model.blocks["0"].named_parameters():
        info, full = infos[f"blocks.0.{name}"], wanted[f"blocks.0.{name}"].grad
        grad = p.grad
        if info.tp_replicas > 1 and info.tp_partial_grad:
            assert info.tp_replicas == tp.size
            dist.all_reduce(grad, group=tp.group.pg)
        if info.split_dim is not None:
            full = full.narrow(info.split_dim, info.offset, p.shape[info.split_dim])
        errors.append(relative_error(grad, full))
    return max(errors)


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from parallelisms.overlap import TPGroup, WaitClock
    from parallelisms.tensor_parallel import TPSettings
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)  # the same references on both ranks
    tp = TPSettings(group=TPGroup(dist.group.WORLD, world, WaitClock()), rank=rank, size=world)
    errors = {"column_sp": column_parallel(tp, True), "column_sp_keep_full": column_parallel(tp, True, True),
              "column": column_parallel(tp, False), "row_sp": row_parallel(tp, True), "row": row_parallel(tp, False),
              "vocab_embedding": vocab_embedding(tp), "vocab_head_and_loss": vocab_head_and_loss(tp),
              **{name: fused_accumulation(tp, *how) for name, how in FUSED.items()},
              **{name: sequence_parallel_block(tp, *how) for name, how in BLOCKS.items()}}
    with open(os.path.join(out_dir, f"errors_{rank}.json"), "w") as f:
        json.dump(errors, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def errors(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp_layers")
    spawn(_worker, 2, str(out))
    return [json.loads((out / f"errors_{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize("primitive", PRIMITIVES)
def test_tp_primitive_equals_its_unsharded_reference(primitive, errors):
    for rank, found in enumerate(errors):
        assert found[primitive] < TOL, f"{primitive} on rank {rank}: relative error {found[primitive]:.2e}"


@pytest.mark.parametrize("block", list(BLOCKS))
def test_sequence_parallel_block_equals_the_plain_block(block, errors):
    for rank, found in enumerate(errors):
        assert found[block] < TOL, f"{block} on rank {rank}: relative error {found[block]:.2e}"


@pytest.mark.parametrize("primitive", list(FUSED))
def test_fused_weight_gradient_equals_the_unfused_accumulation(primitive, errors):
    exact = FUSED[primitive][1] == torch.bfloat16  # a CPU's bf16 path runs the unfused ops
    for rank, found in enumerate(errors):
        assert found[primitive] == 0.0 if exact else found[primitive] < 1e-6, (primitive, rank, found[primitive])


@pytest.mark.parametrize("model_name", ["gpt", "llama", "mqa"])
def test_apply_tp_walks_the_plan_and_keeps_every_name(model_name):
    """apply_tp on a meta-built GPT (or Llama): the same parameter names in the same order, each
    split one 1/tp of its plan's dim (QKV's whole with one KV head, on both ranks), the TP modules
    in the plain ones' places."""
    from parallelisms import tensor_parallel as tpl
    from model import GPT, ModelConfig
    shape = dict(SHAPES[model_name], n_layers=2, d_model=64, vocab_size=128)
    with torch.device("meta"):
        plain, model = (GPT(ModelConfig(**shape)) for _ in range(2))
    tpl.apply_tp(model, tpl.TPSettings(rank=1, size=2))
    before, after = dict(plain.named_parameters()), dict(model.named_parameters())
    assert list(before) == list(after)
    mqa_qkv = model_name == "mqa"
    for name, p in after.items():
        dim = tpl.tp_shard_dim(name)
        want = list(before[name].shape)
        if dim is not None and not (mqa_qkv and ".attn.qkv." in name):
            want[dim] //= 2
        assert list(p.shape) == want, name
    assert isinstance(model.blocks["0"], tpl.SequenceParallelBlock)
    assert isinstance(model.blocks["1"].attn.out, tpl.RowParallelLinear)
    assert isinstance(model.embed, tpl.VocabParallelEmbedding) and isinstance(model.head, tpl.VocabParallelHead)
    infos = tpl.tp_shard_infos(model, tpl.TPSettings(rank=1, size=2))
    assert infos["embed.weight"].offset == 64 and infos["blocks.0.attn.out.weight"].offset == 32
    assert {n for n, i in infos.items() if i.tp_replicas == 2} == {
        n for n in after if ".ln_" in n or n.startswith("norm.") or n.endswith(("attn.out.bias", "mlp.fc_out.bias"))
        or (mqa_qkv and ".attn.qkv." in n)}
    assert all(i.tp_replicas in (1, 2) for i in infos.values())
    if mqa_qkv:
        assert isinstance(model.blocks["0"].attn.qkv, tpl.KVGroupQKV) and model.blocks["0"].attn.group == 2
        assert infos["blocks.0.attn.qkv.weight"].offset == 0


def test_recompute_and_tp_apply_in_either_order():
    """A TP block takes its plain block's recompute switch (and keeps no re-gather hooks then), so
    recompute before TP is recompute after TP; a module already hooked is refused, not replaced
    with its hooks dropped."""
    import parallel
    from parallelisms import tensor_parallel as tpl
    from model import GPT, ModelConfig
    for first in ("recompute", "tp"):
        with torch.device("meta"):
            model = GPT(ModelConfig(n_layers=1, n_heads=4, d_model=64, vocab_size=128))
        steps = [lambda: parallel.apply_recompute(model, "full"), lambda: tpl.apply_tp(model, tpl.TPSettings(size=2))]
        for step in steps if first == "recompute" else steps[::-1]:
            step()
        assert isinstance(model.blocks["0"], tpl.SequenceParallelBlock) and model.blocks["0"].recompute, first
    with torch.device("meta"):
        model = GPT(ModelConfig(n_layers=1, n_heads=4, d_model=64, vocab_size=128))
    model.blocks["0"].register_forward_pre_hook(lambda *_: None)
    with pytest.raises(ValueError, match="blocks.0 has forward hooks"):
        tpl.apply_tp(model, tpl.TPSettings(rank=0, size=2))
