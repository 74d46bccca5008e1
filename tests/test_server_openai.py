"""The official `openai` client against `salaserve serve`: chat and completions, streamed and
not, stop strings, n=2, logprobs, usage, chat_template_kwargs."""

import openai
import pytest


@pytest.fixture(scope="module")
def oai(tiny_server):
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(oai, tiny_model_dir):
    models = oai.models.list().data
    assert [m.id for m in models] == [tiny_model_dir]
    return models[0].id


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir, trust_remote_code=False)


MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colors."}]


def test_chat(oai, model, tokenizer):
    r = oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=10, temperature=0)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("length", "stop")
    # the prompt is the chat template's rendering, tokenized without extra special tokens
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert r.usage.prompt_tokens == len(tokenizer(rendered, add_special_tokens=False).input_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    no_think = oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, temperature=0,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True,
                                             enable_thinking=False)
    assert no_think.usage.prompt_tokens == len(tokenizer(rendered, add_special_tokens=False).input_ids)
    assert no_think.usage.prompt_tokens > r.usage.prompt_tokens

    # streamed: role chunk, content deltas, a finish chunk, the usage chunk; same text as unstreamed
    full = oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True})
    chunks = list(oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, temperature=0,
                                              stream=True, stream_options={"include_usage": True},
                                              extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_chat_stop_n_and_logprobs(oai, model):
    full = oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=16, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].message.content
    stop = full[len(full) // 2:len(full) // 2 + 3]
    if stop.strip():
        r = oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=16, temperature=0, stop=[stop])
        assert r.choices[0].finish_reason == "stop"
        assert r.choices[0].message.content == full[:full.index(stop)]
        streamed = oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=16, temperature=0,
                                               stop=stop, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == full[:full.index(stop)]

    r = oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6, temperature=1.0, seed=3, n=2,
                                    extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.choices[0].message.content != r.choices[1].message.content
    assert r.usage.completion_tokens == 12

    chunks = list(oai.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=5, n=2,
                                              temperature=0.7, seed=5, stream=True,
                                              extra_body={"ignore_eos": True, "top_k": 50, "min_p": 0.01,
                                                          "repetition_penalty": 1.1},
                                              frequency_penalty=0.5, presence_penalty=0.2))
    roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"]
    finals = [(c.choices[0].index, c.choices[0].finish_reason) for c in chunks if c.choices[0].finish_reason]
    assert sorted(roles) == [0, 1] and sorted(finals) == [(0, "length"), (1, "length")]

    r = oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True,
                                    top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


def test_completions(oai, model, tokenizer):
    prompt = "def fibonacci(n):"
    r = oai.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0,
                               extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 10
    assert r.usage.prompt_tokens == len(tokenizer(prompt).input_ids)  # BOS + text
    text = r.choices[0].text

    streamed = list(oai.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0, stream=True,
                                           stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text
    assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == "length"
    assert streamed[-1].usage.completion_tokens == 10

    stop = text[len(text) // 2:len(text) // 2 + 3]
    if stop.strip():
        s = oai.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0, stop=stop)
        assert s.choices[0].finish_reason == "stop" and s.choices[0].text == text[:text.index(stop)]

    batch = oai.completions.create(model=model, prompt=["a b", "c d e"], max_tokens=3, n=2, temperature=0.9,
                                   seed=11, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    assert batch.usage.completion_tokens == 12
    assert batch.usage.prompt_tokens == len(tokenizer("a b").input_ids) + len(tokenizer("c d e").input_ids)

    lp = oai.completions.create(model=model, prompt=prompt, max_tokens=3, temperature=0, logprobs=2,
                                echo=True, extra_body={"ignore_eos": True})
    assert lp.choices[0].text.startswith(prompt)
    n_prompt = len(tokenizer(prompt).input_ids)  # echo: the prompt's tokens first (BOS included)
    assert len(lp.choices[0].logprobs.token_logprobs) == n_prompt + 3
    assert lp.choices[0].logprobs.top_logprobs[0] is None and len(lp.choices[0].logprobs.top_logprobs[-1]) == 2
    offsets = lp.choices[0].logprobs.text_offset  # into the returned text, which starts with the prompt
    assert offsets == sorted(offsets) and offsets[n_prompt] == len(prompt)
    assert all(lp.choices[0].text[o:].startswith(t) for o, t in zip(offsets[1:], lp.choices[0].logprobs.tokens[1:]))

    ids = oai.completions.create(model=model, prompt=tokenizer(prompt).input_ids, max_tokens=10, temperature=0,
                                 extra_body={"ignore_eos": True})
    assert ids.choices[0].text == text

    # echo + logprobs (how evaluation harnesses score a continuation): the prompt tokens' logprobs
    # first, the first one null, then the completion's
    ctx = tokenizer(prompt).input_ids
    scored = oai.completions.create(model=model, prompt=ctx, max_tokens=1, temperature=0, logprobs=1, echo=True)
    lps = scored.choices[0].logprobs
    assert len(lps.token_logprobs) == len(lps.tokens) == len(lps.top_logprobs) == len(ctx) + 1
    assert lps.token_logprobs[0] is None and lps.top_logprobs[0] is None
    assert all(v <= 0 for v in lps.token_logprobs[1:]) and all(len(t) == 1 for t in lps.top_logprobs[1:])
    assert scored.choices[0].text.startswith(tokenizer.decode(ctx, skip_special_tokens=True))
    streamed = list(oai.completions.create(model=model, prompt=ctx, max_tokens=1, temperature=0, logprobs=1,
                                           echo=True, stream=True))
    chunk_lps = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert [v for c in chunk_lps for v in c.token_logprobs] == lps.token_logprobs

    # logit_bias: token ids as strings, OpenAI's -100..100; +100 on one token makes it the greedy choice
    favoured = tokenizer(" banana", add_special_tokens=False).input_ids[0]
    biased = oai.completions.create(model=model, prompt=prompt, max_tokens=3, temperature=0,
                                    logit_bias={str(favoured): 100}, extra_body={"ignore_eos": True})
    assert biased.choices[0].text == tokenizer.decode([favoured] * 3)
    assert biased.usage.completion_tokens == 3


def test_response_format(oai, model):
    """OpenAI's response_format: json_schema and json_object constrain the chat output to JSON."""
    import json

    schema = {"type": "object", "properties": {"colors": {"type": "array", "items": {"enum": ["red", "blue"]},
                                                          "maxItems": 3}}, "required": ["colors"],
              "additionalProperties": False}
    r = oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=60, temperature=0.8,
                                    response_format={"type": "json_schema",
                                                     "json_schema": {"name": "colors", "schema": schema}})
    assert r.choices[0].finish_reason == "stop"
    assert set(json.loads(r.choices[0].message.content)) == {"colors"}
    r = oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=200, temperature=0,
                                    response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":  # (an object may not close within max_tokens)
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=5, response_format={"type": "xml"})


def test_stop_regex_as_an_extra_field(oai, model):
    """SGLang's stop_regex through the OpenAI route's extra fields: the completion ends at the
    token completing a match (finish_reason stop, the text kept whole); a bad pattern is a 400."""
    import re

    r = oai.completions.create(model=model, prompt="def f():", max_tokens=60, temperature=0,
                               extra_body={"stop_regex": r"\s\w+\s"})
    assert r.choices[0].finish_reason == "stop" and re.search(r"\s\w+\s", r.choices[0].text)
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=model, prompt="x", max_tokens=5, extra_body={"stop_regex": "("})


def test_a_second_chat_turn_reuses_the_first(oai, model, tiny_server):
    """The chat template renders a conversation's earlier turns as they were, so the second
    turn's prompt extends the first one's and starts from its cached caches (the server's
    engine_cached_prompt_tokens grows by at least the first prompt's length)."""
    messages = [{"role": "system", "content": "You answer briefly. " * 60}, {"role": "user", "content": "Hi?"}]
    first = oai.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens >= 256  # (the prefix cache's default minimum)
    before = tiny_server.server_info()["internal_states"][0]["engine_cached_prompt_tokens"]
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "Why?"}]
    oai.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0)
    after = tiny_server.server_info()["internal_states"][0]["engine_cached_prompt_tokens"]
    assert after - before >= first.usage.prompt_tokens


def test_errors_reach_the_client(oai, model):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=[], max_tokens=4)
    assert e.value.status_code == 400
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=model, prompt="x", max_tokens=4, temperature=-1)
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=10**9)
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("no-such-model")
