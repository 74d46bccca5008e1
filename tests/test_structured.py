"""Structured output (json_schema / regex / ebnf / structural_tag through xgrammar) in the engine,
offline API and server: every finished output belongs to its grammar, bad grammars are a ValueError / 400 naming
the field, and constrained requests are never speculated."""

import json
import re

import pytest

from salaserve.core.sampling_params import SamplingParams as P
from salaserve.engine.engine import Engine
from salaserve.engine.llm import LLM

pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["color", "n"], "additionalProperties": False}
PROMPTS = ["The answer is", "def f():", "Colors:", "x"]


@pytest.fixture(scope="module")
def llm():
    return LLM(None, device="cpu", dtype="float32", backend="torch")  # the trained default model


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_outputs_belong_to_their_grammar(llm, temperature):
    cases = [
        (P(regex=r"(yes|no|maybe)"), lambda t: re.fullmatch(r"yes|no|maybe", t)),
        (P(regex=r"[0-9]{3}-[a-z]{2,4}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
        (P(json_schema=json.dumps(SCHEMA)),
         lambda t: (lambda d: set(d) == {"color", "n"} and d["color"] in ("red", "green", "blue")
                    and 0 <= d["n"] <= 99)(json.loads(t))),
        (P(ebnf='root ::= "A" ("b" | "c")+ "."'), lambda t: re.fullmatch(r"A[bc]+\.", t)),
    ]
    for params, ok in cases:
        params.temperature, params.max_new_tokens, params.n = temperature, 60, 2
        for out in llm.generate(PROMPTS, params):
            assert out.finish_reason["type"] == "stop", (params, out.text, out.finish_reason)
            assert ok(out.text), (params, out.text)


def test_grammar_decides_where_the_output_ends(llm):
    """min_new_tokens does not hold back the stop token a complete grammar allows (all its other
    tokens are masked: the row would have nothing left to sample)."""
    out = llm.generate("x", P(regex="ab", min_new_tokens=10, max_new_tokens=20, temperature=0.0))[0]
    assert out.text == "ab" and out.finish_reason["type"] == "stop" and len(out.token_ids) < 10


def test_structural_tags_constrain_what_follows_a_trigger(llm):
    """SGLang's structural_tag: free text, but after each trigger the tagged structure (begin, a
    JSON value of its schema, end); also xgrammar's newer format."""
    tag = {"structures": [{"begin": " = ", "schema": {"type": "integer", "minimum": 0, "maximum": 999}, "end": "\n"}],
           "triggers": [" = "]}
    seen = 0
    for out in llm.generate(PROMPTS, P(structural_tag=json.dumps(tag), temperature=0.0, max_new_tokens=40)):
        for m in re.finditer(" = ", out.text):
            seen += 1
            assert re.match(r"\d{0,3}(\n|$)", out.text[m.end():]), out.text  # (the text may end inside one)
    assert seen >= 2  # (the default model writes assignments)
    newer = {"type": "structural_tag", "format": {"type": "tag", "begin": "<a>", "end": "</a>",
                                                  "content": {"type": "json_schema", "json_schema": {"type": "integer"}}}}
    out = llm.generate("x", P(structural_tag=json.dumps(newer), temperature=0.0, max_new_tokens=20))[0]
    assert re.fullmatch(r"<a>-?\d+</a>", out.text), out.text


def test_bad_grammars_name_their_field(llm):
    for params, field in [(P(regex="(unclosed"), "regex"), (P(json_schema="{not json"), "json_schema"),
                          (P(json_schema='{"type": "nonsense"}'), "json_schema"),
                          (P(ebnf="root ::= undefined_rule"), "ebnf"), (P(structural_tag="{no"), "structural_tag"),
                          (P(structural_tag='{"structures": 3, "triggers": []}'), "structural_tag"),
                          (P(structural_tag='{"type": "nonsense"}'), "structural_tag")]:
        with pytest.raises(ValueError, match=rf"^sampling_params\.{field}: "):
            llm.generate("x", params)
    # the engine keeps serving
    assert llm.generate("x", P(regex="ok", max_new_tokens=5))[0].text == "ok"


def test_constrained_requests_are_not_speculated(tiny_model_dir):
    from test_spec import OracleDrafter  # drafts of an unconstrained continuation

    eng = Engine(model=tiny_model_dir, device="cpu", dtype="float32", backend="torch", chunked_prefill_size=64,
                 speculative_algorithm="NGRAM", speculative_num_draft_tokens=6, speculative_max_batch=8)
    eng.make_drafter = lambda req: OracleDrafter(req.num_prompt, [7] * 50)
    eng.add_request("g", [5, 6, 7, 8, 9], P(temperature=0.0, max_new_tokens=30, regex=r"[a-z]{1,8}!"))
    text_ids = []
    while eng.has_unfinished():
        for o in eng.step():
            text_ids += o.new_token_ids
    assert eng.stats["spec_verify_steps"] == 0
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(tiny_model_dir).decode(text_ids, skip_special_tokens=True)
    assert re.fullmatch(r"[a-z]{1,8}!", text), text


def test_cli_generate_with_a_regex(capsys):
    from salaserve.cli import main

    assert main(["generate", "--prompt", "Code: ", "--regex", "[A-Z]{2}-[0-9]{2}", "--device", "cpu",
                 "--dtype", "float32", "--backend", "torch", "--max-new-tokens", "20"]) == 0
    printed = capsys.readouterr().out
    assert re.fullmatch(r"Code: [A-Z]{2}-[0-9]{2}\n", printed), printed
    assert main(["generate", "--prompt", "x", "--regex", "(", "--device", "cpu", "--backend", "torch"]) == 2
    assert "sampling_params.regex" in capsys.readouterr().err


def test_stop_regex_ends_at_the_token_that_completes_a_match(llm):
    """SGLang's stop_regex: the output stops at the first token whose text completes a match (its
    text kept whole, finish reason matched = the pattern); text before that token has no match."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llm.engine.model_dir)
    for pattern in (r"[aeiou]{2}", r"\s\w+\s"):
        for out in llm.generate(PROMPTS, P(stop_regex=[pattern, "zzzz"], temperature=0.0, max_new_tokens=60)):
            if out.finish_reason["type"] == "length":  # no match in 60 tokens: none anywhere
                assert not re.search(pattern, out.text)
                continue
            assert out.finish_reason == {"type": "stop", "matched": pattern}, out.finish_reason
            assert re.search(pattern, out.text) and out.text == tok.decode(out.token_ids, skip_special_tokens=True)
            assert not re.search(pattern, tok.decode(out.token_ids[:-1], skip_special_tokens=True))
