"""ForwardBatch.build: the per-step metadata, and the one-buffer staging its GPU path copies."""

import random

import numpy as np
import pytest
import torch

from salaserve.core.batch import ForwardBatch, PageTableMirror, SeqWork, table_width
from salaserve.core.staging import pack_staged, staged_layout, staged_views


def _reference_fields(work, block, dense_len, pad_slot=None):
    """The fields written out one token at a time (the construction build replaced)."""
    ids, pos, slots, rows, cu = [], [], [], [], [0]
    for w in work:
        ids += w.token_ids
        for p in range(w.cache_len, w.seq_len):
            pos.append(p)
            slots.append(w.pages[p // block] * block + p % block)
        pos += [w.seq_len - 1] * w.pad_tokens
        slots += [pad_slot] * w.pad_tokens
        cu.append(cu[-1] + len(w.token_ids))
        if w.need_logits:
            rows += range(cu[-1] - w.num_logits, cu[-1])
    width = -(-max(len(w.pages) for w in work) // 16) * 16  # padded to a multiple of 16 columns
    table = [w.pages + [0] * (width - len(w.pages)) for w in work]
    return dict(input_ids=ids, positions=pos, slot_mapping=slots, logits_indices=rows, cu_seqlens_q=cu,
                page_table=table, seq_lens=[w.seq_len for w in work], cache_lens=[w.cache_len for w in work],
                state_slots=[w.state_slot for w in work], is_sparse=[w.seq_len >= dense_len for w in work])


def _random_work(rng, n, decode):
    work = []
    for i in range(n):
        cache = rng.randrange(0, 500)
        new = 1 if decode else rng.randrange(1, 90)
        pages = rng.sample(range(10_000), -(-(cache + new) // 64) + rng.randrange(0, 2))
        work.append(SeqWork(state_slot=rng.randrange(64), pages=pages, cache_len=cache,
                            token_ids=[rng.randrange(1000) for _ in range(new)], need_logits=rng.random() < 0.8))
    return work


@pytest.mark.parametrize("decode", [True, False])
def test_build_fields_match_token_by_token_reference(decode):
    rng = random.Random(7 if decode else 8)
    for n in (1, 3, 17):
        work = _random_work(rng, n, decode)
        b = ForwardBatch.build(work, 64, 300, "cpu")
        ref = _reference_fields(work, 64, 300)
        for name, want in ref.items():
            got = getattr(b, name)
            assert got.tolist() == want, name
        assert b.input_ids.dtype == b.positions.dtype == b.slot_mapping.dtype == torch.int64
        assert b.page_table.dtype == b.seq_lens.dtype == b.cu_seqlens_q.dtype == torch.int32
        assert b.is_decode == decode and b.token_seq is None


def test_table_width_is_one_specialisation_class():
    """Every page table's width (its row stride) is a multiple of 16, never 1: one Triton specialisation."""
    assert [table_width(n) for n in (0, 1, 15, 16, 17, 129, 1024)] == [16, 16, 16, 16, 32, 144, 1024]
    mirror = PageTableMirror(4, 3)
    assert mirror.rows.shape[1] == 16
    work = [SeqWork(state_slot=1, pages=list(range(40)), cache_len=0, token_ids=[1] * 2500, need_logits=True)]
    b = ForwardBatch.build(work, 64, 300, "cpu", pages=mirror)
    assert b.page_table.shape == (1, 48) and mirror.rows.shape[1] % 16 == 0
    assert b.page_table[0, :40].tolist() == list(range(40)) and not b.page_table[0, 40:].any()


def test_build_verify_rows_and_filler():
    rng = random.Random(3)
    work = _random_work(rng, 3, True)
    for w in work:
        w.pages = w.pages + [rng.randrange(10_000)]  # room for the drafts and filler
        w.token_ids = w.token_ids + [5, 6]
        w.verify, w.num_logits, w.need_logits = True, 3, True
    work[1].token_ids += [6, 6]
    work[1].pad_tokens, work[1].num_logits = 2, 5
    b = ForwardBatch.build(work, 64, 300, "cpu", pad_slot=999)
    ref = _reference_fields(work, 64, 300, pad_slot=999)
    for name, want in ref.items():
        assert getattr(b, name).tolist() == want, name
    assert b.token_seq.tolist() == [0] * 3 + [1] * 5 + [2] * 3
    assert b.seq_modes.tolist() == [1, 1, 1]
    with pytest.raises(ValueError, match="pad_slot"):
        ForwardBatch.build(work, 64, 300, "cpu")


def test_staged_buffer_round_trip():
    """The GPU path's packing: every array 16-byte aligned in one byte buffer (one Triton pointer
    specialisation whatever the step's sizes), each a view of it with its dtype and shape (checked
    here on a CPU buffer)."""
    rng = np.random.default_rng(0)
    arrays = [rng.integers(-2**40, 2**40, 5), rng.integers(-9, 9, (3, 7)).astype(np.int32),
              rng.random(3) < 0.5, rng.integers(0, 9, 0), rng.integers(0, 2**31 - 1, 1).astype(np.int32)]
    layout, nbytes = staged_layout(arrays)
    raw = np.zeros(nbytes, dtype=np.uint8)
    pack_staged(arrays, layout, raw)
    views = staged_views(torch.from_numpy(raw), arrays, layout)
    for a, v in zip(arrays, views):
        assert v.shape == a.shape and v.numpy().dtype == a.dtype and (v.numpy() == a).all()
    assert all(start % 16 == 0 for start, _ in layout)
    assert all(v.data_ptr() % 16 == 0 for v in views if v.numel())
    with pytest.raises(TypeError):
        staged_layout([np.zeros(2, dtype=np.float32)])


def test_page_mirror_table_matches_per_row_fill():
    """The runner's page mirror across steps: lists that grow, a slot handed to a new request
    (a new, shorter list), rows wider than planned; every step's table equals the plain fill."""
    rng = random.Random(11)
    mirror = PageTableMirror(num_slots=8, max_pages=3)
    lists = {s: rng.sample(range(10_000), rng.randrange(1, 4)) for s in range(8)}
    for step in range(40):
        for s in range(8):
            r = rng.random()
            if r < 0.15:  # the request in this slot ended; a new one takes it
                lists[s] = rng.sample(range(10_000), rng.randrange(1, 3))
            elif r < 0.6:
                lists[s].extend(rng.sample(range(10_000), rng.randrange(1, 3)))
        slots = rng.sample(range(8), rng.randrange(1, 9))
        work = [SeqWork(state_slot=s, pages=lists[s], cache_len=len(lists[s]) * 64 - 1, token_ids=[1],
                        need_logits=True) for s in slots]
        with_mirror = ForwardBatch.build(work, 64, 300, "cpu", pages=mirror)
        plain = ForwardBatch.build(work, 64, 300, "cpu")
        assert with_mirror.page_table.tolist() == plain.page_table.tolist(), step
        assert with_mirror.slot_mapping.tolist() == plain.slot_mapping.tolist(), step
    assert mirror.rows.shape[1] > 3  # some list outgrew the planned width


def test_page_mirror_skipped_for_slots_it_does_not_cover():
    mirror = PageTableMirror(num_slots=2, max_pages=4)
    work = [SeqWork(state_slot=5, pages=[3, 4], cache_len=70, token_ids=[1], need_logits=True)]
    assert ForwardBatch.build(work, 64, 300, "cpu", pages=mirror).page_table.tolist() == [[3, 4] + [0] * 14]


def test_decode_graphs_refuse_steps_with_a_row_that_does_not_sample():
    """A CUDA graph returns every row's logits in order, so a decode-shaped step whose one-token
    prefill chunk samples nothing must run eagerly (the rows after it would be misread)."""
    from salaserve.engine.cuda_graph import StepGraphs

    graphs = object.__new__(StepGraphs)  # the rules only: no capture (that needs a GPU)
    graphs.modes, graphs.widths, graphs.max_bs = ("dense",), {"dense": 64, "sparse": 64}, 8
    graphs.verify_ns, graphs.verify_sizes = [], []

    def step(*need):
        work = [SeqWork(state_slot=i, pages=[i], cache_len=5, token_ids=[7], need_logits=n) for i, n in enumerate(need)]
        return ForwardBatch.build(work, block_size=16, dense_len=1 << 20, device="cpu")

    assert graphs.can_run(step(True, True, True))
    assert not graphs.can_run(step(True, False, True))  # the middle chunk continues a prefill
    assert not graphs.can_run(step(*[True] * 9))  # beyond the largest captured batch
