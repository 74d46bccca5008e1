"""FP8 KV pages in the Triton attention kernels, under the Triton interpreter (CPU).

Run by tests/test_kv_fp8.py in a subprocess with TRITON_INTERPRET=1 (it must be set before triton
is imported). Each page-reading kernel on an fp8 pool against the same kernel on a pool that holds
the dequantized values (fp8 * scale): the attention kernels put the scales on the scores and the
probabilities instead of on K and V, so the products agree up to fp32 rounding order (within
1e-5 of the largest output); the compressed-key update dequantizes like KVPool.gather and is
bit-identical. Compute dtype fp32 here (the interpreter's tl.dot is exact only for fp32 operands).
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 (run through test_kv_fp8.py)", allow_module_level=True)

from test_kernels_attention import make_batch, prefill_block_lists, sparse_lists, tiny_cfg  # noqa: E402

from salaserve.cache.compressed import CompressedKeyPool  # noqa: E402
from salaserve.cache.pages import FP8, KVPool  # noqa: E402
from salaserve.kernels import attention as A  # noqa: E402
from salaserve.kernels import sparse as S  # noqa: E402

F32 = torch.float32
FP32_ORDER = 1e-5  # fp32 rounding-order differences, relative to the largest output


def _close(a, b, tol=FP32_ORDER):
    err = float((a.double() - b.double()).abs().max() / b.double().abs().max())
    assert err < tol, err


def _fp8_pool_and_twin(num_pages, bs, hkv, d, seed, n_layers=2):
    """An fp8 pool with random e4m3 pages and random per-(page, head) scales, and an fp32 pool
    holding exactly its dequantized values."""
    g = torch.Generator().manual_seed(seed)
    kv8 = KVPool(n_layers, num_pages, bs, hkv, d, FP8, "cpu", compute_dtype=F32)
    kv8.k.copy_((torch.randn(kv8.k.shape, generator=g) * 40).clamp(-448, 448).to(FP8))
    kv8.v.copy_((torch.randn(kv8.v.shape, generator=g) * 40).clamp(-448, 448).to(FP8))
    kv8.k_scale.copy_(torch.rand(kv8.k_scale.shape, generator=g) * 0.05 + 0.001)
    kv8.v_scale.copy_(torch.rand(kv8.v_scale.shape, generator=g) * 0.05 + 0.001)
    twin = KVPool(n_layers, num_pages, bs, hkv, d, F32, "cpu")
    twin.k.copy_(kv8.k.float() * kv8.k_scale[:, :, None, :, None])
    twin.v.copy_(kv8.v.float() * kv8.v_scale[:, :, None, :, None])
    return kv8, twin


def test_store_kv_fp8_equals_pool_write():
    """store_kv on an fp8 pool = KVPool.write bit for bit: the same per-page scales (set by the
    step that writes a page's first slot) and the same e4m3 codes (the kernel rounds on the bits,
    round_to_e4m3, so the interpreter's faulty fp8 cast never decides)."""
    cfg = tiny_cfg()
    bs, hkv, d = cfg.sparse.block_size, cfg.num_key_value_heads, cfg.head_dim
    g = torch.Generator().manual_seed(3)
    # page starts inside and outside the step; a decode token opening a page (32, 1); a chunk
    # whose last page gets one row (16, 17)
    batch = make_batch([(0, 40), (5, 3), (30, 1), (32, 1), (16, 17)], bs, 24, "cpu", seed=3)
    n = int(batch.cu_seqlens_q[-1])
    k = torch.randn(n, hkv, d, generator=g) * torch.tensor([1.0, 20.0])[None, :, None]
    v = torch.randn(n, hkv, d, generator=g)
    ref = KVPool(2, 24, bs, hkv, d, FP8, "cpu", compute_dtype=F32)
    ours = KVPool(2, 24, bs, hkv, d, FP8, "cpu", compute_dtype=F32)
    ref.write(1, batch.slot_mapping, k, v)
    A.store_kv(ours, 1, k, v, batch)
    assert torch.equal(ours.k_scale, ref.k_scale) and torch.equal(ours.v_scale, ref.v_scale)
    for a, b in ((ours.k, ref.k), (ours.v, ref.v)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_store_kv_fp8_skips_padding_slots():
    """A negative slot (padding of a captured decode batch) changes neither pages nor scales."""
    cfg = tiny_cfg()
    bs, hkv, d = cfg.sparse.block_size, cfg.num_key_value_heads, cfg.head_dim
    batch = make_batch([(16, 1), (3, 1)], bs, 8, "cpu", seed=4)
    batch.slot_mapping[1] = -1
    pool = KVPool(1, 8, bs, hkv, d, FP8, "cpu", compute_dtype=F32)
    before_k, before_s = pool.k.clone(), pool.k_scale.clone()
    k = torch.randn(2, hkv, d) * 5
    A.store_kv(pool, 0, k, k, batch)
    page0 = int(batch.page_table[0, 1])
    changed_pages = (pool.k.view(torch.uint8) != before_k.view(torch.uint8)).flatten(2).any(-1).nonzero()[:, 1]
    assert set(changed_pages.tolist()) == {page0}
    assert torch.equal(pool.k_scale[0, [p for p in range(8) if p != page0]],
                       before_s[0, [p for p in range(8) if p != page0]])


@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_decode_fp8_equals_dequantized_pool(num_splits):
    cfg = tiny_cfg()
    bs, hkv, d, hq = cfg.sparse.block_size, cfg.num_key_value_heads, cfg.head_dim, cfg.num_attention_heads
    kv8, twin = _fp8_pool_and_twin(24, bs, hkv, d, seed=5)
    batch = make_batch([(37, 1), (90, 1), (5, 1)], bs, 24, "cpu", seed=5)
    table, count, _ = sparse_lists(batch, hkv, bs, 6, 4, seed=5, device="cpu")
    q = torch.randn(3, hq, d, generator=torch.Generator().manual_seed(6))
    a = A.paged_decode_attention(q, kv8, 1, table, count, batch.seq_lens, 0.25, num_splits)
    b = A.paged_decode_attention(q, twin, 1, table, count, batch.seq_lens, 0.25, num_splits)
    _close(a, b)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_decode_fp8_f16_dots_near_dequantized_pool(num_splits):
    """bf16 compute on fp8 pages (attention._f16_dots: fp16 dot operands, q clamped to fp16's range, V's scale on the
    fp32 product) against fp32 attention over the dequantized pages: q and p rounded to fp16 (2^-11) and
    the bf16 output (2^-9) keep it within 2^-7 of the largest output. A q past fp16's range stays finite."""
    cfg = tiny_cfg()
    bs, hkv, d, hq = cfg.sparse.block_size, cfg.num_key_value_heads, cfg.head_dim, cfg.num_attention_heads
    kv8, twin = _fp8_pool_and_twin(24, bs, hkv, d, seed=9)
    kv8.compute_dtype = torch.bfloat16
    batch = make_batch([(37, 1), (90, 1), (5, 1)], bs, 24, "cpu", seed=9)
    table, count, _ = sparse_lists(batch, hkv, bs, 6, 4, seed=9, device="cpu")
    q = torch.randn(3, hq, d, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
    a = A.paged_decode_attention(q, kv8, 1, table, count, batch.seq_lens, 0.25, num_splits)
    b = A.paged_decode_attention(q.float(), twin, 1, table, count, batch.seq_lens, 0.25, num_splits)
    assert a.dtype == torch.bfloat16
    _close(a.float(), b, tol=2 ** -7)
    q[0, 0, 0] = 1e6  # beyond fp16: clamped, not inf
    assert torch.isfinite(A.paged_decode_attention(q, kv8, 1, table, count, batch.seq_lens, 0.25, num_splits)).all()


def test_dense_prefill_fp8_equals_dequantized_pool():
    cfg = tiny_cfg()
    bs, hkv, d, hq = cfg.sparse.block_size, cfg.num_key_value_heads, cfg.head_dim, cfg.num_attention_heads
    kv8, twin = _fp8_pool_and_twin(24, bs, hkv, d, seed=7)
    batch = make_batch([(20, 37), (0, 50)], bs, 24, "cpu", seed=7)
    q = torch.randn(87, hq, d, generator=torch.Generator().manual_seed(8))
    for config in (None, dict(BLOCK_M=32, BLOCK_N=32)):  # tiles inside a page and spanning pages
        a = A.dense_prefill_attention(q, kv8, 0, batch, 0.25, config=config)
        b = A.dense_prefill_attention(q, twin, 0, batch, 0.25, config=config)
        _close(a, b)


def test_sparse_prefill_fp8_equals_dequantized_pool():
    cfg = tiny_cfg()
    bs, hkv, d, hq = cfg.sparse.block_size, cfg.num_key_value_heads, cfg.head_dim, cfg.num_attention_heads
    kv8, twin = _fp8_pool_and_twin(24, bs, hkv, d, seed=9)
    batch = make_batch([(60, 20)], bs, 24, "cpu", seed=9)
    n = 20
    g = torch.Generator().manual_seed(10)
    q = torch.randn(n, hq, d, generator=g)
    nb = -(-80 // bs)
    # every token: a few random causal blocks plus its own, ascending, -1 padded
    idx = torch.full((hkv, n, 4), -1, dtype=torch.int32)
    for t in range(n):
        own = (60 + t) // bs
        for h in range(hkv):
            others = torch.randperm(own, generator=g)[:2].tolist() if own else []
            blocks = sorted(set(others + [own]))
            idx[h, t, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    assert nb >= 5
    # the in-kernel converts (past the staged copy's size cap; the staged copy: the test below)
    with S.knobs(SPARSE_FP8_STAGE_MAX_BYTES=0):
        a = S.sparse_prefill_attention(q, kv8, 1, batch, idx, 0.25)
    b = S.sparse_prefill_attention(q, twin, 1, batch, idx, 0.25)
    _close(a, b)


@pytest.mark.parametrize("dtype", [F32, torch.bfloat16])
def test_dequantize_pages_equals_gather(dtype):
    """attention.dequantize_pages: the listed pages (any order, repeats allowed) with KVPool.gather's values
    (codes times the page's scale in fp32, rounded once to the compute dtype), bit for bit."""
    cfg = tiny_cfg()
    bs, hkv, d = cfg.sparse.block_size, cfg.num_key_value_heads, cfg.head_dim
    kv8, _ = _fp8_pool_and_twin(12, bs, hkv, d, seed=21)
    kv8.compute_dtype = dtype
    pages = torch.tensor([7, 2, 11, 2, 0], dtype=torch.int32)
    k, v = A.dequantize_pages(kv8, 1, pages)
    gk, gv = kv8.gather(1, pages.long(), len(pages) * bs)
    assert k.dtype == v.dtype == dtype and k.shape == (len(pages), bs, hkv, d)
    assert torch.equal(k.flatten(0, 1), gk) and torch.equal(v.flatten(0, 1), gv)
    assert A.dequantize_pages(kv8, 1, pages[:0])[0].shape == (0, bs, hkv, d)
    with pytest.raises(ValueError, match="fp8"):
        A.dequantize_pages(_fp8_pool_and_twin(12, bs, hkv, d, seed=21)[1], 1, pages)


@pytest.mark.parametrize("mode", ["per-token", "window"])
def test_sparse_prefill_fp8_staged_equals_dequantized_pool(mode, monkeypatch):
    """fp8 pages: the batch's pages dequantized once, then the plain-pool kernels on that copy through a
    remapped page table: bit-equal to the same kernels on a pool holding the dequantized values (two
    sequences, one with cached context, so the remap crosses sequences): the per-token kernel on its own and
    after the window kernel. Past SPARSE_FP8_STAGE_MAX_BYTES the in-kernel fp8 path runs instead (no copy
    made)."""
    from salaserve.kernels.sparse import attention as SA

    cfg = tiny_cfg()
    bs, hkv, d, hq = cfg.sparse.block_size, cfg.num_key_value_heads, cfg.head_dim, cfg.num_attention_heads
    kv8, twin = _fp8_pool_and_twin(24, bs, hkv, d, seed=17)
    batch = make_batch([(60, 20), (0, 40)], bs, 24, "cpu", seed=17)
    q = torch.randn(60, hq, d, generator=torch.Generator().manual_seed(18))
    idx = prefill_block_lists(batch, hkv, bs, others=2, width=8, seed=18)
    kw = {"per-token": {}, "window": dict(window=(1, 1), window_tokens=4, ascending=True)}[mode]
    calls = []
    real = SA.dequantize_pages
    monkeypatch.setattr(SA, "dequantize_pages", lambda *a: calls.append(a[2].tolist()) or real(*a))
    a = S.sparse_prefill_attention(q, kv8, 1, batch, idx, 0.25, **kw)
    b = S.sparse_prefill_attention(q, twin, 1, batch, idx, 0.25, **kw)
    assert torch.equal(a, b)
    pt = batch.page_table.tolist()
    assert calls == [pt[0][:5] + pt[1][:3]]  # ceil(80 / 16) pages, then ceil(40 / 16)
    with S.knobs(SPARSE_FP8_STAGE_MAX_BYTES=0):
        c = S.sparse_prefill_attention(q, kv8, 1, batch, idx, 0.25, **kw)
    assert len(calls) == 1  # too large: the in-kernel path
    _close(c, b)


def test_update_compressed_fp8_equals_dequantized_pool():
    cfg = tiny_cfg()
    sc, bs, hkv, d = cfg.sparse, cfg.sparse.block_size, cfg.num_key_value_heads, cfg.head_dim
    kv8, twin = _fp8_pool_and_twin(24, bs, hkv, d, seed=11)
    batch = make_batch([(0, 70), (40, 9)], bs, 24, "cpu", seed=11)
    comps = [CompressedKeyPool(sc, 2, 24, hkv, d, F32, "cpu") for _ in range(2)]
    for comp, pool in zip(comps, (kv8, twin)):
        A.update_compressed(pool, comp, 1, batch)
    assert torch.equal(comps[0].c1, comps[1].c1) and torch.equal(comps[0].c2, comps[1].c2)
    assert comps[0].c1.abs().sum() > 0


def test_engine_triton_fp8_kv_equals_torch_fp8_kv(tmp_path, monkeypatch):
    """The whole wiring on the tiny model (fp32, sparse from 48 tokens): the triton backend with
    an fp8 KV cache (graph-safe scale updates, quantizing store, dequantizing decode / dense and
    sparse prefill / compression kernels) against the torch backend with the same fp8 cache:
    greedy tokens equal, logits within 1e-4 relative (kernel summation orders only)."""
    import random

    from salaserve.config import ModelConfig, preset_config
    from kernel_checks import greedy_outputs_and_logits

    from salaserve.engine.engine import Engine
    from salaserve.kernels.torch_ops import TorchBackend
    from salaserve.kernels.triton_backend import TritonBackend
    from salaserve.model.checkpoint import write_checkpoint

    # linears and the Lightning prefill norm through torch: their kernels have their own tests and
    # would cost minutes under the interpreter
    for name in ("linear", "norm_linear", "residual_norm_linear", "lightning_qk_norm_rope"):
        monkeypatch.setattr(TritonBackend, name, getattr(TorchBackend, name))
    raw = preset_config("tiny").to_dict()
    raw["sparse_config"].update(topk=2, window_size=16, dense_len=48)
    model_dir = str(tmp_path / "model")
    write_checkpoint(model_dir, ModelConfig.from_dict(raw))
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 8000) for _ in range(n)] for n in (30, 70)]

    def run(backend):
        eng = Engine(model=model_dir, device="cpu", dtype="float32", backend=backend, kv_cache_dtype="fp8_e4m3",
                     chunked_prefill_size=64)
        assert eng.runner.caches.kv.fp8
        return greedy_outputs_and_logits(eng, prompts, 10)

    ref, ref_rows = run("torch")
    got, got_rows = run("triton")
    assert got == ref
    assert len(got_rows) == len(ref_rows)
    rel = max(((a - b).norm(dim=-1) / a.norm(dim=-1)).max().item() for a, b in zip(ref_rows, got_rows))
    assert rel < 1e-4, rel
