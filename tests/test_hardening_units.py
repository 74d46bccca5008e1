"""Issue 43's pieces that need no running server: the prompt-length bound from the tokenizer's
vocabulary, the API-key middleware's open paths, fair admission in the engine, and the
evaluation tools' --trust-remote-code."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from salaserve.core.sampling_params import SamplingParams
from salaserve.server.auth import ApiKeyMiddleware
from salaserve.server.tokenization import load_tokenizer, max_chars_per_token


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


# ---- the character bound -----------------------------------------------------------------------------------
def test_the_tiny_tokenizers_bound_is_its_longest_entry(tiny_tokenizer):
    assert max_chars_per_token(tiny_tokenizer) == max(len(t) for t in tiny_tokenizer.get_vocab())


TEXTS = st.text(st.characters(codec="utf-8"), max_size=400) | st.text(" \n\t-#=ab", max_size=2000)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXTS)
def test_no_text_has_more_characters_than_its_tokens_can_spell(tiny_tokenizer, text):
    """The soundness of the cap: tokens >= characters / max_chars_per_token, for any text."""
    per_token = max_chars_per_token(tiny_tokenizer)
    ids = tiny_tokenizer(text, add_special_tokens=False).input_ids
    assert len(text) <= len(ids) * per_token


def test_a_tokenizer_that_may_drop_characters_gets_no_bound():
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "a": 1, "b": 2, "ab": 3}

    def fast(tok):
        return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")

    bpe = Tokenizer(models.BPE(vocab, [("a", "b")], unk_token="[UNK]"))
    assert max_chars_per_token(fast(bpe)) == 5  # ("[UNK]": an over-count, which is safe)
    stripping = Tokenizer(models.BPE(vocab, [("a", "b")], unk_token="[UNK]"))
    stripping.normalizer = normalizers.Strip()  # "   ab   " -> one token
    assert max_chars_per_token(fast(stripping)) is None
    splitting = Tokenizer(models.BPE(vocab, [("a", "b")], unk_token="[UNK]"))
    splitting.pre_tokenizer = pre_tokenizers.Whitespace()  # drops the whitespace
    assert max_chars_per_token(fast(splitting)) is None
    fusing = Tokenizer(models.BPE(vocab, [("a", "b")], unk_token="[UNK]", fuse_unk=True))  # "xyz..." -> one [UNK]
    assert max_chars_per_token(fast(fusing)) is None
    assert max_chars_per_token(fast(Tokenizer(models.WordPiece(vocab, unk_token="[UNK]")))) is None


# ---- API key: which paths are open -------------------------------------------------------------------------------
def app_with_key(**kw):
    routes = [Route(p, lambda request: PlainTextResponse("ok"))
              for p in ("/health", "/ping", "/health_generate", "/metrics", "/generate", "/healthy")]
    return TestClient(ApiKeyMiddleware(Starlette(routes=routes), api_key="k", admin_api_key="adm", **kw))


def test_only_the_probes_are_open_and_metrics_only_by_flag():
    client = app_with_key()
    for path in ("/health", "/ping"):
        assert client.get(path).status_code == 200
    for path in ("/health_generate", "/metrics", "/generate", "/healthy"):
        assert client.get(path).status_code == 401
        assert client.get(path, headers={"authorization": "Bearer k"}).status_code == 200
        assert client.get(path, headers={"authorization": "Bearer adm"}).status_code == 200
        assert client.get(path, headers={"authorization": "Bearer kk"}).status_code == 401
    open_metrics = app_with_key(metrics_no_auth=True)
    assert open_metrics.get("/metrics").status_code == 200
    assert open_metrics.get("/health_generate").status_code == 401


# ---- fair admission ------------------------------------------------------------------------------------------------
def test_a_later_requests_first_sequence_is_admitted_before_an_earlier_requests_later_ones(tiny_model_dir):
    from salaserve.engine.engine import Engine

    engine = Engine(model=tiny_model_dir, device="cpu", dtype="float32", backend="torch", max_running_requests=2)
    params = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    for rank in range(4):  # one client's request: 4 sequences
        engine.add_request(f"big-{rank}", [1, 5, 6, 7], params, share_rank=rank)
    engine.add_request("small", [1, 8, 9], params, share_rank=0)  # another client's, after it
    engine.step()
    assert {r.rid for r in engine.scheduler.running} == {"big-0", "small"}
    finished = []
    while engine.has_unfinished():
        finished += [o.rid for o in engine.step() if o.finished]
    assert finished.index("small") < finished.index("big-1")
    with pytest.raises(ValueError, match="share_rank"):
        engine.add_request("bad", [1, 2], params, share_rank=-1)


# ---- evaluation tools: no remote code unless asked ------------------------------------------------------------------
def test_evaluation_tools_load_tokenizers_without_remote_code_by_default(monkeypatch, tmp_path):
    import transformers

    from salaserve.bench import cli as bench_cli
    from salaserve.bench import workload
    from salaserve.bench.runner import RunConfig
    from salaserve.evaluation import cli as eval_cli
    from salaserve.evaluation.client import load_stop_words

    seen = []

    class Refused(Exception):
        pass

    def from_pretrained(path, **kw):
        seen.append(kw.get("trust_remote_code"))
        raise Refused()

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    for call in (lambda: load_stop_words(str(tmp_path)),
                 lambda: eval_cli.make_synthetic_main(["--out", str(tmp_path / "o"), "--model", str(tmp_path),
                                                       "--lengths", "8", "--per-task", "1"]),
                 lambda: workload.main(["--workload", workload.WORKLOADS[0], "--model", str(tmp_path),
                                        "--out", str(tmp_path / "w")])):
        with pytest.raises(Refused):
            call()
    assert seen == [False, False, False]
    with pytest.raises(Refused):
        load_stop_words(str(tmp_path), trust_remote_code=True)
    assert seen[-1] is True
    assert RunConfig(out=tmp_path).trust_remote_code is False
    assert eval_cli._eval_parser().parse_args(["--data", "d", "--trust-remote-code"]).trust_remote_code
    assert not eval_cli._eval_parser().parse_args(["--data", "d"]).trust_remote_code
    run_args = ["--workload", "toy", "--url", "http://127.0.0.1:1"]
    assert not bench_cli._run_parser().parse_args(run_args).trust_remote_code
    assert bench_cli._run_parser().parse_args([*run_args, "--trust-remote-code"]).trust_remote_code
