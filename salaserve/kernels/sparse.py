"""InfLLM-v2 block selection and block-sparse prefill attention over the paged caches (Triton).

Spec section 3.4/3.5 and the executable spec `salaserve/model/reference.py` (`stage1_scores`,
`select_blocks`): the project's choices are followed exactly, i.e. natural causal visibility of
compressed entries (entry j is visible to the query at position p iff its whole window lies in
[0, p]), future blocks score -inf, and ties are broken toward the lower block index.

Selection, for one query (token t at absolute position p, KV group g):
  1. lse_h = log sum_i exp(s * q_h.C2[i]) over the visible C2 entries            (`_stage1_lse_kernel`)
  2. S[j]  = bf16( sum_{h in g} exp(s * q_h.C1[j] - lse_h) ), 0 for invisible j, -inf past n1
     Bscore[b] = max S[j] over j in [c1_per_block*b - pad, c1_per_block*(b+1) - 1]
     forced blocks (init, local window incl. the current block) = +inf, future blocks = -inf
                                                                              (`_stage1_block_keys_kernel`)
  3. top-k over the blocks with ties toward the lower index
                                        (prefill `topk_blocks`, decode `topk_pages`; torch: `_topk_blocks`)

Step 2 writes, per (group, token, block), one packed int32 key: the bf16 block score's bits mapped
to an order-preserving int16 in the high half and (65535 - block) in the low half. Keys are unique
per row, so a plain `torch.topk` on them returns exactly the reference's stable-sort choice, ties
included, on any device; the [tokens, n1] score matrix is never materialised.

Public entry points:
  select_blocks_decode    one query per sequence, CUDA-graph capturable, returns page ids
  select_blocks_prefill   per-token block indices for (chunked) prefill
  sparse_prefill_attention  block-sparse causal attention over the selected blocks
  sparse_attention        TorchBackend.sparse_attention's contract (selection + attention)
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from salaserve.cache.compressed import CompressedKeyPool
from salaserve.cache.pages import KVPool
from salaserve.config import ModelConfig, SparseConfig
from salaserve.engine.batch import ForwardBatch
from salaserve.kernels._triton_utils import pdl_launch_kwargs, pdl_wait_first, tl_dtype
from salaserve.kernels.attention import _load_kv, _pool_args

LOG2E = 1.0 / math.log(2.0)  # softmax in base 2: exp(x) = exp2(x * log2(e))

# Launch parameters. Several are tuning knobs for the GPU (see bench_sparse.py).
_TARGET_PROGRAMS = 528  # ~4 programs per SM on an H200 (132 SMs): enough to fill it at batch 1
_LSE_BLOCK_N = 64  # C2 entries per tl.dot in the lse pass (also the unit of its splits)
_SELECT_BUFFER_BYTES = 256 << 20  # bound on the int32 key buffer of one prefill selection chunk
_MAX_BLOCKS = 1 << 16  # the packed key keeps the block index in 16 bits
# Stage-1 keys: the previous block's tail by a scan instead of a [BLOCK_T, BB, BB] masked max,
# and unmasked interior steps. sm_90 SASS per scoring step: 1261 instructions -> 1103 (masked
# steps) and ~600 (interior steps); measured (run 19): the selection kernels of an 8K chunk at
# 128K 7.54 -> 5.51 ms, the 128K prefill 5.99 -> 5.41 s. SALASERVE_STAGE1_FAST=0: the first kernel.
_STAGE1_FAST = os.environ.get("SALASERVE_STAGE1_FAST", "1") == "1"


def _env_ints(name: str, default: str, form: str) -> list[int]:
    """The comma-separated integers of environment variable `name` (`default` when unset), as
    many as `form` ("a,b,...") names, or a ValueError naming the variable."""
    text = os.environ.get(name, default)
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if len(values) != len(form.split(",")):
        raise ValueError(f"{name} must be '{form}', got {text!r}")
    return values


def launch_options(warps: int, stages: int, maxnreg: int) -> dict:
    """Triton launch options; 0 leaves one at the launch's default."""
    return {k: v for k, v in (("num_warps", warps), ("num_stages", stages), ("maxnreg", maxnreg)) if v}


def _launch_env(name: str, default: str) -> dict:
    """Launch options "num_warps,num_stages,maxnreg" from the environment (0: the default), for
    A/B runs of the prefill kernels (scripts/sparse_launch_ab.py). maxnreg caps the registers per
    thread so that more programs fit on an SM; these kernels wait on gathered loads, and with one
    or two programs per SM there is little to overlap the waits with."""
    return launch_options(*_env_ints(name, default, "num_warps,num_stages,maxnreg"))


def _tile_env(name: str, default: str) -> tuple[int, int]:
    """(tokens per tile, blocks per step) from the environment: two powers of two (tl.arange
    sizes), at least 2 blocks (a step's first block only donates its tail)."""
    block_t, bb = _env_ints(name, default, "tokens,blocks")
    if block_t < 1 or bb < 2 or block_t & (block_t - 1) or bb & (bb - 1):
        raise ValueError(f"{name}: tokens and blocks must be powers of two (blocks >= 2), got '{block_t},{bb}'")
    return block_t, bb


# Prefill launches of the stage-1 keys kernel (8 warps at the prefill tile unless set), the
# per-token sparse attention kernel and the window kernel (warps by its tile unless set).
# Measured on the last 8K chunk of a 128K prompt (run 53, scripts/sparse_launch_ab.py): stage-1
# 4 tokens x 32 blocks 5.59 ms (172 registers: one program per SM), capped at 120 registers 3.90;
# 8 tokens x 16 blocks 4.83, capped at 128 registers (no spill) **3.45 ms**, the same keys bit for
# bit. Window kernel capped at 128 registers (two programs per SM; 120-128 bytes of stack):
# window + per-token attention 5.83 -> 5.48 ms. The per-token kernel did not gain from a cap
# (96: 5.78 vs 5.75 ms) or from 8 warps (7.69), so it keeps its defaults.
STAGE1_PREFILL_TILE = _tile_env("SALASERVE_STAGE1_TILE", "8,16")
# Run 57 (same script, after the stage-1 C1 loads were moved out of its branch so that they are
# prefetched): stage-1 at 8x16, 128 registers: 3 stages 3488 us (8 bytes of stack), **2 stages
# 3369** (no stack), 1 stage 3621. Per-token kernel with pages from a list (SPARSE_ATTN_PAGE_LIST):
# window + per-token 5466 -> 5363 us, and **with 2 warps 5203** (the 2-warp kernel alone: 5384);
# window kernel at 2 stages 5419 -> 5332. The per-token kernel's warps default by the pool's dtype
# (`_PER_TOKEN_WARPS`); SALASERVE_SPARSE_ATTN_LAUNCH overrides them.
STAGE1_PREFILL_LAUNCH = _launch_env("SALASERVE_STAGE1_LAUNCH", "0,2,128")
SPARSE_ATTN_LAUNCH = _launch_env("SALASERVE_SPARSE_ATTN_LAUNCH", "0,0,0")
SPARSE_WINDOW_LAUNCH = _launch_env("SALASERVE_SPARSE_WINDOW_LAUNCH", "0,2,128")


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs (tests) need IEEE products to match the fp32 reference; bf16 ignores it.
    return "ieee" if dtype == torch.float32 else "tf32"


# ---------------------------------------------------------------------------------------------
# Stage 1: shared pieces
# ---------------------------------------------------------------------------------------------


@triton.jit
def _visible(pos, KERNEL: tl.constexpr, STRIDE: tl.constexpr):
    """Compressed entries whose window [STRIDE*j, STRIDE*j + KERNEL) lies inside [0, pos].
    Written without a negative numerator: Triton's integer division truncates toward zero."""
    return tl.where(pos + 1 >= KERNEL, (pos + 1 - KERNEL) // STRIDE + 1, 0)


@triton.jit
def _tile_rows(tile_seq_ptr, tile_tok0_ptr, tile_ntok_ptr, positions_ptr, pid_tile,
               GP: tl.constexpr, BLOCK_T: tl.constexpr):
    """A tile is BLOCK_T consecutive tokens of one sequence. Rows of the dot's M dimension are
    (token, head-in-group) pairs, row r = t * GP + h; GP >= 16 pads the group for tl.dot."""
    seq = tl.load(tile_seq_ptr + pid_tile)
    tok0 = tl.load(tile_tok0_ptr + pid_tile)
    ntok = tl.load(tile_ntok_ptr + pid_tile)
    r = tl.arange(0, BLOCK_T * GP)
    t_of_r = r // GP
    h_of_r = r % GP
    tok_r = tok0 + t_of_r
    pos_r = tl.load(positions_ptr + tok_r, mask=t_of_r < ntok, other=0)
    return seq, tok0, ntok, t_of_r, h_of_r, tok_r, pos_r


@triton.jit
def _load_q_rows(q_ptr, tok_r, h_of_r, row_ok, g, stride_qt, stride_qh,
                 GROUP: tl.constexpr, D: tl.constexpr):
    d = tl.arange(0, D)
    ptrs = q_ptr + tok_r[:, None] * stride_qt + (g * GROUP + h_of_r)[:, None] * stride_qh + d[None, :]
    return tl.load(ptrs, mask=row_ok[:, None], other=0.0)


@triton.jit
def _stage1_lse_kernel(
    q_ptr, c2_ptr, page_table_ptr, positions_ptr, tile_seq_ptr, tile_tok0_ptr, tile_ntok_ptr,
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
    vis2 = tl.where(row_ok, _visible(pos_r, K2, S2), 0)

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
                         C1PB: tl.constexpr, PAD: tl.constexpr, MASKED: tl.constexpr, SCAN_SHIFT: tl.constexpr):
    """Pooled stage-1 block scores [BLOCK_T, BB] of one step (slot k: block b0 - 1 + k) from its
    scores a2 (`_c1_step_scores`): exp2 against lse2, summed over the group's heads, rounded to
    bf16, max-pooled over each block's entries and the previous block's last PAD. MASKED: entries
    outside j_ok [entries] pad the pooling with -inf and (row, entry) pairs outside keep [rows,
    entries] score 0; not MASKED: the step is interior and every entry and pair counts."""
    p = tl.exp2(a2 - lse2[:, None])
    p = tl.where(p < float("inf"), p, 0.0)  # the reference's nan_to_num(nan=0, posinf=0)
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
    # tail of the previous block, tail[:, k - 1]: a shift along the block axis (plain ops only;
    # tl.gather lowering is fragile). Slot 0 gets -inf (it only donates its tail).
    if SCAN_SHIFT:
        prev, _, _ = tl.associative_scan((tl.full([BLOCK_T, BB], float("-inf"), tl.float32), tail,
                                          tl.full([BLOCK_T, BB], 1, tl.int32)), 1, _shift_combine)
    else:  # a masked max over [BLOCK_T, BB, BB]
        k = tl.arange(0, BB)
        shift = (k[:, None] - 1) == k[None, :]  # [BB, BB]: slot k takes from slot k - 1
        prev = tl.max(tl.where(shift[None, :, :], tail[:, None, :], float("-inf")), axis=2)
    return tl.maximum(own, prev)


@triton.jit
def _stage1_block_keys_kernel(
    q_ptr, c1_ptr, page_table_ptr, seq_lens_ptr, positions_ptr,
    tile_seq_ptr, tile_tok0_ptr, tile_ntok_ptr,
    m_part_ptr, l_part_ptr, keys_ptr,
    stride_qt, stride_qh, stride_c1p, stride_c1s, stride_c1h, stride_pt, stride_ps, stride_ph,
    stride_kg, stride_kt,
    qk_scale2, n_split2, nb_out, blocks_per_split, tok_base, dense_len,
    GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr,
    BB: tl.constexpr, C1PB: tl.constexpr, PAD: tl.constexpr, K1: tl.constexpr, S1: tl.constexpr,
    BS: tl.constexpr, INIT: tl.constexpr, LOCAL: tl.constexpr, DOT_PREC: tl.constexpr,
    PDL: tl.constexpr = False,  # programmatic dependent launch (_triton_utils)
    FAST: tl.constexpr = False,  # _STAGE1_FAST: scan shift, and interior steps without masks
):
    """Packed block keys [Hkv, tokens, nb_out] for the blocks [pid_split * blocks_per_split, ...)
    of a tile of tokens, KV head g.

    A step of the loop scores the C1 entries of BB consecutive blocks b0-1 .. b0+BB-2 with one
    tl.dot and outputs blocks b0 .. b0+BB-2: block b pools its own c1_per_block entries plus the
    last PAD entries of block b-1 (windows that start before b but overlap it), so the first block
    of the step only donates those entries. Steps are independent (no carry), which lets decode
    split one sequence's blocks over many programs.

    With FAST, most steps of a long prompt are interior: every entry of the step visible to every
    row, and all the step's output blocks past the init blocks and before every token's local
    window. Those take an unmasked path (no visibility, padding or forcing masks), which computes
    the same keys with fewer instructions.
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

    vis1 = _visible(pos_r, K1, S1)
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
    # local window starts at or after local_min. (Padding rows need no mask: their q is 0 and
    # their lse2 -inf, so exp2 gives +inf, which the nan_to_num rule turns into 0.)
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
        interior = (FAST & (b0 >= 1) & (b0 >= INIT) & (j_end <= n1) & (j_end <= vis_min)
                    & (b0 + BB - 2 < local_min) & (b0 + BB - 1 <= b_hi))
        j_ok = (eb >= 0) & (j < n1)  # all true on interior steps
        a2 = _c1_step_scores(q, c1_ptr, page_row, eb, e_slot, j_ok, g, stride_c1p, stride_c1s, stride_c1h,
                             qk_scale2, D, DOT_PREC)
        if interior:
            pooled = _pooled_block_scores(a2, lse2, j, j, BLOCK_T, GP, BB, C1PB, PAD, False, True)
            blk = b0 - 1 + k
            ptrs = keys_ptr + g * stride_kg + (row0 + t)[:, None] * stride_kt + blk[None, :]
            tl.store(ptrs, _pack_key(pooled, blk[None, :]), mask=(k >= 1)[None, :] & tok_ok[:, None])
        else:
            keep = row_ok[:, None] & (j[None, :] < vis1[:, None])
            pooled = _pooled_block_scores(a2, lse2, j_ok, keep, BLOCK_T, GP, BB, C1PB, PAD, True, FAST)
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


def _stage1_lse_partials(q, c2, comp: CompressedKeyPool, page_table, positions, tiles, n_rows: int,
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
        q, c2, page_table, positions, tile_seq, tile_tok0, tile_ntok, m_part, l_part,
        q.stride(0), q.stride(1), c2.stride(0), c2.stride(1), c2.stride(2), page_table.stride(0),
        m_part.stride(0), m_part.stride(1), qk_scale2, per2, tok_base,
        GROUP=group, GP=gp, D=D, BLOCK_T=block_t, BLOCK_N=block_n2, K2=sc.c2_kernel_size,
        S2=sc.c2_kernel_stride, C2PP=comp.c2_per_page, DOT_PREC=prec, **pdl_launch_kwargs(q.device))
    return m_part, l_part


def _stage1_keys(q, comp: CompressedKeyPool, layer: int, page_table, seq_lens, positions,
                 tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor], n_rows: int, tok_base: int,
                 nb_out: int, scale: float, block_t: int, bb: int, lse_per_split: int | None = None,
                 launch: dict | None = None) -> torch.Tensor:
    """Packed keys [Hkv, n_rows, nb_out] int32 for the tokens [tok_base, tok_base + n_rows) that
    the tiles cover (see `_stage1_block_keys_kernel`). Fixed shapes for fixed inputs shapes.
    lse_per_split: C2 entries per lse partial (a multiple of _LSE_BLOCK_N); None sizes the
    partials to fill the GPU, which makes the partition (and so the lse's last bits) depend on
    nb_out and the number of rows. launch: options of the keys kernel's launch (prefill passes
    STAGE1_PREFILL_LAUNCH)."""
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

    m_part, l_part = _stage1_lse_partials(q, c2, comp, page_table, positions, tiles, n_rows, tok_base, nb_out,
                                          qk_scale2, block_t, group, gp, prec, lse_per_split)
    n_split2 = m_part.shape[0]
    keys = torch.empty(hkv, n_rows, nb_out, dtype=torch.int32, device=q.device)
    per1, n_split1 = _split(nb_out, n_tiles * hkv, bb - 1)
    _stage1_block_keys_kernel[(n_tiles, hkv, n_split1)](
        q, c1, page_table, seq_lens, positions, tile_seq, tile_tok0, tile_ntok, m_part, l_part, keys,
        q.stride(0), q.stride(1), c1.stride(0), c1.stride(1), c1.stride(2), page_table.stride(0),
        m_part.stride(0), m_part.stride(1), keys.stride(0), keys.stride(1),
        qk_scale2, n_split2, nb_out, per1, tok_base, sc.dense_len,
        GROUP=group, GP=gp, D=D, BLOCK_T=block_t, BB=bb, C1PB=c1pb, PAD=sc.pool_padding,
        K1=sc.kernel_size, S1=sc.kernel_stride, BS=sc.block_size, INIT=sc.init_blocks,
        LOCAL=sc.local_blocks, DOT_PREC=prec, FAST=_STAGE1_FAST,
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


def _topk_blocks(keys: torch.Tensor, width: int, limit: torch.Tensor | int, qb: torch.Tensor) -> torch.Tensor:
    """keys [Hkv, R, nb] -> block indices [Hkv, R, width] int32: for each row the `limit` best
    blocks (limit: int or [R]), causal ones (<= qb [R]) only, ascending, -1 padded at the end."""
    k = min(width, keys.shape[-1])
    # With limit < k (dense rows mixed in) the rank matters, so ask for sorted output then.
    need_rank = not (isinstance(limit, int) and limit >= k)
    top = keys.topk(k, dim=-1, sorted=need_rank).indices  # unique keys: a deterministic choice
    valid = top <= qb[None, :, None]
    if need_rank:
        rank = torch.arange(k, device=keys.device)
        lim = limit if isinstance(limit, int) else limit[None, :, None]
        valid &= rank < lim
    big = torch.iinfo(torch.int64).max
    idx = torch.where(valid, top, big).sort(dim=-1).values
    idx = torch.where(idx == big, -1, idx).to(torch.int32)
    if k < width:
        idx = torch.nn.functional.pad(idx, (0, width - k), value=-1)
    return idx


# ---------------------------------------------------------------------------------------------
# Decode selection
# ---------------------------------------------------------------------------------------------


# One Triton kernel instead of torch.topk + sort + ~8 small ops per sparse layer and decode step
# (0.43 ms of a 5.6 ms eager batch-1 step at 128K, profiled). On by default since measured on the
# H200: equal pages in the GPU tests, 128K graph step 5.890 -> 5.846 ms (docs/perf-notes.md: less
# than the eager profile promised; the graph-replay profile then showed the kernel's row sort at
# 74 us per call, replaced by a bitwise threshold search: 11 us). SALASERVE_FUSED_TOPK=0 selects
# the torch path. Rows up to FUSED_TOPK_MAX_BLOCKS blocks wide (wider ones keep the torch path).
FUSED_DECODE_TOPK = os.environ.get("SALASERVE_FUSED_TOPK", "1") == "1"
FUSED_TOPK_MAX_BLOCKS = 16384  # a 512K context's rows
TOPK_ONE_PASS_BLOCKS = 4096  # rows up to here: one program per (row, KV head); wider: segments
TOPK_SEGMENT = 2048  # blocks per segment program of a wide row
# The prefill counterpart (`topk_blocks`): one Triton kernel instead of _topk_blocks' torch ops
# (topk, where, sort, where, pad) at the end of each prefill selection chunk, which took ~100 ms of
# a 128K prompt's prefill over 128 calls (radix sort, mbtopk, gather; run 52's profile). The same
# blocks bit for bit (interpreter cases, any keys; GPU tests at 2048-8224 blocks). Measured on the
# last 8K chunk of a 128K prompt (run 53): 964 -> 263 us per call, the same blocks.
# SALASERVE_FUSED_PREFILL_TOPK=0 selects the torch path.
FUSED_PREFILL_TOPK = os.environ.get("SALASERVE_FUSED_PREFILL_TOPK", "1") == "1"
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # CPU tensors run Triton kernels (tests)
# How the top-k kernels find the lim-th largest key. "key": bit by bit over all 32 bits of the
# packed key (32 counting passes, each a block-wide reduction). "score": bit by bit over the 16
# score bits only, then the ties at the threshold score by a prefix count in block order (the
# lower block wins, as the key's low half says): 16 passes + 2 reductions, the same selection.
TOPK_SEARCH = os.environ.get("SALASERVE_TOPK_SEARCH", "score")
if TOPK_SEARCH not in ("key", "score"):
    raise ValueError(f"SALASERVE_TOPK_SEARCH must be 'key' or 'score', got {TOPK_SEARCH!r}")


@triton.jit
def _kth_largest(u, lim, BITS: tl.constexpr = 32):
    """The lim-th largest of the uint32 values u (lim >= 1; 0 entries never count), found bit by
    bit from the top: one block-wide counting pass per bit. A bitonic tl.sort of a 4096-wide row
    took 74 us per call on the H200 (0.6 ms of the 128K step); this, 11 us. BITS < 32: only the
    top BITS bits are searched, so the result is the lim-th largest with its low bits cleared."""
    thr = tl.sum(tl.zeros_like(u), axis=0)  # 0, as a uint32 scalar
    for b in tl.static_range(BITS):
        cand = thr | (tl.full([], 1, tl.uint32) << (31 - b))
        thr = tl.where(tl.sum((u >= cand).to(tl.int32), axis=0) >= lim, cand, thr)
    return thr


@triton.jit
def _top_keys(u, lim, SCORE_SEARCH: tl.constexpr):
    """Mask of the lim largest of the unique uint32 keys u (lim >= 1, at most the nonzero count;
    0 entries never count), u laid out in ascending block order.
    SCORE_SEARCH: the threshold's score half (16 passes); of the keys whose score equals it, the
    first `lim - (keys above)` in block order, which are the largest keys (low half 65535 - block).
    Else: the exact 32-bit threshold (32 passes)."""
    if SCORE_SEARCH:
        t = _kth_largest(u, lim, 16) >> 16
        hi = u >> 16
        above = hi > t
        tied = hi == t
        need = lim - tl.sum(above.to(tl.int32), axis=0)  # >= 1: fewer than lim keys score above t
        sel = above | (tied & (tl.cumsum(tied.to(tl.int32), axis=0) <= need))
    else:
        sel = u >= _kth_largest(u, lim)
    return sel


@triton.jit
def _row_limit(seq_lens_ptr, r, nb, dense_len, topk_eff, max_sel, BS: tl.constexpr):
    """(last causal block qb, how many blocks to select) of row r: topk_eff for sparse rows,
    max_sel (every causal block) for dense ones, at most the causal count."""
    L = tl.load(seq_lens_ptr + r)
    qb = (L - 1) // BS
    limit = tl.where(L >= dense_len, topk_eff, max_sel)
    return qb, tl.minimum(limit, tl.minimum(nb, qb + 1))


@triton.jit
def _causal_keys(keys_ptr, r, g, j, nb, qb, stride_kg, stride_kt):
    """Row r's keys at blocks j as uint32 in key order (sign bit flipped), 0 where not causal. No
    real key maps to 0 (that is key -2**31: the lowest score bits with block 65535)."""
    lowest = -2147483648
    ok = (j < nb) & (j <= qb)
    keys = tl.load(keys_ptr + g * stride_kg + r.to(tl.int64) * stride_kt + j, mask=ok, other=lowest)
    return (tl.where(ok, keys, lowest) ^ lowest).to(tl.uint32, bitcast=True)


@triton.jit
def _write_compact(out_row, vals, sel, fill, n_out, OUT_W: tl.constexpr):
    """vals where sel (in input order) at out_row[0, count), `fill` from count up to n_out (count
    <= n_out <= OUT_W). Returns count. The output step of every top-k kernel."""
    pos = tl.cumsum(sel.to(tl.int32), axis=0) - 1
    count = tl.sum(sel.to(tl.int32), axis=0)
    tl.store(out_row + pos, vals, mask=sel)
    m = tl.arange(0, OUT_W)
    tl.store(out_row + m, tl.full([OUT_W], fill, tl.int32), mask=(m >= count) & (m < n_out))
    return count


@triton.jit
def _write_pages(out_row, count_row, page_row, blk, sel, max_sel, MAX_SEL: tl.constexpr):
    """The pages of the selected blocks (ascending in the input order) at out_row[0, count), 0
    up to max_sel, and the count."""
    count = _write_compact(out_row, tl.load(page_row + blk, mask=sel, other=0), sel, 0, max_sel, MAX_SEL)
    tl.store(count_row, count)


@triton.jit
def _write_blocks(out_row, blk, sel, width, OUT_W: tl.constexpr):
    """The selected block indices (ascending in the input order) at out_row[0, count), -1 up to
    width (count <= width)."""
    _write_compact(out_row, blk, sel, -1, width, OUT_W)


@triton.jit
def _topk_pages_kernel(
    keys_ptr, page_table_ptr, seq_lens_ptr, out_ptr, count_ptr,
    stride_kg, stride_kt, stride_pt, stride_ob, stride_oh, stride_cb,
    nb, dense_len, topk_eff, max_sel,
    BS: tl.constexpr, W: tl.constexpr, MAX_SEL: tl.constexpr, SCORE_SEARCH: tl.constexpr = True,
    PDL: tl.constexpr = False,  # programmatic dependent launch (_triton_utils)
):
    """Program (row r, KV head g): the packed keys of row r's blocks -> the page ids of its top
    `limit` causal blocks in ascending block order, zero-padded to MAX_SEL, and their count.
    limit = topk_eff for sparse rows, max_sel (every causal block) for dense ones. The same
    choice as _topk_blocks: keys are unique, non-causal blocks rank below every causal one."""
    pdl_wait_first(PDL)
    r = tl.program_id(0)
    g = tl.program_id(1)
    qb, lim = _row_limit(seq_lens_ptr, r, nb, dense_len, topk_eff, max_sel, BS)  # lim >= 1: block 0 is causal
    j = tl.arange(0, W)
    u = _causal_keys(keys_ptr, r, g, j, nb, qb, stride_kg, stride_kt)
    sel = _top_keys(u, lim, SCORE_SEARCH)  # exactly lim entries: the keys are unique
    _write_pages(out_ptr + r.to(tl.int64) * stride_ob + g * stride_oh, count_ptr + r * stride_cb + g,
                 page_table_ptr + r.to(tl.int64) * stride_pt, j, sel, max_sel, MAX_SEL)


@triton.jit
def _topk_segment_kernel(
    keys_ptr, seq_lens_ptr, cand_key_ptr, cand_blk_ptr,
    stride_kg, stride_kt, stride_cr, stride_cg,
    nb, dense_len, topk_eff, max_sel,
    BS: tl.constexpr, SEG: tl.constexpr, MAX_SEL: tl.constexpr, SCORE_SEARCH: tl.constexpr = True,
    PDL: tl.constexpr = False,  # programmatic dependent launch (_triton_utils)
):
    """Wide rows, first step. Program (row r, KV head g, segment s): the top `lim` keys of the
    segment's blocks (lim as for the whole row; fewer when the segment has fewer causal blocks),
    in ascending block order, with their block indices, at candidates [s * MAX_SEL, ...); the
    rest of the segment's slots 0. Every key of the row's top lim is in its segment's top lim."""
    pdl_wait_first(PDL)
    r = tl.program_id(0)
    g = tl.program_id(1)
    seg = tl.program_id(2)
    qb, lim = _row_limit(seq_lens_ptr, r, nb, dense_len, topk_eff, max_sel, BS)
    _segment_candidates(keys_ptr, cand_key_ptr, cand_blk_ptr, r, g, seg, nb, qb, lim, stride_kg, stride_kt,
                        stride_cr, stride_cg, SEG, MAX_SEL, SCORE_SEARCH)


@triton.jit
def _segment_candidates(keys_ptr, cand_key_ptr, cand_blk_ptr, r, g, seg, nb, qb, lim, stride_kg, stride_kt,
                        stride_cr, stride_cg, SEG: tl.constexpr, MAX_SEL: tl.constexpr, SCORE_SEARCH: tl.constexpr):
    """Segment `seg` of row r, KV head g: the top lim (>= 1) of its keys at blocks <= qb (all of
    them when it has fewer), in ascending block order, with their block indices, at candidates
    [seg * MAX_SEL, ...); the rest of the segment's key slots 0."""
    j = seg * SEG + tl.arange(0, SEG)
    u = _causal_keys(keys_ptr, r, g, j, nb, qb, stride_kg, stride_kt)
    # lim_s = 0 only where the segment has no causal block (lim >= 1): then u > 0 selects nothing
    lim_s = tl.minimum(lim, tl.sum((u > 0).to(tl.int32), axis=0))
    sel = _top_keys(u, tl.maximum(lim_s, 1), SCORE_SEARCH) & (u > 0)
    pos = tl.cumsum(sel.to(tl.int32), axis=0) - 1
    row = r.to(tl.int64) * stride_cr + g * stride_cg + seg * MAX_SEL
    tl.store(cand_key_ptr + row + pos, u.to(tl.int32, bitcast=True), mask=sel)
    tl.store(cand_blk_ptr + row + pos, j, mask=sel)
    m = tl.arange(0, MAX_SEL)
    tl.store(cand_key_ptr + row + m, tl.zeros([MAX_SEL], tl.int32), mask=m >= tl.sum(sel.to(tl.int32), axis=0))


@triton.jit
def _topk_merge_kernel(
    cand_key_ptr, cand_blk_ptr, page_table_ptr, seq_lens_ptr, out_ptr, count_ptr,
    stride_cr, stride_cg, stride_pt, stride_ob, stride_oh, stride_cb,
    nb, dense_len, topk_eff, max_sel,
    BS: tl.constexpr, N_CAND: tl.constexpr, MAX_SEL: tl.constexpr, SCORE_SEARCH: tl.constexpr = True,
    PDL: tl.constexpr = False,  # programmatic dependent launch (_triton_utils)
):
    """Wide rows, second step. Program (row r, KV head g): the row's top lim among the segments'
    candidates (segment by segment, each ascending: block order) -> pages, as _topk_pages_kernel."""
    pdl_wait_first(PDL)
    r = tl.program_id(0)
    g = tl.program_id(1)
    _, lim = _row_limit(seq_lens_ptr, r, nb, dense_len, topk_eff, max_sel, BS)
    blk, sel = _merge_candidates(cand_key_ptr, cand_blk_ptr, r, g, lim, stride_cr, stride_cg, N_CAND, SCORE_SEARCH)
    _write_pages(out_ptr + r.to(tl.int64) * stride_ob + g * stride_oh, count_ptr + r * stride_cb + g,
                 page_table_ptr + r.to(tl.int64) * stride_pt, blk, sel, max_sel, MAX_SEL)


@triton.jit
def _merge_candidates(cand_key_ptr, cand_blk_ptr, r, g, lim, stride_cr, stride_cg, N_CAND: tl.constexpr,
                      SCORE_SEARCH: tl.constexpr):
    """(block indices, selection mask) of the top lim (>= 1) of row r's candidates, KV head g (the
    segments' candidates one after the other, each ascending: block order)."""
    i = tl.arange(0, N_CAND)
    row = r.to(tl.int64) * stride_cr + g * stride_cg
    u = tl.load(cand_key_ptr + row + i).to(tl.uint32, bitcast=True)
    sel = _top_keys(u, lim, SCORE_SEARCH)
    blk = tl.load(cand_blk_ptr + row + i, mask=sel, other=0)
    return blk, sel


@triton.jit
def _row_block_limit(limit_ptr, r, k, LIMIT_PER_ROW: tl.constexpr):
    """How many of row r's best keys _topk_blocks keeps (before dropping non-causal ones): k =
    min(width, nb, int limit) from the host, or min(limit[r], k) with a per-row limit. May be <= 0."""
    lim = k
    if LIMIT_PER_ROW:
        lim = tl.minimum(tl.load(limit_ptr + r), k).to(tl.int32)
    return lim


@triton.jit
def _topk_blocks_kernel(
    keys_ptr, qb_ptr, limit_ptr, out_ptr,
    stride_kg, stride_kt, stride_og, stride_ot,
    nb, k, width,
    W: tl.constexpr, OUT_W: tl.constexpr, LIMIT_PER_ROW: tl.constexpr, SCORE_SEARCH: tl.constexpr = True,
    PDL: tl.constexpr = False,  # programmatic dependent launch (_triton_utils)
):
    """Program (row r, KV head g) of `topk_blocks`: the top lim keys of row r over ALL its nb
    blocks (as _topk_blocks' torch.topk), then the causal ones (<= qb[r]) among them, ascending,
    -1 padded to width. (_causal_keys with qb = nb - 1 loads every block.)"""
    pdl_wait_first(PDL)
    r = tl.program_id(0)
    g = tl.program_id(1)
    qb = tl.load(qb_ptr + r)
    lim = _row_block_limit(limit_ptr, r, k, LIMIT_PER_ROW)
    j = tl.arange(0, W)
    u = _causal_keys(keys_ptr, r, g, j, nb, nb - 1, stride_kg, stride_kt)
    # (lim <= nb nonzero keys; lim <= 0 selects nothing: no causal block then. A full-shape mask:
    # the interpreter widens a scalar int1 in `&`, which its store refuses.)
    sel = _top_keys(u, tl.maximum(lim, 1), SCORE_SEARCH) & (j <= tl.where(lim > 0, qb, -1))
    _write_blocks(out_ptr + g * stride_og + r.to(tl.int64) * stride_ot, j, sel, width, OUT_W)


@triton.jit
def _topk_blocks_segment_kernel(
    keys_ptr, limit_ptr, cand_key_ptr, cand_blk_ptr,
    stride_kg, stride_kt, stride_cr, stride_cg,
    nb, k,
    SEG: tl.constexpr, MAX_SEL: tl.constexpr, LIMIT_PER_ROW: tl.constexpr, SCORE_SEARCH: tl.constexpr = True,
    PDL: tl.constexpr = False,  # programmatic dependent launch (_triton_utils)
):
    """`topk_blocks` for wide rows, first step: _topk_segment_kernel's candidates over every block
    of the segment (causal or not) with the row's lim."""
    pdl_wait_first(PDL)
    r = tl.program_id(0)
    g = tl.program_id(1)
    seg = tl.program_id(2)
    lim = tl.maximum(_row_block_limit(limit_ptr, r, k, LIMIT_PER_ROW), 1)  # lim <= 0: the merge drops all
    _segment_candidates(keys_ptr, cand_key_ptr, cand_blk_ptr, r, g, seg, nb, nb - 1, lim, stride_kg, stride_kt,
                        stride_cr, stride_cg, SEG, MAX_SEL, SCORE_SEARCH)


@triton.jit
def _topk_blocks_merge_kernel(
    cand_key_ptr, cand_blk_ptr, qb_ptr, limit_ptr, out_ptr,
    stride_cr, stride_cg, stride_og, stride_ot,
    k, width,
    N_CAND: tl.constexpr, OUT_W: tl.constexpr, LIMIT_PER_ROW: tl.constexpr, SCORE_SEARCH: tl.constexpr = True,
    PDL: tl.constexpr = False,  # programmatic dependent launch (_triton_utils)
):
    """`topk_blocks` for wide rows, second step: the row's top lim among the candidates, the
    causal ones of them -> block indices, as _topk_blocks_kernel."""
    pdl_wait_first(PDL)
    r = tl.program_id(0)
    g = tl.program_id(1)
    qb = tl.load(qb_ptr + r)
    lim = _row_block_limit(limit_ptr, r, k, LIMIT_PER_ROW)
    blk, sel = _merge_candidates(cand_key_ptr, cand_blk_ptr, r, g, tl.maximum(lim, 1), stride_cr, stride_cg,
                                 N_CAND, SCORE_SEARCH)
    sel = sel & (blk <= tl.where(lim > 0, qb, -1))
    _write_blocks(out_ptr + g * stride_og + r.to(tl.int64) * stride_ot, blk, sel, width, OUT_W)


def topk_pages(keys: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor, sc: SparseConfig,
               max_sel: int, search: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """select_blocks_decode's tail: keys [Hkv, B, nb] int32 (packed), page_table [B, >= nb] int32,
    seq_lens [B] -> (page ids [B, Hkv, max_sel] int32, counts [B, Hkv] int32). Rows up to
    TOPK_ONE_PASS_BLOCKS wide in one kernel (one program per row and KV head); wider rows in
    TOPK_SEGMENT-block segments, each program keeping its segment's best, then a merge: a single
    program per row took 48 us at 512K (16384-wide rows) where the GPU has 132 SMs.
    search: "key" or "score" (TOPK_SEARCH when None): how the threshold is found; same result."""
    if search is not None and search not in ("key", "score"):  # (TOPK_SEARCH is checked at import)
        raise ValueError(f"search must be 'key' or 'score', got {search!r}")
    score = (search or TOPK_SEARCH) == "score"
    hkv, B, nb = keys.shape
    out = torch.empty(B, hkv, max_sel, dtype=torch.int32, device=keys.device)
    count = torch.empty(B, hkv, dtype=torch.int32, device=keys.device)
    if B == 0:
        return out, count
    max_sel_p2 = triton.next_power_of_2(max_sel)
    limits = (nb, sc.dense_len, sc.topk_eff, max_sel)
    if nb <= TOPK_ONE_PASS_BLOCKS:
        _topk_pages_kernel[(B, hkv)](
            keys, page_table, seq_lens, out, count,
            keys.stride(0), keys.stride(1), page_table.stride(0), out.stride(0), out.stride(1), count.stride(0),
            *limits, BS=sc.block_size, W=triton.next_power_of_2(nb), MAX_SEL=max_sel_p2, SCORE_SEARCH=score,
            num_warps=8 if nb > 2048 else 4, **pdl_launch_kwargs(keys.device),
        )
        return out, count
    n_seg = triton.next_power_of_2(triton.cdiv(nb, TOPK_SEGMENT))
    cand_key = torch.empty(B, hkv, n_seg * max_sel_p2, dtype=torch.int32, device=keys.device)
    cand_blk = torch.empty_like(cand_key)
    _topk_segment_kernel[(B, hkv, n_seg)](
        keys, seq_lens, cand_key, cand_blk,
        keys.stride(0), keys.stride(1), cand_key.stride(0), cand_key.stride(1),
        *limits, BS=sc.block_size, SEG=TOPK_SEGMENT, MAX_SEL=max_sel_p2, SCORE_SEARCH=score,
        num_warps=8 if TOPK_SEGMENT > 1024 else 4, **pdl_launch_kwargs(keys.device),
    )
    _topk_merge_kernel[(B, hkv)](
        cand_key, cand_blk, page_table, seq_lens, out, count,
        cand_key.stride(0), cand_key.stride(1), page_table.stride(0), out.stride(0), out.stride(1), count.stride(0),
        *limits, BS=sc.block_size, N_CAND=n_seg * max_sel_p2, MAX_SEL=max_sel_p2, SCORE_SEARCH=score,
        num_warps=4, **pdl_launch_kwargs(cand_key.device),
    )
    return out, count


_TOPK_MAX_CANDIDATES = 4096  # the widest merge of topk_blocks (segments x candidates per segment)


def topk_blocks(keys: torch.Tensor, width: int, limit: torch.Tensor | int, qb: torch.Tensor,
                search: str | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """select_blocks_prefill's tail, `_topk_blocks` in Triton: keys [Hkv, R, nb] int32 (packed,
    unique per row), limit an int or [R] ints, qb [R] the last causal block of each row -> block
    indices [Hkv, R, width] int32 (written into `out` when given, e.g. a slice of a larger output).

    Per row: of its top min(limit, width, nb) keys over ALL nb blocks, the causal ones (<= qb),
    ascending, -1 padded at the end: _topk_blocks' output bit for bit for ANY keys, also where a
    non-causal key outranks causal ones (the torch function then drops it, and so lists fewer than
    min(limit, qb + 1) blocks; so does this). On stage-1 keys that never happens: future blocks
    score -inf and rank below every causal block (the lower block wins a tie), and a forced (+inf)
    future block (init_blocks > qb + 1) only comes when every causal block is forced as well, and
    lower. There this is the top min(limit, qb + 1) causal blocks, as the decode kernels choose
    from _causal_keys; loading the future blocks' keys too is the price of the exact contract.

    Rows up to TOPK_ONE_PASS_BLOCKS wide: one program per (row, KV head); wider rows in
    TOPK_SEGMENT-block segments and a merge, as topk_pages (the torch function where the merge
    would hold more than _TOPK_MAX_CANDIDATES candidates: never at width <= 128 and nb <= 65536).
    search: "key" or "score" (TOPK_SEARCH when None), as topk_pages; same result."""
    if search is not None and search not in ("key", "score"):  # (TOPK_SEARCH is checked at import)
        raise ValueError(f"search must be 'key' or 'score', got {search!r}")
    score = (search or TOPK_SEARCH) == "score"
    hkv, R, nb = keys.shape
    if out is None:
        out = torch.empty(hkv, R, width, dtype=torch.int32, device=keys.device)
    if out.shape != (hkv, R, width) or out.dtype != torch.int32 or (out.numel() and out.stride(2) != 1):
        raise ValueError(f"out must be int32 [{hkv}, {R}, {width}] with unit last stride")
    if out.numel() == 0:
        return out
    per_row = not isinstance(limit, int)
    k = min(width, nb) if per_row else max(0, min(limit, width, nb))
    if k == 0:  # nothing ranks (nb = 0, limit <= 0)
        return out.fill_(-1)
    keys = keys if keys.stride(2) == 1 else keys.contiguous()
    qb = qb.contiguous()
    limit_arg = limit.contiguous() if per_row else qb  # (an unread pointer with an int limit)
    out_w = triton.next_power_of_2(width)
    if nb <= TOPK_ONE_PASS_BLOCKS:
        _topk_blocks_kernel[(R, hkv)](
            keys, qb, limit_arg, out,
            keys.stride(0), keys.stride(1), out.stride(0), out.stride(1), nb, k, width,
            W=triton.next_power_of_2(nb), OUT_W=out_w, LIMIT_PER_ROW=per_row, SCORE_SEARCH=score,
            num_warps=8 if nb > 2048 else 4, **pdl_launch_kwargs(keys.device),
        )
        return out
    n_seg = triton.next_power_of_2(triton.cdiv(nb, TOPK_SEGMENT))
    n_keep = triton.next_power_of_2(min(k, TOPK_SEGMENT))  # candidate slots per segment
    if n_seg * n_keep > _TOPK_MAX_CANDIDATES:
        out.copy_(_topk_blocks(keys, width, limit, qb))
        return out
    cand_key = torch.empty(R, hkv, n_seg * n_keep, dtype=torch.int32, device=keys.device)
    cand_blk = torch.empty_like(cand_key)
    _topk_blocks_segment_kernel[(R, hkv, n_seg)](
        keys, limit_arg, cand_key, cand_blk,
        keys.stride(0), keys.stride(1), cand_key.stride(0), cand_key.stride(1), nb, k,
        SEG=TOPK_SEGMENT, MAX_SEL=n_keep, LIMIT_PER_ROW=per_row, SCORE_SEARCH=score,
        num_warps=8 if TOPK_SEGMENT > 1024 else 4, **pdl_launch_kwargs(keys.device),
    )
    _topk_blocks_merge_kernel[(R, hkv)](
        cand_key, cand_blk, qb, limit_arg, out,
        cand_key.stride(0), cand_key.stride(1), out.stride(0), out.stride(1), k, width,
        N_CAND=n_seg * n_keep, OUT_W=out_w, LIMIT_PER_ROW=per_row, SCORE_SEARCH=score,
        num_warps=8 if n_seg * n_keep > 2048 else 4, **pdl_launch_kwargs(keys.device),
    )
    return out


def decode_select_meta(seq_lens: torch.Tensor) -> tuple:
    """What select_blocks_decode derives from seq_lens alone (int32 lengths, query positions, one
    stage-1 tile per row): the same for every sparse layer of a step, so callers may compute it
    once and pass it as `meta` (4 small kernels per layer otherwise)."""
    seq_lens = seq_lens.to(torch.int32)
    ar = torch.arange(seq_lens.shape[0], device=seq_lens.device, dtype=torch.int32)
    return seq_lens, (seq_lens - 1).to(torch.int64), (ar, ar, torch.ones_like(ar))


def select_blocks_decode(q: torch.Tensor, comp: CompressedKeyPool, layer: int, page_table: torch.Tensor,
                         seq_lens: torch.Tensor, sc: SparseConfig, scale: float, max_sel: int,
                         block_t: int = 1, bb: int = 16, meta: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks to attend for one decode query per sequence (position seq_len - 1).

    q [B, Hq, d] (bf16/fp32); page_table [B, P] int32 (P is the static width, >= every
    sequence's page count); seq_lens [B] int32 total lengths including the new token.
    Returns (block_table [B, Hkv, max_sel] int32 page ids, block_count [B, Hkv] int32):
      - entries [0, count) are page ids in ascending block order, so the last listed page is always
        the sequence's last (possibly partial) page, holding seq_len - (nb - 1) * block_size tokens;
        entries past count are 0 (a valid page id, never to be read);
      - sparse sequences (seq_len >= dense_len): the top-k of spec 3.4 with every existing entry
        visible, count = min(topk_eff, nb);
      - dense sequences (seq_len < dense_len): every block, count = nb. This needs
        max_sel >= ceil((dense_len - 1) / block_size) (128 for the real config); a smaller max_sel
        serves sparse sequences only.
    CUDA-graph capturable: no host sync, every shape depends only on (B, P, max_sel).
    meta: decode_select_meta(seq_lens), when the caller shares it across layers.
    """
    if max_sel < sc.topk_eff:
        raise ValueError(f"max_sel={max_sel} < topk_eff={sc.topk_eff}")
    B = q.shape[0]
    nb_out = page_table.shape[1]
    seq_lens, positions, tiles = meta if meta is not None else decode_select_meta(seq_lens)
    # The lse partials in fixed 64-entry ranges, whatever the table width and batch: a sequence
    # then gets the same lse bits, hence the same bf16 block scores and blocks, in a CUDA graph
    # (static width, padded batch) as eagerly, and whichever requests share its step. (Sized
    # by the GPU, the partition moved with the width: verify graphs vs eager differed by 2e-2.)
    # At batch 1 this is the partition the sizing chose anyway up to 16K pages.
    keys = _stage1_keys(q, comp, layer, page_table, seq_lens, positions, tiles, B, 0, nb_out,
                        scale, block_t, bb, lse_per_split=_LSE_BLOCK_N)
    if FUSED_DECODE_TOPK and nb_out <= FUSED_TOPK_MAX_BLOCKS:
        return topk_pages(keys, page_table, seq_lens, sc, max_sel)
    return topk_pages_torch(keys, page_table, seq_lens, sc, max_sel)


def topk_pages_torch(keys: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor, sc: SparseConfig,
                     max_sel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`topk_pages` with torch ops (the default path)."""
    seq_lens = seq_lens.to(torch.int32)
    qb = ((seq_lens - 1) // sc.block_size).to(torch.int64)
    limit = torch.where(seq_lens >= sc.dense_len, sc.topk_eff, max_sel)
    blocks = _topk_blocks(keys, max_sel, limit, qb)  # [Hkv, B, max_sel]
    blocks = blocks.transpose(0, 1)  # [B, Hkv, max_sel]
    count = (blocks >= 0).sum(-1, dtype=torch.int32)
    pages = torch.gather(page_table, 1, blocks.clamp(min=0).flatten(1).long()).view_as(blocks)
    return torch.where(blocks >= 0, pages, 0).contiguous(), count


# ---------------------------------------------------------------------------------------------
# Prefill selection
# ---------------------------------------------------------------------------------------------


def _prefill_tiles(batch: ForwardBatch, block_t: int):
    """Host-side tiles: BLOCK_T consecutive tokens of one sequence each."""
    seqs, tok0s, ntoks = [], [], []
    start = 0
    for i, n in enumerate(batch.q_lens_host):
        for t in range(0, n, block_t):
            seqs.append(i)
            tok0s.append(start + t)
            ntoks.append(min(block_t, n - t))
        start += n
    return seqs, tok0s, ntoks


def tile_tensors(tiles, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """_prefill_tiles' (sequence, first token, token count) lists as int32 tensors on `device`."""
    return tuple(torch.tensor(x, dtype=torch.int32).to(device, non_blocking=True) for x in tiles)


def _step_tiles(batch: ForwardBatch, block_t: int, device):
    """(_prefill_tiles(batch, block_t), their tile_tensors), built once per step and tile size:
    every sparse layer of a prefill step tiles the same tokens (kept in batch.derived)."""
    cache = batch.derived if batch.derived is not None else {}
    key = ("prefill_tiles", block_t)
    if key not in cache:
        tiles = _prefill_tiles(batch, block_t)
        cache[key] = tiles, tile_tensors(tiles, device)
    return cache[key]


def prefill_width(batch: ForwardBatch, sc: SparseConfig) -> int:
    """Width of select_blocks_prefill's output: topk_eff, or more when a dense sequence needs all
    of its blocks listed."""
    dense_nb = [-(-L // sc.block_size) for L, s in zip(batch.seq_lens_host, batch.is_sparse_host) if not s]
    return max([sc.topk_eff] + dense_nb)


def select_blocks_prefill(q: torch.Tensor, comp: CompressedKeyPool, layer: int, batch: ForwardBatch,
                          sc: SparseConfig, scale: float, block_t: int | None = None,
                          bb: int | None = None) -> torch.Tensor:
    """Per-token block selection for a (chunked) prefill batch.

    q [N, Hq, d] (the batch's tokens, packed by sequence); compressed keys read through
    batch.page_table. Token t at absolute position p sees C1/C2 entries by the natural causal rule.
    Returns block_idx [Hkv, N, W] int32: block indices, ascending, -1 padded at the end.
    W = topk_eff when every sequence is sparse; a dense sequence (seq_len < dense_len) gets every
    causal block listed and W grows to cover it (see `prefill_width`).
    Not graph-capturable (host-side tiling from batch.q_lens_host). block_t (tokens per stage-1
    tile), bb (blocks per stage-1 step): STAGE1_PREFILL_TILE where None; the keys do not depend
    on them.
    """
    block_t = STAGE1_PREFILL_TILE[0] if block_t is None else block_t
    bb = STAGE1_PREFILL_TILE[1] if bb is None else bb
    N = q.shape[0]
    hkv = comp.c1.shape[3]
    dev = q.device
    width = prefill_width(batch, sc)
    nb_out = max(-(-L // sc.block_size) for L in batch.seq_lens_host)
    (seqs, tok0s, ntoks), (tile_seq, tile_tok0, tile_ntok) = _step_tiles(batch, block_t, dev)
    if all(batch.is_sparse_host):
        limit = sc.topk_eff  # = width: the top-k needs no ranks
    else:
        tok_seq = torch.repeat_interleave(torch.arange(len(batch.q_lens_host), device=dev),
                                          batch.cu_seqlens_q.diff(), output_size=N)
        limit = torch.where(batch.is_sparse[tok_seq], sc.topk_eff, width)
    qb = batch.positions // sc.block_size

    out = torch.empty(hkv, N, width, dtype=torch.int32, device=dev)
    rows_per_chunk = max(block_t, _SELECT_BUFFER_BYTES // (4 * hkv * nb_out))
    i = 0
    while i < len(tok0s):  # chunks of whole tiles, bounding the key buffer
        j = i
        while j < len(tok0s) and tok0s[j] + ntoks[j] - tok0s[i] <= rows_per_chunk:
            j += 1
        j = max(j, i + 1)
        lo, hi = tok0s[i], tok0s[j - 1] + ntoks[j - 1]
        keys = _stage1_keys(q, comp, layer, batch.page_table, batch.seq_lens, batch.positions,
                            (tile_seq[i:j], tile_tok0[i:j], tile_ntok[i:j]), hi - lo, lo, nb_out,
                            scale, block_t, bb, launch=STAGE1_PREFILL_LAUNCH)
        lim = limit if isinstance(limit, int) else limit[lo:hi]
        if FUSED_PREFILL_TOPK and (keys.is_cuda or _INTERPRET):
            topk_blocks(keys, width, lim, qb[lo:hi], out=out[:, lo:hi])
        else:
            out[:, lo:hi] = _topk_blocks(keys, width, lim, qb[lo:hi])
        i = j
    return out


# ---------------------------------------------------------------------------------------------
# Stage 2: block-sparse prefill attention
# ---------------------------------------------------------------------------------------------


@triton.jit
def _softmax_block(q, k_ptrs, v_ptrs, visible, scale_off, k_scale_ptr, v_scale_ptr, m, l, acc, scale2,
                   KV_FP8: tl.constexpr, COMPUTE_DT: tl.constexpr, DOT_PREC: tl.constexpr):
    """One K/V block of the online softmax (base 2) of the rows q: scores outside `visible`
    [rows, BS] are -inf; fp8 pages take their (page, KV head) scales at scale_off on the scores and
    on the probabilities. A row that sees nothing in this block keeps (m, l, acc) exactly; one
    that has seen nothing yet keeps m = -inf, l = 0, acc = 0. Returns the new (m, l, acc)."""
    k = _load_kv(k_ptrs, KV_FP8, COMPUTE_DT)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale2
    if KV_FP8:
        s = s * tl.load(k_scale_ptr + scale_off)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_use)
    p = tl.exp2(s - m_use[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    v = _load_kv(v_ptrs, KV_FP8, COMPUTE_DT)
    if KV_FP8:
        p = p * tl.load(v_scale_ptr + scale_off)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l, acc


@triton.jit
def _selected_block(q, b, page, pos, g, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, stride_kp, stride_ks, stride_kh, m, l,
                    acc, scale2, D: tl.constexpr, BS: tl.constexpr, KV_FP8: tl.constexpr, COMPUTE_DT: tl.constexpr,
                    DOT_PREC: tl.constexpr, HKV: tl.constexpr):
    """Block b (in page `page`) of a sequence in one token's online softmax."""
    d = tl.arange(0, D)
    s_off = tl.arange(0, BS)
    page = page.to(tl.int64)  # pools exceed 2^31 elements
    kv_off = page * stride_kp + s_off[:, None] * stride_ks + g * stride_kh + d[None, :]
    # every selected block is <= the query's block, so each has a visible key: m stays finite
    return _softmax_block(q, k_ptr + kv_off, v_ptr + kv_off, (b * BS + s_off)[None, :] <= pos, page * HKV + g,
                          k_scale_ptr, v_scale_ptr, m, l, acc, scale2, KV_FP8, COMPUTE_DT, DOT_PREC)


@triton.jit
def _sparse_prefill_attn_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, block_idx_ptr, page_table_ptr, tok_seq_ptr, positions_ptr,
    k_scale_ptr, v_scale_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kp, stride_ks, stride_kh,
    stride_bg, stride_bt, stride_pt,
    scale2,
    GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, W: tl.constexpr,
    DOT_PREC: tl.constexpr,
    KV_FP8: tl.constexpr = False, COMPUTE_DT: tl.constexpr = tl.bfloat16, HKV: tl.constexpr = 1,
    m_part_ptr=None, l_part_ptr=None, acc_part_ptr=None,
    AFTER_WINDOW: tl.constexpr = False, INIT: tl.constexpr = 1, LOCAL: tl.constexpr = 32,
    page_idx_ptr=None, PAGE_LIST: tl.constexpr = False,
):
    """One program per (token, KV head g): the group's query heads are the M dimension of tl.dot
    (padded to GP >= 16), iterating over the token's selected blocks (pages through the page
    table). Causal mask inside the current block; fp32 online softmax (base 2).
    AFTER_WINDOW: the forced blocks (init, local window) were done by _sparse_window_attn_kernel;
    start from its softmax state ([N, Hq] m and l, [N, Hq, D] acc) and skip them here.
    PAGE_LIST: page_idx_ptr holds each entry's page (block_idx's layout), so the loop loads the page
    and then its K/V: two dependent loads instead of three, and fewer registers."""
    tok, g = tl.program_id(0), tl.program_id(1)
    seq = tl.load(tok_seq_ptr + tok)
    pos = tl.load(positions_ptr + tok)
    h = tl.arange(0, GP)
    h_ok = h < GROUP
    d = tl.arange(0, D)
    q = tl.load(q_ptr + tok * stride_qt + (g * GROUP + h)[:, None] * stride_qh + d[None, :],
                mask=h_ok[:, None], other=0.0)

    row = block_idx_ptr + g * stride_bg + tok * stride_bt
    blocks = tl.load(row + tl.arange(0, W))
    if AFTER_WINDOW:
        # the window kernel did the forced blocks; in an ascending list the others (INIT <= b <
        # qb - LOCAL) are one run of entries, so the loop below has no branch in it (a skip test
        # per entry measured slower than walking all 96)
        hq = tok * (HKV * GROUP) + g * GROUP + h  # the partials are contiguous [N, Hq(, D)]
        m = tl.load(m_part_ptr + hq, mask=h_ok, other=float("-inf"))
        l = tl.load(l_part_ptr + hq, mask=h_ok, other=0.0)
        acc = tl.load(acc_part_ptr + hq[:, None] * D + d[None, :], mask=h_ok[:, None], other=0.0)
        first = tl.sum(((blocks >= 0) & (blocks < INIT)).to(tl.int32), axis=0)
        end = first + tl.sum(((blocks >= INIT) & (blocks < pos // BS - LOCAL)).to(tl.int32), axis=0)
    else:
        m = tl.full([GP], float("-inf"), tl.float32)
        l = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        first = 0
        end = tl.sum((blocks >= 0).to(tl.int32), axis=0)  # valid entries come first
    for i in range(first, end):
        b = tl.load(row + i)
        if PAGE_LIST:
            page = tl.load(page_idx_ptr + g * stride_bg + tok * stride_bt + i)
        else:
            page = tl.load(page_table_ptr + seq * stride_pt + b)
        m, l, acc = _selected_block(q, b, page, pos, g, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, stride_kp,
                                    stride_ks, stride_kh, m, l, acc, scale2, D, BS, KV_FP8, COMPUTE_DT, DOT_PREC, HKV)
    o = acc / l[:, None]
    tl.store(o_ptr + tok * stride_ot + (g * GROUP + h)[:, None] * stride_oh + d[None, :],
             o.to(o_ptr.dtype.element_ty), mask=h_ok[:, None])


@triton.jit
def _attention_tile(q_ptr, tile_seq_ptr, tile_tok0_ptr, tile_ntok_ptr, positions_ptr, g, stride_qt, stride_qh,
                    GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr):
    """The rows of tile program_id(0) for KV head g (see _tile_rows), which of them are real
    tokens and real heads, and their queries."""
    seq, tok0, ntok, t_of_r, h_of_r, tok_r, pos_r = _tile_rows(
        tile_seq_ptr, tile_tok0_ptr, tile_ntok_ptr, positions_ptr, tl.program_id(0), GP, BLOCK_T)
    tok_ok = t_of_r < ntok
    row_ok = tok_ok & (h_of_r < GROUP)
    q = _load_q_rows(q_ptr, tok_r, h_of_r, row_ok, g, stride_qt, stride_qh, GROUP, D)
    return seq, h_of_r, tok_r, pos_r, tok_ok, row_ok, q


@triton.jit
def _sparse_window_attn_kernel(
    q_ptr, k_ptr, v_ptr, m_part_ptr, l_part_ptr, acc_part_ptr, page_table_ptr, positions_ptr,
    tile_seq_ptr, tile_tok0_ptr, tile_ntok_ptr, k_scale_ptr, v_scale_ptr,
    stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_pt,
    scale2,
    GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BLOCK_T: tl.constexpr,
    INIT: tl.constexpr, LOCAL: tl.constexpr, DOT_PREC: tl.constexpr,
    KV_FP8: tl.constexpr = False, COMPUTE_DT: tl.constexpr = tl.bfloat16, HKV: tl.constexpr = 1,
):
    """The blocks every token selects whatever its scores: the init blocks and the local window
    (blocks qb - LOCAL .. qb of a token in block qb). Consecutive tokens share them, so one
    program per (tile of BLOCK_T consecutive tokens of one sequence, KV head g) reads each such
    block's K/V once for all its (token, head) rows. Walks the init blocks, then the union of the
    tile's windows; a row takes a block only if it is forced for its token, and only its causal
    keys. Writes the unnormalised softmax state (base 2) per row for the per-token kernel to
    continue over the other selected blocks (AFTER_WINDOW)."""
    g = tl.program_id(1)
    seq, h_of_r, tok_r, pos_r, tok_ok, row_ok, q = _attention_tile(
        q_ptr, tile_seq_ptr, tile_tok0_ptr, tile_ntok_ptr, positions_ptr, g, stride_qt, stride_qh, GROUP, GP, D,
        BLOCK_T)
    d = tl.arange(0, D)
    s_off = tl.arange(0, BS)
    qb_r = pos_r // BS
    qb_lo = tl.min(tl.where(tok_ok, qb_r, 1 << 30), axis=0)
    qb_hi = tl.max(tl.where(tok_ok, qb_r, -1), axis=0)

    m = tl.full([BLOCK_T * GP], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_T * GP], tl.float32)
    acc = tl.zeros([BLOCK_T * GP, D], tl.float32)
    # init blocks (forced for every token; causality alone limits them), then the windows from
    # where they start (never below INIT: no block twice)
    for b in range(0, INIT):
        page = tl.load(page_table_ptr + seq * stride_pt + b, mask=b <= qb_hi, other=0).to(tl.int64)
        kv_off = page * stride_kp + s_off[:, None] * stride_ks + g * stride_kh + d[None, :]
        visible = tok_ok[:, None] & ((b * BS + s_off)[None, :] <= pos_r[:, None])
        if b <= qb_hi:
            m, l, acc = _softmax_block(q, k_ptr + kv_off, v_ptr + kv_off, visible, page * HKV + g, k_scale_ptr,
                                       v_scale_ptr, m, l, acc, scale2, KV_FP8, COMPUTE_DT, DOT_PREC)
    for b in range(tl.maximum(qb_lo - LOCAL, INIT), qb_hi + 1):
        page = tl.load(page_table_ptr + seq * stride_pt + b).to(tl.int64)  # pools exceed 2^31 elements
        kv_off = page * stride_kp + s_off[:, None] * stride_ks + g * stride_kh + d[None, :]
        forced = tok_ok & (b >= qb_r - LOCAL)
        visible = forced[:, None] & ((b * BS + s_off)[None, :] <= pos_r[:, None])
        m, l, acc = _softmax_block(q, k_ptr + kv_off, v_ptr + kv_off, visible, page * HKV + g, k_scale_ptr,
                                   v_scale_ptr, m, l, acc, scale2, KV_FP8, COMPUTE_DT, DOT_PREC)
    hq = tok_r * (HKV * GROUP) + g * GROUP + h_of_r
    tl.store(m_part_ptr + hq, m, mask=row_ok)
    tl.store(l_part_ptr + hq, l, mask=row_ok)
    tl.store(acc_part_ptr + hq[:, None] * D + d[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _sparse_prefill_attn_tile_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, block_idx_ptr, page_table_ptr, positions_ptr,
    tile_seq_ptr, tile_tok0_ptr, tile_ntok_ptr, k_scale_ptr, v_scale_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kp, stride_ks, stride_kh,
    stride_bg, stride_bt, stride_pt,
    scale2, W,
    GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BLOCK_T: tl.constexpr,
    DOT_PREC: tl.constexpr,
    KV_FP8: tl.constexpr = False, COMPUTE_DT: tl.constexpr = tl.bfloat16, HKV: tl.constexpr = 1,
):
    """One program per (tile of BLOCK_T consecutive tokens of one sequence, KV head g): the rows
    of tl.dot are (token, head-in-group) pairs, and the program walks the union of the tokens'
    selected blocks in ascending order, reading each block's K/V once for the whole tile. Every
    token's list must be ascending (valid entries first, -1 after). Each row keeps a cursor into
    its token's list; a step takes the smallest current block, and rows whose token did not
    select it are masked out of the scores, which leaves their softmax state bit for bit as it
    was. Per row the arithmetic is the per-token kernel's over the same blocks in the same order.
    """
    g = tl.program_id(1)
    seq, h_of_r, tok_r, pos_r, tok_ok, row_ok, q = _attention_tile(
        q_ptr, tile_seq_ptr, tile_tok0_ptr, tile_ntok_ptr, positions_ptr, g, stride_qt, stride_qh, GROUP, GP, D,
        BLOCK_T)
    d = tl.arange(0, D)
    s_off = tl.arange(0, BS)

    NONE: tl.constexpr = 1 << 30  # cursor past the end of a list
    lists = block_idx_ptr + g * stride_bg + tok_r * stride_bt  # [rows]: the row's token's list
    at = tl.zeros([BLOCK_T * GP], tl.int32)
    cur = tl.load(lists, mask=tok_ok, other=-1)
    cur = tl.where(cur < 0, NONE, cur)
    b = tl.min(cur, axis=0)

    m = tl.full([BLOCK_T * GP], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_T * GP], tl.float32)
    acc = tl.zeros([BLOCK_T * GP, D], tl.float32)
    while b < NONE:
        active = cur == b
        page = tl.load(page_table_ptr + seq * stride_pt + b).to(tl.int64)  # pools exceed 2^31 elements
        kv_off = page * stride_kp + s_off[:, None] * stride_ks + g * stride_kh + d[None, :]
        visible = active[:, None] & ((b * BS + s_off)[None, :] <= pos_r[:, None])
        m, l, acc = _softmax_block(q, k_ptr + kv_off, v_ptr + kv_off, visible, page * HKV + g, k_scale_ptr,
                                   v_scale_ptr, m, l, acc, scale2, KV_FP8, COMPUTE_DT, DOT_PREC)
        # the rows that took this block move to their next entry
        at = at + active.to(tl.int32)
        nxt = tl.load(lists + at, mask=tok_ok & active & (at < W), other=-1)
        cur = tl.where(active, tl.where(nxt < 0, NONE, nxt), cur)
        b = tl.min(cur, axis=0)
    o = acc / l[:, None]
    tl.store(o_ptr + tok_r[:, None] * stride_ot + (g * GROUP + h_of_r)[:, None] * stride_oh + d[None, :],
             o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


# Tokens per program of the tile kernel (0: the per-token kernel). The tile kernel reads a block's
# K/V once per tile instead of once per token, but walks the union of the tile's lists: on dummy
# weights (adjacent tokens select unrelated blocks) tile 4 measured 1.5x slower (run 18), so it
# is off; real weights, whose neighbours share most blocks, may differ (perf notes).
SPARSE_ATTN_TILE = int(os.environ.get("SALASERVE_SPARSE_ATTN_TILE", "0"))
# Tokens per program of the window kernel (0: off). With it, the init and local-window blocks (34
# of a token's 96 at the real config) are read once per tile of consecutive tokens, which share
# them exactly, and the per-token kernel walks only the scored ones. bench_sparse (run 26, us
# per call): an 8K chunk at 128K 6795 -> 6250 (window 8) / 6446 (4); a 2K chunk at 18K 2025 ->
# 2042 / 2238. The whole 128K prefill moved less than micro's run-to-run spread (~0.2 s).
SPARSE_ATTN_WINDOW = int(os.environ.get("SALASERVE_SPARSE_ATTN_WINDOW", "8"))
# The per-token kernel reads each entry's page from a list made beforehand (one indexing of the
# page table in torch) instead of looking it up in its loop: two dependent loads per block instead
# of three. The sm_90 compile still has one K/V stage, but 82 registers instead of 128 at 4 warps;
# measured -2% at 4 warps, -5% at 2 (run 57, above).
SPARSE_ATTN_PAGE_LIST = os.environ.get("SALASERVE_SPARSE_ATTN_PAGE_LIST", "1") == "1"
# Warps of the per-token kernel by whether the pages are fp8: 2 for bf16 pages (run 57, above);
# 4 for fp8 ones, which spill at 2 (sm_90 compile: 255 registers, 48 bytes of stack).
_PER_TOKEN_WARPS = {False: 2, True: 4}


def _ascending_lists(block_idx: torch.Tensor) -> torch.Tensor:
    """block_idx rows sorted ascending with the -1 padding kept at the end."""
    big = torch.iinfo(block_idx.dtype).max
    key = torch.where(block_idx < 0, big, block_idx).sort(dim=-1).values
    return torch.where(key == big, -1, key)


def sparse_prefill_attention(q: torch.Tensor, kv: KVPool, layer: int, batch: ForwardBatch,
                             block_idx: torch.Tensor, scale: float, tile_tokens: int | None = None,
                             window: tuple[int, int] | None = None, window_tokens: int | None = None,
                             ascending: bool = False) -> torch.Tensor:
    """q [N, Hq, d]; block_idx [Hkv, N, W] int32 (ascending or not, valid entries first, -1 after).
    Each query attends to the keys of its selected blocks that are <= its position. Returns
    [N, Hq, d] in q.dtype. tile_tokens (default SPARSE_ATTN_TILE, a power of two): > 0 runs the
    tile kernel with that many consecutive tokens per program, 0 the per-token kernel (grid
    (N, Hkv), graph-safe in itself; the callers are not).
    window = (init_blocks, local_blocks): with the per-token kernel and window_tokens (default
    SPARSE_ATTN_WINDOW, a power of two) > 0, the forced blocks (b < init_blocks, or qb - local_blocks
    <= b <= qb for a token in block qb) go through the window kernel, window_tokens tokens per
    program. Every token's list must then hold all of its forced blocks, as InfLLM-v2's selection
    does (they score +inf); lists not known to be ascending (`ascending`) are sorted first."""
    tile = SPARSE_ATTN_TILE if tile_tokens is None else tile_tokens
    if tile < 0 or tile & (tile - 1):
        raise ValueError(f"tile_tokens must be 0 or a power of two, got {tile}")
    win = SPARSE_ATTN_WINDOW if window_tokens is None else window_tokens
    if win < 0 or win & (win - 1):
        raise ValueError(f"window_tokens must be 0 or a power of two, got {win}")
    N, Hq, D = q.shape
    hkv = kv.k.shape[3]
    group = Hq // hkv
    gp = max(16, _pow2(group))
    k, v = kv.k[layer], kv.v[layer]  # [pages, block_size, Hkv, D]
    pa = _pool_args(kv, layer)
    if pa["compute"] != q.dtype:
        raise ValueError(f"q is {q.dtype} but the KV cache computes in {pa['compute']}")
    out = torch.empty(N, Hq, D, dtype=q.dtype, device=q.device)
    if N == 0:
        return out
    strides = (q.stride(0), q.stride(1), out.stride(0), out.stride(1), k.stride(0), k.stride(1), k.stride(2))
    consts = dict(GROUP=group, GP=gp, D=D, BS=kv.block_size, DOT_PREC=_dot_precision(q.dtype), KV_FP8=pa["fp8"],
                  COMPUTE_DT=tl_dtype(pa["compute"]), HKV=hkv)
    if tile:
        block_idx = _ascending_lists(block_idx).contiguous()
        _, (tile_seq, tile_tok0, tile_ntok) = _step_tiles(batch, tile, q.device)
        _sparse_prefill_attn_tile_kernel[(tile_seq.numel(), hkv)](
            q, k, v, out, block_idx, batch.page_table, batch.positions, tile_seq, tile_tok0, tile_ntok,
            pa["k_scale"], pa["v_scale"], *strides, block_idx.stride(0), block_idx.stride(1),
            batch.page_table.stride(0), scale * LOG2E, block_idx.shape[-1],
            BLOCK_T=tile, num_warps=4 if tile * gp <= 64 else 8, **consts)
        return out
    width = block_idx.shape[-1]
    if width & (width - 1):  # the kernel reads a power-of-two row to count valid entries
        block_idx = torch.nn.functional.pad(block_idx, (0, _pow2(width) - width), value=-1)
    block_idx = block_idx.contiguous()
    tok_seq = torch.repeat_interleave(torch.arange(batch.num_seqs, device=q.device),
                                      batch.cu_seqlens_q.diff(), output_size=N)
    kernel_kw = {}  # the per-token kernel's optional inputs (window state, page list)
    if window is not None and win:
        init, local = window
        if not ascending:
            block_idx = _ascending_lists(block_idx)
        m_part = torch.empty(N, Hq, dtype=torch.float32, device=q.device)
        l_part = torch.empty_like(m_part)
        acc_part = torch.empty(N, Hq, D, dtype=torch.float32, device=q.device)
        _, (tile_seq, tile_tok0, tile_ntok) = _step_tiles(batch, win, q.device)
        _sparse_window_attn_kernel[(tile_seq.numel(), hkv)](
            q, k, v, m_part, l_part, acc_part, batch.page_table, batch.positions, tile_seq, tile_tok0, tile_ntok,
            pa["k_scale"], pa["v_scale"], q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
            batch.page_table.stride(0), scale * LOG2E, BLOCK_T=win, INIT=init, LOCAL=local,
            **{"num_warps": 4 if win * gp <= 64 else 8, **SPARSE_WINDOW_LAUNCH}, **consts)
        kernel_kw = dict(m_part_ptr=m_part, l_part_ptr=l_part, acc_part_ptr=acc_part, AFTER_WINDOW=True,
                         INIT=init, LOCAL=local)
    if SPARSE_ATTN_PAGE_LIST:  # each entry's page, in block_idx's layout (-1 entries: any valid page)
        pages = batch.page_table[tok_seq[None, :, None], block_idx.clamp_min(0)]
        kernel_kw.update(page_idx_ptr=pages.contiguous(), PAGE_LIST=True)
    _sparse_prefill_attn_kernel[(N, hkv)](
        q, k, v, out, block_idx, batch.page_table, tok_seq, batch.positions, pa["k_scale"], pa["v_scale"],
        *strides, block_idx.stride(0), block_idx.stride(1), batch.page_table.stride(0), scale * LOG2E,
        W=block_idx.shape[-1], **consts, **kernel_kw,
        **{"num_warps": _PER_TOKEN_WARPS[pa["fp8"]], **SPARSE_ATTN_LAUNCH})
    return out


def sparse_attention(q: torch.Tensor, kv: KVPool, comp: CompressedKeyPool, layer: int,
                     batch: ForwardBatch, cfg: ModelConfig, **select_kw) -> torch.Tensor:
    """TorchBackend.sparse_attention's contract: q [N, Hq, d] -> [N, Hq, d] in q.dtype, per-token
    InfLLM-v2 selection and block-sparse attention. Meant for prefill batches of sparse sequences;
    dense sequences are also exact (every causal block is listed) but a dense kernel is faster."""
    scale = cfg.head_dim ** -0.5
    block_idx = select_blocks_prefill(q, comp, layer, batch, cfg.sparse, scale, **select_kw)
    return sparse_prefill_attention(q, kv, layer, batch, block_idx, scale,
                                    window=(cfg.sparse.init_blocks, cfg.sparse.local_blocks), ascending=True)
