"""The triton backend's tree verify against the torch backend's on one runner, shared by the
interpreter cases (tests/tree_interp_cases.py) and the GPU test (tests/test_spec_tree.py)."""

from __future__ import annotations

import random

import torch

from salaserve.core.batch import SeqWork
from salaserve.spec.tree import DraftTree

# the tree of tests/test_spec_tree.py: width 3, depth 4, 11 rows
PARENTS = (-1, -1, -1, 0, 0, 1, 3, 3, 5, 6)


def _caches(runner):
    c = runner.caches
    return (c.kv.k, c.kv.v, c.compressed.c1, c.compressed.c2, c.states.state)


def forward(runner, seqs, lend_scratch: bool = True):
    """The runner's own batch building (scratch pages for a backend's tree rows unless not
    lend_scratch, as when none are free), freed after. Returns (logits, the scratch pages or None)."""
    scratch = runner._tree_scratch(seqs) if lend_scratch else None
    try:
        batch = runner._build(seqs, None, scratch)
        runner.last_batch = batch
        return runner.model.forward(batch, runner.caches), scratch
    finally:
        if scratch:
            runner.caches.kv.allocator.free(scratch)


def _prefill(runner, prompt, pages, slot):
    done = 0
    while done < len(prompt):
        n = min(64, len(prompt) - done)
        logits, _ = forward(runner, [SeqWork(slot, pages, done, prompt[done:done + n], need_logits=True,
                                             prompt_len=len(prompt))])
        done += n
    return logits[-1]


def check_tree_verify(runner, triton_ops, prompt_len: int, logit_atol: float, cache_atol: float,
                      state_rtol: float, parents=PARENTS, lend_scratch: bool = True) -> None:
    """runner (torch backend) prefills a prompt of prompt_len and a second one; then, from the same
    caches, a step with a tree verify (`parents`, which start with PARENTS) beside a plain decode
    of the second sequence runs on the torch backend and on triton_ops, each followed by the commit
    of the path root -> 0 -> 3 -> 6 -> 9. Every logit row, the sequence's K/V pages and compressed
    keys after the commit, and both state slots agree within the tolerances; the triton step ran
    its sparse kernels (not the torch fallback), its Lightning kernel unless the tree is over
    lightning_verify's CHUNK_MAX_TOKENS rows, and gave its scratch pages back. Without scratch
    pages (lend_scratch False) its sparse layers run the torch ground truth instead."""
    from salaserve.kernels.lightning_verify import CHUNK_MAX_TOKENS

    assert tuple(parents[:len(PARENTS)]) == PARENTS
    cfg = runner.cfg
    sc = cfg.sparse
    rng = random.Random(prompt_len)
    prompt = [rng.randrange(3, cfg.vocab_size) for _ in range(prompt_len)]
    other = [rng.randrange(3, cfg.vocab_size) for _ in range(20)]
    kv, states = runner.caches.kv, runner.caches.states
    pages = kv.allocator.alloc(-(-(prompt_len + 8) // sc.block_size))
    pages2 = kv.allocator.alloc(2)
    slot, slot2 = states.alloc(), states.alloc()
    torch_ops = runner.model.ops
    free_before = kv.allocator.num_free
    try:
        root = int(_prefill(runner, prompt, pages, slot).argmax())
        _prefill(runner, other, pages2, slot2)
        tree = DraftTree(tuple(rng.randrange(3, cfg.vocab_size) for _ in parents), tuple(parents))
        seqs = [SeqWork(slot, pages, prompt_len, [root, *tree.tokens], need_logits=True, num_logits=len(tree) + 1,
                        verify=True, prompt_len=prompt_len, tree_parents=tree.parents),
                SeqWork(slot2, pages2, len(other), [5], need_logits=True, prompt_len=len(other))]
        snap = [t.clone() for t in _caches(runner)]
        rows = tree.path_rows(10)  # every depth
        assert rows == [0, 1, 4, 7, 10]
        results = []
        for ops in (torch_ops, triton_ops):
            for dst, src in zip(_caches(runner), snap):
                dst.copy_(src)
            runner.model.ops = ops
            logits, scratch = forward(runner, seqs, lend_scratch)
            assert (scratch is not None) == (ops is triton_ops and lend_scratch)
            if ops is triton_ops:  # the kernels ran, not the torch fallback (unless no scratch)
                d = runner.last_batch.derived
                assert (d["tree_plan"] is not None) == lend_scratch
                chunk = len(tree) + 1 <= CHUNK_MAX_TOKENS
                assert ("tree_rows" in d) == ("k" in runner.last_batch.spec_kv) == chunk
            runner.commit_verified([(0, slot, rows)])
            assert ("kv", 0, 0) not in runner.last_batch.spec_kv  # the commit took the kept K/V
            p = torch.tensor(pages, device=kv.k.device)
            c = runner.caches
            results.append((logits, [t[:, p].clone() for t in (c.kv.k, c.kv.v, c.compressed.c1, c.compressed.c2)],
                            c.states.state[slot].clone(), c.states.state[slot2].clone()))
        assert kv.allocator.num_free == free_before  # scratch pages came back
        (lt, ct, st, st2), (lg, cg, sg, sg2) = results
        assert lt.shape == lg.shape == (len(tree) + 2, cfg.vocab_size)
        diff = (lt - lg).abs().amax(-1)
        assert diff.max().item() <= logit_atol, diff.tolist()
        for name, a, b in zip(("k", "v", "c1", "c2"), ct, cg):
            assert (a.float() - b.float()).abs().max().item() <= cache_atol, name
        for a, b in ((st, sg), (st2, sg2)):
            assert (a - b).abs().max().item() <= state_rtol * a.abs().max().item()
    finally:
        runner.model.ops = torch_ops
        kv.allocator.free(pages + pages2)
        states.free(slot)
        states.free(slot2)
