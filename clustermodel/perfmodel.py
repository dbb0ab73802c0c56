"""A performance model: the step time, tokens/s, MFU and memory per GPU of a training config on a
cluster you don't have. Meta plans Llama runs with such a model; Megatron-LM ships only a
memory estimate. Here it is also how a machine with no GPU checks that the MegaScale techniques'
effects at cluster scale are understood.

It reads the same Hydra config as train.py (model, parallel and its overlap switches, kernels, data,
optim, train) plus a description of the machine in conf/hardware/, and prices one optimizer step on
the busiest rank: every GEMM and attention kernel (efficiency depends on shape), every memory-bound
op, the TP/SP collectives over NVLink, PP sends (1/tp of the activation under SP or with
Megatron-LM's scatter/gather, which all-gathers it over TP on receipt) and the interleaved-1F1B bubble (p-1)/(m*v), DP
reduce-scatter/all-gather over the network (ring or tree, hierarchical when a group shares hosts;
a ring with k members a host leaves it by k NICs, as NCCL's channels do; a group spanning zones at
its hop out of a zone), ZeRO-3's per-module gathers and hybrid
sharding's two-step reduction (sharding_cost.py), the busiest stage under uneven chunks,
what each overlap switch hides and what hiding costs, the optimizer and the data loader. Memory is
counted per rank (memory.py): weights, gradients and optimizer states by ZeRO stage, activations by
schedule and recomputation. The block's shapes are the config's, as model.py builds them
(memory.block_matrices): GPT's LayerNorm, 4h GeLU MLP and h-wide q, k, v, or Llama's RMSNorm,
SwiGLU (gate and up in one GEMM, three h x ffn matrices) and grouped-query attention's narrower k
and v (n_kv_heads heads: a smaller QKV GEMM, fewer weights, less kept for the backward).

Calibration is honest: two constants are fitted (experiments/fit_perfmodel.py writes
experiments/data/perfmodel_fit.json): the fraction of peak a large GEMM reaches, and for each
cluster the fraction of the NIC rate large cross-host collectives reach (MegaScale's, Selene's).
The fit rows are Table 2's Megatron-LM column and every second published run of
experiments/data/published_runs.csv; everything else is a spec or a stated prior in
conf/hardware/*.yaml, so Table 2's MegaScale column, the Table 3 ablation, the 530B runs and the
held-out published runs are predictions (experiments/validate_published.py).

What the paper leaves unstated, assumed here:
- Megatron-LM (cli.MEGATRON): TP8 PP8 with 6 virtual stages, seq 2048, micro-batch 1
  (microbatches = batch/DP), sequence parallelism, bf16 weights with fp32 gradients and
  --use-distributed-optimizer (ZeRO-1: fp32 reduce-scatter, bf16 all-gather), Adam, no overlap
  beyond Megatron's own async backward collectives, materialized-softmax attention (its default
  core attention) without recomputation (why, against Korthikanti et al. 2022's selective:
  conf/experiment/megascale_ablation.yaml), unfused LayerNorm, GeLU and cross-entropy, the naive
  data loader. Stages hold the embedding (first) and an untied head (last), as model.py. A100s
  with 80 GB, of which 73.5 GiB hold tensors (conf/hardware/a100_cluster.yaml: memory_headroom_gib).
- Dropout: where the paper is silent, Megatron-LM's defaults: --attention-dropout 0.1 and
  --hidden-dropout 0.1 (its GPT-3 175B example sets neither), in both columns (conf/model/175B,
  530B). Megatron's materialized attention pays a pass over the [T, T] probabilities each way
  for it; flash attention draws the mask inside the kernel (priced free); the residual dropout
  is small in both. This assumption moves the fit: with dropout 0, the GEMM efficiency fits at
  0.704 and the MegaScale column misses at 256-768 GPUs (-4.1, -3.8, -3.1 points); with it, 0.73
  and within 2.4 on every row (the Megatron column within 1.30 and 1.32 points); both under the
  Table 2-only fit (fit_perfmodel.py --table2) with DP overlap priced a model chunk at a time.
- MegaScale and Table 3: what conf/experiment/megascale_ablation.yaml switches on, composed as
  train.py composes it (Table 2's MegaScale column is its step 7, every switch but LAMB): PTB, SWA
  (window 512 = T/4; the paper gives none), chunked TP overlap in 4 pieces, PP overlap, DP overlap
  (on the layout's ZeRO-1), flash attention and fused LayerNorm/GeLU/cross-entropy, the two-level
  data pipeline; LAMB only where the batch triples (Table 3's last step). kernels.attention=auto
  is flash-attn on CUDA (attention_impl). Steps 0-1 run Megatron-LM's materialized softmax
  (kernels.attention=unfused), as Table 2's Megatron-LM column does; step 2's window runs the
  banded kernel, fused per block.

Usage: python -m clustermodel [predict|ablation|scaling|plan|530b|validate] [key=value ...]
       (gpus=N, batch=B, micro_batch=B, scale=cluster|cpu, top=N are its own keys; cli.py)
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import config
import machine
import model as gpt
import parallel
from kernels import banded_keys, mean_keys
from config import HardwareConfig
from errors import ConfigError
# The machine's rates and the primitive costs, re-exported: callers price through pm.* alone.
from clustermodel.memory import (MATERIALIZED, rank_modules, Memory, block_matrices, compiled_keeps_gathered, element_bytes,
                                 fused_weight_params, kv_width, layer_params, memory, memory_of_rank, precision, rank_params, stream_shards,
                                 pp_gathers, pp_message_shards, recomputed_layers,
                                 swiglu)
from clustermodel.layout import JobLayout, layout_of  # noqa: F401
from clustermodel.sharding_cost import (dp_overlap_exposed, gradient_reduction, parameter_gather, reductions_a_step,
                                         replica_sum, shard_reduction, zero3_gathers)
from clustermodel.rates import (DATA_DIR, FIT_FILE, FITTED, MEASURED, MEASURED_FP32, ROOT, Rates, _kernel,  # noqa: F401
                   collective_time, gemm_key, gemm_time, owner, resolve_hardware, stream_time)


# --- Pipeline and overlap ---

def bubble_fraction(pp: int, microbatches: int, vpp: int = 1) -> float:
    """Idle time of (interleaved) 1F1B relative to the ideal m microbatches (Narayanan et al. 2021)."""
    return (pp - 1) / (microbatches * vpp)


def hide(comm: float, compute: float, mode: str, chunks: int = 1) -> Tuple[float, float]:
    """(exposed, hidden) seconds of a collective next to a GEMM taking `compute` seconds.
    async: launched beside the GEMM (Megatron's backward), only the excess shows. chunked: both are
    cut in k pieces and pipelined, so one piece of comm shows plus any excess (MegaScale's TP
    overlap). domino: row-split chunks hide each other's comm across layers, no tail shows."""
    if mode == "off":
        exposed = comm
    elif mode == "chunked":
        exposed = comm / chunks + (chunks - 1) / chunks * max(0.0, comm - compute)
    else:  # async, domino
        exposed = max(0.0, comm - compute)
    return exposed, comm - exposed


class Network:
    """Collectives and sends of one layout: NVLink (or loopback) inside a host, the NICs across."""

    def __init__(self, hw: HardwareConfig, lay: JobLayout):
        self.rates, self.lay = hw.perfmodel, lay
        p = self.rates
        self.intra = (p.intra_host_GBps * 1e9 * p.intra_host_efficiency, p.intra_host_latency_us * 1e-6)
        nic = p.inter_host_Gbps / 8 * 1e9 / p.devices_per_host          # bytes/s per device
        self.inter = (nic * p.inter_host_efficiency, p.inter_host_latency_us * 1e-6)
        self.nic = nic

    def crosses_zones(self, dim: str) -> bool:
        """Whether a `dim` group spans more than one zone (hardware.perfmodel.hosts_per_zone)."""
        p = self.rates
        if not p.hosts_per_zone:
            return False
        return self.lay.members_per_host(dim, p.hosts_per_zone * p.devices_per_host) < self.lay.group(dim)[0]

    def network_hop(self, dim: str) -> Tuple[float, float]:
        """(bytes/s, latency) of a `dim` group's slowest network hop: the NIC, or where the group
        spans zones its hop out of a zone, which shares the zone's uplinks (1/oversubscription of
        its GPUs' NICs) with the other groups' rings: a ring in rank order leaves a zone once, so
        the zone's Z GPUs in groups of k members there send Z/k flows out, each at
        min(1, k/oversubscription) of a NIC. DP outermost (k large) keeps the full NIC rate; a
        group with few members a zone (hybrid sharding's replicas) is slowed."""
        if not self.crosses_zones(dim):
            return self.inter
        p = self.rates
        k = self.lay.members_per_host(dim, p.hosts_per_zone * p.devices_per_host)
        return self.inter[0] * min(1.0, k / (p.inter_zone_oversubscription or 1.0)), self.inter[1]

    def ring_hop(self, dim: str, k: int) -> Tuple[float, float]:
        """(bytes/s, latency) of a flat ring's slowest hop where a group has k members a host. NCCL
        runs k rings (its channels), each leaving a host by another member's NIC with 1/k of the
        buffer (nccl-tests across hosts reach the host's NICs together, not one GPU's: NVIDIA/
        nccl-tests#29, #119); gloo's one ring crosses a host link its k members share. Either way
        a host's crossing moves k NICs' worth, while each member's NVLink carries the other
        (k-1)/k of the buffer. Out of a zone the k rings are k flows on the zone's uplinks
        (network_hop's count of flows, times k)."""
        if k == 1:
            return self.network_hop(dim)
        bandwidth, latency = self.inter
        if self.crosses_zones(dim):
            p = self.rates
            in_zone = self.lay.members_per_host(dim, p.hosts_per_zone * p.devices_per_host)
            bandwidth *= min(1.0, in_zone / (k * (p.inter_zone_oversubscription or 1.0)))
        seconds_per_byte = max(1 / (k * bandwidth), (k - 1) / (k * self.intra[0]))
        return 1 / seconds_per_byte, latency

    def collective(self, kind: str, nbytes: float, dim: str) -> float:
        """One collective over a `dim` group (tp, pp, dp; dp_shard and dp_replicate under hybrid
        sharding), priced on the slowest link it crosses."""
        n = self.lay.group(dim)[0]
        k = self.lay.members_per_host(dim, self.rates.devices_per_host)
        algo = self.rates.collective_algo
        # the library's own algorithm for this kind (gloo's reduce_scatter is an all-reduce)
        nbytes = nbytes / (self.rates.collective_efficiency or {}).get(kind, 1.0)
        if k >= n:
            return collective_time(kind, nbytes, n, *self.intra, algo)
        if k == 1 or algo == "ring":  # a flat ring runs at its slowest (network) hop
            return collective_time(kind, nbytes, n, *self.ring_hop(dim, k), algo)
        # tree: inside each host over NVLink, then across hosts on 1/k of the buffer, every GPU on its NIC
        return (collective_time(kind, nbytes, k, *self.intra, "ring")
                + collective_time(kind, nbytes / k, n // k, *self.network_hop(dim), "tree"))

    def pp_send(self, nbytes: float) -> float:
        """One activation (or its gradient) to the next pipeline stage, over NVLink if the whole
        pipeline shares a host, else over the NIC (the slowest hop paces the pipeline)."""
        p = self.rates
        if self.lay.members_per_host("pp", p.devices_per_host) < self.lay.pp:
            slowdown = self.inter[0] / self.network_hop("pp")[0]
            return self.inter[1] + nbytes * slowdown / (self.nic * p.p2p_efficiency)
        return self.intra[1] + nbytes / (p.intra_host_GBps * 1e9 * p.p2p_efficiency)


# --- One layer, one microbatch, one rank ---

# Passes over a tensor (forward, backward) and op counts (forward, backward) of the memory-bound
# ops, unfused and fused (kernels.fused). Unfused: every torch op reads and writes its tensor.
ELEMENTWISE = {
    # residual add + LayerNorm, or RMSNorm (on CUDA one kernel each way too: aten::_fused_rms_norm)
    "add_norm": {False: (5, 7, 2, 3), True: (4, 5, 1, 1)},
    "bias_gelu": {False: (4, 4, 2, 2), True: (2, 3, 1, 1)},
    # silu(gate) * up, in units of ffn (the width of each). Unfused: silu reads the gate and writes
    # its output, the product reads both and writes; back, the product's two gradients (3 passes
    # each), silu's (3), and gate's and up's gradients interleaved into fc_in's (2 ffn read and
    # written). Fused: gate and up read, the product written; back, those and its gradient read,
    # gate's and up's gradients written.
    "swiglu": {False: (5, 13, 2, 4), True: (3, 5, 1, 1)},
    # kernels.heads_with_rope on q and k (each a mul and two half-width multiply-adds each way),
    # and v's gradient copied back into the projection's layout. Fused: one kernel each way, q and
    # k read and written (2 passes over their width); dq, dk and dv read and the projection's
    # gradient written (3: v's half of it beside q and k's).
    "rope": {False: (5, 6, 6, 7), True: (2, 3, 1, 1)},
    "copy": {False: (2, 2, 1, 1), True: (2, 2, 1, 1)},        # attention output back to [tokens, h]
    "add": {False: (3, 3, 1, 1), True: (3, 3, 1, 1)},         # PTB's three-way residual sum
    # GQA into materialized attention: k and v repeated to every query head (read H_kv, write H
    # heads; back, the group's gradients summed), in units of h + h_kv
    "repeat_kv": {False: (2, 2, 2, 2), True: (2, 2, 2, 2)},
    # model.Block.drop: read the branch, write it and a byte mask; back, read grad and mask, write.
    # (In bf16 units: 2.5 passes each way.) Not fused into the residual add (Megatron fuses them).
    "dropout": {False: (2.5, 2.5, 1, 1), True: (2.5, 2.5, 1, 1)},
}


def _add(into: Dict[str, float], other: Dict[str, float], scale: float = 1.0) -> Dict[str, float]:
    for key, value in other.items():
        into[key] = into.get(key, 0.0) + scale * value
    return into


def _comm(c: Dict[str, float], key: str, comm: float, compute: float, mode: str, chunks: int = 1):
    exposed, hidden = hide(comm, compute, mode, chunks)
    c[key] = c.get(key, 0.0) + exposed
    c["hidden"] = c.get("hidden", 0.0) + hidden


def attention_impl(cfg: config.Config, device: str) -> str:
    """The attention backend a run of cfg uses on `device` (cuda|cpu): kernels.attention, with auto
    decided as kernels.pick_attention_impl decides it: flash-attn on CUDA (a GPU cluster is taken to
    have the `gpu` extra installed), else the banded kernel where the window skips enough of the
    sequence (T >= 2 (W + block)), else SDPA."""
    impl, W, T = cfg.kernels.attention, cfg.model.attention.window, cfg.train.seq_len
    if impl != "auto":
        return impl
    if device == "cuda":
        return "flash"
    return "banded" if W is not None and T >= 2 * (W + cfg.kernels.attention_block) else "sdpa"




def attention_time(cfg: config.Config, lay: JobLayout, r: Rates) -> Tuple[float, float, float]:
    """softmax(QK^T)V for one microbatch on one rank: (forward, backward) seconds.
    unfused (Megatron's core attention) and reference materialize every score of the causal square,
    the window only masks them. The others run a fused kernel (flash-attn, or SDPA's flash/memory-efficient
    kernels, CPU and CUDA alike) that keeps no scores: flash skips masked blocks, inside and outside
    the window; sdpa with a window gets an explicit [T, T] mask and computes every score; banded
    computes only its windows of banded_keys() keys per query, masked, so none are skipped."""
    m, T, e = cfg.model, lay.seq, element_bytes(cfg)
    hd, n = m.d_model // m.n_heads, lay.micro_batch * m.n_heads // lay.tp
    impl, W = cfg.kernels.attention, m.attention.window
    if impl in MATERIALIZED:
        # Forward: S = QK^T, softmax (read S, write P), O = PV. Backward: dP = dO V^T, dV = P^T dO,
        # softmax backward (read P and dP, write dS), dQ = dS K, dK = dS^T Q. Dropout on P is a
        # pass of its own each way: read P, write the kept P and a byte mask; read the gradient
        # and the mask, write the gradient.
        drop = stream_time(r, (2 * e + 1) * n * T * T) if m.dropout else 0.0
        fwd = gemm_time(r, T, T, hd, n, e) + stream_time(r, 2 * n * T * T * e) + drop + gemm_time(r, T, hd, T, n, e)
        bwd = (gemm_time(r, T, T, hd, n, e) + gemm_time(r, T, hd, T, n, e) + stream_time(r, 3 * n * T * T * e)
               + drop + gemm_time(r, T, hd, T, n, e) + gemm_time(r, T, hd, T, n, e))
        # Selective recomputation re-runs the core forward up to what the backward keeps: the
        # probabilities (and their dropout), not the PV product (checkpoint stops early there).
        return fwd, bwd, fwd - gemm_time(r, T, hd, T, n, e)
    # Fused kernels draw the dropout mask inside the kernel from a seed (flash-attn regenerates it
    # in the backward), priced as free: random bits beside the exp, no pass over memory.
    if impl == "banded" and banded_keys(cfg.model.attention.window, cfg.kernels.attention_block, T):
        keys = banded_keys(cfg.model.attention.window, cfg.kernels.attention_block, T)
    else:
        keys = T if W and impl != "flash" else mean_keys(T, W)
    fwd = _kernel(r, 4 * n * T * keys * hd / (r.flops * r.flash_eff))
    return fwd, 2.5 * fwd, fwd  # backward recomputes the scores: 5 GEMMs against the forward's 2


def layer_time(cfg: config.Config, lay: JobLayout, r: Rates, net: Network):
    """One transformer layer, one microbatch, on one rank: (forward, backward) seconds by category,
    plus the attention core's forward (what selective recomputation re-runs)."""
    m, t, M, e = cfg.model, lay.tp, lay.micro_batch * lay.seq, element_bytes(cfg)
    h, ff, ptb = m.d_model, gpt.ffn_width(m), m.block == "parallel"
    mode = cfg.parallel.overlap.tp if t > 1 else "off"  # (parallel.validate: off without SP)
    k = cfg.parallel.overlap.tp_chunks if mode in ("chunked", "domino") else 1
    shapes = block_matrices(m, t)
    # Overlap cuts a GEMM into k row chunks: chunked, those next to a blocking collective (every
    # forward GEMM, the row-parallel input gradients); domino, every GEMM (it splits the batch).
    kd = {n: k if mode == "domino" or n in ("out", "fc2") else 1 for n in shapes}
    kw = k if mode == "domino" else 1
    g_fwd = {n: k * gemm_time(r, M / k, N, K, 1, e) for n, (N, K) in shapes.items()}
    g_dgrad = {n: kd[n] * gemm_time(r, M / kd[n], K, N, 1, e) for n, (N, K) in shapes.items()}
    g_wgrad = {n: kw * gemm_time(r, N, K, M / kw, 1, e) for n, (N, K) in shapes.items()}
    attn_f, attn_b, attn_recompute = attention_time(cfg, lay, r)
    fwd = {"gemm": sum(g_fwd.values()), "attention": attn_f}
    bwd = {"gemm": sum(g_dgrad.values()) + sum(g_wgrad.values()), "attention": attn_b}

    shard = h // stream_shards(cfg, t)  # sequence parallelism keeps the residual stream split over the TP group
    # RoPE rotates q and k (GQA: k has n_kv_heads heads); the activation reads fc_in's output
    items = [("add_norm", shard * (1 if ptb else 2)), ("swiglu" if swiglu(m) else "bias_gelu", ff // t),
             ("rope", (h + kv_width(m)) // t), ("copy", h // t)]
    if ptb:
        items.append(("add", shard))
    if cfg.kernels.attention in MATERIALIZED and kv_width(m) < h:
        items.append(("repeat_kv", (h + kv_width(m)) // t))
    if m.dropout:  # each residual branch (PTB: their sum), on the sequence shard
        items += [("dropout", shard)] * (1 if ptb else 2)
    for name, width in items:
        pf, pb, of, ob = ELEMENTWISE[name][bool(cfg.kernels.fused)]  # true or triton: fused
        fwd["elementwise"] = fwd.get("elementwise", 0.0) + stream_time(r, pf * width * M * e, of)
        bwd["elementwise"] = bwd.get("elementwise", 0.0) + stream_time(r, pb * width * M * e, ob)
    # QKV's bias gradient, a sum of its output gradient over the tokens: computed beside its
    # weight gradient, so in the input gradient's reduce-scatter window (overlap.GatheredLinears)
    qkv_bias_grad = stream_time(r, M * shapes["qkv"][0] * e) if m.bias else 0.0
    bwd["elementwise"] += qkv_bias_grad

    if t > 1:  # SP: all-gather before each column-parallel GEMM, reduce-scatter after each row-parallel
        # (without SP: all-reduces, tp_layer_collectives)
        # A collective cut into n pieces (to pipeline with the GEMM chunks it feeds or drains) is n
        # collectives: the same bytes, n times the per-step latency. The piece that shows under
        # chunked overlap is then one latency plus 1/n of the bytes, not 1/n of both.
        ag = lambda n: n * net.collective("all_gather", M * h * e / n, "tp")
        rs = lambda n: n * net.collective("reduce_scatter", M * h * e / n, "tp")
        ar = lambda n: n * net.collective("all_reduce", M * h * e / n, "tp")
        kb, ka = kd["out"], kd["qkv"]   # pieces of the backward's blocking and async collectives
        pieces = {"forward": k, "backward": kb, "regather": ka, "input_grad": kw}
        gemms = {"forward": g_fwd, "backward": g_dgrad, "regather": g_dgrad, "input_grad": g_wgrad}
        for phase, kind, names in tp_layer_collectives(cfg):
            comm = {"all_gather": ag, "reduce_scatter": rs, "all_reduce": ar}[kind](pieces[phase])
            gemm = sum(gemms[phase][n] for n in names)
            if phase == "input_grad" and "qkv" in names:
                gemm += qkv_bias_grad
            _comm(fwd if phase == "forward" else bwd, "tp_comm", comm, gemm,
                  mode if phase in ("forward", "backward") else "async", k)
    return fwd, bwd, attn_recompute


def tp_layer_collectives(cfg: config.Config) -> list:
    """The TP collectives of one layer and microbatch under sequence parallelism, each of the
    layer's full-sequence activation (M·h elements): (phase, kind, the GEMMs it pairs with).
    forward: all-gather before each column-parallel GEMM, reduce-scatter after each row-parallel;
    backward: the all-gather of the row-parallel outputs' gradient (blocking); regather: the
    column-parallel inputs gathered again for their weight gradient (backward keeps only the
    shard, as Megatron-LM; none under full recomputation, whose recomputed forward keeps them, nor
    where compiled_keeps_gathered);
    input_grad: the column-parallel inputs' gradient reduce-scattered, behind the weight gradient.
    PTB shares one of each between attention and MLP (MegaScale §3.1).
    Without SP (parallel.sequence_parallel=false, Megatron-LM before it): forward, an all-reduce
    after each row-parallel GEMM; backward, one of each column-parallel input's gradient, once
    its GEMMs are done (tensor_parallel.CopyToTPRegion: nothing left to hide it behind)."""
    if not cfg.parallel.sequence_parallel:
        pairs = [("qkv", "fc1"), ("out", "fc2")] if cfg.model.block == "parallel" else [("qkv",), ("out",), ("fc1",), ("fc2",)]
        return [("forward" if names[0] in ("out", "fc2") else "backward", "all_reduce", names) for names in pairs]
    if cfg.model.block == "parallel":
        out = [("forward", "all_gather", ("qkv", "fc1")), ("forward", "reduce_scatter", ("out", "fc2")),
               ("backward", "all_gather", ("out", "fc2")), ("regather", "all_gather", ("qkv", "fc1")),
               ("input_grad", "reduce_scatter", ("qkv", "fc1"))]
    else:
        out = [("forward", "all_gather", ("qkv",)), ("forward", "reduce_scatter", ("out",)),
               ("forward", "all_gather", ("fc1",)), ("forward", "reduce_scatter", ("fc2",)),
               ("backward", "all_gather", ("out",)), ("backward", "all_gather", ("fc2",)),
               ("regather", "all_gather", ("qkv",)), ("input_grad", "reduce_scatter", ("qkv",)),
               ("regather", "all_gather", ("fc1",)), ("input_grad", "reduce_scatter", ("fc1",))]
    if cfg.train.recompute == "full" or compiled_keeps_gathered(cfg):
        out = [c for c in out if c[0] != "regather"]
    return out


def resolve_config(cfg: config.Config, hw: HardwareConfig) -> config.Config:
    """cfg with what `auto` leaves to the machine decided as the run would decide it on hw (a
    resolved hardware): precision=auto is bf16 on CUDA and, on a CPU, only where bf16 matmuls are
    not slower than fp32 (machine.resolve_precision: on an AVX2-only CPU they are emulated);
    kernels.attention=auto is attention_impl's choice. A shallow copy; cfg is left as it is."""
    impl = attention_impl(cfg, hw.device)
    if cfg.precision != "auto" and impl == cfg.kernels.attention:
        return cfg
    cfg = copy.copy(cfg)
    if cfg.precision == "auto":
        cfg.precision = "bf16" if hw.device == "cuda" or hw.peak_tflops >= hw.peak_tflops_fp32 else "fp32"
    cfg.kernels = copy.copy(cfg.kernels)
    cfg.kernels.attention = impl
    return cfg


def ends_time(cfg: config.Config, lay: JobLayout, r: Rates, net: Network):
    """The first rank's embedding and the last rank's norm, head and loss: ((fwd, bwd), (fwd, bwd))."""
    m, t, M, e = cfg.model, lay.tp, lay.micro_batch * lay.seq, element_bytes(cfg)
    h, V, fused = m.d_model, m.vocab_size // lay.tp, bool(cfg.kernels.fused)
    emb_f = {"elementwise": stream_time(r, 2 * M * h * e)}
    emb_b = {"elementwise": stream_time(r, M * h * (e + 8), 2)}  # scatter-add into the fp32 grad
    head_f = {"gemm": gemm_time(r, M, V, h, 1, e)}
    head_b = {"gemm": gemm_time(r, M, h, V, 1, e) + gemm_time(r, V, h, M, 1, e)}
    pf, pb, of, ob = ELEMENTWISE["add_norm"][fused]
    # Cross-entropy over [tokens, V/tp]: unfused, logits go through an fp32 copy and log_softmax.
    ce_f, ce_b, ops = ((e, 2 * e, 1) if fused else (e + 12, e + 20, 5))
    s = stream_shards(cfg, t)  # the final norm's share of the sequence
    head_f["elementwise"] = stream_time(r, pf * M * h // s * e, of) + stream_time(r, ce_f * M * V, ops)
    head_b["elementwise"] = stream_time(r, pb * M * h // s * e, ob) + stream_time(r, ce_b * M * V, ops)
    if t > 1 and not cfg.parallel.sequence_parallel:  # the embedding's all-reduce, the head input gradient's
        _comm(emb_f, "tp_comm", net.collective("all_reduce", M * h * e, "tp"), 0.0, "off")
        _comm(head_b, "tp_comm", net.collective("all_reduce", M * h * e, "tp"), 0.0, "off")
    elif t > 1:  # vocab-parallel embedding and loss; the head needs the whole sequence
        _comm(emb_f, "tp_comm", net.collective("reduce_scatter", M * h * e, "tp"), 0.0, "off")
        _comm(emb_b, "tp_comm", net.collective("all_gather", M * h * e, "tp"), 0.0, "off")
        # TP overlap covers the blocks' linears (MegaScale §3.3; tensor_parallel._chunked_block), not the
        # head's gather of the whole sequence, which stays one blocking all-gather.
        _comm(head_f, "tp_comm", net.collective("all_gather", M * h * e, "tp"), 0.0, "off")
        _comm(head_b, "tp_comm", net.collective("reduce_scatter", M * h * e, "tp"), head_b["gemm"] / 2, "async")
        _comm(head_b, "tp_comm", net.collective("all_gather", M * h * e, "tp"), head_b["gemm"] / 2, "async")  # regather
    if t > 1:  # the vocab-parallel loss: the max, then the sum of exponentials with the target logit
        ce = net.collective("all_reduce", M * 4, "tp") + net.collective("all_reduce", 2 * M * 4, "tp")
        _comm(head_f, "tp_comm", ce, 0.0, "off")
    return (emb_f, emb_b), (head_f, head_b)


def layer_mix(cfg: config.Config, lay: JobLayout) -> list:
    """A chunk's layers as they are priced: (a config under which every layer runs as these do,
    their share of the chunk). One kind, but under full recomputation of the first N layers of each
    chunk (train.recompute_layers, Megatron-LM's block method): those recompute, the rest keep
    their activations (and, under TP, gather their inputs again in backward)."""
    n, per_chunk = recomputed_layers(cfg, lay.pp, lay.vpp)
    if cfg.train.recompute != "full" or n == per_chunk:
        return [(cfg, 1.0)]

    def every_layer(recompute: str) -> config.Config:
        c = copy.copy(cfg)
        c.train = copy.copy(cfg.train)
        c.train.recompute, c.train.recompute_layers = recompute, -1
        return c
    return [(every_layer("full"), n / per_chunk), (every_layer("none"), 1 - n / per_chunk)]


def layer_microbatch(cfg: config.Config, lay: JobLayout, r: Rates, net: Network) -> Tuple[dict, dict]:
    """One layer's (forward, backward) for one microbatch by category, the backward with its
    recomputation, averaged over the chunk's layers (layer_mix)."""
    fwd_all, bwd_all = {}, {}
    for c, share in layer_mix(cfg, lay):
        fwd, bwd, attn_recompute = layer_time(c, lay, r, net)
        bwd = dict(bwd)
        if c.train.recompute == "full":
            _add(bwd, fwd)
        elif c.train.recompute == "selective" and c.kernels.attention in MATERIALIZED:
            bwd["attention"] = bwd.get("attention", 0.0) + attn_recompute
        _add(fwd_all, fwd, share)
        _add(bwd_all, bwd, share)
    return fwd_all, bwd_all


def layer_backward(cfg: config.Config, lay: JobLayout, r: Rates, net: Network) -> float:
    """Seconds of one layer's backward for one microbatch, its recomputation included (the mean
    over a chunk's layers where only some recompute)."""
    busy = lambda c: sum(v for k, v in c.items() if k != "hidden")
    return busy(layer_microbatch(cfg, lay, r, net)[1])


def stage_microbatch(cfg: config.Config, lay: JobLayout, r: Rates, net: Network) -> Tuple[dict, dict]:
    """One microbatch's forward and backward (recomputation included) on the first and on the last
    pipeline rank, by part: its layers, the first's embedding, the last's head and loss (one rank
    holds all of them at pp=1); a middle rank is the first less its embedding."""
    fwd, bwd = layer_microbatch(cfg, lay, r, net)
    layer = _add(_add({}, fwd), bwd)
    body = _add({}, layer, lay.rank_layers(0, cfg.model.n_layers))
    (emb_f, emb_b), (head_f, head_b) = ends_time(cfg, lay, r, net)
    first = _add(_add(dict(body), emb_f), emb_b)
    last = _add(_add(_add({}, layer, lay.rank_layers(lay.pp - 1, cfg.model.n_layers)), head_f), head_b)
    if lay.pp == 1:
        first = _add(_add(first, head_f), head_b)
    return first, last


def middle_stages(cfg: config.Config, lay: JobLayout, r: Rates, net: Network) -> list:
    """Where chunks are uneven, the busiest middle pipeline rank's microbatch (its blocks alone):
    with short end chunks it may hold more blocks than the first or last. Even: none (a middle
    rank is the first less its embedding)."""
    if not lay.chunks or lay.pp < 3:
        return []
    layers, rank = max((lay.rank_layers(k, cfg.model.n_layers), k) for k in range(1, lay.pp - 1))
    fwd, bwd = layer_microbatch(cfg, lay, r, net)
    return [(rank, _add({}, _add(_add({}, fwd), bwd), layers))]


@dataclass
class Prediction:
    step_s: float
    tokens_per_s: float
    mfu: float
    breakdown: Dict[str, float]   # seconds per step: compute, exposed comm, bubble, optimizer, ...
    exposed_comm_s: float
    hidden_comm_s: float
    memory: Memory
    layout: JobLayout


def predict(cfg: config.Config, gpus: Optional[int] = None, hw: Optional[HardwareConfig] = None) -> Prediction:
    """Predict one optimizer step of cfg on `gpus` devices of cfg.hardware (or hw, already resolved)."""
    lay = layout_of(cfg, gpus)
    hw = hw or resolve_hardware(cfg.hardware)
    cfg = resolve_config(cfg, hw)
    r, net = Rates.of(hw, precision(cfg), lay.gpus), Network(hw, lay)
    m, ov = cfg.model, cfg.parallel.overlap

    fwd, (first, last) = layer_time(cfg, lay, r, net)[0], stage_microbatch(cfg, lay, r, net)
    busy = lambda c: sum(v for k, v in c.items() if k != "hidden")
    stages = [(0, first), (lay.pp - 1, last), *middle_stages(cfg, lay, r, net)]
    if lay.zero == 3 and lay.dp > 1:  # each rank's own gathers (the first gathers the embedding, the last the head)
        for rank, stage in stages:
            exposed, total = zero3_gathers(cfg, lay, net, rank, busy(fwd), layer_backward(cfg, lay, r, net))
            stage["param_gather"], stage["hidden"] = exposed, stage.get("hidden", 0.0) + total - exposed
    mb = max((stage for _, stage in stages), key=busy)  # the slowest stage sets the pace

    message = lay.micro_batch * lay.seq * m.d_model * element_bytes(cfg)
    send = net.pp_send(message / pp_message_shards(cfg, lay.tp)) if lay.pp > 1 else 0.0
    sends = 2 * lay.vpp * send  # each chunk sends an activation forward and a gradient back
    _comm(mb, "pp_comm", sends, sends, "async" if ov.pp else "off")
    if lay.pp > 1 and pp_gathers(cfg, lay.tp):  # scatter/gather: each message received is all-gathered over TP before its compute
        _comm(mb, "tp_comm", 2 * lay.vpp * net.collective("all_gather", message, "tp"), 0.0, "off")
    step = _add({}, mb, lay.microbatches)
    # The fill and drain idle every rank for (p-1)/v microbatches; with PP overlap the sends along
    # that critical path still cost their latency.
    step["bubble"] = bubble_fraction(lay.pp, lay.microbatches, lay.vpp) * busy(step)
    step["bubble"] += 2 * (lay.pp - 1) * send if ov.pp else 0.0
    step.update(dp_time(cfg, lay, net, busy(fwd), layer_backward(cfg, lay, r, net)))
    step["optimizer"] = optimizer_time(cfg, lay, r)
    step["data"] = data_time(cfg, hw, lay.tp)
    hidden = step.pop("hidden", 0.0) + step.pop("dp_hidden", 0.0)
    step["overlap_slowdown"] = hw.perfmodel.overlap_slowdown * hidden
    step_s = sum(step.values())
    tokens = cfg.train.batch_size * lay.seq
    mfu = tokens / step_s * gpt.flops_per_token(m, lay.seq) / (lay.gpus * r.flops)
    exposed = step.get("tp_comm", 0.0) + step.get("pp_comm", 0.0) + step.get("dp_comm", 0.0) + step.get("param_gather", 0.0)
    return Prediction(step_s, tokens / step_s, mfu, step, exposed, hidden,
                      memory(cfg, lay, machine.tensor_memory_gib(hw)), lay)


def data_time(cfg, hw, tp: int) -> float:
    """What reading the batch adds to a step (data.pipeline's parts: data.data_parts). Prefetched in
    the background, it hides behind the step's compute: 0. Otherwise the step waits for it:
    loader_step_s with every rank of a host reading its own (naive), loader_step_shared_s with one
    reader per TP group (experiments/bench_loader.py measures both)."""
    import data
    prefetch_async, tp_shared = data.data_parts(cfg.data)
    if prefetch_async:
        return 0.0
    p = hw.perfmodel
    if tp_shared and tp > 1 and p.loader_step_shared_s is not None:
        return p.loader_step_shared_s
    return p.loader_step_s


# --- What a rank moves, computes and holds per step: checked against the code's rehearsal ---

def grad_accumulation_bytes(cfg: config.Config, lay: JobLayout, params: int, e: int, grad_bytes: int,
                            fused: Tuple[int, int] = (0, 0)) -> float:
    """Bytes the gradient accumulation reads and writes a step (parallelisms/zero.py): every microbatch adds each
    fresh gradient (the parameters' dtype) into the reduction buffer (read and written), except the
    fused weights' (fused_weight_params), whose GEMMs read and write the buffer and write no
    gradient of their own. One rank at ZeRO-0 in fp32 leaves the gradients to autograd, whose
    first microbatch's gradient is kept as it is and each later one added in place."""
    if lay.dp == 1 and lay.tp == 1 and lay.zero == 0 and e == 4:
        return (lay.microbatches - 1) * params * 12
    weights, accumulated = fused
    return lay.microbatches * ((params - weights) * (e + 2 * grad_bytes) + accumulated * 2 * grad_bytes)


def accounting(cfg: config.Config, gpus: Optional[int] = None, last: bool = False) -> Dict[str, float]:
    """One step of the first (or last) pipeline rank, in the model's own terms: the bytes it puts on
    the wire per mesh dimension (ring collectives: all-reduce 2(n-1)/n of the tensor, all-gather
    and reduce-scatter (n-1)/n of it; a send its tensor), its GEMM and attention FLOPs, the bytes
    its gradient accumulation moves, and its memory at the peak. tests/test_rehearsal.py holds rehearsal.py's records of the code to these
    within 5%."""
    lay = layout_of(cfg, gpus)
    cfg = resolve_config(cfg, resolve_hardware(cfg.hardware))
    m, e, t = cfg.model, element_bytes(cfg), lay.tp
    M, h, V = lay.micro_batch * lay.seq, m.d_model, m.vocab_size
    layers, mbs = lay.rank_layers(lay.pp - 1 if last else 0, m.n_layers), lay.microbatches
    ring = lambda kind, nbytes, n: nbytes * (2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n)
    mix = layer_mix(cfg, lay)
    recomputed = sum(share for c, share in mix if c.train.recompute == "full")  # the chunk's share that recomputes
    tp_layer = 0.0
    for c, share in mix if t > 1 else ():
        tp_layer += share * sum(ring(kind, M * h * e, t) for _, kind, _ in tp_layer_collectives(c))
        if c.train.recompute == "full":  # the recomputed forward gathers and scatters again
            tp_layer += share * sum(ring(kind, M * h * e, t) for ph, kind, _ in tp_layer_collectives(c) if ph == "forward")
    first, final = not last or lay.pp == 1, last or lay.pp == 1
    tp_ends = 0.0
    if t > 1 and not cfg.parallel.sequence_parallel:  # the embedding's all-reduce, the head input gradient's; loss
        tp_ends += ring("all_reduce", M * h * e, t) * first + final * (ring("all_reduce", M * h * e, t) + 3 * ring("all_reduce", M * 4, t))
    elif t > 1:
        tp_ends += 2 * ring("all_gather", M * h * e, t) * first  # the embedding's reduce-scatter, its gradient's all-gather
        tp_ends += final * (3 * ring("all_gather", M * h * e, t) + 3 * ring("all_reduce", M * 4, t))  # head, loss
    sends = (2 * lay.vpp - (not last) - last) if lay.pp > 1 else 0  # stage 0 sends no gradient, the last no activation
    if pp_gathers(cfg, t):  # scatter/gather: each message received (as many as sent) all-gathered over TP
        tp_ends += sends * ring("all_gather", M * h * e, t)
    params = rank_params(m, lay)[1 if last else 0]
    grad_bytes = 4 if cfg.parallel.reduce_dtype == "fp32" else 2
    dp = dp_wire_bytes(cfg, lay, last, params, grad_bytes) if lay.dp > 1 else 0.0
    gemm_fwd = sum(2 * M * n * k for n, k in block_matrices(m, t).values())
    passes = 3 + recomputed
    gemm = passes * gemm_fwd * layers + (3 * 2 * M * V // t * h if final else 0)
    n, T, hd = lay.micro_batch * m.n_heads // t, lay.seq, h // m.n_heads
    if cfg.kernels.attention in MATERIALIZED:
        attn_fwd = 4 * n * T * T * hd
        attn = attn_fwd * (3 + (recomputed if cfg.train.recompute == "full" else 0.5 * (cfg.train.recompute == "selective")))  # selective: QK^T only
    else:
        impl = attention_impl(cfg, "cuda")
        keys = banded_keys(cfg.model.attention.window, cfg.kernels.attention_block, T) if impl == "banded" and banded_keys(cfg.model.attention.window, cfg.kernels.attention_block, T) else (
            T if m.attention.window and impl != "flash" else mean_keys(T, m.attention.window))
        attn_fwd = 4 * n * T * keys * hd
        attn = attn_fwd * (3.5 + recomputed)
    mem = memory_of_rank(cfg, lay, last)
    fused = fused_weight_params(cfg, lay, last)
    return {"grad_accumulation_bytes": grad_accumulation_bytes(cfg, lay, params, e, grad_bytes, fused),
            "tp_bytes_per_layer": tp_layer, "tp_bytes": mbs * (tp_layer * layers + tp_ends),
            "pp_bytes": mbs * sends * M * h * e / pp_message_shards(cfg, t), "dp_bytes": dp,
            "gemm_flops": mbs * gemm, "attention_flops": mbs * attn * layers,
            **{f"{k}_bytes": getattr(mem, k) * 2**30 for k in ("weights", "grads", "optimizer", "activations")}}


def dp_wire_bytes(cfg: config.Config, lay: JobLayout, last: bool, params: int, grad_bytes: int) -> float:
    """Bytes a rank puts on the wire for DP in a step (ring collectives): ZeRO-0's all-reduce; else
    the gradients' reduce-scatter (under hybrid sharding in the shard group, then its shard's
    all-reduce over the replicas) and the parameters' all-gathers in the shard group: once a step,
    or at ZeRO-3 with resharding each module's twice a microbatch (the head once)."""
    e, n = element_bytes(cfg), lay.shard
    ring = lambda kind, nbytes, k: nbytes * (2 * (k - 1) / k if kind == "all_reduce" else (k - 1) / k)
    if lay.zero == 0:
        return ring("all_reduce", params * grad_bytes, lay.dp)
    wire = (reductions_a_step(cfg, lay) * ring("reduce_scatter", params * grad_bytes, n)
            + ring("all_reduce", params * grad_bytes / n, lay.dp // n))
    gathered = params
    if lay.zero == 3 and lay.reshard:
        head = rank_modules(cfg, lay, lay.pp - 1)[-1] if last else 0
        gathered = lay.microbatches * (2 * params - head)
    return wire + ring("all_gather", gathered * e, n)


def dp_time(cfg: config.Config, lay: JobLayout, net: Network, layer_fwd: float, layer_bwd: float) -> Dict[str, float]:
    """Gradient reduce-scatter and parameter all-gather over DP (an all-reduce without ZeRO), given
    one layer's forward and backward seconds (one microbatch, recomputation included) on this rank.
    Without DP overlap both run after the backward. With it they are priced as parallelisms/zero.py
    issues them, a bucket per module (the embedding, each block, the head), on the busier of the
    first and last pipeline rank (dp_overlap_exposed). Hybrid sharding reduces in two steps and
    ZeRO-3 gathers at use, not here (sharding_cost). Reducing each microbatch (no pipeline), every
    microbatch's reduce-scatters hide behind its own backward, waited for at its end."""
    if lay.dp == 1:
        return {"dp_comm": 0.0}
    grad_bytes = 4 if cfg.parallel.reduce_dtype == "fp32" else 2
    gather_bytes = grad_bytes if lay.zero == 0 else element_bytes(cfg)
    earlier = reductions_a_step(cfg, lay) - 1  # microbatches reduced before the last
    if not cfg.parallel.overlap.dp:
        params = max(rank_params(cfg.model, lay))
        rs = gradient_reduction(net, lay, params * grad_bytes) + earlier * shard_reduction(net, lay, params * grad_bytes)
        ag = parameter_gather(net, lay, params * gather_bytes)
        return {"dp_comm": rs + ag, "dp_hidden": 0.0}
    split, replicated = layer_params(cfg.model, lay.tp)
    ends = cfg.model.vocab_size * cfg.model.d_model // lay.tp
    rs = lambda n: shard_reduction(net, lay, n * grad_bytes)
    ag = lambda n: parameter_gather(net, lay, n * gather_bytes)
    priced = [dp_overlap_exposed(lay, lay.rank_layers(0 if end == "embedding" else lay.pp - 1, cfg.model.n_layers),
                                 layer_fwd, layer_bwd, (rs(split + replicated), ag(split + replicated)),
                                 (rs(ends), ag(ends)), end)
              for end in ("embedding", "head")]
    exposed, total = max(priced)
    if earlier:  # each earlier microbatch's reduce-scatters, behind its own backward (no gathers)
        bwd_exposed, bwd_total = max(dp_overlap_exposed(lay, cfg.model.n_layers, layer_fwd, layer_bwd,
                                                        (rs(split + replicated), 0.0), (rs(ends), 0.0), end)
                                     for end in ("embedding", "head"))
        exposed, total = exposed + earlier * bwd_exposed, total + earlier * bwd_total
    replicas = replica_sum(net, lay, max(rank_params(cfg.model, lay)) * grad_bytes)  # after the backward: exposed
    return {"dp_comm": exposed + replicas, "dp_hidden": total - exposed}


def optimizer_time(cfg: config.Config, lay: JobLayout, r: Rates) -> float:
    """A memory-bound pass over this rank's optimizer shard: Adam reads grad, master, two moments
    and writes them back with the bf16 weights (30 B/param); LAMB also reads the update and weights
    for its per-tensor norms (38 B/param, two reductions per tensor); clipping reads the grads."""
    params = max(rank_params(cfg.model, lay)) / (lay.shard if lay.zero >= 1 else 1)
    lamb = cfg.optim.name == "lamb"
    per_param = (38 if lamb else 30) + (4 if cfg.train.grad_clip > 0 else 0)
    tensors = cfg.model.n_layers // lay.pp * block_tensors(cfg.model) + 3
    return stream_time(r, per_param * params, 12 + (2 * tensors if lamb else 0))


def block_tensors(m: gpt.ModelConfig) -> int:
    """Parameter tensors of a block: four weight matrices, their biases, and each norm's weight (and
    LayerNorm's bias); 12 in GPT's sequential block, 6 in Llama's."""
    norms = 1 if m.block == "parallel" else 2
    return 4 * (1 + int(m.bias)) + norms * (1 + int(m.bias and m.norm == "layernorm"))
