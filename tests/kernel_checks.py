"""Shared helpers for the kernel tests: random inputs, ForwardBatch building, comparisons."""

from __future__ import annotations

import torch

from salaserve.core.batch import ForwardBatch, SeqWork


def decode_batch(positions, slots, device="cpu") -> ForwardBatch:
    """A decode ForwardBatch: one token per sequence at the given absolute positions and slots."""
    work = [SeqWork(state_slot=s, pages=[0], cache_len=p, token_ids=[1], need_logits=True)
            for p, s in zip(positions, slots)]
    return ForwardBatch.build(work, block_size=1 << 30, dense_len=1 << 30, device=device)


def prefill_batch(lens, cache_lens, slots, device="cpu") -> ForwardBatch:
    work = [SeqWork(state_slot=s, pages=[0], cache_len=c, token_ids=[1] * n, need_logits=True)
            for n, c, s in zip(lens, cache_lens, slots)]
    return ForwardBatch.build(work, block_size=1 << 30, dense_len=1 << 30, device=device)


def fused_qkvz(n, heads, d, dtype, device="cpu", gen=None):
    """q, k, v, z as strided views into one [n, 4*H*d] projection output, like the model's."""
    qkvz = torch.randn(n, 4 * heads * d, generator=gen, device="cpu").to(device=device, dtype=dtype)
    q, k, v, z = qkvz.split(heads * d, dim=-1)
    return q.view(n, heads, d), k.view(n, heads, d), v.view(n, heads, d), z


def rel_err(a, b) -> float:
    """||a - b|| / ||b|| in fp64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def max_err(a, b) -> float:
    """max |a - b| / max |b|."""
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def assert_within_ulps(a, b, max_ulps: int = 1, max_frac: float = 0.0):
    """a, b same low-precision dtype: every element within max_ulps ulps of its reference (ulp at the
    reference's magnitude), and at most max_frac of the elements differing at all."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    af, bf = a.float(), b.float()
    mant = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[a.dtype]
    ulp = torch.exp2(torch.floor(torch.log2(bf.abs().clamp_min(1e-30))) - mant)
    diff = (af - bf).abs()
    bad = diff > max_ulps * ulp
    assert not bad.any(), f"{int(bad.sum())} elements off by more than {max_ulps} ulp; worst {float(diff.max())}"
    frac = float((diff > 0).float().mean())
    assert frac <= max_frac, f"{frac:.2e} of the elements differ (allowed {max_frac:.1e})"


def assert_rope_within_ulps(a, b, max_ulps: int = 2, max_frac: float = 0.0):
    """RoPE outputs [..., d]: compare against the ulp at the magnitude of each rotated pair
    (x_i, x_{i+d/2}), whose norm the rotation preserves. A lone element of a pair can come out of
    the rotation near zero by cancellation; its own ulp is then tiny while the rounding error of
    the (normed, bf16-rounded) inputs is set by the pair's magnitude. Each input component may be
    one ulp off (GPU vs CPU rsqrt/cos/sin in the last fp32 bit), hence two ulps of the pair."""
    assert a.dtype == b.dtype and a.shape == b.shape
    af, bf = a.float(), b.float()
    half = bf.shape[-1] // 2
    pair = torch.sqrt(bf[..., :half] ** 2 + bf[..., half:] ** 2)
    pair = torch.cat([pair, pair], dim=-1)
    mant = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[a.dtype]
    ulp = torch.exp2(torch.floor(torch.log2(pair.clamp_min(1e-30))) - mant)
    diff = (af - bf).abs()
    bad = diff > max_ulps * ulp
    assert not bad.any(), f"{int(bad.sum())} elements off by more than {max_ulps} pair-ulps; worst {float(diff.max())}"
    frac = float((diff > 0).float().mean())
    assert frac <= max_frac, f"{frac:.2e} of the elements differ (allowed {max_frac:.1e})"


def constexpr_defaults(fn) -> dict:
    """{name: default} of a @triton.jit kernel's constexpr parameters that declare one."""
    import inspect

    return {p.name: p.default for p in fn.params if p.is_constexpr and p.default is not inspect.Parameter.empty}


def compile_sm90(fn, ptr_types: dict, constexprs: dict, num_warps: int, *, num_stages: int = 3,
                 fp_fusion: bool = False, divisible: tuple = (), maxnreg: int | None = None,
                 floats: tuple = ()):
    """Compile a @triton.jit kernel for sm_90 (H100/H200) ahead of time, on a machine without a GPU,
    with the specialisations the JIT would pick at the real shapes (pointers and strides divisible
    by 16). Catches what the interpreter lets through (types, constexpr branches, layouts) and
    reports register use. Arguments named *_ptr are pointers (`ptr_types` overrides the default
    *fp32, and gives the type of any other argument it names, e.g. a tensordesc), scale/eps are
    fp32, other non-constexpr arguments i32. fp_fusion: as the kernel's
    launches (False for the NO_FMA elementwise kernels). divisible: more integer arguments the JIT
    would see as multiples of 16 (e.g. N and K at the model's shapes). maxnreg: the launch's
    register cap, where it sets one. floats: more fp32 arguments. Constexpr parameters not in
    `constexprs` take their declared defaults, as at a launch that does not pass them."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile as triton_compile

    constexprs = {**constexpr_defaults(fn), **constexprs}
    names = fn.arg_names
    sig = {}
    for n in names:
        if n in constexprs:
            sig[n] = "constexpr"
        elif n in ptr_types:
            sig[n] = ptr_types[n]
        elif n.endswith("_ptr"):
            sig[n] = ptr_types.get(n, "*fp32")
        elif n in ("scale", "eps") or n in floats:
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n.endswith("_ptr") or n.startswith("stride") or n in divisible}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(c),): v for c, v in constexprs.items()},
                    attrs=attrs)
    return triton_compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages, "enable_fp_fusion": fp_fusion,
                                   **({"maxnreg": maxnreg} if maxnreg else {})})


def cubin_resources(kernel) -> dict | None:
    """{'REG': n, 'STACK': bytes, ...} from cuobjdump (bundled with triton), or None without it."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    found = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", out))
    return {k: int(v) for k, v in found.items()} or None


def compile_sm90_without_spills(fn, ptr_types: dict, constexprs: dict, num_warps: int, **kw):
    """compile_sm90, asserting that nothing spills (no stack frame, no local memory). Skips the
    calling test where this triton cannot compile for sm_90 at all (no NVIDIA toolchain, another
    ahead-of-time API); errors in the kernel itself raise triton's CompilationError and fail."""
    import pytest

    try:
        kernel = compile_sm90(fn, ptr_types, constexprs, num_warps, **kw)
    except (ImportError, FileNotFoundError, TypeError, AttributeError) as e:
        pytest.skip(f"cannot compile for sm_90 here: {e!r}")
    res = cubin_resources(kernel)
    if res is not None:
        assert res.get("STACK", 0) == 0 and res.get("LOCAL", 0) == 0, res
    return kernel


def greedy_outputs_and_logits(eng, prompts, new_tokens: int):
    """Run prompts greedily to completion on an Engine, recording every logits tensor the runner
    returns; checks that pages, slots and compressed entries come back. Returns ({rid: tokens},
    [logits per step])."""
    from salaserve.core.sampling_params import SamplingParams

    initial = eng.resource_counters()
    rows, fwd = [], eng.runner.forward
    eng.runner.forward = lambda work, **kw: (lambda out: (rows.append(out.clone()), out)[1])(fwd(work, **kw))
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True))
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs.setdefault(o.rid, []).extend(o.new_token_ids)
    assert eng.resource_counters() == initial
    return outs, rows


def run_interpreter_cases(case_file) -> None:
    """Run a *_interp_cases.py file in a subprocess with TRITON_INTERPRET=1 (it must be set before
    triton is imported) and assert that its tests passed and none were skipped."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    case_file = Path(case_file).resolve()
    tests = case_file.parent
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tests.parent), str(tests), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider", str(case_file)],
        cwd=tests.parent, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, f"interpreter cases failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]

