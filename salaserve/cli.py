"""`salaserve` command line: one subcommand per task; `salaserve --help` lists them."""

from __future__ import annotations

import logging
import sys

from salaserve.argparsing import ArgumentParser, Command, run_subcommand


def _cmd_make_checkpoint(argv: list[str]) -> int:
    p = ArgumentParser(prog="salaserve make-checkpoint",
                       description="Write an HF-format MiniCPM-SALA checkpoint with random weights.")
    p.add_argument("--preset", choices=["tiny", "small", "full"], default="tiny",
                   help="tiny: tests; small: the built-in model's shape; full: the real 9.5B model's shape")
    p.add_argument("--out", required=True, help="output model directory")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--no-weights", action="store_true",
                   help="config and tokenizer only (load with --load-format dummy)")
    p.add_argument("--max-shard-bytes", type=int, default=None, help="split the weights into shards of at most "
                                                                    "this size (default: one file)")
    a = p.parse_args(argv)
    from salaserve.model.checkpoint import write_checkpoint

    cfg = write_checkpoint(a.out, a.preset, seed=a.seed, weights=not a.no_weights, max_shard_bytes=a.max_shard_bytes)
    print(f"wrote {a.preset} checkpoint to {a.out}: {cfg.num_parameters():,} parameters"
          + (" (no weights)" if a.no_weights else ""))
    return 0


def _cmd_generate(argv: list[str]) -> int:
    p = ArgumentParser(prog="salaserve generate",
                       description="Generate one completion of a prompt with the engine, in this process "
                                   "(greedy unless --temperature is given).")
    p.add_argument("--model", default=None, help="model directory (default: the built-in model)")
    p.add_argument("--prompt", required=True, help="the text to complete")
    p.add_argument("--max-new-tokens", type=int, default=64, help="most tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--no-thinking", action="store_true", help="with --chat: enable_thinking=False")
    p.add_argument("--device", default="auto", help="cpu | cuda | cuda:N | auto")
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"], help="kernel backend")
    p.add_argument("--tp-size", type=int, default=1,
                   help="tensor parallelism over N ranks (rank i on cuda:i, or CPU processes); must divide the KV heads")
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"],
                   help="dummy: random weights from config.json")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="auto: bfloat16 on CUDA, float32 on the CPU")
    from salaserve.quant.formats import quantization_choices
    p.add_argument("--quantization", choices=quantization_choices(), default=None,
                   help="default: as the checkpoint says; fp8 / w4a16 on a bf16 checkpoint quantize on load")
    p.add_argument("--speculative-algorithm", default=None, choices=["NGRAM", "EAGLE3"],
                   help="speculative decoding (exact verify: the output is the same)")
    p.add_argument("--speculative-draft-model-path", default=None, help="EAGLE3: the draft head's directory")
    p.add_argument("--speculative-num-draft-tokens", type=int, default=4, help="most draft tokens per verify step")
    p.add_argument("--speculative-eagle-topk", type=int, default=1, help="EAGLE3: candidates per draft tree level")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--regex", default=None, help="constrain the output to this regular expression")
    shape.add_argument("--json-schema", default=None, help="constrain the output to JSON with this schema (JSON text)")
    a = p.parse_args(argv)
    from salaserve.core.sampling_params import SamplingParams
    from salaserve.engine.llm import LLM

    llm = None
    try:
        llm = LLM(a.model, device=a.device, backend=a.backend, load_format=a.load_format, dtype=a.dtype,
                  quantization=a.quantization, max_running_requests=1, tp_size=a.tp_size,
                  speculative_algorithm=a.speculative_algorithm,
                  speculative_draft_model_path=a.speculative_draft_model_path,
                  speculative_num_draft_tokens=a.speculative_num_draft_tokens,
                  speculative_eagle_topk=a.speculative_eagle_topk)
        prompt = a.prompt
        if a.chat:
            kwargs = {"enable_thinking": False} if a.no_thinking else {}
            prompt = llm.chat_ids([{"role": "user", "content": a.prompt}], **kwargs)
        out = llm.generate(prompt, SamplingParams(max_new_tokens=a.max_new_tokens, temperature=a.temperature,
                                                  regex=a.regex, json_schema=a.json_schema))[0]
    except (ValueError, OSError) as e:
        print(f"salaserve generate: error: {e}", file=sys.stderr)
        return 2
    finally:
        if llm is not None:
            llm.shutdown()  # the tensor-parallel ranks (--tp-size > 1)
    print(a.prompt if not a.chat else "", end="")
    print(out.text)
    accept = llm.engine.avg_spec_accept_length
    if accept is not None:
        print(f"[speculative {a.speculative_algorithm}: {accept:.2f} tokens per verify step]", file=sys.stderr)
    return 0


def _cmd_serve(argv: list[str]) -> int:
    from salaserve.server.launch import run

    return run(argv)


def _cmd_prepare_model(argv: list[str]) -> int:
    from salaserve.quant.prepare import main as prepare_main

    return prepare_main(argv)


def _cmd_bench(argv: list[str]) -> int:
    from salaserve.bench.cli import main as bench_main

    return bench_main(argv)


def _cmd_eval(argv: list[str]) -> int:
    from salaserve.evaluation.cli import main as eval_main

    return eval_main(argv)


def _cmd_train_draft(argv: list[str]) -> int:
    from salaserve.spec_train.train import main as train_main

    return train_main(argv)


def _cmd_soar_package(argv: list[str]) -> int:
    from salaserve.soar.package import main as package_main

    return package_main(argv)


def _cmd_sglang_shim(argv: list[str]) -> int:
    from salaserve.soar.shim import main as shim_main

    return shim_main(argv)


COMMANDS = {
    "serve": Command(_cmd_serve, "serve a model over HTTP (SGLang and OpenAI APIs, sglang.launch_server's flags)"),
    "generate": Command(_cmd_generate, "complete one prompt in this process and print the text"),
    "make-checkpoint": Command(_cmd_make_checkpoint, "write a MiniCPM-SALA model directory with random weights"),
    "prepare-model": Command(_cmd_prepare_model, "quantize a bf16 checkpoint (fp8, w4a16 RTN or GPTQ), "
                                                 "as SOAR's prepare_model.sh"),
    "bench": Command(_cmd_bench, "speed benchmarks: the SOAR S1/S8/Smax tiers, reports, comparisons"),
    "eval": Command(_cmd_eval, "SOAR-style correctness evaluation against a running server"),
    "train-draft": Command(_cmd_train_draft, "train an EAGLE-3 draft head for a model (speculative decoding)"),
    "soar-package": Command(_cmd_soar_package, "write a SOAR submission folder that installs and serves salaserve"),
    "sglang-shim": Command(_cmd_sglang_shim, "make `python -m sglang.launch_server` start salaserve in this "
                                             "environment"),
}

DESCRIPTION = """A fast inference engine and HTTP server for MiniCPM-SALA. With no --model-path,
`salaserve serve` serves the built-in default model:

  salaserve serve --port 30000"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv in (["--version"], ["-V"]):
        from salaserve import __version__

        print(f"salaserve {__version__}")
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_subcommand("salaserve", COMMANDS, argv, DESCRIPTION)


if __name__ == "__main__":
    sys.exit(main())
