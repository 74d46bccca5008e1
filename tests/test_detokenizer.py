"""IncrementalDetokenizer and StopStringMatcher on a small byte-level BPE trained in the test."""

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from salaserve.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher

FFFD = "\ufffd"
SPECIALS = ["<s>", "</s>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Streaming text, one token at a time!",
    "今天天气很好，我们去公园散步吧。你好，世界！中文分词测试。",
    "emoji time 😀 🎉 👍 and a family 👨‍👩‍👧 with flags 🇫🇷 done",
    "def f(x):\n    return x * 2  # code too\n",
]
# Characters the tokenizer rarely or never saw: they come out as 1-byte pieces.
POOL = list("abcdefghij klmnop.,!?\n") + list("你好世界天气很好中文漢字龍鳳")
POOL += ["😀", "🎉", "🦀", "👍🏽", "👨‍👩‍👧", "é", "ß", "€"]


@pytest.fixture(scope="module")
def tok():
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(CORPUS * 10, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", additional_special_tokens=["<|im_end|>"]
    )


def random_text(rng, n=80):
    return "".join(rng.choice(POOL) for _ in range(n))


def stream(detok, ids, rng=None):
    """Feed ids one at a time (or in random chunks); return the list of deltas incl. flush."""
    deltas, i = [], 0
    while i < len(ids):
        k = 1 if rng is None else rng.randint(1, 4)
        deltas.append(detok.add(ids[i : i + k]))
        i += k
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize(
    "text",
    [
        "Hello, streaming world! The lazy dog sleeps.",
        "你好，世界！漢字和龍鳳不在语料里。",
        "emoji 😀🦀 👍🏽 👨‍👩‍👧 🇫🇷 end",
        "mixed: café 中文 🎉!",
    ],
)
def test_token_by_token_matches_full_decode(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    detok = IncrementalDetokenizer(tok)
    deltas = stream(detok, ids)
    assert "".join(deltas) == text and detok.text == text
    assert all(FFFD not in d for d in deltas)
    assert deltas[-1] == ""  # nothing was left for flush


def test_multibyte_pieces_are_held_back(tok):
    ids = tok.encode("龍🦀")
    assert len(ids) > 2  # unseen characters split into byte pieces
    deltas = stream(IncrementalDetokenizer(tok), ids)
    assert "" in deltas[:-1] and "".join(deltas) == "龍🦀"


def test_random_text_random_chunks(tok):
    rng = random.Random()
    for _ in range(20):
        text = random_text(rng)
        ids = tok.encode(text)
        detok = IncrementalDetokenizer(tok)
        deltas = stream(detok, ids, rng)
        assert "".join(deltas) == tok.decode(ids) == text
        assert all(FFFD not in d for d in deltas)


def test_special_tokens(tok):
    bos, eos, im_end = (tok.convert_tokens_to_ids(t) for t in SPECIALS)
    ids = [bos] + tok.encode("你好 world") + [im_end] + tok.encode(" 😀") + [eos]
    skipped = "".join(stream(IncrementalDetokenizer(tok), ids))
    assert skipped == tok.decode(ids, skip_special_tokens=True) == "你好 world 😀"
    kept = "".join(stream(IncrementalDetokenizer(tok, skip_special_tokens=False), ids))
    assert kept == tok.decode(ids, skip_special_tokens=False) == "<s>你好 world<|im_end|> 😀</s>"


def test_flush_emits_incomplete_tail(tok):
    ids = tok.encode("ok 🦀")
    detok = IncrementalDetokenizer(tok)
    streamed = [detok.add([t]) for t in ids[:-1]]
    assert all(FFFD not in d for d in streamed)
    tail = detok.flush()
    assert tail.endswith(FFFD)
    assert detok.text == tok.decode(ids[:-1])


def test_context_ids(tok):
    prompt, out = tok.encode("Once upon a time,"), tok.encode(" 你好 🎉 there")
    detok = IncrementalDetokenizer(tok, context_ids=prompt)
    text = "".join(stream(detok, out))
    assert text == tok.decode(prompt + out)[len(tok.decode(prompt)) :]
    assert detok.token_ids == out


def test_decode_window_is_bounded(tok):
    lengths = []

    class Spy:
        def decode(self, ids, **kw):
            lengths.append(len(ids))
            return tok.decode(ids, **kw)

    rng = random.Random()
    ids = tok.encode(random_text(rng, 3000))
    detok = IncrementalDetokenizer(Spy())
    assert "".join(stream(detok, ids)) == tok.decode(ids)
    assert len(ids) > 1000 and max(lengths) <= 16


# --- stop strings ---------------------------------------------------------------------------


def feed_all(matcher, deltas):
    out = [matcher.feed(d) for d in deltas]
    if not matcher.stopped:
        out.append(matcher.flush())
    return out


def test_stop_split_across_deltas():
    m = StopStringMatcher(["STOP"])
    out = feed_all(m, ["Hello wo", "rld, ST", "O", "P here", "more"])
    assert out[:3] == ["Hello wo", "rld, ", ""]
    assert "".join(out) == m.text == "Hello world, "
    assert m.stopped and m.matched == "STOP"
    assert m.feed("anything") == ""


def test_no_stop_trim_keeps_stop():
    m = StopStringMatcher(["</answer>"], no_stop_trim=True)
    assert "".join(feed_all(m, ["42</an", "swer>tail"])) == "42</answer>"


def test_held_back_text_released_when_not_a_stop():
    m = StopStringMatcher(["STOP", "结束了"])
    assert m.feed("go ST") == "go "
    assert m.feed("ART 结") == "START "
    assert m.feed("束") == ""
    assert m.feed("吧") == "结束吧"
    assert m.feed("ST") == ""
    assert m.flush() == "ST"
    assert not m.stopped and m.text == "go START 结束吧ST"


def test_earliest_stop_wins():
    m = StopStringMatcher(["bar", "foo bar", "oo"])
    assert "".join(feed_all(m, ["x f", "oo bar"])) == "x "
    assert m.matched == "foo bar"  # starts before "oo" and "bar"
    m = StopStringMatcher(["ab", "a"])
    assert "".join(feed_all(m, ["xab"])) == "x" and m.matched == "ab"  # same start: list order


def _reference_stop(text, stops, no_trim):
    hits = [(text.find(s), k, s) for k, s in enumerate(stops) if s in text]
    if not hits:
        return text, None
    pos, _, s = min(hits)
    return text[: pos + len(s)] if no_trim else text[:pos], s


def test_random_streams_match_reference():
    rng = random.Random()
    alphabet = "ab c"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        word = lambda n: "".join(rng.choice(alphabet) for _ in range(n))  # noqa: E731
        stops = [word(rng.randint(1, 4)) for _ in range(rng.randint(1, 3))]
        no_trim = rng.random() < 0.5
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 8))))
        deltas = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        m = StopStringMatcher(stops, no_stop_trim=no_trim)
        released = ""
        for d in deltas:
            released += m.feed(d)
            if not m.stopped:  # never releases a stop string (or its start) early
                assert not any(s in released for s in stops)
        if not m.stopped:
            released += m.flush()
        # Streaming stops at the first delta after which some stop string is complete.
        acc = ""
        for d in deltas:
            acc += d
            if any(s in acc for s in stops):
                break
        want, matched = _reference_stop(acc, stops, no_trim)
        assert (released, m.matched) == (want, matched), (text, stops, deltas)
        assert m.text == released


def test_detokenizer_and_stop_together(tok):
    text = "答案是 42 🎉</answer> and more text"
    ids = tok.encode(text)
    detok, m = IncrementalDetokenizer(tok), StopStringMatcher(["</answer>"])
    out = ""
    for t in ids:
        out += m.feed(detok.add([t]))
        if m.stopped:
            break
    assert m.stopped and out == "答案是 42 🎉"
