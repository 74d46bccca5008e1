"""The bf16 GEMV's start-up tuning (kernels/tuning.py's recipe): per (M bucket, N, K) of the plain
weights, cuBLAS against the GEMV candidates, in CUDA graphs over L2-busting weight copies; and the
benchmarks' measure of one linear (`time_linear`).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch

from salaserve.kernels.gemv.configs import DOT_MAX_M, GemvConfig, auto_split, candidate_configs, split_useful
from salaserve.kernels.gemv.dispatch import PICKS, Choice
from salaserve.kernels.gemv.launch import gemv
from salaserve.kernels.timing import graph_time_us, l2_busting_count
from salaserve.kernels.tuning import Family, Stopwatch, Trial, tune


def weight_copies(N: int, K: int, dtype, device, seed: int = 0) -> list[torch.Tensor]:
    """Enough distinct random [N, K] matrices that cycling through them never hits in L2."""
    n = l2_busting_count(N * K * torch.tensor([], dtype=dtype).element_size(), least=1, most=64)
    g = torch.Generator(device=device).manual_seed(seed)
    return [(torch.randn(N, K, device=device, generator=g) * K ** -0.5).to(dtype) for _ in range(n)]


def time_linear(fn_name: str, M: int, N: int, K: int, device, config: GemvConfig | None = None,
                pdl: bool | None = None, weights=None, calls: int | None = None) -> float:
    """us per call of cuBLAS ('cublas') or the GEMV ('gemv') at this shape, in a CUDA graph of
    back-to-back calls cycling through L2-busting weight copies (the benchmarks' measure; the
    calibration times the same calls through its Stopwatch)."""
    ws = weights if weights is not None else weight_copies(N, K, torch.bfloat16, device)
    x = torch.randn(M, K, device=device).to(ws[0].dtype)
    out = torch.empty(M, N, device=device, dtype=ws[0].dtype)
    n = calls or max(8, len(ws))
    if fn_name == "cublas":
        def fn(i):
            torch.mm(x, ws[i % len(ws)].t(), out=out)
    else:
        def fn(i):
            gemv(x, ws[i % len(ws)], out=out, config=config, pdl=pdl)
    return graph_time_us(fn, n)


class GemvTuning(Family):
    """The bf16 GEMV against cuBLAS, per (M bucket, N, K) of the plain weights (items: (N, K)): the
    fastest GEMV config is kept either way (the fused ops need one), and `linear` takes the GEMV
    where it beat cuBLAS (Choice.use_gemv). configs: a list for every M, or a callable M -> list;
    default `candidate_configs` less the explicit splits that cannot pay off at N (`split_useful`).
    Buckets above DOT_MAX_M are never the GEMV: not timed."""

    table = PICKS

    def __init__(self, configs=None):
        self.configs = configs

    def shape(self, item) -> tuple:
        return (int(item[0]), int(item[1]))

    def wants(self, item, m: int, device) -> bool:
        return m <= DOT_MAX_M

    def candidates(self, m: int, N: int, K: int, device) -> list[GemvConfig]:
        """The configs timed at bucket m and shape (N, K), each with the split it runs at."""
        if callable(self.configs) or self.configs:
            cands = self.configs(m) if callable(self.configs) else self.configs
        else:
            cands = [c for c in candidate_configs(m) if split_useful(c, N, device)]
        return [c if c.split_k else replace(c, split_k=auto_split(N, K, c, device)) for c in cands]

    def launches(self, item, m: int, device):
        N, K = item
        w = torch.empty(N, K, device=device, dtype=torch.bfloat16)  # launches compile, never run
        x = torch.empty(m, K, device=device, dtype=torch.bfloat16)
        out = torch.empty(m, N, device=device, dtype=torch.bfloat16)
        return [functools.partial(gemv, x, w, out, config=cfg) for cfg in self.candidates(m, N, K, device)]

    def operands(self, item, device):
        return weight_copies(*item, torch.bfloat16, device)

    def tune_bucket(self, item, m: int, ws, device, stopwatch: Stopwatch) -> None:
        N, K = item
        calls = max(8, len(ws))
        x = torch.randn(m, K, device=device).to(torch.bfloat16)
        out = torch.empty(m, N, device=device, dtype=torch.bfloat16)
        t_cublas = stopwatch.time(lambda i: torch.mm(x, ws[i % len(ws)].t(), out=out), calls)
        trials = [Trial(cfg, functools.partial(_gemv_call, x, ws, out, cfg), str(cfg))
                  for cfg in self.candidates(m, N, K, device)]
        best, us = stopwatch.fastest(trials, calls, f"M={m} N={N} K={K}", f" (cuBLAS {t_cublas:.1f})")
        PICKS.put(device, m, (N, K), Choice(best.pick, us, t_cublas))


def _gemv_call(x, ws, out, cfg, i):
    gemv(x, ws[i % len(ws)], out=out, config=cfg)


def calibrate(shapes, device, m_values=(1, 2, 4, 8), *, configs=None, verbose: bool = False,
              parallel_compile: bool = True, stopwatch: Stopwatch | None = None) -> dict:
    """Time cuBLAS and the GEMV candidates once per (M bucket, N, K) (kernels/tuning.py's recipe:
    each a CUDA graph of >= 8 back-to-back calls over L2-busting weight copies, median of 5 replays)
    and record the results for `linear` / `choose_config`. shapes: iterable of (N, K) (bf16
    weights); M is timed at its bucket (3 -> 4); configs: see GemvTuning. Returns {(bucket, N, K):
    Choice}. Cost: a few ms per candidate plus one Triton compile each (cached on disk across runs);
    already calibrated keys are skipped."""
    return tune(GemvTuning(configs), [(int(n), int(k)) for n, k in shapes], device, m_values,
                parallel_compile=parallel_compile, verbose=verbose, stopwatch=stopwatch)


def model_linear_shapes(cfg) -> list[tuple[str, int, int, int]]:
    """(name, N, K, uses per decode step) of a ModelConfig's linear layers (fused projections as
    the model holds them). `calibrate` wants the distinct (N, K) of these."""
    h, f = cfg.hidden_size, cfg.intermediate_size
    n_sparse = len(cfg.sparse_layers)
    n_light = cfg.num_hidden_layers - n_sparse
    shapes = [
        ("qkvg", 2 * cfg.q_size + 2 * cfg.kv_size, h, n_sparse),
        ("qkvz", 4 * cfg.lightning_size, h, n_light),
        ("o_proj", h, cfg.q_size, n_sparse),
        ("o_proj_l", h, cfg.lightning_size, n_light),
        ("gate_up", 2 * f, h, cfg.num_hidden_layers),
        ("down", h, f, cfg.num_hidden_layers),
        ("lm_head", cfg.vocab_size, h, 1),
    ]
    return [s for s in shapes if s[3] > 0]
