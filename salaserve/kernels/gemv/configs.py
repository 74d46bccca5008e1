"""The GEMV's launch configurations: GemvConfig, the candidate lists per M bucket (each checked by an
sm_90 ahead-of-time compile in tests/test_kernels_gemv.py), the M limits, the uncalibrated default
and the automatic split-K.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from salaserve.kernels.tuning import m_bucket


GEMV_MAX_M = 16  # largest M of the fused prologues (each program recomputes its rows' statistics)
# largest M of the plain GEMV / residual epilogue (tensor-core path, BLOCK_M <= 128, a power of two);
# the calibration decides per shape against cuBLAS (the GEMV won at 32 rows, cuBLAS at 128)
DOT_MAX_M = 128


@dataclass(frozen=True)
class GemvConfig:
    """One launch configuration. split_k 0: chosen from the grid size (`auto_split`)."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 0
    dot: bool = False
    stream: bool = False  # fp8 weights only: FMAs behind a num_stages-deep cp.async pipeline (_fp8_stream_sums)

    def __str__(self):
        kind = "dot" if self.dot else "stream" if self.stream else "fma"
        s = f"{kind} n{self.block_n} k{self.block_k} w{self.num_warps} s{self.num_stages}"
        return s + (f" split{self.split_k}" if self.split_k else "")


# Candidate configs, each checked by an sm_90 ahead-of-time compile (no spills, 16-byte W loads,
# no shared-memory layout conversion in the FMA loop; tests/test_kernels_gemv.py). FMA tiles use
# BLOCK_K = 256 * num_warps: every thread holds exactly one 16-byte vector per W row, and x's
# [.., BLOCK_K] slice then gets the same thread mapping (8 values per thread), so x needs no
# reshuffle through shared memory; per thread: BLOCK_N vectors of W (x2, prefetch) and
# BLOCK_M * BLOCK_N * 8 fp32 accumulators.
FMA_CONFIGS = {  # M bucket -> configs; sm_90 registers per thread in the comments
    1: (GemvConfig(4, 1024, 4), GemvConfig(2, 1024, 4), GemvConfig(4, 2048, 8)),  # 64, 40, 80
    2: (GemvConfig(2, 1024, 4),),  # 64
    4: (GemvConfig(1, 1024, 4), GemvConfig(2, 1024, 4)),  # 56, 96
    8: (GemvConfig(1, 1024, 4),),  # 102
}
FMA_MAX_M = 8  # above, the register accumulators get too many: tensor cores only
# fp8 weights (gemv_fp8, `_fp8_sums`): 16 weights per 16-byte vector, BLOCK_K = 512 * num_warps *
# vectors per thread and row; an even BLOCK_N walks its columns in pairs (x shared by two rows).
# Loop SASS at one row (sm_90): ~100 instructions per 16 weights of one row, ~170 per pair of rows,
# plus a cross-warp sum at each column's end; 31-80 registers.
FP8_FMA_CONFIGS = {
    # (2, 4096, 4) and (4, 4096, 8) spill
    1: (GemvConfig(1, 2048, 4), GemvConfig(2, 2048, 4), GemvConfig(4, 2048, 4), GemvConfig(2, 4096, 8)),
    2: (GemvConfig(1, 2048, 4), GemvConfig(2, 2048, 4)),
    4: (GemvConfig(1, 2048, 4), GemvConfig(2, 2048, 4)),
    8: (GemvConfig(1, 2048, 4),),
}
# fp8 weights behind a cp.async pipeline (`_fp8_stream_sums`): a program's BN rows x BK codes per
# loop step, num_stages deep in shared memory (BN * BK + 2 * BM * BK bytes per stage). Loop SASS
# at one row: 2.5 instructions per weight for the math (one cvt per code pair, an f16 -> f32 and
# an FFMA per weight) plus the loads and x's shifts, 3.6 in all at (16, 512) and 4.3 at (8, 512).
# Explicit splits: a split shortens every program's pipelined loop, and each program pays the
# pipeline's fill and drain; at one row split 1 was the fastest at every shape but down, where 2
# came close. At 8 rows the FFMAs per weight make it 1.1 TB/s (w8a16: 2-3.6): none there.
FP8_STREAM_CONFIGS = {
    1: (GemvConfig(8, 512, 4, 4, split_k=1, stream=True),  # 56 registers, 15 KB shared memory
        GemvConfig(16, 512, 4, 6, split_k=1, stream=True),  # 64, 45 KB
        GemvConfig(32, 512, 8, 4, split_k=1, stream=True),  # 78, 51 KB
        GemvConfig(8, 1024, 4, 4, split_k=1, stream=True),  # 72, 30 KB
        GemvConfig(8, 512, 4, 4, split_k=2, stream=True)),
    2: (GemvConfig(8, 512, 4, 4, split_k=1, stream=True),),  # 80 (split 2 spills 8 bytes here)
}
DOT_CONFIGS = (  # any M <= 16 (padded to 16); W pipelined through shared memory by cp.async
    GemvConfig(64, 128, 4, 4, dot=True),  # 48 registers, 80 KB shared memory
    GemvConfig(64, 256, 4, 3, dot=True),  # 80, 120 KB
    GemvConfig(128, 128, 4, 3, dot=True),  # 90, 108 KB
)
# M buckets 32..128 (BLOCK_M = the bucket): explicit splits (1, 2, 4), since the automatic one
# (8 programs per SM) would write split * M * N * 4 bytes of partials; W and x both pipelined
# (shared memory (BN + BM) * BK * 2 bytes per stage, <= 227 KB per block on sm_90). At N = 4096,
# BN 128 split 4 and BN 64 split 2 give 128 programs, BN 64 split 4 256 (two blocks fit per SM);
# split 1 for the wide N. sm_90 registers per thread (plain GEMV, its split; the residual
# epilogue and PDL add up to ~50, 218 at most) and shared memory in the comments. Rejected at
# M = 128: (128, 64, 4, 4) and (128, 128, 4, 3) spill with split 4, (64, 256, 4, 3) needs 288 KB.
DOT_LARGE_M_CONFIGS = {
    32: (GemvConfig(128, 128, 8, 3, split_k=1, dot=True),  # 56, 120 KB
         GemvConfig(128, 128, 8, 3, split_k=4, dot=True),  # 77
         GemvConfig(64, 128, 4, 4, split_k=1, dot=True),  # 64, 96 KB
         GemvConfig(64, 128, 4, 4, split_k=2, dot=True),  # 64
         GemvConfig(64, 128, 4, 4, split_k=4, dot=True)),  # 80
    64: (GemvConfig(128, 128, 8, 3, split_k=1, dot=True),  # 96, 144 KB
         GemvConfig(128, 128, 8, 3, split_k=4, dot=True),  # 119
         GemvConfig(64, 128, 4, 4, split_k=1, dot=True),  # 94, 128 KB
         GemvConfig(64, 128, 4, 4, split_k=2, dot=True),  # 126
         GemvConfig(64, 64, 4, 4, split_k=4, dot=True)),  # 119, 64 KB
    128: (GemvConfig(128, 64, 8, 4, split_k=1, dot=True),  # 109, 128 KB
          GemvConfig(128, 64, 8, 4, split_k=4, dot=True),  # 166
          GemvConfig(64, 64, 4, 4, split_k=1, dot=True),  # 122, 96 KB
          GemvConfig(64, 64, 4, 4, split_k=2, dot=True),  # 168
          GemvConfig(64, 64, 4, 4, split_k=4, dot=True)),  # 170
}

# the grid aims at this many programs per SM (several waves of loads in flight per SM)...
PROGRAMS_PER_SM = 8
# ...but no split shorter than this many K elements (each split's partials cost M*BN*4 bytes)
MIN_SPLIT_LEN = 512


@functools.lru_cache(maxsize=None)
def _device_info(device: str) -> tuple[int, int]:
    """(SM count, compute capability major); off-GPU (interpreter runs): an H200's."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_properties(dev).multi_processor_count, torch.cuda.get_device_capability(dev)[0]
    return 132, 9


def sm_count(device: torch.device) -> int:
    return _device_info(str(device))[0]


def auto_split(N: int, K: int, cfg: GemvConfig, device: torch.device) -> int:
    """Power-of-two split of K giving ~PROGRAMS_PER_SM programs per SM, splits >= MIN_SPLIT_LEN
    long and whole BLOCK_K tiles."""
    tiles = triton.cdiv(N, cfg.block_n)
    want = max(1, PROGRAMS_PER_SM * sm_count(device) // tiles)
    split = 1
    while split * 2 <= want and K // (split * 2) >= max(MIN_SPLIT_LEN, cfg.block_k):
        split *= 2
    return split


def default_config(M: int, N: int, K: int) -> GemvConfig:
    """Uncalibrated choice: FMA at M = 1, tensor cores above (M > 16: the bucket's first config)."""
    if M <= 1:
        return FMA_CONFIGS[1][0]
    return DOT_CONFIGS[0] if M <= GEMV_MAX_M else DOT_LARGE_M_CONFIGS[m_bucket(M)][0]


def candidate_configs(M: int) -> tuple[GemvConfig, ...]:
    """Configs `calibrate` times for an M bucket (each one Triton compile per shape)."""
    b = m_bucket(M)
    if b == 1:
        return FMA_CONFIGS[1] + DOT_CONFIGS[:1]
    if b > GEMV_MAX_M:
        return DOT_LARGE_M_CONFIGS[b]
    return FMA_CONFIGS.get(b, ()) + (DOT_CONFIGS if b > 8 else DOT_CONFIGS[:2])


def split_useful(cfg: GemvConfig, N: int, device: torch.device) -> bool:
    """Whether a config's explicit split-K can pay off at this N: not when half of it would
    already give every SM a program (the split only adds partials then). Calibration skips the
    others (fewer compiles, a smaller workspace)."""
    return cfg.split_k <= 1 or triton.cdiv(N, cfg.block_n) * (cfg.split_k // 2) < sm_count(device)
