"""The int4 decode GEMV with its weights streamed by TMA (`w4a16_gemv_tma`, one row of x rounded by its
producer, as w4a16_gemv_dp2a_rounded takes it). OPT-IN: SALASERVE_W4_TMA=1 adds it to the
calibration's one-row rounded-x candidates (w4_decode.rounded_choices).

Why it is off (runs 121-124, BENCHMARKS): back to back with PDL it beats the dp2a kernel at gate_up
(22.0 vs 24.8 us) and qkvz (13.1 vs 14.5), but the decode step is slower with it picked (2.612-2.666
against 2.504 ms). With PDL off the calibration picks it at no shape: its win is overlap with its own
next launch, which the step does not give it.

Which launches work on the H200 (run 120, scripts/device_runs/gpu_session23_a.sh, Triton 3.6): with only the
weight tile through TMA, every config; with the group's scales and zero words through TMA too, only
the 256-column tiles. Every narrower one faulted with "misaligned address" (runs 117-120), and the
difference is the zero words' box: [1, BLOCK_N / 8] int32, 128 bytes at 256 columns, 16-64 below.
Minimal descriptor loads with 128-byte rows (scripts/tma_probe.py) all worked, so a box row under
128 bytes is the likely cause (not proven); GROUP_TMA configs are therefore refused below 256 columns.

Why: the dp2a GEMV keeps its weight tiles in flight in registers (1-2 tiles of 64 bytes per thread),
which caps the bytes in flight per SM by the register file and leaves the large shapes at ~2.7 TB/s
and the small ones latency-bound (perf-notes, twentieth to twenty-second sessions). Triton's
pipeliner turns a tensor-descriptor load in a loop into TMA copies into shared memory, STAGES - 1
tiles ahead, with no registers held and no per-thread address arithmetic; the tile then comes out
of shared memory in the layout the math wants (the loop has no layout conversion: the sm_90
compile test checks it).

Math per K tile (16 packed rows = 128 channels = one x scale and one quantization group): the
[16, BLOCK_N] words against the rows' int16 x pairs (w4_dp2a._word_dot: a shift, two lop3, four
dp2a per word), the zero point per element as -z * (the row's sum of v), then one convert and one
fma per word into an fp32 [16, BLOCK_N] accumulator, summed over the rows once after the loop:
~10 instructions per word (1.25 per nibble; the dp2a GEMV's loop 1.6-2.6). Exactness: the rounded
dp2a kernel's (x rounded per 128 channels by its producer, integer sums exact).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from salaserve.kernels._triton_utils import pdl_launch_kwargs
from salaserve.kernels.compile_ahead import launch_kernel
from salaserve.kernels.quant_gemm._common import _INTERPRET, _default_split_k, _store_output, _workspace
from salaserve.kernels.quant_gemm.w4_dp2a import X_TILE, _word_dot, w4_dp2a_usable
from salaserve.quant.formats import QuantizedLinearWeights

TMA_ROWS = X_TILE // 8  # packed rows per K tile: one x scale, one quantization group (128)
# (BLOCK_N, num_warps, STAGES, GROUP_TMA): the column tile (a TMA box of TMA_ROWS x BLOCK_N words, at
# most 256), the warps that share it, the pipeline's depth (STAGES - 1 tiles in flight per CTA), and
# whether the group's bf16 scales and zero words come through TMA too (else fp32 scales, plain loads).
# Run 120's A/B (every shape, splits 1-8, configs of 32-256 columns): (256, 4, 3) won every shape, so
# the list is now mostly 256-column variants around it.
W4_TMA_CONFIGS = (
    (256, 4, 3, False),
    (256, 4, 3, True),
    (256, 4, 4, False),
    (256, 4, 4, True),
    (256, 2, 3, False),
    (256, 8, 4, False),
    (128, 4, 4, False),
    (128, 4, 6, False),
)
GROUP_TMA_MIN_N = 256  # narrower zero-word boxes (under 128 bytes) faulted on the H200 (runs 117-120)


@triton.jit
def _tma_group(z_desc, s_desc, qzeros_ptr, scales_ptr, g, col0, cols, z_shift, N, stride_zg,
               BLOCK_N: tl.constexpr, GROUP_TMA: tl.constexpr):
    """Group g's scales (fp32) and zero points ([1, BLOCK_N] in the tile's layout)."""
    if GROUP_TMA:  # bf16 scales and zero words through TMA too
        sc = s_desc.load([g, col0]).to(tl.float32)
        zw = z_desc.load([g, col0 // 8])  # [1, BLOCK_N / 8]
        zq = (tl.reshape(tl.broadcast_to(zw[:, :, None], (1, BLOCK_N // 8, 8)), (1, BLOCK_N)) >> z_shift) & 0xF
    else:  # fp32 scales (a 2-byte load per thread is not pipelined: a DRAM round trip per step)
        sc = tl.load(scales_ptr + g * N + cols[None, :])
        zq = (tl.load(qzeros_ptr + g * stride_zg + cols[None, :] // 8) >> z_shift) & 0xF
    return sc, zq


@triton.jit
def _tma_tile_dot(w, sc, zq, xq_ptr, xs_ptr, r0, rows, ones, ASM: tl.constexpr):
    """One K tile's contribution to the [R, BLOCK_N] fp32 accumulator: sum (q - z) v per row and column
    (integers), times the group's scale and x's tile scale."""
    R: tl.constexpr = 16
    xw = xq_ptr + (r0 + rows) * 4
    xa = tl.load(xw)[:, None]
    xb = tl.load(xw + 1)[:, None]
    xc = tl.load(xw + 2)[:, None]
    xd = tl.load(xw + 3)[:, None]
    sx = tl.load(xs_ptr + r0 // R)  # the tile's group (group size 128) is its x scale's too
    row_v = _word_dot(ones, xa, xb, xc, xd, tl.zeros((R, 1), tl.int32), ASM)  # [R, 1]
    d = _word_dot(w, xa, xb, xc, xd, -zq * row_v, ASM)
    return d.to(tl.float32) * (sc * sx)


@triton.jit
def _w4_gemv_tma_kernel(w_desc, z_desc, s_desc, xq_ptr, xs_ptr, out_ptr, ws_ptr, cnt_ptr, N, K, qzeros_ptr, scales_ptr,
                        stride_zg,
                        BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, STAGES: tl.constexpr,
                        ASM: tl.constexpr, PDL: tl.constexpr = False, GROUP_TMA: tl.constexpr = False):
    R: tl.constexpr = 16  # TMA_ROWS
    pid_n = tl.program_id(0)
    K8 = K // 8
    r_len = tl.cdiv(K8, SPLIT_K * R) * R
    r_begin = tl.program_id(1) * r_len
    r_end = tl.minimum(r_begin + r_len, K8)
    col0 = pid_n * BLOCK_N
    cols = col0 + tl.arange(0, BLOCK_N)
    z_shift = ((tl.arange(0, BLOCK_N) % 8) * 4)[None, :]
    rows = tl.arange(0, R)
    ones = tl.full((R, 1), 0x11111111, tl.int32)  # a word of 8 codes 1: _word_dot then sums a row's 8 v
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    # the first tile's weights, scales and zeros before the dependency wait (they never depend on the
    # previous kernel): in the step every call follows a short norm or silu kernel, and without this
    # the first DRAM round trip came after it (run 121: the step 2.504 -> 2.666 ms with this kernel in,
    # while it won the back-to-back A/B; with this, run 122: 2.612, still slower); the pipelined loop
    # takes the second tile on
    w_first = w_desc.load([r_begin, col0])
    sc_first, zq_first = _tma_group(z_desc, s_desc, qzeros_ptr, scales_ptr, tl.minimum(r_begin, K8 - R) // R, col0,
                                    cols, z_shift, N, stride_zg, BLOCK_N, GROUP_TMA)
    if PDL:
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros((R, BLOCK_N), dtype=tl.float32)
    if r_begin < r_end:  # an empty split (r_begin past K / 8) adds nothing
        acc += _tma_tile_dot(w_first, sc_first, zq_first, xq_ptr, xs_ptr, r_begin, rows, ones, ASM)
    for r0 in tl.range(r_begin + R, r_end, R, num_stages=STAGES):
        w = w_desc.load([r0, col0])  # [R, BLOCK_N] int32, through the TMA pipeline
        sc, zq = _tma_group(z_desc, s_desc, qzeros_ptr, scales_ptr, r0 // R, col0, cols, z_shift, N, stride_zg,
                            BLOCK_N, GROUP_TMA)
        acc += _tma_tile_dot(w, sc, zq, xq_ptr, xs_ptr, r0, rows, ones, ASM)
    y = tl.sum(acc, axis=0)
    _store_output(y[None, :], tl.arange(0, 1), cols, 1, N, out_ptr, N, ws_ptr, cnt_ptr, pid_n, SPLIT_K)


_F32_SCALES: dict = {}


def _fp32_scales(scales: torch.Tensor) -> torch.Tensor:
    """An fp32 copy of a weight's group scales, made once per tensor (the probe's cache; the engine would
    keep it with the weights). The entry holds the source tensor too, so its address cannot be freed and
    handed to another tensor while the key is in use."""
    key = (scales.data_ptr(), tuple(scales.shape), str(scales.device))
    if key not in _F32_SCALES:
        _F32_SCALES[key] = (scales, scales.float().contiguous())
    return _F32_SCALES[key][1]


def w4_tma_usable(w: QuantizedLinearWeights, block_n: int) -> bool:
    """Whether the TMA GEMV takes these weights with column tile block_n: dp2a-usable, group size
    128 (one group per K tile), whole tiles (N a multiple of block_n, K of 128)."""
    return (w4_dp2a_usable(w) and w.group_size == X_TILE and w.out_features % block_n == 0
            and w.in_features % X_TILE == 0 and w.out_features % 32 == 0 and block_n >= 32
            and all(t.is_contiguous() for t in (w.qweight, w.qzeros, w.scales)))  # TMA: 16-byte rows


def w4a16_gemv_tma(xq: torch.Tensor, xs: torch.Tensor, w: QuantizedLinearWeights, *,
                   config: tuple = W4_TMA_CONFIGS[0], split_k: int | None = None,
                   out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """One row of x rounded by its producer (round_x_int16's layout: xq int32 [1, K / 2], xs fp32
    [1, K / 128]) @ int4 weights (GPTQ layout, group size 128) -> [1, N] of out_dtype."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    block_n, warps, stages, group_tma = config
    if group_tma and block_n < GROUP_TMA_MIN_N:
        raise ValueError(f"w4a16_gemv_tma: scales and zeros through TMA need a column tile of at least "
                         f"{GROUP_TMA_MIN_N} (narrower zero-word boxes faulted on the H200), got {config}")
    K, N = w.in_features, w.out_features
    if xq.shape != (1, K // 2) or xq.dtype != torch.int32 or xs.shape != (1, K // X_TILE) or xs.dtype != torch.float32:
        raise ValueError(f"w4a16_gemv_tma takes xq int32 [1, {K // 2}] and xs fp32 [1, {K // X_TILE}], got "
                         f"{tuple(xq.shape)} {xq.dtype} and {tuple(xs.shape)} {xs.dtype}")
    if not (xq.is_contiguous() and xs.is_contiguous()):
        raise ValueError("w4a16_gemv_tma takes contiguous xq and xs")
    if not w4_tma_usable(w, block_n):
        raise ValueError(f"w4a16_gemv_tma cannot take these weights with column tile {block_n}")
    tiles = N // block_n
    split = split_k or _default_split_k(tiles, K, xq.device)
    out = torch.empty(1, N, dtype=out_dtype, device=xq.device)
    ws, cnt = _workspace(xq.device, split * N if split > 1 else 0, tiles)
    descs = (TensorDescriptor.from_tensor(w.qweight, [TMA_ROWS, block_n]),
             TensorDescriptor.from_tensor(w.qzeros, [1, block_n // 8]),
             TensorDescriptor.from_tensor(w.scales, [1, block_n]))
    launch_kernel(_w4_gemv_tma_kernel, (tiles, split),
        *descs, xq, xs, out, ws, cnt, N, K, w.qzeros, w.scales if group_tma else _fp32_scales(w.scales),
        w.qzeros.stride(0), GROUP_TMA=group_tma,
        BLOCK_N=block_n, SPLIT_K=split, STAGES=stages, ASM=not _INTERPRET, num_warps=warps,
        **pdl_launch_kwargs(xq.device))
    return out
