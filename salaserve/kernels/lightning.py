"""Triton kernels for the Lightning (simple gated linear attention) layers, spec section 4.

    lightning_decode_step   one kernel per layer per decode step: q/k RMSNorm + RoPE + state update
                            + output, reading and writing the state slots in place
    qk_norm_rope            the same q/k RMSNorm + RoPE for many tokens (prefill)
    gla_prefill             varlen chunked GLA over prefill chunks through fla-core, state slots in
                            and out (CPU: the torch twin)
    lightning_output        bf16(o) -> RMSNorm over H*d -> times sigmoid(z), one kernel
    TritonLightningOps      the above behind TorchBackend's method names, for TritonBackend

Every function computes the same function as its TorchBackend twin (`salaserve.kernels.torch_ops`),
including the intermediate roundings to the model dtype, up to fp32 rounding: the GPU's exp, cos,
reduction order and fused multiply-adds differ from torch's by an ulp or so, which can move a bf16
rounding by one bf16 ulp now and then.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from salaserve.kernels._triton_utils import (NO_FMA, pdl_launch_kwargs, pdl_launch_next, pdl_wait, promote, round_to,
                                             rsqrt_rn, tl_dtype)

# ---------------------------------------------------------------------------------------------
# RoPE frequencies
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _inv_freq_cached(head_dim: int, theta: float, device: str) -> torch.Tensor:
    # Exactly the expression of reference.rope_cos_sin, on the same device, so the kernel's angle
    # fp32(p) * inv_freq[i] is bit-identical to torch.outer(positions.float(), inv_freq). (An
    # in-kernel pow/exp2 would be off by an ulp, i.e. by ~5e-3 rad at p = 100000.)
    dev = torch.device(device)
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=dev).float() / head_dim))


def rope_inv_freq(head_dim: int, theta: float, device) -> torch.Tensor:
    """fp32 [head_dim/2] inverse frequencies, cached per (head_dim, theta, device). Call it once
    outside CUDA-graph capture (any warm-up call of the kernels does) so the table is not allocated
    inside a graph."""
    return _inv_freq_cached(int(head_dim), float(theta), str(torch.device(device)))


# ---------------------------------------------------------------------------------------------
# Per-head RMSNorm + NeoX RoPE of one row, in registers
# ---------------------------------------------------------------------------------------------


@triton.jit
def _norm_rope_row(x_ptr, w_ptr, cos, sin, eps, HALF: tl.constexpr, X_DT: tl.constexpr,
                   NORM_DT: tl.constexpr):
    """One head's row x[0:2*HALF] -> RMSNorm (fp32 stats, normalised value rounded to X_DT, times
    the weight, rounded to NORM_DT) -> rotate-half RoPE in fp32, rounded to NORM_DT. Returns the
    two halves as fp32 (values exactly representable in NORM_DT)."""
    offs = tl.arange(0, HALF)
    x1 = tl.load(x_ptr + offs).to(tl.float32)
    x2 = tl.load(x_ptr + HALF + offs).to(tl.float32)
    var = (tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * HALF)
    rstd = rsqrt_rn(var + eps)
    w1 = tl.load(w_ptr + offs).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + offs).to(tl.float32)
    y1 = round_to(round_to(x1 * rstd, X_DT) * w1, NORM_DT)
    y2 = round_to(round_to(x2 * rstd, X_DT) * w2, NORM_DT)
    # NeoX rotate-half: [y1, y2] * cos + [-y2, y1] * sin
    r1 = round_to(y1 * cos - y2 * sin, NORM_DT)
    r2 = round_to(y2 * cos + y1 * sin, NORM_DT)
    return r1, r2


@triton.jit
def _rope_cos_sin(pos_ptr, row, inv_freq_ptr, HALF: tl.constexpr):
    pos = tl.load(pos_ptr + row).to(tl.float32)
    angle = pos * tl.load(inv_freq_ptr + tl.arange(0, HALF))  # one fp32 product, as torch.outer
    return tl.cos(angle), tl.sin(angle)


# ---------------------------------------------------------------------------------------------
# Decode: one token per sequence, the whole layer step in one kernel
# ---------------------------------------------------------------------------------------------


@triton.jit
def _decode_step_kernel(
    q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, pos_ptr, slot_ptr, log_decay_ptr, inv_freq_ptr,
    state_ptr, o_ptr,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
    stride_ss, stride_sh, stride_sk,
    stride_ob, stride_oh,
    scale, eps, B, H,
    HALF: tl.constexpr, BLOCK_V: tl.constexpr,
    X_DT: tl.constexpr, QN_DT: tl.constexpr, KN_DT: tl.constexpr,
    SLOT_MAJOR: tl.constexpr = True,
    PDL: tl.constexpr = False,  # programmatic dependent launch (_triton_utils)
):
    pdl_launch_next(PDL)
    # B * H * (D // BLOCK_V) programs: each owns a [D, BLOCK_V] column block of one head's state,
    # so B=1 x 32 heads still spreads over >100 SMs. Every program recomputes the (cheap) full
    # normalised q and k of its head. SLOT_MAJOR numbers them column block fastest, then head, then
    # sequence, so programs that run side by side stream one slot's contiguous state; otherwise the
    # sequence is fastest (the first layout: neighbours 48 MiB apart).
    pid = tl.program_id(0)
    NVB: tl.constexpr = 2 * HALF // BLOCK_V
    if SLOT_MAJOR:
        vb = pid % NVB
        h = (pid // NVB) % H
        b = pid // (NVB * H)
    else:
        b = pid % B
        h = (pid // B) % H
        vb = pid // (B * H)

    # Issue the state loads first: their latency then overlaps the norm/RoPE arithmetic.
    # The tile of this (slot, head, value block) is split into its key-dim halves [HALF, BLOCK_V],
    # matching the two RoPE halves of q and k.
    # Before the dependency wait (with PDL): the slot numbers, the state and the decay, which no
    # kernel of this forward writes (_triton_utils.pdl_wait). The slots are copied in before the
    # forward; the state is written by this kernel in earlier forwards, and by prefill, verify-commit
    # and prefix-cache copies, which are plain launches or torch ops. The slot -> state chain is two
    # dependent DRAM round trips, which then overlap the qkv GEMV instead of following it.
    slot = tl.load(slot_ptr + b).to(tl.int64)
    rows = tl.arange(0, HALF)
    cols = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    p1 = state_ptr + slot * stride_ss + h * stride_sh + rows[:, None] * stride_sk + cols[None, :]
    p2 = p1 + HALF * stride_sk
    s1 = tl.load(p1)
    s2 = tl.load(p2)
    gamma = tl.exp(tl.load(log_decay_ptr + h).to(tl.float32))
    pdl_wait(PDL)
    v = tl.load(v_ptr + b * stride_vb + h * stride_vh + cols).to(tl.float32)

    cos, sin = _rope_cos_sin(pos_ptr, b, inv_freq_ptr, HALF)
    q1, q2 = _norm_rope_row(q_ptr + b * stride_qb + h * stride_qh, qw_ptr, cos, sin, eps, HALF, X_DT, QN_DT)
    k1, k2 = _norm_rope_row(k_ptr + b * stride_kb + h * stride_kh, kw_ptr, cos, sin, eps, HALF, X_DT, KN_DT)

    s1 = gamma * s1 + k1[:, None] * v[None, :]  # S = gamma S + k^T v
    s2 = gamma * s2 + k2[:, None] * v[None, :]
    tl.store(p1, s1)
    tl.store(p2, s2)

    o = scale * (tl.sum(q1[:, None] * s1, axis=0) + tl.sum(q2[:, None] * s2, axis=0))  # o = s q S
    tl.store(o_ptr + b * stride_ob + h * stride_oh + cols, o)


def _check_rows(name, x, n, H, d):
    if x.dim() != 3 or tuple(x.shape) != (n, H, d):
        raise ValueError(f"{name} must be [{n}, {H}, {d}], got {tuple(x.shape)}")
    if x.stride(2) != 1:
        raise ValueError(f"{name} needs a unit stride in its last dim (rows and heads may be strided)")


def _pick_block_v(num_rows: int, heads: int, d: int) -> int:
    # bench_lightning's sweep on the H200 (24 layers, us per layer): batch 1
    # best at 16-column blocks (4.7; 32: 5.0), batch 128 at 32 (170.9; 64 with 8 warps: 229.0).
    # Small programs with few warps keep many state tiles in flight per SM.
    bv = 16 if num_rows * heads < 512 else 32
    return max(1, min(bv, d))


def _pick_slot_major(num_rows: int, heads: int) -> bool:
    # bench_lightning's order sweep on the H200 (us per layer): batch 128
    # 170.3 sequence-fastest -> 151.5 slot-major (neighbouring programs stream one slot's
    # contiguous state); batch 1 4.8 vs 4.9, within noise, so small batches keep the first order.
    # (An evict-first hint on the state's loads and stores did not help: 154.4 / 5.0.)
    return num_rows * heads >= 512


def _pick_warps(block_v: int) -> int:
    # the same sweep: 2 warps at 16-32 columns (<= 64 state values per thread); wider blocks need
    # more warps or they spill on sm_90
    return 2 if block_v <= 32 else 4 if block_v <= 64 else 8


def lightning_decode_step(q, k, v, q_norm_w, k_norm_w, positions, state, slots, layer, log_decay,
                          scale, eps, theta, *, block_v: int | None = None, num_warps: int | None = None,
                          slot_major: bool | None = None):
    """One Lightning-layer decode step for B sequences (one new token each), in one kernel.

    Per sequence b and head h: q, k <- per-head RMSNorm (TorchBackend.rms_norm roundings) with
    q_norm_w / k_norm_w, then NeoX RoPE at positions[b] (rounded back to the normed dtype); then
        S = exp(log_decay[h]) * S + k^T v ;  o = scale * q S
    with S = state[slots[b], layer, h] updated IN PLACE. Same function as
    TorchBackend.lightning_qk_norm_rope followed by TorchBackend.gla for a decode batch.

    Args:
        q, k, v: [B, H, d] float (bf16/fp16/fp32), same dtype. Any row/head strides (e.g. views into
            the fused [B, 4*H*d] projection), last-dim stride 1.
        q_norm_w, k_norm_w: [d] contiguous. The normed q/k dtype is promote(q.dtype, weight dtype),
            as in torch.
        positions: [B] int (absolute positions). slots: [B] int state slots, all distinct (two rows
            on one slot would race). Padding rows of a fixed-size graph batch are computed and
            written too: point them at spare slots of their own.
        state: [num_slots, n_layers, H, d, d] fp32, last dim contiguous; only
            state[slots[b], layer] is read and written.
        layer: index into state's layer dim. log_decay: [H] fp32 (= -slope). scale, eps, theta: floats.
        block_v: value columns per program (divides d); default picks by B*H. num_warps: default
            picks by block_v. slot_major: program order (default `_pick_slot_major`; it changes no
            bit of the results).
    Returns:
        o: [B, H, d] fp32, contiguous.
    No host syncs and a grid that depends only on shapes: CUDA-graph capturable (positions, slots,
    q/k/v and state must then be static buffers). Call once before capture (RoPE table).
    """
    B, H, d = q.shape
    if d % 2 or d & (d - 1):
        raise ValueError(f"head_dim must be a power of two, got {d}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_rows(name, x, B, H, d)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError("q, k and v must share a dtype")
    if state.dtype != torch.float32 or state.dim() != 5 or tuple(state.shape[2:]) != (H, d, d) or state.stride(4) != 1:
        raise ValueError(f"state must be fp32 [slots, layers, {H}, {d}, {d}] with a contiguous last dim")
    if not (q_norm_w.is_contiguous() and k_norm_w.is_contiguous() and log_decay.is_contiguous()):
        raise ValueError("norm weights and log_decay must be contiguous")
    bv = block_v or _pick_block_v(B, H, d)
    if d % bv:
        raise ValueError(f"block_v {bv} must divide head_dim {d}")
    o = torch.empty(B, H, d, dtype=torch.float32, device=q.device)
    if B == 0:
        return o
    st = state[:, layer]  # a view: the kernel writes the pool itself
    inv_freq = rope_inv_freq(d, theta, q.device)
    _decode_step_kernel[(B * H * (d // bv),)](
        q, k, v, q_norm_w, k_norm_w, positions, slots, log_decay, inv_freq, st, o,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        st.stride(0), st.stride(1), st.stride(2),
        o.stride(0), o.stride(1),
        float(scale), float(eps), B, H,
        HALF=d // 2, BLOCK_V=bv,
        SLOT_MAJOR=_pick_slot_major(B, H) if slot_major is None else bool(slot_major),
        X_DT=tl_dtype(q.dtype), QN_DT=tl_dtype(promote(q.dtype, q_norm_w.dtype)),
        KN_DT=tl_dtype(promote(k.dtype, k_norm_w.dtype)),
        num_warps=num_warps or _pick_warps(bv), **NO_FMA, **pdl_launch_kwargs(q.device),
    )
    return o


# ---------------------------------------------------------------------------------------------
# q/k RMSNorm + RoPE for many tokens (prefill)
# ---------------------------------------------------------------------------------------------


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr, k_ptr, qw_ptr, kw_ptr, pos_ptr, inv_freq_ptr, qo_ptr, ko_ptr,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_qon, stride_qoh, stride_kon, stride_koh,
    eps,
    HALF: tl.constexpr, X_DT: tl.constexpr, QN_DT: tl.constexpr, KN_DT: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)  # n * stride can pass 2^31 in long prefills
    h = tl.program_id(1)
    cos, sin = _rope_cos_sin(pos_ptr, n, inv_freq_ptr, HALF)
    offs = tl.arange(0, HALF)
    q1, q2 = _norm_rope_row(q_ptr + n * stride_qn + h * stride_qh, qw_ptr, cos, sin, eps, HALF, X_DT, QN_DT)
    qo = qo_ptr + n * stride_qon + h * stride_qoh
    tl.store(qo + offs, q1.to(qo_ptr.dtype.element_ty))
    tl.store(qo + HALF + offs, q2.to(qo_ptr.dtype.element_ty))
    k1, k2 = _norm_rope_row(k_ptr + n * stride_kn + h * stride_kh, kw_ptr, cos, sin, eps, HALF, X_DT, KN_DT)
    ko = ko_ptr + n * stride_kon + h * stride_koh
    tl.store(ko + offs, k1.to(ko_ptr.dtype.element_ty))
    tl.store(ko + HALF + offs, k2.to(ko_ptr.dtype.element_ty))


def qk_norm_rope(q, k, q_norm_w, k_norm_w, positions, eps, theta, *, out_dtype=None, num_warps: int = 1):
    """TorchBackend.lightning_qk_norm_rope in one kernel: q, k [N, H, d] (strided rows/heads allowed,
    last-dim stride 1), positions [N] int -> (q', k') [N, H, d] contiguous. Values equal the torch
    twin's (dtype promote(x.dtype, norm weight dtype)); out_dtype=torch.float32 stores those same
    values in fp32, saving the .float() pass before the GLA."""
    N, H, d = q.shape
    if d % 2 or d & (d - 1):
        raise ValueError(f"head_dim must be a power of two, got {d}")
    _check_rows("q", q, N, H, d)
    _check_rows("k", k, N, H, d)
    qn_dt, kn_dt = promote(q.dtype, q_norm_w.dtype), promote(k.dtype, k_norm_w.dtype)
    qo = torch.empty(N, H, d, dtype=out_dtype or qn_dt, device=q.device)
    ko = torch.empty(N, H, d, dtype=out_dtype or kn_dt, device=q.device)
    if N == 0:
        return qo, ko
    inv_freq = rope_inv_freq(d, theta, q.device)
    _qk_norm_rope_kernel[(N, H)](
        q, k, q_norm_w, k_norm_w, positions, inv_freq, qo, ko,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        qo.stride(0), qo.stride(1), ko.stride(0), ko.stride(1),
        float(eps), HALF=d // 2, X_DT=tl_dtype(q.dtype), QN_DT=tl_dtype(qn_dt), KN_DT=tl_dtype(kn_dt),
        num_warps=num_warps, **NO_FMA,
    )
    return qo, ko


# ---------------------------------------------------------------------------------------------
# Output: bf16(o) -> RMSNorm over H*d -> times sigmoid(z)
# ---------------------------------------------------------------------------------------------


@triton.jit
def _output_kernel(
    o_ptr, w_ptr, z_ptr, out_ptr, stride_o, stride_z, stride_out, n_cols, eps,
    BLOCK: tl.constexpr, O_DT: tl.constexpr, NORM_DT: tl.constexpr, Z_DT: tl.constexpr,
    OUT_DT: tl.constexpr,
    PDL: tl.constexpr = False,  # programmatic dependent launch (_triton_utils)
):
    pdl_launch_next(PDL)
    row = tl.program_id(0).to(tl.int64)  # row * stride can pass 2^31 in long prefills
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    # the norm weight before the dependency wait (no kernel writes it; _triton_utils.pdl_wait)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    pdl_wait(PDL)
    x = round_to(tl.load(o_ptr + row * stride_o + cols, mask=mask, other=0.0).to(tl.float32), O_DT)
    rstd = rsqrt_rn(tl.sum(x * x, axis=0) / n_cols + eps)
    y = round_to(round_to(x * rstd, O_DT) * w, NORM_DT)
    z = tl.load(z_ptr + row * stride_z + cols, mask=mask, other=0.0).to(tl.float32)
    gate = round_to(tl.sigmoid(z), Z_DT)  # torch.sigmoid(z) is stored in z's dtype
    out = round_to(y * gate, OUT_DT)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def lightning_output(o, o_norm_w, z, eps, dtype, *, num_warps: int | None = None):
    """TorchBackend.lightning_output in one kernel (one program per row).

    o: [N, H*d] or [N, H, d] (the GLA's output, fp32 or bf16; rows may be strided, the H*d vector contiguous);
    o_norm_w: [H*d] contiguous; z: [N, H*d] with unit last-dim stride (e.g. a view into the fused
    projection). Computes o' = bf16(o) (rounded to `dtype`), RMSNorm over the whole H*d vector with
    fp32 statistics and torch's roundings, times sigmoid(z) (rounded to z.dtype).
    Returns a new contiguous [N, H*d] tensor of dtype promote(dtype, o_norm_w.dtype, z.dtype)
    (= dtype for the model). Graph capturable.
    """
    N = o.shape[0]
    o2 = o.reshape(N, -1)
    n_cols = o2.shape[1]
    if o2.stride(1) != 1 or z.dim() != 2 or tuple(z.shape) != (N, n_cols) or z.stride(1) != 1:
        raise ValueError("o and z need unit stride along H*d and matching shapes")
    if o_norm_w.numel() != n_cols or not o_norm_w.is_contiguous():
        raise ValueError(f"o_norm_w must be a contiguous [{n_cols}] vector")
    norm_dt = promote(dtype, o_norm_w.dtype)
    out_dt = promote(norm_dt, z.dtype)
    out = torch.empty(N, n_cols, dtype=out_dt, device=o.device)
    if N == 0:
        return out
    block = triton.next_power_of_2(n_cols)
    _output_kernel[(N,)](
        o2, o_norm_w, z, out, o2.stride(0), z.stride(0), out.stride(0), n_cols, float(eps),
        BLOCK=block, O_DT=tl_dtype(dtype), NORM_DT=tl_dtype(norm_dt), Z_DT=tl_dtype(z.dtype),
        OUT_DT=tl_dtype(out_dt), num_warps=num_warps or (8 if block >= 2048 else 4), **NO_FMA,
        **pdl_launch_kwargs(o2.device),
    )
    return out


# ---------------------------------------------------------------------------------------------
# Prefill GLA: fla-core's varlen chunk kernel, state slots gathered and scattered
# ---------------------------------------------------------------------------------------------


def _load_fla():
    """(chunk_simple_gla, fused_recurrent_simple_gla) from fla-core (GPU only). Tests replace this
    function to check the glue on CPU."""
    from fla.ops.simple_gla import chunk_simple_gla, fused_recurrent_simple_gla

    return chunk_simple_gla, fused_recurrent_simple_gla


def gla_prefill(q, k, v, batch, states, layer, log_decay, scale, *, input_dtype=torch.float32,
                recurrent_below: int = 64, impl: str = "auto"):
    """Simple GLA over the packed tokens of several sequences (varlen), each starting from its state
    slot; final states are written back. Same function as TorchBackend.gla.

    Args:
        q, k, v: [N, H, d] (already normed/roped q, k; any float dtype; strides free), N = sum of
            batch.q_lens_host, sequences packed in batch order along N (batch.cu_seqlens_q).
        batch: ForwardBatch (uses cu_seqlens_q, q_lens_host, state_slots; slots distinct).
        states: StatePool; states.state[state_slots[i], layer] is the initial state of sequence i
            and receives its final state (gathered into a [B, H, d, d] copy and scattered back:
            2 MiB per sequence, nothing next to a prefill).
        log_decay: [H] fp32 (= -slope), fla's g_gamma. scale: float.
        input_dtype: dtype q/k/v are cast to before fla. fp32 (default) is HF parity: HF feeds fp32
            q/k/v to fla. bf16 is ~2x faster at long chunks (anchors) and is what SGLang does; the
            state stays fp32 either way, but fla then keeps its per-chunk states in bf16.
        recurrent_below: when every sequence of the batch has fewer tokens than this, use fla's
            fused_recurrent_simple_gla (one launch, fp32 elementwise math, no chunk overhead), as HF
            does for T < 64; otherwise chunk_simple_gla (varlen, chunk 64). Same function.
        impl: "fla", "torch" (TorchBackend.gla) or "auto" (fla on CUDA, torch elsewhere).
    Returns:
        o: [N, H, d] in fla's output dtype, input_dtype (fp32 on the torch path): the values of
        TorchBackend.gla rounded to it.
    Not graph-capturable (fla's varlen index preparation); prefill runs eagerly. A batch of one
    sequence goes through fla's fixed-length call, which needs no host sync.
    Note: fla's chunk kernels use tl.dot's default precision, i.e. TF32 for fp32 inputs (HF's own
    numerics), so expect ~1e-3 relative differences from the fp32 torch twin on the GPU.
    """
    if impl == "auto":
        impl = "fla" if q.device.type == "cuda" else "torch"
    if impl == "torch":
        from salaserve.kernels.torch_ops import TorchBackend

        return TorchBackend().gla(q, k, v, batch, states, layer, log_decay, scale)
    if impl != "fla":
        raise ValueError(f"impl must be 'auto', 'fla' or 'torch', got {impl!r}")
    chunk_simple_gla, fused_recurrent_simple_gla = _load_fla()

    lens = batch.q_lens_host
    N = q.shape[0]
    if sum(lens) != N:
        raise ValueError(f"q has {N} tokens but the batch packs {sum(lens)}")
    # fla's varlen API: batch dim 1, tokens of all sequences packed along T.
    q1, k1, v1 = (x.to(input_dtype).contiguous()[None] for x in (q, k, v))
    # int32 -> int64 always makes a new tensor: fla memoises index tensors by tensor identity, so a
    # reused (static) cu_seqlens buffer with new contents must never reach it.
    cu_seqlens = batch.cu_seqlens_q.to(torch.int64)
    slots = batch.state_slots
    h0 = states.state[slots, layer].to(torch.float32)  # [B, H, d, d] gather
    g_gamma = log_decay.to(torch.float32).contiguous()
    if max(lens) < recurrent_below:
        o, ht = fused_recurrent_simple_gla(q1, k1, v1, g_gamma=g_gamma, scale=scale, initial_state=h0,
                                           output_final_state=True, cu_seqlens=cu_seqlens)
    elif len(lens) == 1:
        # one sequence (a long prompt's chunks): fla's fixed-length call. Its varlen path reads
        # chunk counts back to the host twice per call (fla 0.6: chunk_fwd_h's .item(),
        # chunk_fwd_o's index preparation), and each stream sync leaves the GPU idle while
        # Python launches the next kernels: 192 syncs in a 32K prefill.
        o, ht = chunk_simple_gla(q1, k1, v1, g_gamma=g_gamma, scale=scale, initial_state=h0,
                                 output_final_state=True)
    else:
        cu_cpu = torch.tensor([0] + list(_cumsum(lens)), dtype=torch.int64)  # no device sync
        o, ht = chunk_simple_gla(q1, k1, v1, g_gamma=g_gamma, scale=scale, initial_state=h0,
                                 output_final_state=True, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_cpu)
    states.state[slots, layer] = ht.to(states.state.dtype)  # scatter
    # o in fla's output dtype (its input dtype): lightning_output rounds it to the model dtype first,
    # so an fp32 copy here would change no value and cost a pass over o
    return o[0]


def _cumsum(xs):
    total = 0
    for x in xs:
        total += x
        yield total


# ---------------------------------------------------------------------------------------------
# Backend methods
# ---------------------------------------------------------------------------------------------


class TritonLightningOps:
    """Mixin with TorchBackend's Lightning-layer method names, for TritonBackend.

    lightning_qk_norm_rope / gla / lightning_output replace the torch twins one for one; the model
    can instead call lightning_decode (norm + RoPE + GLA in one kernel) when batch.is_decode.
    """

    # fla's q/k/v precision in prefill: bf16, what SGLang feeds it (half fla's input bytes; fla then
    # keeps its per-chunk states in bf16). fp32 (HF parity) measured a 128K prefill 4.915 s against
    # 4.828, with the engine's error against the reference the same within 1.5% (max rel err
    # 0.0230 vs 0.0233 at 1K, top-1 equal).
    gla_input_dtype = torch.bfloat16

    def lightning_qk_norm_rope(self, q, k, q_norm, k_norm, positions, eps, theta):
        """q', k' in fla's input dtype straight from the kernel (the torch twin's values; with fp32,
        exactly them): gla_prefill then has no cast pass over q and k."""
        return qk_norm_rope(q, k, q_norm, k_norm, positions, eps, theta, out_dtype=self.gla_input_dtype)

    def lightning_decode(self, q, k, v, q_norm, k_norm, batch, states, layer, log_decay, scale, eps, theta):
        """Decode batch (one token per sequence): o [B, H, d] fp32; states updated in place."""
        return lightning_decode_step(q, k, v, q_norm, k_norm, batch.positions, states.state,
                                     batch.state_slots, layer, log_decay, scale, eps, theta)

    def gla(self, q, k, v, batch, states, layer, log_decay, scale):
        return gla_prefill(q, k, v, batch, states, layer, log_decay, scale, input_dtype=self.gla_input_dtype)

    def lightning_output(self, o, o_norm, z, eps, dtype):
        return lightning_output(o, o_norm, z, eps, dtype)
