"""Self-consistency of the reference model (the executable spec) on the tiny config, fp32."""

import dataclasses

import pytest
import torch

from salaserve.config import ModelConfig, preset_config
from salaserve.core.weights import random_state_dict
from salaserve.model import reference as ref
from salaserve.model.reference import ReferenceModel

TOL = 1e-4  # max abs logit difference allowed between mathematically identical fp32 schedules


def tiny_model(seed=0, **sparse_overrides) -> ReferenceModel:
    cfg = preset_config("tiny")
    if sparse_overrides:
        cfg = dataclasses.replace(cfg, sparse=dataclasses.replace(cfg.sparse, **sparse_overrides))
    w = random_state_dict(cfg, seed=seed, dtype=torch.float32)
    return ReferenceModel(cfg, w, dtype=torch.float32)


def run_chunks(model, ids, bounds, prompt_len=None):
    """ids fed in the calls bounds[i]:bounds[i+1]; all of them are the prompt unless prompt_len
    says where it ends (the rest are then output tokens, as in a recompute after a preemption)."""
    state = model.new_state(prompt_len=bounds[-1] if prompt_len is None else prompt_len)
    return torch.cat([model.forward(ids[a:b], state) for a, b in zip(bounds[:-1], bounds[1:])])


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=1)


@pytest.mark.parametrize("length", [100, 300])  # all dense (< dense_len 128); crossing into sparse
def test_one_shot_equals_token_by_token_and_uneven_chunks(model, length):
    g = torch.Generator().manual_seed(length)
    ids = torch.randint(3, model.config.vocab_size, (length,), generator=g)
    one_shot = run_chunks(model, ids, [0, length])
    by_token = run_chunks(model, ids, list(range(length + 1)))
    cuts = sorted(set([0, length] + torch.randint(1, length, (6,), generator=g).tolist()))
    uneven = run_chunks(model, ids, cuts)
    assert one_shot.shape == (length, model.config.vocab_size)
    assert torch.isfinite(one_shot).all()
    assert (by_token - one_shot).abs().max().item() <= TOL
    assert (uneven - one_shot).abs().max().item() <= TOL
    # the logits are not degenerate: a spread of values and more than one argmax
    assert one_shot.std().item() > 0.5
    assert one_shot.argmax(-1).unique().numel() > 1


def test_chunk_ending_exactly_at_dense_len(model):
    dense_len = model.config.sparse.dense_len
    ids = torch.randint(3, model.config.vocab_size, (dense_len + 40,), generator=torch.Generator().manual_seed(5))
    a = run_chunks(model, ids, [0, dense_len - 1, dense_len, dense_len + 40])
    b = run_chunks(model, ids, [0, dense_len + 40])
    assert (a - b).abs().max().item() <= TOL


@pytest.mark.parametrize("T,chunk", [(150, 64), (64, 64), (7, 64), (100, 16)])
def test_lightning_chunked_equals_recurrent(T, chunk):
    g = torch.Generator().manual_seed(T * 1000 + chunk)
    H, d = 4, 16
    q, k, v = (torch.randn(T, H, d, generator=g) for _ in range(3))
    log_decay = -torch.tensor(preset_config("tiny").lightning_slopes()[:H])
    s0 = torch.randn(H, d, d, generator=g)
    o_rec, s_rec = ref.gla_recurrent(q, k, v, log_decay, s0.clone(), d ** -0.5)
    o_chk, s_chk = ref.gla_chunked(q, k, v, log_decay, s0.clone(), d ** -0.5, chunk_size=chunk)
    assert (o_rec - o_chk).abs().max().item() <= 1e-4
    assert (s_rec - s_chk).abs().max().item() <= 1e-4
    # the state really decays and accumulates (guards against a no-op implementation)
    assert (s_rec - s0).abs().max().item() > 1e-2


def test_recurrent_matches_explicit_sum():
    """o_t = s * sum_{u<=t} gamma^(t-u) (q_t . k_u) v_u + s * gamma^(t+1) q_t S_-1, by hand."""
    g = torch.Generator().manual_seed(3)
    T, H, d = 9, 2, 4
    q, k, v = (torch.randn(T, H, d, generator=g) for _ in range(3))
    log_decay = torch.tensor([-0.3, -0.05])
    s0 = torch.randn(H, d, d, generator=g)
    o, _ = ref.gla_recurrent(q, k, v, log_decay, s0, 0.5)
    gamma = log_decay.exp()
    for t in range(T):
        for h in range(H):
            want = sum(gamma[h] ** (t - u) * (q[t, h] @ k[u, h]) * v[u, h] for u in range(t + 1))
            want = want + gamma[h] ** (t + 1) * (q[t, h] @ s0[h])
            assert torch.allclose(o[t, h], 0.5 * want, atol=1e-5)


def test_sparse_with_full_topk_equals_dense():
    """A top-k budget that covers every block makes the InfLLM-v2 path dense attention."""
    dense = tiny_model(seed=2, dense_len=10**6)
    sparse_all = tiny_model(seed=2, topk=10**4)
    ids = torch.randint(3, dense.config.vocab_size, (400,), generator=torch.Generator().manual_seed(9))
    a = dense.forward(ids, dense.new_state())
    b = sparse_all.forward(ids, sparse_all.new_state())
    assert (a - b).abs().max().item() <= TOL
    # ... whereas the real budget is sparse at this length and changes the output
    real = tiny_model(seed=2)
    c = real.forward(ids, real.new_state())
    assert (a - c)[200:].abs().max().item() > 1e-2


@pytest.mark.parametrize("L,n1,n2", [(31, 0, 0), (32, 1, 0), (127, 6, 0), (128, 7, 1), (143, 7, 1),
                                     (191, 10, 1), (192, 11, 2)])
def test_compressed_key_counts_real_config(L, n1, n2):
    sc = preset_config("full").sparse
    keys = torch.randn(L, 2, 8)
    c1 = ref.compress_keys(keys, sc.kernel_size, sc.kernel_stride)
    c2 = ref.compress_keys(keys, sc.c2_kernel_size, sc.c2_kernel_stride)
    assert c1.shape[0] == n1 and c2.shape[0] == n2
    if n1:
        assert torch.allclose(c1[-1], keys[16 * (n1 - 1):16 * (n1 - 1) + 32].mean(0), atol=1e-6)
    if n2:
        assert torch.allclose(c2[-1], keys[64 * (n2 - 1):64 * (n2 - 1) + 128].mean(0), atol=1e-6)
    # natural visibility at the last position equals the number of existing entries
    pos = torch.tensor([L - 1])
    assert ref.visible_count(pos, 32, 16, n1).item() == n1
    assert ref.visible_count(pos, 128, 64, n2).item() == n2


def test_block_selection_hand_built():
    sc = preset_config("full").sparse  # block 64, stride 16, topk 64 + 32 local, init 1
    nb, qb = 120, 110
    n1 = 4 * nb
    scores = torch.zeros(1, 1, n1)
    for b in range(nb):  # distinct small scores, increasing with the block index
        scores[0, 0, 4 * b + 1] = 1e-3 * (b + 1)
    for j in (13, 39, 203):  # strong C1 entries; 39 overlaps blocks 9 and 10, 203 blocks 50 and 51
        scores[0, 0, j] = 5.0
    scores[0, 0, 4 * 115] = 9.0  # a future block (115 > qb) with a huge score
    chosen = ref.select_blocks(scores, torch.tensor([qb]), nb, sc)[0, 0]
    sel = set(torch.nonzero(chosen).flatten().tolist())

    # re-derive by hand: block b pools C1 entries 4b-1 .. 4b+3 (those overlapping its 64 tokens)
    pooled = {b: max(scores[0, 0, j].item() for j in range(max(0, 4 * b - 1), 4 * b + 4)) for b in range(nb)}
    forced = {0} | set(range(qb - 32, qb + 1))
    candidates = sorted((b for b in range(qb + 1) if b not in forced), key=lambda b: (-pooled[b], b))
    expected = forced | set(candidates[: sc.topk_eff - len(forced)])
    assert sel == expected
    assert {3, 9, 10, 50, 51} <= sel and 115 not in sel
    assert len(sel) == sc.topk_eff == 96  # exactly 96 blocks once qb >= 95


def test_block_selection_ties_prefer_lower_index():
    sc = dataclasses.replace(preset_config("full").sparse, topk=2, window_size=64)  # 1 local block
    nb, qb = 10, 9
    scores = torch.ones(1, 1, 4 * nb)  # every block ties
    chosen = ref.select_blocks(scores, torch.tensor([qb]), nb, sc)[0, 0]
    # forced: block 0, blocks 8 and 9; 3 - 3 = 0 dynamic? topk_eff = 2 + 1 = 3 -> forced fill it
    assert set(torch.nonzero(chosen).flatten().tolist()) == {0, 8, 9}
    sc = dataclasses.replace(sc, topk=4)  # topk_eff 5: two dynamic picks among tied 1..7
    chosen = ref.select_blocks(scores, torch.tensor([qb]), nb, sc)[0, 0]
    assert set(torch.nonzero(chosen).flatten().tolist()) == {0, 1, 2, 8, 9}


def test_short_sequences_select_every_causal_block():
    sc = preset_config("full").sparse
    scores = torch.rand(2, 3, 4 * 96)
    qbs = torch.tensor([0, 40, 95])
    chosen = ref.select_blocks(scores, qbs, 96, sc)
    for t, qb in enumerate(qbs.tolist()):
        assert chosen[:, t].sum(-1).tolist() == [qb + 1, qb + 1]


def test_stage1_normaliser_is_lse_over_c2():
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 4, 8, generator=g)  # 4 query heads, 2 KV heads -> group 2
    c1 = torch.randn(5, 2, 8, generator=g)
    c2 = torch.randn(3, 2, 8, generator=g)
    s = ref.stage1_scores(q, c1, c2, torch.tensor([4]), torch.tensor([2]), group=2, scale=0.5)
    for kv in range(2):
        want = torch.zeros(5)
        for h in (2 * kv, 2 * kv + 1):
            lse = torch.logsumexp(0.5 * c2[:2, kv] @ q[0, h], 0)
            want += torch.exp(0.5 * c1[:, kv] @ q[0, h] - lse)
        want[4:] = 0  # entry 4 not visible
        assert torch.allclose(s[kv, 0], want.to(torch.bfloat16).float())


# (kernel, stride) of C1 and C2: real (32/16, 128/64), tiny (8/4, 32/16), small (16/8, 64/32)
GEOMETRIES = [(32, 16), (128, 64), (8, 4), (16, 8), (64, 32)]


def entries(L, kernel, stride):
    return max(0, (L - kernel) // stride + 1)


@pytest.mark.parametrize("kernel,stride", GEOMETRIES)
def test_prompt_rule_is_the_official_single_shot_mask(kernel, stride):
    """D1: a prompt token sees what the official kernel's mask (mask.h, transcribed in
    kernel_visible_count) shows it in ONE stage-1 call over the whole prompt (T = L), for every
    prompt length: the natural rule, one entry fewer when L = stride - 1 (mod stride). Short
    prompts included, where C truncation (T <= stride - 2) differs from Python's floor."""
    for L in range(1, 6 * kernel + 3):
        n = entries(L, kernel, stride)
        pos = torch.arange(L)
        mine = ref.visible_count(pos, kernel, stride, n, prompt_len=L)
        assert torch.equal(mine, ref.kernel_visible_count(L, kernel, stride, n, "cpu")), L
        natural = ref.visible_count(pos, kernel, stride, n)
        lag = natural - mine
        assert lag.max().item() == (1 if L % stride == stride - 1 and n > 0 else 0), L
        # after the prompt (decode, verify, recomputed output) every complete entry is visible
        after = torch.arange(L, L + 3 * stride)
        n_after = entries(L + 3 * stride, kernel, stride)
        assert torch.equal(ref.visible_count(after, kernel, stride, n_after, prompt_len=L),
                           ref.visible_count(after, kernel, stride, n_after))
        assert ref.visible_count(torch.tensor([L - 1]), kernel, stride, n).item() == n  # decode: all of them


def test_kernel_visible_count_truncates_like_c():
    """mask.h divides (T - S + 1) / S in C, toward zero: a call of 4 queries on top of a cache of
    100 C1 entries shows 99 of them (Python's floor division would show all 100)."""
    assert ref.kernel_visible_count(4, 32, 16, 100, "cpu").tolist() == [99] * 4
    assert ref.kernel_visible_count(62, 128, 64, 10, "cpu").tolist() == [9] * 62
    assert ref.kernel_visible_count(63, 128, 64, 10, "cpu").tolist() == [9] * 63  # (63 - 63) / 64 = 0


def _stage1_case(L, seed):
    """Random q / structured keys of a tiny-config sequence of L tokens: C1, C2, q, its blocks."""
    sc = preset_config("tiny").sparse
    g = torch.Generator().manual_seed(seed)
    nb = -(-L // sc.block_size)
    keys = torch.randn(L, 2, 16, generator=g) + 2 * torch.randn(nb, 2, 16, generator=g).repeat_interleave(
        sc.block_size, 0)[:L]
    q = torch.randn(L, 8, 16, generator=g) + 1.5 * torch.randn(1, 8, 16, generator=g)
    c1 = ref.compress_keys(keys, sc.kernel_size, sc.kernel_stride)
    c2 = ref.compress_keys(keys, sc.c2_kernel_size, sc.c2_kernel_stride)
    return sc, q, c1, c2, nb


def _selection(L, seed, prompt_len):
    sc, q, c1, c2, nb = _stage1_case(L, seed)
    pos = torch.arange(L)
    vis1 = ref.visible_count(pos, sc.kernel_size, sc.kernel_stride, c1.shape[0], prompt_len)
    vis2 = ref.visible_count(pos, sc.c2_kernel_size, sc.c2_kernel_stride, c2.shape[0], prompt_len)
    scores = ref.stage1_scores(q, c1, c2, vis1, vis2, group=4, scale=0.25)
    return scores, ref.select_blocks(scores, pos // sc.block_size, nb, sc)


def test_prompt_rule_changes_selection_only_at_the_c2_residue():
    """Tiny config (C1 stride 4, C2 stride 16): a prompt of L = 15 (mod 16) tokens hides the
    newest C2 entry from every prompt token, which changes the C2 normaliser and so selections;
    L = 3 (mod 4) alone hides the newest C1 entry, which lies in forced blocks: the stage-1 scores
    change, the selection never does (SparseConfig.prompt_class leaves that bit out)."""
    L = 399  # = 15 (mod 16), = 3 (mod 4)
    s_prompt, sel_prompt = _selection(L, 1, prompt_len=L)
    s_nat, sel_nat = _selection(L, 1, prompt_len=0)  # prompt_len 0: the natural rule everywhere
    assert (sel_prompt != sel_nat).any(-1).sum().item() > 10
    for L in (395, 391, 403):  # = 3 (mod 4), not 15 (mod 16)
        s_prompt, sel_prompt = _selection(L, 2, prompt_len=L)
        s_nat, sel_nat = _selection(L, 2, prompt_len=0)
        assert not torch.equal(s_prompt, s_nat) and torch.equal(sel_prompt, sel_nat), L
    sc = preset_config("tiny").sparse
    assert [sc.prompt_class(L) for L in (399, 395, 400, 15)] == [1, 0, 0, 1]
    full = preset_config("full").sparse
    assert [full.prompt_class(L) for L in (9023, 9007, 9024, 63)] == [1, 0, 0, 1]


def test_model_follows_the_prompt_rule_in_chunks_and_after_the_prompt():
    """The model at a C2 residue (399 = 15 mod 16, sparse): the prompt rule changes the logits
    against the natural rule (prompt_len=0); the prompt in uneven chunks, or token by token, gives
    the one-shot logits; output tokens after it (decode, or recomputed with the prompt in one
    call after a preemption) see every entry, so both schedules agree. At L = 3 (mod 4) only the
    C1 lag applies and the logits are exactly the natural rule's."""
    base = tiny_model(seed=3)
    vocab = base.config.vocab_size
    ids = torch.randint(3, vocab, (399 + 6,), generator=torch.Generator().manual_seed(6))
    prompt = ids[:399]
    one_shot = run_chunks(base, prompt, [0, 399])
    natural = run_chunks(base, prompt, [0, 399], prompt_len=0)
    assert (one_shot - natural).abs().max() > TOL
    for cuts in ([0, 131, 250, 251, 399], [0, 127, 128, 300, 398, 399]):  # chunk ends off the block grid
        assert (run_chunks(base, prompt, cuts) - one_shot).abs().max() <= TOL, cuts
    # decode after the prompt vs a recompute of prompt + output in one call (prompt_len = 399)
    decoded = run_chunks(base, ids, [0, 399] + list(range(400, 406)), prompt_len=399)
    recomputed = run_chunks(base, ids, [0, 405], prompt_len=399)
    assert (decoded - recomputed).abs().max() <= TOL
    assert (decoded[:399] - one_shot).abs().max() <= TOL
    ids = torch.randint(3, vocab, (395,), generator=torch.Generator().manual_seed(7))
    assert torch.equal(run_chunks(base, ids, [0, 395]), run_chunks(base, ids, [0, 395], prompt_len=0))


def test_stage1_overflow_stays_inf_and_rows_without_c2_are_zero():
    """D4: an fp32 overflow of exp(a - lse) stays +inf (the official wrapper maps only NaN to 0),
    a row that sees no C2 entry scores 0 everywhere (the kernel returns before writing)."""
    q = torch.zeros(2, 4, 8)
    q[:, :, 0] = 10.0
    c1 = torch.zeros(3, 2, 8)
    c1[1, :, 0] = 100.0  # s*q.c1 = 0.5 * 10 * 100 = 500 >> 88.7 + lse
    c2 = torch.zeros(2, 2, 8)
    s = ref.stage1_scores(q, c1, c2, torch.tensor([3, 3]), torch.tensor([2, 0]), group=2, scale=0.5)
    assert s[:, 0, 1].isinf().all() and (s[:, 0, 1] > 0).all()
    assert torch.equal(s[:, 0, [0, 2]], torch.full((2, 2), 2 * 0.5).to(torch.bfloat16).float())  # exp(0 - log 2) x 2 heads
    assert (s[:, 1] == 0).all()  # no visible C2 entry
    # a +inf block is selected like a forced one, before any finite score
    sc = dataclasses.replace(preset_config("full").sparse, topk=3, window_size=64)  # forced 0, 8, 9; topk_eff 4
    scores = torch.zeros(1, 1, 4 * 10)
    scores[0, 0, 4 * 3] = float("inf")
    scores[0, 0, 4 * 5 + 1] = 7.0
    chosen = ref.select_blocks(scores, torch.tensor([9]), 10, sc)[0, 0]
    assert set(torch.nonzero(chosen).flatten().tolist()) == {0, 3, 8, 9}


def test_bf16_reference_tracks_fp32():
    m32 = tiny_model(seed=4)
    m16 = ReferenceModel(m32.config, {k: v.to(torch.bfloat16) for k, v in m32.w.items()}, dtype=torch.bfloat16)
    ids = torch.randint(3, m32.config.vocab_size, (200,), generator=torch.Generator().manual_seed(8))
    a = m32.forward(ids, m32.new_state())
    b = m16.forward(ids, m16.new_state())
    rel = ((a - b).norm() / a.norm()).item()
    assert rel < 0.05
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() > 0.9
