"""Every request feature at once, under preemption and random aborts, with and without speculative
decoding: prompt logprobs, logit_bias, grammars, penalties, seeds, greedy, twins (repeated prompts,
which may start from a copy of a prefill), prompts that extend or share a prefix with earlier ones
(the prefix cache). Each finished request keeps its feature's promise,
greedy plain requests equal their solo runs, and every page, state slot and compressed entry
comes back."""

import random
import re

import pytest

from salaserve.core.sampling_params import SamplingParams as P
from salaserve.engine.engine import Engine


def make(model_dir, spec, **kw):
    return Engine(model=model_dir, device="cpu", dtype="float32", backend="torch", chunked_prefill_size=48,
                  max_running_requests=6, speculative_algorithm="NGRAM" if spec else None,
                  speculative_num_draft_tokens=4, speculative_max_batch=6, **kw)


def solo(model_dir, prompt, params):
    eng = make(model_dir, False)
    eng.add_request("solo", prompt, params)
    toks = []
    while eng.has_unfinished():
        for o in eng.step():
            toks += o.new_token_ids
    return toks


def random_request(rng, vocab, earlier):
    prompt = [rng.randrange(3, vocab - 8) for _ in range(rng.randrange(2, 200))]
    kind = rng.choice(["greedy", "sampled", "penalised", "prompt_lp", "score_only", "bias", "regex", "twin"])
    if rng.random() < 0.3:
        kind = rng.choice(["extend", "share"])
    if kind == "twin" and earlier:  # an earlier prompt again: may start from a copy of its prefill
        return "greedy", list(rng.choice(earlier)), P(temperature=0.0, max_new_tokens=rng.randrange(1, 40),
                                                      ignore_eos=True)
    if kind in ("extend", "share") and earlier:  # a recent prompt, or a part of it, then new tokens
        head = list(rng.choice(earlier[-3:]))
        head = head if kind == "extend" else head[:rng.randrange(1, len(head) + 1)]
        return "greedy", head + prompt[:rng.randrange(1, 40)], P(temperature=0.0, max_new_tokens=rng.randrange(1, 40),
                                                                 ignore_eos=True)
    kind = "greedy" if kind in ("twin", "extend", "share") else kind
    new = rng.randrange(1, 40)
    if kind == "greedy":
        return kind, prompt, P(temperature=0.0, max_new_tokens=new, ignore_eos=True)
    if kind == "sampled":
        return kind, prompt, P(temperature=0.9, top_p=0.9, seed=rng.randrange(100), max_new_tokens=new)
    if kind == "penalised":
        return kind, prompt, P(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5, max_new_tokens=new)
    if kind in ("prompt_lp", "score_only"):
        return kind, prompt, P(temperature=0.0, max_new_tokens=0 if kind == "score_only" else new,
                               logprob_start_len=rng.randrange(0, len(prompt) + 2), top_logprobs=rng.choice([0, 2]))
    if kind == "bias":
        return kind, prompt, P(temperature=0.8, max_new_tokens=new, ignore_eos=True, logit_bias={4321: 1e4})
    return kind, prompt, P(temperature=0.8, max_new_tokens=40, regex=r"[a-z]{1,6}\.")


@pytest.mark.parametrize("spec", [False, True])
def test_every_feature_at_once_under_pressure(tiny_model_dir, spec):
    pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    # 40 pages of 16: preemption; prompts of 24+ tokens kept in the prefix cache
    eng = make(tiny_model_dir, spec, max_total_tokens=640, prefix_cache_min_tokens=24)
    eng.scheduler.prompt_logprob_chunk = 24
    initial = eng.resource_counters()
    rng = random.Random(17 + spec)
    reqs, outs, aborted = {}, {}, set()
    for step in range(3000):
        if step < 120 and rng.random() < 0.4:
            rid = f"q{step}"
            reqs[rid] = random_request(rng, eng.cfg.vocab_size, [r[1] for r in reqs.values()])
            if rng.random() < 0.3:  # and at once a twin of it (n > 1 style)
                reqs[rid + "t"] = ("greedy", list(reqs[rid][1]), P(temperature=0.0, max_new_tokens=9, ignore_eos=True))
                eng.add_request(rid + "t", reqs[rid + "t"][1], reqs[rid + "t"][2])
            eng.add_request(rid, reqs[rid][1], reqs[rid][2])
        if rng.random() < 0.03 and eng.requests:
            rid = rng.choice(sorted(eng.requests))
            if eng.abort(rid):
                aborted.add(rid)
        for o in eng.step():
            outs.setdefault(o.rid, []).append(o)
        if step >= 120 and not eng.has_unfinished():
            break
    assert not eng.has_unfinished()
    assert eng.resource_counters() == initial
    assert eng.scheduler.num_preemptions > 0 and len(aborted) >= 2
    assert eng.flush_cache() and eng.runner.caches.kv.allocator.num_used == initial["pages_used"]
    checked = set()
    for rid, (kind, prompt, params) in reqs.items():
        if rid in aborted:
            continue
        os_ = outs[rid]
        toks = [t for o in os_ for t in o.new_token_ids]
        assert os_[-1].finished, rid
        if kind == "greedy":
            assert toks == solo(tiny_model_dir, prompt, params), rid
        elif kind in ("prompt_lp", "score_only"):
            (lps,) = [o.prompt_logprobs for o in os_ if o.prompt_logprobs is not None]
            assert [t for _, t, _ in lps] == prompt[params.logprob_start_len:], rid
            assert kind == "prompt_lp" or toks == []
        elif kind == "bias":
            assert toks == [4321] * params.max_new_tokens, rid
        elif kind == "regex" and os_[-1].finish_reason["type"] == "stop":
            assert re.fullmatch(r"[a-z]{1,6}\.", tok.decode(toks, skip_special_tokens=True)), rid
        checked.add(kind)
    assert {"greedy", "prompt_lp", "bias", "regex"} <= checked
    print(f"spec={spec}: {len(reqs)} requests, {len(aborted)} aborted, {eng.scheduler.num_preemptions} preemptions, "
          f"{eng.stats['spec_verify_steps']} verify steps, {eng.stats['shared_prefill_tokens']} prefill tokens shared")
    assert eng.stats["shared_prefill_tokens"] > 0
