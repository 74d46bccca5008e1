"""Top-k over stage 1's packed keys (Triton), with ties toward the lower block index.

`topk_pages` (decode: page ids of the best blocks, CUDA-graph capturable), `topk_blocks` (prefill:
block indices per token) and their torch counterparts `topk_pages_torch` / `_topk_blocks`, which
define the result the kernels match bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from salaserve.config import SparseConfig
from salaserve.kernels._triton_utils import pdl_launch_kwargs, pdl_wait_first
from salaserve.kernels.compile_ahead import launch_kernel, precompile

TOPK_ONE_PASS_BLOCKS = 4096  # rows up to here: one program per (row, KV head); wider: segments
TOPK_SEGMENT = 2048  # blocks per segment program of a wide row


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
def _top_keys(u, lim):
    """Mask of the lim largest of the unique uint32 keys u (lim >= 1, at most the nonzero count;
    0 entries never count), u laid out in ascending block order: the threshold's score half by 16
    counting passes, then, of the keys whose score equals it, the first `lim - (keys above)` in
    block order, which are the largest keys (low half 65535 - block). The same selection as the
    exact 32-bit threshold (32 passes): 11.0 against 11.6 us per call at 128K, 13.7-15.3 against
    19.3-19.9 at 512K."""
    t = _kth_largest(u, lim, 16) >> 16
    hi = u >> 16
    above = hi > t
    tied = hi == t
    need = lim - tl.sum(above.to(tl.int32), axis=0)  # >= 1: fewer than lim keys score above t
    return above | (tied & (tl.cumsum(tied.to(tl.int32), axis=0) <= need))


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
    BS: tl.constexpr, W: tl.constexpr, MAX_SEL: tl.constexpr,
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
    sel = _top_keys(u, lim)  # exactly lim entries: the keys are unique
    _write_pages(out_ptr + r.to(tl.int64) * stride_ob + g * stride_oh, count_ptr + r * stride_cb + g,
                 page_table_ptr + r.to(tl.int64) * stride_pt, j, sel, max_sel, MAX_SEL)


@triton.jit
def _topk_segment_kernel(
    keys_ptr, seq_lens_ptr, cand_key_ptr, cand_blk_ptr,
    stride_kg, stride_kt, stride_cr, stride_cg,
    nb, dense_len, topk_eff, max_sel,
    BS: tl.constexpr, SEG: tl.constexpr, MAX_SEL: tl.constexpr,
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
                        stride_cr, stride_cg, SEG, MAX_SEL)


@triton.jit
def _segment_candidates(keys_ptr, cand_key_ptr, cand_blk_ptr, r, g, seg, nb, qb, lim, stride_kg, stride_kt,
                        stride_cr, stride_cg, SEG: tl.constexpr, MAX_SEL: tl.constexpr):
    """Segment `seg` of row r, KV head g: the top lim (>= 1) of its keys at blocks <= qb (all of
    them when it has fewer), in ascending block order, with their block indices, at candidates
    [seg * MAX_SEL, ...); the rest of the segment's key slots 0."""
    j = seg * SEG + tl.arange(0, SEG)
    u = _causal_keys(keys_ptr, r, g, j, nb, qb, stride_kg, stride_kt)
    # lim_s = 0 only where the segment has no causal block (lim >= 1): then u > 0 selects nothing
    lim_s = tl.minimum(lim, tl.sum((u > 0).to(tl.int32), axis=0))
    sel = _top_keys(u, tl.maximum(lim_s, 1)) & (u > 0)
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
    BS: tl.constexpr, N_CAND: tl.constexpr, MAX_SEL: tl.constexpr,
    PDL: tl.constexpr = False,  # programmatic dependent launch (_triton_utils)
):
    """Wide rows, second step. Program (row r, KV head g): the row's top lim among the segments'
    candidates (segment by segment, each ascending: block order) -> pages, as _topk_pages_kernel."""
    pdl_wait_first(PDL)
    r = tl.program_id(0)
    g = tl.program_id(1)
    _, lim = _row_limit(seq_lens_ptr, r, nb, dense_len, topk_eff, max_sel, BS)
    blk, sel = _merge_candidates(cand_key_ptr, cand_blk_ptr, r, g, lim, stride_cr, stride_cg, N_CAND)
    _write_pages(out_ptr + r.to(tl.int64) * stride_ob + g * stride_oh, count_ptr + r * stride_cb + g,
                 page_table_ptr + r.to(tl.int64) * stride_pt, blk, sel, max_sel, MAX_SEL)


@triton.jit
def _merge_candidates(cand_key_ptr, cand_blk_ptr, r, g, lim, stride_cr, stride_cg, N_CAND: tl.constexpr):
    """(block indices, selection mask) of the top lim (>= 1) of row r's candidates, KV head g (the
    segments' candidates one after the other, each ascending: block order)."""
    i = tl.arange(0, N_CAND)
    row = r.to(tl.int64) * stride_cr + g * stride_cg
    u = tl.load(cand_key_ptr + row + i).to(tl.uint32, bitcast=True)
    sel = _top_keys(u, lim)
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


# the step's sizes are not specialised on: one compiled kernel for every step (compile_watch.py)
@triton.jit(do_not_specialize=['stride_kg', 'stride_kt', 'stride_og', 'stride_ot', 'nb', 'k', 'width'])
def _topk_blocks_kernel(
    keys_ptr, qb_ptr, limit_ptr, out_ptr,
    stride_kg, stride_kt, stride_og, stride_ot,
    nb, k, width,
    W: tl.constexpr, OUT_W: tl.constexpr, LIMIT_PER_ROW: tl.constexpr,
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
    sel = _top_keys(u, tl.maximum(lim, 1)) & (j <= tl.where(lim > 0, qb, -1))
    _write_blocks(out_ptr + g * stride_og + r.to(tl.int64) * stride_ot, j, sel, width, OUT_W)


@triton.jit(do_not_specialize=['stride_kg', 'stride_kt', 'stride_cr', 'stride_cg', 'nb', 'k'])
def _topk_blocks_segment_kernel(
    keys_ptr, limit_ptr, cand_key_ptr, cand_blk_ptr,
    stride_kg, stride_kt, stride_cr, stride_cg,
    nb, k,
    SEG: tl.constexpr, MAX_SEL: tl.constexpr, LIMIT_PER_ROW: tl.constexpr,
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
                        stride_cr, stride_cg, SEG, MAX_SEL)


@triton.jit(do_not_specialize=['stride_cr', 'stride_cg', 'stride_og', 'stride_ot', 'k', 'width'])
def _topk_blocks_merge_kernel(
    cand_key_ptr, cand_blk_ptr, qb_ptr, limit_ptr, out_ptr,
    stride_cr, stride_cg, stride_og, stride_ot,
    k, width,
    N_CAND: tl.constexpr, OUT_W: tl.constexpr, LIMIT_PER_ROW: tl.constexpr,
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
                                 N_CAND)
    sel = sel & (blk <= tl.where(lim > 0, qb, -1))
    _write_blocks(out_ptr + g * stride_og + r.to(tl.int64) * stride_ot, blk, sel, width, OUT_W)


def topk_pages(keys: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor, sc: SparseConfig,
               max_sel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """select_blocks_decode's tail: keys [Hkv, B, nb] int32 (packed), page_table [B, >= nb] int32,
    seq_lens [B] -> (page ids [B, Hkv, max_sel] int32, counts [B, Hkv] int32). Rows up to
    TOPK_ONE_PASS_BLOCKS wide in one kernel (one program per row and KV head); wider rows in
    TOPK_SEGMENT-block segments, each program keeping its segment's best, then a merge: a single
    program per row took 48 us at 512K (16384-wide rows) where the GPU has 132 SMs."""
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
            *limits, BS=sc.block_size, W=triton.next_power_of_2(nb), MAX_SEL=max_sel_p2,
            num_warps=8 if nb > 2048 else 4, **pdl_launch_kwargs(keys.device),
        )
        return out, count
    n_seg = triton.next_power_of_2(triton.cdiv(nb, TOPK_SEGMENT))
    cand_key = torch.empty(B, hkv, n_seg * max_sel_p2, dtype=torch.int32, device=keys.device)
    cand_blk = torch.empty_like(cand_key)
    _topk_segment_kernel[(B, hkv, n_seg)](
        keys, seq_lens, cand_key, cand_blk,
        keys.stride(0), keys.stride(1), cand_key.stride(0), cand_key.stride(1),
        *limits, BS=sc.block_size, SEG=TOPK_SEGMENT, MAX_SEL=max_sel_p2,
        num_warps=8 if TOPK_SEGMENT > 1024 else 4, **pdl_launch_kwargs(keys.device),
    )
    _topk_merge_kernel[(B, hkv)](
        cand_key, cand_blk, page_table, seq_lens, out, count,
        cand_key.stride(0), cand_key.stride(1), page_table.stride(0), out.stride(0), out.stride(1), count.stride(0),
        *limits, BS=sc.block_size, N_CAND=n_seg * max_sel_p2, MAX_SEL=max_sel_p2,
        num_warps=4, **pdl_launch_kwargs(cand_key.device),
    )
    return out, count


_TOPK_MAX_CANDIDATES = 4096  # the widest merge of topk_blocks (segments x candidates per segment)


def topk_blocks(keys: torch.Tensor, width: int, limit: torch.Tensor | int, qb: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
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
    would hold more than _TOPK_MAX_CANDIDATES candidates: never at width <= 128 and nb <= 65536)."""
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
    plan = topk_blocks_plan(nb, width, k, per_row)
    if plan[0] == "one pass":
        _, w, out_w, _, warps = plan
        launch_kernel(
            _topk_blocks_kernel, (R, hkv), keys, qb, limit_arg, out,
            keys.stride(0), keys.stride(1), out.stride(0), out.stride(1), nb, k, width,
            W=w, OUT_W=out_w, LIMIT_PER_ROW=per_row, num_warps=warps, **pdl_launch_kwargs(keys.device),
        )
        return out
    if plan[0] == "torch":
        out.copy_(_topk_blocks(keys, width, limit, qb))
        return out
    _, n_keep, n_cand, out_w, _, warps = plan
    cand_key = torch.empty(R, hkv, n_cand, dtype=torch.int32, device=keys.device)
    cand_blk = torch.empty_like(cand_key)
    launch_kernel(
        _topk_blocks_segment_kernel, (R, hkv, n_cand // n_keep), keys, limit_arg, cand_key, cand_blk,
        keys.stride(0), keys.stride(1), cand_key.stride(0), cand_key.stride(1), nb, k,
        SEG=TOPK_SEGMENT, MAX_SEL=n_keep, LIMIT_PER_ROW=per_row,
        num_warps=8 if TOPK_SEGMENT > 1024 else 4, **pdl_launch_kwargs(keys.device),
    )
    launch_kernel(
        _topk_blocks_merge_kernel, (R, hkv), cand_key, cand_blk, qb, limit_arg, out,
        cand_key.stride(0), cand_key.stride(1), out.stride(0), out.stride(1), k, width,
        N_CAND=n_cand, OUT_W=out_w, LIMIT_PER_ROW=per_row, num_warps=warps, **pdl_launch_kwargs(keys.device),
    )
    return out


def topk_blocks_plan(nb: int, width: int, k: int, per_row: bool) -> tuple:
    """What topk_blocks runs for rows of nb blocks, output width `width` and k ranked, named by the
    kernels' compile-time arguments (one compiled kernel per distinct plan):
    ("one pass", W, OUT_W, per_row, num_warps), ("segments", n_keep, N_CAND, OUT_W, per_row,
    merge num_warps), or ("torch",) where the merge would hold too many candidates."""
    out_w = triton.next_power_of_2(width)
    if nb <= TOPK_ONE_PASS_BLOCKS:
        return ("one pass", triton.next_power_of_2(nb), out_w, per_row, 8 if nb > 2048 else 4)
    n_seg = triton.next_power_of_2(triton.cdiv(nb, TOPK_SEGMENT))
    n_keep = triton.next_power_of_2(min(k, TOPK_SEGMENT))  # candidate slots per segment
    if n_seg * n_keep > _TOPK_MAX_CANDIDATES:
        return ("torch",)
    return ("segments", n_keep, n_seg * n_keep, out_w, per_row, 8 if n_seg * n_keep > 2048 else 4)


def prefill_topk_classes(sc: SparseConfig, max_blocks: int) -> list[tuple[int, int, bool]]:
    """One (nb, width, per-row limit) per kernel class `topk_blocks` meets in select_blocks_prefill
    for sequences of up to max_blocks blocks. The classes are its constexprs: W = next_pow2(nb)
    (nb: the step's widest sequence, a sparse one, so from ceil(dense_len / block_size) blocks up)
    or, past TOPK_ONE_PASS_BLOCKS, the segment count; OUT_W = next_pow2(width), width from topk_eff
    (every sequence sparse: one int limit) to a dense sequence's block count (mixed: per-row limits)."""
    dense_blocks = -(-sc.dense_len // sc.block_size)
    nbs, nb = [], triton.next_power_of_2(max(1, dense_blocks))
    while nb <= min(max_blocks, TOPK_ONE_PASS_BLOCKS) * 2:  # the class max_blocks itself falls in
        nbs.append(min(nb, max_blocks, TOPK_ONE_PASS_BLOCKS))
        nb *= 2
    n_seg = triton.next_power_of_2(triton.cdiv(TOPK_ONE_PASS_BLOCKS + 1, TOPK_SEGMENT))
    while (n_seg // 2) * TOPK_SEGMENT < max_blocks:  # wide rows: one nb per segment count
        nbs.append(min(max_blocks, (n_seg // 2) * TOPK_SEGMENT + 1))
        n_seg *= 2
    widths, w = [sc.topk_eff], triton.next_power_of_2(sc.topk_eff) * 2
    while w // 2 < max(dense_blocks, sc.topk_eff):  # mixed steps: width up to the dense block count
        widths.append(min(w, dense_blocks))
        w *= 2
    out = []
    for nb in dict.fromkeys(nbs):
        out.append((nb, sc.topk_eff, False))
        out += [(nb, width, True) for width in dict.fromkeys(widths)]
    return out


def warm_up_prefill_topk(sc: SparseConfig, max_blocks: int, kv_heads: int, device, parallel: bool = True) -> int:
    """Build every `prefill_topk_classes` kernel of topk_blocks ahead (compiled in threads where
    compile_ahead.precompile can, else by one real launch each, on one row), so that no prompt length
    up to max_blocks blocks meets a compile while serving. Returns the number of classes."""
    classes = prefill_topk_classes(sc, max_blocks)

    def launch(nb, width, per_row):
        keys = torch.arange(nb, dtype=torch.int32, device=device).expand(kv_heads, 1, nb).contiguous()
        qb = torch.full((1,), nb - 1, dtype=torch.int64, device=device)
        limit = torch.full((1,), width, dtype=torch.int64, device=device) if per_row else width
        topk_blocks(keys, width, limit, qb)

    launches = [lambda c=c: launch(*c) for c in classes]
    if not precompile(launches, parallel):
        for fn in launches:
            fn()
    return len(classes)


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
