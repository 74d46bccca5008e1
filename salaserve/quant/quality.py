"""Quantization quality against bf16 on the same weights, through the serving engine.

    python -m salaserve.quant.quality --model DIR [--formats fp8,w4a16-rtn,w4a16-gptq] [--prompts 64]
        [--prompt-len 256] [--load-format dummy] [--device auto] [--json quality.json]

For every format the model is built by the engine (`ModelRunner`, the real kernels: on CUDA the
Triton w4a16 / fp8 GEMMs, fp8 w8a8 at prefill sizes) and each held-out prompt is prefilled once;
logits at every position are compared with the bf16 (unquantized) model's:

  rel_err   mean over positions of ||l_q - l||_2 / ||l||_2
  kl        mean KL(p_bf16 || p_q) in nats
  top1      share of positions whose argmax agrees
  ppl       perplexity of the prompt's next tokens (meaningful only for a trained model; for
            random weights it is reported but says nothing)

fp8 and w4a16-rtn are quantized on load; kv-fp8 keeps the weights and stores K/V in fp8; w4a16-gptq is made by prepare-model (layer-by-layer GPTQ
on the corpus' train split) into a temporary directory, or taken from --gptq-model. Prompts come
from the corpus' held-out split. Works on CPU for the tiny model and on the GPU at full size with
dummy weights (`--load-format dummy`: every format quantizes the same random weights; the GPTQ
path reads them as a bf16 checkpoint would hold them, which in an fp32 CPU run differs from the
baseline by bf16 rounding, far below int4 error).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from salaserve.config import EngineArgs
from salaserve.core.batch import ForwardBatch, SeqWork

# kv-fp8: bf16 weights, fp8 K/V cache. w4a16-rtn: int4 weights, prefill dequantizing them for a bf16 GEMM;
# w4a16-fp8-prefill: the same int4 weights, prefill through their fp8 copy (w8a8, as on GPUs with fp8 tensor cores)
FORMATS = ("fp8", "w4a16-rtn", "w4a16-gptq", "kv-fp8", "w4a16-fp8-prefill")
DEFAULT_FORMATS = FORMATS[:4]  # (w4a16-fp8-prefill on request)
_ON_LOAD = {"bf16": None, "fp8": "fp8", "w4a16-rtn": "w4a16", "w4a16-fp8-prefill": "w4a16"}


def prompt_logits(runner, ids: list[int]) -> torch.Tensor:
    """fp32 logits [T, vocab] at every position of one prompt, prefilled in one step by the
    serving model on the runner's own caches (pages and a state slot taken and given back)."""
    kv, states, sc = runner.caches.kv, runner.caches.states, runner.cfg.sparse
    pages = kv.allocator.alloc(-(-len(ids) // sc.block_size))
    slot = states.alloc()
    try:
        work = SeqWork(state_slot=slot, pages=pages, cache_len=0, token_ids=list(ids), need_logits=True)
        batch = ForwardBatch.build([work], sc.block_size, sc.dense_len, runner.device)
        batch.logits_indices = torch.arange(len(ids), device=runner.device)
        return runner.model.forward(batch, runner.caches)
    finally:
        kv.allocator.free(pages)
        states.free(slot)


class Stats:
    """Running sums of the metrics over all prompt positions."""

    def __init__(self):
        self.n = 0
        self.rel = self.kl = self.top1 = self.nll_ref = self.nll_q = 0.0
        self.n_next = 0

    def add(self, ref: torch.Tensor, q: torch.Tensor, ids: list[int]) -> None:
        ref, q = ref.float(), q.float().to(ref.device)
        self.n += ref.shape[0]
        self.rel += float(((q - ref).norm(dim=-1) / ref.norm(dim=-1).clamp(min=1e-12)).sum())
        lp_ref, lp_q = ref.log_softmax(-1), q.log_softmax(-1)
        self.kl += float((lp_ref.exp() * (lp_ref - lp_q)).sum())
        self.top1 += float((ref.argmax(-1) == q.argmax(-1)).sum())
        nxt = torch.as_tensor(ids[1:], device=ref.device)
        self.nll_ref += float(F.nll_loss(lp_ref[:-1], nxt, reduction="sum"))
        self.nll_q += float(F.nll_loss(lp_q[:-1], nxt, reduction="sum"))
        self.n_next += len(ids) - 1

    def result(self) -> dict:
        return {"rel_err": self.rel / self.n, "kl": self.kl / self.n, "top1": self.top1 / self.n,
                "ppl": math.exp(self.nll_q / self.n_next), "ppl_bf16": math.exp(self.nll_ref / self.n_next),
                "positions": self.n}


def _runner(model_dir: str, quantization, args: argparse.Namespace, load_format: str, capacity: int,
            kv_cache_dtype: str = "auto", w4a16_prefill: str = "bf16"):
    from salaserve.engine.runner import ModelRunner

    eargs = EngineArgs(model=model_dir, device=args.device, dtype=args.dtype, backend=args.backend,
                       load_format=load_format, seed=args.seed, quantization=quantization,
                       max_running_requests=1, max_total_tokens=capacity, enable_cuda_graph=False,
                       kv_cache_dtype=kv_cache_dtype, w4a16_prefill=w4a16_prefill)
    return ModelRunner(eargs, model_dir)


def _fp8_prefill_copies(runner) -> None:
    """w4a16-fp8-prefill: the int4 weights' fp8 copies. The GPU backend makes them at load on GPUs
    with fp8 tensor cores; elsewhere they are made here and the reference linear runs their w8a8 math
    (per-token e4m3 activations), what such a GPU computes."""
    from salaserve.quant.formats.fp8 import attach_fp8_prefill_copies

    linears = _quantized_linears(runner)
    if torch.device(runner.device).type == "cpu":
        attach_fp8_prefill_copies(linears)
    if not any(w.prefill is not None for w in linears):
        raise ValueError("w4a16-fp8-prefill needs a CUDA GPU with fp8 tensor cores (sm_89+), or the CPU")


def _quantized_linears(runner) -> list:
    from salaserve.quant.formats import QuantizedLinearWeights
    from salaserve.quant.fuse import linear_weights

    return [w for w in linear_weights(runner.model.p) if isinstance(w, QuantizedLinearWeights)]


def _fp8_as_served(runner) -> None:
    """fp8 weights on the CPU: the reference computes what a GPU with fp8 tensor cores serves
    (w8a8 at prefill sizes), not weight-only math."""
    if torch.device(runner.device).type == "cpu":
        for w in _quantized_linears(runner):
            w.w8a8 = w.format == "fp8"


def _free(runner) -> None:
    del runner
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def held_out_prompts(model_dir: str, n: int, length: int) -> list[list[int]]:
    from salaserve.engine.llm import load_tokenizer
    from salaserve.quant.calib import calibration_sequences

    return calibration_sequences(load_tokenizer(model_dir), n * length, length, split="heldout")


def _gptq_model(args: argparse.Namespace, workdir: str) -> str:
    from salaserve.quant.prepare import PrepareOptions, prepare_model

    opts = PrepareOptions(quant="w4a16-gptq", device=args.device, load_format=args.load_format, seed=args.seed,
                          calib_tokens=args.calib_tokens, calib_seq_len=args.calib_seq_len)
    prepare_model(args.model, workdir, opts, progress=not args.quiet)
    return workdir


def evaluate(args: argparse.Namespace) -> dict:
    formats = [f for f in args.formats.split(",") if f]
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise ValueError(f"unknown format(s) {', '.join(unknown)}; choose from {', '.join(FORMATS)}")
    prompts = held_out_prompts(args.model, args.prompts, args.prompt_len)
    capacity = args.prompt_len + 256
    t0 = time.perf_counter()
    runner = _runner(args.model, None, args, args.load_format, capacity)
    ref = []
    for ids in prompts:  # kept on the host; bf16 when fp32 would not fit comfortably
        lg = prompt_logits(runner, ids)
        big = lg.numel() * len(prompts) * 4 > 8 * 2**30
        ref.append(lg.to("cpu", torch.bfloat16 if big else torch.float32))
    _free(runner)
    results = {"model": args.model, "load_format": args.load_format, "prompts": len(prompts),
               "prompt_len": args.prompt_len, "formats": {}}
    with tempfile.TemporaryDirectory(prefix="salaserve-quality-") as tmp:
        for fmt in formats:
            t = time.perf_counter()
            if fmt == "w4a16-gptq":
                path = args.gptq_model or _gptq_model(args, tmp)
                runner = _runner(path, None, args, "auto", capacity)
            elif fmt == "kv-fp8":
                runner = _runner(args.model, None, args, args.load_format, capacity, kv_cache_dtype="fp8_e4m3")
            elif fmt == "w4a16-fp8-prefill":
                runner = _runner(args.model, "w4a16", args, args.load_format, capacity, w4a16_prefill="fp8")
                _fp8_prefill_copies(runner)
            else:
                runner = _runner(args.model, _ON_LOAD[fmt], args, args.load_format, capacity)
                _fp8_as_served(runner)
            stats = Stats()
            for ids, lr in zip(prompts, ref):
                stats.add(lr, prompt_logits(runner, ids).cpu(), ids)
            _free(runner)
            results["formats"][fmt] = {**stats.result(), "seconds": round(time.perf_counter() - t, 1)}
    results["seconds"] = round(time.perf_counter() - t0, 1)
    return results


def table(results: dict) -> str:
    rows = ["| format | rel logit err | KL (nats) | top-1 agree | ppl (bf16) |", "|---|---|---|---|---|"]
    for fmt, r in results["formats"].items():
        rows.append(f"| {fmt} | {r['rel_err']:.4f} | {r['kl']:.5f} | {r['top1']:.3f} | "
                    f"{r['ppl']:.2f} ({r['ppl_bf16']:.2f}) |")
    return "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m salaserve.quant.quality",
                                description="Logit error, KL, top-1 agreement and perplexity of quantized "
                                            "formats against bf16 on the same weights.")
    p.add_argument("--model", required=True, help="bf16 model directory")
    p.add_argument("--formats", default=",".join(DEFAULT_FORMATS),
                   help=f"comma-separated subset of {','.join(FORMATS)}")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--load-format", choices=["auto", "dummy"], default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="auto: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--backend", default="auto")
    p.add_argument("--gptq-model", default=None, help="use this GPTQ checkpoint instead of running prepare-model")
    p.add_argument("--calib-tokens", type=int, default=65536)
    p.add_argument("--calib-seq-len", type=int, default=2048)
    p.add_argument("--json", default="quality.json", help="where to write the results")
    p.add_argument("--quiet", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        results = evaluate(args)
    except (ValueError, OSError) as e:
        print(f"quality: error: {e}", file=sys.stderr)
        return 2
    print(table(results))
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2)
        f.write("\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
