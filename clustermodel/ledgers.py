"""What a rank computes and holds, counted op by op as it runs (TorchDispatchMode), for the
rehearsal (rehearsal.py) on the meta device:

- FlopLedger: FLOPs by op class (GEMM, attention, elementwise), torch's FlopCounterMode formulas;
  and Segment, the work between two recorded communication events, which replay.py prices.
- cuda_attention: CUDA's fused attention kernels, stood in for on meta with their outputs,
  saved tensors and FLOPs.
- MemoryLedger: bytes alive, storage by storage, with the peak split by category (categories:
  weights, gradients, optimizer state, communication buffers, activations).
"""
from __future__ import annotations

import contextlib
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode


# --- FLOPs by op class ---

BATCHED = (torch.ops.aten.bmm, torch.ops.aten.baddbmm)
ACCUMULATING = (torch.ops.aten.add_.Tensor, torch.ops.aten._foreach_add_.List)  # the gradient accumulation's ops
# A weight-gradient GEMM accumulating into its gradient buffer (zero.weight_gradient): C += A @ B,
# in C's dtype or (bf16 operands, CUDA's and meta's) into fp32.
GEMM_ACCUMULATING = (torch.ops.aten.addmm_.default, torch.ops.aten.addmm.dtype_out)


class FlopLedger(TorchDispatchMode):
    """FLOPs of every op the rank runs: GEMMs and attention by torch's FlopCounterMode formulas,
    and one FLOP per output element for pointwise ops (elementwise). Attention is what runs inside
    Attention.core in the forward, and every batched matmul (the model's linears are mm/addmm;
    only attention multiplies batches of matrices, forward and backward), and the fused kernels'
    own count (cuda_attention)."""

    def __init__(self):
        super().__init__()
        from torch.utils.flop_counter import flop_registry
        self.registry = flop_registry
        self.flops = {"gemm": 0, "attention": 0, "elementwise": 0}
        self.in_attention, self.active = 0, 0
        self.segment = Segment()  # the work since the last recorded event: what replay.py prices
        self.accumulation_bytes = 0  # read and written by the gradient accumulation (count_accumulation_into)
        self._gradient_storages = set

    def __enter__(self):
        self.active += 1
        return super().__enter__()

    def __exit__(self, *exc):
        self.active -= 1
        return super().__exit__(*exc)

    def add(self, kind: str, n: float) -> None:
        """FLOPs of a kernel this mode cannot see (counted only while the mode is on)."""
        if self.active:
            self.flops[kind] += int(n)
            if kind == "attention":
                self.segment.attention += int(n)
                self.segment.attention_ops += 1

    def count_accumulation_into(self, zero) -> None:
        """Count apart the bytes of the gradient accumulation, microbatch by microbatch: the in-place
        adds into zero's (parallelisms/zero.py's ZeroDataParallel) gradient buffers (one foreach add a module and
        bucket) or, where autograd keeps the gradients, into the parameters' .grad (each add reads
        the fresh gradient and the sum, and writes the sum); and the weight-gradient GEMMs that
        accumulate into a buffer themselves (they read the sum and write it: no fresh gradient)."""
        def storages():
            kept = [p.grad for p in zero.params] if zero.autograd_keeps_grads else []
            return {id(t.untyped_storage()) for t in [b.grads for b in zero.buckets] + kept if t is not None}
        self._gradient_storages = storages

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if func in ACCUMULATING:
            sums, fresh = (args[0], args[1]) if func is torch.ops.aten._foreach_add_.List else ([args[0]], [args[1]])
            if sums and id(sums[0].untyped_storage()) in self._gradient_storages():
                self.accumulation_bytes += sum(2 * s.numel() * s.element_size() + f.numel() * f.element_size()
                                               for s, f in zip(sums, fresh))
        elif func in GEMM_ACCUMULATING:
            if id(args[0].untyped_storage()) in self._gradient_storages():
                self.accumulation_bytes += 2 * args[0].numel() * args[0].element_size()
            packet, args, kwargs = torch.ops.aten.addmm, args[:3], {}  # addmm's FLOPs (its formula takes no out_dtype)
        if packet in self.registry:
            n = self.registry[packet](*args, **kwargs, out_val=out)
            attention = self.in_attention or packet in BATCHED or "attention" in str(packet)
            self.flops["attention" if attention else "gemm"] += int(n)
            self.segment.count(func, args, out, int(n), attention)
            return out
        self.segment.count(func, args, out)
        if torch.Tag.pointwise in func.tags:
            first = out[0] if isinstance(out, (tuple, list)) else out
            if torch.is_tensor(first):
                self.flops["attention" if self.in_attention else "elementwise"] += first.numel()
        return out


class Segment:
    """The work a rank's compute stream does between two recorded events, in the units replay.py
    prices: each GEMM's shape (mm and addmm: [M,K] @ [K,N], bytes per element), each batched
    GEMM's (bmm and baddbmm, with the batch: the materialized core attention's products, priced as
    the GEMMs they are, as perfmodel.attention_time prices them), the fused attention kernels'
    FLOPs and kernel count, and the bytes every other kernel reads and writes (views and
    allocations move none) with their count."""
    GEMMS = (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_)
    FREE = (torch.ops.aten.empty, torch.ops.aten.empty_strided, torch.ops.aten.new_empty,
            torch.ops.aten.new_empty_strided, torch.ops.aten.detach, torch.ops.aten.lift_fresh)

    def __init__(self):
        self.gemms, self.bmms, self.attention, self.attention_ops, self.bytes, self.ops = {}, {}, 0, 0, 0, 0

    def count(self, func, args, out, flops: int = 0, attention: bool = False) -> None:
        packet = func._overloadpacket
        if packet in self.GEMMS:
            a, b = args[-2], args[-1]
            key = (a.shape[0], b.shape[1], a.shape[1], a.element_size())
            self.gemms[key] = self.gemms.get(key, 0) + 1
        elif packet in BATCHED:  # [B,M,K] @ [B,K,N]
            a, b = args[-2], args[-1]
            key = (a.shape[0], a.shape[1], b.shape[2], a.shape[2], a.element_size())
            self.bmms[key] = self.bmms.get(key, 0) + 1
        elif flops:  # the fused attention kernels
            self.attention += flops
            self.attention_ops += 1
        elif func is torch.ops.aten._foreach_add_.List:  # reads both lists, writes the first; CUDA's one
            sums, fresh = args[0], args[1]          # launch takes one dtype, else it is a kernel a tensor
            self.bytes += sum(2 * s.numel() * s.element_size() + f.numel() * f.element_size() for s, f in zip(sums, fresh))
            self.ops += 1 if all(s.dtype == f.dtype for s, f in zip(sums, fresh)) else len(sums)
        elif not func.is_view and packet not in self.FREE:
            tensors = [t for t in torch.utils._pytree.tree_leaves((args, out)) if torch.is_tensor(t)]
            self.bytes += sum(t.numel() * t.element_size() for t in tensors)
            self.ops += 1

    def take(self) -> dict:
        """This segment as JSON, and a fresh one begun."""
        done = {"gemm": [[*k, n] for k, n in self.gemms.items()], "bmm": [[*k, n] for k, n in self.bmms.items()],
                "attention": self.attention,
                "attention_ops": self.attention_ops, "bytes": self.bytes, "ops": self.ops}
        self.__init__()
        return done


# --- CUDA's fused attention, stood in for on meta ---
# On meta, SDPA has only its math path, which materializes every score, and flash-attn does not
# run; on the GPUs a rehearsal stands for, both are fused kernels that keep q, k, v, the output
# and a log-sum-exp per row, and compute (flash, causal) the unmasked tiles only. So a rehearsal
# runs this in their place: the same outputs and saved tensors, the same FLOPs as
# perfmodel.attention_time prices (4·T·keys·d forward, 2.5x that backward).

class _FusedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, keys, flops):
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.work, ctx.flops = 4 * q.shape[:-2].numel() * q.shape[-2] * keys * q.shape[-1], flops
        flops.add("attention", ctx.work)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        ctx.flops.add("attention", 2.5 * ctx.work)
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None, None


@contextlib.contextmanager
def cuda_attention(flops):
    """kernels' attention as it runs on CUDA, on meta tensors: auto picks flash-attn (a cluster has
    the `gpu` extra), flash skips masked tiles (kernels.mean_keys), SDPA scores every key when given
    a mask and skips the causal half without one."""
    import kernels
    import torch.nn.functional as F
    saved = (kernels.attention_flash, kernels.pick_attention_impl, F.scaled_dot_product_attention)

    def flash(q, k, v, window=None, dropout=0.0):
        return _FusedAttention.apply(q, k, v, kernels.mean_keys(q.shape[-2], window), flops)

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **_):
        keys = kernels.mean_keys(q.shape[-2], None) if is_causal else k.shape[-2]
        return _FusedAttention.apply(q, k, v, keys, flops)
    kernels.attention_flash, kernels.pick_attention_impl = flash, lambda q, window, block=None: "flash"
    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        kernels.attention_flash, kernels.pick_attention_impl, F.scaled_dot_product_attention = saved


# --- CUDA's fused RMSNorm, stood in for on meta ---
# On CUDA F.rms_norm is one kernel each way (aten::_fused_rms_norm), whose backward keeps the input
# and a fp32 rstd a row. On meta (and a CPU) it is ATen's composite of elementwise ops, whose
# backward keeps an fp32 copy of the input and the fp32 normalized input besides: 8 bytes an
# element where CUDA keeps none beyond the input. So a rehearsal runs this in its place: CUDA's
# output and saved tensors, and an allocation each way that reads and writes what the kernel does.

class _FusedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, dims):
        out = torch.empty_like(x)
        rstd = torch.empty((*x.shape[:x.dim() - dims], *(1,) * dims), dtype=torch.float32, device=x.device)
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, _ = ctx.saved_tensors
        return torch.empty_like(x), None if weight is None else torch.empty_like(weight), None


@contextlib.contextmanager
def cuda_rms_norm():
    """F.rms_norm as it runs on CUDA, on meta tensors (nn.RMSNorm calls it)."""
    import torch.nn.functional as F
    saved = F.rms_norm

    def rms_norm(x, normalized_shape, weight=None, eps=None):
        if x.device.type != "meta":
            return saved(x, normalized_shape, weight, eps)
        return _FusedRMSNorm.apply(x, weight, len(normalized_shape))
    F.rms_norm = rms_norm
    try:
        yield
    finally:
        F.rms_norm = saved


# --- Memory by category ---

class MemoryLedger(TorchDispatchMode):
    """Bytes alive on the device, storage by storage (a view adds nothing), with the peak and
    what it was made of. `classify` names each live storage's category at a new peak: weights,
    gradients, optimizer state, communication buffers, else activations."""

    def __init__(self, device: torch.device, classify):
        super().__init__()
        self.device, self.classify = device, classify
        self.live, self.bytes, self.peak = {}, 0, 0
        self._split, self._peak_at, self.where = {}, "", "start"
        self._snapshot_at, self.paused, self._unclassified = 0, False, None

    def track(self, t: torch.Tensor) -> None:
        if self.paused or not torch.is_tensor(t) or t.device.type != self.device.type:
            return
        st = t.untyped_storage()
        key = id(st)
        if key in self.live:
            return
        self.live[key] = (weakref.ref(st), st.nbytes(), tuple(t.shape), str(t.dtype).removeprefix("torch."))
        self.bytes += st.nbytes()
        weakref.finalize(st, self._release, key, st.nbytes())
        self._note_peak()

    def _note_peak(self) -> None:
        if self.bytes > self.peak:
            self.peak = self.bytes
            if self.bytes > self._snapshot_at * 1.001:  # re-split only when the peak moved
                self._snapshot_at = self.bytes
                self._unclassified = (dict(self.live), self.where)

    def _classify_peak(self) -> None:
        """Names the peak's storages one op after it: the op that allocated its last buffer returns
        before its caller hands the buffer to its owner (ZeRO-2's gradient bucket is allocated,
        then assigned), and classified at the allocation it read as an activation."""
        if self._unclassified is not None:
            live, where = self._unclassified
            self._split, self._peak_at, self._unclassified = self.classify(live), where, None

    @property
    def peak_split(self) -> dict:
        self._classify_peak()
        return self._split

    @property
    def peak_at(self) -> str:
        self._classify_peak()
        return self._peak_at

    def _resized(self, t: torch.Tensor) -> None:
        """A storage resized in place (ZeRO-3 frees a gathered bucket and gathers it again): its
        bytes as they are now."""
        st = t.untyped_storage()
        entry = self.live.get(id(st))
        if entry is None:
            return self.track(t)
        ref, before, shape, dtype = entry
        self.live[id(st)] = (ref, st.nbytes(), shape, dtype)
        self.bytes += st.nbytes() - before
        self._note_peak()

    def _release(self, key, nbytes) -> None:
        entry = self.live.pop(key, None)
        if entry is not None:
            self.bytes -= entry[1]  # (its size now: a resized storage's differs from its first)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._classify_peak()
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.inductor.resize_storage_bytes_.default:
            if not self.paused and args[0].device.type == self.device.type:
                self._resized(args[0])
            return out
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            self.track(t)
        return out


def categories(engine, optimizer, recorder):
    """classify(live) for MemoryLedger: the storages the engine and optimizer hold by name."""
    def keys(tensors):
        return {id(t.untyped_storage()) for t in tensors if torch.is_tensor(t)}

    def classify(live: dict) -> dict:
        zero = engine.zero
        weights = keys(b.params for b in zero.buckets)
        # A parameter's .grad is the gradient itself only where autograd keeps it (one rank, ZeRO-0
        # in fp32); otherwise it is a weight gradient on its way into the bucket, in the backward's
        # working set (as memory.backward_working_set counts it)
        kept = [p.grad for p in zero.params] if zero.autograd_keeps_grads else []
        grads = keys([b.grads for b in zero.buckets] + kept + [s.grad for s in zero.shards])
        state = [v for s in optimizer.state.values() for v in s.values()] + list(getattr(optimizer, "_updates", {}).values())
        opt = keys(state + [b.master for b in zero.buckets if b.master is not None]) - weights
        comm = recorder.comm_storages() - weights - grads - opt
        split = {"weights": 0, "gradients": 0, "optimizer": 0, "communication": 0, "activations": 0}
        largest = []
        for key, (_, nbytes, shape, dtype) in live.items():
            kind = ("weights" if key in weights else "gradients" if key in grads else "optimizer" if key in opt
                    else "communication" if key in comm else "activations")
            split[kind] += nbytes
            if kind == "activations":
                largest.append((nbytes, shape, dtype))
        split["largest_activations"] = [[n, list(sh), dt] for n, sh, dt in sorted(largest, reverse=True)[:12]]
        return split
    return classify
