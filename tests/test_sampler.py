"""Sampler and SamplingParams: exactness against straightforward references, statistics."""

import dataclasses
import math
import random

import pytest
import torch

from salaserve.core.sampling_params import SamplingParams as P
from salaserve.engine.sampler import Sampler, SamplingState, apply_penalties


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(random.randrange(2**31))


def states_for(*params, **kw):
    return [SamplingState(p, **kw) for p in params]


# --- greedy -------------------------------------------------------------------------------


def test_greedy_is_argmax_and_draws_no_randomness(gen):
    logits = torch.randn(16, 1000, generator=gen)
    sampler = Sampler()
    rng = torch.get_rng_state()
    out = sampler.sample(logits, states_for(*[P(temperature=0.0)] * 8, *[P(temperature=1e-7, seed=5)] * 8))
    assert out.token_ids == logits.argmax(-1).tolist()
    assert torch.equal(torch.get_rng_state(), rng)
    assert out.logprobs is None and out.top_logprobs is None


def test_top_k_one_equals_greedy_in_mixed_batch(gen):
    logits = torch.randn(12, 500, generator=gen)
    params = [P(temperature=0.8, top_k=1), P(temperature=2.0), P(temperature=0.0, seed=1)] * 4
    out = Sampler(seed=0).sample(logits, states_for(*params))
    argmax = logits.argmax(-1).tolist()
    for i, p in enumerate(params):
        if p.is_greedy:
            assert out.token_ids[i] == argmax[i]


def test_greedy_ties_pick_lowest_id():
    logits = torch.zeros(1, 10)
    logits[0, [3, 7]] = 5.0
    assert Sampler().sample(logits, states_for(P(temperature=0))).token_ids == [3]


# --- seeded reproducibility ----------------------------------------------------------------


def _run_steps(sampler, logits_per_step, states, row):
    toks = []
    for logits in logits_per_step:
        toks.append(sampler.sample(logits, states).token_ids[row])
    return toks


@pytest.mark.parametrize(
    "params", [P(seed=1234), P(seed=99, top_k=40, top_p=0.9), P(seed=7, min_p=0.02, temperature=1.5)]
)
def test_seeded_rows_independent_of_batch(gen, params):
    steps, vocab = 12, 300
    target = torch.randn(steps, vocab, generator=gen) * 2

    alone = _run_steps(Sampler(), [target[t : t + 1] for t in range(steps)], [SamplingState(params)], 0)
    again = _run_steps(Sampler(), [target[t : t + 1] for t in range(steps)], [SamplingState(params)], 0)
    assert alone == again

    # Same request among others (unseeded, other seeds, greedy, full-vocab rows that force the
    # sort path instead of topk), at a different position, with a differently seeded sampler.
    others = [P(), P(seed=5, top_k=3), P(temperature=0), P(top_p=0.5), P(seed=6, repetition_penalty=1.2)]
    states = [SamplingState(p) for p in others]
    states.insert(3, SamplingState(params))
    batch = []
    for t in range(steps):
        rows = torch.randn(len(states), vocab, generator=gen)
        rows[3] = target[t]
        batch.append(rows)
    assert _run_steps(Sampler(seed=42), batch, states, 3) == alone

    other_seed = dataclasses.replace(params, seed=params.seed + 1)
    single = [target[t : t + 1] for t in range(steps)]
    assert _run_steps(Sampler(), single, [SamplingState(other_seed)], 0) != alone


def test_uncommitted_sample_repeats_the_step(gen):
    logits = torch.randn(1, 1000, generator=gen)
    st = [SamplingState(P(seed=3))]
    a = Sampler().sample(logits, st, commit=False).token_ids
    assert st[0].num_generated == 0
    b = Sampler().sample(logits, st).token_ids
    assert a == b and st[0].output_ids == a


# --- distributions --------------------------------------------------------------------------


def _empirical(tokens, vocab):
    return torch.bincount(torch.tensor(tokens), minlength=vocab).double() / len(tokens)


def _reference_filter(logits_row, p: P):
    """Straightforward per-token reference of steps 4-7: the renormalised distribution."""
    probs = torch.softmax(logits_row.double() / p.temperature, -1).tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    k = len(order) if p.top_k <= 0 else min(p.top_k, len(order))
    kept = order[:k]
    if p.top_p < 1.0:
        mass = sum(probs[i] for i in kept)
        nucleus, acc = [], 0.0
        for i in kept:
            if acc >= p.top_p * mass:
                break
            nucleus.append(i)
            acc += probs[i]
        kept = nucleus
    top = probs[order[0]]
    kept = [i for i in kept if probs[i] >= p.min_p * top]
    out = torch.zeros(len(probs), dtype=torch.double)
    for i in kept:
        out[i] = probs[i]
    return out / out.sum()


@pytest.mark.parametrize(
    "params",
    [
        P(temperature=0.7), P(temperature=1.3, top_k=4), P(top_p=0.7), P(top_k=6, top_p=0.8),
        P(min_p=0.15, temperature=0.9),
    ],
)
def test_distribution_matches_softmax(gen, params):
    vocab, n = 10, 40_000
    logits = torch.randn(1, vocab, generator=gen) * 1.5
    torch.manual_seed(0)
    out = Sampler().sample(logits.expand(n, vocab), states_for(*[params] * n))
    want = _reference_filter(logits[0], params)
    got = _empirical(out.token_ids, vocab)
    tv = 0.5 * (got - want).abs().sum().item()
    assert tv < 0.02, (tv, got, want)
    assert got[want == 0].sum() == 0


def test_seeded_distribution_matches_softmax(gen):
    # One row per seed: exercises the per-request generators, not the shared one.
    vocab, n = 6, 4000
    logits = torch.randn(1, vocab, generator=gen)
    params = [P(seed=s, temperature=0.8) for s in range(n)]
    out = Sampler().sample(logits.expand(n, vocab), states_for(*params))
    tv = 0.5 * (_empirical(out.token_ids, vocab) - torch.softmax(logits[0].double() / 0.8, -1)).abs().sum()
    assert tv < 0.05


def test_filters_never_pick_filtered_tokens(gen):
    vocab = 200
    params = [
        P(top_k=4, temperature=4.0), P(top_k=17, temperature=3.0), P(top_p=0.3),
        P(top_p=0.9, temperature=2.0),
        P(min_p=0.3), P(min_p=0.05, temperature=5.0), P(top_k=50, top_p=0.5, min_p=0.1), P(seed=11, top_k=2),
    ]
    logits = torch.randn(len(params), vocab, generator=gen) * 3
    ref = [_reference_filter(logits[i], p) for i, p in enumerate(params)]
    allowed = [set(torch.nonzero(r).flatten().tolist()) for r in ref]
    states = states_for(*params)
    sampler = Sampler(seed=1)
    seen = [set() for _ in params]
    for _ in range(300):
        for i, t in enumerate(sampler.sample(logits, states).token_ids):
            assert t in allowed[i], (params[i], t)
            seen[i].add(t)
    # Nor stricter than the reference: where every allowed token has >= 5% mass, all show up.
    broad = [i for i, r in enumerate(ref) if r[r > 0].min() >= 0.05]
    assert 0 in broad
    for i in broad:
        assert seen[i] == allowed[i], (params[i], ref[i][ref[i] > 0])


# --- penalties ------------------------------------------------------------------------------


def _reference_penalised(logits_row, st: SamplingState, vocab):
    p = st.params
    out = logits_row.clone()
    history = set(st.prompt_ids) | set(st.output_ids)
    for v in range(vocab):
        x = out[v].item()
        if v in history:
            x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        c = st.output_ids.count(v)
        x -= p.frequency_penalty * c + p.presence_penalty * (1.0 if c > 0 else 0.0)
        x += (p.logit_bias or {}).get(v, 0.0)
        if st.num_generated < p.min_new_tokens and v in st.min_tokens_block:
            x = -math.inf
        out[v] = x
    return out


def test_penalties_match_reference_loop(gen):
    vocab, steps = 64, 6
    params = [
        P(repetition_penalty=1.5), P(repetition_penalty=0.7), P(frequency_penalty=0.8),
        P(presence_penalty=-1.1), P(frequency_penalty=-0.3, presence_penalty=1.7, repetition_penalty=1.25),
        P(min_new_tokens=3, stop_token_ids=[9, 10]), P(),
        P(logit_bias={3: 5.5, 40: -100.0, 63: 0.25}),
        P(repetition_penalty=1.3, frequency_penalty=0.5, logit_bias={3: -2.0, 9: 7.0}, min_new_tokens=2,
          stop_token_ids=[9]),  # the bias on a blocked token leaves it at -inf
    ]
    states = [
        SamplingState(p, prompt_ids=torch.randint(vocab, (20,), generator=gen).tolist(), eos_token_ids=[2])
        for p in params
    ]
    for st in states[:3]:  # history before the tensors exist: built lazily from it
        for t in torch.randint(vocab, (5,), generator=gen).tolist():
            st.append(t)
    sampler = Sampler(seed=3)
    for _ in range(steps):
        logits = torch.randn(len(states), vocab, generator=gen) * 4
        got = apply_penalties(logits, states)
        for i, st in enumerate(states):
            want = _reference_penalised(logits[i], st, vocab)
            torch.testing.assert_close(got[i], want, rtol=1e-6, atol=1e-6)
        sampler.sample(logits, states)  # commits: counts are updated incrementally
    counts = torch.bincount(torch.tensor(states[2].output_ids), minlength=vocab).float()
    assert torch.equal(states[2].counts, counts)


def test_penalties_do_not_modify_input(gen):
    logits = torch.randn(2, 30, generator=gen)
    before = logits.clone()
    params = P(repetition_penalty=2.0), P(presence_penalty=1.0)
    apply_penalties(logits, states_for(*params, prompt_ids=[1, 2, 3]))
    assert torch.equal(logits, before)


def test_min_new_tokens_blocks_eos_and_stop_ids():
    vocab, eos = 20, 2
    logits = torch.zeros(2, vocab)
    logits[:, eos] = 100.0
    logits[:, 5] = 90.0
    logits[:, 7] = 1.0
    states = [
        SamplingState(P(temperature=0, min_new_tokens=3, ignore_eos=True), eos_token_ids=[eos]),
        SamplingState(P(temperature=0, min_new_tokens=2, stop_token_ids=[5]), eos_token_ids=[eos]),
    ]
    sampler = Sampler()
    toks = [sampler.sample(logits, states).token_ids for _ in range(4)]
    assert [t[0] for t in toks] == [5, 5, 5, eos]
    assert [t[1] for t in toks] == [7, 7, eos, eos]


# --- logprobs -------------------------------------------------------------------------------


@pytest.mark.parametrize("after_temperature", [False, True])
def test_logprobs_are_log_softmax_of_penalised_logits(gen, after_temperature):
    vocab = 300
    params = [
        P(logprobs=True), P(temperature=0.5, top_logprobs=5, logprobs=True), P(),
        P(temperature=0, top_logprobs=20), P(repetition_penalty=1.4, top_k=10, top_logprobs=1, seed=4),
    ]
    states = states_for(*params, prompt_ids=[3, 4, 5])
    logits = torch.randn(len(params), vocab, generator=gen)
    penalised = apply_penalties(logits, states)
    out = Sampler(logprobs_after_temperature=after_temperature).sample(logits, states)
    assert out.logprobs[2] is None and out.top_logprobs[2] is None
    for i, p in enumerate(params):
        if not p.wants_logprobs:
            continue
        temp = p.temperature if after_temperature and not p.is_greedy else 1.0
        lsm = torch.log_softmax(penalised[i].double() / temp, -1)
        assert out.logprobs[i] == pytest.approx(lsm[out.token_ids[i]].item(), abs=1e-5)
        top = out.top_logprobs[i]
        assert len(top) == p.top_logprobs
        want_lp, want_id = lsm.topk(p.top_logprobs) if p.top_logprobs else (torch.empty(0), torch.empty(0))
        assert [t for t, _ in top] == want_id.tolist()
        assert [v for _, v in top] == pytest.approx(want_lp.tolist(), abs=1e-5)


# --- validation -----------------------------------------------------------------------------


BAD = [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=101.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature="hot"), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.01), "top_p"),
    (dict(top_p=float("inf")), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(top_k=True), "top_k"),
    (dict(min_p=-0.01), "min_p"),
    (dict(min_p=1.5), "min_p"),
    (dict(frequency_penalty=2.5), "frequency_penalty"),
    (dict(presence_penalty=-2.01), "presence_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=11.0), "repetition_penalty"),
    (dict(max_new_tokens=-1), "max_new_tokens"),
    (dict(max_new_tokens=10.0), "max_new_tokens"),
    (dict(min_new_tokens=-1), "min_new_tokens"),
    (dict(min_new_tokens=20, max_new_tokens=10), "min_new_tokens"),
    (dict(stop=[""]), "stop"),
    (dict(stop=[f"s{i}" for i in range(17)]), "stop"),
    (dict(stop=["ok", 3]), "stop"),
    (dict(stop=5), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(stop_token_ids=[1000]), "stop_token_ids"),
    (dict(stop_token_ids=["1"]), "stop_token_ids"),
    (dict(top_logprobs=21), "top_logprobs"),
    (dict(top_logprobs=-1), "top_logprobs"),
    (dict(n=0), "n"),
    (dict(seed=-5), "seed"),
    (dict(seed="7"), "seed"),
    (dict(ignore_eos="yes"), "ignore_eos"),
    (dict(logprobs=1), "logprobs"),
    (dict(logit_bias=[1, 2]), "logit_bias"),
    (dict(logit_bias={"x": 1.0}), "logit_bias"),
    (dict(logit_bias={"1.5": 1.0}), "logit_bias"),
    (dict(logit_bias={"-1": 1.0}), "logit_bias"),
    (dict(logit_bias={"1000": 1.0}), "logit_bias"),
    (dict(logit_bias={True: 1.0}), "logit_bias"),
    (dict(logit_bias={"5": "high"}), "logit_bias"),
    (dict(logit_bias={"5": float("inf")}), "logit_bias"),
    (dict(logit_bias={"5": 2e9}), "logit_bias"),
    (dict(logit_bias={"5": 1.0, "05": 2.0}), "logit_bias"),
]


@pytest.mark.parametrize("kwargs,field", BAD, ids=[f"{f}={list(k.values())[0]!r}"[:40] for k, f in BAD])
def test_validate_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        P(**kwargs).validate(vocab_size=1000)
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        P.from_dict(kwargs, vocab_size=1000)


def test_validate_accepts_sane_params():
    P().validate(vocab_size=10)
    edge = P(temperature=0, top_k=0, top_p=1, min_p=1, stop="x", stop_token_ids=[9], seed=2**64 - 1)
    edge.validate(vocab_size=10)
    P(max_new_tokens=None, min_new_tokens=5).validate()
    with pytest.raises(ValueError, match="max_new_tokens"):
        P(max_new_tokens=4097).validate(max_new_tokens_cap=4096)


def test_from_dict_keys():
    p = P.from_dict(
        {"temperature": 0, "max_new_tokens": 5, "stop": "##", "sampling_seed": 3, "stream_interval": 2,
         "json_schema": None, "top_k": None, "custom_params": {"a": 1}}
    )
    assert (p.is_greedy, p.max_new_tokens, p.stop_strs, p.seed, p.top_k) == (True, 5, ["##"], 3, -1)
    assert p.extra == {"stream_interval": 2, "custom_params": {"a": 1}}
    assert P.from_dict({"max_new_tokens": None}).max_new_tokens is None
    assert P.from_dict(None) == P()
    with pytest.raises(ValueError, match="bogus.*typo"):
        P.from_dict({"typo": 1, "bogus": 2})
    assert P.from_dict({"structural_tag": '{"type": "structural_tag"}'}).structural_tag  # (compiled by the engine)
    with pytest.raises(ValueError, match="set one of"):
        P.from_dict({"structural_tag": "{}", "regex": "a"})
    assert P.from_dict({"stop_regex": "a+b"}).stop_regexes == ["a+b"]
    assert P.from_dict({"stop_regex": ["x", "y{2}"]}).stop_regexes == ["x", "y{2}"]
    for bad, msg in (("(", "not a valid regular expression"), ([""], "non-empty"), (3, "string or a list"),
                     (["a"] * 17, "at most 16")):
        with pytest.raises(ValueError, match=msg):
            P.from_dict({"stop_regex": bad})
    assert P.from_dict({"regex": "a+", "json_schema": None}).regex == "a+"
    with pytest.raises(ValueError, match="set one of"):
        P.from_dict({"regex": "a+", "ebnf": 'root ::= "a"'})
    with pytest.raises(ValueError, match="json_schema: must be a non-empty string"):
        P.from_dict({"json_schema": {"type": "object"}})
    with pytest.raises(ValueError, match="sampling_seed"):
        P.from_dict({"seed": 1, "sampling_seed": 2})


def test_logit_bias_from_json_keys():
    """JSON objects key token ids as strings; validate makes them ints. An empty map is no bias."""
    p = P.from_dict({"logit_bias": {"7": 3, " 12": -100.5, "0": 0}}, vocab_size=20)
    assert p.logit_bias == {7: 3.0, 12: -100.5, 0: 0.0} and all(type(t) is int for t in p.logit_bias)
    assert P.from_dict({"logit_bias": {}}).logit_bias is None
    assert P.from_dict({"logit_bias": None}).logit_bias is None
    p.validate(vocab_size=20)  # idempotent
    assert p.logit_bias == {7: 3.0, 12: -100.5, 0: 0.0}


def test_logit_bias_steers_greedy_and_sampled_rows(gen):
    """+100 makes a token the argmax; -100 keeps a sampled row off its most likely tokens."""
    vocab = 50
    logits = torch.randn(3, vocab, generator=gen)
    top = logits.argmax(dim=-1)
    banned = logits[2].topk(5).indices.tolist()
    states = states_for(P(temperature=0, logit_bias={int(top[0]) ^ 1: 100.0}), P(temperature=0),
                        P(temperature=1.0, logit_bias={t: -100.0 for t in banned}))
    sampler = Sampler(seed=int(torch.randint(2**31, (1,), generator=gen)))
    for _ in range(50):
        ids = sampler.sample(logits, states, commit=False).token_ids
        assert ids[0] == int(top[0]) ^ 1 and ids[1] == int(top[1]) and ids[2] not in banned


# --- device ---------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_matches_cpu_semantics():
    dev = torch.device("cuda")
    logits = torch.randn(8, 50_000, device=dev)
    params = [P(temperature=0), P(seed=1, top_k=20), P(top_p=0.8, repetition_penalty=1.3)] * 2
    params += [P(seed=2, min_p=0.1)] * 2
    out = Sampler().sample(logits, states_for(*params, prompt_ids=[1, 2]))
    assert out.token_ids[0] == logits[0].argmax().item()
    alone = Sampler().sample(logits[1:2], [SamplingState(P(seed=1, top_k=20))]).token_ids[0]
    assert out.token_ids[1] == alone
    # logit_bias on the device, with the on-device (overlap) path too
    cold = int(logits[0].argmin())
    biased = [SamplingState(P(temperature=0, logit_bias={cold: 1e3})), SamplingState(P(temperature=0))]
    assert Sampler().sample(logits[:2], biased).token_ids == [cold, int(logits[1].argmax())]
    assert Sampler().sample_on_device(logits[:2], biased).tolist() == [cold, int(logits[1].argmax())]
