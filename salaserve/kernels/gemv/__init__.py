"""Weight-streaming GEMV for decode: y = x @ W^T at decode M (1..128), W [N, K] bf16 read once.

    gemv(x, w)                                  x [M, K] -> [M, N]
    gemv_residual(x, w, residual, scale)        residual + y * scale       (TorchBackend.add_rms_norm's add)
    gemv_rmsnorm(x, norm_w, eps, w)             rms_norm(x, norm_w, eps) @ W^T
    gemv_silu_mul(gate_up, w, residual=, scale=)  silu_mul(gate_up) @ W^T [then the residual epilogue]
    gemv_silu_out(x, w_gate_up)                 silu_mul(x @ W^T) (the silu_mul epilogue)
    linear(x, w)                                GEMV or cuBLAS, whichever `calibrate` measured faster
    calibrate(shapes, device)                   times both per (M bucket, N, K) inside CUDA graphs

Why not cuBLAS: at M <= 16 a linear layer is a pure weight stream (2*N*K bytes, ~1 FLOP/byte).
The whole decode step is 18.35 GB of bf16 weights, 4.30 ms at 4.27 TB/s; cuBLAS M=1 GEMMs take
4.99 ms in a graph, mostly lost on the 4096x4096 matrices (launch and tail bound) and in the gaps.

Batch 17..128 (`DOT_MAX_M`; tensor-core path only, plain GEMV and residual epilogue, the prologues
stop at GEMV_MAX_M = 16): still weight-bound (M FLOPs per weight byte, 128 against the H200's ~230
at the balance point), but cuBLAS tiles these as GEMMs: at M = 128 and N = 4096 it launches ~32
output tiles on 132 SMs (o_proj 15 us against a 7.9 us floor, down 39.6 us plus a separate split-K
reduce against 31.8). Here the DOT program takes BLOCK_M = M's power-of-two bucket (32, 64, 128)
and a small explicit split-K per config (1, 2, 4; the automatic split aims at 8 programs per SM,
far too many partials at 128 rows: they cost split * M * N * 4 bytes, 25% of W's bytes at M = 128,
K = 4096, split 4), reduced in the same launch (kernel.py). `calibrate` decides per (M bucket, N, K)
whether it beats cuBLAS; uncalibrated shapes above M = 8 stay on cuBLAS.

Modules, one role each: kernel.py (the Triton kernel: inner paths, fusions, split-K, PDL, numerics),
fp8_sums.py (its fp8-weight inner loops), configs.py (launch configurations and candidate lists),
launch.py (the entry points above and their workspace), dispatch.py (the calibration's picks and
what they decide), tuning.py (the start-up calibration, kernels/tuning.py's recipe).
"""

from salaserve.kernels.gemv.configs import (DOT_CONFIGS, DOT_LARGE_M_CONFIGS, DOT_MAX_M, FMA_CONFIGS, FMA_MAX_M,
                                            FP8_FMA_CONFIGS, FP8_STREAM_CONFIGS, GEMV_MAX_M, GemvConfig, auto_split,
                                            candidate_configs, default_config, sm_count, split_useful)
from salaserve.kernels.gemv.dispatch import PICKS, Choice, calibrated_choice, choose_config, clear_calibration, uses_gemv
from salaserve.kernels.gemv.launch import (gemv, gemv_fp8, gemv_residual, gemv_rmsnorm, gemv_silu_mul, gemv_silu_out,
                                           linear)
from salaserve.kernels.gemv.tuning import GemvTuning, calibrate, model_linear_shapes, time_linear, weight_copies

__all__ = [
    # launch
    "gemv", "gemv_fp8", "gemv_residual", "gemv_rmsnorm", "gemv_silu_mul", "gemv_silu_out", "linear",
    # configs
    "GemvConfig", "FMA_CONFIGS", "FP8_FMA_CONFIGS", "FP8_STREAM_CONFIGS", "DOT_CONFIGS", "DOT_LARGE_M_CONFIGS",
    "GEMV_MAX_M", "DOT_MAX_M", "FMA_MAX_M", "candidate_configs", "default_config", "auto_split", "split_useful",
    "sm_count",
    # dispatch and tuning
    "Choice", "PICKS", "calibrated_choice", "choose_config", "uses_gemv", "clear_calibration", "GemvTuning",
    "calibrate", "model_linear_shapes", "time_linear", "weight_copies",
]
