"""Tree verify through the triton backend's kernels, on CPU under the Triton interpreter, against
the torch backend's tree verify (the ground truth, kernels/tree_verify.py).

tests/test_spec_tree.py runs this file in a subprocess with TRITON_INTERPRET=1 (the file name keeps
it out of normal collection). By hand:

    TRITON_INTERPRET=1 python -m pytest tests/tree_interp_cases.py
"""

from __future__ import annotations

import os
import random

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 (run through test_spec_tree.py)", allow_module_level=True)

from _tree_cases import PARENTS, check_tree_verify  # noqa: E402
from engine_utils import run_requests  # noqa: E402

from salaserve.config import EngineArgs, ModelConfig, preset_config  # noqa: E402
from salaserve.core.sampling_params import SamplingParams  # noqa: E402
from salaserve.engine.engine import Engine  # noqa: E402
from salaserve.engine.runner import ModelRunner  # noqa: E402
from salaserve.kernels.torch_ops import TorchBackend  # noqa: E402
from salaserve.kernels.triton_backend import TritonBackend  # noqa: E402
from salaserve.model.checkpoint import write_checkpoint  # noqa: E402
from salaserve.spec.oracle import TreeOracleDrafter  # noqa: E402

# fp32 everywhere. Per row, the triton tree verify and the torch one compute the same decode of the
# row's path with other summation orders (split-K attention, fp32 compressed-key means in the
# kernel, the Lightning chunk form against the recurrence): logits of the tiny model are O(1)
LOGIT_ATOL = 2e-4
# K/V and compressed keys: O(1) values of one projection (the commit writes them in torch on both
# backends; the entries up to the root come from the compression kernel on the triton side)
CACHE_ATOL = 1e-5
# Lightning states grow to O(10) entries: a few fp32 ulps of the largest
STATE_RTOL = 2e-6


@pytest.fixture
def verify_kernels_only(monkeypatch):
    """Linears (with their fused norms and residual adds) and the q/k norm through torch: they have
    their own kernel tests, and the interpreter would spend minutes on them here."""
    monkeypatch.setattr(TritonBackend, "linear", TorchBackend.linear)
    monkeypatch.setattr(TritonBackend, "norm_linear", TorchBackend.norm_linear)
    monkeypatch.setattr(TritonBackend, "residual_norm_linear", TorchBackend.residual_norm_linear)
    monkeypatch.setattr(TritonBackend, "lightning_qk_norm_rope", TorchBackend.lightning_qk_norm_rope)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-model")
    write_checkpoint(str(d), "tiny", seed=0)
    return str(d)


@pytest.fixture(scope="module")
def runner(tiny_dir):
    args = EngineArgs(model=tiny_dir, device="cpu", dtype="float32", backend="torch",
                      chunked_prefill_size=64, max_running_requests=4)
    return ModelRunner(args, tiny_dir)


@pytest.mark.parametrize("prompt_len", [40, 125, 252], ids=["dense", "crosses-dense_len", "sparse"])
def test_triton_tree_verify_equals_torch(runner, verify_kernels_only, prompt_len):
    """Every row of a tree verify through the triton backend (Lightning chunk kernel's tree form,
    per-row page tables over scratch copies for the sparse layers) equals the torch tree verify;
    committing a path leaves the sequence's K/V pages, compressed keys and states as the torch commit
    does (`_tree_cases.check_tree_verify`). 40: dense; 125: rows on both sides of dense_len (128),
    a C2 entry born on a path; 252: top-k selection over up to 17 blocks, entries born on paths, a
    new block at depth 4. A plain decode sequence shares the step."""
    check_tree_verify(runner, TritonBackend(), prompt_len, LOGIT_ATOL, CACHE_ATOL, STATE_RTOL)


def test_wide_tree_takes_the_torch_lightning(runner, verify_kernels_only):
    """A tree of 21 rows (over lightning_verify's 16): its Lightning layers run the torch ground
    truth, its sparse layers the kernels; rows and commit still equal the torch backend's."""
    wide = PARENTS + (-1, -1, 2, 2, 10, 10, 11, 12, 13, 14)
    check_tree_verify(runner, TritonBackend(), 252, LOGIT_ATOL, CACHE_ATOL, STATE_RTOL, parents=wide)


def test_tree_step_without_scratch_pages(runner, verify_kernels_only):
    """No scratch pages lent (none free): the sparse layers run the torch ground truth, the
    Lightning ones the kernel; the results are the torch backend's all the same."""
    check_tree_verify(runner, TritonBackend(), 125, LOGIT_ATOL, CACHE_ATOL, STATE_RTOL, lend_scratch=False)


def _small_sparse_model(out_dir: str) -> str:
    """The tiny model with InfLLM-v2 from 48 tokens and 3 selected blocks of 16 tokens, so short
    prompts (cheap under the interpreter) already attend sparsely."""
    raw = preset_config("tiny").to_dict()
    raw["sparse_config"].update(topk=2, window_size=16, dense_len=48)
    write_checkpoint(out_dir, ModelConfig.from_dict(raw))
    return out_dir


def test_greedy_tree_verify_on_triton_equals_plain_decoding(tmp_path, verify_kernels_only):
    """Engine level: the tree oracle (width 2, depth 3, the true continuation dropped every 3rd
    proposal) on the triton backend gives plain decoding's greedy output (torch backend); one
    prompt crosses dense_len (48) while verifying, one is sparse from the start. Pages, slots and
    compressed entries all come back."""
    model_dir = _small_sparse_model(str(tmp_path / "model"))
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 8000) for _ in range(40)], [rng.randrange(3, 8000) for _ in range(60)]]
    params = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
    kw = dict(model=model_dir, device="cpu", dtype="float32", chunked_prefill_size=64, max_running_requests=4)
    plain = run_requests(Engine(backend="torch", **kw), prompts, params)
    eng = Engine(backend="triton", speculative_algorithm="NGRAM", speculative_num_draft_tokens=6,
                 speculative_max_batch=32, **kw)
    assert eng.tree_verify
    initial = eng.resource_counters()
    trees = []
    eng.make_drafter = lambda req: TreeOracleDrafter(req.num_prompt, plain[req.rid], eng.cfg.vocab_size, depth=3,
                                                     width=2, miss_every=3, seed=len(req.rid))
    forward = eng.runner.forward

    def spy(work, prev_tokens=None):
        logits = forward(work, prev_tokens)
        batch = eng.runner.last_batch
        trees.append(batch.trees)
        if batch.trees:  # the kernels ran, not the torch fallback
            assert batch.derived["tree_plan"] is not None and "tree_rows" in batch.derived
        return logits

    eng.runner.forward = spy
    assert run_requests(eng, prompts, params) == plain
    assert any(t is not None for t in trees)
    assert eng.stats["spec_accepted_tokens"] > eng.stats["spec_verify_steps"]
    assert eng.resource_counters() == initial
