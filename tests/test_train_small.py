"""The small-model trainer and its evaluation (tools/train_{model,small}.py, eval_small.py).

(a) the batched training forward equals the reference model (fp32, dense and sparse lengths):
    what makes trained weights mean the same thing in the serving engine;
(b) a few CPU training steps lower the loss, are reproducible from the seed, and the checkpoint
    loads through the project's loader and the reference model;
(c) the evaluation runs end to end through `LLM` on a tiny random checkpoint;
(d) skipped unless salaserve/assets/default_model/ exists: the shipped model's loss on the
    guard sample recorded in its metrics.json;
(e) the extra training data: the package-source corpus and the chat exchanges made from
    documented functions (tools/small_data.py).
"""

import ast
import dataclasses
import json
import os

import pytest
import torch
from safetensors import safe_open

from salaserve.config import ModelConfig, preset_config
from salaserve.core.weights import random_state_dict
from salaserve.model.loader import load_state_dict
from salaserve.model.reference import ReferenceModel, gla_chunked
from salaserve.model.corpus import read_corpus_file, stdlib_corpus_files
from tools import eval_small, small_data, train_small
from tools.train_model import TrainModel, gla_parallel, infllm_v2_mask

TOL = 1e-4
DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "salaserve", "assets",
                             "default_model")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Small tensors: one thread is as fast, and does not spin against other jobs on a busy CPU.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def reference_logits(ref: ReferenceModel, ids: torch.Tensor) -> torch.Tensor:
    return torch.stack([ref.forward(row, ref.new_state()) for row in ids])


# ---- (a) equivalence ------------------------------------------------------------------------


@pytest.mark.parametrize("T,chunk", [(150, 64), (64, 64), (7, 64), (100, 16)])
def test_gla_parallel_equals_reference_chunked(T, chunk):
    g = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(2, T, 4, 16, generator=g) for _ in range(3))
    log_decay = -torch.tensor([0.9, 0.2, 0.03, 0.004])
    out = gla_parallel(q, k, v, log_decay, 0.25, chunk_size=chunk)
    for b in range(2):
        want, _ = gla_chunked(q[b], k[b], v[b], log_decay, torch.zeros(4, 16, 16), 0.25, chunk_size=64)
        assert (out[b] - want).abs().max().item() <= 1e-5


@pytest.fixture(scope="module")
def tiny_pair():
    cfg = preset_config("tiny")
    w = random_state_dict(cfg, seed=3, dtype=torch.float32)
    model = TrainModel(cfg)
    model.load_hf_state_dict(w)
    return cfg, w, model.eval(), ReferenceModel(cfg, w, dtype=torch.float32)


# dense_len is 128: 50 and 127 are dense, 128 switches to InfLLM-v2, 300 and 517 select blocks
@pytest.mark.parametrize("T", [50, 127, 128, 300, 517])
def test_training_forward_equals_reference(tiny_pair, T):
    cfg, _, model, ref = tiny_pair
    ids = torch.randint(3, cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(T))
    with torch.no_grad():
        got = model(ids)
    assert got.shape == (2, T, cfg.vocab_size) and got.dtype == torch.float32
    assert (got - reference_logits(ref, ids)).abs().max().item() <= TOL


def test_sparse_path_is_really_sparse(tiny_pair):
    """At 517 tokens the selection drops causal blocks and that changes the logits: the
    equality above covers the InfLLM-v2 selection, not only dense attention."""
    cfg, w, model, _ = tiny_pair
    T = 517
    ids = torch.randint(3, cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(1))
    q = torch.randn(2, T, cfg.num_attention_heads, cfg.head_dim)
    k = torch.randn(2, T, cfg.num_key_value_heads, cfg.head_dim)
    mask = infllm_v2_mask(q, k, cfg)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    assert not (mask & ~causal).any()  # never a future key
    assert mask[..., -1, :].sum(-1).max() <= cfg.sparse.topk_eff * cfg.sparse.block_size
    assert (mask.sum(-1) < causal.sum(-1)).any()

    dense_cfg = dataclasses.replace(cfg, sparse=dataclasses.replace(cfg.sparse, dense_len=10**6))
    dense = TrainModel(dense_cfg)
    dense.load_hf_state_dict(w)
    with torch.no_grad():
        assert (dense.eval()(ids) - model(ids))[:, -64:].abs().max().item() > 1e-2


def test_small_preset_forward_equals_reference():
    """The shipped shape (head_dim 64, GQA 2, block 32, C2 stride 32) past its 384-token span."""
    cfg = preset_config("small")
    assert cfg.sparse.block_size % cfg.sparse.c2_kernel_stride == 0  # page-aligned C2 entries
    assert 2 * cfg.num_parameters() <= train_small.MAX_CHECKPOINT_BYTES  # bf16 checkpoint fits
    w = random_state_dict(cfg, seed=0, dtype=torch.float32)
    model = TrainModel(cfg)
    model.load_hf_state_dict(w)
    ids = torch.randint(3, cfg.vocab_size, (1, 520), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = model.eval()(ids)
    want = reference_logits(ReferenceModel(cfg, w, dtype=torch.float32), ids)
    assert (got - want).abs().max().item() <= TOL


# ---- (b) training on CPU --------------------------------------------------------------------


def run_train(out, steps, extra=()):
    return train_small.main(["--out", str(out), "--preset", "tiny", "--steps", str(steps), "--batch-size", "2",
                             "--seq-len", "160", "--max-train-files", "8", "--device", "cpu", "--log-every", "1",
                             "--eval-every", "4", "--lr", "0.03", "--no-eval", *extra])


def test_train_steps_lower_loss_and_checkpoint_loads(tmp_path):
    out = tmp_path / "m"
    metrics = run_train(out, 8)
    t = metrics["training"]
    assert t["steps"] == 8 and t["seq_len"] == 160 and t["tokens_seen"] == 8 * 320
    assert t["best_val_loss"] < t["initial_val_loss"] - 0.3  # on unseen files
    assert t["final_train_loss"] < t["first_train_loss"] - 0.5
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja", "model.safetensors", "metrics.json", "README.md"):
        assert (out / name).is_file(), name
    reproduce = json.loads((out / "metrics.json").read_text())["reproduce"]
    assert reproduce.startswith("python -m tools.train_small")

    cfg = ModelConfig.from_pretrained(out)
    assert cfg == preset_config("tiny")
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert all(f.get_slice(n).get_dtype() == "BF16" for n in f.keys())
    weights = load_state_dict(str(out), cfg, dtype=torch.float32)  # validates names and shapes
    ref = ReferenceModel.from_pretrained(str(out), dtype=torch.float32)
    model = TrainModel(cfg)
    model.load_hf_state_dict(weights)
    ids = torch.randint(3, cfg.vocab_size, (1, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model.eval()(ids) - reference_logits(ref, ids)).abs().max().item() <= TOL


def test_training_is_reproducible_from_the_seed(tmp_path):
    tensors = []
    for name in ("a", "b"):
        run_train(tmp_path / name, 3, ["--dropout", "0.1"])
        with safe_open(str(tmp_path / name / "model.safetensors"), framework="pt") as f:
            tensors.append({n: f.get_tensor(n) for n in f.keys()})
    assert all(torch.equal(tensors[0][n], tensors[1][n]) for n in tensors[0])


def test_time_budget_mode_plans_the_steps(tmp_path):
    # --patience 0: no early decay, whose timing (when the validation loss stalls) would
    # otherwise shorten the planned run on some machines.
    metrics = train_small.main(["--out", str(tmp_path), "--preset", "tiny", "--minutes", "0.2", "--probe-steps", "5",
                                "--batch-size", "2", "--seq-len", "160", "--max-train-files", "4", "--device", "cpu",
                                "--no-eval", "--patience", "0"])
    t = metrics["training"]
    (planned,) = [e for e in t["events"] if e["event"] == "planned"]
    assert planned["step"] == 5 and t["steps"] == planned["total"] >= 6
    assert not [e for e in t["events"] if e["event"] == "early_decay"]
    assert "--steps {} --decay-start {}".format(t["steps"], t["decay_start"]) in metrics["reproduce"]


def test_stalled_validation_decays_early(tmp_path):
    # An impossible --min-delta makes every evaluation after the first a stall, so with
    # --patience 1 the first evaluation past warmup starts the decay, whatever the machine's speed.
    metrics = train_small.main(["--out", str(tmp_path), "--preset", "tiny", "--minutes", "0.2", "--probe-steps", "5",
                                "--batch-size", "2", "--seq-len", "160", "--max-train-files", "4", "--device", "cpu",
                                "--no-eval", "--patience", "1", "--min-delta", "1e9", "--eval-every", "2"])
    t = metrics["training"]
    (planned,) = [e for e in t["events"] if e["event"] == "planned"]
    (early,) = [e for e in t["events"] if e["event"] == "early_decay"]
    assert planned["step"] < early["step"] < t["steps"] == early["total"] < planned["total"]
    assert t["decay_start"] == early["step"]
    assert "--steps {} --decay-start {}".format(t["steps"], t["decay_start"]) in metrics["reproduce"]


def test_bf16_autocast_training_step_runs():
    """The GPU recipe's precision path (bf16 autocast; fp32 selection and GLA inside), on CPU."""
    cfg = preset_config("tiny")
    model = TrainModel(cfg, dropout=0.1)
    model.init_weights(0)
    ids = torch.randint(3, cfg.vocab_size, (2, 301), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fp32 = model.eval().loss(ids[:, :-1], ids[:, 1:]).item()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16 = model.loss(ids[:, :-1], ids[:, 1:]).item()
    assert bf16 == pytest.approx(fp32, rel=0.02)
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model.loss(ids[:, :-1], ids[:, 1:])
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_schedule_warmup_stable_decay():
    s = train_small.Schedule(warmup=4, decay_start=10, total=20)
    assert [s.factor(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s.factor(9) == 1.0 and s.factor(15) == 0.5 and s.factor(20) == 0.0


# ---- (c) evaluation -------------------------------------------------------------------------


def test_completion_scoring():
    src = ('class A:\n'
           '    def f(self, x):\n'
           '        """Doc."""\n'
           '        y = x + 1\n'
           '\n'
           '        z = y * 2\n'
           '        return z\n'
           '\n'
           'def g():\n'
           '    """Doc."""\n'
           '    return 1\n')
    (case,) = eval_small.find_functions("/nowhere/mod.py", src)  # g has too short a body
    assert case.name == "A.f" and case.lineno == 2 and case.indent == 4
    assert case.prompt.endswith('"""Doc."""') and case.body == ["        y = x + 1", "        z = y * 2",
                                                                 "        return z"]
    assert case.self_contained
    perfect = "\n        y = x + 1\n\n        z = y * 2\n        return z\n\n    def h(self):\n"
    s = eval_small.score_case(case, perfect, truncated=False)
    assert s["next_line_exact"] and s["first3_exact"] and s["body_exact"] and s["body_parses"]
    s = eval_small.score_case(case, "\n        y = x + 1\n        return (y\n", truncated=False)
    assert s["next_line_exact"] and not s["first3_exact"] and not s["body_parses"]
    # a line cut by the token limit is dropped
    s = eval_small.score_case(case, "\n        y = x + 1\n        z = y *", truncated=True)
    assert s["body_parses"] and not s["first3_exact"]
    assert not eval_small.is_self_contained(eval_small.ast.parse("def f(a):\n    return os.path(a)\n").body[0])


def test_eval_end_to_end_on_tiny_random_checkpoint(tiny_model_dir):
    result = eval_small.evaluate(tiny_model_dir, device="cpu", ctx=96, n_functions=2, max_new_tokens=8,
                                 max_train_files=2, max_heldout_files=4, max_tokens_per_file=150)
    ppl = result["perplexity"]
    assert ppl["tokens"] > 100 and ppl["nats_per_token"] > 0 and ppl["unigram_nats_per_token"] > 0
    assert ppl["ppl"] == pytest.approx(2.718281828 ** ppl["nats_per_token"])
    comp = result["completion"]
    assert comp["n"] == 2 and comp["backend"] == "torch" and comp["device"] == "cpu"
    assert all(d["completion_tokens"] >= 1 and d["prompt_tokens"] <= 96 - 8 for d in comp["details"])
    assert set(comp) >= {"next_line_exact", "first3_exact", "body_exact", "body_parses"}


def test_guard_loss_matches_training_forward(tiny_model_dir):
    from tools.small_data import load_tokenizer

    guard = eval_small.make_guard(tiny_model_dir, load_tokenizer(tiny_model_dir), n_files=2, n_tokens=140)
    assert len(guard["token_ids"]) == 2 and all(len(s) == 141 for s in guard["token_ids"])
    model = eval_small.load_train_model(tiny_model_dir, "cpu")
    ids = torch.tensor(guard["token_ids"])
    with torch.no_grad():
        loss = model.loss(ids[:, :-1], ids[:, 1:]).item()
    assert loss == pytest.approx(guard["nats_per_token"], abs=1e-4)
    assert [len(g["tokens"]) for g in guard["greedy"]] == [12, 12]
    assert all(g["prompt_tokens"] == 141 for g in guard["greedy"])  # capped by the sample length


# ---- (d) the shipped model ------------------------------------------------------------------


@pytest.mark.skipif(not os.path.isfile(os.path.join(DEFAULT_MODEL, "config.json")),
                    reason="no trained default model in salaserve/assets/default_model")
def test_shipped_default_model_guard_loss():
    """Guards the loader and the reference kernels: the recorded loss on a fixed token sample."""
    metrics = json.loads(open(os.path.join(DEFAULT_MODEL, "metrics.json"), encoding="utf-8").read())
    assert os.path.getsize(os.path.join(DEFAULT_MODEL, "model.safetensors")) <= train_small.MAX_CHECKPOINT_BYTES
    guard = metrics["guard"]
    loss = eval_small.reference_loss(DEFAULT_MODEL, guard["token_ids"])
    assert loss == pytest.approx(guard["nats_per_token"], rel=0.05)
    # and it is a trained model: far below the uniform log(vocab)
    assert loss < 0.6 * torch.log(torch.tensor(float(metrics["config"]["vocab_size"]))).item()


@pytest.mark.skipif(not os.path.isfile(os.path.join(DEFAULT_MODEL, "config.json")),
                    reason="no trained default model in salaserve/assets/default_model")
def test_shipped_default_model_engine_greedy():
    """The engine (torch backend, CPU, fp32) continues the guard prompts as the reference did
    when the model was trained, up to the first step whose top-2 margin was too small to matter."""
    from salaserve.core.sampling_params import SamplingParams
    from salaserve.engine.llm import LLM

    guard = json.loads(open(os.path.join(DEFAULT_MODEL, "metrics.json"), encoding="utf-8").read())["guard"]
    llm = LLM(DEFAULT_MODEL, device="cpu", dtype="float32", backend="torch", max_total_tokens=8192)
    prompts = [ids[:g["prompt_tokens"]] for ids, g in zip(guard["token_ids"], guard["greedy"])]
    n = len(guard["greedy"][0]["tokens"])
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True))
    compared = 0
    for out, g in zip(outs, guard["greedy"]):
        k = next((i for i, m in enumerate(g["margins"]) if m < 1e-3), n)
        assert out.token_ids[:k] == g["tokens"][:k]
        compared += k
    assert compared >= n  # the check compared something


def test_engine_matches_reference_on_small_shape(tmp_path):
    """The serving engine (torch backend, CPU) on the shipped model's shape, dense and sparse."""
    from salaserve.core.sampling_params import SamplingParams
    from salaserve.engine.llm import LLM
    from salaserve.model.checkpoint import write_checkpoint

    cfg = write_checkpoint(str(tmp_path), preset_config("small"), seed=0)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", backend="torch", max_total_tokens=4096)
    ref = ReferenceModel.from_pretrained(str(tmp_path), dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    for length in (200, 450):  # below dense_len 256; past the 384-token selection span
        prompt = torch.randint(3, cfg.vocab_size - 8, (length,), generator=g).tolist()
        out = llm.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True))[0]
        state = ref.new_state()
        logits = ref.forward(prompt, state)[-1]
        want = []
        for _ in range(5):
            want.append(int(logits.argmax()))
            logits = ref.forward([want[-1]], state)[-1]
        assert out.token_ids == want


# ---- (e) extra training data ----------------------------------------------------------------

MODULE = '''
import os


def join_parts(head, *tail, sep="/"):
    """Join path parts with a separator.

    More details that are not part of the request.
    """
    return sep.join([head, *tail])


def undocumented(x):
    return x


def _private(x):
    """Private helpers are not requests a user would make."""
    return x


class Holder:
    def method(self):
        """Methods are left out: their source needs the class around it."""
        return 1
'''


def test_function_examples_ask_for_documented_public_functions():
    (pair,) = small_data.function_examples(MODULE)
    request, answer = pair
    assert "join_parts(head, *tail, sep='/')" in request or "`join_parts`" in request
    assert "join path parts with a separator." in request.lower()
    assert "More details" not in request
    assert answer.startswith("```python\n") and answer.endswith("\n```")
    code = answer[len("```python\n"):-len("\n```")]
    (fn,) = ast.parse(code).body
    assert fn.name == "join_parts" and code in MODULE
    assert small_data.function_examples("def broken(:\n") == []


def test_rendered_exchange_is_the_chat_template():
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    request, answer = small_data.function_examples(MODULE)[0]
    want = tok.apply_chat_template([{"role": "user", "content": request}, {"role": "assistant", "content": answer}],
                                   tokenize=False)
    assert want == tok.bos_token + small_data.render(request, answer)
    # serving's generation prompt is a prefix of the trained exchange
    prompt = tok.apply_chat_template([{"role": "user", "content": request}], tokenize=False, add_generation_prompt=True)
    assert want.startswith(prompt)


def test_chat_texts_are_capped_and_deterministic():
    texts = [MODULE, MODULE.replace("join_parts", "glue_parts")]
    got = small_data.chat_texts(texts, 5)
    assert len(got) == 2 and got == small_data.chat_texts(list(reversed(texts)), 5)
    assert len(small_data.chat_texts(texts, 1)) == 1


def test_chat_answer_check():
    assert eval_small.chat_answer_ok("gcd", "Sure.\n```python\ndef gcd(a, b):\n    return a\n```")
    assert not eval_small.chat_answer_ok("gcd", "```python\ndef lcm(a, b):\n    return a\n```")
    assert not eval_small.chat_answer_ok("gcd", "```python\ndef gcd(a, b:\n```")
    assert not eval_small.chat_answer_ok("gcd", "def gcd(a, b):\n    return a\n")


def test_corpus_filters_copies_data_and_tests(tmp_path):
    stdlib_file = next(p for p in stdlib_corpus_files("heldout") if len(read_corpus_file(p)) > 4000)
    stdlib = small_data.stdlib_lines()
    assert not small_data.keep_file(read_corpus_file(stdlib_file), stdlib)  # a copy of held-out code
    assert not small_data.keep_file("TABLE = [\n" + "    " + "1, " * 200 + "\n]\n", stdlib)  # data
    assert small_data.keep_file(MODULE, stdlib)

    pkg = tmp_path / "pkg"
    for rel in ("__init__.py", "core.py", "tests/test_core.py", "_vendor/six.py", "sub/util.py"):
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(MODULE)
    (pkg / "big.py").write_text("x = 1\n" * (small_data.MAX_FILE_BYTES // 6 + 1))
    rels = [os.path.relpath(p, pkg) for p in small_data.package_files(str(pkg))]
    assert rels == ["__init__.py", "core.py", os.path.join("sub", "util.py")]


def test_corpus_round_trip_and_training_texts(tmp_path, monkeypatch):
    monkeypatch.setattr(small_data, "stdlib_lines", lambda: set())  # the stdlib scan is slow; filters tested above
    pytest.importorskip("click")
    docs, manifest = small_data.collect(10**6, ["click"])
    assert docs and manifest["files"] == len(docs) and manifest["bytes"] <= 10**6 * len(manifest["packages"])
    assert all(m["licence"] for m in manifest["packages"].values())
    path = str(tmp_path / "c.jsonl.xz")
    small_data.write_corpus(path, docs)
    assert small_data.read_corpus(path) == docs

    stdlib_files = stdlib_corpus_files("train")[:3]
    texts, comp = train_small.training_texts(stdlib_files, 2, path, 4)
    assert comp == {"stdlib_files": 3, "stdlib_repeat": 2, "extra_files": len(docs),
                    "chat_examples": len(texts) - 6 - len(docs)}
    assert 0 < comp["chat_examples"] <= 4
    assert texts[:3] == texts[3:6] == [read_corpus_file(p) for p in stdlib_files]
    assert all(t.startswith("<|im_start|>user\n") for t in texts[6 + len(docs):])
