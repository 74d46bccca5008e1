"""Triton kernels of salaserve.kernels.lightning / .fused against their torch twins, on CPU.

Run under the Triton interpreter, which must be switched on before triton is first imported:
tests/test_kernels_lightning.py runs this file in a subprocess with TRITON_INTERPRET=1 (the file
name keeps it out of normal collection). By hand:

    TRITON_INTERPRET=1 python -m pytest tests/lightning_interp_cases.py

Small shapes; fp32 cases are compared at ~1e-5, bf16 cases (the roundings to the model dtype, done
by exact integer arithmetic in the kernels) to within one bf16 ulp on a small fraction of elements.
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 (run through test_kernels_lightning.py)", allow_module_level=True)

from kernel_checks import assert_within_ulps, decode_batch, fused_qkvz, max_err, rel_err  # noqa: E402

from salaserve.cache.state import StatePool  # noqa: E402
from salaserve.config import alibi_slopes  # noqa: E402
from salaserve.kernels import fused, lightning  # noqa: E402
from salaserve.kernels.torch_ops import TorchBackend  # noqa: E402
from salaserve.model import reference as spec  # noqa: E402

EPS, THETA = 1e-6, 10000.0
H, D = 4, 16
TB = TorchBackend()


def _log_decay(heads=H):
    return -torch.tensor(alibi_slopes(heads), dtype=torch.float32)


def _norm_weight(n, dtype, gen):
    return (1.0 + 0.3 * torch.randn(n, generator=gen)).to(dtype)


def test_inv_freq_matches_reference():
    pos = torch.tensor([0, 1, 7, 100000, 524287])
    inv = lightning.rope_inv_freq(D, THETA, "cpu")
    cos, sin = spec.rope_cos_sin(pos, D, THETA)
    ang = torch.outer(pos.float(), inv)
    assert torch.equal(ang.cos(), cos[:, : D // 2]) and torch.equal(ang.sin(), sin[:, D // 2:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_step_matches_torch(dtype):
    """Three decode steps over two layers; slots scattered in a bigger pool; positions up to 5e5."""
    gen = torch.Generator().manual_seed(0)
    B, num_slots, n_layers = 3, 6, 3
    scale = D ** -0.5
    log_decay = _log_decay()
    qw, kw = _norm_weight(D, dtype, gen), _norm_weight(D, dtype, gen)
    ours = StatePool(num_slots, n_layers, H, D, torch.float32, "cpu")
    ours.state.copy_(0.3 * torch.randn(ours.state.shape, generator=gen))
    ref = StatePool(num_slots, n_layers, H, D, torch.float32, "cpu")
    ref.state.copy_(ours.state)
    initial = ours.state.clone()
    slots = [4, 0, 2]
    steps = [([0, 100000, 524300], 1, 8), ([1, 100001, 524301], 2, 16), ([2, 100002, 524302], 1, None)]
    for positions, layer, block_v in steps:
        batch = decode_batch(positions, slots)
        q, k, v, _ = fused_qkvz(B, H, D, dtype, gen=gen)
        o = lightning.lightning_decode_step(q, k, v, qw, kw, batch.positions, ours.state, batch.state_slots,
                                            layer, log_decay, scale, EPS, THETA, block_v=block_v)
        qr, kr = TB.lightning_qk_norm_rope(q, k, qw, kw, batch.positions, EPS, THETA)
        o_ref = TB.gla(qr, kr, v, batch, ref, layer, log_decay, scale)
        assert o.dtype == torch.float32 and o.shape == (B, H, D)
        # fp32: same math up to summation order; bf16: q/k roundings may differ by an ulp rarely
        tol = 1e-5 if dtype == torch.float32 else 1e-3
        assert rel_err(o, o_ref) < tol and max_err(o, o_ref) < 5 * tol
        assert rel_err(ours.state, ref.state) < tol
    untouched = [s for s in range(num_slots) if s not in slots]
    assert torch.equal(ours.state[untouched], initial[untouched])  # other slots: bit-identical
    assert torch.equal(ours.state[:, 0], initial[:, 0])  # layer 0 never used


@pytest.mark.parametrize("block_v", [8, 16])
def test_decode_step_program_order_keeps_the_bits(block_v):
    """The slot-major program order only moves work around: same o, same state."""
    gen = torch.Generator().manual_seed(7)
    B, num_slots = 3, 5
    qw, kw = _norm_weight(D, torch.bfloat16, gen), _norm_weight(D, torch.bfloat16, gen)
    initial = 0.3 * torch.randn(num_slots, 2, H, D, D, generator=gen)
    q, k, v, _ = fused_qkvz(B, H, D, torch.bfloat16, gen=gen)
    batch = decode_batch([7, 300, 70000], [3, 0, 4])
    results = []
    for slot_major in (False, True):
        pool = StatePool(num_slots, 2, H, D, torch.float32, "cpu")
        pool.state.copy_(initial)
        o = lightning.lightning_decode_step(q, k, v, qw, kw, batch.positions, pool.state, batch.state_slots, 1,
                                            _log_decay(), D ** -0.5, EPS, THETA, block_v=block_v,
                                            slot_major=slot_major)
        results.append((o, pool.state.clone()))
    assert not torch.equal(results[0][1], initial)  # the step did write the state
    for o, state in results[1:]:
        assert torch.equal(o, results[0][0]) and torch.equal(state, results[0][1])


def test_decode_step_fresh_state_is_exact_recurrence():
    """From S = 0, one step gives o = scale * (q.k) v exactly as the reference recurrence."""
    gen = torch.Generator().manual_seed(1)
    B = 2
    pool = StatePool(2, 1, H, D, torch.float32, "cpu")
    q, k, v, _ = fused_qkvz(B, H, D, torch.float32, gen=gen)
    w = torch.ones(D)
    pos = torch.tensor([5, 9])
    slots = torch.tensor([1, 0])
    o = lightning.lightning_decode_step(q, k, v, w, w, pos, pool.state, slots, 0, _log_decay(), 0.25, EPS, THETA)
    qr, kr = TB.lightning_qk_norm_rope(q, k, w, w, pos, EPS, THETA)
    for b in range(B):
        o_ref, s_ref = spec.gla_recurrent(qr[b:b + 1], kr[b:b + 1], v[b:b + 1].float(), _log_decay(),
                                          torch.zeros(H, D, D), 0.25)
        torch.testing.assert_close(o[b], o_ref[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(pool.state[int(slots[b]), 0], s_ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_rope_matches_torch(dtype):
    gen = torch.Generator().manual_seed(2)
    N = 5
    q, k, _, _ = fused_qkvz(N, H, D, dtype, gen=gen)
    qw, kw = _norm_weight(D, dtype, gen), _norm_weight(D, dtype, gen)
    pos = torch.tensor([0, 3, 4095, 100000, 600000])
    qo, ko = lightning.qk_norm_rope(q, k, qw, kw, pos, EPS, THETA)
    qr, kr = TB.lightning_qk_norm_rope(q, k, qw, kw, pos, EPS, THETA)
    assert qo.dtype == qr.dtype and ko.dtype == kr.dtype
    if dtype == torch.float32:
        torch.testing.assert_close(qo, qr, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ko, kr, rtol=1e-5, atol=1e-5)
    else:
        assert_within_ulps(qo, qr, max_ulps=1, max_frac=0.02)
        assert_within_ulps(ko, kr, max_ulps=1, max_frac=0.02)
    q32, _ = lightning.qk_norm_rope(q, k, qw, kw, pos, EPS, THETA, out_dtype=torch.float32)
    assert q32.dtype == torch.float32 and torch.equal(q32, qo.float())
    # the backend writes them in fla's input dtype (bf16 by default, fp32 for HF parity): the same
    # values as the model-dtype kernel output, cast, so gla_prefill has no cast pass
    assert lightning.TritonLightningOps.gla_input_dtype == torch.bfloat16
    for gla_dtype in (torch.float32, torch.bfloat16):
        ops = lightning.TritonLightningOps()
        ops.gla_input_dtype = gla_dtype
        qb, kb = ops.lightning_qk_norm_rope(q, k, qw, kw, pos, EPS, THETA)
        assert qb.dtype == kb.dtype == gla_dtype
        if gla_dtype == torch.float32 or dtype == torch.bfloat16:  # a widening cast or none
            assert torch.equal(qb, qo.to(gla_dtype)) and torch.equal(kb, ko.to(gla_dtype))
        else:  # fp32 model narrowed to bf16 (the interpreter's cast truncates, torch's rounds)
            assert_within_ulps(qb, qo.to(gla_dtype), max_ulps=1, max_frac=1.0)
            assert_within_ulps(kb, ko.to(gla_dtype), max_ulps=1, max_frac=1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [4, 3])  # 3 x 16 = 48 columns: a masked (non power of two) row
def test_lightning_output_matches_torch(dtype, heads):
    gen = torch.Generator().manual_seed(3)
    N = 3
    o = torch.randn(N, heads, D, generator=gen)
    _, _, _, z = fused_qkvz(N, heads, D, dtype, gen=gen)  # z: strided rows
    w = _norm_weight(heads * D, dtype, gen)
    out = lightning.lightning_output(o, w, z, EPS, dtype)
    ref = TB.lightning_output(o, w, z, EPS, dtype)
    assert out.dtype == ref.dtype and out.shape == ref.shape == (N, heads * D)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    else:
        assert_within_ulps(out, ref, max_ulps=1, max_frac=0.02)
    # [N, H*d] input gives the same
    assert torch.equal(lightning.lightning_output(o.reshape(N, -1), w, z, EPS, dtype), out)


def _check(out, ref, dtype):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    else:
        assert_within_ulps(out, ref, max_ulps=1, max_frac=0.02)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", [64, 40])
def test_rms_norm_and_add_rms_norm(dtype, cols):
    gen = torch.Generator().manual_seed(4)
    N = 4
    big = torch.randn(N, 3 * cols, generator=gen).to(dtype)
    x = big[:, cols: 2 * cols]  # strided rows
    upd = (4 * torch.randn(N, cols, generator=gen)).to(dtype)
    w = _norm_weight(cols, dtype, gen)
    _check(fused.rms_norm(x, w, EPS), TB.rms_norm(x, w, EPS), dtype)
    _check(fused.rms_norm(x.reshape(2, 2, cols), w, EPS), TB.rms_norm(x.reshape(2, 2, cols), w, EPS), dtype)
    r = 0.24748737341529164
    h, n = fused.add_rms_norm(x, upd, r, w, EPS)
    h_ref, n_ref = TB.add_rms_norm(x, upd, r, w, EPS)
    assert torch.equal(h, h_ref)  # two roundings, no reduction: bit-exact
    _check(n, n_ref, dtype)
    assert torch.equal(x, big[:, cols: 2 * cols])  # inputs untouched
    # fp8_out (a w8a8 linear next): the per-token quantization of that normed output, bit for bit
    from salaserve.kernels.quant_gemm import quantize_rows_fp8

    h8, (q, s) = fused.add_rms_norm(x, upd, r, w, EPS, fp8_out=True)
    q_ref, s_ref = quantize_rows_fp8(n)
    assert torch.equal(h8, h) and torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def test_norm_and_silu_mul_write_the_dp2a_gemvs_rounded_x():
    """int16_out (an int4 linear on the dp2a GEMV next): add_rms_norm's normed rows and silu_mul's
    activation come out as quant_gemm.round_x_int16 of their bf16 values, bit for bit (codes and
    tile scales; one tile with an outlier, silu_mul over several column blocks); widths that are
    not whole tiles are refused."""
    from salaserve.kernels.quant_gemm import round_x_int16

    gen = torch.Generator().manual_seed(6)
    for n_rows, cols in ((1, 384), (2, 256)):
        x = torch.randn(n_rows, cols, generator=gen).to(torch.bfloat16)
        upd = (4 * torch.randn(n_rows, cols, generator=gen)).to(torch.bfloat16)
        upd[:, 130] = 300.0
        w = _norm_weight(cols, torch.bfloat16, gen)
        h, n = fused.add_rms_norm(x, upd, 0.25, w, EPS)
        h16, (xq, xs) = fused.add_rms_norm(x, upd, 0.25, w, EPS, int16_out=True)
        q_ref, s_ref = round_x_int16(n)
        assert torch.equal(h16, h) and torch.equal(xq, q_ref) and torch.equal(xs, s_ref)
        gate_up = (3 * torch.randn(n_rows, 2 * cols, generator=gen)).to(torch.bfloat16)
        xq, xs = fused.silu_mul(gate_up, block=128, int16_out=True)
        q_ref, s_ref = round_x_int16(fused.silu_mul(gate_up, block=128))
        assert torch.equal(xq, q_ref) and torch.equal(xs, s_ref)
    with pytest.raises(ValueError, match="multiple of 128"):
        fused.add_rms_norm(x[:, :200], upd[:, :200], 0.25, w[:200], EPS, int16_out=True)
    with pytest.raises(ValueError, match="multiple of 128"):
        fused.silu_mul(gate_up[:, :400], int16_out=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_and_sigmoid_mul(dtype):
    gen = torch.Generator().manual_seed(5)
    N, F = 3, 40
    gate_up = (3 * torch.randn(N, 2 * F, generator=gen)).to(dtype)
    _check(fused.silu_mul(gate_up, block=16), TB.silu_mul(gate_up), dtype)
    big = (3 * torch.randn(N, 3 * F, generator=gen)).to(dtype)
    x, g = big[:, :F], big[:, 2 * F:]
    _check(fused.sigmoid_mul(x, g, block=16), x * torch.sigmoid(g), dtype)


# ---------------------------------------------------------------------------------------------
# speculative verify: lightning_verify / lightning_commit
# ---------------------------------------------------------------------------------------------


def _verify_setup(dtype, gen, lens, num_slots=7, n_layers=2):
    from kernel_checks import prefill_batch

    pool = StatePool(num_slots, n_layers, H, D, torch.float32, "cpu")
    pool.state.copy_(0.3 * torch.randn(pool.state.shape, generator=gen))
    slots = torch.randperm(num_slots, generator=gen)[: len(lens)].tolist()
    caches = torch.randint(0, 600000, (len(lens),), generator=gen).tolist()
    batch = prefill_batch(lens, caches, slots)
    N = sum(lens)
    q, k, v, _ = fused_qkvz(N, H, D, dtype, gen=gen)
    qw, kw = _norm_weight(D, dtype, gen), _norm_weight(D, dtype, gen)
    return pool, batch, q, k, v, qw, kw


@pytest.mark.parametrize("impl", ["chunk", "loop"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_outputs_keep_state_and_commit_replays(dtype, impl):
    """Verify sequences: outputs of every token from the live state, state untouched, k/v kept;
    decode sequences: state written; skipped ones untouched. The commit of n tokens then equals n
    plain decode steps (same kernel arithmetic: bit-identical in fp32 on the interpreter)."""
    from salaserve.kernels.lightning_verify import DECODE, SKIP, VERIFY, lightning_commit, lightning_verify

    gen = torch.Generator().manual_seed(11)
    lens = [5, 1, 3, 4]
    modes = [VERIFY, DECODE, SKIP, VERIFY]
    pool, batch, q, k, v, qw, kw = _verify_setup(dtype, gen, lens)
    before = pool.state.clone()
    scale, layer, log_decay = D ** -0.5, 1, _log_decay()
    N = q.shape[0]
    kn_dt = torch.promote_types(dtype, kw.dtype)
    k_keep = torch.zeros(2, N, H, D, dtype=kn_dt)
    v_keep = torch.zeros(2, N, H, D, dtype=dtype)
    o = lightning_verify(q, k, v, qw, kw, batch.positions, batch.cu_seqlens_q,
                         torch.tensor(modes, dtype=torch.int32), pool.state, batch.state_slots, layer,
                         log_decay, scale, EPS, THETA, k_keep[layer], v_keep[layer], block_v=8, impl=impl)
    qr, kr = TB.lightning_qk_norm_rope(q, k, qw, kw, batch.positions, EPS, THETA)
    tol = 1e-5 if dtype == torch.float32 else 1e-3
    start = 0
    for i, (n, mode) in enumerate(zip(lens, modes)):
        sl = slice(start, start + n)
        slot = int(batch.state_slots[i])
        start += n
        if mode == SKIP:
            assert torch.equal(pool.state[slot], before[slot])
            continue
        o_ref, s_ref = spec.gla_recurrent(qr[sl].float(), kr[sl].float(), v[sl].float(), log_decay,
                                          before[slot, layer], scale)
        assert rel_err(o[sl], o_ref) < tol, (i, rel_err(o[sl], o_ref))
        if mode == VERIFY:
            assert torch.equal(pool.state[slot], before[slot])
            # the kernel's normed k: exact in bf16 (integer roundings), fp32 up to summation order
            assert rel_err(k_keep[layer, sl], kr[sl]) < (1e-6 if dtype == torch.float32 else 1e-3)
            assert torch.equal(v_keep[layer, sl], v[sl])
        else:
            assert rel_err(pool.state[slot, layer], s_ref) < tol
    # commit: sequence 0 keeps 3 of its 5 tokens, sequence 3 all 4; layer 0 replays the same k/v
    k_keep[0], v_keep[0] = k_keep[layer], v_keep[layer]
    counts = torch.tensor([3, 0, 0, 4], dtype=torch.int32)
    mid = pool.state.clone()
    lightning_commit(pool.state, batch.state_slots, batch.cu_seqlens_q, counts, k_keep, v_keep, log_decay, block_v=8)
    for i, n in enumerate(counts.tolist()):
        slot = int(batch.state_slots[i])
        if n == 0:
            assert torch.equal(pool.state[slot], mid[slot])
            continue
        rows = [int(batch.cu_seqlens_q[i]) + t for t in range(n)]
        for lay in (0, 1):
            ref = StatePool(1, 1, H, D, torch.float32, "cpu")
            ref.state[0, 0] = before[slot, lay]
            for r in rows:  # n plain decode steps with the decode kernel
                lightning.lightning_decode_step(q[r:r + 1], k[r:r + 1], v[r:r + 1], qw, kw, batch.positions[r:r + 1],
                                                ref.state, torch.tensor([0]), 0, log_decay, scale, EPS, THETA,
                                                block_v=8)
            if dtype == torch.float32:
                assert torch.equal(pool.state[slot, lay], ref.state[0, 0]), (i, lay)
            else:
                assert rel_err(pool.state[slot, lay], ref.state[0, 0]) < tol


def test_verify_rejects_bad_keep_buffers():
    from salaserve.kernels.lightning_verify import lightning_verify

    gen = torch.Generator().manual_seed(12)
    pool, batch, q, k, v, qw, kw = _verify_setup(torch.bfloat16, gen, [2])
    bad = torch.zeros(q.shape, dtype=torch.float16)
    with pytest.raises(TypeError, match="k_keep"):
        lightning_verify(q, k, v, qw, kw, batch.positions, batch.cu_seqlens_q, torch.ones(1, dtype=torch.int32),
                         pool.state, batch.state_slots, 0, _log_decay(), 0.25, EPS, THETA, bad, bad)


def test_verify_chunk_form_bounds_tokens():
    """More than 16 tokens per sequence: the default falls back to the loop form (same outputs);
    forcing the chunk form is refused rather than silently truncated."""
    from salaserve.kernels.lightning_verify import VERIFY, lightning_verify

    gen = torch.Generator().manual_seed(13)
    pool, batch, q, k, v, qw, kw = _verify_setup(torch.float32, gen, [18])
    keep = [torch.zeros(q.shape) for _ in range(4)]
    modes = torch.full((1,), VERIFY, dtype=torch.int32)
    args = (q, k, v, qw, kw, batch.positions, batch.cu_seqlens_q, modes, pool.state, batch.state_slots, 0,
            _log_decay(), 0.25, EPS, THETA)
    auto = lightning_verify(*args, keep[0], keep[1])
    loop = lightning_verify(*args, keep[2], keep[3], impl="loop")
    assert torch.equal(auto, loop)
    with pytest.raises(ValueError, match="at most 16"):
        lightning_verify(*args, keep[0], keep[1], impl="chunk")


def test_verify_chunk_form_takes_draft_trees():
    """The chunk form with a tree mask (lightning_verify's `tree`): every row of a draft tree equals
    the recurrence along its root-to-row path from the live state (kernels/tree_verify.tree_gla,
    the torch backend's ground truth), beside a chain verify and a plain decode in the same launch
    whose results are those of the maskless form; the kept k/v replayed along the accepted path
    (gathered to the front) equal the torch commit of those rows. fp32 at 1e-5."""
    from salaserve.kernels.lightning_verify import (DECODE, VERIFY, lightning_commit, lightning_verify,
                                                    tree_rows_meta)
    from salaserve.kernels.tree_verify import tree_gla

    gen = torch.Generator().manual_seed(14)
    parents = (-1, -1, -1, 0, 0, 1, 3, 3, 5, 6)  # 11 rows, depth 4
    lens, modes = [11, 4, 1], [VERIFY, VERIFY, DECODE]
    trees = [parents, None, None]
    pool, batch, q, k, v, qw, kw = _verify_setup(torch.float32, gen, lens)
    depths = [0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4]  # the tree's rows sit at cache_len + depth
    positions = batch.positions.clone()
    positions[:11] = positions[0] + torch.tensor(depths)
    before = pool.state.clone()
    scale, layer, log_decay = D ** -0.5, 1, _log_decay()
    N = q.shape[0]
    keep = [torch.zeros(2, N, H, D) for _ in range(2)]
    mode_t = torch.tensor(modes, dtype=torch.int32)
    args = (q, k, v, qw, kw, positions, batch.cu_seqlens_q)
    o = lightning_verify(*args, mode_t, pool.state, batch.state_slots, layer, log_decay, scale, EPS, THETA,
                         keep[0][layer], keep[1][layer], block_v=8, impl="chunk",
                         tree=tree_rows_meta(lens, trees, "cpu"))
    decoded = pool.state.clone()
    qr, kr = TB.lightning_qk_norm_rope(q, k, qw, kw, positions, EPS, THETA)
    slot0 = int(batch.state_slots[0])
    o_ref = tree_gla(qr[:11].float(), kr[:11].float(), v[:11].float(), parents, log_decay, before[slot0, layer], scale)
    assert max_err(o[:11], o_ref) < 1e-5
    # the chain and the decode: what the maskless chunk form gives (state restored for the decode)
    pool.state.copy_(before)
    plain_keep = [torch.zeros(N, H, D) for _ in range(2)]
    o_plain = lightning_verify(*args, mode_t, pool.state, batch.state_slots, layer, log_decay, scale, EPS, THETA,
                               plain_keep[0], plain_keep[1], block_v=8, impl="chunk")
    assert torch.equal(o[11:], o_plain[11:]) and torch.equal(decoded, pool.state)
    # commit the path root -> 1 -> 5 -> 8 (rows 0, 2, 6, 9) of the tree, 2 tokens of the chain
    rows = [0, 2, 6, 9]
    pool.state.copy_(before)
    for t in keep:
        t[0] = t[layer]
        t[:, :len(rows)] = t[:, rows].clone()  # the accepted path first, in order
    counts = torch.tensor([len(rows), 2, 0], dtype=torch.int32)
    lightning_commit(pool.state, batch.state_slots, batch.cu_seqlens_q, counts, keep[0], keep[1], log_decay, block_v=8)
    ref = StatePool(1, 1, H, D, torch.float32, "cpu")
    for lay in (0, 1):
        ref.state[0, 0] = before[slot0, lay]
        TB.gla_commit(ref, 0, 0, kr[rows].float(), v[rows].float(), log_decay, len(rows))
        assert max_err(pool.state[slot0, lay], ref.state[0, 0]) < 1e-5
