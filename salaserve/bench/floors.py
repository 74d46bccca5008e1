"""Hardware floors: the fewest bytes and FLOPs a step must move or compute, over measured rates.

Every benchmark reports achieved/floor. The two ceilings are measured in the same run
(`measure_ceilings`): device-to-device copy bandwidth (bytes read + written) and a large bf16
matmul rate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from salaserve.cache.compressed import num_entries
from salaserve.config import ModelConfig


@dataclass
class Ceilings:
    copy_gbps: float  # GB/s, read + write
    matmul_tflops: float  # bf16


def measure_ceilings(device="cuda") -> Ceilings:
    from triton.testing import do_bench

    n = 1 << 30  # 1 GiB copy, far beyond L2
    src = torch.empty(n, dtype=torch.uint8, device=device)
    src.random_(0, 255)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    copy = 2 * n / (ms * 1e-3) / 1e9
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    tflops = 2 * 8192**3 / (ms * 1e-3) / 1e12
    del src, dst, a, b
    torch.cuda.empty_cache()
    return Ceilings(copy_gbps=copy, matmul_tflops=tflops)


def linear_params(cfg: ModelConfig, include_lm_head: bool = True) -> int:
    """Parameters read by the linear layers of one forward (no embedding gather)."""
    n = cfg.num_parameters() - cfg.vocab_size * cfg.hidden_size  # drop the embedding table
    n -= cfg.hidden_size * (2 * cfg.num_hidden_layers + 1)  # norms are not GEMM weights
    if not include_lm_head:
        n -= cfg.vocab_size * cfg.hidden_size
    return n


def decode_bytes(cfg: ModelConfig, batch: int, context: int, weight_bytes_per_param: float = 2.0,
                 kv_bytes: int = 2, state_bytes: int = 4, lm_head_bytes_per_param: float = 2.0) -> float:
    """Bytes one decode step must move: weights once, Lightning states read + written, the K/V the
    sparse layers attend to (all of it while dense, the selected blocks after) and, in the sparse
    regime, the compressed keys scored by stage 1."""
    sc = cfg.sparse
    # the lm_head stays bf16 unless it is quantized explicitly
    weights = (linear_params(cfg, include_lm_head=False) * weight_bytes_per_param
               + cfg.vocab_size * cfg.hidden_size * lm_head_bytes_per_param)
    states = 2 * batch * len(cfg.lightning_layers) * cfg.lightning_nh * cfg.lightning_head_dim ** 2 * state_bytes
    per_token_kv = 2 * cfg.num_key_value_heads * cfg.head_dim * kv_bytes * len(cfg.sparse_layers)
    if context < sc.dense_len:
        attended = context
        compressed = 0
    else:
        attended = min(context, sc.topk_eff * sc.block_size)
        n1 = num_entries(context, sc.kernel_size, sc.kernel_stride)
        n2 = num_entries(context, sc.c2_kernel_size, sc.c2_kernel_stride)
        compressed = (n1 + n2) * cfg.num_key_value_heads * cfg.head_dim * kv_bytes * len(cfg.sparse_layers)
    return weights + states + batch * (attended * per_token_kv + compressed)


def prefill_flops(cfg: ModelConfig, tokens: int, chunk: int = 8192) -> float:
    """FLOPs of a single-sequence prefill: the linear layers (2 per parameter per token) plus the
    sparse layers' attention (dense below dense_len, ~topk_eff blocks per query beyond, plus the
    stage-1 scoring of compressed keys). Lightning GLA is O(T) and small; it is left out."""
    sc = cfg.sparse
    flops = 2.0 * linear_params(cfg, include_lm_head=False) * tokens
    hq, d, n_sparse = cfg.num_attention_heads, cfg.head_dim, len(cfg.sparse_layers)
    attn = 0.0
    stage1 = 0.0
    for p in range(0, tokens, 256):  # integrate per 256 tokens: exact enough for a floor
        n = min(256, tokens - p)
        visible = min(p + 1, sc.topk_eff * sc.block_size) if tokens >= sc.dense_len else p + 1
        attn += n * 4 * hq * d * visible
        if tokens >= sc.dense_len:
            n1 = num_entries(p + 1, sc.kernel_size, sc.kernel_stride)
            stage1 += n * 2 * hq * d * (n1 + n1 / 4)
    return flops + n_sparse * (attn + stage1)
