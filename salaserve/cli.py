"""`salaserve` command line: serve | generate | make-checkpoint | prepare-model | bench | eval."""

from __future__ import annotations

import argparse
import logging
import sys


def _cmd_make_checkpoint(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="salaserve make-checkpoint",
                                description="Write an HF-format MiniCPM-SALA checkpoint with random weights.")
    p.add_argument("--preset", choices=["tiny", "small", "full"], default="tiny")
    p.add_argument("--out", required=True, help="output model directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-weights", action="store_true",
                   help="config and tokenizer only (load with --load-format dummy)")
    p.add_argument("--max-shard-bytes", type=int, default=None)
    a = p.parse_args(argv)
    from salaserve.model.checkpoint import write_checkpoint

    cfg = write_checkpoint(a.out, a.preset, seed=a.seed, weights=not a.no_weights, max_shard_bytes=a.max_shard_bytes)
    print(f"wrote {a.preset} checkpoint to {a.out}: {cfg.num_parameters():,} parameters"
          + (" (no weights)" if a.no_weights else ""))
    return 0


def _cmd_generate(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="salaserve generate", description="Generate text greedily with the engine.")
    p.add_argument("--model", default=None, help="model directory (default: the built-in model)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--no-thinking", action="store_true", help="with --chat: enable_thinking=False")
    p.add_argument("--device", default="auto")
    p.add_argument("--backend", default="auto")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--dtype", default="auto")
    from salaserve.quant.formats import quantization_choices
    p.add_argument("--quantization", choices=quantization_choices(), default=None,
                   help="default: as the checkpoint says; fp8 / w4a16 on a bf16 checkpoint quantize on load")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--regex", default=None, help="constrain the output to this regular expression")
    shape.add_argument("--json-schema", default=None, help="constrain the output to JSON with this schema (JSON text)")
    a = p.parse_args(argv)
    from salaserve.engine.llm import LLM
    from salaserve.engine.sampling_params import SamplingParams

    try:
        llm = LLM(a.model, device=a.device, backend=a.backend, load_format=a.load_format, dtype=a.dtype,
                  quantization=a.quantization, max_running_requests=1)
        prompt = a.prompt
        if a.chat:
            kwargs = {"enable_thinking": False} if a.no_thinking else {}
            prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": a.prompt}], tokenize=True,
                                                       add_generation_prompt=True, **kwargs)
            if not isinstance(prompt, list):  # transformers 5 returns a BatchEncoding
                prompt = list(prompt["input_ids"])
        out = llm.generate(prompt, SamplingParams(max_new_tokens=a.max_new_tokens, temperature=a.temperature,
                                                  regex=a.regex, json_schema=a.json_schema))[0]
    except (ValueError, OSError) as e:
        print(f"salaserve generate: error: {e}", file=sys.stderr)
        return 2
    print(a.prompt if not a.chat else "", end="")
    print(out.text)
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


COMMANDS = {
    "serve": _cmd_serve,
    "make-checkpoint": _cmd_make_checkpoint,
    "generate": _cmd_generate,
    "prepare-model": _cmd_prepare_model,
    "bench": _cmd_bench,
    "eval": _cmd_eval,
}


def run_subcommand(prog: str, commands: dict, argv: list[str], usage: str) -> int:
    """Dispatch `prog CMD ...` to commands[CMD]; help with no or -h/--help, exit 2 on unknown."""
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0 if argv else 2
    cmd = commands.get(argv[0])
    if cmd is None:
        print(f"{prog}: unknown command {argv[0]!r}; choose from {', '.join(commands)}", file=sys.stderr)
        return 2
    return cmd(argv[1:])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_subcommand("salaserve", COMMANDS, argv, "usage: salaserve {" + ",".join(COMMANDS) + "} ...")


if __name__ == "__main__":
    sys.exit(main())
