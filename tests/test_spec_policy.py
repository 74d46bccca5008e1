"""Speculation scheduling: the draft shape by load (spec/policy.py) with hysteresis, and EAGLE3's
n-gram routing (spec/routing.py). Engine tests: greedy output is plain decoding's whatever the
shape; no drafts at high load, drafts at batch 1; routed steps do not run the head."""

from __future__ import annotations

import os

import pytest
import torch

from salaserve.core.sampling_params import SamplingParams
from salaserve.engine.llm import LLM
from salaserve.model.eagle3 import Eagle3Config, init_head, save_eagle3
from salaserve.model.eagle3_drafter import Eagle3Drafter
from salaserve.config import ModelConfig
from salaserve.spec.ngram import NgramDrafter
from salaserve.spec.oracle import OracleDrafter
from salaserve.spec.policy import OFF, DraftShape, SpeculationPolicy, parse_levels
from salaserve.spec.routing import NgramRouter


def test_parse_levels():
    assert parse_levels("1:5:4, 4:3") == [(1, DraftShape(5, 4)), (4, DraftShape(3, 1))]
    for bad in ("", "1:5,1:3", "1", "a:2", "0:3", "2:0"):
        with pytest.raises(ValueError):
            parse_levels(bad)


def test_thresholds_and_caps():
    pol = SpeculationPolicy(parse_levels("1:5:4,4:3:2,8:2:1"), max_depth=4, max_topk=3, patience=1)
    # each load once (patience 1); the configured depth and width cap every level
    assert [pol.update(n) for n in (1, 2, 4, 5, 8, 9, 1)] == [
        DraftShape(4, 3), DraftShape(3, 2), DraftShape(3, 2), DraftShape(2, 1), DraftShape(2, 1), OFF,
        DraftShape(4, 3)]
    capped = SpeculationPolicy(parse_levels("1:5,64:2"), max_depth=5, patience=10, hard_cap=8)
    assert capped.update(9) == OFF  # the hard cap does not wait for the hysteresis
    assert capped.update(8) == DraftShape(5, 1)  # (still level 0: the load left it for one step only)


def test_hysteresis_waits_for_patience_steps():
    pol = SpeculationPolicy(parse_levels("1:5,4:3"), max_depth=5, patience=3)
    assert pol.update(1).depth == 5
    # a wobbling load across the threshold never holds a level for 3 steps: no change
    assert [pol.update(n).depth for n in (2, 1, 2, 2, 1, 3, 1)] == [5] * 7
    assert [pol.update(n).depth for n in (3, 3, 3, 3)] == [5, 5, 3, 3]  # the third step in level 1 moves
    assert [pol.update(n).depth for n in (9, 9, 9)] == [3, 3, 0]  # off after patience steps too
    assert [pol.update(n).depth for n in (1, 9, 1, 1, 1)] == [0, 0, 0, 0, 5]  # the count restarts


def test_router_uses_a_long_enough_match_and_the_head_keeps_its_cache(tiny_model_dir):
    """A routed step does not run the head; the states it observed meanwhile are computed at its
    next propose: its cache and tree equal those of a drafter that proposed every step."""
    cfg = ModelConfig.from_pretrained(tiny_model_dir)
    head = init_head(Eagle3Config.for_target(cfg, draft_vocab_size=64), seed=1, std=0.05)
    head.set_vocab_map(torch.arange(64) * 4)
    head.attach_target(torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.1, 1.0)
    H3 = 3 * cfg.hidden_size
    torch.manual_seed(0)
    toks = [1, 10, 11, 12, 13, 20, 21, 10, 11, 12]  # ends with "10 11 12", seen before: a 3-gram hit
    aux = torch.randn(len(toks) + 3, H3)

    class Counting(Eagle3Drafter):
        runs = 0

        def propose(self, tokens, k, topk=None):
            Counting.runs += 1
            return super().propose(tokens, k, topk)

    routed = NgramRouter(Counting(head, depth=3), min_n=3, max_n=4)
    every = Eagle3Drafter(head, depth=3)
    for p in range(5):
        routed.observe(p, aux[p])
        every.observe(p, aux[p])
    assert not isinstance(routed.propose(toks[:6], 3), list) and not routed.routed  # no 3-gram match
    every.propose(toks[:6], 3)
    for p in range(5, len(toks) - 1):
        routed.observe(p, aux[p])
        every.observe(p, aux[p])
        every.propose(toks[:p + 2], 3)
    assert routed.propose(toks, 3) == [13, 20, 21] and routed.routed and Counting.runs == 1
    seq = toks + [13]  # the next step's head draft, after routed steps
    routed.observe(len(toks) - 1, aux[len(toks) - 1])
    every.observe(len(toks) - 1, aux[len(toks) - 1])
    t1, t2 = routed.drafter.propose(seq, 3), every.propose(seq, 3)
    assert t1 == t2 and routed.drafter.cache_pos == every.cache_pos == list(range(len(seq) - 1))
    torch.testing.assert_close(routed.drafter.cache_k, every.cache_k, rtol=1e-5, atol=1e-5)
    # a 2-gram match is not enough at min_n 3
    short = NgramRouter(Eagle3Drafter(head, depth=3), min_n=3, max_n=4)
    assert short.ngram.lookup([1, 7, 8, 9, 7, 8], 2) == (0, [])
    assert NgramDrafter(4, 1).lookup([1, 7, 8, 9, 7, 8], 2) == (2, [9, 7])


PARAMS = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
LOOPY = [1] + [40, 41, 42, 43, 44, 45] * 6  # repeats: prompt lookup always finds a continuation


def test_no_drafts_at_high_load_and_drafts_at_batch_1(tiny_model_dir):
    """An oracle drafter (always right) on NGRAM's path: the policy alone decides whether it runs."""
    prompts = [LOOPY[:n] for n in (30, 31, 32, 33)]
    plain = [o.token_ids for o in LLM(tiny_model_dir, device="cpu").generate(prompts, PARAMS)]
    kw = dict(device="cpu", speculative_algorithm="NGRAM", speculative_load_levels="1:4,2:2",
              speculative_policy_patience=1)

    def run(batch):
        llm = LLM(tiny_model_dir, **kw)
        llm.engine.make_drafter = lambda req: OracleDrafter(req.num_prompt, plain[prompts.index(req.prompt_ids)])
        assert [o.token_ids for o in llm.generate(batch, PARAMS)] == plain[:len(batch)]
        return llm.engine.stats

    busy = run(prompts)  # 4 decode at once: past the last level
    assert busy["spec_verify_steps"] == 0 and busy["spec_draft_tokens"] == 0
    alone = run(prompts[:1])
    assert alone["spec_verify_steps"] > 0 and alone["spec_draft_tokens"] > 0
    assert alone["spec_draft_tokens"] <= 4 * alone["spec_verify_steps"]  # at most level 1's depth


@pytest.fixture(scope="module")
def head_dir(tiny_model_dir, tmp_path_factory):
    cfg = ModelConfig.from_pretrained(tiny_model_dir)
    head = init_head(Eagle3Config.for_target(cfg, draft_vocab_size=512), seed=3, std=0.05)
    head.set_vocab_map(torch.arange(512) * 16)
    d = str(tmp_path_factory.mktemp("eagle3-head"))
    save_eagle3(head, d, dtype=torch.float32)
    return d


def test_eagle3_router_keeps_greedy_output_on_random_weights(tiny_model_dir, head_dir):
    """Random weights never repeat (no route taken): tree drafts of the head, at batch 2 and 1."""
    prompts = [LOOPY, [1] + [5 + (i * 37) % 200 for i in range(40)]]
    plain = [o.token_ids for o in LLM(tiny_model_dir, device="cpu").generate(prompts, PARAMS)]
    llm = LLM(tiny_model_dir, device="cpu", speculative_algorithm="EAGLE3", speculative_draft_model_path=head_dir,
              speculative_eagle_topk=2, speculative_ngram_route=3)
    assert [o.token_ids for o in llm.generate(prompts, PARAMS)] == plain
    assert llm.engine.stats["spec_head_drafts"] > 0
    for i, p in enumerate(prompts):
        llm.engine.reset_stats()
        assert [o.token_ids for o in llm.generate([p], PARAMS)] == [plain[i]]
        assert llm.engine.stats["spec_verify_steps"] > 0


@pytest.mark.parametrize("route", [0, 3])
def test_eagle3_ngram_routing_on_repetitive_code(route):
    """The built-in model and its shipped head on code that repeats itself: with routing some
    steps take prompt lookup's chain instead of the head; greedy output is plain decoding's."""
    from salaserve.engine.llm import load_tokenizer
    from salaserve.model.default import PACKAGED

    src = "def f(x):\n    return x + 1\n\n\ndef g(x):\n    return x + 1\n\n\ndef h(x):\n"
    tok = load_tokenizer(PACKAGED)
    prompt = [1] + tok(src, add_special_tokens=False).input_ids
    plain = LLM(None, device="cpu").generate([prompt], PARAMS)[0].token_ids
    llm = LLM(None, device="cpu", speculative_algorithm="EAGLE3", speculative_ngram_route=route,
              speculative_draft_model_path=os.path.join(PACKAGED, "eagle3"))
    assert llm.generate([prompt], PARAMS)[0].token_ids == plain
    s = llm.engine.stats
    assert s["spec_head_drafts"] > 0
    assert (s["spec_ngram_routed"] > 0) == (route > 0)
    assert s["spec_head_drafts"] + s["spec_ngram_routed"] >= s["spec_verify_steps"]
