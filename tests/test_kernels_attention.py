"""Triton attention / cache-maintenance kernels (salaserve/kernels/attention/) vs the torch twins.

CPU: the kernels run under the Triton interpreter on small fp32 shapes. TRITON_INTERPRET must be
set before triton is imported, and other test files of the same pytest process import triton
normally, so `test_attention_kernels_under_interpreter` re-runs this file in a subprocess with
TRITON_INTERPRET=1; only there are the `test_interp_*` checks defined.
GPU (`-m gpu`): the same checks at the real shapes (Hq=32, Hkv=2, d=128, block 64, bf16 pools).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from salaserve.cache.compressed import CompressedKeyPool
from salaserve.cache.pages import KVPool
from salaserve.config import SparseConfig, preset_config
from salaserve.core.batch import ForwardBatch, SeqWork
from salaserve.kernels.torch_ops import TorchBackend
from salaserve.model import reference as spec

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POISON = 0  # page id never given to a sequence; the page tables are padded with it


# ---------------------------------------------------------------------------------------------
# scenario builders (shared by the interpreter and the GPU checks)
# ---------------------------------------------------------------------------------------------


def make_pools(num_pages, block_size, hkv, d, dtype, device, seed, sc=None, n_layers=2):
    g = torch.Generator().manual_seed(seed)
    kv = KVPool(n_layers, num_pages, block_size, hkv, d, dtype, device)
    kv.k.copy_(torch.randn(kv.k.shape, generator=g).to(dtype))
    kv.v.copy_(torch.randn(kv.v.shape, generator=g).to(dtype))
    comp = None
    if sc is not None:
        comp = CompressedKeyPool(sc, n_layers, num_pages, hkv, d, dtype, device)
        # garbage everywhere: entries that must stay untouched are checked against it
        comp.c1.copy_(torch.randn(comp.c1.shape, generator=g).to(dtype))
        comp.c2.copy_(torch.randn(comp.c2.shape, generator=g).to(dtype))
    return kv, comp


def make_batch(seqs, block_size, num_pages, device, seed):
    """seqs: [(cache_len, q_len)]. Pages are a random permutation of 1..num_pages-1 (never
    contiguous, page 0 reserved as poison); tables are padded with page 0."""
    g = torch.Generator().manual_seed(seed + 1)
    free = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    work = []
    for i, (c, n) in enumerate(seqs):
        need = -(-(c + n) // block_size)
        assert need <= len(free), "test pool too small"
        pages, free = free[:need], free[need:]
        work.append(SeqWork(state_slot=i, pages=pages, cache_len=c, token_ids=[0] * n, need_logits=True))
    return ForwardBatch.build(work, block_size, dense_len=1 << 30, device=device)


def poison_unused_slots(kv, layer, batch):
    """NaN in page 0 and in the slots past each sequence's end: a kernel that reads a key it must
    not see (or multiplies a masked V by 0) produces NaN."""
    bs = kv.block_size
    kv.k[layer, POISON] = float("nan")
    kv.v[layer, POISON] = float("nan")
    for i, L in enumerate(batch.seq_lens_host):
        last = int(batch.page_table[i, (L - 1) // bs])
        if L % bs:
            kv.k[layer, last, L % bs:] = float("nan")
            kv.v[layer, last, L % bs:] = float("nan")


def rel_err(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def tiny_cfg():
    return preset_config("tiny")  # Hq=8, Hkv=2, d=16, block 16, C1 8/4, C2 32/16


def ref_prefill(q, kv, layer, batch, scale):
    """Causal attention per sequence on gathered keys (reference.attention), query-chunked."""
    out = torch.empty_like(q, dtype=torch.float32)
    bs = kv.block_size
    for i, n in enumerate(batch.q_lens_host):
        s = int(batch.cu_seqlens_q[i])
        L = batch.seq_lens_host[i]
        keys, values = kv.gather(layer, batch.page_table[i, : -(-L // bs)].long(), L)
        pos = batch.positions[s:s + n]
        kpos = torch.arange(L, device=q.device)
        for c in range(0, n, 1024):
            e = min(n, c + 1024)
            allowed = (kpos[None, :] <= pos[c:e, None])[None]
            out[s + c:s + e] = spec.attention(q[s + c:s + e].float(), keys, values, allowed, scale)
    return out


def sparse_lists(batch, hkv, block_size, max_sel, keep, seed, device):
    """Per (seq, KV head): a random subset of the sequence's logical blocks that always holds the
    last one, listed as page ids with the last block LAST and the others shuffled; padded with the
    poison page. Returns block_table, block_count and the bool block mask [B, hkv, nb_max]."""
    g = torch.Generator().manual_seed(seed + 2)
    B = batch.num_seqs
    table = torch.full((B, hkv, max_sel), POISON, dtype=torch.int32)
    count = torch.zeros((B, hkv), dtype=torch.int32)
    nb_max = batch.page_table.shape[1]
    mask = torch.zeros((B, hkv, nb_max), dtype=torch.bool)
    pt = batch.page_table.cpu()
    for i, L in enumerate(batch.seq_lens_host):
        nb = -(-L // block_size)
        for h in range(hkv):
            others = torch.randperm(nb - 1, generator=g)[: min(nb - 1, keep - 1, max_sel - 1)]
            chosen = others.tolist() + [nb - 1]
            mask[i, h, chosen] = True
            table[i, h, : len(chosen)] = pt[i, chosen]
            count[i, h] = len(chosen)
    return table.to(device), count.to(device), mask.to(device)


def prefill_block_lists(batch, hkv, block_size, others, width, seed):
    """Per (KV head, prefill token): block 0, the token's own block and the one before (the forced blocks of
    a (1, 1) window), plus up to `others` random causal blocks, ascending and -1 padded to `width`: the
    block_idx [hkv, N, width] int32 of sparse_prefill_attention, on the batch's device."""
    g = torch.Generator().manual_seed(seed)
    positions = batch.positions.cpu().tolist()
    idx = torch.full((hkv, len(positions), width), -1, dtype=torch.int32)
    for t, pos in enumerate(positions):
        own = pos // block_size
        for h in range(hkv):
            blocks = sorted(set(torch.randperm(own, generator=g)[:others].tolist() + [0, max(own - 1, 0), own]))
            idx[h, t, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    return idx.to(batch.positions.device)


def ref_decode(q, kv, layer, page_table, seq_lens, block_mask, scale):
    out = torch.empty_like(q, dtype=torch.float32)
    bs = kv.block_size
    for i, L in enumerate(seq_lens):
        nb = -(-L // bs)
        keys, values = kv.gather(layer, page_table[i, :nb].long(), L)
        allowed = block_mask[i, :, :nb].repeat_interleave(bs, dim=-1)[:, None, :L]  # [hkv, 1, L]
        out[i:i + 1] = spec.attention(q[i:i + 1].float(), keys, values, allowed, scale)
    return out


# ---------------------------------------------------------------------------------------------
# checks, parameterized by shape; called from the interpreter tests and the GPU tests
# ---------------------------------------------------------------------------------------------


def check_store_kv(seqs, block_size, hkv, d, dtype, device, num_pages, seed=0):
    from salaserve.kernels import attention as A

    layer = 1
    kv, _ = make_pools(num_pages, block_size, hkv, d, dtype, device, seed)
    batch = make_batch(seqs, block_size, num_pages, device, seed)
    n = batch.num_tokens
    g = torch.Generator().manual_seed(seed + 3)
    # k, v as strided views of one fused projection output, like the serving model's split
    fused = torch.randn(n, 3 * hkv * d + 5, generator=g).to(device=device, dtype=dtype)
    k = fused[:, 5:5 + hkv * d].view(n, hkv, d)
    v = fused[:, 5 + 2 * hkv * d:5 + 3 * hkv * d].view(n, hkv, d)
    want = KVPool(2, num_pages, block_size, hkv, d, dtype, device)
    want.k.copy_(kv.k)
    want.v.copy_(kv.v)
    TorchBackend().store_kv(want, layer, k, v, batch)
    A.store_kv(kv, layer, k, v, batch)
    assert torch.equal(kv.k, want.k) and torch.equal(kv.v, want.v)  # incl. other layer and pages

    # a negative slot (padded token of a captured batch) writes nothing
    before_k, before_v = kv.k.clone(), kv.v.clone()
    batch.slot_mapping[0] = -1
    k2, v2 = k + 1, v + 1
    A.store_kv(kv, layer, k2, v2, batch)
    sel = batch.slot_mapping >= 0
    TorchBackend().store_kv(want, layer, k2[sel], v2[sel], type("B", (), {"slot_mapping": batch.slot_mapping[sel], "trees": None}))
    assert torch.equal(kv.k, want.k) and torch.equal(kv.v, want.v)
    assert not torch.equal(kv.k, before_k) and not torch.equal(kv.v, before_v)


def check_update_compressed(seqs, sc, hkv, d, dtype, device, num_pages, seed=0, max_new_entries=None,
                            atol=1e-6, rtol=1e-5):
    from salaserve.kernels import attention as A

    layer = 1
    kv, comp = make_pools(num_pages, sc.block_size, hkv, d, dtype, device, seed, sc=sc)
    batch = make_batch(seqs, sc.block_size, num_pages, device, seed)
    want = CompressedKeyPool(sc, 2, num_pages, hkv, d, dtype, device)
    want.c1.copy_(comp.c1)
    want.c2.copy_(comp.c2)
    TorchBackend().update_compressed(kv, want, layer, batch)
    changed = (want.c1 != comp.c1).any(-1).any(-1).sum() + (want.c2 != comp.c2).any(-1).any(-1).sum()
    A.update_compressed(kv, comp, layer, batch, max_new_entries=max_new_entries)
    # the twin's writes and the kernel's must land in the same entries; untouched ones stay bitwise
    torch.testing.assert_close(comp.c1, want.c1, atol=atol, rtol=rtol)
    torch.testing.assert_close(comp.c2, want.c2, atol=atol, rtol=rtol)
    return int(changed)


def check_dense_prefill(seqs, hq, hkv, d, block_size, dtype, device, num_pages, seed=0, config=None,
                        tol=1e-4):
    from salaserve.kernels import attention as A

    layer = 0
    kv, _ = make_pools(num_pages, block_size, hkv, d, dtype, device, seed)
    batch = make_batch(seqs, block_size, num_pages, device, seed)
    poison_unused_slots(kv, layer, batch)
    g = torch.Generator().manual_seed(seed + 4)
    q = torch.randn(batch.num_tokens, hq, d, generator=g).to(device=device, dtype=dtype)
    scale = d ** -0.5
    out = A.dense_prefill_attention(q, kv, layer, batch, scale, config=config)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert torch.isfinite(out).all()
    ref = ref_prefill(q, kv, layer, batch, scale)
    for i, n in enumerate(batch.q_lens_host):
        s = int(batch.cu_seqlens_q[i])
        e = rel_err(out[s:s + n], ref[s:s + n])
        assert e < tol, f"seq {i} {seqs[i]}: relative error {e:.3g}"
    return batch, kv, q, out


def check_paged_decode(seq_lens, hq, hkv, d, block_size, dtype, device, num_pages, num_splits, sparse_keep=None,
                       max_sel=None, seed=0, tol=1e-4):
    from salaserve.kernels import attention as A

    layer = 1
    kv, _ = make_pools(num_pages, block_size, hkv, d, dtype, device, seed)
    batch = make_batch([(L - 1, 1) for L in seq_lens], block_size, num_pages, device, seed)
    poison_unused_slots(kv, layer, batch)
    g = torch.Generator().manual_seed(seed + 5)
    q = torch.randn(len(seq_lens), hq, d, generator=g).to(device=device, dtype=dtype)
    scale = d ** -0.5
    if sparse_keep is None:
        table, count = A.dense_block_table(batch.page_table, batch.seq_lens, hkv, block_size)
        nb = batch.page_table.shape[1]
        bidx = torch.arange(nb, device=device)
        mask = (bidx[None, :] < count[:, :1])[:, None, :].expand(-1, hkv, -1)
    else:
        table, count, mask = sparse_lists(batch, hkv, block_size, max_sel, sparse_keep, seed, device)
    out = A.paged_decode_attention(q, kv, layer, table, count, batch.seq_lens, scale, num_splits=num_splits)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert torch.isfinite(out).all()
    ref = ref_decode(q, kv, layer, batch.page_table, batch.seq_lens_host, mask, scale)
    for i in range(len(seq_lens)):
        e = rel_err(out[i], ref[i])
        assert e < tol, f"seq {i} (len {seq_lens[i]}, splits {num_splits}): relative error {e:.3g}"
    return out


# ---------------------------------------------------------------------------------------------
# CPU: interpreter checks (defined only in the TRITON_INTERPRET=1 subprocess)
# ---------------------------------------------------------------------------------------------

# (cache_len, q_len): fresh prefills, chunks over a cache, decodes; partial and exact last pages.
TINY_SEQS = [(0, 37), (21, 1), (40, 24), (16, 16), (5, 3), (0, 1), (63, 1), (31, 2), (2, 30), (10, 20)]

if INTERP:

    def test_interp_store_kv():
        check_store_kv(TINY_SEQS, 16, 2, 16, torch.float32, "cpu", num_pages=40)

    def test_interp_update_compressed_tiny():
        sc = tiny_cfg().sparse  # C1 8/4, C2 32/16, block 16
        # prefill chunks and decodes that do / do not give birth to C1 and C2 entries
        seqs = [(0, 37), (21, 30), (31, 1), (47, 1), (33, 1), (100, 60), (0, 7), (12, 1)]
        assert check_update_compressed(seqs, sc, 2, 16, torch.float32, "cpu", num_pages=40) > 0
        # fewer programs than new entries: each program strides over several
        check_update_compressed(seqs, sc, 2, 16, torch.float32, "cpu", num_pages=40, seed=1, max_new_entries=3)

    def test_interp_update_compressed_decode_batch():
        sc = tiny_cfg().sparse
        # a decode batch (grid (B, 1)): births of C1 and C2 (L=32, 48), C1 only (L=36), none (L=34)
        seqs = [(31, 1), (47, 1), (35, 1), (33, 1), (7, 1)]
        assert check_update_compressed(seqs, sc, 2, 16, torch.float32, "cpu", num_pages=24) == 2 + 2 + 1 + 0 + 1

    def test_interp_update_compressed_real_geometry():
        sc = SparseConfig()  # kernel 32/16, C2 128/64, block 64: C1 4 per page, C2 1 per page
        seqs = [(0, 200), (127, 1), (191, 1), (130, 70)]
        check_update_compressed(seqs, sc, 2, 8, torch.float32, "cpu", num_pages=16)

    @pytest.mark.parametrize("config", [dict(BLOCK_M=16, BLOCK_N=16), dict(BLOCK_M=32, BLOCK_N=32),
                                        dict(BLOCK_M=16, BLOCK_N=8)])
    def test_interp_dense_prefill(config):
        # tiles of one page, two pages and half a page
        check_dense_prefill(TINY_SEQS, 8, 2, 16, 16, torch.float32, "cpu", num_pages=40, config=config)

    def test_interp_dense_prefill_matches_torch_backend():
        cfg = tiny_cfg()
        batch, kv, q, out = check_dense_prefill([(0, 20), (13, 9)], 8, 2, 16, 16, torch.float32, "cpu",
                                                num_pages=12, config=dict(BLOCK_M=16, BLOCK_N=16))
        kv.k[0, POISON] = 0.0  # the torch twin only gathers valid keys; keep it NaN-free anyway
        kv.v[0, POISON] = 0.0
        want = TorchBackend().sparse_attention(q, kv, None, 0, batch, cfg)
        assert rel_err(out, want) < 1e-5

    @pytest.mark.parametrize("num_splits", [1, 3, 8])
    def test_interp_paged_decode_dense(num_splits):
        check_paged_decode([1, 16, 17, 50, 95, 33], 8, 2, 16, 16, torch.float32, "cpu", num_pages=40,
                           num_splits=num_splits)

    @pytest.mark.parametrize("num_splits", [1, 4, 9])  # 9: more splits than listed pages (empty splits)
    def test_interp_paged_decode_sparse(num_splits):
        check_paged_decode([1, 16, 40, 95, 150], 8, 2, 16, 16, torch.float32, "cpu", num_pages=40,
                           num_splits=num_splits, sparse_keep=4, max_sel=6)

    @pytest.mark.parametrize("num_splits", [1, 2])
    def test_interp_paged_decode_padding_rows(num_splits):
        """Padded rows of a captured batch (block_count 0, seq_len 0) give zeros and disturb nothing."""
        from salaserve.kernels import attention as A

        kv, _ = make_pools(12, 16, 2, 16, torch.float32, "cpu", 0)
        batch = make_batch([(20, 1), (40, 1)], 16, 12, "cpu", 0)
        q = torch.randn(3, 8, 16)
        table, count = A.dense_block_table(batch.page_table, batch.seq_lens, 2, 16)
        table = torch.cat([table, torch.zeros_like(table[:1])])
        count = torch.cat([count, torch.zeros_like(count[:1])])
        seq_lens = torch.cat([batch.seq_lens, torch.zeros_like(batch.seq_lens[:1])])
        out = A.paged_decode_attention(q, kv, 1, table, count, seq_lens, 0.25, num_splits=num_splits)
        assert torch.equal(out[2], torch.zeros_like(out[2]))
        mask = torch.ones(2, 2, batch.page_table.shape[1], dtype=torch.bool)
        mask[0, :, 2:] = False
        ref = ref_decode(q[:2], kv, 1, batch.page_table, batch.seq_lens_host, mask, 0.25)
        assert rel_err(out[:2], ref) < 1e-5

    def test_interp_dense_block_table():
        from salaserve.kernels.attention import dense_block_table

        batch = make_batch([(0, 37), (15, 1), (0, 16), (63, 2)], 16, 20, "cpu", 0)
        table, count = dense_block_table(batch.page_table, batch.seq_lens, 2, 16)
        assert table.shape == (4, 2, batch.page_table.shape[1]) and table.dtype == torch.int32
        assert torch.equal(table[:, 1], batch.page_table) and torch.equal(table[:, 0], batch.page_table)
        assert count.tolist() == [[3, 3], [1, 1], [1, 1], [5, 5]]

else:

    def _compile_sm90(fn, ptr_types, constexprs, **opts):
        """Ahead-of-time compile for sm_90 (no GPU needed), with the 16-divisibility the JIT would
        infer for pointers and strides at the real shapes. Returns (kernel, cuobjdump -res-usage)."""
        import tempfile

        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        from kernel_checks import constexpr_defaults

        constexprs = {**constexpr_defaults(fn), **constexprs}  # as a launch that does not pass them
        no_div = {"stride_pt", "num_tiles", "n_progs", "stride_btb", "stride_bth", "stride_bcb", "stride_bch",
                  "stride_lb", "stride_lh", "scale_log2", "stride_gb"}
        sig, attrs = {}, {}
        for i, name in enumerate(fn.arg_names):
            if name in constexprs:
                sig[name] = "constexpr"
                continue
            sig[name] = ptr_types.get(name, "fp32" if name == "scale_log2" else "i32")
            if name not in no_div:
                attrs[(i,)] = [["tt.divisibility", 16]]
        k = triton.compile(ASTSource(fn, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32), options=opts)
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
        return k, res

    def test_attention_kernels_compile_for_sm90():
        """The interpreter accepts code the GPU compiler rejects: compile every kernel for the H200
        at the real shapes and default configs. The prefill must use wgmma with pipelined
        (cp.async) K/V loads; nothing may spill to local memory."""
        pytest.importorskip("triton.backends.nvidia")
        import triton.language as tl

        from salaserve.kernels.attention import compress, decode, kv_store, prefill

        bf = "*bf16"
        results = []
        # bf16 pages, and fp8 pages with their fp32 scales (dequantized in registers)
        for pool, fp8 in ((bf, False), ("*fp8e4nv", True)):
            kv_ptrs = dict(K_pool=pool, V_pool=pool, Q=bf, Out=bf, page_table="*i32", cu_seqlens_q="*i32",
                           seq_lens="*i32", K_scale="*fp32", V_scale="*fp32")
            fp8_kw = dict(KV_FP8=fp8, COMPUTE_DT=tl.bfloat16, HKV=2)
            cfg = prefill.PREFILL_CONFIG
            pre, res = _compile_sm90(
                prefill._dense_prefill_kernel, kv_ptrs,
                dict(GROUP=16, HEAD_DIM=128, BLOCK_SIZE=64, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                     DOT_PREC=None, **fp8_kw),
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
            assert "wgmma" in pre.asm["ptx"], "prefill tl.dot does not lower to wgmma"
            assert "cp.async" in pre.asm["ptx"], "prefill K/V loads are not pipelined"
            results.append(res)
            dec_ptrs = dict(kv_ptrs, block_table="*i32", block_count="*i32", O_part="*fp32", LSE_part="*fp32")
            for splits in (1, 16):
                _, res = _compile_sm90(
                    decode._decode_split_kernel, dec_ptrs,
                    dict(GROUP=16, BLOCK_G=16, HEAD_DIM=128, BLOCK_SIZE=64, NUM_SPLITS=splits, DOT_PREC=None,
                         **fp8_kw),
                    **decode.DECODE_CONFIG)
                results.append(res)
            if fp8:  # bf16 compute on fp8 pages (_f16_dots): the codes go to fp16 dot operands, one cvt per two, no bf16 repacking
                f16, res = _compile_sm90(
                    decode._decode_split_kernel, dec_ptrs,
                    dict(GROUP=16, BLOCK_G=16, HEAD_DIM=128, BLOCK_SIZE=64, NUM_SPLITS=16, DOT_PREC=None,
                         F16_DOTS=True, **fp8_kw),
                    **decode.DECODE_CONFIG)
                ptx = f16.asm["ptx"]
                assert "cvt.rn.f16x2.e4m3x2" in ptx and "cvt.bf16.f16" not in ptx, "fp8 codes not straight to fp16"
                results.append(res)
            results.append(_compile_sm90(
                compress._update_compressed_kernel, dict(K_pool=pool, C1_pool=bf, C2_pool=bf, page_table="*i32",
                                                  seq_lens="*i32", cache_lens="*i32", K_scale="*fp32"),
                dict(K1=32, S1=16, PER1=4, CH1=32, K2=128, S2=64, PER2=1, CH2=32, BLOCK_SIZE=64, HD=256,
                     BLOCK_HD=256, **fp8_kw, **(dict(BLOCK_HKV=2, BLOCK_D=128) if fp8 else {})),
                num_warps=4)[1])
            if fp8:
                results.append(_compile_sm90(
                    kv_store._store_kv_fp8_kernel, dict(K_new=bf, V_new=bf, K_pool=pool, V_pool=pool, slot_mapping="*i64",
                                                 K_scale="*fp32", V_scale="*fp32"),
                    dict(HKV=2, HEAD_DIM=128, BLOCK_H=2, BLOCK_SIZE=64, ROWS=16), num_warps=4)[1])
            else:
                results.append(_compile_sm90(kv_store._store_kv_kernel, dict(K_new=bf, V_new=bf, K_pool=pool, V_pool=pool,
                                                                       slot_mapping="*i64"),
                                             dict(HKV=2, HEAD_DIM=128, BLOCK_H=2), num_warps=4)[1])
        results.append(_compile_sm90(decode._decode_reduce_kernel, dict(O_part="*fp32", LSE_part="*fp32", Out=bf),
                                     dict(NUM_SPLITS=16, BLOCK_S=16, HEAD_DIM=128), num_warps=4)[1])
        for res in results:
            assert "STACK:0 " in res and "LOCAL:0 " in res, res
        # programmatic dependent launch (on by default): the decode kernels signal and wait
        dec, _ = _compile_sm90(decode._decode_split_kernel, dec_ptrs,
                               dict(GROUP=16, BLOCK_G=16, HEAD_DIM=128, BLOCK_SIZE=64, NUM_SPLITS=16, DOT_PREC=None,
                                    PDL=True, **fp8_kw), **decode.DECODE_CONFIG)
        red, _ = _compile_sm90(decode._decode_reduce_kernel, dict(O_part="*fp32", LSE_part="*fp32", Out=bf),
                               dict(NUM_SPLITS=16, BLOCK_S=16, HEAD_DIM=128, PDL=True), num_warps=4)
        for k in (dec, red):
            assert "griddepcontrol.wait" in k.asm["ptx"] and "griddepcontrol.launch_dependents" in k.asm["ptx"]

    def test_attention_kernels_under_interpreter():
        env = dict(os.environ, TRITON_INTERPRET="1")
        r = subprocess.run(
            [sys.executable, "-m", "pytest", os.path.abspath(__file__), "-q", "-p", "no:cacheprovider",
             "-k", "interp"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
        )
        assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]


# ---------------------------------------------------------------------------------------------
# GPU: real shapes, bf16 pools (relative error < 1e-2 against fp32 math on the same bf16 data)
# ---------------------------------------------------------------------------------------------

HQ, HKV, D, BS = 32, 2, 128, 64
BF16_TOL = 1e-2
gpu = pytest.mark.skipif(INTERP or not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
def test_gpu_store_kv():
    check_store_kv([(0, 8192), (100, 1), (4000, 900)], BS, HKV, D, torch.bfloat16, "cuda", num_pages=400)
    check_store_kv([(L - 1, 1) for L in range(1000, 1064)], BS, HKV, D, torch.bfloat16, "cuda", num_pages=1200)


@pytest.mark.gpu
@gpu
def test_gpu_update_compressed():
    sc = SparseConfig()
    seqs = [(0, 8192), (4096, 4096), (8191, 1), (8127, 1), (1000, 1), (3, 5000)]
    # one rounding of an fp32 mean to bf16 either side: a 1-ulp difference is allowed
    check_update_compressed(seqs, sc, HKV, D, torch.bfloat16, "cuda", num_pages=800, atol=1e-3, rtol=2 ** -7)
    check_update_compressed([(L - 1, 1) for L in range(8000, 8064)], sc, HKV, D, torch.bfloat16, "cuda",
                            num_pages=8200, atol=1e-3, rtol=2 ** -7)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("seqs", [
    [(0, 8192)],
    [(0, 1024)],
    [(1024, 8192)],  # a chunk over a cache: 9216 keys
    [(0, 3000), (512, 2048), (7000, 1191), (8100, 1), (4095, 7)],
])
def test_gpu_dense_prefill(seqs):
    check_dense_prefill(seqs, HQ, HKV, D, BS, torch.bfloat16, "cuda", num_pages=700, tol=BF16_TOL)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("batch_size", [1, 8, 64])
@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_gpu_paged_decode(batch_size, mode):
    from salaserve.kernels.attention import choose_num_splits

    g = torch.Generator().manual_seed(batch_size)
    lens = torch.randint(1024, 9217, (batch_size,), generator=g).tolist()
    num_pages = sum(-(-L // BS) for L in lens) + 8
    keep = None if mode == "dense" else 96
    max_sel = -(-max(lens) // BS) if mode == "dense" else 96
    # 128: one page per split and more splits than pages
    for splits in sorted({1, choose_num_splits(batch_size, HKV, max_sel), 128}):
        check_paged_decode(lens, HQ, HKV, D, BS, torch.bfloat16, "cuda", num_pages, splits,
                           sparse_keep=keep, max_sel=max_sel, tol=BF16_TOL)


def test_choose_num_splits_rule():
    """Two programs per SM, at least one page each."""
    from salaserve.kernels import attention as A

    assert A.choose_num_splits(1, 2, 96) == 96  # by pages
    assert A.choose_num_splits(1, 2, 128) == 128  # by pages (2 * 132 // 2 = 132 by SMs)
    assert A.choose_num_splits(8, 2, 128) == 16  # by SMs: 2 * 132 // 16
    assert A.choose_num_splits(256, 2, 128) == 1


@pytest.mark.gpu
@gpu
def test_gpu_paged_decode_cuda_graph():
    """Capture once, then change seq_lens / tables in place: the replay must follow."""
    from salaserve.kernels import attention as A

    B, layer = 8, 1
    lens = [1500 + 300 * i for i in range(B)]
    num_pages = sum(-(-(L + 200) // BS) for L in lens) + 8
    kv, _ = make_pools(num_pages, BS, HKV, D, torch.bfloat16, "cuda", 0)
    batch = make_batch([(L + 199, 1) for L in lens], BS, num_pages, "cuda", 0)  # pages for L+200
    q = torch.randn(B, HQ, D, device="cuda", dtype=torch.bfloat16)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    table, count = A.dense_block_table(batch.page_table, seq_lens, HKV, BS)
    splits = A.choose_num_splits(B, HKV, batch.page_table.shape[1])
    A.paged_decode_attention(q, kv, layer, table, count, seq_lens, D ** -0.5, num_splits=splits)  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        table, count = A.dense_block_table(batch.page_table, seq_lens, HKV, BS)
        out = A.paged_decode_attention(q, kv, layer, table, count, seq_lens, D ** -0.5, num_splits=splits)
    for step in (0, 1, 150):
        seq_lens.copy_(torch.tensor([L + step for L in lens], dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        nb = batch.page_table.shape[1]
        mask = (torch.arange(nb, device="cuda")[None, :] < count[:, :1])[:, None, :].expand(-1, HKV, -1)
        ref = ref_decode(q, kv, layer, batch.page_table, [L + step for L in lens], mask, D ** -0.5)
        for i in range(B):
            assert rel_err(out[i], ref[i]) < BF16_TOL
