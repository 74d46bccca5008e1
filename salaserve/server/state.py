"""What every route shares: arguments, the engine replicas, the tokenizer, metrics, readiness, and
the checks that turn a prompt plus sampling options into engine requests."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from salaserve.config import EngineArgs
from salaserve.core.sampling_params import SamplingParams
from salaserve.server.args import ServerArgs
from salaserve.server.engine_client import EngineUnavailable
from salaserve.server.generation import RequestGroup
from salaserve.server.input_checks import check_prompt_text
from salaserve.server.metrics import ServerMetrics
from salaserve.server.protocol import ApiError
from salaserve.server.replicas import RESTART_ATTEMPTS, EngineReplicas, replica_engine_args
from salaserve.server.tokenization import Tokenization, load_tokenizer

log = logging.getLogger("salaserve.server")

_SEED_STRIDE = 0x9E3779B97F4A7C15  # golden-ratio step: sibling seeds far apart
WARMUP_PROMPT = "The capital city of France is"


@dataclass
class ServerState:
    args: ServerArgs
    engine_args: EngineArgs
    on_fatal: Callable[[str], None] | None = None
    devices: list[str] | None = None  # one per engine replica (replicas.replica_devices); None: engine_args.device
    client: EngineReplicas = None
    tokenization: Tokenization | None = None
    metrics: ServerMetrics | None = None
    ready: bool = False
    started_at: float = field(default_factory=time.time)
    rid_aliases: dict[str, list[str]] = field(default_factory=dict)  # user rid -> engine rids (n > 1)

    def __post_init__(self):
        devices = self.devices or [self.engine_args.device]
        self.client = EngineReplicas(replica_engine_args(self.engine_args, devices),
                                     on_fatal=self.fatal, warm_up=self.warm_up,
                                     restart_attempts=RESTART_ATTEMPTS if len(devices) > 1 else 0)
        self.metrics = ServerMetrics(self.args.model_name, self.client)

    # ---- life cycle ----------------------------------------------------------------------------
    async def boot(self) -> None:
        """Load the tokenizer and start the engines side by side, warm each up, then report ready."""
        try:
            loop = asyncio.get_running_loop()
            tok = loop.run_in_executor(None, load_tokenizer, self.args.model_path, self.args.trust_remote_code)
            try:
                info = await self.client.start()
            except BaseException:  # the engine's error is the one to report
                tok.add_done_callback(lambda f: f.cancelled() or f.exception())
                raise
            self.tokenization = Tokenization(await tok)
            devices = ", ".join(r.info["device"] for r in self.client.replicas)
            log.info("engine ready: %s on %s (%s, backend %s); context %d tokens, KV cache %d tokens, "
                     "%d state slots%s", info["model_dir"], devices, info["dtype"], info["backend"],
                     info["context_length"], info["max_total_num_tokens"], info["num_state_slots"],
                     " per replica" if len(self.client.replicas) > 1 else "")
            await asyncio.gather(*(self.warm_up(r.index) for r in self.client.replicas))
            self.ready = True
            log.info("The server is fired up and ready to roll! http://%s:%d", self.args.host, self.args.port)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.error("start-up failed: %s", e)
            self.fatal(str(e))

    async def warm_up(self, replica: int) -> None:
        """One short generation on `replica` (unless --skip-server-warmup), before it takes requests."""
        if self.args.skip_server_warmup:
            return
        t0 = time.perf_counter()
        ids = await self.tokenization.encode(WARMUP_PROMPT)
        group = RequestGroup(self.client, self.tokenization.tokenizer)  # not counted in the metrics
        group.add(ids, SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True))
        await group.start(replica=replica)
        seq = (await group.wait())[0]
        if seq.error:
            raise RuntimeError(f"warm-up generation failed: {seq.error}")
        where = f" (replica {replica})" if len(self.client.replicas) > 1 else ""
        log.info("warm-up done%s: %d-token prompt, %d tokens generated in %.2f s", where, len(ids),
                 seq.completion_tokens, time.perf_counter() - t0)

    def fatal(self, message: str) -> None:
        self.ready = False
        if self.on_fatal is not None:
            self.on_fatal(message)

    async def shutdown(self) -> None:
        self.ready = False
        await self.client.aclose()
        if self.tokenization is not None:
            self.tokenization.close()

    # ---- per-request helpers -------------------------------------------------------------------
    def require_ready(self) -> None:
        if self.client.dead:
            raise ApiError(503, f"the engine is not running: {self.client.dead}")
        if not self.ready:
            raise ApiError(503, "the server is starting; retry when /health returns 200")

    @property
    def context_length(self) -> int:
        return self.client.info["context_length"]

    @property
    def max_prompt_chars(self) -> int | None:
        """No text longer than this fits the context, whatever it tokenizes to (see
        tokenization.max_chars_per_token); None where the tokenizer allows no such bound."""
        per_token = self.tokenization.max_chars_per_token
        return None if per_token is None else self.context_length * per_token

    def check_text(self, text: str, field: str) -> None:
        """400 for a prompt text the tokenizer must not see: invalid Unicode, NUL, or too long."""
        check_prompt_text(text, field, self.max_prompt_chars, self.context_length)

    def check_request_size(self, num_prompts: int, num_sequences: int, field: str) -> None:
        """400 for a request that asks for more prompts, or prompts x n sequences, than one
        request may (--max-batch-prompts, --max-request-sequences); checked before any tokenizing."""
        if num_prompts > self.args.max_batch_prompts:
            raise ApiError(400, f"{field}: {num_prompts} prompts in one request; the limit is "
                                f"{self.args.max_batch_prompts} (--max-batch-prompts)", field)
        if num_sequences > self.args.max_request_sequences:
            raise ApiError(400, f"n: {num_prompts} prompt(s) x n make {num_sequences} sequences in one request; the "
                                f"limit is {self.args.max_request_sequences} (--max-request-sequences)", "n")

    def new_group(self, owner: str | None) -> RequestGroup:
        return RequestGroup(self.client, self.tokenization.tokenizer, self.metrics, owner=owner)

    def sampling_params(self, d: dict) -> SamplingParams:
        try:
            return SamplingParams.from_dict(d, vocab_size=self.client.info["vocab_size"])
        except ValueError as e:
            raise ApiError(400, str(e)) from None

    def fit_to_context(self, ids: list[int], params: SamplingParams) -> list[int]:
        """SGLang's rule: the prompt, and the prompt plus max_new_tokens, stay under the context
        length, else 400. With --allow-auto-truncate, SGLang's truncation instead: an over-long
        prompt keeps its first tokens (the longest prompt the context takes) and a max_new_tokens
        that does not fit is lowered to what the context leaves, with a warning. Returns the prompt
        to run; resolves max_new_tokens=None to everything the context leaves."""
        ctx = self.context_length
        truncate = self.args.allow_auto_truncate
        if len(ids) >= ctx:
            if not truncate:
                raise ApiError(400, f"The input ({len(ids)} tokens) is longer than the model's context length "
                                    f"({ctx} tokens).")
            log.warning("The input (%d tokens) is longer than the model's context length (%d tokens). "
                        "Truncating the input.", len(ids), ctx)
            ids = ids[:ctx - 1]
        prompt_len = len(ids)
        if params.max_new_tokens is None:
            params.max_new_tokens = ctx - prompt_len
        elif prompt_len + params.max_new_tokens >= ctx:
            if not truncate:
                raise ApiError(400, f"Requested token count exceeds the model's maximum context length of {ctx} "
                                    f"tokens. You requested a total of {prompt_len + params.max_new_tokens} tokens: "
                                    f"{prompt_len} tokens from the input messages and {params.max_new_tokens} "
                                    f"tokens for the completion. Please reduce the number of tokens in the input "
                                    f"messages or the completion to fit within the limit.")
            log.warning("Requested token count (%d input + %d new) exceeds the model's context length (%d tokens). "
                        "Truncating max_new_tokens.", prompt_len, params.max_new_tokens, ctx)
            params.max_new_tokens = ctx - 1 - prompt_len
            params.min_new_tokens = min(params.min_new_tokens, params.max_new_tokens)
        return ids

    @staticmethod
    def siblings(params: SamplingParams) -> list[SamplingParams]:
        """`n` independent samples: n requests with n=1; a seeded request gets a distinct seed
        per sibling (the first keeps the given one, so n=1 and sample 0 of n agree)."""
        out = []
        for j in range(params.n):
            p = dataclasses.replace(params, n=1)
            if params.seed is not None and j:
                p.seed = (params.seed + j * _SEED_STRIDE) % 2**64
            out.append(p)
        return out

    async def start(self, group: RequestGroup) -> None:
        try:
            await group.start()
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        except EngineUnavailable as e:
            raise ApiError(503, str(e)) from None
