"""The prefix cache (engine/prefix_cache.py): prompts that extend a cached prompt, or share a
cached common prefix, prefill only the rest and produce what an engine without the cache does;
entries give their pages back under pressure, before anything running is preempted; nothing leaks."""

import random

import pytest
import torch

from salaserve.core.sampling_params import SamplingParams
from salaserve.engine.engine import Engine
from salaserve.engine.prefix_cache import PrefixCache, _common_prefix

LOGPROB_TOL = 1e-4  # fp32: the cached and uncached runs differ only in where prefill chunks end


def make_engine(model_dir, **kw):
    kw = dict(dict(device="cpu", dtype="float32", backend="torch", chunked_prefill_size=64,
                   max_running_requests=4, prefix_cache_min_tokens=40), **kw)
    return Engine(model=model_dir, **kw)


def run(engine, rid, prompt, n):
    """One greedy request alone to completion: (tokens, their logprobs)."""
    engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True, logprobs=True))
    toks, lps = [], []
    while engine.has_unfinished():
        for o in engine.step():
            toks += o.new_token_ids
            lps += [lp for lp, _ in (o.logprobs or [])]
    return toks, lps


def test_common_prefix_bisection():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randrange(0, 50)
        a = [rng.randrange(3) for _ in range(n)]
        b = a[:rng.randrange(0, n + 1)] + [rng.randrange(3) for _ in range(rng.randrange(0, 5))]
        want = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), min(len(a), len(b)))
        assert _common_prefix(a, b, min(len(a), len(b))) == want


def test_entries_lookup_split_and_lru():
    c = PrefixCache(max_entries=2, min_tokens=3)
    from salaserve.engine.prefix_cache import CachedPrompt

    assert c.wants([1, 2, 3, 4]) and not c.wants([1, 2])  # too short
    c.add(CachedPrompt([1, 2, 3, 4], [0], 0))
    assert not c.wants([1, 2, 3, 4])  # held already
    assert c.lookup([1, 2, 3, 4]) is None  # not a proper prefix: the request needs a token of its own
    assert c.lookup([1, 2, 3, 4, 5]).tokens == [1, 2, 3, 4]
    assert c.split_point([1, 2, 3, 9, 9]) == 3 and c.split_point([1, 2, 9]) == 0  # 2 < min_tokens
    c.add(CachedPrompt([7, 7, 7], [1], 1))
    c.lookup([1, 2, 3, 4, 0])  # touches the first entry: the second is now the least recently used
    assert c.pop_lru().tokens == [7, 7, 7] and c.num_pages == 1


def test_cached_prefixes_give_the_uncached_outputs(tiny_model_dir):
    """A system prompt shared by four questions, then a second turn of the first conversation:
    the second question's prefill pauses at the shared prefix for a snapshot, the third and fourth
    start from it, the second turn starts from the whole first prompt; the tokens and logprobs
    equal an engine without the cache; everything is given back."""
    # 8 entries: none is evicted here (4 whole prompts and the system prompt, then the second turn)
    cached, plain = make_engine(tiny_model_dir, prefix_cache_slots=8), make_engine(tiny_model_dir, prefix_cache_slots=0)
    initial = cached.resource_counters()
    rng = random.Random(1)
    vocab = cached.cfg.vocab_size
    system = [rng.randrange(3, vocab - 8) for _ in range(150)]
    questions = [[rng.randrange(3, vocab - 8) for _ in range(rng.randrange(5, 40))] for _ in range(4)]
    prompts = [system + q for q in questions]
    saved = []
    for i, p in enumerate(prompts):
        before = cached.stats["cached_prompt_tokens"]
        got, want = run(cached, f"q{i}", p, 12), run(plain, f"q{i}", p, 12)
        assert got[0] == want[0], i
        assert max(abs(a - b) for a, b in zip(got[1], want[1])) < LOGPROB_TOL, i
        saved.append(cached.stats["cached_prompt_tokens"] - before)
        if i == 0:
            answer = got[0]
    # the shared snapshot (150 tokens >= dense_len 128) was computed under the second prompt's
    # stage-1 class (SparseConfig.prompt_class): the fourth prompt, 159 = 15 (mod 16) tokens, is of
    # another one, computes its whole prompt and makes a snapshot of its own
    sc = cached.cfg.sparse
    assert [sc.prompt_class(len(p)) for p in prompts] == [0, 0, 0, 1]
    assert saved[:2] == [0, 0] and saved[2] >= len(system) and saved[3] == 0
    assert sorted(e.variant for e in cached.prefix_cache.entries if e.tokens == system) == [0, 1]
    second_turn = prompts[0] + answer + [rng.randrange(3, vocab - 8) for _ in range(20)]
    before = cached.stats["cached_prompt_tokens"]
    got, want = run(cached, "turn2", second_turn, 12), run(plain, "turn2", second_turn, 12)
    assert got[0] == want[0] and max(abs(a - b) for a, b in zip(got[1], want[1])) < LOGPROB_TOL
    assert cached.stats["cached_prompt_tokens"] - before == len(prompts[0])  # the whole first prompt
    assert plain.stats["cached_prompt_tokens"] == 0
    assert cached.resource_counters() == initial
    c = cached.runner.caches
    assert cached.prefix_cache.entries and c.kv.allocator.num_used == cached.prefix_cache.num_pages
    assert cached.flush_cache() and not cached.prefix_cache.entries
    assert c.kv.allocator.num_used == 0 and c.compressed.entries_in_use == 0
    assert c.states.num_free == c.states.num_slots


def test_entries_are_reused_within_a_prompt_class(tiny_model_dir):
    """The stage-1 prompt rule hides a C2 entry from the prompt tokens of a prompt of 15 (mod 16)
    tokens (tiny config), so cached values past dense_len (128) depend on the prompt's class: a
    prompt reuses only an entry of its own class (or one shorter than dense_len, computed densely,
    which fits any), and each class gets its snapshot of a shared prefix. Every output equals the
    uncached engine's."""
    cached, plain = make_engine(tiny_model_dir, prefix_cache_slots=16), make_engine(tiny_model_dir, prefix_cache_slots=0)
    sc = cached.cfg.sparse
    rng = random.Random(7)
    vocab = cached.cfg.vocab_size

    def tokens(n):
        return [rng.randrange(3, vocab - 8) for _ in range(n)]

    def check(rid, prompt, want_class, want_saved):
        before = cached.stats["cached_prompt_tokens"]
        got, want = run(cached, rid, prompt, 6), run(plain, rid, prompt, 6)
        assert sc.prompt_class(len(prompt)) == want_class, rid
        assert got[0] == want[0] and max(abs(a - b) for a, b in zip(got[1], want[1])) < LOGPROB_TOL, rid
        assert cached.stats["cached_prompt_tokens"] - before == want_saved, rid
        return got[0]

    system = tokens(150)
    check("a", system + tokens(9), 1, 0)  # 159: class 1, cached whole
    check("b", system + tokens(20), 0, 0)  # 170: pauses at 150 for a class-0 snapshot
    check("c", system + tokens(24), 0, 150)
    check("d", system + tokens(41), 1, 0)  # 191: the class-0 snapshot does not fit; a class-1 one
    check("e", system + tokens(57), 1, 150)
    assert sorted(e.variant for e in cached.prefix_cache.entries if e.tokens == system) == [0, 1]
    # a next turn of "a" in another class reuses the class-0 snapshot only; one in the same class
    # reuses the whole of "a"
    first = [e for e in cached.prefix_cache.entries if e.length == 159][0].tokens
    check("a2", first + tokens(11), 0, 150)  # 170
    check("a3", first + tokens(16), 1, 159)  # 175
    # entries shorter than dense_len were computed densely and fit every class
    short = tokens(100)
    check("f", short + tokens(40), 0, 0)
    check("g", short + tokens(30), 0, 0)  # pauses at 100: a snapshot with no class
    check("h", short + tokens(43), 1, 100)
    check("i", short + tokens(44), 0, 100)


@pytest.mark.parametrize("spec", [False, True])
def test_concurrent_requests_under_page_pressure(tiny_model_dir, spec):
    """Many requests over a few shared prefixes, concurrently, in a page pool too small to keep
    every entry, with and without speculative decoding: entries give their pages back when the
    scheduler is short (before any preemption), the outputs equal the uncached engine's, and
    nothing leaks."""
    kw = dict(max_total_tokens=640, max_running_requests=4,
              **(dict(speculative_algorithm="NGRAM", speculative_max_batch=4) if spec else {}))
    cached, plain = make_engine(tiny_model_dir, **kw), make_engine(tiny_model_dir, prefix_cache_slots=0, **kw)
    reclaims, preempted_with_entries = [], []
    real_reclaim, real_preempt = cached._reclaim_pages, cached.scheduler._preempt
    cached.scheduler.reclaim = lambda n: reclaims.append(n) or real_reclaim(n)

    def preempt(victim):  # the cache gives everything back before a running request is preempted
        preempted_with_entries.append(len(cached.prefix_cache.entries))
        real_preempt(victim)

    cached.scheduler._preempt = preempt
    rng = random.Random(2)
    vocab = cached.cfg.vocab_size
    heads = [[rng.randrange(3, vocab - 8) for _ in range(rng.randrange(60, 200))] for _ in range(3)]
    prompts = [rng.choice(heads) + [rng.randrange(3, vocab - 8) for _ in range(rng.randrange(1, 60))]
               for _ in range(24)]
    outs = {}
    for eng in (cached, plain):
        initial = eng.resource_counters()
        res = {}
        for step in range(100000):
            if step < 48 and step % 2 == 0:
                i = step // 2
                eng.add_request(f"r{i}", prompts[i], SamplingParams(temperature=0.0, max_new_tokens=rng.randrange(1, 80)
                                                                    if eng is cached else len(outs["cached"][f"r{i}"]),
                                                                    ignore_eos=True))
            for o in eng.step():
                res.setdefault(o.rid, []).extend(o.new_token_ids)
            c = eng.runner.caches
            assert c.kv.allocator.num_used == eng.resource_counters()["pages_used"] + eng.prefix_cache.num_pages
            if step >= 48 and not eng.has_unfinished():
                break
        outs["cached" if eng is cached else "plain"] = res
        assert eng.resource_counters() == initial
    assert outs["cached"] == outs["plain"]
    assert cached.stats["cached_prompt_tokens"] > 0 and reclaims
    assert preempted_with_entries and not any(preempted_with_entries), preempted_with_entries
    print(f"reclaims {len(reclaims)}, preemptions {cached.scheduler.num_preemptions} (uncached {plain.scheduler.num_preemptions}), "
          f"cached prompt tokens {cached.stats['cached_prompt_tokens']}")


def test_requests_with_prompt_logprobs_compute_their_whole_prompt(tiny_model_dir):
    eng = make_engine(tiny_model_dir)
    rng = random.Random(3)
    prompt = [rng.randrange(3, eng.cfg.vocab_size - 8) for _ in range(100)]
    run(eng, "a", prompt, 4)
    assert eng.prefix_cache.entries
    longer = prompt + [5, 6, 7]
    eng.add_request("b", longer, SamplingParams(max_new_tokens=1, logprob_start_len=0))
    while eng.has_unfinished():
        eng.step()
    assert eng.stats["cached_prompt_tokens"] == 0
    run(eng, "c", longer, 2)
    assert eng.stats["cached_prompt_tokens"] == 100


def test_a_preempted_request_resumes_from_a_cached_prompt(tiny_model_dir):
    """A request preempted after a few tokens recomputes from a cached prompt (its own, kept when
    its prefill completed) rather than from scratch, and ends as an uncached run does."""
    eng = make_engine(tiny_model_dir, overlap_schedule=False)
    plain = make_engine(tiny_model_dir, prefix_cache_slots=0)
    rng = random.Random(4)
    head = [rng.randrange(3, eng.cfg.vocab_size - 8) for _ in range(90)]
    run(eng, "head", head, 2)
    prompt = head + [5, 6, 7, 8]
    eng.add_request("r", prompt, SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True, logprobs=True))
    toks, lps = [], []
    while len(toks) < 5:
        for o in eng.step():
            toks += o.new_token_ids
            lps += [lp for lp, _ in o.logprobs]
    assert eng.stats["cached_prompt_tokens"] == len(head)
    eng.scheduler._preempt(eng.requests["r"])  # as when pages run out
    while eng.has_unfinished():
        for o in eng.step():
            toks += o.new_token_ids
            lps += [lp for lp, _ in o.logprobs]
    assert eng.stats["cached_prompt_tokens"] == len(head) + len(prompt)  # then its own whole prompt
    want_toks, want_lps = run(plain, "r", prompt, 20)
    assert toks == want_toks and max(abs(a - b) for a, b in zip(lps, want_lps)) < LOGPROB_TOL
    assert eng.flush_cache() and eng.runner.caches.kv.allocator.num_used == 0


def test_fp8_kv_pages_and_their_scales_are_cached(tiny_model_dir):
    """With fp8 K/V pages the entries carry the pages' scales: a prompt reusing a cached system
    prompt decodes what the uncached engine does. (fp8 page scales depend on where chunks end, so
    the comparison is with an uncached run whose chunks end at the same places: 64-token chunks
    and a 128-token system prompt.)"""
    rng = random.Random(5)
    eng = make_engine(tiny_model_dir, kv_cache_dtype="fp8_e4m3", chunked_prefill_size=64)
    vocab = eng.cfg.vocab_size
    system = [rng.randrange(3, vocab - 8) for _ in range(128)]
    prompts = [system + [rng.randrange(3, vocab - 8) for _ in range(20)] for _ in range(3)]
    outs = [run(eng, f"q{i}", p, 10) for i, p in enumerate(prompts)]
    assert eng.stats["cached_prompt_tokens"] == len(system)  # the third started from the snapshot
    plain = make_engine(tiny_model_dir, kv_cache_dtype="fp8_e4m3", chunked_prefill_size=64, prefix_cache_slots=0)
    want = run(plain, "q2", prompts[2], 10)
    assert outs[2][0] == want[0] and max(abs(a - b) for a, b in zip(outs[2][1], want[1])) < LOGPROB_TOL


def test_offline_outputs_report_cached_tokens(tiny_model_dir):
    from salaserve.engine.llm import LLM

    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", backend="torch", prefix_cache_min_tokens=40)
    rng = random.Random(6)
    prompt = [rng.randrange(3, llm.config.vocab_size - 8) for _ in range(60)]
    first = llm.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=3))[0]
    second = llm.generate(prompt + first.token_ids + [9, 9], SamplingParams(temperature=0.0, max_new_tokens=3))[0]
    assert (first.cached_tokens, second.cached_tokens) == (0, 60)
