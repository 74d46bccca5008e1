"""InfLLM-v2 stage 1 in Triton: block scores of the compressed keys, packed into sortable keys.

For one query (token t at absolute position p, KV group g):
  1. lse_h = log sum_i exp(s * q_h.C2[i]) over the visible C2 entries            (`_stage1_lse_kernel`)
  2. S[j]  = bf16( sum_{h in g} exp(s * q_h.C1[j] - lse_h) ), 0 for invisible j, -inf past n1
     (0 for every j when no C2 entry is visible; an fp32 overflow stays +inf)
     Bscore[b] = max S[j] over j in [c1_per_block*b - pad, c1_per_block*(b+1) - 1]
     forced blocks (init, local window incl. the current block) = +inf, future blocks = -inf
                                                                              (`_stage1_block_keys_kernel`)

Step 2 writes, per (group, token, block), one packed int32 key: the bf16 block score's bits mapped
to an order-preserving int16 in the high half and (65535 - block) in the low half. Keys are unique
per row, so a plain `torch.topk` on them returns exactly the reference's stable-sort choice, ties
included, on any device; the [tokens, n1] score matrix is never materialised. `topk.py` takes
the keys from here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from salaserve.cache.compressed import CompressedKeyPool
from salaserve.kernels._triton_utils import pdl_launch_kwargs, pdl_wait_first
from salaserve.kernels.sparse._common import LOG2E, _dot_precision, _load_q_rows, _pow2, _tile_rows

# Launch parameters (tuning knobs for the GPU, see bench_sparse.py).
_TARGET_PROGRAMS = 528  # ~4 programs per SM on an H200 (132 SMs): enough to fill it at batch 1
_LSE_BLOCK_N = 64  # C2 entries per tl.dot in the lse pass (also the unit of its splits)
_MAX_BLOCKS = 1 << 16  # the packed key keeps the block index in 16 bits


@triton.jit
def _visible(pos, KERNEL: tl.constexpr, STRIDE: tl.constexpr):
    """Compressed entries whose window [STRIDE*j, STRIDE*j + KERNEL) lies inside [0, pos].
    Written without a negative numerator: Triton's integer division truncates toward zero."""
    return tl.where(pos + 1 >= KERNEL, (pos + 1 - KERNEL) // STRIDE + 1, 0)


@triton.jit
def _stage1_visible(pos, prompt_len, KERNEL: tl.constexpr, STRIDE: tl.constexpr):
    """Entries stage 1 shows the query at pos (reference.visible_count): `_visible`, one fewer for
    a prompt token (pos < prompt_len) when prompt_len = STRIDE - 1 (mod STRIDE), as the official
    single-shot prefill of the prompt shows it (mask.h:226-319); decode and verify tokens lie at or
    past prompt_len and see every complete entry, as official decode (causal=False) does."""
    lag = ((pos < prompt_len) & ((prompt_len + 1) % STRIDE == 0)).to(tl.int32)
    return tl.maximum(_visible(pos, KERNEL, STRIDE) - lag, 0)


# the step's sizes are not specialised on: one compiled kernel for every step (compile_watch.py)
@triton.jit(do_not_specialize=['entries_per_split', 'tok_base'])
def _stage1_lse_kernel(
    q_ptr, c2_ptr, page_table_ptr, positions_ptr, prompt_lens_ptr, tile_seq_ptr, tile_tok0_ptr, tile_ntok_ptr,
    m_part_ptr, l_part_ptr,
    stride_qt, stride_qh, stride_c2p, stride_c2s, stride_c2h, stride_pt, stride_ps, stride_ph,
    qk_scale2, entries_per_split, tok_base,
    GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr, K2: tl.constexpr, S2: tl.constexpr, C2PP: tl.constexpr,
    DOT_PREC: tl.constexpr,
    PDL: tl.constexpr = False,  # programmatic dependent launch (_triton_utils)
):
    """Partial log-sum-exp (base 2, online max / sum) of s*q_h.C2[i] over one range of C2 entries,
    for every (token, head) row of a tile and KV head g. Partials are merged by the next kernel,
    so decode at batch 1 can spread a long C2 list over many programs."""
    pdl_wait_first(PDL)
    pid_tile, g, pid_split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq, tok0, ntok, t_of_r, h_of_r, tok_r, pos_r = _tile_rows(
        tile_seq_ptr, tile_tok0_ptr, tile_ntok_ptr, positions_ptr, pid_tile, GP, BLOCK_T)
    row_ok = (t_of_r < ntok) & (h_of_r < GROUP)
    q = _load_q_rows(q_ptr, tok_r, h_of_r, row_ok, g, stride_qt, stride_qh, GROUP, D)
    vis2 = tl.where(row_ok, _stage1_visible(pos_r, tl.load(prompt_lens_ptr + seq), K2, S2), 0)

    lo = pid_split * entries_per_split
    hi = tl.minimum(lo + entries_per_split, tl.max(vis2, axis=0))
    d = tl.arange(0, D)
    m = tl.full([BLOCK_T * GP], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_T * GP], tl.float32)
    for i0 in range(lo, hi, BLOCK_N):
        i = i0 + tl.arange(0, BLOCK_N)
        i_ok = i < hi
        page = tl.load(page_table_ptr + seq * stride_pt + i // C2PP, mask=i_ok, other=0).to(tl.int64)
        c = tl.load(c2_ptr + page[:, None] * stride_c2p + (i % C2PP)[:, None] * stride_c2s
                    + g * stride_c2h + d[None, :], mask=i_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(c), input_precision=DOT_PREC) * qk_scale2
        s = tl.where(i[None, :] < vis2[:, None], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        l = l * tl.exp2(m - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), axis=1)
        m = m_new

    out = pid_split * stride_ps + (g * GROUP + h_of_r) * stride_ph + (tok_r - tok_base)
    tl.store(m_part_ptr + out, m, mask=row_ok)
    tl.store(l_part_ptr + out, l, mask=row_ok)


@triton.jit
def _shift_combine(a_prev, a_last, a_n, b_prev, b_last, b_n):
    """Scan operator whose inclusive scan yields, at slot k, the value at slot k - 1: a segment is
    (its second-to-last value, its last value, its length)."""
    return tl.where(b_n == 1, a_last, b_prev), b_last, a_n + b_n


@triton.jit
def _round_bf16(x):
    """fp32 -> nearest bf16 (ties to even), kept in fp32. Spelled out on the bits because the
    Triton interpreter's bf16 cast truncates; finite and +-inf inputs (NaN never reaches here)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536 = 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _pack_key(score, blk):
    """Order-preserving int32 key of (bf16 score, -block) for a bf16-valued fp32 score: the high
    half is the bf16 bit pattern made monotone as a signed int16 (negative floats get their
    magnitude bits flipped), the low half 65535 - block, so equal scores rank the lower block first."""
    bits = score.to(tl.int32, bitcast=True) >> 16  # arithmetic shift: the bf16 bits as int16
    key = tl.where(bits < 0, bits ^ 0x7FFF, bits)
    return key * 65536 + (65535 - blk)


@triton.jit
def _c1_step_scores(q, c1_ptr, page_row, eb, e_slot, j_ok, g, stride_c1p, stride_c1s, stride_c1h, qk_scale2,
                    D: tl.constexpr, DOT_PREC: tl.constexpr):
    """Scores (base 2) of the rows q against one step's C1 entries [rows, entries]: entry slot i
    is entry e_slot[i] of block (= page) eb[i]; entries outside j_ok load as 0. Kept out of the
    callers' branches so that the compiler can prefetch the next step's entries (its pipeliner
    does not look inside an if)."""
    d = tl.arange(0, D)
    page = tl.load(page_row + eb, mask=j_ok, other=0).to(tl.int64)
    c = tl.load(c1_ptr + page[:, None] * stride_c1p + e_slot[:, None] * stride_c1s + g * stride_c1h + d[None, :],
                mask=j_ok[:, None], other=0.0)
    return tl.dot(q, tl.trans(c), input_precision=DOT_PREC) * qk_scale2


@triton.jit
def _pooled_block_scores(a2, lse2, j_ok, keep, BLOCK_T: tl.constexpr, GP: tl.constexpr, BB: tl.constexpr,
                         C1PB: tl.constexpr, PAD: tl.constexpr, MASKED: tl.constexpr):
    """Pooled stage-1 block scores [BLOCK_T, BB] of one step (slot k: block b0 - 1 + k) from its
    scores a2 (`_c1_step_scores`): exp2 against lse2, summed over the group's heads, rounded to
    bf16, max-pooled over each block's entries and the previous block's last PAD. MASKED: entries
    outside j_ok [entries] pad the pooling with -inf and (row, entry) pairs outside keep [rows,
    entries] score 0; not MASKED: the step is interior and every entry and pair counts."""
    # rows that see no C2 entry (lse2 -inf; padding rows too) score 0, an overflow stays +inf, as
    # in reference.stage1_scores (official kernel: early return, +inf kept). NaN needs a non-finite
    # q or key, so the reference's NaN -> 0 has no counterpart here.
    p = tl.where((lse2 > float("-inf"))[:, None], tl.exp2(a2 - lse2[:, None]), 0.0)
    if MASKED:
        p = tl.where(keep, p, 0.0)
    s = tl.sum(tl.reshape(p, (BLOCK_T, GP, BB * C1PB)), axis=1)  # sum over the group's heads
    s = _round_bf16(s)  # InfLLM-v2 stores stage-1 scores in bf16
    if MASKED:
        s = tl.where(j_ok[None, :], s, float("-inf"))  # pooling pads past the entries with -inf
    s3 = tl.reshape(s, (BLOCK_T, BB, C1PB))
    own = tl.max(s3, axis=2)
    u = tl.arange(0, C1PB)
    tail = tl.max(tl.where(u[None, None, :] >= C1PB - PAD, s3, float("-inf")), axis=2)
    # tail of the previous block, tail[:, k - 1]: a shift along the block axis by a scan (plain ops
    # only; tl.gather lowering is fragile; a masked max over [BLOCK_T, BB, BB] cost ~160 more
    # instructions per step on sm_90). Slot 0 gets -inf (it only donates its tail).
    prev, _, _ = tl.associative_scan((tl.full([BLOCK_T, BB], float("-inf"), tl.float32), tail,
                                      tl.full([BLOCK_T, BB], 1, tl.int32)), 1, _shift_combine)
    return tl.maximum(own, prev)


# the step's sizes are not specialised on: one compiled kernel for every step (compile_watch.py)
@triton.jit(do_not_specialize=['stride_kg', 'stride_kt', 'n_split2', 'nb_out', 'blocks_per_split', 'tok_base'])
def _stage1_block_keys_kernel(
    q_ptr, c1_ptr, page_table_ptr, seq_lens_ptr, positions_ptr, prompt_lens_ptr,
    tile_seq_ptr, tile_tok0_ptr, tile_ntok_ptr,
    m_part_ptr, l_part_ptr, keys_ptr,
    stride_qt, stride_qh, stride_c1p, stride_c1s, stride_c1h, stride_pt, stride_ps, stride_ph,
    stride_kg, stride_kt,
    qk_scale2, n_split2, nb_out, blocks_per_split, tok_base, dense_len,
    GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr,
    BB: tl.constexpr, C1PB: tl.constexpr, PAD: tl.constexpr, K1: tl.constexpr, S1: tl.constexpr,
    BS: tl.constexpr, INIT: tl.constexpr, LOCAL: tl.constexpr, DOT_PREC: tl.constexpr,
    PDL: tl.constexpr = False,  # programmatic dependent launch (_triton_utils)
):
    """Packed block keys [Hkv, tokens, nb_out] for the blocks [pid_split * blocks_per_split, ...)
    of a tile of tokens, KV head g.

    A step of the loop scores the C1 entries of BB consecutive blocks b0-1 .. b0+BB-2 with one
    tl.dot and outputs blocks b0 .. b0+BB-2: block b pools its own c1_per_block entries plus the
    last PAD entries of block b-1 (windows that start before b but overlap it), so the first block
    of the step only donates those entries. Steps are independent (no carry), which lets decode
    split one sequence's blocks over many programs.

    Most steps of a long prompt are interior: every entry of the step visible to every row, and all
    the step's output blocks past the init blocks and before every token's local window. Those take
    an unmasked path (no visibility, padding or forcing masks), which computes the same keys with
    about half the instructions (sm_90 SASS per scoring step: ~600 against 1103; the selection
    kernels of an 8K chunk at 128K 7.54 -> 5.51 ms with the scan shift).
    """
    pdl_wait_first(PDL)
    pid_tile, g, pid_split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq, tok0, ntok, t_of_r, h_of_r, tok_r, pos_r = _tile_rows(
        tile_seq_ptr, tile_tok0_ptr, tile_ntok_ptr, positions_ptr, pid_tile, GP, BLOCK_T)
    row_ok = (t_of_r < ntok) & (h_of_r < GROUP)
    q = _load_q_rows(q_ptr, tok_r, h_of_r, row_ok, g, stride_qt, stride_qh, GROUP, D)

    L = tl.load(seq_lens_ptr + seq)
    n1 = _visible(L - 1, K1, S1)  # entries of the whole sequence
    sparse = L >= dense_len
    dense = L < dense_len  # dense sequences: every causal block is forced (all listed)

    # Merge the C2 partials into lse2 = log2 sum 2^(s*log2e*q.C2) per row (-inf: nothing visible).
    prow = (g * GROUP + h_of_r) * stride_ph + (tok_r - tok_base)
    m = tl.full([BLOCK_T * GP], float("-inf"), tl.float32)
    for sp in range(n_split2):
        m = tl.maximum(m, tl.load(m_part_ptr + sp * stride_ps + prow, mask=row_ok, other=float("-inf")))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    l = tl.zeros([BLOCK_T * GP], tl.float32)
    for sp in range(n_split2):
        m_s = tl.load(m_part_ptr + sp * stride_ps + prow, mask=row_ok, other=float("-inf"))
        l += tl.load(l_part_ptr + sp * stride_ps + prow, mask=row_ok, other=0.0) * tl.exp2(m_s - m_safe)
    lse2 = m_safe + tl.log2(l)  # log2(0) = -inf

    vis1 = _stage1_visible(pos_r, tl.load(prompt_lens_ptr + seq), K1, S1)
    t = tl.arange(0, BLOCK_T)
    tok_ok = t < ntok
    qb = tl.load(positions_ptr + tok0 + t, mask=tok_ok, other=0) // BS  # [BLOCK_T]
    # Only blocks below qb - LOCAL need a score; the rest are forced (+inf) or future (-inf).
    score_end = tl.max(tl.where(tok_ok, qb - LOCAL, 0), axis=0)

    k = tl.arange(0, BB)  # block slot in a step; slot 0 only donates its tail entries
    e = tl.arange(0, BB * C1PB)  # C1 entry slot in a step, block-major
    e_blk, e_slot = e // C1PB, e % C1PB
    page_row = page_table_ptr + seq * stride_pt
    row0 = tok0 - tok_base
    # bounds of the interior steps: every row sees the entries below vis_min, and every token's
    # local window starts at or after local_min. (Padding rows need no mask: their lse2 is -inf,
    # and rows that see no C2 entry score 0.)
    vis_min = tl.min(tl.where(row_ok, vis1, 1 << 30), axis=0)
    local_min = tl.min(tl.where(tok_ok, qb - LOCAL, 1 << 30), axis=0)

    b_lo = pid_split * blocks_per_split
    b_hi = tl.minimum(b_lo + blocks_per_split, nb_out)
    # Steps below score_end compute scores; the rest only store forced / future keys. Two loops
    # rather than a branch, so that the compiler can pipeline the first one's loads.
    score_hi = tl.where(sparse, tl.minimum(tl.maximum(score_end, b_lo), b_hi), b_lo)
    for b0 in range(b_lo, score_hi, BB - 1):
        eb = b0 - 1 + e_blk  # block (= page) holding each entry
        j = eb * C1PB + e_slot  # C1 entry index; negative before block 0
        j_end = (b0 - 1 + BB) * C1PB  # past the step's last entry
        interior = ((b0 >= 1) & (b0 >= INIT) & (j_end <= n1) & (j_end <= vis_min)
                    & (b0 + BB - 2 < local_min) & (b0 + BB - 1 <= b_hi))
        j_ok = (eb >= 0) & (j < n1)  # all true on interior steps
        a2 = _c1_step_scores(q, c1_ptr, page_row, eb, e_slot, j_ok, g, stride_c1p, stride_c1s, stride_c1h,
                             qk_scale2, D, DOT_PREC)
        if interior:
            pooled = _pooled_block_scores(a2, lse2, j_ok, j_ok, BLOCK_T, GP, BB, C1PB, PAD, False)  # masks unread
            blk = b0 - 1 + k
            ptrs = keys_ptr + g * stride_kg + (row0 + t)[:, None] * stride_kt + blk[None, :]
            tl.store(ptrs, _pack_key(pooled, blk[None, :]), mask=(k >= 1)[None, :] & tok_ok[:, None])
        else:
            keep = row_ok[:, None] & (j[None, :] < vis1[:, None])
            pooled = _pooled_block_scores(a2, lse2, j_ok, keep, BLOCK_T, GP, BB, C1PB, PAD, True)
            _store_keys(keys_ptr, pooled, b0, b_hi, qb, dense, tok_ok, t, row0, g, stride_kg, stride_kt, BB, INIT,
                        LOCAL)
    rest = b_lo + tl.cdiv(score_hi - b_lo, BB - 1) * (BB - 1)  # where the first loop stopped
    for b0 in range(rest, b_hi, BB - 1):
        _store_keys(keys_ptr, tl.zeros([BLOCK_T, BB], tl.float32), b0, b_hi, qb, dense, tok_ok, t,
                    row0, g, stride_kg, stride_kt, BB, INIT, LOCAL)


@triton.jit
def _store_keys(keys_ptr, pooled, b0, b_hi, qb, dense, tok_ok, t, row0, g, stride_kg, stride_kt,
                BB: tl.constexpr, INIT: tl.constexpr, LOCAL: tl.constexpr):
    """Force init / local blocks (+inf; every causal block of a dense sequence), drop future ones
    (-inf), pack and store the keys of blocks b0 .. b0+BB-2 (step slots 1 .. BB-1)."""
    k = tl.arange(0, BB)
    blk = (b0 - 1 + k)[None, :]
    qb2 = qb[:, None]
    forced = (blk < INIT) | ((blk >= qb2 - LOCAL) & (blk <= qb2)) | (dense & (blk <= qb2))
    score = tl.where(forced, float("inf"), tl.where(blk > qb2, float("-inf"), pooled))
    ok = tok_ok[:, None] & (k[None, :] >= 1) & (blk < b_hi)
    ptrs = keys_ptr + g * stride_kg + (row0 + t)[:, None] * stride_kt + blk
    tl.store(ptrs, _pack_key(score, blk), mask=ok)


def _split(total: int, parallel: int, unit: int) -> tuple[int, int]:
    """(items per split, number of splits) so that parallel * splits ~ _TARGET_PROGRAMS, with
    splits a multiple of `unit` items."""
    total = max(total, 1)
    want = max(1, min(-(-_TARGET_PROGRAMS // max(parallel, 1)), -(-total // unit)))
    per = -(-(-(-total // want)) // unit) * unit
    return per, -(-total // per)


def _stage1_lse_partials(q, c2, comp: CompressedKeyPool, page_table, positions, prompt_lens, tiles, n_rows: int,
                         tok_base: int, nb_out: int, qk_scale2: float, block_t: int, group: int, gp: int,
                         prec: str, lse_per_split: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The C2 log-sum-exp partials (max, sum) [splits, Hq, n_rows] of `_stage1_lse_kernel` over
    C2 ranges of lse_per_split entries (None: sized to fill the GPU, see _stage1_keys)."""
    sc = comp.sc
    Hq, D = q.shape[1], q.shape[2]
    hkv = c2.shape[2]
    tile_seq, tile_tok0, tile_ntok = tiles
    n_tiles = tile_seq.shape[0]
    block_n2 = _LSE_BLOCK_N
    if lse_per_split is None:
        per2, n_split2 = _split(nb_out * comp.c2_per_page, n_tiles * hkv, block_n2)
    else:
        per2 = lse_per_split
        n_split2 = max(1, -(-(nb_out * comp.c2_per_page) // per2))
    m_part = torch.empty(n_split2, Hq, n_rows, dtype=torch.float32, device=q.device)
    l_part = torch.empty_like(m_part)
    _stage1_lse_kernel[(n_tiles, hkv, n_split2)](
        q, c2, page_table, positions, prompt_lens, tile_seq, tile_tok0, tile_ntok, m_part, l_part,
        q.stride(0), q.stride(1), c2.stride(0), c2.stride(1), c2.stride(2), page_table.stride(0),
        m_part.stride(0), m_part.stride(1), qk_scale2, per2, tok_base,
        GROUP=group, GP=gp, D=D, BLOCK_T=block_t, BLOCK_N=block_n2, K2=sc.c2_kernel_size,
        S2=sc.c2_kernel_stride, C2PP=comp.c2_per_page, DOT_PREC=prec, **pdl_launch_kwargs(q.device))
    return m_part, l_part


def _stage1_keys(q, comp: CompressedKeyPool, layer: int, page_table, seq_lens, positions,
                 tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor], n_rows: int, tok_base: int,
                 nb_out: int, scale: float, block_t: int, bb: int, lse_per_split: int | None = None,
                 launch: dict | None = None, prompt_lens: torch.Tensor | None = None) -> torch.Tensor:
    """Packed keys [Hkv, n_rows, nb_out] int32 for the tokens [tok_base, tok_base + n_rows) that
    the tiles cover (see `_stage1_block_keys_kernel`). Fixed shapes for fixed inputs shapes.
    lse_per_split: C2 entries per lse partial (a multiple of _LSE_BLOCK_N); None sizes the
    partials to fill the GPU, which makes the partition (and so the lse's last bits) depend on
    nb_out and the number of rows. launch: options of the keys kernel's launch (prefill passes
    STAGE1_PREFILL_LAUNCH). prompt_lens: int32 per sequence of the tiles (tile_seq indexes it),
    its prompt's length for the stage-1 prompt rule (`_stage1_visible`); None: 0 (every row sees
    every complete entry, the decode rule)."""
    sc = comp.sc
    _, Hq, D = q.shape
    hkv = comp.c1.shape[3]
    group = Hq // hkv
    gp = max(16, _pow2(group))
    c1pb = sc.c1_per_block
    if comp.c1_per_page != c1pb or c1pb & (c1pb - 1) or sc.pool_padding > c1pb:
        raise ValueError("C1 entries must pool page-aligned: c1_per_block a power of two, pool padding "
                         "<= c1_per_block")
    if nb_out > _MAX_BLOCKS or D & (D - 1):
        raise ValueError(f"unsupported shape: {nb_out} blocks (max {_MAX_BLOCKS}), head_dim {D}")
    if comp.c1.dtype != q.dtype:
        raise ValueError(f"q is {q.dtype} but the compressed keys are {comp.c1.dtype}")
    tile_seq, tile_tok0, tile_ntok = tiles
    n_tiles = tile_seq.shape[0]
    c1, c2 = comp.c1[layer], comp.c2[layer]  # [pages, per_page, Hkv, D]
    qk_scale2 = scale * LOG2E
    prec = _dot_precision(q.dtype)
    if prompt_lens is None:
        prompt_lens = torch.zeros(page_table.shape[0], dtype=torch.int32, device=q.device)

    m_part, l_part = _stage1_lse_partials(q, c2, comp, page_table, positions, prompt_lens, tiles, n_rows, tok_base,
                                          nb_out, qk_scale2, block_t, group, gp, prec, lse_per_split)
    n_split2 = m_part.shape[0]
    keys = torch.empty(hkv, n_rows, nb_out, dtype=torch.int32, device=q.device)
    per1, n_split1 = _split(nb_out, n_tiles * hkv, bb - 1)
    _stage1_block_keys_kernel[(n_tiles, hkv, n_split1)](
        q, c1, page_table, seq_lens, positions, prompt_lens, tile_seq, tile_tok0, tile_ntok, m_part, l_part, keys,
        q.stride(0), q.stride(1), c1.stride(0), c1.stride(1), c1.stride(2), page_table.stride(0),
        m_part.stride(0), m_part.stride(1), keys.stride(0), keys.stride(1),
        qk_scale2, n_split2, nb_out, per1, tok_base, sc.dense_len,
        GROUP=group, GP=gp, D=D, BLOCK_T=block_t, BB=bb, C1PB=c1pb, PAD=sc.pool_padding,
        K1=sc.kernel_size, S1=sc.kernel_stride, BS=sc.block_size, INIT=sc.init_blocks,
        LOCAL=sc.local_blocks, DOT_PREC=prec,
        **{"num_warps": 8 if block_t * gp * bb * c1pb > 4096 else 4, **(launch or {})},
        **pdl_launch_kwargs(q.device))
    return keys


def pack_keys(scores: torch.Tensor) -> torch.Tensor:
    """The kernel's key packing in torch: block scores [..., nb] (rounded to bf16) -> int32 keys,
    the bf16 bits mapped to an order-preserving int16 in the high half and 65535 - block (the
    last dim's index) in the low half. For benchmarks and tests that feed the top-k kernels."""
    bits = scores.to(torch.bfloat16).view(torch.int16).to(torch.int32)
    blk = torch.arange(scores.shape[-1], device=scores.device)
    return (torch.where(bits < 0, bits ^ 0x7FFF, bits) * 65536 + (65535 - blk)).to(torch.int32)


def unpack_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of the kernel's key packing: (bf16 block scores as fp32, block indices)."""
    bits = keys >> 16
    bits = torch.where(bits < 0, bits ^ 0x7FFF, bits)
    scores = bits.to(torch.int16).view(torch.bfloat16).float()
    return scores, 65535 - (keys & 0xFFFF)
