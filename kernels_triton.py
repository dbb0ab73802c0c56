"""Hand-written Triton kernels for kernels.fused=triton (CUDA, the optional `triton` extra):
residual add + LayerNorm or RMSNorm, bias + GeLU and SwiGLU, forward and backward, and the
cross-entropy.

Each op is one pass over its rows forward and one backward, computing in fp32 whatever the
tensors' dtype, and saving only its input and at most two floats per row (the LayerNorm's mean
and 1/std, RMSNorm's 1/rms, the cross-entropy's log-sum-exp): the backward recomputes the rest, which costs less
than reading it back. The kernels are defined inside jit_kernels(), so `import triton` happens on
first use and a run without the optional extra never needs it. kernels.py decides when they run
(kernels._use_triton); on CPU only Triton's interpreter (TRITON_INTERPRET=1) runs them, for tests.
"""
from __future__ import annotations

import functools
from types import SimpleNamespace

import torch


@functools.lru_cache(maxsize=None)
def jit_kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def layer_norm_fwd(x_ptr, delta_ptr, w_ptr, b_ptr, sum_ptr, y_ptr, mean_ptr, rstd_ptr, N, eps,
                       HAS_DELTA: tl.constexpr, HAS_BIAS: tl.constexpr, RMS: tl.constexpr, BLOCK: tl.constexpr):
        # One program per row, the whole row in registers. RMS: RMSNorm, x / rms(x) * w (no mean taken
        # out, no bias), else LayerNorm.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        offs = row * N + cols
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_DELTA:
            # Rounded to the residual stream's dtype before normalizing, as eager normalizes it.
            s = (x + tl.load(delta_ptr + offs, mask=mask, other=0.0).to(tl.float32)).to(sum_ptr.dtype.element_ty)
            tl.store(sum_ptr + offs, s, mask=mask)
            x = s.to(tl.float32)
        if RMS:
            xc = x  # masked columns loaded as 0
        else:
            mean = tl.sum(x, axis=0) / N
            xc = tl.where(mask, x - mean, 0.0)
            tl.store(mean_ptr + row, mean)
        rstd = 1 / tl.sqrt(tl.sum(xc * xc, axis=0) / N + eps)
        y = xc * rstd * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(rstd_ptr + row, rstd)

    @triton.jit
    def layer_norm_bwd(s_ptr, w_ptr, mean_ptr, rstd_ptr, dy_ptr, dsum_ptr, ds_ptr, dw_ptr, db_ptr, M, N,
                       HAS_DSUM: tl.constexpr, RMS: tl.constexpr, BLOCK: tl.constexpr):
        # Program p takes rows p, p + P, p + 2P, ...: it writes their input gradient and sums their
        # dw and db in registers, stored once as row p of [P, N] partials (torch adds the P rows).
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK], dtype=tl.float32)
        db = tl.zeros([BLOCK], dtype=tl.float32)
        for row in range(pid, M, tl.num_programs(0)):
            # int64, as M·N may pass 2^31; tl.cast, not .to: in the interpreter row is a Python int
            offs = tl.cast(row, tl.int64) * N + cols
            s = tl.load(s_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + row)
            dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            wdy = w * dy
            if RMS:  # no mean taken out: no sum of wdy in the gradient
                xhat = s * rstd
                ds = (wdy - xhat * tl.sum(wdy * xhat, axis=0) / N) * rstd
            else:
                xhat = tl.where(mask, (s - tl.load(mean_ptr + row)) * rstd, 0.0)
                ds = (wdy - (xhat * tl.sum(wdy * xhat, axis=0) + tl.sum(wdy, axis=0)) / N) * rstd
            if HAS_DSUM:  # the residual stream's own gradient joins the LayerNorm's
                ds += tl.load(dsum_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(ds_ptr + offs, ds.to(ds_ptr.dtype.element_ty), mask=mask)
            dw += dy * xhat
            db += dy
        tl.store(dw_ptr + pid * N + cols, dw, mask=mask)
        tl.store(db_ptr + pid * N + cols, db, mask=mask)

    @triton.jit
    def bias_gelu(x_ptr, b_ptr, dy_ptr, out_ptr, db_ptr, M, N, HAS_BIAS: tl.constexpr, BACKWARD: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        # Forward and backward in one kernel (a constexpr picks), as both start from the same tile of
        # x + bias; the interpreter cannot call a helper @triton.jit defined in here. The backward
        # recomputes z = x + bias rather than saving it: one read of x instead of a write and a read.
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        offs = rows[:, None].to(tl.int64) * N + cols[None, :]
        z = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:  # the bias rounded to x's dtype first, as eager's bias.to(x.dtype)
            b = tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(x_ptr.dtype.element_ty)
            z += b.to(tl.float32)[None, :]
        cdf = 0.5 * (1 + tl.erf(z * 0.7071067811865476))  # exact erf GeLU: z·Phi(z)
        if not BACKWARD:
            tl.store(out_ptr + offs, (z * cdf).to(out_ptr.dtype.element_ty), mask=mask)
        else:  # GeLU'(z) = Phi(z) + z·phi(z)
            dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            dz = dy * (cdf + z * tl.exp(-0.5 * z * z) * 0.3989422804014327)
            tl.store(out_ptr + offs, dz.to(out_ptr.dtype.element_ty), mask=mask)
            if HAS_BIAS:  # this tile's column sums: row program_id(0) of [M / BLOCK_M, N] partials
                tl.store(db_ptr + tl.program_id(0) * N + cols, tl.sum(dz, axis=0), mask=cols < N)

    @triton.jit
    def swiglu(x_ptr, b_ptr, dy_ptr, out_ptr, db_ptr, M, F, HAS_BIAS: tl.constexpr, BACKWARD: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        # x is [M, 2F] with gate and up interleaved (unit j: columns 2j, 2j+1); a tile is
        # [BLOCK_M, BLOCK_N] units. Forward writes silu(g)·u [M, F]; backward, from dy [M, F], the
        # gradient of x in x's layout, and the tile's bias column sums as bias_gelu's. Backward
        # recomputes silu from x rather than saving it, as bias_gelu does.
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        units = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < M) & (units[None, :] < F)
        g_offs = rows[:, None].to(tl.int64) * (2 * F) + 2 * units[None, :]
        g = tl.load(x_ptr + g_offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + g_offs + 1, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:  # the bias rounded to x's dtype first, as eager's bias.to(x.dtype)
            bg = tl.load(b_ptr + 2 * units, mask=units < F, other=0.0).to(x_ptr.dtype.element_ty)
            bu = tl.load(b_ptr + 2 * units + 1, mask=units < F, other=0.0).to(x_ptr.dtype.element_ty)
            g += bg.to(tl.float32)[None, :]
            u += bu.to(tl.float32)[None, :]
        sig = 1 / (1 + tl.exp(-g))
        y_offs = rows[:, None].to(tl.int64) * F + units[None, :]
        if not BACKWARD:
            tl.store(out_ptr + y_offs, (g * sig * u).to(out_ptr.dtype.element_ty), mask=mask)
        else:  # d/dg silu(g) = sig·(1 + g·(1 - sig))
            dy = tl.load(dy_ptr + y_offs, mask=mask, other=0.0).to(tl.float32)
            dg = dy * u * sig * (1 + g * (1 - sig))
            du = dy * g * sig
            tl.store(out_ptr + g_offs, dg.to(out_ptr.dtype.element_ty), mask=mask)
            tl.store(out_ptr + g_offs + 1, du.to(out_ptr.dtype.element_ty), mask=mask)
            if HAS_BIAS:  # row program_id(0) of [M / BLOCK_M, 2F] partials
                part = db_ptr + tl.program_id(0) * (2 * F) + 2 * units
                tl.store(part, tl.sum(dg, axis=0), mask=units < F)
                tl.store(part + 1, tl.sum(du, axis=0), mask=units < F)

    @triton.jit
    def cross_entropy_fwd(logits_ptr, targets_ptr, loss_ptr, lse_ptr, V, BLOCK_V: tl.constexpr):
        # One program per row and one pass over the vocab: the online log-sum-exp keeps a running
        # max m and the sum d of exp(z - m), rescaled whenever m grows (Milakov & Gimelshein 2018).
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * V
        m = float("-inf")
        d = 0.0
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            z = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(z, axis=0))
            d = d * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
            m = m_new
        lse = m + tl.log(d)
        target_logit = tl.load(base + tl.load(targets_ptr + row)).to(tl.float32)
        tl.store(loss_ptr + row, lse - target_logit)
        tl.store(lse_ptr + row, lse)

    @triton.jit
    def cross_entropy_bwd(logits_ptr, targets_ptr, lse_ptr, dloss_ptr, dlogits_ptr, V, BLOCK_V: tl.constexpr):
        # d loss / d logits = (softmax - one-hot(target)) · d loss, written in the logits' dtype.
        row = tl.program_id(0).to(tl.int64)
        lse = tl.load(lse_ptr + row)
        dloss = tl.load(dloss_ptr + row)
        target = tl.load(targets_ptr + row)
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            z = tl.load(logits_ptr + row * V + cols, mask=cols < V, other=0.0).to(tl.float32)
            p = tl.exp(z - lse)
            p = tl.where(cols == target, p - 1.0, p)
            tl.store(dlogits_ptr + row * V + cols, (p * dloss).to(dlogits_ptr.dtype.element_ty), mask=cols < V)

    next_power_of_2 = triton.next_power_of_2
    return SimpleNamespace(**locals())


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., N] as a contiguous [M, N] (a view when t is already contiguous)."""
    return t.reshape(-1, t.shape[-1]).contiguous()


def _cdiv(n: int, d: int) -> int:
    return -(-n // d)


def _warps(block: int) -> int:
    return min(max(block // 256, 1), 8)  # a warp per 256 elements of a row, 1 to 8


def _partial_programs(device: torch.device, rows: int) -> int:
    """How many programs share the LayerNorm backward's rows: enough to fill the GPU a few times
    over, few enough that adding up their [P, N] partial dw and db costs little."""
    if device.type == "cuda":
        return min(rows, 4 * torch.cuda.get_device_properties(device).multi_processor_count)
    return min(rows, 4)  # the interpreter runs programs one after another: fewer is faster


class TritonLayerNorm(torch.autograd.Function):
    """(x + delta, LN(x + delta)), or LN(x) when delta is None; RMSNorm for rms=True (bias None)."""

    @staticmethod
    def forward(ctx, x, delta, weight, bias, eps, rms=False):
        k = jit_kernels()
        rows = _rows(x)
        M, N = rows.shape
        block = k.next_power_of_2(N)
        dtype = x.dtype if delta is None else torch.promote_types(x.dtype, delta.dtype)
        s = rows if delta is None else torch.empty(M, N, dtype=dtype, device=x.device)
        y = torch.empty(M, N, dtype=dtype, device=x.device)
        mean, rstd = (torch.empty(M, dtype=torch.float32, device=x.device) for _ in range(2))
        # Unused pointers (no delta, no bias) get any tensor: the constexpr flags compile them out.
        k.layer_norm_fwd[(M,)](rows, rows if delta is None else _rows(delta), weight,
                               weight if bias is None else bias, s, y, mean, rstd, N, eps,
                               HAS_DELTA=delta is not None, HAS_BIAS=bias is not None, RMS=rms, BLOCK=block,
                               num_warps=_warps(block))
        ctx.save_for_backward(s, weight, bias, mean, rstd)
        ctx.rms = rms
        ctx.shape, ctx.x_dtype = x.shape, x.dtype
        ctx.delta_dtype = None if delta is None else delta.dtype
        y = y.view(x.shape)
        return y if delta is None else (s.view(x.shape), y)

    @staticmethod
    def backward(ctx, *grads):
        k = jit_kernels()
        s, weight, bias, mean, rstd = ctx.saved_tensors
        M, N = s.shape
        block = k.next_power_of_2(N)
        dy = _rows(grads[-1])
        dsum = _rows(grads[0]) if len(grads) == 2 else None
        P = _partial_programs(s.device, M)
        ds = torch.empty_like(s)
        dw, db = (torch.empty(P, N, dtype=torch.float32, device=s.device) for _ in range(2))
        k.layer_norm_bwd[(P,)](s, weight, mean, rstd, dy, dy if dsum is None else dsum, ds, dw, db, M, N,
                               HAS_DSUM=dsum is not None, RMS=ctx.rms, BLOCK=block, num_warps=_warps(block))
        ds = ds.view(ctx.shape)
        d_delta = None if ctx.delta_dtype is None else ds.to(ctx.delta_dtype)
        d_bias = None if bias is None else db.sum(0).to(bias.dtype)
        return ds.to(ctx.x_dtype), d_delta, dw.sum(0).to(weight.dtype), d_bias, None, None


class TritonBiasGelu(torch.autograd.Function):
    """GeLU(x + bias), bias optional, in [BLOCK_M, BLOCK_N] tiles of x as [M, N] rows."""
    BLOCK_M, BLOCK_N = 32, 128

    @staticmethod
    def _launch(rows, bias, dy, out, db):
        M, N = rows.shape
        bm, bn = TritonBiasGelu.BLOCK_M, TritonBiasGelu.BLOCK_N
        jit_kernels().bias_gelu[(_cdiv(M, bm), _cdiv(N, bn))](
            rows, rows if bias is None else bias, rows if dy is None else dy, out, out if db is None else db,
            M, N, HAS_BIAS=bias is not None, BACKWARD=dy is not None, BLOCK_M=bm, BLOCK_N=bn)

    @staticmethod
    def forward(ctx, x, bias):
        rows = _rows(x)
        y = torch.empty_like(rows)
        TritonBiasGelu._launch(rows, bias, None, y, None)
        ctx.save_for_backward(rows, bias)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        rows, bias = ctx.saved_tensors
        dx = torch.empty_like(rows)
        db = None
        if bias is not None:
            db = torch.empty(_cdiv(rows.shape[0], TritonBiasGelu.BLOCK_M), rows.shape[1], dtype=torch.float32,
                             device=rows.device)
        TritonBiasGelu._launch(rows, bias, _rows(dy), dx, db)
        return dx.view(dy.shape), None if bias is None else db.sum(0).to(bias.dtype)


class TritonSwiGLU(torch.autograd.Function):
    """silu(gate) * up of x [..., 2F] (+ bias), gate and up interleaved, in tiles of [M, F] units."""
    BLOCK_M, BLOCK_N = 32, 64

    @staticmethod
    def _launch(rows, bias, dy, out, db):
        M, F = rows.shape[0], rows.shape[1] // 2
        bm, bn = TritonSwiGLU.BLOCK_M, TritonSwiGLU.BLOCK_N
        jit_kernels().swiglu[(_cdiv(M, bm), _cdiv(F, bn))](
            rows, rows if bias is None else bias, rows if dy is None else dy, out, out if db is None else db,
            M, F, HAS_BIAS=bias is not None, BACKWARD=dy is not None, BLOCK_M=bm, BLOCK_N=bn)

    @staticmethod
    def forward(ctx, x, bias):
        rows = _rows(x)
        y = rows.new_empty(rows.shape[0], rows.shape[1] // 2)
        TritonSwiGLU._launch(rows, bias, None, y, None)
        ctx.save_for_backward(rows, bias)
        ctx.shape = x.shape
        return y.view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, dy):
        rows, bias = ctx.saved_tensors
        dx = torch.empty_like(rows)
        db = None
        if bias is not None:
            db = torch.empty(_cdiv(rows.shape[0], TritonSwiGLU.BLOCK_M), rows.shape[1], dtype=torch.float32,
                             device=rows.device)
        TritonSwiGLU._launch(rows, bias, _rows(dy), dx, db)
        return dx.view(ctx.shape), None if bias is None else db.sum(0).to(bias.dtype)


def _vocab_block(V: int) -> int:
    """Logits per step of the cross-entropy's loop over a row: a 50k vocab is read in 13 steps."""
    return min(jit_kernels().next_power_of_2(V), 4096)


class TritonCrossEntropy(torch.autograd.Function):
    """Per-row cross-entropy of [N, V] logits, in fp32; the caller takes the mean."""

    @staticmethod
    def forward(ctx, logits, targets):
        k = jit_kernels()
        logits, targets = logits.contiguous(), targets.contiguous()
        n, V = logits.shape
        loss, lse = (torch.empty(n, dtype=torch.float32, device=logits.device) for _ in range(2))
        ctx.block = _vocab_block(V)
        k.cross_entropy_fwd[(n,)](logits, targets, loss, lse, V, BLOCK_V=ctx.block, num_warps=_warps(ctx.block))
        ctx.save_for_backward(logits, targets, lse)
        return loss

    @staticmethod
    def backward(ctx, dloss):
        logits, targets, lse = ctx.saved_tensors
        n, V = logits.shape
        dlogits = torch.empty_like(logits)
        # dloss of a mean is one value expanded (stride 0): contiguous() makes the n floats the kernel reads.
        jit_kernels().cross_entropy_bwd[(n,)](logits, targets, lse, dloss.contiguous(), dlogits, V,
                                                  BLOCK_V=ctx.block, num_warps=_warps(ctx.block))
        return dlogits, None
