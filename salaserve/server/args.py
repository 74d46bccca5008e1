"""`salaserve serve` flags: those of `python -m sglang.launch_server` that the SOAR toolkit and
users pass, plus our own (--device, --dtype, --backend).

The platform launches with a fixed SGLang command line, so every flag it uses must parse. SGLang
flags that mean nothing here are accepted with a one-line notice (the list and the reasons are in
sglang_flags.py); any other unknown flag is an error with a did-you-mean, as SGLang rejects it,
so a mistyped flag never leaves the server running on a default.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from salaserve.argparsing import ArgumentParser
from salaserve.config import EngineArgs, default_plan_cache_dir
from salaserve.core.request import ADMISSION_ORDERS
from salaserve.server.sglang_flags import SGLANG_ONLY_POLICIES, add_ignored_flags, admission_order, ignored_flag_notices


def quantization_name(value: str) -> str:
    """--quantization's check, run only when the flag is given: the format registry imports torch,
    and `serve --help` (the SOAR launcher's too) must work without it."""
    from salaserve.quant.formats import quantization_choices
    if value not in quantization_choices():
        raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from {', '.join(quantization_choices())})")
    return value


@dataclass
class ServerArgs:
    """What the HTTP side needs; the engine's knobs travel separately as EngineArgs."""

    model_path: str | None = None  # None: the built-in default model (resolved at launch)
    served_model_name: str | None = None  # default: the model path, as SGLang does
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    enable_metrics: bool = False
    skip_server_warmup: bool = False
    trust_remote_code: bool = False
    stream_interval: int = 1  # tokens between streamed events (SGLang's --stream-interval)
    max_request_bytes: int = 64 * 2**20  # request bodies beyond this get 413
    enable_cache_report: bool = False  # OpenAI usage.prompt_tokens_details.cached_tokens (SGLang's flag)
    allow_auto_truncate: bool = False  # over-long requests are cut to fit the context, not refused (SGLang's flag)
    log_level: str = "info"
    # hardening (salaserve/server/auth.py, http_limits.py; README "Limits and access")
    admin_api_key: str | None = None  # abort_all, and aborting other clients' requests
    metrics_no_auth: bool = False  # /metrics answers without the API key
    max_batch_prompts: int = 256  # prompts in one request
    max_request_sequences: int = 1024  # sequences one request starts: prompts x n
    request_read_timeout: float = 60.0  # seconds to send a request head, and then its body
    dp_size: int = 1  # engine replicas behind this front end (server/replicas.py)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path or ""

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        for key in ("api_key", "admin_api_key"):  # never echo a key back
            d[key] = None if d[key] is None else "***"
        return d


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="salaserve serve",
                       description="Serve MiniCPM-SALA over HTTP (SGLang-native and OpenAI APIs). Takes the "
                                   "flags of `python -m sglang.launch_server`; unknown flags are errors.")
    a = p.add_argument
    a("--model-path", "--model", dest="model_path", default=None,
      help="model directory (default: the built-in default model)")
    a("--served-model-name", default=None, help="model id in /v1/models (default: the model path)")
    a("--host", default="127.0.0.1", help="address to listen on")
    a("--port", type=int, default=30000, help="port to listen on")
    a("--context-length", type=int, default=None,
      help="longest prompt + completion in tokens (default: the model's max_position_embeddings; more is refused "
           "unless SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1, as in SGLang)")
    a("--allow-auto-truncate", action="store_true",
      help="as SGLang: a prompt that does not fit the context keeps its first tokens, and a max_new_tokens "
           "that does not fit is lowered, instead of a 400")
    a("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1,
      help="tensor parallelism: N ranks, each with 1/N of the heads and MLP (rank i on cuda:i over NCCL, or CPU "
           "processes over gloo); N must divide the query heads and either divide the KV heads or be a "
           "multiple of them (replicated KV heads, torch backend only): MiniCPM-SALA takes 2, 4 or 8")
    a("--dist-timeout", type=float, default=EngineArgs.dist_timeout,
      help="seconds a tensor-parallel rank waits for the others (start-up, each collective) before failing")
    a("--dp-size", "--data-parallel-size", dest="dp_size", type=int, default=1,
      help="engine replicas, one process each (replica i on cuda:i, or all on the CPU), behind this one HTTP "
           "server; each request goes to the least loaded replica, or to the one that recently got the same "
           "long prompt prefix unless that one is much busier")
    a("--max-running-requests", type=int, default=64, help="requests decoded at once; more wait in a queue")
    a("--max-total-tokens", type=int, default=None, help="KV cache size in tokens (default: from memory)")
    a("--mem-fraction-static", type=float, default=0.88, help="share of GPU memory for weights and caches")
    a("--chunked-prefill-size", type=int, default=8192, help="prompt tokens prefilled per step")
    a("--schedule-policy", default="fcfs", choices=list(ADMISSION_ORDERS) + list(SGLANG_ONLY_POLICIES),
      help="order waiting requests are admitted in, within a priority: fcfs (arrival) or lof (longest "
           "max_new_tokens first); SGLang's other policies are accepted and run as fcfs")
    a("--enable-metrics", action="store_true", help="serve Prometheus metrics at /metrics")
    a("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but /health and /ping")
    a("--trust-remote-code", action="store_true",
      help="let transformers run Python code shipped with the model (tokenizer, config)")
    a("--disable-radix-cache", action="store_true", help="no prefix cache (same as --prefix-cache-slots 0)")
    a("--enable-cache-report", action="store_true",
      help="report the prompt tokens taken from the prefix cache in OpenAI usage.prompt_tokens_details")
    a("--skip-server-warmup", action="store_true", help="report ready without a warm-up generation")
    a("--quantization", default=None, type=quantization_name, metavar="{fp8,w4a16,gptq}",
      help="default: as the checkpoint says; a format on a bf16 checkpoint quantizes on load")
    a("--quantize-lm-head", action="store_true",
      help="with --quantization fp8/w4a16 on a bf16 checkpoint: quantize lm_head on load too (default: bf16)")
    a("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3"],
      help="fp8_e4m3: the sparse layers' K/V pages in fp8 with a scale per page and KV head: about twice the "
           "pages in the same memory; at 128K 0.2-0.6%% slower at batch 1, faster at batches 8 and 32")
    a("--load-format", default="auto", choices=["auto", "safetensors", "dummy"])
    a("--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"],
      help="debug adds uvicorn's access log")
    a("--random-seed", type=int, default=0, help="seed of the dummy weights and of unseeded sampling")
    a("--stream-interval", type=int, default=1, help="tokens between streamed events")
    a("--speculative-algorithm", default=None, choices=["NGRAM", "EAGLE", "EAGLE3"],
      help="speculative decoding (NGRAM: prompt-lookup drafts; EAGLE3: a draft head over the target's hidden "
           "states, --speculative-draft-model-path; exact verify)")
    a("--speculative-draft-model-path", default=None, help="EAGLE3: the draft head's directory (SGLang's format)")
    a("--speculative-num-steps", type=int, default=None,
      help="EAGLE3: draft depth (default: --speculative-num-draft-tokens)")
    a("--speculative-eagle-topk", type=int, default=1, help="EAGLE3: candidates per draft tree level")
    a("--speculative-num-draft-tokens", type=int, default=4, help="most draft tokens per verify step")
    a("--speculative-max-batch", type=int, default=8, help="speculate only while at most this many requests decode")
    a("--speculative-load-levels", default="1:5:4,4:3:2,8:2:1",
      help="draft shape by load: max_batch:depth[:topk] levels; the first level holding the decoding "
           "requests caps the depth and tree width, past the last no drafts")
    a("--speculative-policy-patience", type=int, default=4,
      help="steps the load must stay in another level before the draft shape follows (hysteresis)")
    a("--speculative-ngram-route", type=int, default=0,
      help="EAGLE3: a prompt-lookup match of at least this many tokens drafts instead of the head "
           "(0: off)")
    a("--disable-cuda-graph", action="store_true", help="run decode steps eagerly (no CUDA graphs)")
    a("--disable-overlap-schedule", action="store_true",
      help="read each step's tokens back before scheduling the next (no CPU/GPU overlap)")
    a("--cuda-graph-max-bs", type=int, default=None, help="largest captured decode batch "
                                                            "(default: --max-running-requests)")
    # our own
    a("--device", default="auto", help="cpu | cuda | cuda:N | auto")
    a("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    a("--backend", default="auto", choices=["auto", "torch", "triton"], help="kernel backend")
    a("--max-request-mb", type=float, default=64.0, help="largest accepted request body, in MiB")
    a("--prefix-cache-slots", type=int, default=EngineArgs.prefix_cache_slots,
      help="prompts kept for reuse as prefixes of later prompts (one Lightning state slot each); 0: off")
    a("--prefix-cache-min-tokens", type=int, default=EngineArgs.prefix_cache_min_tokens,
      help="shortest prompt kept in the prefix cache")
    a("--w4a16-prefill", default=EngineArgs.w4a16_prefill, choices=["fp8", "bf16"],
      help="int4 weights at prefill sizes: fp8 (an fp8 copy of the weights, w8a8 on fp8 tensor cores, sm_89+) "
           "or bf16 (the int4 weights dequantized for a bf16 GEMM)")
    a("--w4-wgmma", default=EngineArgs.w4_wgmma, action=argparse.BooleanOptionalAction,
      help="int4 weights on the GPU: a repacked copy of each linear (qweight's bytes again, ~4.6 GB at full size) "
           "for the wgmma decode GEMV at 4-16 rows; --no-w4-wgmma gives that memory to KV pages")
    a("--plan-cache-dir", default=default_plan_cache_dir() or "off",
      help="where the start-up calibration's picks are kept across restarts (default: $SALASERVE_PLAN_CACHE, "
           "else ~/.cache/salaserve/plans); 'off': no plans, every start-up calibrates")
    a("--parallel-compile", default=EngineArgs.parallel_compile, action=argparse.BooleanOptionalAction,
      help="start-up compiles in a thread pool: the calibration's candidate kernels and the warm-up's autotune "
           "configs, before timing them; "
           "--no-parallel-compile: one compile at a time (for a Triton whose async compile misbehaves)")
    a("--step-trace", default=None, help="append one JSON line per engine step to this file (scheduler trace)")
    # hardening: access and per-request limits
    a("--admin-api-key", default=None,
      help="key (Authorization: Bearer KEY) that may abort any client's requests and use abort_all")
    a("--metrics-no-auth", action="store_true", help="serve /metrics without the API key (for scrapers)")
    a("--max-batch-prompts", type=int, default=ServerArgs.max_batch_prompts, help="most prompts in one request")
    a("--max-request-sequences", type=int, default=ServerArgs.max_request_sequences,
      help="most sequences one request may start (prompts x n)")
    a("--request-read-timeout", type=float, default=ServerArgs.request_read_timeout,
      help="seconds a client has to send a request's head, and then its body (408 after)")
    add_ignored_flags(p)
    return p


def parse_args(argv: list[str]) -> tuple[EngineArgs, ServerArgs, list[str]]:
    """Returns the engine's and the server's arguments plus one notice per ignored SGLang flag.
    Raises SystemExit (argparse, status 2) for an unknown flag or a flag value that cannot be
    served, e.g. --tp-size 0."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.tp_size < 1:
        parser.error(f"--tp-size must be >= 1, got {ns.tp_size}")
    if ns.dp_size < 1:
        parser.error(f"--dp-size must be >= 1, got {ns.dp_size}")
    if ns.tp_size > 1 and ns.dp_size > 1:
        parser.error("--tp-size > 1 with --dp-size > 1 is not supported yet: use one of them")
    if ns.stream_interval < 1:
        parser.error(f"--stream-interval must be >= 1, got {ns.stream_interval}")
    if ns.speculative_algorithm == "EAGLE":
        parser.error("--speculative-algorithm EAGLE: not supported (use EAGLE3 or NGRAM)")
    if ns.max_request_mb <= 0:
        parser.error(f"--max-request-mb must be positive, got {ns.max_request_mb}")
    for flag in ("max_batch_prompts", "max_request_sequences", "request_read_timeout"):
        if getattr(ns, flag) <= 0:
            parser.error(f"--{flag.replace('_', '-')} must be positive, got {getattr(ns, flag)}")
    notices = ignored_flag_notices(ns)
    engine = EngineArgs(
        model=ns.model_path, backend=ns.backend, device=ns.device, dtype=ns.dtype, load_format=ns.load_format,
        seed=ns.random_seed, max_running_requests=ns.max_running_requests,
        chunked_prefill_size=ns.chunked_prefill_size, schedule_policy=admission_order(ns.schedule_policy, notices),
        mem_fraction_static=ns.mem_fraction_static,
        max_total_tokens=ns.max_total_tokens, context_length=ns.context_length,
        kv_cache_dtype=ns.kv_cache_dtype, quantization=ns.quantization, quantize_lm_head=ns.quantize_lm_head,
        log_level=ns.log_level,
        speculative_algorithm=ns.speculative_algorithm, speculative_num_draft_tokens=ns.speculative_num_draft_tokens,
        speculative_max_batch=ns.speculative_max_batch, speculative_draft_model_path=ns.speculative_draft_model_path,
        speculative_num_steps=ns.speculative_num_steps, speculative_eagle_topk=ns.speculative_eagle_topk,
        speculative_load_levels=ns.speculative_load_levels,
        speculative_policy_patience=ns.speculative_policy_patience,
        speculative_ngram_route=ns.speculative_ngram_route,
        enable_cuda_graph=not ns.disable_cuda_graph,
        overlap_schedule=not ns.disable_overlap_schedule,
        cuda_graph_max_bs=ns.cuda_graph_max_bs,
        prefix_cache_slots=0 if ns.disable_radix_cache else ns.prefix_cache_slots,
        prefix_cache_min_tokens=ns.prefix_cache_min_tokens, step_trace=ns.step_trace,
        w4a16_prefill=ns.w4a16_prefill, w4_wgmma=ns.w4_wgmma, parallel_compile=ns.parallel_compile,
        plan_cache_dir=None if ns.plan_cache_dir == "off" else ns.plan_cache_dir,
        tp_size=ns.tp_size, dist_timeout=ns.dist_timeout,
    )
    try:
        engine.validate()
    except ValueError as e:
        parser.error(str(e))
    server = ServerArgs(
        model_path=ns.model_path, served_model_name=ns.served_model_name, host=ns.host, port=ns.port,
        api_key=ns.api_key, enable_metrics=ns.enable_metrics, skip_server_warmup=ns.skip_server_warmup,
        trust_remote_code=ns.trust_remote_code, stream_interval=ns.stream_interval,
        max_request_bytes=int(ns.max_request_mb * 2**20), log_level=ns.log_level,
        enable_cache_report=ns.enable_cache_report, allow_auto_truncate=ns.allow_auto_truncate,
        admin_api_key=ns.admin_api_key, metrics_no_auth=ns.metrics_no_auth, max_batch_prompts=ns.max_batch_prompts,
        max_request_sequences=ns.max_request_sequences, request_read_timeout=ns.request_read_timeout,
        dp_size=ns.dp_size,
    )
    return engine, server, notices
