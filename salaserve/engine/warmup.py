"""Start-up warm-up through the serving path: synthetic requests driven through the engine's own
scheduler, batch builder, model, sampler and overlap loop, so that every kind of step a server
meets compiles its kernels before the first real request.

The runner's warm-up (one sequence's prefill) leaves out what only concurrent requests do: a
prefill step of several sequences, decode rows sharing a step with a prefill chunk, sampled and
greedy rows together, one-token and block-aligned prompts, a sequence past dense_len beside dense
ones, and, with speculation, verify steps mixed with prefill. Each compiles Triton specialisations
of its own (an int argument equal to 1, a multiple of 16 or neither is a different kernel), and a
first real step that needs one waits for its compile: the S8 tier's first eight requests once
waited ~40 s for their first token that way.

The requests' tokens are synthetic; afterwards the prefix cache is emptied and the counters are
reset, so the engine starts serving exactly as without the warm-up.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from salaserve.core.sampling_params import SamplingParams

log = logging.getLogger("salaserve")

GREEDY = {"temperature": 0.0}
SAMPLED = {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "min_p": 0.01}


@dataclass(frozen=True)
class WarmRequest:
    at_step: int  # engine step after which it is added (0: before the first)
    prompt_len: int
    new_tokens: int
    params: dict
    repeat: bool = False  # a repeating prompt: n-gram drafts find matches (speculation's verify steps)


def warmup_requests(dense_len: int, block_size: int, chunk: int, room: int) -> list[WarmRequest]:
    """The warm-up's requests, for a prefill budget of `chunk` tokens and `room` tokens of cache.
    Step by step (chunk >= dense_len + block_size): one sequence's chunk; a prefill of four
    sequences (a sparse continuation, odd, 1-token and block-aligned prompts); decodes; decode rows
    beside a new prompt's chunk, beside a repeating prompt's (speculation) and beside a short one
    (under 64 tokens the Lightning layers take fla's recurrent kernel); then, each alone once the
    others are done, a dense prompt, a short one and one crossing dense_len in two chunks."""
    # longer than a chunk (its first step is its own) and crossing dense_len, where it fits
    long_len = max(1, min(max(dense_len + block_size, chunk) + 37, room // 2))
    return [
        WarmRequest(0, long_len, 6, GREEDY),
        WarmRequest(0, 301, 9, SAMPLED),
        WarmRequest(0, 1, 5, GREEDY),
        WarmRequest(0, 128, 7, GREEDY),
        WarmRequest(3, 517, 4, SAMPLED),
        WarmRequest(4, 97, 12, GREEDY, repeat=True),
        WarmRequest(6, 40, 3, GREEDY),
        WarmRequest(40, 300, 3, GREEDY),
        WarmRequest(50, 40, 3, SAMPLED),
        WarmRequest(60, long_len, 3, GREEDY),
    ]


def _prompt(req: WarmRequest, vocab: int, salt: int) -> list[int]:
    span = max(1, vocab - 32)
    if req.repeat:
        unit = [16 + (salt * 131 + j * 17) % span for j in range(5)]
        return (unit * (req.prompt_len // 5 + 1))[:req.prompt_len]
    return [16 + (salt * 7919 + j * 104729) % span for j in range(req.prompt_len)]


def warm_up_engine(engine) -> float:
    """Run the warm-up requests through `engine` to completion; returns the seconds it took.
    Leaves the engine as it found it: no request, empty prefix cache, zeroed counters."""
    t0 = time.perf_counter()
    cfg, sc = engine.cfg, engine.cfg.sparse
    room = min(engine.runner.capacity_tokens, engine.context_length) - 64
    plan = warmup_requests(sc.dense_len, sc.block_size, engine.args.chunked_prefill_size, room)
    pending = sorted(enumerate(plan), key=lambda x: x[1].at_step)
    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[0][1].at_step <= step:
            i, req = pending.pop(0)
            if req.prompt_len + req.new_tokens < room:
                engine.add_request(f"warmup-{i}", _prompt(req, cfg.vocab_size, i),
                                   SamplingParams(max_new_tokens=req.new_tokens, ignore_eos=True, **req.params))
        engine.step()
        step += 1
    engine.flush_cache()
    engine.reset_stats()
    seconds = time.perf_counter() - t0
    log.info("serving warm-up: %d engine steps in %.1f s", step, seconds)
    return seconds
