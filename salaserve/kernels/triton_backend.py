"""The `triton` kernel backend: fused GPU kernels behind TorchBackend's interface.

Decode and verify batches captured in CUDA graphs (batch.decode_mode set) only touch device
tensors; eager steps may use the batch's host mirrors.

Speculative verify: Lightning layers run `lightning_verify` (outputs from the live state, k/v kept
for `commit_verified`); sparse layers treat every verify token as a decode query of its own at its
position (its own length, the sequence's page table), so block selection and the dense/sparse
switch happen per token exactly as plain decoding would. Prefill chunks sharing the step take the
prefill kernels.

Draft trees (eager steps): Lightning layers take lightning_verify's tree form (each row's depth and
ancestors) and the commit replays the accepted path's rows; sparse layers read each tree row
through its own page table whose pages past the root are private copies holding its path
(kernels/tree_pages.py). Where that cannot run (a tree over CHUNK_MAX_TOKENS rows, fp8 pages, no
scratch pages) the step falls back to the torch ground truth (kernels/tree_verify.py).

Note for comparisons: with random full-size weights, 32 bf16 layers amplify any rounding
difference (another split count, another GEMM tile for a padded M) to ~2% of the logits, so
only identical kernel choices give identical results.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from types import SimpleNamespace

import torch

from salaserve.kernels._triton_utils import promote
from salaserve.kernels import attention as attn
from salaserve.kernels import gemv as gemv_ops
from salaserve.kernels import sparse as sparse_ops
from salaserve.kernels import tree_pages, tree_verify
from salaserve.kernels.fused import TritonFusedOps, add_rms_norm, silu_mul
from salaserve.kernels.lightning import TritonLightningOps
from salaserve.kernels.lightning_verify import CHUNK_MAX_TOKENS, lightning_commit, lightning_verify, tree_rows_meta
from salaserve.kernels.options import INTERPRET, KernelOptions
from salaserve.kernels.torch_ops import TorchBackend
from salaserve.kernels.tuning import m_bucket
from salaserve.quant.formats import QuantizedLinearWeights
from salaserve.quant.formats.fp8 import FP8
from salaserve.quant.fuse import linear_weights

log = logging.getLogger(__name__)


# One-row steps apply the MLP's silu_mul in the gate_up GEMV's epilogue (gemv.gemv_silu_out; for fp8
# weights gemv_fp8(silu_out=True), for int4 ones the dp2a GEMV's silu_out) instead of a silu_mul kernel
# before down: 32 fewer kernels per step (bf16 4K step -54 us; w4a16 2.41 -> 2.35 ms). 2-16 rows keep
# the silu_mul prologue on the down GEMV, which costs no kernel either (the epilogue there, with the
# RMSNorm prologue on gate_up, measured 1% slower at batch 8).


def _has_verify(batch) -> bool:
    return bool(batch.verify_host) and any(batch.verify_host)


def _long_tree_step(batch) -> bool:
    """A tree step with a sequence over the chunk form's CHUNK_MAX_TOKENS rows (the only form
    lightning_verify takes trees in): its Lightning layers run the torch ground truth."""
    return any(n > CHUNK_MAX_TOKENS for n, v in zip(batch.q_lens_host, batch.verify_host) if v)


def _plain_shapes(cfg, params) -> list[tuple[int, int]]:
    """(N, K) of the linears the bf16 GEMV / cuBLAS calibration serves: the model's plain (tensor)
    weights, e.g. only lm_head in a quantized model (quantized linears never take the bf16 GEMV);
    every linear shape of cfg without params."""
    if params is None:
        return [(n, k) for _, n, k, _ in gemv_ops.model_linear_shapes(cfg)]
    return list(dict.fromkeys((int(w.shape[0]), int(w.shape[1])) for w in linear_weights(params)
                              if isinstance(w, torch.Tensor)))


def _split_verify_step(batch) -> tuple[list[int], list[int]]:
    """(recurrent, chunks): the sequences of a verify step that verify or decode one token, and
    those that are prefill chunks. Graph batches hold verify sequences only (host mirrors are
    placeholders there)."""
    if batch.decode_mode is not None:
        return list(range(batch.num_seqs)), []
    recurrent, chunks = [], []
    for i, (n, ver) in enumerate(zip(batch.q_lens_host, batch.verify_host)):
        (recurrent if ver or n == 1 else chunks).append(i)
    return recurrent, chunks


class TritonBackend(TritonFusedOps, TritonLightningOps, TorchBackend):
    name = "triton"
    # int4 MLPs with a gate_up the dp2a epilogue cannot take whose down linear may take x rounded by
    # the silu_mul kernel: silu_mul stays before down at one row too (set by prepare_weights)
    _silu_before_down = False
    # verifies draft trees whole (eagerly; tests/tree_interp_cases.py against the torch ground truth)
    supports_tree_verify = True
    # tree steps read each row through private copies of the pages its path rewrites
    # (kernels/tree_pages.py): the runner hands out batch.tree_scratch for the step
    wants_tree_scratch = True

    def __init__(self, options: KernelOptions | None = None):
        self.options = options if options is not None else KernelOptions()

    # ---- linear layers -----------------------------------------------------------------------
    def prepare_weights(self, params, device) -> None:
        """At load, before the cache plan measures free memory: on the GPU, every int4 linear the
        wgmma decode kernel takes gets its repacked copy (quant_gemm.w4_wgmma, 4-16 rows; qweight's
        bytes again, ~1/8 more for the zero/scale words), so that the calibration can offer it.
        options.w4_wgmma False skips the copies: memory for KV pages instead, and the FMA kernel up
        to 4 rows and the tl.dot GEMV above. options.w4a16_prefill "fp8" (on GPUs with fp8 tensor
        cores, sm_89+): every int4 linear also gets an fp8 copy (twice qweight's bytes) that
        prefill-sized inputs meet through w8a8 (formats.fp8_prefill_copy); "bf16": prefill
        dequantizes the int4 weights for a bf16 GEMM."""
        if torch.device(device).type != "cuda":
            return
        if self.options.w4a16_prefill == "fp8" and torch.cuda.get_device_capability(device) >= (8, 9):
            self._attach_fp8_prefill_copies(params)
        from salaserve.kernels import quant_gemm as Q

        self._silu_before_down = self.keeps_silu_before_down(params["layers"])

        if not self.options.w4_wgmma:
            return
        added = 0
        for w in linear_weights(params):
            if not isinstance(w, QuantizedLinearWeights):
                continue
            if w.wgmma is None and any(Q.w4_wgmma_usable(w, c) for c in Q.W4_WGMMA_CONFIGS):
                w.wgmma = Q.repack_w4_for_wgmma(w)
                added += w.wgmma.qweight.nbytes + w.wgmma.zs.nbytes
        if added:
            torch.cuda.empty_cache()  # the repacking's temporaries would count as used memory in the plan
            log.info("int4 weights: repacked copies for the wgmma decode GEMV, %.2f GiB (--no-w4-wgmma "
                     "skips them)", added / 2**30)

    @staticmethod
    def _attach_fp8_prefill_copies(params) -> None:
        from salaserve.quant.formats.fp8 import attach_fp8_prefill_copies

        added = attach_fp8_prefill_copies(linear_weights(params))
        if added:
            torch.cuda.empty_cache()  # the dequantization's temporaries would count as used memory in the plan
            log.info("int4 weights: fp8 copies for inputs past 16 rows (w8a16, w8a8 at prefill sizes), %.2f GiB",
                     added / 2**30)

    @staticmethod
    def keeps_silu_before_down(layers) -> bool:
        """Whether one-row steps keep silu_mul before down (a kernel writing down's x rounded to int16)
        rather than in the gate_up GEMV's epilogue: for int4 MLPs whose down takes rounded x, unless
        every gate_up can take the dp2a GEMV's silu_out."""
        from salaserve.kernels import quant_gemm as Q

        if all(isinstance(layer["gate_up"], QuantizedLinearWeights)
                               and Q.w4_silu_out_usable(layer["gate_up"]) for layer in layers):
            return False
        return any(isinstance(layer["down"], QuantizedLinearWeights) and Q.w4_rounded_usable(layer["down"])
                   for layer in layers)

    def prepare(self, cfg, device, params=None, max_rows: int = gemv_ops.DOT_MAX_M,
                max_context: int | None = None) -> None:
        """Start-up: time cuBLAS against the split-K GEMV for the model's shapes at decode batch
        sizes and verify row counts (M buckets 1..128; above 16 the tensor-core GEMV only), so
        `linear` takes the faster one (seconds, plus Triton compiles cached on disk; before graph
        capture); int4 weights (in `params`, the model's fused weights): the decode
        kernels' configs and splits among themselves; fp8 weights: the fp8 FMA GEMV's configs
        against w8a16. max_rows: the most rows a
        decode or verify step can have (buckets above it are not timed). The picks are kept on disk
        (kernels/plan_cache.py, options.plan_cache_dir): a restart on the same GPU and code times only
        shapes it has not seen, and compiles only the picked kernels. max_context: the longest
        sequence served; the prefill top-k's kernels for every length up to it are built now (a
        prompt longer than any warm-up one otherwise compiles one while serving)."""
        from salaserve.kernels import plan_cache, quant_gemm  # noqa: F401 (quant_gemm: its pick tables join the plan)
        from salaserve.kernels.sparse.topk import warm_up_prefill_topk

        plan_cache.load(device, self.options)  # picks of an earlier start-up: only shapes new to the plan get timed
        self._calibrate(cfg, device, params, max_rows)
        plan_cache.save(device, self.options)
        if max_context and cfg.sparse_layers:
            sc = cfg.sparse
            warm_up_prefill_topk(sc, -(-max_context // sc.block_size), cfg.num_key_value_heads, device,
                                 parallel=self.options.parallel_compile)

    def _calibrate(self, cfg, device, params, max_rows: int, stopwatch=None) -> None:
        """Each tuned kernel family over the weights it serves (kernels/tuning.py): the bf16 GEMV
        against cuBLAS for the plain weights (every linear shape of cfg without params) at the
        buckets up to max_rows (at least 16), the int4 decode kernels for w4a16 weights, the fp8 GEMV
        against w8a16 for fp8 weights. stopwatch: the tuner's timer (tests fake one on the CPU)."""
        from salaserve.kernels import quant_gemm

        run = dict(parallel_compile=self.options.parallel_compile, stopwatch=stopwatch)
        top = max(m_bucket(max_rows), 16)
        gemv_ops.calibrate(_plain_shapes(cfg, params), device,
                           m_values=tuple(m for m in (1, 2, 4, 8, 16, 32, 64, 128) if m <= top), **run)
        quantized = [w for w in linear_weights(params or {"lm_head": None, "layers": []})
                     if isinstance(w, QuantizedLinearWeights)]
        if not quantized:
            return
        quant_gemm.calibrate_w4(quantized, device, **run)
        # gate_up at one row runs through the silu_mul junction: timed that way
        silu = {(2 * cfg.intermediate_size, cfg.hidden_size)} if self.silu_after_gate_up(1) else set()
        quant_gemm.calibrate_fp8_gemv(quantized, device, silu_shapes=silu, **run)

    def linear(self, x, weight):
        """Plain weights at decode sizes (M <= gemv.DOT_MAX_M = 128): the GEMV or cuBLAS
        (calibrated); quantized weights: quant_gemm's kernels (through TorchBackend.linear)."""
        if isinstance(weight, torch.Tensor) and x.dim() == 2 and x.shape[0] <= gemv_ops.DOT_MAX_M:
            return gemv_ops.linear(x, weight)
        return TorchBackend.linear(self, x, weight)

    @staticmethod
    def _gemv_fuses(x, w, min_rows: int = 2) -> bool:
        """Whether a norm / residual / silu can ride on this linear's GEMV: a plain weight of x's
        dtype, 2-16 rows (gemv.GEMV_MAX_M: the prologues recompute their rows' statistics in every
        program), and the GEMV calibrated as the faster kernel for the shape. At one row
        the fused GEMVs measured slower (6.12 vs 5.12 ms per decode step: every program of the
        split-K grid recomputes the row's RMSNorm statistics before its first weight load), at
        5-9 rows faster (verify k=4: 5.68 vs 5.77 ms; batch 8: 5.82 vs 5.93 ms). min_rows 1: for
        the silu_mul epilogue, which adds nothing per program."""
        return (isinstance(w, torch.Tensor) and x.dim() == 2 and w.dtype == x.dtype
                and min_rows <= x.shape[0] <= gemv_ops.GEMV_MAX_M
                and gemv_ops.uses_gemv(x.shape[0], w.shape[0], w.shape[1], x.device)
                and (x.is_cuda or INTERPRET))

    def norm_linear(self, x, norm_w, eps, w):
        if self._gemv_fuses(x, w) and norm_w.dtype == x.dtype:
            return gemv_ops.gemv_rmsnorm(x, norm_w, eps, w)
        return TorchBackend.norm_linear(self, x, norm_w, eps, w)

    def silu_after_gate_up(self, rows: int) -> bool:
        return rows == 1 and not self._silu_before_down

    @staticmethod
    def _w4_rounded(rows, w):
        """The calibrated (kernel, config, split) of quant_gemm.w4a16_decode_rounded (x rounded by its
        producer), for bf16 rows [M, K] on the GPU meeting int4 weights w, or None (the producer writes
        bf16 x)."""
        if not (isinstance(w, QuantizedLinearWeights) and rows.dim() == 2 and rows.dtype == torch.bfloat16
                and rows.is_cuda):
            return None
        from salaserve.kernels import quant_gemm

        return quant_gemm.w4_rounded_choice(rows.shape[0], w, rows.device)

    def _silu_epilogue(self, x, w) -> bool:
        """Whether gemv_silu_out can take this gate_up linear: what _gemv_fuses asks, from one row,
        and a config with an even BLOCK_N (gate and up rows pair up in a tile)."""
        return (self._gemv_fuses(x, w, min_rows=1)
                and gemv_ops.choose_config(x.shape[0], *w.shape, x.device).block_n % 2 == 0)

    @staticmethod
    def _fp8_silu_config(x, w):
        """The fp8 GEMV config under which an fp8 [gate | up] weight takes the silu_mul epilogue
        (gemv_fp8(silu_out=True)), or None: the start-up calibration chose the GEMV for this shape
        and row count, with an even BLOCK_N; bf16 x."""
        if not (isinstance(w, QuantizedLinearWeights) and w.format == FP8.name and x.dim() == 2
                and x.dtype == torch.bfloat16 and (x.is_cuda or INTERPRET)):
            return None
        from salaserve.kernels import quant_gemm

        cfg = quant_gemm.fp8_gemv_choice(x.shape[0], w, x.device)
        return cfg if cfg is not None and cfg.block_n % 2 == 0 else None

    def silu_linear(self, x, w):
        """silu_mul(linear(x, w)) with the activation written by the gate_up GEMV itself where it
        can: gemv_silu_out for plain weights, gemv_fp8(silu_out=True) for fp8 ones, the dp2a GEMV's
        silu_out for int4 ones; else the linear and the silu_mul kernel."""
        if self._silu_epilogue(x, w):
            return gemv_ops.gemv_silu_out(x, w)
        if (cfg := self._fp8_silu_config(x, w)) is not None:
            return gemv_ops.gemv_fp8(x, w.weight, w.scale, cfg, silu_out=True)
        if (choice := self._w4_silu_choice(x, w)) is not None:
            from salaserve.kernels import quant_gemm

            return quant_gemm.w4a16_decode(x, w, choice, silu_out=True)
        return TorchBackend.silu_linear(self, x, w)

    @staticmethod
    def _w4_silu_choice(x, w):
        """The calibrated dp2a (kernel, config, split) for bf16 x [1-2, K] on the GPU meeting a [gate | up]
        int4 weight that takes silu_out; else None."""
        if not (isinstance(w, QuantizedLinearWeights) and x.dim() == 2 and x.is_cuda
                and x.dtype == torch.bfloat16):
            return None
        from salaserve.kernels import quant_gemm

        if not (x.shape[0] <= quant_gemm.W4_DP2A_MAX_M and quant_gemm.w4_silu_out_usable(w)):
            return None
        choice = quant_gemm.w4_decode_choice(x, w)
        return choice if choice is not None and choice[0] == "dp2a" else None

    def add_rms_norm_silu_linear(self, h, u, scale, norm_w, eps, w):
        """int4 [gate | up] weights at 1-2 rows whose calibration picked x rounded by its producer: the
        add + RMSNorm kernel writes it, the dp2a GEMV's silu_out epilogue the activation; else
        TorchBackend's (add + RMSNorm, then silu_linear)."""
        if (h.dim() == 2 and isinstance(w, QuantizedLinearWeights)
                and promote(promote(h.dtype, u.dtype), norm_w.dtype) == torch.bfloat16
                and (choice := self._w4_rounded(h, w)) is not None and choice[0] == "dp2a_rounded"):
            from salaserve.kernels import quant_gemm

            if quant_gemm.w4_silu_out_usable(w):
                h, (xq, xs) = add_rms_norm(h, u, scale, norm_w, eps, int16_out=True)
                return h, quant_gemm.w4a16_decode_rounded(xq, xs, w, choice, silu_out=True)
        return TorchBackend.add_rms_norm_silu_linear(self, h, u, scale, norm_w, eps, w)

    @staticmethod
    def _w8a8_prefill(rows, w):
        """The fp8 weights rows [M, K] meet through w8a8 on cuBLAS at prefill sizes on the GPU (fp8
        weights, or int4 weights' fp8 prefill copy), whose per-token activation quantization a
        producer kernel can take over; else None."""
        if not (isinstance(w, QuantizedLinearWeights) and rows.is_cuda):
            return None
        from salaserve.kernels import quant_gemm

        w8 = w.prefill if w.prefill is not None else w
        return w8 if quant_gemm.fp8_scaled_mm_takes(rows.shape[0], w8) else None

    def silu_mul_linear(self, gate_up, w):
        """fp8 weights at prefill sizes (w8a8 on cuBLAS): silu_mul and the per-token quantization
        of down's input in one kernel, never written in bf16; int4 weights at 1-2 rows where the
        calibration picked it: the silu_mul kernel writes down's x rounded to int16 (the dp2a GEMV's
        input); else silu_mul, then the linear."""
        rows = gate_up.reshape(-1, gate_up.shape[-1])
        if (choice := self._w4_rounded(rows, w)) is not None:
            from salaserve.kernels import quant_gemm

            xq, xs = silu_mul(rows, int16_out=True)
            y = quant_gemm.w4a16_decode_rounded(xq, xs, w, choice, out_dtype=rows.dtype)
            return y.view(*gate_up.shape[:-1], w.out_features)
        if (w8 := self._w8a8_prefill(rows, w)) is not None:
            from salaserve.kernels import quant_gemm

            y = quant_gemm.fp8_scaled_mm(rows, w8.weight, w8.scale, silu=True)
            return y.view(*gate_up.shape[:-1], w.out_features)
        return TorchBackend.silu_mul_linear(self, gate_up, w)

    def add_rms_norm_linear(self, h, u, scale, norm_w, eps, w):
        """fp8 weights at prefill sizes (w8a8 on cuBLAS): the add + RMSNorm kernel writes the
        normed rows as their per-token fp8 codes and scales, never in bf16; int4 weights at 1-2 rows
        where the calibration picked it: as the dp2a GEMV's x rounded to int16; else the norm, then
        the linear."""
        if h.dim() == 2 and (w8 := self._w8a8_prefill(h, w)) is not None:
            from salaserve.kernels import quant_gemm

            h, (x8, sx) = add_rms_norm(h, u, scale, norm_w, eps, fp8_out=True)
            return h, quant_gemm.fp8_scaled_mm_quantized(x8, sx, w8.weight, w8.scale, promote(h.dtype, norm_w.dtype))
        if (h.dim() == 2 and promote(promote(h.dtype, u.dtype), norm_w.dtype) == torch.bfloat16
                and (choice := self._w4_rounded(h, w)) is not None):
            from salaserve.kernels import quant_gemm

            h, (xq, xs) = add_rms_norm(h, u, scale, norm_w, eps, int16_out=True)
            return h, quant_gemm.w4a16_decode_rounded(xq, xs, w, choice)
        return TorchBackend.add_rms_norm_linear(self, h, u, scale, norm_w, eps, w)

    def residual_norm_linear(self, h, x, w_out, scale, norm_w, eps, w_in, silu: bool = False,
                             silu_out: bool = False):
        """Decode-sized steps: the residual add in the o_proj / down GEMV's epilogue (silu_mul in
        the down GEMV's prologue), the next RMSNorm in the following GEMV's prologue: 2 kernels
        per junction instead of 3-4. silu_out (one-row steps, silu_after_gate_up): the gate_up
        GEMV writes silu_mul of its output (silu_linear)."""
        # silu_out (one row): nothing rides on o_proj there (_gemv_fuses), gate_up takes silu_linear
        if silu_out or not (self._gemv_fuses(h, w_out) and h.dtype == x.dtype):
            return TorchBackend.residual_norm_linear(self, h, x, w_out, scale, norm_w, eps, w_in, silu, silu_out)
        if silu:
            h = gemv_ops.gemv_silu_mul(x, w_out, residual=h, scale=scale)
        else:
            h = gemv_ops.gemv_residual(x, w_out, h, scale)
        if norm_w is None:
            return h, None
        return h, self.norm_linear(h, norm_w, eps, w_in)

    # ---- lightning layers --------------------------------------------------------------------
    def lightning_attention(self, q, k, v, q_norm, k_norm, batch, states, layer, log_decay, scale, eps, theta):
        if batch.trees and _long_tree_step(batch):  # the chunk kernel's tree form takes <= 16 rows
            # the torch twins throughout (this class's gla is fla's prefill, its norm rounds to bf16)
            q, k = TorchBackend.lightning_qk_norm_rope(self, q, k, q_norm, k_norm, batch.positions, eps, theta)
            return TorchBackend.gla(self, q, k, v, batch, states, layer, log_decay, scale)
        if _has_verify(batch):
            return self._lightning_verify(q, k, v, q_norm, k_norm, batch, states, layer, log_decay, scale, eps, theta)
        if batch.is_decode:
            return self.lightning_decode(q, k, v, q_norm, k_norm, batch, states, layer, log_decay, scale, eps, theta)
        q, k = self.lightning_qk_norm_rope(q, k, q_norm, k_norm, batch.positions, eps, theta)
        return self.gla(q, k, v, batch, states, layer, log_decay, scale)

    def _lightning_verify(self, q, k, v, q_norm, k_norm, batch, states, layer, log_decay, scale, eps, theta):
        """Verify and plain-decode sequences through the recurrent kernel (verify ones keep their
        k/v in batch.spec_kv for the commit); prefill chunks of the same step through fla."""
        spec = batch.spec_kv
        if "k" not in spec:  # first Lightning layer of the step: room for every layer's k/v
            n_layers = states.state.shape[1]
            spec["k"] = torch.empty((n_layers, *k.shape), dtype=promote(k.dtype, k_norm.dtype), device=k.device)
            spec["v"] = torch.empty((n_layers, *v.shape), dtype=v.dtype, device=v.device)
            spec["cu"], spec["slots"] = batch.cu_seqlens_q, batch.state_slots
        recurrent, chunks = _split_verify_step(batch)
        # (graph batches: q_lens_host holds the static tokens per sequence, which is what counts)
        longest = max(batch.q_lens_host[i] for i in recurrent)
        tree = None
        if batch.trees:  # once per step: each row's depth and ancestors (chains: causal)
            if "tree_rows" not in batch.derived:
                batch.derived["tree_rows"] = tree_rows_meta(batch.q_lens_host, batch.trees, q.device)
            tree = batch.derived["tree_rows"]
        o = lightning_verify(q, k, v, q_norm, k_norm, batch.positions, batch.cu_seqlens_q, batch.seq_modes,
                             states.state, batch.state_slots, layer, log_decay, scale, eps, theta,
                             spec["k"][layer], spec["v"][layer], max_tokens=longest, tree=tree)
        if chunks:
            sub, rows = batch.subset(chunks)
            qc, kc = self.lightning_qk_norm_rope(q[rows], k[rows], q_norm, k_norm, sub.positions, eps, theta)
            o[rows] = self.gla(qc, kc, v[rows], sub, states, layer, log_decay, scale)
        return o

    def commit_verified(self, states, batch, commits, log_decay) -> None:
        """Advance the Lightning states of verified sequences by their accepted tokens: one launch
        for every layer and sequence. commits: (seq index in the batch, state slot, tokens)."""
        spec = batch.spec_kv
        if "k" not in spec:
            return TorchBackend.commit_verified(self, states, batch, commits, log_decay)
        counts = [0] * spec["slots"].shape[0]
        ks, vs = spec["k"], spec["v"]
        if any(not isinstance(n, int) for _, _, n in commits):
            # a tree's accepted path: its rows moved to the front of its range, then a prefix commit
            ks, vs = ks.clone(), vs.clone()
            starts = [0]
            for n in batch.q_lens_host:
                starts.append(starts[-1] + n)
            for i, _, n in commits:
                if not isinstance(n, int):
                    src = torch.tensor([starts[i] + r for r in n], device=ks.device)
                    ks[:, starts[i]:starts[i] + len(n)] = spec["k"][:, src]
                    vs[:, starts[i]:starts[i] + len(n)] = spec["v"][:, src]
        for i, _, n in commits:
            counts[i] = n if isinstance(n, int) else len(n)
        counts_t = torch.tensor(counts, dtype=torch.int32).to(ks.device, non_blocking=True)
        lightning_commit(states.state, spec["slots"], spec["cu"], counts_t, ks, vs, log_decay)

    # ---- sparse layers -----------------------------------------------------------------------
    def store_kv(self, kv, layer, k, v, batch):
        if not batch.trees:
            attn.store_kv(kv, layer, k, v, batch)
            return
        # a tree's root goes to the cache, every tree row's K/V wait in spec_kv for the commit
        # (commit_tree_kv), and each row's path goes to its private page copies
        plan = self._tree_plan(kv, batch)
        if plan is None:
            return TorchBackend.store_kv(self, kv, layer, k, v, batch)
        for i, (start, end) in enumerate(tree_verify.row_ranges(batch)):
            if batch.trees[i] is not None:
                batch.spec_kv[("kv", layer, i)] = (k[start:end], v[start:end])
        attn.store_kv(kv, layer, k, v, SimpleNamespace(slot_mapping=plan.root_slots))
        kv.k[layer, plan.copy_dst] = kv.k[layer, plan.copy_src]
        kv.v[layer, plan.copy_dst] = kv.v[layer, plan.copy_src]
        attn.store_kv(kv, layer, k[plan.path_rows], v[plan.path_rows], SimpleNamespace(slot_mapping=plan.path_slots))

    def update_compressed(self, kv, comp, layer, batch):
        if batch.trees:  # the entries up to each tree's root; its rows' paths complete theirs in their copies
            plan = self._tree_plan(kv, batch)
            if plan is None:
                return TorchBackend.update_compressed(self, kv, comp, layer, batch)
            roots = [c + 1 if t is not None else L
                     for c, L, t in zip(batch.cache_lens_host, batch.seq_lens_host, batch.trees)]
            attn.update_compressed(kv, comp, layer, replace(
                batch, seq_lens=torch.tensor(roots, dtype=torch.int32, device=batch.seq_lens.device),
                seq_lens_host=roots))
            comp.c1[layer, plan.copy_dst] = comp.c1[layer, plan.copy_src]
            comp.c2[layer, plan.copy_dst] = comp.c2[layer, plan.copy_src]
            if plan.rows_batch.num_seqs:
                attn.update_compressed(kv, comp, layer, plan.rows_batch)
            return
        # graph batches: a fixed grid (the kernel loops over however many entries were born)
        attn.update_compressed(kv, comp, layer, batch, max_new_entries=1 if batch.decode_mode else None)

    @staticmethod
    def _tree_plan(kv, batch):
        """The step's tree_pages.TreePlan (built at its first sparse layer), or None where the torch
        ground truth runs the tree step's sparse layers: fp8 pages (path keys enter unquantized
        there), or no scratch pages from the runner."""
        if "tree_plan" not in batch.derived:
            batch.derived["tree_plan"] = None if kv.fp8 else tree_pages.plan(batch)
        return batch.derived["tree_plan"]

    def sparse_attention(self, q, kv, comp, layer, batch, cfg, score_reduce=None):
        if score_reduce is not None:  # refused at start-up too (parallel/shard.check_tp_backend)
            raise NotImplementedError("the triton backend's stage 1 ranks blocks inside one kernel: it cannot "
                                      "all-reduce partial stage-1 scores (replicated KV heads need backend torch)")
        if batch.trees and self._tree_plan(kv, batch) is None:
            return TorchBackend.sparse_attention(self, q, kv, comp, layer, batch, cfg)
        if _has_verify(batch):
            return self._verify_attention(q, kv, comp, layer, batch, cfg)
        if batch.is_decode:
            return self._decode_attention(q, kv, comp, layer, batch, cfg)
        return self._prefill_attention(q, kv, comp, layer, batch, cfg)

    @staticmethod
    def max_decode_blocks(cfg) -> int:
        """Longest page list of a decode query: every block of a dense sequence (L < dense_len),
        or the top-k selection of a sparse one."""
        sc = cfg.sparse
        return max(sc.topk_eff, -(-(sc.dense_len - 1) // sc.block_size))

    def select_blocks_decode(self, q, comp, layer, page_table, lens, cfg, derived=None, meta_key="select_meta",
                             prompt_lens=None):
        """Graph-safe InfLLM-v2 selection for decode queries (its presence tells the graph runner
        that sparse-mode decode can be captured). derived: the step's shared dict, where the
        length-derived metadata is computed once under meta_key. prompt_lens: per row, its
        sequence's prompt length (a one-token prefill chunk is a prompt token; None: no row is)."""
        meta = None
        if derived is not None:
            if meta_key not in derived:
                derived[meta_key] = sparse_ops.decode_select_meta(lens, prompt_lens)
            meta = derived[meta_key]
        return sparse_ops.select_blocks_decode(q, comp, layer, page_table, lens, cfg.sparse,
                                               cfg.head_dim ** -0.5, self.max_decode_blocks(cfg), meta=meta,
                                               prompt_lens=prompt_lens)

    def sparse_prefill(self, q, kv, comp, layer, batch, cfg):
        return sparse_ops.sparse_attention(q, kv, comp, layer, batch, cfg)

    def _decode_attention(self, q, kv, comp, layer, batch, cfg):
        """One token per sequence over a page list: all pages for dense sequences, the InfLLM-v2
        selection for sparse ones. Graph-safe."""
        sparse = batch.decode_mode == "sparse" or (batch.decode_mode is None and any(batch.is_sparse_host))
        return self._query_attention(q, kv, comp, layer, batch.page_table, batch.seq_lens, sparse, batch.derived,
                                     "dense_table", cfg, batch.prompt_lens)

    def _query_attention(self, q, kv, comp, layer, page_table, lens, sparse, derived, table_key, cfg,
                         prompt_lens=None):
        """Each row of q is a decode query: the last token of a sequence of length lens[row] with
        page_table[row] (and prompt length prompt_lens[row]: a one-token prefill chunk is a prompt
        token). `sparse` says whether any row is at or past dense_len (then the InfLLM-v2
        selection runs, which lists every block for the rows below it)."""
        sc, hkv = cfg.sparse, cfg.num_key_value_heads
        scale = cfg.head_dim ** -0.5
        if sparse:
            table, count = self.select_blocks_decode(q, comp, layer, page_table, lens, cfg, derived,
                                                     f"{table_key}_select_meta", prompt_lens)
        else:
            if table_key not in derived:  # once per step, shared by the sparse layers
                derived[table_key] = attn.dense_block_table(page_table, lens, hkv, sc.block_size)
            table, count = derived[table_key]
        # the split count depends only on static sizes, so eager and graph runs use the same kernels
        splits = attn.choose_num_splits(q.shape[0], hkv, self.max_decode_blocks(cfg))
        return attn.paged_decode_attention(q, kv, layer, table, count, lens, scale, splits)

    def _verify_attention(self, q, kv, comp, layer, batch, cfg):
        """Verify and plain-decode tokens as decode queries of their own (length position + 1);
        prefill chunks of the same step through the prefill kernels."""
        recurrent, chunks = _split_verify_step(batch)
        if "verify_rows" not in batch.derived:  # once per step, shared by the sparse layers
            rows = batch.subset(recurrent)[1] if chunks else None
            positions = batch.positions if rows is None else batch.positions[rows]
            token_seq = batch.token_seq if rows is None else batch.token_seq[rows]
            if batch.decode_mode is not None:
                sparse = batch.decode_mode == "sparse"
            else:
                sparse = any(batch.seq_lens_host[i] >= cfg.sparse.dense_len for i in recurrent)
            prompt_lens = batch.prompt_lens[token_seq] if batch.prompt_lens is not None else None
            table = batch.page_table[token_seq]
            if batch.trees:  # tree rows read their paths through their page copies
                table = self._tree_plan(kv, batch).row_table
                table = table if rows is None else table[rows]
            batch.derived["verify_rows"] = (rows, table, (positions + 1).to(torch.int32), sparse, prompt_lens)
        rows, table, lens, sparse, prompt_lens = batch.derived["verify_rows"]
        qr = q if rows is None else q[rows]
        o = self._query_attention(qr, kv, comp, layer, table, lens, sparse, batch.derived, "verify_dense_table", cfg,
                                  prompt_lens)
        if not chunks:
            return o
        out = torch.empty_like(q)
        out[rows] = o
        sub, crows = batch.subset(chunks)
        out[crows] = self._prefill_attention(q[crows], kv, comp, layer, sub, cfg)
        return out

    def _prefill_attention(self, q, kv, comp, layer, batch, cfg):
        """Eager steps: dense sequences through the flash kernel, sparse ones through InfLLM-v2."""
        scale = cfg.head_dim ** -0.5
        dense = [i for i, s in enumerate(batch.is_sparse_host) if not s]
        sparse = [i for i, s in enumerate(batch.is_sparse_host) if s]
        if not sparse:
            return attn.dense_prefill_attention(q, kv, layer, batch, scale)
        out = torch.empty_like(q)
        for group, fn in ((dense, "dense"), (sparse, "sparse")):
            if not group:
                continue
            sub, rows = batch.subset(group) if len(group) < batch.num_seqs else (batch, None)
            qs = q if rows is None else q[rows]
            if fn == "dense":
                o = attn.dense_prefill_attention(qs, kv, layer, sub, scale)
            else:
                o = self.sparse_prefill(qs, kv, comp, layer, sub, cfg)
            if rows is None:
                return o
            out[rows] = o
        return out
