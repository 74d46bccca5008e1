"""Tensor parallelism past the KV heads (tp_size a multiple of num_key_value_heads): each KV head
replicated on tp_size / num_key_value_heads ranks that share its query heads and all-reduce its
stage-1 scores over their sub-group. The default model (4 query heads, 2 KV heads, 4 Lightning
heads) at TP=4: one query head a rank, each KV head on two ranks.

Tolerances: as tests/test_tp.py (LOGIT_ATOL): only the order of fp32 sums changes; the stage-1
sum of the default model's groups of two heads is exact (a + b on either side), so block
selection is the TP=1 selection. Observed at TP=4: ~3e-6 on logits of magnitude ~13. Without the
stage-1 all-reduce each rank would select with half of its group's score: ~0.09
(test_unreduced_stage1_would_be_caught).
"""

from __future__ import annotations

import pytest
import torch
from test_tp import (LOGIT_ATOL, LONG, PROMPTS, _alive, _model, _prefill_and_decode, _run_ranks, _sharded_logits,
                     _thread_groups)

import salaserve.parallel.shard as shard
from salaserve.config import ModelConfig, preset_config
from salaserve.model import reference as spec
from salaserve.model.default import default_model_dir
from salaserve.model.loader import load_state_dict
from salaserve.parallel.shard import (TPConfigError, check_tp, check_tp_backend, kv_replicas, local_config,
                                      shard_state_dict)


@pytest.fixture(scope="module")
def cfg():
    return ModelConfig.from_pretrained(default_model_dir())


# ---- the rules ---------------------------------------------------------------------------------
def test_replicas_and_local_config(cfg):
    assert [kv_replicas(cfg, n) for n in (1, 2, 4)] == [1, 1, 2]
    real = preset_config("full")  # MiniCPM-SALA: 32 query heads, 2 KV heads -> --tp-size 2, 4, 8
    for n, reps in ((2, 1), (4, 2), (8, 4)):
        check_tp(real, n)
        assert kv_replicas(real, n) == reps
        assert local_config(real, n - 1, n).gqa_group_size == 32 // n
    with pytest.raises(TPConfigError, match="num_attention_heads = 32"):
        check_tp(real, 6)
    lc = local_config(cfg, 3, 4)
    assert (lc.num_attention_heads, lc.num_key_value_heads, lc.gqa_group_size, lc.lightning_nh,
            lc.intermediate_size) == (1, 1, 1, 1, cfg.intermediate_size // 4)


@pytest.mark.parametrize("size,field", [(3, "num_key_value_heads = 2.*not a multiple"),
                                        (8, "does not divide num_attention_heads = 4"),
                                        (0, "positive integer")])
def test_check_tp_errors(cfg, size, field):
    check_tp(cfg, 4)  # a multiple of the KV heads that divides the rest
    with pytest.raises(TPConfigError, match=field):
        check_tp(cfg, size)


def test_triton_refuses_replicated_kv_heads(cfg):
    check_tp_backend(cfg, 2, "triton")  # each rank its own KV head: no sub-group needed
    check_tp_backend(cfg, 4, "torch")
    with pytest.raises(TPConfigError, match="tp_size 4 > num_key_value_heads = 2.*needs --backend torch"):
        check_tp_backend(cfg, 4, "triton")


def test_kv_rows_replicated_query_heads_split(cfg):
    """Sparse layer 0 at TP=4: rank r holds query head r and all of KV head r // 2; a Lightning
    layer's k_proj is still split four ways."""
    w = load_state_dict(default_model_dir(), cfg, dtype=torch.float32)
    d = cfg.head_dim
    a, li = "model.layers.0.self_attn.", f"model.layers.{cfg.lightning_layers[0]}.self_attn."
    for r in range(4):
        s = shard_state_dict(cfg, dict(w), r, 4)
        assert torch.equal(s[a + "q_proj.weight"], w[a + "q_proj.weight"][r * d:(r + 1) * d])
        for n in ("k_proj", "v_proj"):
            assert torch.equal(s[a + n + ".weight"], w[a + n + ".weight"][(r // 2) * d:(r // 2 + 1) * d])
        assert torch.equal(s[a + "o_proj.weight"], w[a + "o_proj.weight"][:, r * d:(r + 1) * d])
        ld = cfg.lightning_head_dim
        assert torch.equal(s[li + "k_proj.weight"], w[li + "k_proj.weight"][r * ld:(r + 1) * ld])


def test_w4a16_at_tp4_is_a_clear_error(cfg):
    """int4 groups of 128 along o_proj's input (4 heads x 64): 64 columns a rank would cut them."""
    w = load_state_dict(default_model_dir(), cfg, dtype=torch.float32, quantization="w4a16")
    with pytest.raises(TPConfigError, match=r"layers\.0\.self_attn\.o_proj\.weight.*multiple of the group size"):
        shard_state_dict(cfg, w, 0, 4)


# ---- stage 1 over a sub-group ------------------------------------------------------------------
def _stage1_case(hq, hkv, seed=0):
    g = torch.Generator().manual_seed(seed)
    T, d, n1, n2 = 48, 64, 160, 40
    q = torch.randn(T, hq, d, generator=g) * 2
    c1, c2 = torch.randn(n1, hkv, d, generator=g), torch.randn(n2, hkv, d, generator=g)
    pos = torch.arange(T) * 8 + 70
    vis1 = spec.visible_count(pos, 16, 8, n1, 0)
    vis2 = spec.visible_count(pos, 64, 32, n2, 0)
    return q, c1, c2, vis1, vis2


def _stage1_sharded(q, c1, c2, vis1, vis2, size):
    """stage1_scores on `size` threads, each with its query heads and its KV head, the partial sums
    all-reduced over the ranks sharing the head: [Hkv, T, n1] assembled from each head's first rank."""
    hq, hkv = q.shape[1], c1.shape[1]
    reps, per, scale = size // hkv, hq // size, q.shape[-1] ** -0.5
    kv_groups = sum(_thread_groups(size, hkv), [])
    out, errors = [None] * size, []

    def rank(r):
        h = r // reps
        try:
            out[r] = spec.stage1_scores(q[:, r * per:(r + 1) * per], c1[:, h:h + 1], c2[:, h:h + 1], vis1, vis2,
                                        per, scale, reduce=kv_groups[r].all_reduce)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    _run_ranks(size, rank, errors)
    for h in range(hkv):  # the replicas of a head agree
        assert all(torch.equal(out[h * reps], o) for o in out[h * reps:(h + 1) * reps])
    return torch.cat([out[h * reps] for h in range(hkv)])


def test_all_reduced_stage1_equals_single_rank():
    """The default model's shape (groups of 2 heads on 2 ranks, one head each): equal exactly, as a
    sum of two is the same on both sides."""
    case = _stage1_case(4, 2)
    full = spec.stage1_scores(*case, 2, 64 ** -0.5)
    assert full.abs().sum() > 0
    assert torch.equal(_stage1_sharded(*case, 4), full)


@pytest.mark.parametrize("size", [4, 8])
def test_all_reduced_stage1_real_model_groups(size):
    """MiniCPM-SALA's groups of 16 heads over 2 or 4 ranks: the fp32 sum's order differs from TP=1's
    (two or four partial sums), so a bf16 rounding could flip at a rounding midpoint; bounded by
    one bf16 ulp (relative 2^-7), and none flipped on this input (observed)."""
    case = _stage1_case(32, 2)
    full = spec.stage1_scores(*case, 16, 64 ** -0.5)
    got = _stage1_sharded(*case, size)
    torch.testing.assert_close(got, full, rtol=2 ** -7, atol=0)
    assert torch.equal(got, full)


# ---- the sharded model in one process: ranks as threads -------------------------------------------
@pytest.mark.parametrize("quantization,kv_dtype", [(None, torch.float32), ("fp8", torch.float32),
                                                   (None, torch.float8_e4m3fn)],
                         ids=["fp32", "fp8-weights", "fp8-kv"])
def test_tp4_sharded_model_equals_whole_model(cfg, quantization, kv_dtype):
    """fp8 K/V pages: each replica computes its head's per-page scales from the same keys."""
    w = load_state_dict(default_model_dir(), cfg, dtype=torch.float32, quantization=quantization)
    for ids in (LONG, LONG[:40]):  # the sparse regime (600 > dense_len 256) and a short dense prompt
        whole = _prefill_and_decode(*_model(cfg, w, 0, 1, None, kv_dtype), ids, 3)
        sharded = _sharded_logits(cfg, w, ids, 3, size=4, kv_dtype=kv_dtype)
        torch.testing.assert_close(sharded, whole, atol=LOGIT_ATOL, rtol=0)
        assert torch.equal(sharded.argmax(-1), whole.argmax(-1))


def test_unreduced_stage1_would_be_caught(cfg, monkeypatch):
    """Without the sub-group all-reduce (each rank selecting blocks by its own heads' partial
    score) the logits move far past LOGIT_ATOL: the comparison above sees the hook at work."""
    import test_tp

    w = load_state_dict(default_model_dir(), cfg, dtype=torch.float32)
    whole = _prefill_and_decode(*_model(cfg, w, 0, 1, None), LONG, 1)
    monkeypatch.setattr(test_tp, "kv_replicas", lambda c, n: 1)  # no kv_group for the ranks
    wrong = _sharded_logits(cfg, w, LONG, 1, size=4)
    assert (wrong - whole).abs().max() > 100 * LOGIT_ATOL
    assert shard.kv_replicas(cfg, 4) == 2  # the module's own rule is untouched


# ---- engines: real processes over gloo ------------------------------------------------------------
@pytest.mark.timeout(300)
def test_tp4_greedy_equals_tp1():
    """Four ranks (sub-groups {0, 1} and {2, 3} made by every rank) against one: prompts below and
    above dense_len, fp32 on the CPU."""
    from salaserve.core.sampling_params import SamplingParams
    from salaserve.engine.llm import LLM

    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    kw = dict(device="cpu", max_running_requests=4, chunked_prefill_size=200)
    want = [o.token_ids for o in LLM(**kw).generate(PROMPTS, params)]
    with LLM(tp_size=4, dist_timeout=60, **kw) as four:
        pids = four.engine.runner.followers.pids
        assert len(pids) == 3
        assert four.engine.runner.model.ops.kv_group.size == 2
        got = [o.token_ids for o in four.generate(PROMPTS, params)]
    assert got == want
    assert not any(_alive(p) for p in pids)


@pytest.mark.timeout(60)
def test_triton_tp4_refused_before_any_process():
    import multiprocessing

    from salaserve.engine.llm import LLM

    before = set(p.pid for p in multiprocessing.active_children())
    with pytest.raises(TPConfigError, match="needs --backend torch"):
        LLM(device="cpu", tp_size=4, backend="triton")
    assert set(p.pid for p in multiprocessing.active_children()) == before
