"""FP8 KV cache (`kv_cache_dtype="fp8_e4m3"`, torch backend): quantization per page and KV head,
the page budget, and the engine end to end against the model-dtype cache."""

import random
from pathlib import Path

import pytest
import torch
from kernel_checks import greedy_outputs_and_logits, run_interpreter_cases

from salaserve.cache.pages import FP8_HEADROOM, FP8_MAX, KVPool
from salaserve.config import EngineArgs, preset_config
from salaserve.engine.engine import Engine

# e4m3 keeps 3 mantissa bits: a value in the normal range (>= 2^-6 * scale) is rounded to within
# half a step, 2^-4 of its magnitude; smaller ones to within half the subnormal step, 2^-10 * scale.
REL_STEP = 2.0 ** -4
SUBNORMAL_HALF_STEP = 2.0 ** -10


def _within_fp8_rounding(deq, x, scale):
    err = (deq.float() - x.float()).abs()
    bound = torch.maximum(REL_STEP * x.float().abs(), SUBNORMAL_HALF_STEP * scale)
    return bool((err <= bound * (1 + 1e-6)).all())


def test_write_gather_round_trip_per_page_scales():
    gen = torch.Generator().manual_seed(0)
    bs, hkv, d = 4, 2, 8
    pool = KVPool(1, 6, bs, hkv, d, torch.float8_e4m3fn, "cpu", compute_dtype=torch.float32)
    pages = torch.tensor([3, 1, 5])
    k = torch.randn(12, hkv, d, generator=gen) * torch.tensor([1.0, 30.0])[None, :, None]  # heads differ
    v = torch.randn(12, hkv, d, generator=gen)
    # a prefill chunk of 6 tokens (page 3 whole, page 1 half), then 6 decode steps of one token
    slots = torch.stack([pages[t // bs] * bs + t % bs for t in range(12)])
    pool.write(0, slots[:6], k[:6], v[:6])
    for t in range(6, 12):
        pool.write(0, slots[t:t + 1], k[t:t + 1], v[t:t + 1])
    kk, vv = pool.gather(0, pages, 12)
    for x, deq, scale in ((k, kk, pool.k_scale), (v, vv, pool.v_scale)):
        for t in range(12):
            page = int(pages[t // bs])
            s = scale[0, page]  # [hkv]
            assert _within_fp8_rounding(deq[t], x[t], s[:, None])
    # scales come from the tokens written with a page's first slot: page 3 from tokens 0-3, page 1
    # from tokens 4-5, page 5 from token 8 alone; per head
    expect = torch.stack([k[0:4].abs().amax((0, 2)), k[4:6].abs().amax((0, 2)), k[8].abs().amax(-1)])
    assert torch.allclose(pool.k_scale[0, pages], expect * FP8_HEADROOM / FP8_MAX)


def test_values_past_the_headroom_saturate():
    pool = KVPool(1, 2, 4, 1, 4, torch.float8_e4m3fn, "cpu", compute_dtype=torch.float32)
    x = torch.ones(1, 1, 4)
    pool.write(0, torch.tensor([0]), x, x)  # scale = 8 / 448
    pool.write(0, torch.tensor([1]), 4 * x, 4 * x)  # within the headroom: kept (224 in e4m3, exact)
    pool.write(0, torch.tensor([2]), 100 * x, 100 * x)  # past it: clamped to 448 * scale = 8
    k, _ = pool.gather(0, torch.tensor([0]), 3)
    assert k[:, 0, 0].tolist() == [1.0, 4.0, 8.0]


def test_fp8_pages_cost_about_half():
    """The page budget: K/V bytes halve; compressed keys stay 16-bit and each page carries its scales."""
    from salaserve.cache.budget import plan_caches

    cfg = preset_config("full")
    args = EngineArgs(model="x")
    bf16 = plan_caches(cfg, args, torch.device("cpu"), torch.bfloat16, torch.float32)
    fp8 = plan_caches(cfg, args, torch.device("cpu"), torch.float8_e4m3fn, torch.float32,
                      compressed_dtype=torch.bfloat16)
    ratio = bf16.page_bytes / fp8.page_bytes
    assert 1.9 < ratio < 2.0, ratio  # pages per GiB: 1.93x


def test_kv_cache_dtype_is_validated():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineArgs(model="x", kv_cache_dtype="int4").validate()


def test_engine_with_fp8_kv_follows_the_model_dtype_cache(tiny_model_dir):
    """Tiny model, fp32 compute: prompts below and past dense_len (128), chunked prefill (64).
    K/V rounding of ~2^-4 relative per element moves the logits by a few percent at most here."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 8000) for _ in range(n)] for n in (40, 150, 300)]

    def run(kv_dtype):
        eng = Engine(model=tiny_model_dir, device="cpu", dtype="float32", backend="torch",
                     kv_cache_dtype=kv_dtype, chunked_prefill_size=64)
        return greedy_outputs_and_logits(eng, prompts, 16)

    ref, ref_rows = run("auto")
    got, got_rows = run("fp8_e4m3")
    assert got == ref  # greedy tokens unchanged on these prompts
    assert len(got_rows) == len(ref_rows)
    rel = max(((a - b).norm(dim=-1) / a.norm(dim=-1)).max().item() for a, b in zip(ref_rows, got_rows))
    assert 0 < rel < 0.05, rel  # not vacuous: the cache really is fp8


def test_triton_kernels_on_fp8_pages_under_interpreter():
    """The triton kernels' fp8 KV path (quantizing store_kv, dequantizing decode / dense prefill /
    sparse prefill attention and compressed-key updates, the engine end to end): the cases live in
    tests/kv_fp8_interp_cases.py and run in a subprocess with TRITON_INTERPRET=1."""
    run_interpreter_cases(Path(__file__).resolve().parent / "kv_fp8_interp_cases.py")


def test_sparse_prefill_kernel_on_fp8_pages_compiles_for_sm90():
    """The block-sparse prefill kernel (bf16 and fp8 pages) compiles for the H200 without spills, as it
    is launched: the pool dtype's warps (_PER_TOKEN_WARPS), after the window kernel or on its own."""
    import sys
    from pathlib import Path

    import triton.language as tl

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from kernel_checks import compile_sm90_without_spills
    from salaserve.kernels import sparse as S

    for pool, fp8 in (("*bf16", False), ("*fp8e4nv", True)):
        ptrs = dict(q_ptr="*bf16", k_ptr=pool, v_ptr=pool, o_ptr="*bf16", block_idx_ptr="*i32",
                    page_idx_ptr="*i32", positions_ptr="*i32", m_part_ptr="*fp32", l_part_ptr="*fp32",
                    acc_part_ptr="*fp32")
        for after_window in (False, True):
            compile_sm90_without_spills(S._sparse_prefill_attn_kernel, ptrs,
                                        dict(GROUP=16, GP=16, D=128, BS=64, W=128, DOT_PREC=None, KV_FP8=fp8,
                                             COMPUTE_DT=tl.bfloat16, HKV=2, AFTER_WINDOW=after_window, INIT=1,
                                             LOCAL=32),
                                        S._PER_TOKEN_WARPS[fp8])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["decode", "prefill", "store", "compress", "sparse"])
def test_gpu_kernels_on_fp8_pages_equal_dequantized_pages(kind):
    """On the GPU at the model's head geometry (Hkv 2, d 128, 64-token pages), bf16 compute: each
    attention kernel on fp8 pages against the same kernel on bf16 pages holding KVPool.gather's
    values. Those pages carry one bf16 rounding per element (2^-9 relative) that the fp8 path
    does not (it scales scores and probabilities instead), so outputs may differ by a few 2^-9:
    bound 2^-6 of the largest output. store_kv equals KVPool.write bit for bit (scales, codes), and
    the staged sparse prefill (the bf16-page kernels on a dequantized copy) equals the twin bit for bit."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_kernels_attention import make_batch, prefill_block_lists, sparse_lists

    from salaserve.cache.pages import FP8
    from salaserve.kernels import attention as A
    from salaserve.kernels import sparse as S

    dev, bs, hkv, d, hq, pages = "cuda", 64, 2, 128, 32, 80
    g = torch.Generator(device=dev).manual_seed(0)
    kv8 = KVPool(1, pages, bs, hkv, d, FP8, dev, compute_dtype=torch.bfloat16)
    twin = KVPool(1, pages, bs, hkv, d, torch.bfloat16, dev)
    if kind == "store":
        batch = make_batch([(0, 300), (130, 1), (64, 1)], bs, pages, dev, seed=1)
        n = int(batch.cu_seqlens_q[-1])
        k = (torch.randn(n, hkv, d, device=dev, generator=g) * 3).to(torch.bfloat16)
        v = torch.randn(n, hkv, d, device=dev, generator=g).to(torch.bfloat16)
        A.store_kv(kv8, 0, k, v, batch)
        twin8 = KVPool(1, pages, bs, hkv, d, FP8, dev, compute_dtype=torch.bfloat16)
        twin8.write(0, batch.slot_mapping, k, v)
        assert torch.equal(kv8.k_scale, twin8.k_scale) and torch.equal(kv8.v_scale, twin8.v_scale)
        assert torch.equal(kv8.k.view(torch.uint8), twin8.k.view(torch.uint8))
        assert torch.equal(kv8.v.view(torch.uint8), twin8.v.view(torch.uint8))
        return
    kv8.k.copy_((torch.randn(kv8.k.shape, device=dev, generator=g) * 40).clamp(-448, 448).to(FP8))
    kv8.v.copy_((torch.randn(kv8.v.shape, device=dev, generator=g) * 40).clamp(-448, 448).to(FP8))
    kv8.k_scale.copy_(torch.rand(kv8.k_scale.shape, device=dev, generator=g) * 0.05 + 0.001)
    kv8.v_scale.copy_(torch.rand(kv8.v_scale.shape, device=dev, generator=g) * 0.05 + 0.001)
    twin.k.copy_((kv8.k.float() * kv8.k_scale[:, :, None, :, None]).to(torch.bfloat16))
    twin.v.copy_((kv8.v.float() * kv8.v_scale[:, :, None, :, None]).to(torch.bfloat16))
    if kind == "compress":
        # update_compressed (fp8 pools: a scale load per token and KV head) against the
        # same kernel on the pages holding gather's values: equal inputs to fp32 window sums taken in
        # different orders, so at most one bf16 ulp apart (2^-7 of the value, bounded by the largest)
        from salaserve.cache.compressed import CompressedKeyPool
        from salaserve.config import SparseConfig

        sc = SparseConfig()
        batch = make_batch([(0, 1500), (2000, 33), (1007, 1)], bs, pages, dev, seed=4)  # 24 + 32 + 16 pages
        comps = [CompressedKeyPool(sc, 1, pages, hkv, d, torch.bfloat16, dev) for _ in range(2)]
        for comp, pool in zip(comps, (kv8, twin)):
            A.update_compressed(pool, comp, 0, batch)
        for name in ("c1", "c2"):
            a, b = getattr(comps[0], name).float(), getattr(comps[1], name).float()
            err = (a - b).abs().max().item()
            print(f"compress {name}: max |fp8 - dequantized| {err:.3g}, equal {torch.equal(a, b)}")
            assert b.abs().sum() > 0 and err <= 2 ** -7 * b.abs().max().item()
        return
    if kind == "decode":
        batch = make_batch([(1000, 1), (3000, 1), (40, 1)], bs, pages, dev, seed=2)
        table, count, _ = sparse_lists(batch, hkv, bs, 16, 10, seed=2, device=dev)
        q = torch.randn(3, hq, d, device=dev, generator=g).to(torch.bfloat16)
        for splits in (1, 4):  # bf16 compute: fp16 dot operands (attention._f16_dots)
            a = A.paged_decode_attention(q, kv8, 0, table, count, batch.seq_lens, d ** -0.5, splits)
            b = A.paged_decode_attention(q, twin, 0, table, count, batch.seq_lens, d ** -0.5, splits)
            err = (a.float() - b.float()).abs().max().item()
            print(f"decode splits={splits}: max |fp8 - dequantized| {err:.3g}, equal {torch.equal(a, b)}")
            assert err <= 2 ** -6 * b.float().abs().max().item()
    elif kind == "sparse":
        # the block-sparse prefill (window kernel for the forced blocks, then the per-token kernel) with the
        # in-kernel fp8 converts (past the staged copy's size cap): every token lists block 0, its own block
        # and the one before (the forced blocks of window (1, 1)) and up to 8 random causal others, ascending
        batch = make_batch([(1900, 700), (0, 300)], bs, pages, dev, seed=5)
        idx = prefill_block_lists(batch, hkv, bs, others=8, width=16, seed=5)
        q = torch.randn(idx.shape[1], hq, d, device=dev, generator=g).to(torch.bfloat16)
        for window in (None, (1, 1)):
            kw = dict(window=window, window_tokens=8, ascending=True) if window else {}
            with S.knobs(SPARSE_FP8_STAGE_MAX_BYTES=0):
                a = S.sparse_prefill_attention(q, kv8, 0, batch, idx, d ** -0.5, **kw)
            b = S.sparse_prefill_attention(q, twin, 0, batch, idx, d ** -0.5, **kw)
            err = (a.float() - b.float()).abs().max().item()
            print(f"sparse in-kernel window={window}: max |fp8 - dequantized| {err:.3g}")
            assert err <= 2 ** -6 * b.float().abs().max().item()
        for window in (None, (1, 1)):  # the staged copy: the same kernels on the same values, bit-equal
            kw = dict(window=window, window_tokens=8, ascending=True) if window else {}
            a = S.sparse_prefill_attention(q, kv8, 0, batch, idx, d ** -0.5, **kw)
            b = S.sparse_prefill_attention(q, twin, 0, batch, idx, d ** -0.5, **kw)
            print(f"sparse staged window={window}: equal {torch.equal(a, b)}")
            assert torch.equal(a, b)
    else:
        batch = make_batch([(500, 700), (0, 300)], bs, pages, dev, seed=3)
        q = torch.randn(1000, hq, d, device=dev, generator=g).to(torch.bfloat16)
        a = A.dense_prefill_attention(q, kv8, 0, batch, d ** -0.5)
        b = A.dense_prefill_attention(q, twin, 0, batch, d ** -0.5)
        err = (a.float() - b.float()).abs().max().item()
        print(f"prefill: max |fp8 - dequantized| {err:.3g}")
        assert err <= 2 ** -6 * b.float().abs().max().item()
