"""`salaserve prepare-model`: a bf16 MiniCPM-SALA checkpoint -> a quantized model directory.

    salaserve prepare-model --input DIR --output DIR [--quant {fp8,w4a16-rtn,w4a16-gptq}]
        [--calib FILE] [--calib-tokens N] [--calib-seq-len N] [--group-size 128] [--act-order]
        [--sym/--no-sym] [--quantize-lm-head] [--device auto] [--load-format {auto,dummy}]

The interface of the SOAR `prepare_model.sh` (`--input`, `--output`); the output is a complete
model directory (weights, config.json with quantization_config, quantize_config.json, tokenizer
and every other file of the input) that `LLM(model=out)` / `salaserve serve --model-path out` load.

  fp8         per-output-channel e4m3 weights (no calibration)
  w4a16-rtn   int4 round-to-nearest, GPTQ layout (no calibration)
  w4a16-gptq  int4 GPTQ, layer by layer: the calibration sequences go through the reference model
              one decoder layer at a time (only that layer's weights loaded); the Hessian of every
              linear is accumulated from its real inputs (quant/layerwise.py), the layer is
              quantized, and its outputs are recomputed with the quantized weights as the next
              layer's inputs, so each layer corrects for the error of those before it.

All decoder linears are quantized (q/k/v/o, o_gate / z_proj, gate/up/down); embeddings and norms
stay as stored, lm_head too unless --quantize-lm-head.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from salaserve.argparsing import ArgumentParser
from salaserve.config import ModelConfig
from salaserve.core.weights import expected_shapes, validate_names_and_shapes
from salaserve.quant import formats
from salaserve.quant.formats import GPTQ_V1, GPTQ_V2, QuantizedLinearWeights, QuantScheme, pack_zeros, unpack_zeros
from salaserve.quant.gptq import HessianAccumulator, gptq_quantize
from salaserve.quant.layerwise import LayerRunner, embed, layer_linears, layer_prefix
from salaserve.quant.load import quantizable_linears
from salaserve.quant.rtn import quantize_fp8, quantize_w4a16_rtn
from salaserve.quant.scheme import checkpoint_quant_config, fp8_config_json, gptq_config_json
from salaserve.quant.source import TensorSource
from salaserve.quant.writer import ShardWriter, copy_model_files, write_configs

METHODS = ("fp8", "w4a16-rtn", "w4a16-gptq")


@dataclass
class PrepareOptions:
    quant: str = "w4a16-gptq"
    group_size: int = 128
    act_order: bool = False
    sym: bool = True
    quantize_lm_head: bool = False
    calib: str | None = None  # JSONL; None: the stdlib corpus (train split)
    calib_tokens: int = 131072
    calib_seq_len: int = 2048
    device: str = "auto"
    damp: float = 0.01
    load_format: str = "auto"  # "dummy": random weights from the config (full-size runs without weights)
    seed: int = 0
    checkpoint_format: str = GPTQ_V1
    max_shard_bytes: int = 4 * 2**30

    def validate(self) -> None:
        if self.quant not in METHODS:
            raise ValueError(f"--quant must be one of {', '.join(METHODS)}, got {self.quant!r}")
        if self.group_size != -1 and self.group_size <= 0:
            raise ValueError(f"--group-size must be positive or -1 (per channel), got {self.group_size}")
        if self.checkpoint_format not in (GPTQ_V1, GPTQ_V2):
            raise ValueError(f"--checkpoint-format must be {GPTQ_V1} or {GPTQ_V2}")


def split_outputs(q: QuantizedLinearWeights, sizes: list[int]) -> list[QuantizedLinearWeights]:
    """The inverse of QuantizedLinearWeights.concat for int4 weights: output rows in `sizes` parts."""
    if len(sizes) == 1:
        return [q]
    zeros = unpack_zeros(q.qzeros, q.out_features, GPTQ_V2)
    out, start = [], 0
    for n in sizes:
        cols = slice(start, start + n)
        out.append(dataclasses.replace(
            q, out_features=n, qweight=q.qweight[:, cols].contiguous(), scales=q.scales[:, cols].contiguous(),
            qzeros=pack_zeros(zeros[:, cols], GPTQ_V2)))
        start += n
    return out


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _linear_tensors(base: str, q: QuantizedLinearWeights, fmt: str) -> dict[str, torch.Tensor]:
    """A quantized linear's tensors under their checkpoint names (quant/load.py reads them back);
    fmt: the int4 zero-point convention on disk."""
    return formats.get(q.format).checkpoint_tensors(q, base, QuantScheme(q.format, checkpoint_format=fmt))


class _Job:
    """One prepare-model run: the source, the writer and the per-linear quantizer."""

    def __init__(self, input_dir: str, output_dir: str, opts: PrepareOptions, progress: bool):
        self.input_dir, self.opts, self.progress = input_dir, opts, progress
        self.cfg = ModelConfig.from_pretrained(input_dir)
        if checkpoint_quant_config(input_dir, self.cfg.extra) is not None:
            raise ValueError(f"{input_dir} is already quantized (it has a quantization config); "
                             "prepare-model needs the bf16 checkpoint")
        self.device = _device(opts.device)
        self.dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16  # as the engine runs
        self.src = TensorSource(input_dir, self.cfg, opts.load_format, opts.seed)
        if not self.src.dummy:
            validate_names_and_shapes({n: self.src.shape(n) for n in self.src.names()}, self.cfg,
                                      ignore_unexpected=("rotary_emb.inv_freq",))
        self.writer = ShardWriter(output_dir, opts.max_shard_bytes)
        self.quantized = set(quantizable_linears(self.cfg, opts.quantize_lm_head))

    def write_linear(self, name: str, q: QuantizedLinearWeights) -> None:
        for k, v in _linear_tensors(name[: -len(".weight")], q, self.opts.checkpoint_format).items():
            self.writer.add(k, v)

    def direct(self, name: str) -> None:
        """Write one tensor: quantized without calibration (fp8 / RTN) if it is a linear, else as stored."""
        w = self.src.get(name, self.device)
        if name not in self.quantized:
            self.writer.add(name, w)
        elif self.opts.quant == "fp8":
            self.write_linear(name, quantize_fp8(w))
        else:
            self.write_linear(name, quantize_w4a16_rtn(w, self.opts.group_size, self.opts.sym))

    def gptq(self, ws: list[torch.Tensor], hessian: torch.Tensor) -> list[QuantizedLinearWeights]:
        """GPTQ of linears that share an input (hence H), in one pass over the columns: output rows
        are independent in GPTQ (per-row grids, the same H^-1 updates), so quantizing the stacked
        rows and splitting them is the same as one call per linear, with fewer, larger steps."""
        o = self.opts
        q = gptq_quantize(torch.cat(ws), hessian, group_size=o.group_size, sym=o.sym, act_order=o.act_order,
                          percdamp=o.damp)
        return split_outputs(q, [w.shape[0] for w in ws])

    def layer_names(self, i: int) -> list[str]:
        return [n for n in expected_shapes(self.cfg) if n.startswith(layer_prefix(i))]

    def bar(self, it, desc: str):
        return tqdm(it, desc=desc, disable=not self.progress, file=sys.stderr, dynamic_ncols=True)

    # ---- the two pipelines
    def run_direct(self) -> None:
        for i in self.bar(range(self.cfg.num_hidden_layers), f"{self.opts.quant} layers"):
            for name in self.layer_names(i):
                self.direct(name)
        self.direct("lm_head.weight")

    def run_gptq(self, sequences: list[list[int]]) -> None:
        cfg, runner = self.cfg, LayerRunner(self.cfg, self.dtype, self.device)
        emb = self.src.get("model.embed_tokens.weight", self.device)
        hs = [embed(cfg, emb, s, self.dtype) for s in sequences]
        del emb
        for i in self.bar(range(cfg.num_hidden_layers), "GPTQ layers"):
            w = {n: self.src.get(n, self.device) for n in self.layer_names(i)}
            accs = runner.new_accumulators(i)
            for h in hs:  # Hessians from this layer's real inputs (earlier layers already quantized)
                runner.run(i, w, h, accs)
            q = {}
            for group, names in layer_linears(cfg, i).items():
                q.update(zip(names, self.gptq([w[n] for n in names], accs[group].hessian)))
            del accs
            wq = {**w, **{n: qn.dequantize(self.dtype) for n, qn in q.items()}}
            hs = [runner.run(i, wq, h) for h in hs]  # the next layer sees the quantized layer's outputs
            for n in self.layer_names(i):
                if n in q:
                    self.write_linear(n, q[n])
                else:
                    self.writer.add(n, w[n])
        if "lm_head.weight" in self.quantized:
            acc = HessianAccumulator(cfg.hidden_size, self.device)
            norm = self.src.get("model.norm.weight", self.device)
            for h in hs:
                acc.add(runner.head_input(norm, h))
            head = self.src.get("lm_head.weight", self.device)
            self.write_linear("lm_head.weight", self.gptq([head], acc.hessian)[0])
        else:
            self.writer.add("lm_head.weight", self.src.get("lm_head.weight"))

    def quant_config(self, sequences: list[list[int]] | None) -> dict:
        o = self.opts
        if o.quant == "fp8":
            return fp8_config_json(o.quantize_lm_head)
        method = "gptq" if o.quant == "w4a16-gptq" else "rtn"
        qc = gptq_config_json(o.group_size, o.sym, o.act_order and method == "gptq", o.quantize_lm_head,
                              method, o.checkpoint_format, o.damp)
        if method == "gptq":
            qc["meta"]["calibration"] = {"source": o.calib or "stdlib-corpus", "sequences": len(sequences),
                                         "seq_len": len(sequences[0])}
        return qc


def calibration_for(input_dir: str, opts: PrepareOptions) -> list[list[int]]:
    from salaserve.engine.llm import load_tokenizer
    from salaserve.quant.calib import calibration_sequences

    return calibration_sequences(load_tokenizer(input_dir), opts.calib_tokens, opts.calib_seq_len, opts.calib)


def prepare_model(input_dir: str, output_dir: str, opts: PrepareOptions | None = None,
                  progress: bool = True, sequences: list[list[int]] | None = None) -> dict:
    """Write the quantized model to output_dir; returns a summary. `sequences` overrides the
    calibration token sequences (w4a16-gptq)."""
    opts = opts or PrepareOptions()
    opts.validate()
    t0 = time.perf_counter()
    if os.path.abspath(input_dir) == os.path.abspath(output_dir):
        raise ValueError("--output must differ from --input")
    job = _Job(input_dir, output_dir, opts, progress)
    for name in ("model.embed_tokens.weight", "model.norm.weight"):
        job.writer.add(name, job.src.get(name))
    with torch.no_grad():
        if opts.quant == "w4a16-gptq":
            if sequences is None:
                sequences = calibration_for(input_dir, opts)
            job.run_gptq(sequences)
        else:
            job.run_direct()
    job.writer.close()
    copy_model_files(input_dir, output_dir)
    write_configs(input_dir, output_dir, job.quant_config(sequences))
    return {"quant": opts.quant, "output": output_dir, "device": str(job.device),
            "calibration_sequences": len(sequences or ()), "weight_bytes": job.writer.total_bytes,
            "seconds": round(time.perf_counter() - t0, 2)}


# ---------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    d = PrepareOptions()
    p = ArgumentParser(prog="salaserve prepare-model",
                       description="Quantize a bf16 MiniCPM-SALA checkpoint into a model directory "
                                   "the engine serves (SOAR prepare_model.sh interface).")
    p.add_argument("--input", required=True, help="bf16 model directory (HF layout)")
    p.add_argument("--output", required=True, help="output model directory")
    p.add_argument("--quant", choices=METHODS, default=d.quant, help="weight format")
    p.add_argument("--calib", default=None, help="calibration JSONL ({'text'} or SOAR {'question', ...} rows); "
                                                  "default: the standard-library corpus")
    p.add_argument("--calib-tokens", type=int, default=d.calib_tokens, help="calibration tokens in all")
    p.add_argument("--calib-seq-len", type=int, default=d.calib_seq_len, help="tokens per calibration sequence")
    p.add_argument("--group-size", type=int, default=d.group_size, help="int4 group size (-1: per channel)")
    p.add_argument("--act-order", action="store_true", help="GPTQ act-order (desc_act): quantize columns by "
                                                            "decreasing Hessian diagonal")
    p.add_argument("--sym", action=argparse.BooleanOptionalAction, default=d.sym,
                   help="symmetric int4 (zero point 8); --no-sym fits a zero point per group")
    p.add_argument("--quantize-lm-head", action="store_true", help="quantize lm_head too (default: keep bf16)")
    p.add_argument("--device", default=d.device, help="calibration / quantization device (auto: cuda if present)")
    p.add_argument("--load-format", choices=["auto", "dummy"], default=d.load_format,
                   help="dummy: random weights from config.json (no safetensors needed)")
    p.add_argument("--seed", type=int, default=d.seed, help="dummy-weight seed")
    p.add_argument("--damp", type=float, default=d.damp, help="GPTQ dampening (fraction of mean diag H)")
    p.add_argument("--checkpoint-format", choices=[GPTQ_V1, GPTQ_V2], default=d.checkpoint_format,
                   help="qzeros convention on disk (gptq = v1, what GPTQModel writes by default)")
    p.add_argument("--max-shard-bytes", type=int, default=d.max_shard_bytes, help="largest weight shard")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    opts = PrepareOptions(quant=a.quant, group_size=a.group_size, act_order=a.act_order, sym=a.sym,
                          quantize_lm_head=a.quantize_lm_head, calib=a.calib, calib_tokens=a.calib_tokens,
                          calib_seq_len=a.calib_seq_len, device=a.device, damp=a.damp, load_format=a.load_format,
                          seed=a.seed, checkpoint_format=a.checkpoint_format, max_shard_bytes=a.max_shard_bytes)
    try:
        summary = prepare_model(a.input, a.output, opts)
    except (ValueError, OSError) as e:
        print(f"salaserve prepare-model: error: {e}", file=sys.stderr)
        return 2
    print(" ".join(f"{k}={v}" for k, v in summary.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
