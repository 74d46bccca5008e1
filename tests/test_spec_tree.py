"""Tree verify (issue 45 part 3) on the tiny model, fp32, torch backend: every tree row equals the
plain decode of its path, the commit leaves the caches a decode of the accepted path would,
greedy output equals plain decoding, tree sampling acceptance is exact, chains are unchanged."""

import copy
import random

import pytest
import torch

from engine_utils import run_requests
from salaserve.config import EngineArgs
from salaserve.core.batch import ForwardBatch, SeqWork
from salaserve.core.sampling_params import SamplingParams
from salaserve.engine.engine import Engine
from salaserve.engine.runner import ModelRunner
from salaserve.kernels import tree_verify
from salaserve.model.reference import ReferenceModel
from salaserve.spec.accept import accept_sampling_tree, target_probs
from salaserve.spec.oracle import OracleDrafter, TreeOracleDrafter
from salaserve.spec.tree import DraftTree

# fp32 everywhere: a tree row and the decode of its path differ only by the order of fp32 sums
# over keys (masked columns, different lengths); logits of the tiny model are O(1)
LOGIT_ATOL = 2e-4
# K/V and compressed keys of the tiny model are O(1) values of one projection
CACHE_ATOL = 1e-5
# Lightning states grow to O(10) entries: a few fp32 ulps of the largest (eps 1.2e-7 each)
STATE_RTOL = 2e-6

#            root
#        /    |    \
#       0     1     2            depth 1
#      / \    |
#     3   4   5                  depth 2
#    / \      |
#   6   7     8                  depth 3
#   |
#   9                            depth 4
PARENTS = (-1, -1, -1, 0, 0, 1, 3, 3, 5, 6)


# ---- backend level: rows vs decode of their paths -------------------------------------------

@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    args = EngineArgs(model=tiny_model_dir, device="cpu", dtype="float32", backend="torch",
                      chunked_prefill_size=64, max_running_requests=4)
    return ModelRunner(args, tiny_model_dir)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return ReferenceModel.from_pretrained(tiny_model_dir, dtype=torch.float32)


def _forward(runner, work):
    sc = runner.cfg.sparse
    batch = ForwardBatch.build(work, sc.block_size, sc.dense_len, runner.device)
    runner.last_batch = batch
    return runner.model.forward(batch, runner.caches)


def _snapshot(runner):
    c = runner.caches
    return [t.clone() for t in (c.kv.k, c.kv.v, c.compressed.c1, c.compressed.c2, c.states.state)]


def _restore(runner, snap):
    c = runner.caches
    for dst, src in zip((c.kv.k, c.kv.v, c.compressed.c1, c.compressed.c2, c.states.state), snap):
        dst.copy_(src)


def _prefill(runner, prompt, pages, slot):
    done = 0
    while done < len(prompt):
        n = min(64, len(prompt) - done)
        logits = _forward(runner, [SeqWork(slot, pages, done, prompt[done:done + n], need_logits=True,
                                           prompt_len=len(prompt))])
        done += n
    return logits[-1]


def _decode(runner, pages, slot, start, tokens, prompt_len):
    """Plain decode of tokens from position start: the logits of the last one."""
    for j, t in enumerate(tokens):
        logits = _forward(runner, [SeqWork(slot, pages, start + j, [t], need_logits=True, prompt_len=prompt_len)])
    return logits[-1]


@pytest.mark.parametrize("prompt_len", [40, 125, 252], ids=["dense", "crosses-dense_len", "sparse"])
def test_tree_rows_equal_decoding_their_paths(runner, reference, prompt_len):
    """Every row of a tree verify equals the plain decode of its root-to-row path. 40: dense;
    125: rows on both sides of dense_len (128) and a C2 entry born at depth 2; 252: top-k selects
    8 of up to 17 blocks, a C2 entry is born at depth 3 and a new block starts at depth 4. The reference model
    (the executable spec) decoding each path agrees too. Then the commit of a path leaves the
    caches a decode of it would: the next token's logits and the states agree."""
    cfg = runner.cfg
    rng = random.Random(prompt_len)
    prompt = [rng.randrange(3, cfg.vocab_size) for _ in range(prompt_len)]
    sc = cfg.sparse
    pages = runner.caches.kv.allocator.alloc(-(-(prompt_len + 8) // sc.block_size))
    slot = runner.caches.states.alloc()
    try:
        root = int(_prefill(runner, prompt, pages, slot).argmax())
        tree = DraftTree(tuple(rng.randrange(3, cfg.vocab_size) for _ in PARENTS), PARENTS)
        snap = _snapshot(runner)
        work = SeqWork(slot, pages, prompt_len, [root, *tree.tokens], need_logits=True, num_logits=len(tree) + 1,
                       verify=True, prompt_len=prompt_len, tree_parents=tree.parents)
        tree_logits = _forward(runner, [work])
        vb = runner.last_batch
        assert tree_logits.shape[0] == len(tree) + 1
        kv, comp = runner.caches.kv, runner.caches.compressed
        roots = [tree_verify.root_caches(kv, comp, layer, vb, 0) for layer in range(kv.k.shape[0])]
        for r in range(len(tree) + 1):
            _restore(runner, snap)
            path = [root] + [tree.tokens[j - 1] for j in tree.path_rows(r)[1:]]
            want = _decode(runner, pages, slot, prompt_len, path, prompt_len)
            diff = (tree_logits[r] - want).abs().max().item()
            assert diff <= LOGIT_ATOL, (r, diff)
            # what the row read in each sparse layer is what the decode of its path stored, the
            # compressed entries its path completed included (their only effect on block choice
            # is through C2's log-sum-exp, too faint for the logits to show reliably)
            L = prompt_len + len(path)
            for layer in range(kv.k.shape[0]):
                k_rows, v_rows = vb.spec_kv[("kv", layer, 0)]
                got = tree_verify.path_caches(roots[layer], k_rows, v_rows, tree.path_rows(r)[1:], runner.cfg.sparse)
                p = torch.tensor(pages)[: -(-L // sc.block_size)]
                for a, b in zip(got, (*kv.gather(layer, p, L), *comp.gather(layer, p, L))):
                    assert a.shape == b.shape and (a - b).abs().max().item() <= CACHE_ATOL

        # and the executable spec agrees: ReferenceModel decoding each path after the whole prompt
        state = reference.new_state()
        reference.forward(prompt, state)
        for r in range(len(tree) + 1):
            st = copy.deepcopy(state)
            path = [root] + [tree.tokens[j - 1] for j in tree.path_rows(r)[1:]]
            for t in path:
                want = reference.forward([t], st)[-1]
            diff = (tree_logits[r] - want).abs().max().item()
            assert diff <= LOGIT_ATOL, ("reference", r, diff)

        # commit the path root -> 1 -> 5 -> 8 (rows 0, 2, 6, 9), then decode one more token
        rows = tree.path_rows(9)
        assert rows == [0, 2, 6, 9]
        path = [root] + [tree.tokens[j - 1] for j in rows[1:]]
        _restore(runner, snap)
        _forward(runner, [work])  # the verify again (its batch is the commit's)
        runner.commit_verified([(0, slot, rows)])
        assert not runner.last_batch.spec_kv  # the commit took every layer's kept K/V
        nxt = int(tree_logits[9].argmax())
        got = _decode(runner, pages, slot, prompt_len + len(path), [nxt], prompt_len)
        got_state = runner.caches.states.state[slot].clone()
        _restore(runner, snap)
        want = _decode(runner, pages, slot, prompt_len, path + [nxt], prompt_len)
        assert (got - want).abs().max().item() <= LOGIT_ATOL
        want_state = runner.caches.states.state[slot]
        assert (got_state - want_state).abs().max().item() <= STATE_RTOL * want_state.abs().max().item()
    finally:
        runner.caches.kv.allocator.free(pages)
        runner.caches.states.free(slot)


# ---- sampling acceptance ---------------------------------------------------------------------

def _chi2(counts: torch.Tensor, p: torch.Tensor) -> float:
    n = counts.sum()
    return float(((counts - n * p) ** 2 / (n * p)).sum())


def test_tree_rejection_sampling_is_exact():
    """5 tokens, a tree whose root has children 1, 3, 3 (a duplicate) and 0, and deeper levels: the
    first emitted token is ~ p(root row), and given an accepted child the next is ~ p(its row).
    Chi-square with 4 degrees of freedom: 30 is exceeded with probability ~5e-6 (fixed seed)."""
    params = SamplingParams(temperature=1.0)
    tree = DraftTree((1, 3, 3, 0, 2, 4, 2), (-1, -1, -1, -1, 0, 0, 4))
    g = torch.Generator().manual_seed(1234)
    logits = torch.randn(len(tree) + 1, 5, generator=g) * 0.8
    probs = target_probs(logits, params)
    n = 20000
    first = torch.zeros(5)
    after = {1: torch.zeros(5), 3: torch.zeros(5)}
    for _ in range(n):
        toks, rows = accept_sampling_tree(logits, tree, params, g)
        assert len(rows) == len(toks) and rows[0] == 0
        first[toks[0]] += 1
        if toks[0] in after:
            after[toks[0]][toks[1]] += 1
    assert _chi2(first, probs[0]) < 30.0, (first / n, probs[0])
    assert (first / n - probs[0]).abs().sum() / 2 < 0.02  # total variation
    assert _chi2(after[1], probs[1]) < 30.0  # child 0 (token 1) is row 1
    assert _chi2(after[3], probs[2]) < 30.0  # token 3 is child 1 (row 2); its duplicate never wins


def test_tree_sampling_point_mass_and_chain_rows():
    """A target that is a point mass accepts its token; accepted rows follow the path."""
    params = SamplingParams(temperature=1.0)
    tree = DraftTree((2, 4, 1), (-1, -1, 1))
    logits = torch.full((4, 5), -1e4)
    logits[0, 4] = logits[2, 1] = logits[3, 0] = 0.0
    toks, rows = accept_sampling_tree(logits, tree, params, torch.Generator().manual_seed(0))
    assert toks == [4, 1, 0] and rows == [0, 2, 3]


# ---- engine level ----------------------------------------------------------------------------

def _engine(model_dir, spec=True, **kw):
    extra = dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=6, speculative_max_batch=32) if spec else {}
    return Engine(model=model_dir, device="cpu", dtype="float32", backend="torch", chunked_prefill_size=64,
                  max_running_requests=16, **extra, **kw)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(5)
    out = []
    for L in (5, 60, 120, 127, 140, 143, 260):
        base = [rng.randrange(3, 8000) for _ in range(7 if L % 2 else 300)]
        out.append((base * 300)[:L])
    return out


@pytest.fixture(scope="module")
def plain(tiny_model_dir, prompts):
    return run_requests(_engine(tiny_model_dir, spec=False), prompts,
                SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True))


def _spy_trees(eng):
    seen = []
    build = eng.runner.build_batch

    def spy(work):
        batch = build(work)
        seen.append(batch.trees)
        return batch

    eng.runner.build_batch = spy
    return seen


def test_greedy_tree_verify_equals_plain_decoding(tiny_model_dir, prompts, plain):
    """The tree oracle hides the plain output among wrong siblings (width 3, depth 4) and drops
    it at a random level every 3rd proposal: full, partial and no acceptance, trees crossing
    dense_len and C1/C2 and block boundaries. Output equals plain decoding; pages, compressed
    entries and state slots all come back."""
    params = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)
    eng = _engine(tiny_model_dir)
    assert eng.tree_verify
    initial = eng.resource_counters()
    drafters = []

    def make(req):
        drafters.append(TreeOracleDrafter(req.num_prompt, plain[req.rid], eng.cfg.vocab_size, depth=4, width=3,
                                          miss_every=3, seed=len(drafters)))
        return drafters[-1]

    eng.make_drafter = make
    seen = _spy_trees(eng)
    assert run_requests(eng, prompts, params) == plain
    assert any(t is not None for t in seen)  # trees were verified whole ...
    # ... in steps beside other sequences (prefill chunks, chains of pruned trees, plain decodes)
    assert any(t is not None and None in t for t in seen)
    misses = [m for d in drafters for m in d.misses]
    assert 0 in misses and any(m > 0 for m in misses)  # full rejection and partial acceptance
    s = eng.stats
    assert s["spec_accepted_tokens"] > s["spec_verify_steps"]  # and much accepted
    assert eng.avg_spec_accept_length > 2.0
    assert eng.resource_counters() == initial
    c = eng.resource_counters()
    assert c["pages_used"] == 0 and c["slots_used"] == 0 and c["compressed_entries"] == 0


def test_tree_sampling_in_the_engine_runs(tiny_model_dir, prompts, plain):
    eng = _engine(tiny_model_dir)
    eng.make_drafter = lambda req: TreeOracleDrafter(req.num_prompt, plain[req.rid], eng.cfg.vocab_size,
                                                     depth=3, width=2)
    initial = eng.resource_counters()
    out = run_requests(eng, prompts[:4], SamplingParams(temperature=0.8, seed=3, max_new_tokens=12, ignore_eos=True))
    assert all(len(v) == 12 for v in out.values())
    assert eng.stats["spec_verify_steps"] > 0
    assert eng.resource_counters() == initial


def test_chain_trees_take_the_chain_path(tiny_model_dir, prompts, plain):
    """A drafter's chain DraftTree is verified as the list draft it is: same outputs, same
    statistics, no tree in any batch."""
    params = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)
    results = []
    for as_tree in (False, True):
        eng = _engine(tiny_model_dir)

        def make(req, as_tree=as_tree, eng=eng):
            o = OracleDrafter(req.num_prompt, plain[req.rid], error_every=3, vocab_size=eng.cfg.vocab_size)
            if not as_tree:
                return o
            return type("ChainTree", (), {"propose": lambda self, t, k: DraftTree.chain(o.propose(t, k))})()

        eng.make_drafter = make
        seen = _spy_trees(eng)
        results.append((run_requests(eng, prompts, params), dict(eng.stats)))
        assert all(t is None for t in seen)
    assert results[0] == results[1]
    assert results[0][0] == plain


def test_backend_without_tree_support_verifies_first_paths(tiny_model_dir, prompts, plain):
    """Where the backend lacks tree verify, trees become their first path: no tree reaches a
    batch, output unchanged."""
    params = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)
    eng = _engine(tiny_model_dir)
    eng.tree_verify = False
    eng.make_drafter = lambda req: TreeOracleDrafter(req.num_prompt, plain[req.rid], eng.cfg.vocab_size,
                                                     depth=4, width=2)
    seen = _spy_trees(eng)
    assert run_requests(eng, prompts, params) == plain
    assert all(t is None for t in seen)
    assert eng.stats["spec_verify_steps"] > 0


def test_tree_pruning_and_paths():
    tree = DraftTree((5, 8, 6, 9, 4, 7), PARENTS[:6])
    assert tree.max_depth == 2 and tree.path_rows(6) == [0, 2, 6] and tree.path_rows(0) == [0]
    p1 = tree.pruned(1)
    assert p1.tokens == (5, 8, 6) and p1.parents == (-1, -1, -1)
    assert tree.pruned(0).tokens == () and tree.pruned(5) == tree


def test_forward_batch_of_a_tree_verify():
    """Tree rows sit at cache_len + depth (siblings share a position and its slot), the sequence
    reaches the deepest candidate; chains build as before; trees are never padded."""
    pages = [7, 3]  # block 16: positions 0-15 on page 7, 16-31 on page 3
    tree = SeqWork(0, pages, 14, [1, 2, 3, 4, 5], need_logits=True, num_logits=5, verify=True,
                   tree_parents=(-1, -1, 0, 2))
    chain = SeqWork(1, pages, 10, [1, 2, 3], need_logits=True, num_logits=3, verify=True)
    b = ForwardBatch.build([tree, chain], 16, 128, "cpu")
    assert b.positions.tolist() == [14, 15, 15, 16, 17, 10, 11, 12]
    assert b.slot_mapping.tolist()[:5] == [7 * 16 + 14, 7 * 16 + 15, 7 * 16 + 15, 3 * 16, 3 * 16 + 1]
    assert b.seq_lens_host == [18, 13] and b.trees == [(-1, -1, 0, 2), None]
    assert b.logits_indices.tolist() == list(range(8))
    assert ForwardBatch.build([chain], 16, 128, "cpu").trees is None
    bad = SeqWork(0, pages, 14, [1, 2, 3, 9], need_logits=True, num_logits=4, verify=True, pad_tokens=1,
                  tree_parents=(-1, -1))
    with pytest.raises(ValueError, match="draft tree"):
        ForwardBatch.build([bad], 16, 128, "cpu", pad_slot=0)


# ---- the triton backend ----------------------------------------------------------------------

def test_triton_tree_verify_under_interpreter():
    """The triton backend's tree verify against the torch one (rows, commit, engine greedy output):
    the cases live in tests/tree_interp_cases.py and run in a subprocess with TRITON_INTERPRET=1."""
    from pathlib import Path

    from kernel_checks import run_interpreter_cases

    run_interpreter_cases(Path(__file__).resolve().parent / "tree_interp_cases.py")


def test_tree_scratch_spans():
    """The pages a tree row's path rewrites: from the page of the first compressed entry it
    completes (entries live in the page their window starts in) or the root's page, to the page
    of its deepest position. Tiny config: block 16, C1 kernel 8 stride 4, C2 kernel 32 stride 16."""
    from salaserve.config import preset_config
    from salaserve.kernels.tree_pages import row_spans, scratch_pages_needed

    sc = preset_config("tiny").sparse
    assert (sc.block_size, sc.kernel_size, sc.kernel_stride) == (16, 8, 4)
    assert (sc.c2_kernel_size, sc.c2_kernel_stride) == (32, 16)
    # root at 40 (page 2); a chain of 3: positions 41..43; C1 entries end at 4j + 7: 43 -> j = 9
    # (window 36..43, page 2); no C2 entry (ends at 16i + 31: 47)
    assert row_spans(40, (-1, 0, 1), sc) == [(0, -1), (2, 2), (2, 2), (2, 2)]
    # root at 45: depth 2 reaches 47, completing C2 entry 1 (window 16..47, page 1), depth 3 the next page
    assert row_spans(45, (-1, 0, 1), sc) == [(0, -1), (2, 2), (1, 2), (1, 3)]
    assert scratch_pages_needed([45, 7], [(-1, 0, 1), None], sc) == 1 + 2 + 3


def test_verify_graphs_refuse_tree_steps():
    """Trees run eagerly: a tree verify of a captured verify shape is refused, the chain of the
    same shape taken (the rules only: no capture, which needs a GPU)."""
    from salaserve.engine.cuda_graph import StepGraphs

    graphs = object.__new__(StepGraphs)
    graphs.modes, graphs.widths, graphs.max_bs = ("dense",), {"dense": 64, "sparse": 64}, 8
    graphs.verify_ns, graphs.verify_sizes = [4], [8]

    def step(parents):
        work = [SeqWork(0, [0], 5, [7, 8, 9, 10], need_logits=True, num_logits=4, verify=True,
                        tree_parents=parents)]
        return ForwardBatch.build(work, block_size=16, dense_len=1 << 20, device="cpu")

    assert graphs.can_run(step(None))
    assert not graphs.can_run(step((-1, -1, 0)))


def test_runner_lends_tree_scratch_pages_when_free(runner):
    """The runner lends a tree step the pages kernels/tree_pages.py asks for, to backends that want
    them; none when they are not free (the backend then runs the torch ground truth) or for chains."""
    from salaserve.kernels.tree_pages import scratch_pages_needed
    from salaserve.kernels.triton_backend import TritonBackend

    tree = SeqWork(0, [1, 2, 3, 4], 45, [1, 2, 3, 4], need_logits=True, num_logits=4, verify=True,
                   tree_parents=(-1, 0, 1))
    chain = SeqWork(1, [5], 3, [1, 2], need_logits=True, num_logits=2, verify=True)
    need = scratch_pages_needed([45], [tree.tree_parents], runner.cfg.sparse)
    alloc, ops = runner.caches.kv.allocator, runner.model.ops
    assert runner._tree_scratch([tree, chain]) is None  # the torch backend reads no page copies
    runner.model.ops = TritonBackend()
    try:
        assert runner._tree_scratch([chain]) is None
        lent = runner._tree_scratch([tree, chain])
        assert len(lent) == need == 6
        alloc.free(lent)
        rest = alloc.alloc(alloc.num_free - need + 1)
        assert runner._tree_scratch([tree, chain]) is None
        alloc.free(rest)
    finally:
        runner.model.ops = ops


def test_tree_rows_meta_beside_long_prefill_chunks():
    """lightning_verify's tree argument for a step that also holds a prefill chunk over 31 rows (the
    kernel skips it): the tree's rows get their depths and ancestor bits, the chunk's rows past the
    31st no bits instead of an overflow."""
    from salaserve.kernels.lightning_verify import tree_rows_meta

    depth, anc = tree_rows_meta([3, 40], [(-1, 0), None], "cpu")
    assert depth.tolist()[:3] == [0, 1, 2] and anc.tolist()[:3] == [1, 3, 7]
    assert anc.tolist()[3 + 30] == (1 << 31) - 1 and anc.tolist()[3 + 31:] == [0] * 9
    with pytest.raises(ValueError, match="31 rows"):
        tree_rows_meta([32], [(-1,) * 31], "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("prompt_len", [40, 125, 252], ids=["dense", "crosses-dense_len", "sparse"])
def test_gpu_triton_tree_verify_equals_torch(tiny_model_dir, prompt_len):
    """On the GPU, fp32 tiny model, every kernel of the triton backend (linears included): the tree
    verify's rows, the commit's caches and states equal the torch backend's
    (`_tree_cases.check_tree_verify`; the interpreter cases' tolerances: fp32 dots run in ieee
    precision on both sides)."""
    from _tree_cases import check_tree_verify

    from salaserve.kernels.triton_backend import TritonBackend

    # a small KV pool: the check snapshots every cache (the default pool fills the GPU)
    args = EngineArgs(model=tiny_model_dir, device="cuda", dtype="float32", backend="torch",
                      chunked_prefill_size=64, max_running_requests=4, max_total_tokens=4096)
    runner = ModelRunner(args, tiny_model_dir)
    check_tree_verify(runner, TritonBackend(), prompt_len, LOGIT_ATOL, CACHE_ATOL, STATE_RTOL)


def test_benchmark_level_trees_have_the_asked_candidates_per_depth():
    from benchmarks.spec import _depth_counts, level_tree
    from salaserve.spec.tree import path_rows

    tree = level_tree([4, 4, 4, 3])
    assert len(tree) == 15 and _depth_counts(tree) == [4, 4, 4, 3]
    assert tree.parents[:4] == (-1, -1, -1, -1)
    assert tree.parents[4:8] == (0, 1, 2, 3) and tree.parents[12:] == (8, 9, 10)
    assert path_rows(tree.parents, 15) == [0, 3, 7, 11, 15]  # row 15 = candidate 14: third of each level
    assert level_tree([1, 1, 1]).is_chain
