"""Speculative decoding on the tiny model (fp32, CPU): exactness, acceptance, resources."""

import random

import pytest
import torch

from engine_utils import run_requests
from salaserve.core.sampling_params import SamplingParams
from salaserve.engine.engine import Engine
from salaserve.spec.accept import accept_greedy, accept_sampling, target_probs
from salaserve.spec.ngram import NgramDrafter
from salaserve.spec.oracle import OracleDrafter


def brute_force_propose(tokens, k, max_n=4, min_n=1):
    L = len(tokens)
    for n in range(min(max_n, L), min_n - 1, -1):
        suffix = tokens[L - n:]
        for e in range(L - 2, n - 2, -1):  # most recent earlier occurrence ending at e
            if tokens[e - n + 1:e + 1] == suffix:
                return tokens[e + 1:e + 1 + k]
    return []


def test_ngram_drafter_matches_brute_force():
    rng = random.Random(0)
    for trial in range(30):
        tokens = [rng.randrange(6) for _ in range(rng.randrange(1, 60))]
        d = NgramDrafter()
        # grow the sequence token by token, proposing at every step (incremental index)
        for L in range(1, len(tokens) + 1):
            assert d.propose(tokens[:L], 5) == brute_force_propose(tokens[:L], 5)


def test_accept_greedy():
    logits = torch.full((4, 10), -1.0)
    for i, t in enumerate([3, 5, 7, 9]):
        logits[i, t] = 1.0
    assert accept_greedy(logits, [3, 5, 7]) == [3, 5, 7, 9]
    assert accept_greedy(logits, [3, 6, 7]) == [3, 5]
    assert accept_greedy(logits, [4, 5, 7]) == [3]


def test_rejection_sampling_matches_target_distribution():
    """The first emitted token is distributed as the target's, whatever the (point-mass) draft."""
    params = SamplingParams(temperature=1.0, top_k=4)
    logits = torch.tensor([[0.5, 1.5, -0.3, 0.9, 0.0, 2.0]] * 3)
    p = target_probs(logits, params)[0]
    assert p[4] == 0 and p[2] == 0  # top-k=4 keeps ids 5, 1, 3, 0
    g = torch.Generator().manual_seed(0)
    n = 20000
    for draft in ([1, 1], [2, 5], [5, 3]):
        counts = torch.zeros(6)
        seconds = torch.zeros(6)
        for _ in range(n):
            out = accept_sampling(logits, draft, params, g)
            counts[out[0]] += 1
            if len(out) > 1:
                seconds[out[1]] += 1
        freq = counts / n
        # 4-sigma binomial bound per token
        sigma = (p * (1 - p) / n).sqrt()
        assert ((freq - p).abs() <= 4 * sigma + 1e-9).all(), (draft, freq, p)
        if draft[0] in (1, 5):  # when the first draft was accepted, the second token is ~ p too
            sec = seconds / seconds.sum()
            assert (sec - p).abs().max() < 0.03


def make_engine(model_dir, spec, **kw):
    return Engine(model=model_dir, device="cpu", dtype="float32", backend="torch", chunked_prefill_size=64,
                  max_running_requests=32, speculative_algorithm="NGRAM" if spec else None,
                  speculative_num_draft_tokens=6, speculative_max_batch=32, **kw)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(3)
    out = []
    for i in range(32):
        if i % 2:  # repetitive prompts
            base = [rng.randrange(3, 8000) for _ in range(rng.randrange(2, 9))]
            L = rng.choice([30, 90, 110, 125, 180])
        else:
            base = [rng.randrange(3, 8000) for _ in range(300)]
            L = rng.choice([5, 60, 100, 120, 127, 140, 260])
        out.append((base * 300)[:L])
    # sparse prompts of 15 (mod 16) tokens: stage 1 hides a C2 entry from their prompt tokens (the
    # prompt rule), never from verify or decode tokens, so verify still equals plain decoding
    for L in (143, 271):
        out.append(([rng.randrange(3, 8000) for _ in range(5)] * 60)[:L])
    return out


def test_greedy_identical_with_and_without_speculation(tiny_model_dir, prompts):
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    plain = run_requests(make_engine(tiny_model_dir, False), prompts, params)

    # n-gram drafts (rarely right on random weights) ...
    eng = make_engine(tiny_model_dir, True)
    assert run_requests(eng, prompts, params) == plain

    # ... and an oracle that knows the plain output but corrupts every 3rd draft: many accepted
    # tokens, partial acceptance, rollback, drafts crossing dense_len (128) and C1/C2 boundaries
    oracle = make_engine(tiny_model_dir, True)
    conts = {i: plain[f"r{i}"] for i in range(len(prompts))}
    oracle.make_drafter = lambda req: OracleDrafter(req.num_prompt, conts[int(req.rid[1:])], error_every=3,
                                                    vocab_size=oracle.cfg.vocab_size)
    assert run_requests(oracle, prompts, params) == plain
    assert oracle.avg_spec_accept_length > 2.0  # not vacuous: drafts were accepted
    assert oracle.stats["spec_accepted_tokens"] < oracle.stats["spec_draft_tokens"]  # and some rejected
    c = oracle.resource_counters()
    assert c["pages_used"] == 0 and c["slots_used"] == 0 and c["compressed_entries"] == 0


def test_abort_during_verify_frees_resources(tiny_model_dir, prompts):
    eng = make_engine(tiny_model_dir, True)
    initial = eng.resource_counters()
    eng.make_drafter = lambda req: OracleDrafter(req.num_prompt, [7] * 100)
    for i, p in enumerate(prompts[:8]):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True))
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
        if steps % 3 == 0:
            live = sorted(eng.requests)
            if live:
                eng.abort(live[0])
    assert eng.stats["spec_verify_steps"] > 0
    assert eng.resource_counters() == initial


def test_seeded_sampling_with_speculation_runs(tiny_model_dir, prompts):
    eng = make_engine(tiny_model_dir, True)
    eng.make_drafter = lambda req: OracleDrafter(req.num_prompt, [11] * 100)
    out = run_requests(eng, prompts[:4], SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_new_tokens=10,
                                                   ignore_eos=True))
    assert all(len(v) == 10 for v in out.values())
    assert eng.stats["spec_verify_steps"] > 0


def test_ngram_drafts_accepted_on_the_trained_model():
    """With the shipped trained model, a repetitive prompt is continued the way it repeats, so
    n-gram drafts are accepted (accept length > 1), and greedy output stays identical."""
    import os

    from salaserve.engine.llm import LLM
    from salaserve.model.default import PACKAGED

    if not os.path.isfile(os.path.join(PACKAGED, "config.json")):
        pytest.skip("no trained default model shipped")
    prompt = "".join(f"    self.value_{i} = value_{i}\n" for i in range(12)) + "    self.value_12"
    outs = {}
    for spec in (False, True):
        kw = dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=4) if spec else {}
        llm = LLM(PACKAGED, device="cpu", dtype="float32", backend="torch", **kw)
        outs[spec] = llm.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True))[0]
        if spec:
            assert llm.engine.avg_spec_accept_length > 1.0
    assert outs[True].token_ids == outs[False].token_ids


def test_triton_verify_path_under_interpreter():
    """The triton backend's verify path (lightning_verify / lightning_commit, per-token decode
    attention, mixed verify + decode + prefill steps) against plain torch decoding: the cases live
    in tests/spec_interp_cases.py and run in a subprocess with TRITON_INTERPRET=1."""
    from pathlib import Path

    from kernel_checks import run_interpreter_cases

    run_interpreter_cases(Path(__file__).resolve().parent / "spec_interp_cases.py")


def test_padded_verify_steps_equal_plain(tiny_model_dir, prompts):
    """Verify steps padded with filler tokens (as the verify CUDA graphs need) change nothing: the
    filler's k/v go to the scratch page, its rows are dropped, resources come back."""
    params = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)
    plain = run_requests(make_engine(tiny_model_dir, False), prompts[:12], params)
    eng = make_engine(tiny_model_dir, True)
    eng.runner.enable_verify_padding([2, 3, 5, 7])
    initial = eng.resource_counters()
    conts = {f"r{i}": plain[f"r{i}"] for i in range(12)}
    eng.make_drafter = lambda req: OracleDrafter(req.num_prompt, conts[req.rid], error_every=2,
                                                 vocab_size=eng.cfg.vocab_size)
    padded_steps = []
    build = eng.runner.build_batch

    def spy(work):
        batch = build(work)
        padded_steps.append(eng.runner.real_rows is not None)
        return batch

    eng.runner.build_batch = spy
    assert run_requests(eng, prompts[:12], params) == plain
    assert any(padded_steps)  # not vacuous
    assert eng.stats["spec_accepted_tokens"] > 0
    assert eng.resource_counters() == initial


def test_draft_tree_metadata_and_greedy_acceptance():
    from salaserve.spec.tree import DraftTree, accept_greedy_tree

    chain = DraftTree.chain([5, 6, 7])
    assert chain.is_chain and chain.parents == (-1, 0, 1) and chain.depths() == [1, 2, 3]
    assert torch.equal(chain.ancestor_mask(), torch.ones(4, 4, dtype=torch.bool).tril())
    #        root
    #       /    \\
    #     a=5    b=8          candidates 0, 1 (depth 1)
    #     |      |  \\
    #    c=6    d=9  e=4      candidates 2 (parent 0), 3 and 4 (parent 1)
    tree = DraftTree((5, 8, 6, 9, 4), (-1, -1, 0, 1, 1))
    assert not tree.is_chain and tree.depths() == [1, 1, 2, 2, 2]
    assert tree.children(-1) == [0, 1] and tree.children(1) == [3, 4] and tree.first_path() == [5, 6]
    m = tree.ancestor_mask()
    assert m[5].tolist() == [True, False, True, False, False, True]  # e sees root, b, itself
    assert m[3].tolist() == [True, True, False, True, False, False]  # c sees root, a, itself
    with pytest.raises(ValueError, match="parents must come first"):
        DraftTree((1, 2), (1, -1))

    V = 12
    def logits_for(targets):  # one row per verify row with the given argmax
        return torch.nn.functional.one_hot(torch.tensor(targets), V).float()
    # root -> 8 (b), b -> 4 (e), e -> 11 (bonus): path rows 0, 2, 5
    toks, rows = accept_greedy_tree(logits_for([8, 6, 4, 0, 0, 11]), tree)
    assert toks == [8, 4, 11] and rows == [0, 2, 5]
    toks, rows = accept_greedy_tree(logits_for([3, 0, 0, 0, 0, 0]), tree)  # no child matches
    assert toks == [3] and rows == [0]
    # a chain accepts exactly as accept_greedy
    lg = logits_for([5, 6, 2, 9])
    assert accept_greedy_tree(lg, chain)[0] == accept_greedy(lg, [5, 6, 7])


def test_tree_drafter_keeps_greedy_output(tiny_model_dir, prompts):
    """A drafter returning DraftTree (the torch backend verifies it whole; see test_spec_tree.py
    for trees on a backend without tree verify): output unchanged."""
    from salaserve.spec.tree import DraftTree

    params = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    plain = run_requests(make_engine(tiny_model_dir, False), prompts[:6], params)

    class TreeOracle:  # the right continuation first, a wrong sibling at every level
        def __init__(self, req):
            self.oracle = OracleDrafter(req.num_prompt, plain[req.rid])

        def propose(self, tokens, k):
            path = self.oracle.propose(tokens, k)
            toks, parents = [], []
            for i, t in enumerate(path):
                parent = 2 * (i - 1) if i else -1
                toks += [t, (t + 1) % 8000]
                parents += [parent, parent]
            return DraftTree(tuple(toks), tuple(parents))

    eng = make_engine(tiny_model_dir, True)
    eng.make_drafter = TreeOracle
    assert run_requests(eng, prompts[:6], params) == plain
    assert eng.stats["spec_accepted_tokens"] > 0


def test_logit_bias_requests_are_not_speculated(tiny_model_dir, prompts):
    """The verify reads the raw logits, so a biased request decodes without drafts; here drafts of
    the unbiased continuation would otherwise be accepted and the bias lost."""
    unbiased = run_requests(make_engine(tiny_model_dir, False), prompts[:4],
                       SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True))
    favoured = 4321
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True, logit_bias={favoured: 1e4})
    plain = run_requests(make_engine(tiny_model_dir, False), prompts[:4], params)
    assert all(v == [favoured] * 12 for v in plain.values())
    eng = make_engine(tiny_model_dir, True)
    conts = {i: unbiased[f"r{i}"] for i in range(4)}
    eng.make_drafter = lambda req: OracleDrafter(req.num_prompt, conts[int(req.rid[1:])])
    assert run_requests(eng, prompts[:4], params) == plain
    assert eng.stats["spec_verify_steps"] == 0
