"""One persistent kernel for a one-row int4 junction: h' = h + (x @ W_out) * scale, then
y = RMSNorm(h') @ W_in (`w4_junction`), where the decode step ran three kernels (the dp2a GEMV, add +
RMSNorm, the dp2a GEMV).

Status: NOT used by the engine. Correct and deterministic, but 0.83-0.89x the three-kernel chain
at the model's junctions at every config and order (BENCHMARKS runs 111-116; perf-notes,
twenty-second session, says why and what a next try should change). Kept, with its interpreter and
GPU tests, as the base for that try (grid barrier, stream-K and split-K ranges, fixed-order partials).

Premise (refuted by runs 111-116): at one row each int4 GEMV in the step's chain takes ~6 us more
than its DRAM floor, L2 prefetch showed that this is not DRAM, so it would be the launch, the ramp of
~1000 short CTAs, the split-K round trip and the tail (perf-notes, runs 105-106), which one kernel per
junction removes. Here one grid of SM-count x CTAS_PER_SM CTAs, all resident at once, streams both
weight matrices:

- phase A: x @ W_out split over the CTAs stream-K style. The (column tile, K tile) steps of the
  GEMV are numbered column-major and each CTA takes an equal contiguous range, so every CTA streams
  the same bytes whatever the shape; a range that crosses column tiles flushes a partial per tile.
  Partials go to the workspace, and the last contributor of a column tile sums them in a fixed
  order (reproducible) and writes h' = h + round(u) * scale for those columns;
- a grid barrier (one counter and a generation word; a spin cap turns a would-be hang into an
  error flag that the host checks). Before it each CTA has already asked for its first W_in tile:
  weights never depend on the previous phase;
- phase B: each CTA reads h' back (hidden size values, L2), normalises it as fused.add_rms_norm
  does into its own scratch row, and runs the same stream-K loop over W_in.

`split_order` gives each phase a split-K grid's ranges instead (column c % tiles, K split c // tiles),
so that the CTAs running together read the same K rows of neighbouring columns. A CTA's range is cut
at column tiles into segments; each segment runs the dp2a GEMV's inner loop (w4_dp2a.py: x rounded to
int16 per thread and K tile in the loop, the weight tiles PREFETCH steps ahead in registers), so the
numbers match w4a16_gemv_dp2a's to the split-K summation order.

Co-residency: the barrier needs every CTA on an SM at once. The grid is the SM count times
min(CTAS_PER_SM, the occupancy that the compiled kernel's registers, threads and shared memory
allow). Under PDL the next kernel launches only once all of this grid's CTAs have started, so it
cannot take their slots. The Triton interpreter runs programs one after another, so there the
two phases are two launches (PHASE 1, then 2) and the barrier is never reached.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from salaserve.kernels._triton_utils import pdl_launch_kwargs, round_to, rsqrt_rn
from salaserve.kernels.device_buffers import Want, persistent_buffers
from salaserve.kernels.quant_gemm._common import _INTERPRET, _sm_count, _workspace
from salaserve.kernels.quant_gemm.w4_dp2a import _w4_dp2a_row, _w4_dp2a_tile, w4_dp2a_layout, w4_dp2a_usable
from salaserve.quant.formats import QuantizedLinearWeights

# (BLOCK_N, BLOCK_R, num_warps, SLABS, CTAS_PER_SM, PREFETCH): the tile and thread layout of the dp2a
# loop (w4_dp2a_layout), how many CTAs per SM the grid asks for (capped by occupancy), and how many
# steps ahead the loop reads.
W4_JUNCTION_CONFIGS = (
    (256, 16, 8, 4, 2, 1),
    (128, 16, 4, 4, 5, 1),
    (128, 16, 4, 4, 4, 2),
    (64, 16, 2, 4, 8, 2),
    (64, 16, 2, 4, 10, 1),
    (512, 16, 16, 4, 1, 1),
)
SPIN_LIMIT = tl.constexpr(1 << 22)  # barrier polls before the CTA gives up and raises the error flag (~seconds)


@triton.jit
def _owner(s, G, T):
    """The CTA whose stream range [c T / G, (c + 1) T / G) holds step s."""
    return ((s + 1) * G - 1) // T


@triton.jit
def _range(c, G, n_cols, KT, split):
    """CTA c's steps [begin, end): stream-K (an equal share of all n_cols * KT steps, split 0), or the
    split-K grid's (column c % n_cols, K tiles of split c // n_cols; CTAs past n_cols * split idle),
    where the CTAs running together read the same K rows of neighbouring columns."""
    T = n_cols * KT
    begin = c * T // G
    end = (c + 1) * T // G
    if split > 0:
        j = c % n_cols
        ks = c // n_cols
        begin = j * KT + ks * KT // split
        end = j * KT + (ks + 1) * KT // split
        if ks >= split:
            begin = 0
            end = 0
    return begin, end


@triton.jit
def _first_tiles(q_ptr, s, KT, N, rr, cols_in_tile, RS: tl.constexpr, SLABS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PREFETCH: tl.constexpr):
    """The weight tiles of stream step s and (PREFETCH 2) the step after it in the same column tile
    (clamped to the tile's last K tile): what a segment's loop starts with."""
    j = s // KT
    w_ptr = q_ptr + rr * N + j * BLOCK_N + cols_in_tile
    r0 = (s - j * KT) * BLOCK_R
    K8 = KT * BLOCK_R
    w0, w1, w2, w3 = _w4_dp2a_tile(w_ptr, r0, K8, N, rr, cols_in_tile, RS, SLABS, True)
    p0, p1, p2, p3 = w0, w1, w2, w3
    if PREFETCH >= 2:
        p0, p1, p2, p3 = _w4_dp2a_tile(w_ptr, r0 + BLOCK_R, K8, N, rr, cols_in_tile, RS, SLABS, True)
    return w0, w1, w2, w3, p0, p1, p2, p3


@triton.jit
def _segment(x_pairs, q_ptr, z_ptr, s_ptr, stride_z, N, K8, ws_ptr, cnt_ptr, maxc, split,
             h_ptr, h_out_ptr, y_ptr, scale, tiles, s, seg_end, c, G, cols_in_tile, rr,
             GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
             RS: tl.constexpr, SLABS: tl.constexpr, VECS: tl.constexpr, NV: tl.constexpr,
             PREFETCH: tl.constexpr, RESIDUAL: tl.constexpr, ASM: tl.constexpr):
    """Steps [s, seg_end) of one column tile (tiles: _first_tiles of s): the dp2a GEMV's own loop
    (pointer steps, the weight tiles PREFETCH ahead), then the sum to the tile's last contributor:
    RESIDUAL, as h_out = round(h + round(round(u) * scale)) (fused.add_rms_norm's roundings); else as
    y = round(u)."""
    KT = K8 // BLOCK_R
    T = (N // BLOCK_N) * KT
    rows0 = rr * 0
    offs = tl.arange(0, BLOCK_N)
    w0, w1, w2, w3, p0, p1, p2, p3 = tiles
    j = s // KT
    r_begin = (s - j * KT) * BLOCK_R
    r_end = (seg_end - j * KT) * BLOCK_R
    cols = j * BLOCK_N + cols_in_tile
    w_ptr = q_ptr + rr * N + cols
    s_cols = s_ptr + cols + rows0
    z_cols = z_ptr + cols // 8 + rows0
    z_shift = (cols % 8) * 4
    acc = tl.zeros((VECS, RS, NV // 4, 4), dtype=tl.float32)
    for r0 in tl.range(r_begin, r_end, BLOCK_R, loop_unroll_factor=2):
        # the tile PREFETCH ahead is issued before this one is consumed (w4_dp2a's loop)
        n0, n1, n2, n3 = _w4_dp2a_tile(w_ptr, r0 + PREFETCH * BLOCK_R, r_end, N, rr, cols, RS, SLABS, True)
        g = (r0 * 8) // GROUP_SIZE
        sc = tl.load(s_cols + g * N).to(tl.float32)
        zq = (tl.load(z_cols + g * stride_z) >> z_shift) & 0xF
        acc += _w4_dp2a_row(x_pairs, r0, rr, K8, w0, w1, w2, w3, zq, sc, RS, SLABS, True, ASM)
        if PREFETCH >= 2:
            w0, w1, w2, w3 = p0, p1, p2, p3
            p0, p1, p2, p3 = n0, n1, n2, n3
        else:
            w0, w1, w2, w3 = n0, n1, n2, n3
    part = tl.reshape(tl.sum(acc, axis=1), (BLOCK_N,))
    if split > 0:
        n_parts = split
        slot = c // (N // BLOCK_N)
    else:
        first_owner = _owner(j * KT, G, T)
        n_parts = _owner(j * KT + KT - 1, G, T) - first_owner + 1
        slot = c - first_owner
    total = part
    last = n_parts == 1
    if n_parts > 1:
        slots = ws_ptr + (j * maxc) * BLOCK_N + offs
        tl.store(slots + slot * BLOCK_N, part)
        tl.debug_barrier()  # every thread's partial is written before the release below
        arrived = tl.atomic_add(cnt_ptr + j, 1, sem="acq_rel", scope="gpu")
        last = arrived == n_parts - 1
        if last:  # all partials of the tile, summed in contributor order
            total = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for p in range(n_parts):
                total += tl.load(slots + p * BLOCK_N, cache_modifier=".cg")
            tl.atomic_xchg(cnt_ptr + j, 0)  # re-armed for the next launch
    if last:
        out_cols = j * BLOCK_N + offs
        u = round_to(total, tl.bfloat16)
        if RESIDUAL:
            r = tl.load(h_ptr + out_cols).to(tl.float32)
            h = round_to(r + round_to(u * scale, tl.bfloat16), tl.bfloat16)
            tl.store(h_out_ptr + out_cols, h.to(h_out_ptr.dtype.element_ty))
        else:
            tl.store(y_ptr + out_cols, u.to(y_ptr.dtype.element_ty))


@triton.jit
def _stream_gemv(x_pairs, q_ptr, z_ptr, s_ptr, stride_z, N, K8, ws_ptr, cnt_ptr, maxc, split,
                 h_ptr, h_out_ptr, y_ptr, scale, first, s_begin, s_end, c, G, cols_in_tile, rr,
                 GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                 RS: tl.constexpr, SLABS: tl.constexpr, VECS: tl.constexpr, NV: tl.constexpr,
                 PREFETCH: tl.constexpr, RESIDUAL: tl.constexpr, ONE_SEGMENT: tl.constexpr, ASM: tl.constexpr):
    """Steps [s_begin, s_end) of one GEMV, x one row, cut at column tiles into _segments (at most a
    few per CTA; the first tiles of a later one are asked for at its start). first: _first_tiles of
    s_begin, asked for before the caller's wait. split > 0: the ranges are a split-K grid's
    (_range), `split` contributors per column tile; ONE_SEGMENT (split order: a range never crosses a
    column tile) drops the segment loop and the tiles it carries."""
    KT = K8 // BLOCK_R
    if ONE_SEGMENT:
        if s_begin < s_end:
            _segment(x_pairs, q_ptr, z_ptr, s_ptr, stride_z, N, K8, ws_ptr, cnt_ptr, maxc, split, h_ptr, h_out_ptr,
                     y_ptr, scale, first, s_begin, s_end, c, G, cols_in_tile, rr, GROUP_SIZE, BLOCK_N, BLOCK_R, RS,
                     SLABS, VECS, NV, PREFETCH, RESIDUAL, ASM)
    else:
        tiles = first
        s = s_begin
        while s < s_end:
            seg_end = tl.minimum(s_end, (s // KT + 1) * KT)
            if s != s_begin:
                tiles = _first_tiles(q_ptr, s, KT, N, rr, cols_in_tile, RS, SLABS, BLOCK_N, BLOCK_R, PREFETCH)
            _segment(x_pairs, q_ptr, z_ptr, s_ptr, stride_z, N, K8, ws_ptr, cnt_ptr, maxc, split, h_ptr, h_out_ptr,
                     y_ptr, scale, tiles, s, seg_end, c, G, cols_in_tile, rr, GROUP_SIZE, BLOCK_N, BLOCK_R, RS,
                     SLABS, VECS, NV, PREFETCH, RESIDUAL, ASM)
            s = seg_end


@triton.jit
def _grid_barrier(bar_ptr, G):
    """Every CTA of the grid waits here until all have arrived; bar_ptr: [count, generation, error].
    The last arriver re-arms the count and moves the generation on, so no reset between launches."""
    tl.debug_barrier()  # this CTA's writes are issued before its arrival (released below)
    gen = tl.atomic_add(bar_ptr + 1, 0, sem="relaxed", scope="gpu")
    arrived = tl.atomic_add(bar_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == G - 1:
        tl.atomic_xchg(bar_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_add(bar_ptr + 1, 1, sem="release", scope="gpu")
    else:
        spins = 0
        while (tl.atomic_add(bar_ptr + 1, 0, sem="acquire", scope="gpu") == gen) & (spins < SPIN_LIMIT):
            spins += 1
        if spins >= SPIN_LIMIT:  # not all CTAs resident: the host sees the flag, the outputs are wrong
            tl.atomic_xchg(bar_ptr + 2, 1)
    tl.debug_barrier()


@triton.jit
def _w4_junction_kernel(
    x_ptr, h_ptr, norm_ptr, h_out_ptr, y_ptr, xn_ptr, ws_ptr, cnt_ptr, bar_ptr,
    qa_ptr, za_ptr, sa_ptr, qb_ptr, zb_ptr, sb_ptr, stride_za, stride_zb,
    K_A, N_B, maxc_a, maxc_b, split_a, split_b, scale, eps,
    HIDDEN: tl.constexpr, GROUP_A: tl.constexpr, GROUP_B: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, SLABS: tl.constexpr, VECS: tl.constexpr,
    PREFETCH: tl.constexpr,  # steps read ahead of the one being computed: 1 or 2
    SPLIT_ORDER: tl.constexpr,  # split_a / split_b > 0: each range within one column tile
    PHASE: tl.constexpr,  # 0: both phases and the grid barrier; 1: phase A only; 2: phase B only
    ASM: tl.constexpr, PDL: tl.constexpr = False, NORM_CHUNK: tl.constexpr = 512,
):
    RS: tl.constexpr = BLOCK_R // SLABS
    NV: tl.constexpr = BLOCK_N // VECS
    c = tl.program_id(0)
    G = tl.num_programs(0)
    rr = tl.arange(0, RS)[None, :, None, None]
    lane = tl.arange(0, NV // 4)[None, None, :, None]
    k4 = tl.arange(0, 4)[None, None, None, :]
    cols_in_tile = (tl.arange(0, VECS) * NV)[:, None, None, None] + lane * 4 + k4  # [V, 1, NV/4, 4]
    x_quads = rr * 4 + lane * 0 + k4  # int32 pairs of a slab's rows: [1, RS, NV/4, 4]
    ka8 = K_A // 8
    kb8: tl.constexpr = HIDDEN // 8
    ta = (HIDDEN // BLOCK_N) * (ka8 // BLOCK_R)  # phase A's steps
    tb = (N_B // BLOCK_N) * (kb8 // BLOCK_R)
    kta = ka8 // BLOCK_R
    ktb: tl.constexpr = kb8 // BLOCK_R
    if PHASE != 2:
        a_begin, a_end = _range(c, G, HIDDEN // BLOCK_N, kta, split_a)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        # the first tiles before the dependency wait: weights never depend on the previous kernel
        first = _first_tiles(qa_ptr, tl.minimum(a_begin, ta - 1), kta, HIDDEN, rr, cols_in_tile, RS, SLABS, BLOCK_N,
                             BLOCK_R, PREFETCH)
        if PDL:
            tl.extra.cuda.gdc_wait()
        x_pairs = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + x_quads
        _stream_gemv(x_pairs, qa_ptr, za_ptr, sa_ptr, stride_za, HIDDEN, ka8, ws_ptr, cnt_ptr, maxc_a, split_a,
                     h_ptr, h_out_ptr, y_ptr, scale, first, a_begin, a_end, c, G, cols_in_tile, rr,
                     GROUP_A, BLOCK_N, BLOCK_R, RS, SLABS, VECS, NV, PREFETCH, True, SPLIT_ORDER, ASM)
    if PHASE != 1:
        b_begin, b_end = _range(c, G, N_B // BLOCK_N, ktb, split_b)  # here: nothing of phase B lives through A
        first_b = _first_tiles(qb_ptr, tl.minimum(b_begin, tb - 1), ktb, N_B, rr, cols_in_tile, RS, SLABS, BLOCK_N,
                               BLOCK_R, PREFETCH)
        if PHASE == 0:
            _grid_barrier(bar_ptr, G)
        # h' is complete: this CTA's copy of RMSNorm(h') (fused._normalize's roundings), in chunks
        # (a whole row per thread group would hold HIDDEN / threads values across the prefetched tiles)
        ch = tl.arange(0, NORM_CHUNK)
        ss = tl.zeros((NORM_CHUNK,), dtype=tl.float32)
        for k0 in range(0, HIDDEN, NORM_CHUNK):
            hv = tl.load(h_out_ptr + k0 + ch, cache_modifier=".cg").to(tl.float32)
            ss += hv * hv
        rstd = rsqrt_rn(tl.sum(ss, axis=0) / HIDDEN + eps)
        xn_row = xn_ptr + c * HIDDEN
        for k0 in range(0, HIDDEN, NORM_CHUNK):
            hv = tl.load(h_out_ptr + k0 + ch, cache_modifier=".cg").to(tl.float32)
            nw = tl.load(norm_ptr + k0 + ch).to(tl.float32)
            tl.store(xn_row + k0 + ch, round_to(round_to(hv * rstd, tl.bfloat16) * nw, tl.bfloat16)
                     .to(xn_ptr.dtype.element_ty))
        tl.debug_barrier()  # the CTA's threads read each other's x below
        xn_pairs = xn_row.to(tl.pointer_type(tl.int32), bitcast=True) + x_quads
        cnt_b = cnt_ptr + HIDDEN // BLOCK_N
        _stream_gemv(xn_pairs, qb_ptr, zb_ptr, sb_ptr, stride_zb, N_B, kb8, ws_ptr + HIDDEN * maxc_a, cnt_b, maxc_b, split_b,
                     h_ptr, h_out_ptr, y_ptr, scale, first_b, b_begin, b_end, c, G, cols_in_tile, rr,
                     GROUP_B, BLOCK_N, BLOCK_R, RS, SLABS, VECS, NV, PREFETCH, False, SPLIT_ORDER, ASM)


# ---------------------------------------------------------------- host side


def _host_owner(s: int, G: int, T: int) -> int:
    """_owner on the host."""
    return ((s + 1) * G - 1) // T


def max_contributors(n_tiles: int, kt: int, G: int) -> int:
    """The most CTAs whose stream ranges meet one column tile (its partial slots in the workspace)."""
    T = n_tiles * kt
    return max(_host_owner(j * kt + kt - 1, G, T) - _host_owner(j * kt, G, T) + 1 for j in range(n_tiles))


_BARRIER: dict = {}
_XN_SCRATCH: dict = {}


def barrier_words(device: torch.device) -> torch.Tensor:
    """[count, generation, error flag, unused] of the grid barrier, one set per device."""
    return persistent_buffers(_BARRIER, device, (Want(4, 4, torch.int32, zeroed=True),), "the junction barrier")[0]


def barrier_error(device: torch.device) -> bool:
    """Whether a junction kernel's barrier ever gave up waiting (its outputs were then wrong)."""
    return bool(barrier_words(torch.device(device))[2].item())


def w4_junction_usable(hidden: int, w_out: QuantizedLinearWeights, w_in: QuantizedLinearWeights,
                       config: tuple) -> bool:
    """Whether w4_junction takes these weights with this config: both dp2a-usable, W_out [K_A ->
    hidden], W_in [hidden -> N_B], every dimension whole tiles, hidden a power of two (the norm
    holds the row in one block)."""
    block_n, block_r = config[0], config[1]
    return (w4_dp2a_usable(w_out) and w4_dp2a_usable(w_in) and w_out.out_features == hidden
            and w_in.in_features == hidden and hidden & (hidden - 1) == 0
            and hidden % block_n == 0 and w_in.out_features % block_n == 0
            and w_out.in_features % (8 * block_r) == 0 and hidden % (8 * block_r) == 0
            and w_out.group_size % (8 * block_r) == 0 and w_in.group_size % (8 * block_r) == 0)


@functools.lru_cache(maxsize=None)
def _sm90_occupancy(n_regs: int, warps: int, shared: int) -> int:
    """CTAs per SM that fit on an H100/H200 SM: 64K registers in 4 quarters (allocated per warp in
    units of 256), 2048 threads, 32 CTAs, 228 KB of shared memory (1 KB reserved per CTA)."""
    per_warp = -(-max(n_regs, 1) * 32 // 256) * 256
    by_regs = (4 * (16384 // per_warp)) // warps
    by_threads = 2048 // (32 * warps)
    by_smem = (228 * 1024) // (shared + 1024)
    return max(0, min(32, by_regs, by_threads, by_smem))


def w4_junction(h: torch.Tensor, x: torch.Tensor, w_out: QuantizedLinearWeights, scale: float,
                norm_w: torch.Tensor, eps: float, w_in: QuantizedLinearWeights, *,
                config: tuple = W4_JUNCTION_CONFIGS[0], grid: int | None = None,
                phases_apart: bool = False, only_phase: int = 0, split_order: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One row: (h' = h + (x @ W_out) * scale, RMSNorm(h', norm_w) @ W_in), each bf16 [1, .], as
    add_rms_norm(h, w4a16_gemv_dp2a(x, W_out), scale, norm_w, eps) and the GEMV of its output would
    give them (to the split-K summation order). grid: the CTA count (default: the SM count times
    the config's CTAs per SM, capped by occupancy). phases_apart: the two phases as two launches
    without the barrier (what the interpreter always does; the GPU tests compare the two forms).
    only_phase 1 or 2: launch that phase alone (a benchmark's breakdown; phase 2 alone reads h' from
    an earlier call's output buffer, so its values are not meaningful). split_order: each phase as a
    split-K grid (split = grid // column tiles) instead of stream-K."""
    hidden = h.shape[-1]
    if (h.dim() != 2 or h.shape[0] != 1 or x.dim() != 2 or x.shape != (1, w_out.in_features)
            or h.dtype != torch.bfloat16 or x.dtype != torch.bfloat16 or norm_w.shape != (hidden,)):
        raise ValueError(f"w4_junction takes one bf16 row: h [1, hidden], x [1, {w_out.in_features}], norm_w "
                         f"[hidden]; got {tuple(h.shape)} {h.dtype}, {tuple(x.shape)} {x.dtype}, {tuple(norm_w.shape)}")
    if not w4_junction_usable(hidden, w_out, w_in, config):
        raise ValueError(f"w4_junction cannot take these weights with config {config}")
    block_n, block_r, warps, slabs, _, prefetch = config
    device = x.device
    h = h.contiguous()
    x = x if x.is_contiguous() and x.data_ptr() % 4 == 0 else x.clone()
    n_b = w_in.out_features
    h_out = torch.empty_like(h)
    y = torch.empty(1, n_b, dtype=torch.bfloat16, device=device)
    kt_a, kt_b = w_out.in_features // (8 * block_r), hidden // (8 * block_r)
    tiles_a, tiles_b = hidden // block_n, n_b // block_n
    args = dict(HIDDEN=hidden, GROUP_A=w_out.group_size, GROUP_B=w_in.group_size, BLOCK_N=block_n,
                BLOCK_R=block_r, **w4_dp2a_layout(block_n, block_r, warps, slabs), PREFETCH=prefetch,
                NORM_CHUNK=min(512, hidden), ASM=not _INTERPRET, num_warps=warps)
    args["SPLIT_ORDER"] = split_order
    pdl = {} if phases_apart else pdl_launch_kwargs(device)

    def operands(g: int) -> tuple:
        split_a = max(1, min(g // tiles_a, kt_a)) if split_order else 0
        split_b = max(1, min(g // tiles_b, kt_b)) if split_order else 0
        maxc_a = split_a or max_contributors(tiles_a, kt_a, g)
        maxc_b = split_b or max_contributors(tiles_b, kt_b, g)
        ws, cnt = _workspace(device, hidden * maxc_a + n_b * maxc_b, tiles_a + tiles_b)
        xn = persistent_buffers(_XN_SCRATCH, device, (Want(g * hidden, 0, torch.bfloat16),), "the junction's x rows")[0]
        return (x, h, norm_w, h_out, y, xn, ws, cnt, barrier_words(device),
                w_out.qweight, w_out.qzeros, w_out.scales, w_in.qweight, w_in.qzeros, w_in.scales,
                w_out.qzeros.stride(0), w_in.qzeros.stride(0), w_out.in_features, n_b, maxc_a, maxc_b,
                split_a, split_b, float(scale), float(eps))

    if grid is None:
        grid = _default_grid(config, args, pdl, operands, device, (tiles_a * kt_a, tiles_b * kt_b))
    # every CTA at least one step of each phase: the contributors of a column tile are then the
    # consecutive CTAs between its first and last step's owners
    grid = min(grid, tiles_a * kt_a, tiles_b * kt_b)
    if grid < (max(tiles_a, tiles_b) if split_order else 1):
        raise ValueError(f"w4_junction: grid {grid} too small")
    ops = operands(grid)
    if only_phase:
        _w4_junction_kernel[(grid,)](*ops, PHASE=only_phase, **args)
    elif _INTERPRET or phases_apart:  # the interpreter runs programs one after another: a barrier would never open
        _w4_junction_kernel[(grid,)](*ops, PHASE=1, **args)
        _w4_junction_kernel[(grid,)](*ops, PHASE=2, **args)
    else:
        _w4_junction_kernel[(grid,)](*ops, PHASE=0, **args, **pdl)
    return h_out, y


_GRIDS: dict = {}


def _default_grid(config, args, pdl, operands, device, steps) -> int:
    """The SM count times min(the config's CTAs per SM, what the compiled kernel's resources let
    one SM hold), worked out once per specialisation (a compile-only warm-up, nothing launched)."""
    key = (str(device), config, tuple(sorted(args.items())), steps)
    if key not in _GRIDS:
        sms, want = _sm_count(device), config[4]
        if _INTERPRET:
            _GRIDS[key] = sms * want
        else:
            kernel = _w4_junction_kernel.warmup(*operands(min(sms * want, *steps)), PHASE=0, grid=(1,), **args, **pdl)
            kernel._init_handles()
            fits = _sm90_occupancy(kernel.n_regs, args["num_warps"], kernel.metadata.shared)
            if fits < 1:
                raise ValueError(f"w4_junction: config {config} does not fit one CTA per SM")
            _GRIDS[key] = sms * min(want, fits)
    return _GRIDS[key]
