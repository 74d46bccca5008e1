"""EAGLE-3: the head's checkpoint, the target's hidden-state capture, drafting, the engine, training.

References: the captured hidden states against ReferenceModel's layers; the drafter's cached,
incremental forward against the training forward (ttt_forward) that recomputes everything;
greedy EAGLE3 output against plain decoding, token for token.
"""

from __future__ import annotations

import json
import os
import weakref

import pytest
import torch

from salaserve.config import EngineArgs, ModelConfig
from salaserve.core.sampling_params import SamplingParams
from salaserve.engine.llm import LLM
from salaserve.model.eagle3 import Eagle3Config, default_aux_layers, init_head, load_eagle3, save_eagle3
from salaserve.model.eagle3_drafter import Eagle3Drafter
from salaserve.model.reference import ReferenceModel

# fp32 on the CPU: the serving model's hidden states against the reference's (different op order:
# fused projections, chunked GLA); relative to the states' scale
CAPTURE_RTOL = 1e-4
# the drafter's incremental forward against the batched training forward: same math, other shapes
DRAFT_ATOL = 1e-4

SGLANG_NAMES = {
    "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight",
    *(f"midlayer.self_attn.{n}_proj.weight" for n in "qkvo"),
    *(f"midlayer.mlp.{n}_proj.weight" for n in ("gate", "up", "down")),
}


@pytest.fixture(scope="module")
def cfg(tiny_model_dir):
    return ModelConfig.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def head_dir(tiny_model_dir, cfg, tmp_path_factory):
    """A random head with a 512-token draft vocab (every 16th target id)."""
    head = init_head(Eagle3Config.for_target(cfg, draft_vocab_size=512), seed=3, std=0.05)
    head.set_vocab_map(torch.arange(512) * 16)
    d = str(tmp_path_factory.mktemp("eagle3-head"))
    save_eagle3(head, d, dtype=torch.float32)
    return d


@pytest.fixture(scope="module")
def prompts():
    return [[1] + [5 + (i * 37) % 200 for i in range(n)] for n in (9, 40, 70)]


def test_checkpoint_layout_and_roundtrip(head_dir, cfg):
    from safetensors.torch import load_file

    with open(os.path.join(head_dir, "config.json")) as f:
        c = json.load(f)
    assert c["architectures"] == ["LlamaForCausalLMEagle3"]
    assert c["draft_vocab_size"] == 512 and c["vocab_size"] == cfg.vocab_size and c["num_hidden_layers"] == 1
    assert c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(default_aux_layers(cfg.num_hidden_layers))
    t = load_file(os.path.join(head_dir, "model.safetensors"))
    assert set(t) == SGLANG_NAMES
    H = cfg.hidden_size
    assert t["fc.weight"].shape == (H, 3 * H)
    assert t["midlayer.self_attn.q_proj.weight"].shape == (cfg.num_attention_heads * cfg.head_dim, 2 * H)
    assert t["lm_head.weight"].shape == (512, H)
    assert t["d2t"].dtype == torch.int64 and t["t2d"].dtype == torch.bool and int(t["t2d"].sum()) == 512
    assert torch.equal(torch.arange(512) + t["d2t"], torch.arange(512) * 16)
    head = load_eagle3(head_dir, target_cfg=cfg)
    for k, v in head.state_dict().items():
        assert torch.equal(v, t[k]), k


def test_loader_errors_name_the_problem(head_dir, cfg, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    with pytest.raises(ValueError, match="no config.json"):
        load_eagle3(str(tmp_path))
    bad = tmp_path / "arch"
    shutil.copytree(head_dir, bad)
    c = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(dict(c, architectures=["LlamaForCausalLM"])))
    with pytest.raises(ValueError, match="not an EAGLE-3 head"):
        load_eagle3(str(bad))
    (bad / "config.json").write_text(json.dumps(dict(c, vocab_size=1000)))
    with pytest.raises(ValueError, match="vocab_size 1000 != the target's"):
        load_eagle3(str(bad), target_cfg=cfg)
    (bad / "config.json").write_text(json.dumps(c))
    t = load_file(str(bad / "model.safetensors"))
    t["fc.weight"] = t["fc.weight"][:, :10].contiguous()
    del t["norm.weight"]
    save_file(t, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="missing \\['norm.weight'\\]"):
        load_eagle3(str(bad))
    t["norm.weight"] = torch.ones(cfg.hidden_size)
    save_file(t, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="fc.weight has shape"):
        load_eagle3(str(bad))


@pytest.mark.parametrize("window,chunk", [(128, 8192), (24, 16)])
def test_captured_states_equal_the_reference(tiny_model_dir, head_dir, cfg, prompts, window, chunk):
    """Every (position, state) the engine hands the drafters (the prompt's last `window` rows,
    decode rows, verify rows of accepted tokens) against the reference model's layers over the
    final sequence; with chunks of 16 tokens the prompt context spans chunks."""
    seen = []

    class Spy(Eagle3Drafter):
        def observe(self, position, aux):
            seen.append((self.rid, position, aux.clone()))
            super().observe(position, aux)

    llm = LLM(tiny_model_dir, device="cpu", speculative_algorithm="EAGLE3", speculative_draft_model_path=head_dir,
              speculative_num_draft_tokens=3, speculative_eagle_window=window, chunked_prefill_size=chunk)
    eng = llm.engine

    def make(req):
        d = Spy(eng.eagle_head, depth=3, window=window)
        d.rid = req.rid
        return d

    eng.make_drafter = make
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True))
    ref = ReferenceModel.from_pretrained(tiny_model_dir)
    layers = default_aux_layers(cfg.num_hidden_layers)
    by_rid = {}
    for rid, pos, aux in seen:
        by_rid.setdefault(rid, {})[pos] = aux
    assert len(by_rid) == len(prompts)
    for p, o in zip(prompts, outs):
        _, want = ref.forward(p + o.token_ids, ref.new_state(), aux_layers=layers)
        got = by_rid[o.rid]
        # the prompt's last `window` positions and every generated one but the last (never computed)
        assert sorted(got) == list(range(max(0, len(p) - window), len(p) + len(o.token_ids) - 1))
        for pos, aux in got.items():
            torch.testing.assert_close(aux, want[pos], rtol=CAPTURE_RTOL, atol=CAPTURE_RTOL * float(want[pos].abs().max()))


def test_no_capture_without_eagle(tiny_model_dir, prompts):
    llm = LLM(tiny_model_dir, device="cpu")
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=2))
    assert llm.engine.runner.aux_layers is None and llm.engine.runner.last_aux is None


def _sample(cfg, n_ctx: int, seed: int, H3: int):
    g = torch.Generator().manual_seed(seed)
    return {"aux": torch.randn(n_ctx, H3, generator=g) * 3, "tokens": torch.randint(3, cfg.vocab_size, (64,),
                                                                                     generator=g).tolist()}


def test_drafter_chain_equals_training_forward(head_dir, cfg):
    """The drafter (cached K/V, observed in three rounds, greedy chain) against ttt_forward over
    the whole sequence with the drafted tokens as the continuation: same logits at every step."""
    from salaserve.spec_train.ttt import batch_tensors, ttt_forward

    head = load_eagle3(head_dir, target_cfg=cfg)
    head.attach_target(torch.randn(cfg.vocab_size, cfg.hidden_size, generator=torch.Generator().manual_seed(1)),
                       cfg.scale_emb)
    pos0, n, depth = 20, 12, 4
    s = _sample(cfg, n, 0, 3 * cfg.hidden_size)
    tokens = s["tokens"][:pos0 + n + 1]  # positions 0 .. pos0 + n; states at pos0 .. pos0 + n - 1
    dr = Eagle3Drafter(head, depth=depth, topk=1, window=64)
    for lo, hi in ((0, 1), (1, 5), (5, n)):  # prefill's row, then two verify steps' rows
        for c in range(lo, hi):
            dr.observe(pos0 + c, s["aux"][c])
        tree = dr.propose(tokens[:pos0 + hi + 1], depth)
    chain = tree.first_path()
    assert len(chain) == depth
    # training forward: index c = n - 1 (the root), continuation = the drafted chain
    nxt = torch.tensor(tokens[pos0 + 1:pos0 + n + 1] + chain[:-1] + [-1])
    m = n + depth
    aux = torch.cat([s["aux"], torch.zeros(depth, s["aux"].shape[1])])
    sample = {"aux": aux, "next": nxt, "pos0": pos0, "top_ids": torch.zeros(m, 1, dtype=torch.int32),
              "top_p": torch.zeros(m, 1)}
    t2d = torch.full((cfg.vocab_size,), -1, dtype=torch.long)
    t2d[head.target_ids(torch.arange(512))] = torch.arange(512)
    outs = ttt_forward(head, batch_tensors([sample], t2d, 512, [0]), depth)
    # the drafter's tokens are the training forward's argmaxes, step by step
    got = [int(head.target_ids(o["logits"][0, n - 1].argmax())) for o in outs]
    assert got == chain
    # and a second drafter that reads all rows at once gives the same root logits
    dr2 = Eagle3Drafter(head, depth=1)
    for c in range(n):
        dr2.observe(pos0 + c, s["aux"][c])
    dr2.propose(tokens[:pos0 + n + 1], 1)
    torch.testing.assert_close(head.logits(dr2.root[1][None])[0], outs[0]["logits"][0, n - 1], atol=DRAFT_ATOL,
                               rtol=0)
    torch.testing.assert_close(dr2.root[1], dr.root[1], atol=DRAFT_ATOL, rtol=0)


def test_tree_has_topk_per_level_and_a_greedy_first_path(head_dir, cfg):
    head = load_eagle3(head_dir, target_cfg=cfg)
    head.attach_target(torch.randn(cfg.vocab_size, cfg.hidden_size, generator=torch.Generator().manual_seed(2)),
                       cfg.scale_emb)
    s = _sample(cfg, 6, 1, 3 * cfg.hidden_size)
    trees = {}
    for k in (1, 3):
        dr = Eagle3Drafter(head, depth=4, topk=k)
        for c in range(6):
            dr.observe(10 + c, s["aux"][c])
        trees[k] = dr.propose(s["tokens"][:17], 4)
    assert trees[1].is_chain and len(trees[1]) == 4
    assert len(trees[3]) == 12 and trees[3].depths() == [1] * 3 + [2] * 3 + [3] * 3 + [4] * 3
    assert trees[3].first_path() == list(trees[1].tokens)
    assert len(set(trees[3].tokens[:3])) == 3  # the root's three best, distinct
    assert all(dr.head.cfg.vocab_size > t >= 0 and t % 16 == 0 for t in trees[3].tokens)  # target ids of the vocab


def test_window_bounds_the_draft_cache(head_dir, cfg):
    head = load_eagle3(head_dir, target_cfg=cfg)
    head.attach_target(torch.randn(cfg.vocab_size, cfg.hidden_size), cfg.scale_emb)
    dr = Eagle3Drafter(head, depth=2, window=8)
    s = _sample(cfg, 30, 2, 3 * cfg.hidden_size)
    for c in range(30):
        dr.observe(c, s["aux"][c])
        if c % 4 == 3:
            dr.propose(s["tokens"][:c + 2], 2)
    assert len(dr.pending) <= 8 and len(dr.cache_pos) <= 8 and dr.cache_k.shape[1] == len(dr.cache_pos)


@pytest.mark.parametrize("topk", [1, 2])
def test_greedy_eagle3_equals_plain_decoding(tiny_model_dir, head_dir, prompts, topk):
    params = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)
    plain = [o.token_ids for o in LLM(tiny_model_dir, device="cpu").generate(prompts, params)]
    llm = LLM(tiny_model_dir, device="cpu", speculative_algorithm="EAGLE3", speculative_draft_model_path=head_dir,
              speculative_num_draft_tokens=4, speculative_eagle_topk=topk)
    drafters = []
    make = llm.engine.make_drafter

    def tracked(req):
        d = make(req)
        drafters.append(weakref.ref(d))
        return d

    llm.engine.make_drafter = tracked
    assert [o.token_ids for o in llm.generate(prompts, params)] == plain
    e = llm.engine
    assert e.stats["spec_verify_steps"] > 0 and e.stats["spec_draft_tokens"] > 0
    assert e.avg_spec_accept_length is not None
    assert drafters and all(d() is None for d in drafters)  # released with their requests
    assert not e.requests


def test_eagle3_with_the_trained_default_head_accepts_drafts():
    """The shipped head on the built-in model: greedy output unchanged, and drafts accepted."""
    head = _packaged_head()
    prompts = [[1] + list(range(300, 340)), [1, 500, 501, 502, 503, 504, 505]]
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    plain = [o.token_ids for o in LLM(None, device="cpu").generate(prompts, params)]
    llm = LLM(None, device="cpu", speculative_algorithm="EAGLE3", speculative_draft_model_path=head)
    assert [o.token_ids for o in llm.generate(prompts, params)] == plain
    assert llm.engine.stats["spec_accepted_tokens"] > 0


def test_engine_args_and_flags(head_dir):
    from salaserve.server.args import parse_args

    with pytest.raises(ValueError, match="speculative_draft_model_path"):
        EngineArgs(speculative_algorithm="EAGLE3").validate()
    eng, _, _ = parse_args(["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", head_dir,
                            "--speculative-eagle-topk", "2", "--speculative-num-steps", "3"])
    assert (eng.speculative_algorithm, eng.speculative_draft_model_path, eng.speculative_eagle_topk,
            eng.speculative_num_steps) == ("EAGLE3", head_dir, 2, 3)


def test_seeded_sampling_with_eagle3_runs(tiny_model_dir, head_dir, prompts):
    llm = LLM(tiny_model_dir, device="cpu", speculative_algorithm="EAGLE3", speculative_draft_model_path=head_dir)
    outs = llm.generate(prompts, SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_new_tokens=12,
                                                ignore_eos=True))
    assert all(len(o.token_ids) == 12 for o in outs)
    assert llm.engine.stats["spec_verify_steps"] > 0


def _packaged_head():
    from salaserve.model.default import PACKAGED

    head = os.path.join(PACKAGED, "eagle3")
    if not os.path.isfile(os.path.join(head, "config.json")):
        pytest.skip("no packaged EAGLE-3 head")
    return head


def test_preemption_with_eagle3_keeps_outputs():
    """A page pool far too small for the batch: requests are preempted and recomputed (their
    drafters see positions again) and the greedy output is still plain decoding's."""
    import random

    head = _packaged_head()
    rng = random.Random(0)
    prompts = [[1] + [rng.randrange(300, 3000) for _ in range(n)] for n in (90, 150, 60, 120)]
    params = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    kw = dict(device="cpu", chunked_prefill_size=64)
    plain = [o.token_ids for o in LLM(None, **kw).generate(prompts, params)]
    llm = LLM(None, max_total_tokens=320, speculative_algorithm="EAGLE3", speculative_draft_model_path=head, **kw)
    assert [o.token_ids for o in llm.generate(prompts, params)] == plain
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.stats["spec_accepted_tokens"] > 0


def test_train_draft_resumes_to_the_same_head(tiny_model_dir, tmp_path):
    """train-draft in two halves (--stop-at, then --resume) ends with the head of one run; the
    outputs: a loadable head, curves.json."""
    from safetensors.torch import load_file

    from salaserve.spec_train.train import main

    common = ["--model", tiny_model_dir, "--samples", "6", "--heldout", "2", "--prompt-len", "12", "24",
              "--gen-len", "8", "--draft-vocab", "128", "--steps", "4", "--batch-size", "3", "--ttt-steps", "3",
              "--log-every", "1", "--warmup", "2"]
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    assert main(["--out", one] + common) == 0
    os.makedirs(two)
    os.link(os.path.join(one, "data.pt"), os.path.join(two, "data.pt"))  # the same data, not recollected
    assert main(["--out", two, "--stop-at", "2"] + common) == 0
    assert main(["--out", two, "--resume"] + common) == 0
    a, b = (load_file(os.path.join(d, "head", "model.safetensors")) for d in (one, two))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    with open(os.path.join(two, "curves.json")) as f:
        curves = json.load(f)["curves"]
    assert [c["step"] for c in curves if "loss" in c] == [1, 2, 3, 4]
    assert 1.0 <= curves[-1]["heldout"]["accept_length"] <= 4.0
    load_eagle3(os.path.join(two, "head"), target_cfg=ModelConfig.from_pretrained(tiny_model_dir))


def test_eagle3_with_shared_and_cached_prompts(tiny_model_dir, head_dir, prompts):
    """Twins (one prefill, several requests) and prefix-cache hits give each drafter its states
    too: the prompt context its prefill (or its twin's) computed, then every committed position
    once; greedy output still plain decoding's."""
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    batch = [prompts[1], prompts[1], prompts[2]]
    kw = dict(device="cpu", prefix_cache_min_tokens=8)
    plain = [o.token_ids for o in LLM(tiny_model_dir, **kw).generate(batch, params)]
    llm = LLM(tiny_model_dir, speculative_algorithm="EAGLE3", speculative_draft_model_path=head_dir, **kw)
    seen = {}
    make = llm.engine.make_drafter

    def spy(req):
        d = make(req)
        observe = d.observe
        d.observe = lambda pos, aux: (seen.setdefault(req.rid, []).append(pos), observe(pos, aux))
        return d

    llm.engine.make_drafter = spy
    for rnd in range(2):  # the second round starts from cached prompts
        outs = llm.generate(batch, params)
        assert [o.token_ids for o in outs] == plain
        for p, o in zip(batch, outs):  # every request's drafter saw each committed position once
            start = seen[o.rid][0]  # the first computed prompt position (the window holds every prompt)
            assert seen[o.rid] == list(range(start, len(p) + 11))
            assert start == 0 if rnd == 0 else start <= min(o.cached_tokens, len(p) - 1)
    s = llm.engine.stats
    assert s["shared_prefill_tokens"] > 0 and s["cached_prompt_tokens"] > 0 and s["spec_verify_steps"] > 0


def test_head_prompt_context_caps_the_captured_prompt(tiny_model_dir, cfg, tmp_path):
    """A head trained with `prompt_context` C (config.json) gets at most C prompt positions; the
    window caps it too; a head that does not say gets the window."""
    head = init_head(Eagle3Config.for_target(cfg, draft_vocab_size=512), seed=3, std=0.05)
    head.set_vocab_map(torch.arange(512) * 16)
    head.cfg.prompt_context = 6
    save_eagle3(head, str(tmp_path), dtype=torch.float32)
    assert load_eagle3(str(tmp_path)).cfg.prompt_context == 6
    kw = dict(device="cpu", speculative_algorithm="EAGLE3", speculative_draft_model_path=str(tmp_path))
    assert LLM(tiny_model_dir, **kw).engine.runner.aux_context == 6
    assert LLM(tiny_model_dir, speculative_eagle_window=4, **kw).engine.runner.aux_context == 4
    assert load_eagle3(_packaged_head()).cfg.prompt_context == 1  # trained from the prompt's last token
