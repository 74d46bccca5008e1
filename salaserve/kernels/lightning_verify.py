"""Lightning layers under speculative decoding: verify without committing, then commit the
accepted prefix (issue 8; spec section 4).

    lightning_verify   per sequence, its few tokens through the recurrence from the live state:
                       q/k RMSNorm + RoPE, S <- gamma S + k^T v, o = scale q S. Verify sequences
                       leave the state untouched and keep their normed k and v for the commit;
                       plain decode sequences of the same batch write their state back at once.
                       Two forms: "chunk" (default; dots over all tokens at once, one pass) and
                       "loop" (token by token, the decode kernel's exact arithmetic).
    lightning_commit   after acceptance, every Lightning layer of every verified sequence advances
                       by its first `count` tokens, replaying the kept k/v (one launch per step).

Keeping k and v (2 x 8 KiB per token per layer at the real shapes) instead of a state copy per
candidate (64 KiB per head) is what makes verify cheap. Both kernels have grids that depend on
shapes only and never sync: CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from salaserve.kernels._triton_utils import NO_FMA, promote, tl_dtype
from salaserve.kernels.lightning import (_check_rows, _norm_rope_row, _pick_block_v, _pick_warps, _rope_cos_sin,
                                         qk_norm_rope, rope_inv_freq)

# per-sequence modes of lightning_verify
SKIP, VERIFY, DECODE = 0, 1, 2


@triton.jit
def _verify_kernel(
    q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, pos_ptr, cu_ptr, mode_ptr, slot_ptr, log_decay_ptr, inv_freq_ptr,
    state_ptr, o_ptr, ks_ptr, vs_ptr,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
    stride_ss, stride_sh, stride_sk,
    stride_on, stride_oh, stride_ksn, stride_ksh, stride_vsn, stride_vsh,
    scale, eps,
    HALF: tl.constexpr, BLOCK_V: tl.constexpr,
    X_DT: tl.constexpr, QN_DT: tl.constexpr, KN_DT: tl.constexpr,
):
    # grid (B, H, D // BLOCK_V), as the decode step: each program owns a [D, BLOCK_V] column block
    # of one head's state and walks the sequence's tokens in order with the state in registers.
    b = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    mode = tl.load(mode_ptr + b)
    if mode != 0:
        start = tl.load(cu_ptr + b).to(tl.int64)  # int64 row offsets: t * stride may pass 2^31
        end = tl.load(cu_ptr + b + 1).to(tl.int64)
        slot = tl.load(slot_ptr + b).to(tl.int64)
        rows = tl.arange(0, HALF)
        cols = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        p1 = state_ptr + slot * stride_ss + h * stride_sh + rows[:, None] * stride_sk + cols[None, :]
        p2 = p1 + HALF * stride_sk
        s1 = tl.load(p1)
        s2 = tl.load(p2)
        gamma = tl.exp(tl.load(log_decay_ptr + h).to(tl.float32))
        for t64 in range(start, end):
            v = tl.load(v_ptr + t64 * stride_vn + h * stride_vh + cols).to(tl.float32)
            cos, sin = _rope_cos_sin(pos_ptr, t64, inv_freq_ptr, HALF)
            q1, q2 = _norm_rope_row(q_ptr + t64 * stride_qn + h * stride_qh, qw_ptr, cos, sin, eps, HALF, X_DT,
                                    QN_DT)
            k1, k2 = _norm_rope_row(k_ptr + t64 * stride_kn + h * stride_kh, kw_ptr, cos, sin, eps, HALF, X_DT,
                                    KN_DT)
            s1 = gamma * s1 + k1[:, None] * v[None, :]  # S = gamma S + k^T v (no FMA: as decode)
            s2 = gamma * s2 + k2[:, None] * v[None, :]
            o = scale * (tl.sum(q1[:, None] * s1, axis=0) + tl.sum(q2[:, None] * s2, axis=0))
            tl.store(o_ptr + t64 * stride_on + h * stride_oh + cols, o)
            if mode == 1:  # keep what the commit replays: normed k (exact in KN_DT) and v
                tl.store(vs_ptr + t64 * stride_vsn + h * stride_vsh + cols, v.to(vs_ptr.dtype.element_ty))
                if vb == 0:
                    kp = ks_ptr + t64 * stride_ksn + h * stride_ksh + rows
                    tl.store(kp, k1.to(ks_ptr.dtype.element_ty))
                    tl.store(kp + HALF, k2.to(ks_ptr.dtype.element_ty))
        if mode == 2:
            tl.store(p1, s1)
            tl.store(p2, s2)


@triton.jit
def _verify_chunk_kernel(
    qn_ptr, kn_ptr, v_ptr, cu_ptr, mode_ptr, slot_ptr, log_decay_ptr, state_ptr, o_ptr, ks_ptr, vs_ptr,
    depth_ptr, anc_ptr,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
    stride_ss, stride_sh, stride_sk,
    stride_on, stride_oh, stride_ksn, stride_ksh, stride_vsn, stride_vsh,
    scale,
    D: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_T: tl.constexpr, TREE: tl.constexpr,
):
    # grid (B, H, D // BLOCK_V). The same function as the token loop, in the chunk form with no
    # sequential dependency between tokens (q, k already normed and roped, as fp32):
    #   o_t = scale * (gamma^(t+1) q_t S0 + sum_{j<=t} gamma^(t-j) (q_t . k_j) v_j)
    #   S_n = gamma^n S0 + sum_j gamma^(n-1-j) k_j^T v_j              (DECODE sequences only)
    # TREE: draft trees (spec/tree.py): t becomes each row's depth and j <= t "j is t or one of
    # its ancestors" (anc_ptr: per row, a bit mask over its sequence's rows)
    b = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    mode = tl.load(mode_ptr + b)
    if mode != 0:
        start = tl.load(cu_ptr + b).to(tl.int64)
        n = (tl.load(cu_ptr + b + 1) - tl.load(cu_ptr + b)).to(tl.int32)
        t = tl.arange(0, BLOCK_T)
        tok = start + t
        t_ok = t < n
        d = tl.arange(0, D)
        cols = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        qt = tl.load(qn_ptr + tok[:, None] * stride_qn + h * stride_qh + d[None, :], mask=t_ok[:, None], other=0.0)
        kt = tl.load(kn_ptr + tok[:, None] * stride_kn + h * stride_kh + d[None, :], mask=t_ok[:, None], other=0.0)
        vt = tl.load(v_ptr + tok[:, None] * stride_vn + h * stride_vh + cols[None, :], mask=t_ok[:, None],
                     other=0.0).to(tl.float32)
        slot = tl.load(slot_ptr + b).to(tl.int64)
        sp = state_ptr + slot * stride_ss + h * stride_sh + d[:, None] * stride_sk + cols[None, :]
        s0 = tl.load(sp)
        ld = tl.load(log_decay_ptr + h).to(tl.float32)
        if TREE:
            tf = tl.load(depth_ptr + tok, mask=t_ok, other=0).to(tl.float32)
            anc = tl.load(anc_ptr + tok, mask=t_ok, other=0)
            causal = ((anc[:, None] >> t[None, :]) & 1) != 0
        else:
            tf = t.to(tl.float32)
            causal = t[:, None] >= t[None, :]
        decay = tl.where(causal, tl.exp((tf[:, None] - tf[None, :]) * ld), 0.0)
        a = tl.dot(qt, tl.trans(kt), input_precision="ieee") * decay
        o = tl.dot(qt, s0, input_precision="ieee") * tl.exp((tf + 1.0) * ld)[:, None]
        o = scale * tl.dot(a, vt, o, input_precision="ieee")
        tl.store(o_ptr + tok[:, None] * stride_on + h * stride_oh + cols[None, :], o, mask=t_ok[:, None])
        if mode == 1:  # keep what the commit replays: normed k (exact in its dtype) and v
            tl.store(vs_ptr + tok[:, None] * stride_vsn + h * stride_vsh + cols[None, :],
                     vt.to(vs_ptr.dtype.element_ty), mask=t_ok[:, None])
            if vb == 0:
                tl.store(ks_ptr + tok[:, None] * stride_ksn + h * stride_ksh + d[None, :],
                         kt.to(ks_ptr.dtype.element_ty), mask=t_ok[:, None])
        if mode == 2:
            w = tl.where(t_ok, tl.exp((n - 1 - t).to(tl.float32) * ld), 0.0)
            s_end = tl.dot(tl.trans(kt * w[:, None]), vt, s0 * tl.exp(n.to(tl.float32) * ld),
                           input_precision="ieee")
            tl.store(sp, s_end)


def tree_rows_meta(q_lens: list[int], trees: list, device) -> tuple[torch.Tensor, torch.Tensor]:
    """lightning_verify's `tree` argument: per token row, its depth and the bit mask of the rows of
    its sequence it sees. trees[i]: sequence i's parent candidates (spec/tree.py) or None (its rows
    as a chain: the causal mask; rows past the 31st get no bits: only prefill chunks, which the
    kernel skips, are that long)."""
    depth, anc = [], []
    for n, parents in zip(q_lens, trees):
        if parents is None:
            depth.extend(range(n))
            anc.extend((1 << (t + 1)) - 1 if t < 31 else 0 for t in range(n))
            continue
        d, a = [0], [1]
        for i, p in enumerate(parents):
            d.append(d[p + 1] + 1)
            a.append(a[p + 1] | (1 << (i + 1)))
        depth.extend(d)
        anc.extend(a)
    if any(x >= 1 << 31 for x in anc):
        raise ValueError("a draft tree's sequence has more than 31 rows")
    return (torch.tensor(depth, dtype=torch.int32, device=device), torch.tensor(anc, dtype=torch.int32, device=device))


# Two forms: "chunk", one pass with dots and no token-to-token dependency (k = 8 verify 1.12x a decode
# step against 1.20x), up to CHUNK_MAX_TOKENS per sequence; "loop", token by token, the decode kernel's
# exact arithmetic (bitwise what plain decoding computes), for longer sequences
CHUNK_MAX_TOKENS = 16  # [T, d] fp32 tiles of q and k: 32 rows spill registers on sm_90


def lightning_verify(q, k, v, q_norm_w, k_norm_w, positions, cu_seqlens, modes, state, slots, layer, log_decay,
                     scale, eps, theta, k_keep, v_keep, *, block_v: int | None = None,
                     num_warps: int | None = None, max_tokens: int | None = None, impl: str | None = None,
                     tree: tuple[torch.Tensor, torch.Tensor] | None = None):
    """Lightning outputs for the tokens of B sequences packed along N (cu_seqlens), from their
    state slots, as the recurrence token by token would give them.

    Args:
        q, k, v: [N, H, d] (strided rows/heads allowed, unit last stride), one dtype.
        q_norm_w, k_norm_w: [d]. positions: [N] int. cu_seqlens: [B+1] int32 token offsets.
        modes: [B] int32: SKIP (0: not touched, e.g. a prefill chunk done elsewhere; its output
            rows are left as they are), VERIFY (1: state read only; normed k and v of its tokens go
            to k_keep / v_keep rows) or DECODE (2: the final state is written back, as
            lightning_decode_step would for each token in turn).
        state: [slots, layers, H, d, d] fp32; slots [B] int (distinct among non-SKIP sequences).
        k_keep, v_keep: [N, H, d] buffers (k_keep's dtype must hold the normed k exactly: the
            normed dtype promote(k.dtype, k_norm_w.dtype) or fp32; v_keep: v's dtype or fp32).
        max_tokens: a bound on any sequence's token count (default N). impl: "chunk" or "loop"
            (default: chunk when max_tokens <= 16, else loop).
        tree: (depth, ancestors) [N] int32 each (`tree_rows_meta`) where VERIFY sequences are draft
            trees: each row's depth in its sequence and a bit mask of the rows it sees (itself and
            its ancestors; a chain row t: depth t, bits 0..t). Chunk form only.
    Returns o [N, H, d] fp32 (rows of SKIP sequences uninitialised).
    """
    N, H, d = q.shape
    if d % 2 or d & (d - 1):
        raise ValueError(f"head_dim must be a power of two, got {d}")
    for name, x in (("q", q), ("k", k), ("v", v), ("k_keep", k_keep), ("v_keep", v_keep)):
        _check_rows(name, x, N, H, d)
    kn_dt = promote(k.dtype, k_norm_w.dtype)
    if k_keep.dtype not in (kn_dt, torch.float32) or v_keep.dtype not in (v.dtype, torch.float32):
        raise TypeError(f"k_keep must be {kn_dt} or fp32 and v_keep {v.dtype} or fp32 (exact copies)")
    if state.dtype != torch.float32 or state.dim() != 5 or tuple(state.shape[2:]) != (H, d, d) or state.stride(4) != 1:
        raise ValueError(f"state must be fp32 [slots, layers, {H}, {d}, {d}] with a contiguous last dim")
    B = modes.shape[0]
    if cu_seqlens.shape[0] != B + 1 or slots.shape[0] != B:
        raise ValueError("cu_seqlens must be [B+1] and slots [B] for modes [B]")
    bv = block_v or _pick_block_v(B, H, d)
    o = torch.empty(N, H, d, dtype=torch.float32, device=q.device)
    if B == 0 or N == 0:
        return o
    st = state[:, layer]
    longest = max_tokens or N  # a bound on any sequence's token count
    impl = impl or ("chunk" if longest <= CHUNK_MAX_TOKENS else "loop")
    if impl == "chunk":
        # normed/roped q and k of every token first (exactly the loop's values, kept in fp32)
        qn, kn = qk_norm_rope(q, k, q_norm_w, k_norm_w, positions, eps, theta, out_dtype=torch.float32)
        if longest > CHUNK_MAX_TOKENS:
            raise ValueError(f"the chunk form takes at most {CHUNK_MAX_TOKENS} tokens per sequence, got {longest}")
        block_t = CHUNK_MAX_TOKENS
        depth, anc = tree if tree is not None else (cu_seqlens, cu_seqlens)  # (unread without TREE)
        _verify_chunk_kernel[(B, H, d // bv)](
            qn, kn, v, cu_seqlens, modes, slots, log_decay, st, o, k_keep, v_keep, depth, anc,
            qn.stride(0), qn.stride(1), kn.stride(0), kn.stride(1), v.stride(0), v.stride(1),
            st.stride(0), st.stride(1), st.stride(2),
            o.stride(0), o.stride(1), k_keep.stride(0), k_keep.stride(1), v_keep.stride(0), v_keep.stride(1),
            float(scale), D=d, BLOCK_V=bv, BLOCK_T=block_t, TREE=tree is not None, num_warps=num_warps or 8,
        )
        return o
    if tree is not None:
        raise ValueError("draft trees take the chunk form (at most 16 tokens per sequence)")
    if impl != "loop":
        raise ValueError(f"impl must be 'chunk' or 'loop', got {impl!r}")
    inv_freq = rope_inv_freq(d, theta, q.device)
    _verify_kernel[(B, H, d // bv)](
        q, k, v, q_norm_w, k_norm_w, positions, cu_seqlens, modes, slots, log_decay, inv_freq, st, o, k_keep, v_keep,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        st.stride(0), st.stride(1), st.stride(2),
        o.stride(0), o.stride(1), k_keep.stride(0), k_keep.stride(1), v_keep.stride(0), v_keep.stride(1),
        float(scale), float(eps),
        HALF=d // 2, BLOCK_V=bv,
        X_DT=tl_dtype(q.dtype), QN_DT=tl_dtype(promote(q.dtype, q_norm_w.dtype)), KN_DT=tl_dtype(kn_dt),
        # twice the decode kernel's warps: the loop keeps more live (4 warps spill at 32 columns)
        num_warps=num_warps or 2 * _pick_warps(bv), **NO_FMA,
    )
    return o


@triton.jit
def _commit_kernel(
    ks_ptr, vs_ptr, cu_ptr, count_ptr, slot_ptr, log_decay_ptr, state_ptr,
    stride_ksl, stride_ksn, stride_ksh, stride_vsl, stride_vsn, stride_vsh,
    stride_ss, stride_sl, stride_sh, stride_sk,
    H: tl.constexpr, HALF: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # grid (B, layers * H, D // BLOCK_V): the decode step's state update, replayed count[b] times.
    b = tl.program_id(0)
    lh = tl.program_id(1)
    vb = tl.program_id(2)
    n = tl.load(count_ptr + b)
    if n > 0:
        layer = lh // H
        h = lh % H
        start = tl.load(cu_ptr + b).to(tl.int64)
        slot = tl.load(slot_ptr + b).to(tl.int64)
        rows = tl.arange(0, HALF)
        cols = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        p1 = (state_ptr + slot * stride_ss + layer.to(tl.int64) * stride_sl + h * stride_sh
              + rows[:, None] * stride_sk + cols[None, :])
        p2 = p1 + HALF * stride_sk
        s1 = tl.load(p1)
        s2 = tl.load(p2)
        gamma = tl.exp(tl.load(log_decay_ptr + h).to(tl.float32))
        kbase = ks_ptr + layer.to(tl.int64) * stride_ksl + h * stride_ksh
        vbase = vs_ptr + layer.to(tl.int64) * stride_vsl + h * stride_vsh
        for t64 in range(start, start + n):
            k1 = tl.load(kbase + t64 * stride_ksn + rows).to(tl.float32)
            k2 = tl.load(kbase + t64 * stride_ksn + HALF + rows).to(tl.float32)
            v = tl.load(vbase + t64 * stride_vsn + cols).to(tl.float32)
            s1 = gamma * s1 + k1[:, None] * v[None, :]
            s2 = gamma * s2 + k2[:, None] * v[None, :]
        tl.store(p1, s1)
        tl.store(p2, s2)


def lightning_commit(state, slots, cu_seqlens, counts, k_keep, v_keep, log_decay, *, block_v: int | None = None,
                     num_warps: int | None = None) -> None:
    """Advance every layer's state of sequence b by its first counts[b] tokens (0: untouched).

    state: [slots, layers, H, d, d] fp32; slots [B]; cu_seqlens [B+1] int32 (the verify step's
    token offsets); counts [B] int32; k_keep, v_keep: [layers, N, H, d] as lightning_verify wrote
    them, one [N, H, d] slice per Lightning layer. log_decay [H] fp32.
    Bit-identical to running lightning_decode_step on those tokens one by one.
    """
    L, N, H, d = k_keep.shape
    if tuple(v_keep.shape) != (L, N, H, d) or k_keep.stride(3) != 1 or v_keep.stride(3) != 1:
        raise ValueError("k_keep and v_keep must be [layers, N, H, d] with a unit last stride")
    if state.dtype != torch.float32 or tuple(state.shape[1:]) != (L, H, d, d) or state.stride(4) != 1:
        raise ValueError(f"state must be fp32 [slots, {L}, {H}, {d}, {d}]")
    B = counts.shape[0]
    if B == 0:
        return
    bv = block_v or _pick_block_v(B * L, H, d)
    _commit_kernel[(B, L * H, d // bv)](
        k_keep, v_keep, cu_seqlens, counts, slots, log_decay, state,
        k_keep.stride(0), k_keep.stride(1), k_keep.stride(2), v_keep.stride(0), v_keep.stride(1), v_keep.stride(2),
        state.stride(0), state.stride(1), state.stride(2), state.stride(3),
        H=H, HALF=d // 2, BLOCK_V=bv, num_warps=num_warps or _pick_warps(bv), **NO_FMA,
    )
