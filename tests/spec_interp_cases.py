"""Speculative verify through the triton backend's kernels, on CPU under the Triton interpreter.

tests/test_spec.py runs this file in a subprocess with TRITON_INTERPRET=1 (the file name keeps it
out of normal collection). By hand:

    TRITON_INTERPRET=1 python -m pytest tests/spec_interp_cases.py
"""

from __future__ import annotations

import os
import random

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 (run through test_spec.py)", allow_module_level=True)

from kernel_checks import greedy_outputs_and_logits  # noqa: E402

from salaserve.config import ModelConfig, preset_config  # noqa: E402
from salaserve.engine.engine import Engine  # noqa: E402
from salaserve.model.checkpoint import write_checkpoint  # noqa: E402
from salaserve.spec.oracle import OracleDrafter  # noqa: E402


def _run(model_dir, backend, prompts, new_tokens, conts=None, pad_buckets=None, kv_cache_dtype="auto"):
    spec = {} if conts is None else dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=6,
                                         speculative_max_batch=32)
    eng = Engine(model=model_dir, device="cpu", dtype="float32", backend=backend, max_running_requests=8,
                 chunked_prefill_size=64, kv_cache_dtype=kv_cache_dtype, **spec)
    if conts is not None:  # knows the plain output, corrupts every 2nd draft: accepts and rejects
        eng.make_drafter = lambda req: OracleDrafter(req.num_prompt, conts[req.rid], error_every=2,
                                                     vocab_size=eng.cfg.vocab_size)
    if pad_buckets:  # as with verify CUDA graphs: all-verify steps padded with filler tokens
        eng.runner.enable_verify_padding(pad_buckets)
    out, _ = greedy_outputs_and_logits(eng, prompts, new_tokens)  # also checks resources come back
    return out, eng


def _small_sparse_model(out_dir: str) -> str:
    """The tiny model with InfLLM-v2 from 48 tokens and 3 selected blocks (2 top-k + 1 local) of
    16 tokens, so short prompts (cheap under the interpreter) already attend sparsely."""
    raw = preset_config("tiny").to_dict()
    raw["sparse_config"].update(topk=2, window_size=16, dense_len=48)
    write_checkpoint(out_dir, ModelConfig.from_dict(raw))
    return out_dir


@pytest.fixture
def verify_kernels_only(monkeypatch):
    """Linears (with their fused norms and residual adds) and the prefill q/k norm through torch:
    they have their own kernel tests, and the interpreter would spend minutes on them here."""
    from salaserve.kernels.torch_ops import TorchBackend
    from salaserve.kernels.triton_backend import TritonBackend

    monkeypatch.setattr(TritonBackend, "linear", TorchBackend.linear)
    monkeypatch.setattr(TritonBackend, "norm_linear", TorchBackend.norm_linear)
    monkeypatch.setattr(TritonBackend, "residual_norm_linear", TorchBackend.residual_norm_linear)
    monkeypatch.setattr(TritonBackend, "lightning_qk_norm_rope", TorchBackend.lightning_qk_norm_rope)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_triton_verify_equals_plain_decoding(tmp_path, verify_kernels_only, kv_cache_dtype):
    """fp32, C1 stride 4, C2 stride 16: greedy output with oracle drafts through lightning_verify /
    lightning_commit and per-token decode attention equals plain decoding with the torch backend,
    with model-dtype and with fp8 KV pages (the verify tokens' K/V stored through the fp8 store
    kernel, filler tokens included).
    One prompt crosses dense_len inside a draft window, one is already sparse (5+ blocks, 3
    selected), and the 95-token one is still prefilling (chunks of 64) while the others verify, so
    steps mix verify, decode and prefill sequences; all-verify steps are padded with filler tokens
    to 2, 3, 5 or 7 tokens per sequence, as for the verify CUDA graphs. The sparse prompts (79 and
    95 tokens, = 15 mod 16) are where stage 1 hides the newest C2 entry from prompt tokens (the
    prompt rule), which verify and decode tokens after them do not."""
    model_dir = _small_sparse_model(str(tmp_path / "model"))
    rng = random.Random(7)
    base = [rng.randrange(3, 8000) for _ in range(200)]
    prompts = [([5, 9, 11] * 20)[:44], base[:79], base[80:175]]
    plain, _ = _run(model_dir, "torch", prompts, 14, kv_cache_dtype=kv_cache_dtype)
    spec, eng = _run(model_dir, "triton", prompts, 14, conts=plain, pad_buckets=[2, 3, 5, 7],
                     kv_cache_dtype=kv_cache_dtype)
    assert spec == plain
    assert eng.avg_spec_accept_length > 2.0  # not vacuous: drafts were accepted ...
    assert eng.stats["spec_accepted_tokens"] < eng.stats["spec_draft_tokens"]  # ... and rejected
    # (_run checks that pages, slots and compressed entries are back to their initial counts)
