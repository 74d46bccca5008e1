"""Lightning-layer and fused elementwise Triton kernels (salaserve.kernels.lightning / .fused).

CPU (default run):
- every Triton kernel against its torch twin under the Triton interpreter, in a subprocess
  (TRITON_INTERPRET must be set before triton is imported; other test files import it normally):
  the cases live in tests/lightning_interp_cases.py;
- gla_prefill's varlen packing and state-slot gather/scatter, with fla-core replaced by fakes built
  on reference.gla_chunked / gla_recurrent (fla needs a GPU).
GPU (`pytest -m gpu`): the kernels at the real shapes (32 heads x 128, bf16 projections, fp32
state) against the torch twins on the same GPU, CUDA-graph capture, and fla-core itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernel_checks import assert_rope_within_ulps, assert_within_ulps, decode_batch, fused_qkvz, max_err, prefill_batch, rel_err

from salaserve.cache.state import StatePool
from salaserve.config import alibi_slopes
from salaserve.kernels.torch_ops import TorchBackend
from salaserve.model import reference as spec

TESTS = Path(__file__).resolve().parent
EPS, THETA = 1e-6, 10000.0
TB = TorchBackend()


def test_triton_kernels_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS.parent), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider", str(TESTS / "lightning_interp_cases.py")],
        cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"interpreter cases failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]


def _compile_cases():
    import triton.language as tl

    from salaserve.kernels import fused, lightning as L

    bf, i64 = "*bf16", "*i64"
    dec_ptrs = dict(q_ptr=bf, k_ptr=bf, v_ptr=bf, qw_ptr=bf, kw_ptr=bf, pos_ptr=i64, slot_ptr=i64)
    dec = dict(HALF=64, X_DT=tl.bfloat16, QN_DT=tl.bfloat16, KN_DT=tl.bfloat16)
    b16 = tl.bfloat16
    return {
        "decode_bv16": (L._decode_step_kernel, dec_ptrs, dict(dec, BLOCK_V=16), L._pick_warps(16)),
        "decode_bv32": (L._decode_step_kernel, dec_ptrs, dict(dec, BLOCK_V=32), L._pick_warps(32)),
        "decode_bv64": (L._decode_step_kernel, dec_ptrs, dict(dec, BLOCK_V=64), L._pick_warps(64)),
        "decode_bv32_batch_major": (L._decode_step_kernel, dec_ptrs, dict(dec, BLOCK_V=32, SLOT_MAJOR=False), 2),
        "decode_fp32": (L._decode_step_kernel, dict(pos_ptr=i64, slot_ptr=i64),
                        dict(HALF=64, X_DT=tl.float32, QN_DT=tl.float32, KN_DT=tl.float32, BLOCK_V=32), 4),
        "qk_norm_rope": (L._qk_norm_rope_kernel, dict(q_ptr=bf, k_ptr=bf, qw_ptr=bf, kw_ptr=bf, pos_ptr=i64,
                                                      qo_ptr=bf, ko_ptr=bf), dec, 1),
        "output": (L._output_kernel, dict(w_ptr=bf, z_ptr=bf, out_ptr=bf),
                   dict(BLOCK=4096, O_DT=b16, NORM_DT=b16, Z_DT=b16, OUT_DT=b16), 8),
        "rms_norm": (fused._rms_norm_kernel, dict(x_ptr=bf, w_ptr=bf, out_ptr=bf),
                     dict(BLOCK=4096, X_DT=b16, OUT_DT=b16), 8),
        "add_rms_norm": (fused._add_rms_norm_kernel, dict(r_ptr=bf, u_ptr=bf, w_ptr=bf, h_ptr=bf, out_ptr=bf),
                         dict(BLOCK=4096, U_DT=b16, H_DT=b16, OUT_DT=b16), 8),
        "add_rms_norm_fp8": (fused._add_rms_norm_kernel, dict(r_ptr=bf, u_ptr=bf, w_ptr=bf, h_ptr=bf, out_ptr="*fp8e4nv"),
                             dict(BLOCK=4096, U_DT=b16, H_DT=b16, OUT_DT=b16, FP8_OUT=True, INTERPRET=False), 8),
        "silu_mul": (fused._silu_mul_kernel, dict(x_ptr=bf, out_ptr=bf), dict(BLOCK=1024, DT=b16), 4),
        "sigmoid_mul": (fused._sigmoid_mul_kernel, dict(x_ptr=bf, g_ptr=bf, out_ptr=bf),
                        dict(BLOCK=1024, G_DT=b16, OUT_DT=b16), 4),
    }


@pytest.mark.parametrize("name", ["decode_bv16", "decode_bv32", "decode_bv64", "decode_bv32_batch_major", "decode_fp32", "qk_norm_rope", "output",
                                  "rms_norm", "add_rms_norm", "add_rms_norm_fp8", "silu_mul", "sigmoid_mul"])
def test_kernel_compiles_for_sm90_without_spills(name):
    """Ahead-of-time compile for sm_90 at the real shapes (no GPU needed): the interpreter does not
    type-check or lower the kernels, this does; spilling registers would cost bandwidth."""
    from kernel_checks import compile_sm90_without_spills

    fn, ptrs, constexprs, warps = _compile_cases()[name]
    compile_sm90_without_spills(fn, ptrs, constexprs, warps)


@pytest.mark.parametrize("name", ["decode_bv64", "output"])
def test_decode_kernels_compile_with_pdl(name):
    """The Lightning decode kernels take part in programmatic dependent launch (on by default):
    with PDL their sm_90 code signals the next launch and waits on the previous grid."""
    from kernel_checks import compile_sm90_without_spills

    fn, ptrs, constexprs, warps = _compile_cases()[name]
    ptx = compile_sm90_without_spills(fn, ptrs, dict(constexprs, PDL=True), warps).asm["ptx"]
    assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx


@pytest.mark.parametrize("name", ["decode_bv16", "decode_bv64", "output", "rms_norm", "add_rms_norm", "add_rms_norm_fp8"])
def test_pdl_kernels_load_what_no_kernel_writes_before_the_wait(name):
    """With PDL, what no kernel of the forward writes is loaded before griddepcontrol.wait, so its DRAM
    round trip overlaps the previous kernel: the norms' weight; the Lightning step's slot number, state
    tile and decay. Nothing else is: the loads before the wait are exactly those (the weight's
    elements per thread; one 8-byte slot, the tile's 16-byte vectors per thread, one 4-byte decay), and
    the activations are loaded after it."""
    from kernel_checks import compile_sm90_without_spills

    fn, ptrs, constexprs, warps = _compile_cases()[name]
    ptx = compile_sm90_without_spills(fn, ptrs, dict(constexprs, PDL=True), warps).asm["ptx"]
    body = ptx[ptx.index("griddepcontrol.launch_dependents"):]
    wait = body.index("griddepcontrol.wait")
    before = [ln.split("ld.global")[1].split()[0] for ln in body[:wait].splitlines() if "ld.global" in ln]
    threads = 32 * warps
    if name.startswith("decode"):
        tile_vectors = 2 * constexprs["HALF"] * constexprs["BLOCK_V"] * 4 // 16 // threads
        assert sorted(before) == sorted([".b64"] + [".v4.b32"] * tile_vectors + [".b32"]), before
    else:
        assert len(before) == constexprs["BLOCK"] // threads, before  # one bf16 weight element per load
    assert "ld.global" in body[wait:]  # the activations, after the wait


# ---------------------------------------------------------------------------------------------
# gla_prefill glue on CPU, with fla replaced by reference-based fakes
# ---------------------------------------------------------------------------------------------


class FakeFla:
    """chunk_simple_gla / fused_recurrent_simple_gla with fla 0.6.0's varlen calling convention,
    computed with the reference forms; checks the arguments the wrapper must pass."""

    def __init__(self):
        self.calls = []

    def _run(self, form, q, k, v, g, g_gamma, scale, initial_state, output_final_state, cu_seqlens):
        assert q.dim() == 4 and q.shape[0] == 1, "varlen (or one sequence) wants [1, T, H, d]"
        if cu_seqlens is None:  # fixed length, batch 1: the whole T is one sequence
            cu_seqlens = torch.tensor([0, q.shape[1]], dtype=torch.int64)
        assert q.shape == k.shape == v.shape and q.dtype == k.dtype == v.dtype
        assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
        assert g is None and g_gamma.dtype == torch.float32 and g_gamma.shape == (q.shape[2],)
        assert cu_seqlens.dtype == torch.int64 and int(cu_seqlens[-1]) == q.shape[1]
        assert initial_state.shape == (len(cu_seqlens) - 1, q.shape[2], q.shape[3], v.shape[3])
        assert initial_state.dtype == torch.float32 and output_final_state
        cu = cu_seqlens.tolist()
        outs, finals = [], []
        for i in range(len(cu) - 1):
            sl = slice(cu[i], cu[i + 1])
            o, s = form(q[0, sl].float(), k[0, sl].float(), v[0, sl].float(), g_gamma, initial_state[i], scale)
            outs.append(o)
            finals.append(s)
        return torch.cat(outs)[None].to(q.dtype), torch.stack(finals)

    def chunk_simple_gla(self, q, k, v, g=None, g_gamma=None, scale=None, initial_state=None,
                         output_final_state=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None):
        assert not state_v_first
        if cu_seqlens is None:  # fixed length: no index tensors at all
            assert cu_seqlens_cpu is None
            self.calls.append("chunk-fixed")
        else:
            assert cu_seqlens_cpu is not None and cu_seqlens_cpu.device.type == "cpu"
            assert torch.equal(cu_seqlens_cpu, cu_seqlens.cpu())
            self.calls.append("chunk")
        return self._run(spec.gla_chunked, q, k, v, g, g_gamma, scale, initial_state, output_final_state,
                         cu_seqlens)

    def fused_recurrent_simple_gla(self, q, k, v, g=None, g_gamma=None, scale=None, initial_state=None,
                                   output_final_state=False, reverse=False, state_v_first=False,
                                   cu_seqlens=None):
        assert not reverse and not state_v_first
        self.calls.append("recurrent")
        return self._run(spec.gla_recurrent, q, k, v, g, g_gamma, scale, initial_state, output_final_state,
                         cu_seqlens)


@pytest.fixture
def fake_fla(monkeypatch):
    from salaserve.kernels import lightning

    fake = FakeFla()
    monkeypatch.setattr(lightning, "_load_fla", lambda: (fake.chunk_simple_gla, fake.fused_recurrent_simple_gla))
    return fake


def _pools(num_slots, n_layers, heads, d, gen):
    ours = StatePool(num_slots, n_layers, heads, d, torch.float32, "cpu")
    ours.state.copy_(0.3 * torch.randn(ours.state.shape, generator=gen))
    ref = StatePool(num_slots, n_layers, heads, d, torch.float32, "cpu")
    ref.state.copy_(ours.state)
    return ours, ref, ours.state.clone()


@pytest.mark.parametrize("lens,route", [([5, 70, 1, 130], "chunk"), ([3, 1, 40], "recurrent"),
                                        ([200], "chunk-fixed"), ([9], "recurrent")])
def test_gla_prefill_packing_and_slots(fake_fla, lens, route):
    from salaserve.kernels.lightning import gla_prefill

    gen = torch.Generator().manual_seed(0)
    H, d, n_layers, num_slots = 4, 16, 3, 7
    slots = [5, 2, 6, 0][: len(lens)]
    ours, ref, initial = _pools(num_slots, n_layers, H, d, gen)
    log_decay = -torch.tensor(alibi_slopes(H), dtype=torch.float32)
    batch = prefill_batch(lens, [0, 17, 4096, 3][: len(lens)], slots)
    N = sum(lens)
    q, k, v, _ = fused_qkvz(N, H, d, torch.float32, gen=gen)  # strided views, as from the projection
    for layer in (1, 2):
        o = gla_prefill(q, k, v, batch, ours, layer, log_decay, 0.25, impl="fla")
        o_ref = TB.gla(q, k, v, batch, ref, layer, log_decay, 0.25)
        assert o.dtype == torch.float32 and o.shape == (N, H, d)
        # the fakes and the twin use different forms (recurrent vs chunked): fp32 summation order
        torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.state, ref.state, rtol=1e-5, atol=1e-5)
    assert fake_fla.calls == [route, route]
    untouched = [s for s in range(num_slots) if s not in slots]
    assert torch.equal(ours.state[untouched], initial[untouched])
    assert torch.equal(ours.state[:, 0], initial[:, 0])


def test_gla_prefill_bf16_inputs_and_cpu_fallback(fake_fla):
    from salaserve.kernels.lightning import gla_prefill

    gen = torch.Generator().manual_seed(1)
    H, d = 4, 16
    lens, slots = [66, 2], [1, 0]
    ours, ref, _ = _pools(2, 1, H, d, gen)
    log_decay = -torch.tensor(alibi_slopes(H), dtype=torch.float32)
    batch = prefill_batch(lens, [0, 0], slots)
    q, k, v, _ = fused_qkvz(sum(lens), H, d, torch.float32, gen=gen)
    o = gla_prefill(q, k, v, batch, ours, 0, log_decay, 0.25, impl="fla", input_dtype=torch.bfloat16)
    qb, kb, vb = (x.bfloat16().float() for x in (q, k, v))
    o_ref = TB.gla(qb, kb, vb, batch, ref, 0, log_decay, 0.25)
    assert o.dtype == torch.bfloat16  # fla's output dtype, passed on (lightning_output rounds to bf16 first)
    # the fake returns o in the input dtype, as fla does: one bf16 rounding of the output
    torch.testing.assert_close(o.float(), o_ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(ours.state, ref.state, rtol=1e-5, atol=1e-6)
    # CPU tensors with impl="auto" take the torch twin itself
    ours2, ref2, _ = _pools(2, 1, H, d, torch.Generator().manual_seed(2))
    o2 = gla_prefill(q, k, v, batch, ours2, 0, log_decay, 0.25)
    assert torch.equal(o2, TB.gla(q, k, v, batch, ref2, 0, log_decay, 0.25))
    assert torch.equal(ours2.state, ref2.state)
    assert fake_fla.calls == ["chunk"]


# ---------------------------------------------------------------------------------------------
# GPU: real shapes against the torch twins on the same device
# ---------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
H_REAL, D_REAL = 32, 128


def _real_weights(dtype, gen, dev):
    qw = (1.0 + 0.2 * torch.randn(D_REAL, generator=gen)).to(dev, dtype)
    kw = (1.0 + 0.2 * torch.randn(D_REAL, generator=gen)).to(dev, dtype)
    log_decay = -torch.tensor(alibi_slopes(H_REAL), dtype=torch.float32, device=dev)
    return qw, kw, log_decay


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B", [1, 8, 64])
def test_gpu_decode_step(B, dtype):
    from salaserve.kernels.lightning import lightning_decode_step

    dev = "cuda"
    gen = torch.Generator().manual_seed(B)
    qw, kw, log_decay = _real_weights(dtype, gen, dev)
    num_slots, n_layers = B + 5, 3
    ours = StatePool(num_slots, n_layers, H_REAL, D_REAL, torch.float32, dev)
    ours.state.copy_(0.05 * torch.randn(ours.state.shape, generator=gen))
    ref = StatePool(num_slots, n_layers, H_REAL, D_REAL, torch.float32, dev)
    ref.state.copy_(ours.state)
    initial = ours.state.clone()
    slots = torch.randperm(num_slots, generator=gen)[:B].tolist()
    base = torch.randint(0, 600000, (B,), generator=gen).tolist()
    scale = D_REAL ** -0.5
    for step, layer in enumerate((1, 2, 1, 1)):
        batch = decode_batch([p + step for p in base], slots, dev)
        q, k, v, _ = fused_qkvz(B, H_REAL, D_REAL, dtype, dev, gen)
        o = lightning_decode_step(q, k, v, qw, kw, batch.positions, ours.state, batch.state_slots, layer,
                                  log_decay, scale, EPS, THETA)
        qr, kr = TB.lightning_qk_norm_rope(q, k, qw, kw, batch.positions, EPS, THETA)
        o_ref = TB.gla(qr, kr, v, batch, ref, layer, log_decay, scale)
        # fp32: GPU exp/cos/FMA vs torch, ~1e-6. bf16: a q/k element may land one bf16 ulp (2^-8
        # relative) away when the fp32 value sits on a rounding boundary; such flips are rare
        # (~1e-4 of elements), each moves one term of a 128-term dot product.
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        assert rel_err(o, o_ref) < tol, (step, rel_err(o, o_ref))
        assert max_err(o, o_ref) < 10 * tol, (step, max_err(o, o_ref))
        assert rel_err(ours.state, ref.state) < tol
    untouched = [s for s in range(num_slots) if s not in slots]
    assert torch.equal(ours.state[untouched], initial[untouched])
    assert torch.equal(ours.state[:, 0], initial[:, 0])


@pytest.mark.gpu
@cuda
def test_gpu_decode_step_in_cuda_graph():
    """Captured once, replayed with new inputs copied into the static buffers: same as eager."""
    from salaserve.kernels.lightning import lightning_decode_step

    dev, B, dtype = "cuda", 8, torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    qw, kw, log_decay = _real_weights(dtype, gen, dev)
    pool = StatePool(16, 2, H_REAL, D_REAL, torch.float32, dev)
    pool.state.copy_(0.05 * torch.randn(pool.state.shape, generator=gen))
    qkvz = torch.zeros(B, 4 * H_REAL * D_REAL, dtype=dtype, device=dev)
    q, k, v, _ = (x.view(B, H_REAL, D_REAL) for x in qkvz.split(H_REAL * D_REAL, dim=-1))
    positions = torch.zeros(B, dtype=torch.int64, device=dev)
    slots = torch.arange(B, dtype=torch.int64, device=dev)

    def step():
        return lightning_decode_step(q, k, v, qw, kw, positions, pool.state, slots, 1, log_decay,
                                     D_REAL ** -0.5, EPS, THETA)

    step()  # warm-up: compile, RoPE table
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_static = step()
    for _ in range(3):
        qkvz.copy_(torch.randn(qkvz.shape, generator=gen).to(dev, dtype))
        positions.copy_(torch.randint(0, 500000, (B,), generator=gen))
        slots.copy_(torch.randperm(16, generator=gen)[:B])
        before = pool.state.clone()
        graph.replay()
        after = pool.state.clone()
        pool.state.copy_(before)
        o_eager = step()
        assert torch.equal(o_static, o_eager)
        assert torch.equal(pool.state, after)


@pytest.mark.gpu
@cuda
def test_gpu_lightning_chain_with_pdl_in_a_graph_changes_no_bit():
    """With PDL the decode step loads its slot, state tile and decay, and the output kernel its norm
    weight, before griddepcontrol.wait (they overlap the previous kernel). A Lightning layer's batch-1
    chain (qkvz GEMV -> decode step -> output -> o_proj GEMV), captured with PDL and replayed step after
    step (the state carried from replay to replay, new inputs each time), equals the same steps run
    eagerly without PDL, bit for bit: outputs and state. Where the GPU cannot launch with PDL, both
    runs are plain."""
    from salaserve.kernels import _triton_utils as U
    from salaserve.kernels import gemv as G
    from salaserve.kernels.lightning import lightning_decode_step, lightning_output

    dev, dtype, hd = "cuda", torch.bfloat16, H_REAL * D_REAL
    gen = torch.Generator().manual_seed(11)
    qw, kw, log_decay = _real_weights(dtype, gen, dev)
    o_norm = (1 + 0.2 * torch.randn(hd, generator=gen)).to(dev, dtype)
    w_qkvz = (torch.randn(4 * hd, 4096, generator=gen) / 64).to(dev, dtype)
    w_o = (torch.randn(4096, hd, generator=gen) / 64).to(dev, dtype)
    x = torch.zeros(1, 4096, dtype=dtype, device=dev)
    positions = torch.zeros(1, dtype=torch.int64, device=dev)
    slots = torch.tensor([2], dtype=torch.int64, device=dev)
    pool = StatePool(4, 2, H_REAL, D_REAL, torch.float32, dev)
    pool.state.copy_(0.05 * torch.randn(pool.state.shape, generator=gen))
    start = pool.state.clone()

    def run():
        qkvz = G.gemv(x, w_qkvz)
        q, k, v, z = (t.view(1, H_REAL, D_REAL) for t in qkvz.split(hd, dim=-1))
        o = lightning_decode_step(q, k, v, qw, kw, positions, pool.state, slots, 1, log_decay, D_REAL ** -0.5,
                                  EPS, THETA)
        y = lightning_output(o, o_norm, z.reshape(1, hd), EPS, dtype)
        return o, y, G.gemv(y, w_o)

    inputs = [(torch.randn(1, 4096, generator=gen).to(dev, dtype), 1000 + 7 * i) for i in range(4)]
    before = U._PDL
    try:
        U.set_pdl(False)
        eager = []
        for xi, pos in inputs:
            x.copy_(xi)
            positions.fill_(pos)
            eager.append([t.clone() for t in run()] + [pool.state.clone()])
        U.set_pdl(True)
        pool.state.copy_(start)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()  # compile and warm up with PDL (this step's state update is undone below)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = run()
        pool.state.copy_(start)
        for (xi, pos), want in zip(inputs, eager):
            x.copy_(xi)
            positions.fill_(pos)
            graph.replay()
            torch.cuda.synchronize()
            for got, exp in zip(list(outs) + [pool.state], want):
                assert torch.equal(got, exp)
    finally:
        U.set_pdl(before)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("N", [1, 8, 64, 300])
def test_gpu_lightning_output_and_qk_norm_rope(N):
    from salaserve.kernels.lightning import lightning_output, qk_norm_rope

    dev, dtype = "cuda", torch.bfloat16
    gen = torch.Generator().manual_seed(N)
    q, k, _, z = fused_qkvz(N, H_REAL, D_REAL, dtype, dev, gen)
    qw, kw, _ = _real_weights(dtype, gen, dev)
    pos = torch.randint(0, 600000, (N,), generator=gen).to(dev)
    qo, ko = qk_norm_rope(q, k, qw, kw, pos, EPS, THETA)
    qr, kr = TB.lightning_qk_norm_rope(q, k, qw, kw, pos, EPS, THETA)
    # bf16 flips where the GPU's fp32 differs from torch's in the last bit: rare; measured per
    # rotated pair (see assert_rope_within_ulps)
    assert_rope_within_ulps(qo, qr, max_ulps=2, max_frac=1e-3)
    assert_rope_within_ulps(ko, kr, max_ulps=2, max_frac=1e-3)
    o = torch.randn(N, H_REAL, D_REAL, generator=gen).to(dev)
    w = (1.0 + 0.2 * torch.randn(H_REAL * D_REAL, generator=gen)).to(dev, dtype)
    out = lightning_output(o, w, z, EPS, dtype)
    assert_within_ulps(out, TB.lightning_output(o, w, z, EPS, dtype), max_ulps=1, max_frac=1e-3)
    # the GLA's bf16 output (fla's dtype) gives the same bits as its fp32 copy: the first rounding absorbs it
    ob = o.to(dtype)
    assert torch.equal(lightning_output(ob, w, z, EPS, dtype), lightning_output(ob.float(), w, z, EPS, dtype))


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("N", [1, 8, 64, 1000])
def test_gpu_fused_elementwise(N):
    from salaserve.kernels import fused

    dev, dtype = "cuda", torch.bfloat16
    gen = torch.Generator().manual_seed(N)
    hidden, ffn = 4096, 16384
    big = torch.randn(N, 2 * hidden, generator=gen).to(dev, dtype)
    h, upd = big[:, :hidden], big[:, hidden:]
    w = (1.0 + 0.2 * torch.randn(hidden, generator=gen)).to(dev, dtype)
    assert_within_ulps(fused.rms_norm(h, w, EPS), TB.rms_norm(h, w, EPS), max_ulps=1, max_frac=1e-3)
    r = 1.4 / 32 ** 0.5
    nh, nn = fused.add_rms_norm(h, upd, r, w, EPS)
    rh, rn = TB.add_rms_norm(h, upd, r, w, EPS)
    assert torch.equal(nh, rh)
    assert_within_ulps(nn, rn, max_ulps=1, max_frac=1e-3)
    gate_up = (2 * torch.randn(N, 2 * ffn, generator=gen)).to(dev, dtype)
    assert_within_ulps(fused.silu_mul(gate_up), TB.silu_mul(gate_up), max_ulps=1, max_frac=1e-3)
    assert_within_ulps(fused.sigmoid_mul(h, upd), h * torch.sigmoid(upd), max_ulps=1, max_frac=1e-3)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens", [[1, 37, 64, 200, 1000], [1, 5, 63], [4096]])
def test_gpu_gla_prefill_fla(lens, input_dtype):
    pytest.importorskip("fla")
    from salaserve.kernels.lightning import gla_prefill

    dev = "cuda"
    gen = torch.Generator().manual_seed(len(lens))
    num_slots = len(lens) + 2
    slots = torch.randperm(num_slots, generator=gen)[: len(lens)].tolist()
    ours = StatePool(num_slots, 2, H_REAL, D_REAL, torch.float32, dev)
    ours.state.copy_(0.05 * torch.randn(ours.state.shape, generator=gen))
    ref = StatePool(num_slots, 2, H_REAL, D_REAL, torch.float32, dev)
    ref.state.copy_(ours.state)
    initial = ours.state.clone()
    batch = prefill_batch(lens, [0] * len(lens), slots, dev)
    N = sum(lens)
    # inputs shaped like the real ones: unit-RMS bf16 q/k (after norm + RoPE), bf16 v
    q, k, v, _ = fused_qkvz(N, H_REAL, D_REAL, torch.bfloat16, dev, gen)
    _, _, log_decay = _real_weights(torch.bfloat16, gen, dev)
    o = gla_prefill(q, k, v, batch, ours, 1, log_decay, D_REAL ** -0.5, input_dtype=input_dtype)
    o_ref = TB.gla(q, k, v, batch, ref, 1, log_decay, D_REAL ** -0.5)
    # fp32: fla's chunk kernel uses TF32 dots (10-bit mantissa, ~5e-4 per product) as in HF;
    # bf16: inputs are already bf16 values, but fla keeps per-chunk states and o in bf16 (~4e-3).
    tol = 3e-3 if input_dtype == torch.float32 else 1.5e-2
    assert rel_err(o, o_ref) < tol, rel_err(o, o_ref)
    assert rel_err(ours.state, ref.state) < tol, rel_err(ours.state, ref.state)
    untouched = [s for s in range(num_slots) if s not in slots]
    assert torch.equal(ours.state[untouched], initial[untouched])
    assert torch.equal(ours.state[:, 0], initial[:, 0])


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("impl", ["chunk", "loop"])
@pytest.mark.parametrize("lens", [[9], [5, 1, 9, 3]])
def test_gpu_verify_and_commit(lens, impl):
    """lightning_verify at the real shapes (bf16 projections, fp32 state): outputs of every draft
    token against the torch recurrence, states untouched; the commit of a prefix then equals the
    decode kernel run token by token (same arithmetic: bitwise)."""
    from salaserve.kernels.lightning import lightning_decode_step
    from salaserve.kernels.lightning_verify import VERIFY, lightning_commit, lightning_verify

    dev, dtype = "cuda", torch.bfloat16
    gen = torch.Generator().manual_seed(len(lens))
    qw, kw, log_decay = _real_weights(dtype, gen, dev)
    B, N, n_layers = len(lens), sum(lens), 2
    pool = StatePool(B + 3, n_layers, H_REAL, D_REAL, torch.float32, dev)
    pool.state.copy_(0.05 * torch.randn(pool.state.shape, generator=gen))
    before = pool.state.clone()
    slots = torch.randperm(B + 3, generator=gen)[:B].tolist()
    caches = torch.randint(0, 600000, (B,), generator=gen).tolist()
    batch = prefill_batch(lens, caches, slots, dev)
    q, k, v, _ = fused_qkvz(N, H_REAL, D_REAL, dtype, dev, gen)
    scale = D_REAL ** -0.5
    k_keep = torch.empty(n_layers, N, H_REAL, D_REAL, dtype=dtype, device=dev)
    v_keep = torch.empty_like(k_keep)
    modes = torch.full((B,), VERIFY, dtype=torch.int32, device=dev)
    o = lightning_verify(q, k, v, qw, kw, batch.positions, batch.cu_seqlens_q, modes, pool.state,
                         batch.state_slots, 1, log_decay, scale, EPS, THETA, k_keep[1], v_keep[1],
                         max_tokens=max(lens), impl=impl)
    assert torch.equal(pool.state, before)
    qr, kr = TB.lightning_qk_norm_rope(q, k, qw, kw, batch.positions, EPS, THETA)
    start = 0
    for i, n in enumerate(lens):
        sl = slice(start, start + n)
        o_ref, _ = spec.gla_recurrent(qr[sl].float(), kr[sl].float(), v[sl].float(), log_decay,
                                      before[slots[i], 1], scale)
        assert rel_err(o[sl], o_ref) < 2e-3, (i, rel_err(o[sl], o_ref))  # bf16 q/k ulp flips, as decode
        start += n
    counts = torch.tensor([max(1, n - 2) for n in lens], dtype=torch.int32, device=dev)
    k_keep[0], v_keep[0] = k_keep[1], v_keep[1]
    lightning_commit(pool.state, batch.state_slots, batch.cu_seqlens_q, counts, k_keep, v_keep, log_decay)
    for i, n in enumerate(counts.tolist()):
        ref = before[slots[i]].clone()[None]
        r0 = int(batch.cu_seqlens_q[i])
        for lay in range(n_layers):
            for r in range(r0, r0 + n):
                lightning_decode_step(q[r:r + 1], k[r:r + 1], v[r:r + 1], qw, kw, batch.positions[r:r + 1], ref,
                                      torch.zeros(1, dtype=torch.int64, device=dev), lay, log_decay, scale, EPS, THETA)
        assert torch.equal(pool.state[slots[i]], ref[0]), i


def _verify_compile_cases():
    import triton.language as tl

    from salaserve.kernels import lightning_verify as LV

    bf, i32, i64 = "*bf16", "*i32", "*i64"
    meta = dict(cu_ptr=i32, mode_ptr=i32, slot_ptr=i64)
    chunk_ptrs = dict(meta, v_ptr=bf, ks_ptr=bf, vs_ptr=bf, depth_ptr=i32, anc_ptr=i32)
    return {
        "verify_chunk": (LV._verify_chunk_kernel, chunk_ptrs, dict(D=128, BLOCK_V=32, BLOCK_T=16, TREE=False), 8, True),
        # with a draft tree's mask (depth and ancestor bits per row)
        "verify_chunk_tree": (LV._verify_chunk_kernel, chunk_ptrs, dict(D=128, BLOCK_V=32, BLOCK_T=16, TREE=True), 8,
                              True),
        "verify_loop": (LV._verify_kernel, dict(meta, q_ptr=bf, k_ptr=bf, v_ptr=bf, qw_ptr=bf, kw_ptr=bf, pos_ptr=i64,
                                                ks_ptr=bf, vs_ptr=bf),
                        dict(HALF=64, BLOCK_V=32, X_DT=tl.bfloat16, QN_DT=tl.bfloat16, KN_DT=tl.bfloat16), 8, False),
        "commit": (LV._commit_kernel, dict(ks_ptr=bf, vs_ptr=bf, cu_ptr=i32, count_ptr=i32, slot_ptr=i64),
                   dict(H=32, HALF=64, BLOCK_V=32), 4, False),
    }


@pytest.mark.parametrize("name", ["verify_chunk", "verify_chunk_tree", "verify_loop", "commit"])
def test_verify_kernels_compile_for_sm90_without_spills(name):
    """The speculative-verify kernels at the real shapes, compiled ahead of time for sm_90."""
    from kernel_checks import compile_sm90_without_spills

    fn, ptrs, constexprs, warps, fusion = _verify_compile_cases()[name]
    compile_sm90_without_spills(fn, ptrs, constexprs, warps, fp_fusion=fusion)
