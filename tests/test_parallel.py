"""3D parallelism against one process: every layout must give the same losses and final weights
on the same global batch (fp32, within 1e-5 relative), with real gloo ranks (forked as torchrun would
start them: tests/forked.py; the CI stress pass launches the 8-rank and pp2 vpp2 layouts with torchrun)."""
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

import checkpoint
import forked
from conftest import EIGHT_RANKS, EXACT, EXACT_STEPS, SMALL, first_good_run, read_metrics, run_train, spawn

STEPS = EXACT_STEPS

LAYOUTS = {  # name: (ranks, overrides). Plain pp2 (1F1B) runs inside pp2_dp2, plain TP (tp2 x dp1)
    # inside tp2_recompute_full_megascale_data and tp2_dp2, TP x PP inside
    # tp2_pp2_dp2_overlap (8 ranks, every overlap on), and the ZeRO-2 path inside
    # dp2_zero2_overlap (the same reductions, per bucket) and pp2_dp2.
    "pp2_vpp2": (2, ["parallel.pp=2", "parallel.vpp=2", "parallel.microbatches=4"]),
    "dp2_zero0": (2, ["parallel.zero_stage=0"]),  # plain data parallelism: 2 ranks = 1 rank
    "dp2_zero1": (2, ["parallel.zero_stage=1"]),
    "tp2_dp2": (4, ["parallel.tp=2", "parallel.zero_stage=1"]),
    "pp2_dp2": (4, ["parallel.pp=2", "parallel.microbatches=2", "parallel.zero_stage=2"]),
    # The overlap switches change when collectives run, never the maths: each layout the
    # 3D matrix has, with its overlap on, equals the single process.
    "tp2_overlap_chunked": (2, ["parallel.tp=2", "parallel.overlap.tp=chunked", "parallel.overlap.tp_chunks=2"]),
    "tp2_overlap_domino": (2, ["parallel.tp=2", "parallel.overlap.tp=domino", "parallel.overlap.tp_chunks=2"]),
    "pp2_vpp2_overlap": (2, ["parallel.pp=2", "parallel.vpp=2", "parallel.microbatches=4", "parallel.overlap.pp=true"]),
    "dp2_zero2_overlap": (2, ["parallel.zero_stage=2", "parallel.overlap.dp=true", "parallel.microbatches=2"]),
    # DeepSpeed's ZeRO-2: each microbatch's gradients reduce-scattered into the shard
    "dp2_zero2_each_overlap": (2, ["parallel.zero_stage=2", "parallel.overlap.dp=true", "parallel.microbatches=2",
                                   "parallel.reduce_each_microbatch=true"]),
    # ZeRO-3: each module's parameters gathered for its forward and again for its backward, freed
    # after each (or, reshard_after_forward=false, kept from forward to backward); under a
    # pipeline too, where the interleaved schedule runs other microbatches between a module's
    # forward and its backward (dp1 there: the gathers are copies; pp2_dp2 gathers over DP).
    "dp2_zero3": (2, ["parallel.zero_stage=3"]),
    "dp2_zero3_overlap": (2, ["parallel.zero_stage=3", "parallel.overlap.dp=true", "parallel.microbatches=2"]),
    "dp2_zero3_no_reshard": (2, ["parallel.zero_stage=3", "parallel.reshard_after_forward=false",
                                 "parallel.microbatches=2"]),
    "pp2_dp2_zero3_overlap": (4, ["parallel.pp=2", "parallel.microbatches=2", "parallel.zero_stage=3",
                                  "parallel.overlap.dp=true"]),
    "pp2_vpp2_zero3_overlap": (2, ["parallel.pp=2", "parallel.vpp=2", "parallel.microbatches=4", "parallel.zero_stage=3",
                                   "parallel.overlap.dp=true", "parallel.overlap.pp=true"]),
    "tp2_dp2_zero3_recompute_full": (4, ["parallel.tp=2", "parallel.zero_stage=3", "train.recompute=full"]),
    # Hybrid sharding (parallel.dp_shard): ZeRO shards over dp_shard consecutive DP ranks, each shard
    # summed over its replicas; dp_shard=1 shards nothing and all-reduces every shard over dp. (Hybrid
    # ZeRO-1 at dp4: test_checkpoint's cross resume and test_zero_buckets' hybrid test.)
    "dp4_shard2_zero3_overlap": (4, ["parallel.zero_stage=3", "parallel.dp_shard=2", "parallel.overlap.dp=true",
                                     "parallel.microbatches=2"]),
    "pp2_dp2_shard1_zero2": (4, ["parallel.pp=2", "parallel.microbatches=2", "parallel.zero_stage=2",
                                 "parallel.dp_shard=1"]),
    "tp2_dp2_shard1_zero3": (4, ["parallel.tp=2", "parallel.zero_stage=3", "parallel.dp_shard=1"]),
    # (plain 1F1B here: pp2_vpp2_overlap has the interleaved schedule)
    "tp2_pp2_dp2_overlap": (8, EIGHT_RANKS),  # the CI stress pass's run (conftest.eight_rank_run)
    # Also data.pipeline=megascale (the reference reads naively): one reader per TP group plus
    # background prefetch must hand every rank the very batches it would have read itself.
    "tp2_recompute_full_megascale_data": (2, ["parallel.tp=2", "train.recompute=full", "data.pipeline=megascale"]),
    "recompute_selective_megascale_data": (1, ["train.recompute=selective", "data.pipeline=megascale"]),
    # Full recomputation of the first of each stage's two blocks only (train.recompute_layers).
    "pp2_recompute_layers": (2, ["parallel.pp=2", "parallel.microbatches=2", "train.recompute=full",
                                 "train.recompute_layers=1"]),
    # Uneven pipeline chunks (parallel.pp_first/last_chunk_layers): stages of 1 and 3 blocks, each
    # recomputing up to 3 (train.recompute_layers counts against the largest chunk); then first and
    # last chunks of no block (the embedding alone, the final norm and head alone: the tail's ZeRO-3
    # gather hooked on the chunk itself) around two of 2, interleaved, every overlap on; and 1F1B's
    # last stage the tail alone, its gradients reduced per bucket as the backward goes.
    "pp2_uneven_recompute_layers": (2, ["parallel.pp=2", "parallel.pp_first_chunk_layers=1", "parallel.microbatches=2",
                                        "train.recompute=full", "train.recompute_layers=3"]),
    "pp2_vpp2_uneven_empty_ends_zero3_overlap": (2, ["parallel.pp=2", "parallel.vpp=2", "parallel.microbatches=4",
                                                     "parallel.pp_first_chunk_layers=0", "parallel.pp_last_chunk_layers=0",
                                                     "parallel.zero_stage=3", "parallel.overlap.dp=true",
                                                     "parallel.overlap.pp=true"]),
    "pp2_empty_last_zero2_overlap": (2, ["parallel.pp=2", "parallel.pp_last_chunk_layers=0", "parallel.microbatches=2",
                                         "parallel.zero_stage=2", "parallel.overlap.dp=true"]),
    # Two middle stages, which read no batch (a shaped placeholder), between two that do.
    "pp4_megascale_data": (4, ["parallel.pp=4", "parallel.microbatches=4", "data.pipeline=megascale"]),
    # TP without sequence parallelism: the stream replicated, the norms' and biases' gradients whole
    # on each rank (summed over TP they would count twice; the gradient norm counts them once).
    "tp2_no_sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=false"]),
    # Its pipeline messages sent in 1/tp slices and all-gathered over TP on receipt (Megatron-LM's
    # scatter/gather, the default), and sent whole.
    "tp2_pp2_no_sp": (4, ["parallel.tp=2", "parallel.pp=2", "parallel.microbatches=2", "parallel.sequence_parallel=false"]),
    "tp2_pp2_no_sp_whole_sends": (4, ["parallel.tp=2", "parallel.pp=2", "parallel.microbatches=2",
                                      "parallel.sequence_parallel=false", "parallel.pp_scatter_gather=false"]),
}

# The Llama block (llama_tiny: RMSNorm, SwiGLU, 4 query heads sharing 2 KV heads, no biases)
# through the TP paths that differ from GPT's, not the whole matrix again (three runs, not
# thirteen): DP, ZeRO and PP see only parameters, whatever the block. At tp2 a rank holds one KV
# group (its 2 query heads, k and v) and half of the interleaved gate/up rows; each TP overlap mode
# runs its own schedule of the block: off here, domino, and chunked inside the tp2 x pp2 run (two
# blocks a stage). tests/test_tp_layers.py checks the block alone in every mode, sequential and
# PTB; resume (a one-process checkpoint read back as TP slices) is tests/test_checkpoint.py's.
# With one KV head (multi-query) both tp2 ranks hold its QKV rows, each computing two query heads:
# ZeRO sums the rows' gradients over the two, and the gradient norm counts them once. At tp4 each
# of llama_tiny's 2 KV groups is on 2 of the 4 ranks: the sum runs over those two (a sub-group of TP).
LLAMA = ["model=llama_tiny" if o == "model=tiny" else o for o in EXACT]
LLAMA_MQA = LLAMA + ["model.n_kv_heads=1"]
LLAMA_LAYOUTS = {
    "llama_tp2": (2, ["parallel.tp=2"]),
    "llama_tp2_overlap_domino": (2, ["parallel.tp=2", "parallel.overlap.tp=domino", "parallel.overlap.tp_chunks=2"]),
    "llama_tp2_pp2_overlap_chunked": (4, ["parallel.tp=2", "parallel.pp=2", "parallel.microbatches=2",
                                          "parallel.overlap.tp=chunked", "parallel.overlap.tp_chunks=2"]),
    "llama_mqa_tp2": (2, ["parallel.tp=2"]),
    "llama_tp4": (4, ["parallel.tp=4"]),
    "llama_tp2_dp2_zero3_overlap": (4, ["parallel.tp=2", "parallel.zero_stage=3", "parallel.overlap.dp=true"]),
}
BASES = {**{name: EXACT for name in LAYOUTS}, **{name: LLAMA for name in LLAMA_LAYOUTS}, "llama_mqa_tp2": LLAMA_MQA}

STRESSED = {"pp2_vpp2_overlap"}  # layouts whose run here is the first of the CI stress pass's


@pytest.fixture(scope="module")
def references(tmp_path_factory, cache_dir):
    """The one-process run of a base config (EXACT or LLAMA): its metrics and final weights, run once."""
    found = {}

    def of(base: list):
        key = tuple(base)
        if key not in found:
            run_dir = tmp_path_factory.mktemp("reference")
            run_train(run_dir, base, cache_dir)
            found[key] = read_metrics(run_dir), checkpoint.consolidate_model(checkpoint.step_dir(run_dir / "checkpoints", STEPS))
        return found[key]
    return of


@pytest.mark.parametrize("name", list(LAYOUTS) + list(LLAMA_LAYOUTS))
def test_layout_equals_single_process(name, references, tmp_path, cache_dir, request):
    base = BASES[name]
    ranks, overrides = LAYOUTS.get(name) or LLAMA_LAYOUTS[name]
    if overrides is EIGHT_RANKS:
        tmp_path = request.getfixturevalue("eight_rank_run")
    elif name in STRESSED:  # the CI stress pass runs it anyway (tests/test_stress.py)
        tmp_path = first_good_run(request.getfixturevalue("ci_stress")(name))
    else:
        run_train(tmp_path, base + overrides, cache_dir, nproc=ranks)
    ref_rows, ref_weights = references(base)
    rows = read_metrics(tmp_path)
    assert len(rows) == STEPS
    for got, want in zip(rows, ref_rows):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), (name, got["step"])
        if name in LLAMA_LAYOUTS or "no_sp" in name or "_shard" in name:  # each element counted once, a replicated one too
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), (name, got["step"])
    assert rows[-1]["val_loss"] == pytest.approx(ref_rows[-1]["val_loss"], rel=1e-5)
    weights = checkpoint.consolidate_model(checkpoint.step_dir(tmp_path / "checkpoints", STEPS))
    assert weights.keys() == ref_weights.keys()
    names = list(ref_weights)
    flat = lambda w: torch.cat([w[k].double().flatten() for k in names])
    assert relative_error(flat(weights), flat(ref_weights)) < 1e-5
    for key in names:  # a missing or doubled reduction shows up as ~1e-1 here
        assert relative_error(weights[key], ref_weights[key]) < 1e-4, key
    if name in ("dp2_zero1", "dp2_zero2_overlap", "dp2_zero3"):
        assert_zero_splits_the_optimizer_state(checkpoint.step_dir(tmp_path / "checkpoints", STEPS))


# Llama's block with every non-TP MegaScale switch: PTB, SWA, fused operators, LAMB.
LLAMA_EVERY_SWITCH = [a for a in EXACT if a != "model=tiny"] + [
    "model=llama_tiny", "model.block=parallel", "model.attention.window=32", "kernels.fused=true", "optim=lamb",
    "optim.warmup_steps=1", "train.lr=1e-2"]  # the full rate from the first step, so 3 steps show a fall


def test_llama_with_every_switch_learns_and_pp2_dp2_equals_one_process(tmp_path, cache_dir):
    """llama_tiny with PTB, SWA, kernels.fused and LAMB trains in one process, its loss falling,
    and a pipeline of two stages (which delete the blocks they don't own) times ZeRO-2 data
    parallelism gives the same losses and weights."""
    run_train(tmp_path / "one", LLAMA_EVERY_SWITCH, cache_dir)
    run_train(tmp_path / "pp2_dp2", LLAMA_EVERY_SWITCH + LAYOUTS["pp2_dp2"][1], cache_dir, nproc=4)
    one, four = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "pp2_dp2")
    print("llama_tiny, every switch: losses", [round(r["loss"], 4) for r in one], "pp2 x dp2", [round(r["loss"], 4) for r in four])
    assert len(one) == len(four) == STEPS and one[-1]["loss"] < one[0]["loss"] - 0.05, [r["loss"] for r in one]
    for got, want in zip(four, one):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), got["step"]
    weights = [checkpoint.consolidate_model(checkpoint.step_dir(tmp_path / run / "checkpoints", STEPS))
               for run in ("one", "pp2_dp2")]
    assert weights[0].keys() == weights[1].keys()
    for key in weights[0]:
        assert relative_error(weights[1][key], weights[0][key]) < 1e-4, key


def test_the_megascale_data_pipeline_changes_no_bit_at_tp2(tmp_path, cache_dir):
    """tp2: one reader per TP group prefetching and broadcasting the narrow token stream gives
    the very losses each rank reading its own batch gives, bit for bit (tests/test_data.py
    checks the batches, the bytes broadcast, and who reads)."""
    losses = {}
    for pipeline in ("naive", "megascale"):
        run_train(tmp_path / pipeline, EXACT + ["parallel.tp=2", f"data.pipeline={pipeline}"], cache_dir, nproc=2)
        losses[pipeline] = [(row["loss"], row.get("val_loss")) for row in read_metrics(tmp_path / pipeline)]
    assert len(losses["naive"]) == STEPS and losses["megascale"] == losses["naive"]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want||. Elementwise tolerances are the wrong measure after Adam steps: Adam
    divides each element's update by that element's own gradient scale, so where the gradient is
    at rounding level the update is still ~lr and its sign is noise. Two such places exist: the
    key bias, whose gradient is zero analytically (a constant added to every key's logit leaves
    the softmax unchanged), and embedding rows of tokens the batch barely touches. Measured over 3
    steps at tp2: the whole model agrees to 2.6e-7, every tensor but the QKV bias to 2.6e-6, and
    the QKV bias to 3.8e-5 (max abs 2e-7)."""
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


def assert_zero_splits_the_optimizer_state(folder):
    """ZeRO-1/2 at dp2: each rank holds (and saved) half of the Adam moments, not all of them."""
    full = checkpoint.consolidate_model(folder)
    # Two Adam moments per element; each tensor's values are split into dp=2 equal, zero-padded pieces.
    per_rank = sum(2 * -(-t.numel() // 2) for t in full.values())
    assert per_rank < 0.51 * 2 * sum(t.numel() for t in full.values())
    # What each rank saved is what it held: DCP records which rank's file every piece is in.
    meta = torch.distributed.checkpoint.FileSystemReader(folder).read_metadata()
    held = {0: 0, 1: 0}
    for index, info in meta.storage_data.items():
        if index.fqn.endswith(("/exp_avg", "/exp_avg_sq")):
            sizes = next(c.sizes for c in meta.state_dict_metadata[index.fqn].chunks if c.offsets == index.offset)
            held[int(info.relative_path.split("_")[2])] += sizes.numel()
    padding = sum(2 * (-(-t.numel() // 2) * 2 - t.numel()) for t in full.values())
    assert held[0] + held[1] == 2 * sum(t.numel() for t in full.values())
    assert abs(held[0] - per_rank) <= padding and abs(held[1] - per_rank) <= padding, (held, per_rank)


ORDERS = [  # (order, sizes, every rank's (rank, dp, pp, tp)) on 4 ranks
    # order=[dp,pp,tp] (outermost first): TP groups are consecutive ranks, one host's worth.
    (["dp", "pp", "tp"], {"tp": 2, "pp": 2}, [(0, 0, 0, 0), (1, 0, 0, 1), (2, 0, 1, 0), (3, 0, 1, 1)]),
    (["tp", "dp", "pp"], {"tp": 2}, [(0, 0, 0, 0), (1, 1, 0, 0), (2, 0, 0, 1), (3, 1, 0, 1)]),
]


def _mesh_coordinates(rank, world, port, out):
    """One spawned gloo rank: build each order's layout as train.py does and report its coordinates."""
    import torch.distributed as dist
    import parallel
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    for order, sizes, _ in ORDERS:
        cfg = parallel.ParallelConfig(order=list(order), **sizes)
        out.put((tuple(order), parallel.build_layout(cfg, rank, world, torch.device("cpu")).coordinates()))
    dist.destroy_process_group()


def test_rank_coordinates_follow_the_documented_order():
    """The mesh train.py builds (parallel.build_layout), on 4 real gloo ranks without a training run."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = forked.context()  # ranks forked from the preloaded server, not fresh interpreters
    out = ctx.Queue()
    procs = [ctx.Process(target=_mesh_coordinates, args=(r, 4, port, out)) for r in range(4)]
    for p in procs:
        p.start()
    found = {}
    for _ in range(len(procs) * len(ORDERS)):
        order, c = out.get(timeout=120)
        found.setdefault(order, []).append((c["rank"], c["dp"], c["pp"], c["tp"]))
    for p in procs:
        p.join(timeout=60)
    for order, _, expected in ORDERS:
        assert sorted(found[tuple(order)]) == expected, order


def test_bf16_tracks_fp32_at_tp2_dp2(tmp_path, cache_dir):
    """bf16 autocast with fp32 master weights follows fp32 training: over 20 steps of a small model
    the loss curves stay within 2% of each other (bf16 has 8 mantissa bits: ~0.4% per rounding,
    which averages out over a GEMM's sums, and the fp32 master weights keep updates exact)."""
    small = SMALL + ["model.d_model=64", "model.n_layers=2", "train.seq_len=32", "train.max_steps=20",
                     "parallel.tp=2", "parallel.zero_stage=2"]
    # fp32 at tp2 x dp2 equals one process (test_layout_equals_single_process), so one process is the reference.
    run_train(tmp_path / "fp32", small + ["precision=fp32", "parallel.tp=1", "parallel.zero_stage=0"], cache_dir)
    run_train(tmp_path / "bf16", small + ["precision=bf16"], cache_dir, nproc=4)
    fp32, bf16 = read_metrics(tmp_path / "fp32"), read_metrics(tmp_path / "bf16")
    assert fp32[-1]["loss"] < fp32[0]["loss"] - 0.5  # it trains
    for a, b in zip(fp32, bf16):
        assert b["loss"] == pytest.approx(a["loss"], rel=0.02), a["step"]


INVALID_LAYOUTS = [
    (["parallel.tp=3"], 3, "parallel.tp"),                      # 3 divides neither 4 heads nor 256
    (["parallel.tp=2"], 3, "parallel"),                         # 3 ranks cannot be tp2 x dp
    (["parallel.pp=3"], 3, "parallel.pp"),                      # 4 layers over 3 stages
    (["parallel.pp=2", "parallel.vpp=4"], 2, "parallel.pp"),    # 8 virtual stages, 4 layers
    (["parallel.pp=2", "parallel.vpp=2", "parallel.microbatches=3"], 2, "parallel.microbatches"),
    (["parallel.microbatches=3"], 2, "train.batch_size"),       # 8 sequences over dp2 x 3
    (["parallel.zero_stage=4"], 2, "parallel.zero_stage"),
    (["parallel.order=[dp,tp]"], 2, "parallel.order"),
    (["model=llama_tiny", "model.n_heads=12", "model.n_kv_heads=6", "model.d_model=384", "parallel.tp=4"], 4,
     "parallel.tp: tp=4 neither divides model.n_kv_heads=6 nor is a multiple"),  # 4 ranks cannot share 6 KV heads
    (["model=llama_tiny", "model.n_kv_heads=4", "model.ffn_hidden_size=702", "parallel.tp=4"], 4,
     "parallel.tp: tp=4 does not divide the MLP's width"),
    (["parallel.tp=2", "parallel.sequence_parallel=false", "parallel.overlap.tp=chunked"], 2, "parallel.overlap.tp"),
    (["parallel.tp=2", "parallel.sequence_parallel=false", "model.dropout=0.1"], 2, "model.dropout"),
    (["parallel.zero_stage=3", "train.compile=true"], 2, "train.compile"),
    (["parallel.zero_stage=1", "parallel.dp_shard=3"], 4, "parallel.dp_shard: 3 does not divide dp=4"),
    (["parallel.dp_shard=2"], 4, "parallel.dp_shard: 2 with parallel.zero_stage=0"),  # nothing to shard
]


@pytest.mark.parametrize("overrides, world, key", INVALID_LAYOUTS)
def test_invalid_layout_is_a_config_error_naming_its_key(overrides, world, key):
    """What train.py checks before any rank starts, on each layout (in this process)."""
    import config
    with pytest.raises(config.ConfigError) as err:
        config.validate(config.compose(SMALL + overrides), world)
    assert str(err.value).startswith(f"config error: {key}") and "\n" not in str(err.value)


@pytest.mark.parametrize("overrides, world, key", [INVALID_LAYOUTS[0], INVALID_LAYOUTS[4], INVALID_LAYOUTS[8]])
def test_invalid_layout_is_one_line_before_any_work(overrides, world, key, tmp_path, cache_dir):
    """train.py itself: the one line and exit 2 (two of the layouts; the rest share the path)."""
    proc = run_train(tmp_path, SMALL + overrides, cache_dir, check=False, WORLD_SIZE=world)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"config error: {key}"), proc.stderr


def gradients(engine) -> torch.Tensor:
    """Every gradient the optimizer would read, flat (reduced, unclipped)."""
    engine.finish_gradients(float("inf"))
    return torch.cat([s.grad.flatten() for s in engine.zero.shards])


def _compiled_pipeline(rank: int, world: int, port: int, out_dir: str, last_chunk_layers: int) -> None:
    import torch.distributed as dist
    import parallel
    from model import GPT, ModelConfig
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = parallel.ParallelConfig(pp=2, microbatches=2, pp_last_chunk_layers=last_chunk_layers)
    layout = parallel.build_layout(cfg, rank, world, torch.device("cpu"))
    tokens = torch.randint(0, 128, (4, 17), generator=torch.Generator().manual_seed(0))
    found = {}
    for compiled in (False, True):
        model = GPT(ModelConfig(n_layers=2, n_heads=4, d_model=64, vocab_size=128))
        model.init_weights(0)
        engine = parallel.build(model, layout, cfg)
        if compiled:  # the eager backend: dynamo traces the chunks, without inductor's compile time
            torch._dynamo.reset()
            engine.compile(backend="eager")
        loss = engine.forward_backward(tokens[:, :-1], tokens[:, 1:], torch.float32)
        found[compiled] = (loss.item(), gradients(engine))
    (Path(out_dir) / f"compiled_{rank}.json").write_text(json.dumps({
        "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
        "loss": [found[False][0], found[True][0]], "grad_diff": (found[False][1] - found[True][1]).abs().max().item()}))
    dist.destroy_process_group()


@pytest.mark.parametrize("last_chunk_layers", [-1, 0])
def test_compiled_chunks_run_in_the_pipeline(last_chunk_layers, tmp_path):
    """train.compile=true at pp2: the pipeline runs the compiled chunks (it used to keep its own
    list of the uncompiled ones), and they compute what the eager chunks do; a last chunk of the
    norm and head alone too, its DP hook on the chunk itself traced with it."""
    spawn(_compiled_pipeline, 2, str(tmp_path), last_chunk_layers)
    for rank in range(2):
        got = json.loads((tmp_path / f"compiled_{rank}.json").read_text())
        assert got["graphs"] >= 1, rank
        assert got["loss"][0] == pytest.approx(got["loss"][1], rel=1e-6) and got["grad_diff"] < 1e-6


def test_one_stage_compiles_forward_and_loss_as_one_graph():
    """train.compile=true on one stage without TP: the loss is in the compiled graph with the
    forward (one graph, no break), and the step computes what the eager step does."""
    import parallel
    from model import GPT, ModelConfig
    cfg = parallel.ParallelConfig(microbatches=2)
    layout = parallel.build_layout(cfg, 0, 1, torch.device("cpu"))
    tokens = torch.randint(0, 128, (4, 17), generator=torch.Generator().manual_seed(0))
    graphs, found = [], {}
    for compiled in (False, True):
        model = GPT(ModelConfig(n_layers=2, n_heads=4, d_model=64, vocab_size=128))
        model.init_weights(0)
        engine = parallel.build(model, layout, cfg)
        if compiled:  # a backend that keeps the graph and runs it as traced: no inductor compile time
            torch._dynamo.reset()
            assert "one graph" in engine.compile(backend=lambda gm, _: graphs.append(gm) or gm.forward)
        loss = engine.forward_backward(tokens[:, :-1], tokens[:, 1:], torch.float32)
        found[compiled] = (loss.item(), gradients(engine))
    assert len(graphs) == 1, f"{len(graphs)} graphs: a graph break"
    ops = {str(node.target) for node in graphs[0].graph.nodes}
    assert any("cross_entropy" in op or "log_softmax" in op or "logsumexp" in op for op in ops), ops
    assert found[True][0] == pytest.approx(found[False][0], rel=1e-6)
    assert (found[True][1] - found[False][1]).abs().max().item() < 1e-6


class _GemmCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # addmm_: a weight-gradient GEMM accumulating into ZeRO's gradient buffer (zero.weight_gradient)
        self.count += func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_,
                                              torch.ops.aten.bmm)
        return func(*args, **(kwargs or {}))


def _count_tp_collectives(rank: int, world: int, port: int, block: str, out_dir: str, mode: str = "off") -> None:
    import collections
    import torch.distributed as dist
    from parallelisms import overlap
    import parallel
    from model import GPT, ModelConfig
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = parallel.ParallelConfig(tp=2)
    cfg.overlap.tp, cfg.overlap.tp_chunks = mode, 2
    layout = parallel.build_layout(cfg, rank, world, torch.device("cpu"))
    model = GPT(ModelConfig(n_layers=3, n_heads=4, d_model=64, vocab_size=128, block=block))
    model.init_weights(0)
    engine = parallel.build(model, layout, cfg)
    counts = collections.Counter()
    for name in ("all_gather_single", "reduce_scatter_single"):
        original = getattr(dist, name)
        setattr(dist, name, lambda *a, _f=original, _n=name, **k: (counts.update([(phase, _n)]), _f(*a, **k))[1])
    gemms, hidden = _GemmCounter(), []  # per re-gather: the GEMMs that ran between its launch and its wait
    prefetch, tensor = overlap._Regather.prefetch, overlap._Regather.tensor

    def counted_prefetch(self):
        if self.pending and self.full is None and self.inflight is None:
            self.launched_at = gemms.count
        prefetch(self)

    def counted_tensor(self):
        if self.full is None:
            counted_prefetch(self)
            hidden.append(gemms.count - self.launched_at)
        return tensor(self)
    overlap._Regather.prefetch, overlap._Regather.tensor = counted_prefetch, counted_tensor
    tokens = torch.randint(0, 128, (2, 16))
    phase = "forward"
    loss = engine.loss_fn(engine.chunks[0](tokens), tokens)
    phase = "backward"
    with gemms:
        loss.backward()
    found = {f"{p} {n}": c for (p, n), c in counts.items()}
    (Path(out_dir) / f"{block}_{mode}_{rank}.json").write_text(json.dumps(dict(found, regather_hidden_gemms=hidden)))
    dist.destroy_process_group()


@pytest.mark.parametrize("block, per_layer", [("sequential", 2), ("parallel", 1)])
def test_ptb_halves_the_tp_collectives_per_layer(block, per_layer, tmp_path):
    """Under tp2 with sequence parallelism, a sequential block all-gathers and reduce-scatters twice
    (before/after attention and MLP); PTB does each once, since both branches read one LN output and
    their outputs are summed before the reduce-scatter. The embedding adds one reduce-scatter and
    the output projection one all-gather. Backward mirrors forward, and gathers each gathered
    input again for its weight gradient (only the shard was kept: Megatron-LM's way)."""
    spawn(_count_tp_collectives, 2, block, str(tmp_path))
    counts = json.loads((tmp_path / f"{block}_off_0.json").read_text())
    del counts["regather_hidden_gemms"]  # GatheredLinears re-gathers without saved-tensor hooks
    layers = 3
    assert counts == {
        "forward all_gather_single": per_layer * layers + 1, "forward reduce_scatter_single": per_layer * layers + 1,
        "backward all_gather_single": 2 * (per_layer * layers + 1),
        "backward reduce_scatter_single": per_layer * layers + 1}


@pytest.mark.parametrize("mode", ["chunked", "domino"])
def test_every_gathered_piece_is_gathered_again_for_backward(mode, tmp_path):
    """Under TP overlap a gathered piece is kept as its shard too (overlap.TPGroup.regather_saved), at a
    batch of 2: the GEMMs once read the transposed view of the gathered buffer, copied it, and
    saved the copy whole, which no hook could tell apart (only batch-1 pieces were re-gathered).
    Each re-gather is launched when its region's backward begins, and backward GEMMs run while it
    is on the wire: launched only when its GEMM needed it, it hid nothing (0 GEMMs)."""
    spawn(_count_tp_collectives, 2, "sequential", str(tmp_path), mode)
    counts = json.loads((tmp_path / f"sequential_{mode}_0.json").read_text())
    gathered = counts["forward all_gather_single"]
    assert gathered == 2 * 2 * 3 + 1  # two pieces at each of the 3 layers' two gathers, and the head's
    assert counts["backward all_gather_single"] == 2 * gathered
    hidden = counts["regather_hidden_gemms"]
    assert len(hidden) == gathered - 1  # the head's input is re-gathered by GatheredLinears
    assert min(hidden) >= 2, hidden  # at least one output projection's two GEMMs


@pytest.mark.parametrize("base", ["gpt", "llama_mqa"])
def test_lamb_under_tp2_dp2_zero2_equals_single_process_lamb(base, tmp_path, cache_dir):
    """Per-tensor trust ratios need the norms of whole logical tensors: the TP slices and ZeRO
    shards' partial norms are summed in one all-reduce over the stage's dp x tp ranks (with one
    KV head, QKV's ZeRO shards summed over TP first, then reduce-scattered over DP)."""
    lamb = {"gpt": EXACT, "llama_mqa": LLAMA_MQA}[base] + ["optim=lamb", "optim.trust_clamp=null"]
    run_train(tmp_path / "one", lamb, cache_dir)
    run_train(tmp_path / "four", lamb + ["parallel.tp=2", "parallel.zero_stage=2"], cache_dir, nproc=4)
    one, four = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "four")
    for a, b in zip(one, four):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    ref = checkpoint.consolidate_model(checkpoint.step_dir(tmp_path / "one" / "checkpoints", STEPS))
    got = checkpoint.consolidate_model(checkpoint.step_dir(tmp_path / "four" / "checkpoints", STEPS))
    names = list(ref)
    flat = lambda w: torch.cat([w[k].double().flatten() for k in names])
    assert relative_error(flat(got), flat(ref)) < 1e-5
    for key in names:
        assert relative_error(got[key], ref[key]) < 1e-4, key


@pytest.fixture(scope="module")
def ptb_tp2(tmp_path_factory, cache_dir):
    run_dir = tmp_path_factory.mktemp("ptb_tp2")
    run_train(run_dir, EXACT + ["model.block=parallel", "parallel.tp=2"], cache_dir, nproc=2)
    return read_metrics(run_dir), checkpoint.consolidate_model(checkpoint.step_dir(run_dir / "checkpoints", STEPS))


@pytest.mark.parametrize("mode", ["chunked", "domino"])
def test_tp_overlap_keeps_ptb_exact(mode, ptb_tp2, tmp_path, cache_dir):
    """PTB's shared collectives under chunked TP overlap: one region whose attention core sees
    the sequence reassembled in order from the gathered pieces; it equals overlap off."""
    run_train(tmp_path, EXACT + ["model.block=parallel", "parallel.tp=2", f"parallel.overlap.tp={mode}",
                                 "parallel.overlap.tp_chunks=2"], cache_dir, nproc=2)
    want_rows, want = ptb_tp2
    for got_row, want_row in zip(read_metrics(tmp_path), want_rows):
        assert got_row["loss"] == pytest.approx(want_row["loss"], rel=1e-5)
    got = checkpoint.consolidate_model(checkpoint.step_dir(tmp_path / "checkpoints", STEPS))
    flat = lambda w: torch.cat([w[k].double().flatten() for k in sorted(w)])
    assert relative_error(flat(got), flat(want)) < 1e-5


@pytest.mark.parametrize("mode", ["correct", "split", "misordered"])
def test_dp_overlap_layers_compute_with_this_steps_weights(mode):
    """Megatron-LM #950: with DP overlap every module's forward must see the weights the optimizer
    just produced. The probe compares each module's parameters, at its forward, with an
    independent all-gather of the updated shards; shifting every bucket's wait one module late
    (the bug) must be caught, by the probe or by autograd's in-place check on saved weights."""
    proc = forked.run([mode], dict(os.environ, OMP_NUM_THREADS="1"), nproc=2, timeout=300,
                      script="tests/dp_overlap_probe.py")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(lines[-1])
    if mode in ("correct", "split"):
        assert result["error"] is None and result["checked"] > 0 and result["moved"] > 1e-3
        assert result["stale"] == 0.0
    else:
        assert result["stale"] > 0 or "modified by an inplace operation" in (result["error"] or "")


def _group_timeouts(rank, world, port, out):
    """One spawned gloo rank: the timeout of every group a layout holds, the world's given at init
    as train.py gives it (launch.init_distributed) and the layout's at build_layout."""
    import datetime
    import torch.distributed as dist
    import parallel
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=77))
    layout = parallel.build_layout(parallel.ParallelConfig(tp=2, pp=2, microbatches=2), rank, world,
                                   torch.device("cpu"), timeout_s=77)
    groups = {**{n: layout.group(n) for n in ("dp", "pp", "tp")}, **{str(k): g for k, g in layout.pp_channels.items()},
              "dp_tp": parallel._norm_group(layout)}
    hybrid = parallel.build_layout(parallel.ParallelConfig(zero_stage=1, dp_shard=2), rank, world,
                                   torch.device("cpu"), timeout_s=77)
    groups.update({n: hybrid.group(n) for n in ("dp_shard", "dp_replicate")})
    found = {name: g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for name, g in groups.items()}
    whole = parallel.build_layout(parallel.ParallelConfig(), rank, world, torch.device("cpu"), timeout_s=77)
    from observe import oplog
    dims = oplog.dim_names(hybrid)
    out.put((found, whole.group("dp") is dist.group.WORLD and whole.group("dp_shard") is dist.group.WORLD
             and whole.group("dp_replicate") is None,
             [dims[hybrid.group(n).group_name] for n in ("dp_shard", "dp_replicate")]))
    dist.destroy_process_group()


def test_every_group_gets_the_configured_timeout():
    """Mesh dimensions, pipeline channels, the flattened dp x tp group and hybrid sharding's split
    of dp all time out after the configured seconds, not torch's 30-minute default; a dimension
    over every rank is the world group itself, not a second group over the same ranks (nor does
    ZeRO's shard group make one without hybrid sharding)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = forked.context()
    out = ctx.Queue()
    procs = [ctx.Process(target=_group_timeouts, args=(r, 4, port, out)) for r in range(4)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    for found, dp_is_world, hybrid_dims in results:
        assert len(found) == 10 and set(found.values()) == {77.0}, found
        assert dp_is_world
        assert hybrid_dims == ["dp", "dp"]  # the op log counts hybrid sharding's collectives as DP's


def test_a_cuda_rank_binds_its_device_at_init(monkeypatch):
    """On CUDA, init_process_group gets the rank's device (NCCL then creates the world's
    communicator at once and splits it for every later group) and the configured timeout; what
    torch.distributed receives is checked, as no GPU is here."""
    import launch
    seen = {}
    for key, value in dict(WORLD_SIZE="2", RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29999").items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setattr(launch.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(launch.dist, "init_process_group", lambda **kwargs: seen.update(kwargs))
    monkeypatch.setattr(launch.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(launch.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(launch.torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(launch.atexit, "register", lambda fn: None)
    assert launch.init_distributed(torch.device("cuda", 0), timeout_s=77) == (0, 2)
    assert seen["backend"] == "nccl" and seen["device_id"] == torch.device("cuda", 0)
    assert seen["timeout"].total_seconds() == 77
    seen.clear()
    launch.init_distributed(torch.device("cpu"), timeout_s=77)
    assert seen["backend"] == "gloo" and "device_id" not in seen
