"""Seeded long-context eval tasks in the `perf_public_set.jsonl` row format.

Rows are `{"task", "question", "gold"}` (serving_protocol.md section 5.5) plus `lang`,
`target_tokens` and `input_tokens` for reference. Tasks follow the public set's kinds:
- `niah`: needle in a haystack; a few "special magic number" needles, one asked for.
- `qa`: extraction QA over founding records of invented organisations hidden in prose.
- `cwe`: common words extraction from a numbered word list (the 10 most frequent).
- `fwe`: frequent words extraction from a coded text (the 3 most frequent).

Golds are correct by construction and unambiguous: needle keys, organisations and
answers are invented words that the haystack grammar never produces, values are unique, and
frequency gaps are strict. Gold words are never substrings of other words in the same list,
so substring scoring cannot credit a wrong word.

Length: `question` is fitted to at most `target_tokens` tokens of the raw question without
special tokens (the public set's lengths are counted that way; the chat template adds a few),
landing within one haystack unit below the target.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from salaserve.bench.textgen import TextGen, distinct_words, in_lexicon, pseudo_word
from salaserve.bench.tokfit import count_tokens_batch, fit_units

TASKS = ("niah", "qa", "cwe", "fwe")

NIAH_NEEDLE = {"en": "One of the special magic numbers for {key} is: {value}.",
               "zh": "{key}的特殊魔法数字是：{value}。"}
_NIAH_INTRO = {"en": "Some special magic numbers are hidden in the text below. Remember them; "
                     "you will be asked about one of them afterwards.",
               "zh": "下面的文字中藏有一些特殊魔法数字。请记住它们，稍后会就其中一个向你提问。"}
_NIAH_ASK = {"en": "Question: According to the text above, what is the special magic number for "
                   "{key}? Answer with the number.",
             "zh": "问题：根据上文，{key}的特殊魔法数字是多少？请直接回答数字。"}

QA_RECORD = {"en": "The {org} was founded in {town} in {year} by {person}.",
             "zh": "{year}年，{person}在{town}创立了{org}。"}
_QA_INTRO = {"en": "Read the documents below and answer the question at the end.",
             "zh": "请阅读以下文档，并回答最后的问题。"}
QA_ASK = {"en": {"town": "Question: Based on the documents above, in which town was the {org} "
                         "founded? Answer with the name of the town.",
                 "person": "Question: Based on the documents above, who founded the {org}? "
                           "Answer with the person's name."},
          "zh": {"town": "问题：根据上文，{org}是在哪里创立的？请直接回答地名。",
                 "person": "问题：根据上文，{org}是由谁创立的？请直接回答人名。"}}
_ORG_KINDS = {"en": ("Society", "Institute", "Guild", "Observatory", "Foundation", "Academy",
                     "Trading Company", "Museum", "Conservatory", "Library"),
              "zh": ("研究会", "学社", "天文台", "基金会", "书院", "商会", "博物馆", "图书馆")}
_TOWN_SUFFIX = {"en": ("ford", "ton", "ville", "haven", "stead", "mouth", "bury"),
                "zh": ("镇", "城", "村", "港", "堡")}
_ZH_SURNAMES = "欧阳司马上官诸葛东方慕容"  # two-char surnames, absent from the haystack grammar

CWE_INTRO = {"en": "Below is a numbered list of words. Some words appear more often than others.",
             "zh": "下面是一个带编号的词语列表，其中有些词语出现的次数比其他词语多。"}
CWE_ASK = {"en": "Question: What are the 10 most common words in the list above? List them.",
           "zh": "问题：上面列表中出现次数最多的10个词语是什么？请列出它们。"}
FWE_INTRO = {"en": "Below is a coded text made of invented words. Keep track of how often each "
                   "coded word appears.",
             "zh": "下面是一段由生造词组成的编码文本。请留意每个编码词出现的次数。"}
FWE_ASK = {"en": "Question: What are the three most frequent coded words in the text above? "
                 "List them.",
           "zh": "问题：上面编码文本中出现次数最多的三个编码词是什么？请列出它们。"}


def _counter(tokenizer) -> Callable[[str], int]:
    return lambda s: count_tokens_batch(tokenizer, [s], add_special_tokens=False)[0]


def _haystack(gen: TextGen, lang: str, target: int) -> list[str]:
    # Every sentence is several tokens, so target // 4 sentences always suffice.
    return [gen.sentence(lang) for _ in range(max(16, target // 4))]


def _insert(sents: list[str], items: list[tuple[float, str]], lang: str) -> str:
    """Join sentences with `items` (depth in [0, 1], text) placed at their relative depths."""
    out = list(sents)
    for depth, text in sorted(items, key=lambda x: -x[0]):  # deepest first keeps indices valid
        out.insert(round(depth * len(sents)), text)
    return (" " if lang == "en" else "").join(out)


def _row(task: str, question: str, gold: list[str], lang: str, target: int, tokens: int) -> dict:
    return {"task": task, "question": question, "gold": gold, "lang": lang,
            "target_tokens": target, "input_tokens": tokens}


def _answer_words(rng: random.Random, lang: str, n: int) -> list[str]:
    """Distinct invented words, none inside another or anywhere in the haystack grammar."""
    out: list[str] = []
    while len(out) < n:
        w = pseudo_word(rng, lang)
        if in_lexicon(w) or any(w in o or o in w for o in out):
            continue
        out.append(w)
    return out


def _filler_words(rng: random.Random, lang: str, n: int, answers: list[str]) -> list[str]:
    """Distinct invented words that contain no answer word, so listing one earns no credit."""
    out = []
    for w in distinct_words(rng, lang, 2 * n + 16, set(answers)):
        if not any(a in w for a in answers):
            out.append(w)
            if len(out) == n:
                return out
    return out + _filler_words(rng, lang, n - len(out), answers + out)


def make_niah(tokenizer, target: int, lang: str, key: str) -> dict:
    rng = random.Random(f"niah-{key}")
    hay = _haystack(TextGen(f"niah-text-{key}"), lang, target)
    n_needles = rng.randint(1, 4)
    if lang == "en":
        words = _answer_words(rng, lang, 2 * n_needles)
        keys = [f"{a}-{b}" for a, b in zip(words[::2], words[1::2])]
    else:
        keys = ["代号" + w for w in _answer_words(rng, lang, n_needles)]
    values = rng.sample(range(10**6, 10**7), n_needles)
    needles = [(rng.random(), NIAH_NEEDLE[lang].format(key=k, value=v)) for k, v in zip(keys, values)]
    ask = rng.randrange(n_needles)

    def build(n: int) -> str:
        return (f"{_NIAH_INTRO[lang]}\n\n{_insert(hay[:n], needles, lang)}\n\n"
                + _NIAH_ASK[lang].format(key=keys[ask]))

    _, q, tokens = fit_units(build, _counter(tokenizer), target, n_hint=max(1, target // 20),
                             n_max=len(hay))
    return _row("niah", q, [str(values[ask])], lang, target, tokens)


def make_qa(tokenizer, target: int, lang: str, key: str) -> dict:
    rng = random.Random(f"qa-{key}")
    hay = _haystack(TextGen(f"qa-text-{key}"), lang, target)
    n = rng.randint(4, 9)
    words = _answer_words(rng, lang, 3 * n)
    orgs, towns, people = words[:n], words[n:2 * n], words[2 * n:]
    if lang == "en":
        orgs = [f"{w.title()} {rng.choice(_ORG_KINDS[lang])}" for w in orgs]
        towns = [w.title() + rng.choice(_TOWN_SUFFIX[lang]) for w in towns]
        people = [f"{rng.choice(('Ada', 'Milo', 'Iris', 'Otto', 'Nell', 'Hugo'))} {w.title()}"
                  for w in people]
    else:
        orgs = [w + rng.choice(_ORG_KINDS[lang]) for w in orgs]
        towns = [w + rng.choice(_TOWN_SUFFIX[lang]) for w in towns]
        people = [_ZH_SURNAMES[2 * (i % 6):2 * (i % 6) + 2] + w for i, w in enumerate(people)]
    years = rng.sample(range(1600, 1990), n)
    records = [(rng.random(), QA_RECORD[lang].format(org=o, town=t, year=y, person=p))
               for o, t, y, p in zip(orgs, towns, years, people)]
    ask, attr = rng.randrange(n), rng.choice(("town", "person"))
    gold = towns[ask] if attr == "town" else people[ask]

    def build(k: int) -> str:
        return (f"{_QA_INTRO[lang]}\n\n{_insert(hay[:k], records, lang)}\n\n"
                + QA_ASK[lang][attr].format(org=orgs[ask]))

    _, q, tokens = fit_units(build, _counter(tokenizer), target, n_hint=max(1, target // 20),
                             n_max=len(hay))
    return _row("qa", q, [gold], lang, target, tokens)


def make_cwe(tokenizer, target: int, lang: str, key: str) -> dict:
    rng = random.Random(f"cwe-{key}")
    common = _answer_words(rng, lang, 10)
    count = _counter(tokenizer)
    sample = distinct_words(random.Random(f"cwe-sample-{key}"), lang, 64)
    per_entry = count("\n".join(f"{100 + i}. {w}" for i, w in enumerate(sample))) / len(sample)
    entries_est = max(40, int(target / per_entry))
    # RULER-like shape (10 words x 30 among words x 3) where the length allows; common words
    # stay about 30% of the entries so the list is mostly distractors.
    freq_u = 3 if entries_est >= 600 else 1
    freq_c = max(freq_u + 3, min(30, round(entries_est * 0.3 / 10)))
    uncommon = _filler_words(rng, lang, entries_est // freq_u + 16, common)

    def build(n: int) -> str:
        words = common * freq_c + uncommon[:n] * freq_u
        random.Random(f"cwe-order-{key}-{n}").shuffle(words)
        body = "\n".join(f"{i}. {w}" for i, w in enumerate(words, 1))
        return f"{CWE_INTRO[lang]}\n\n{body}\n\n{CWE_ASK[lang]}"

    _, q, tokens = fit_units(build, count, target, n_hint=max(1, entries_est // freq_u // 2),
                             n_max=len(uncommon))
    return _row("cwe", q, common, lang, target, tokens)


def fwe_counts(n_words: int, n_vocab: int) -> list[int]:
    """Zipf-like counts (rank r gets ~1/r) summing to about `n_words`, the top 4 strictly falling."""
    weights = [1.0 / r for r in range(1, n_vocab + 1)]
    total = sum(weights)
    counts = [max(1, round(n_words * w / total)) for w in weights]
    for r in (2, 1, 0):  # make rank 1 > rank 2 > rank 3 > every later rank
        counts[r] = max(counts[r], counts[r + 1] + 1)
    return counts


def make_fwe(tokenizer, target: int, lang: str, key: str) -> dict:
    rng = random.Random(f"fwe-{key}")
    top = _answer_words(rng, lang, 3)
    words_est = max(32, target // 3)
    rest = _filler_words(rng, lang, max(8, words_est // 8), top)
    vocab = top + rest

    def build(n: int) -> str:
        counts = fwe_counts(n, max(8, n // 8)) if n else []
        seq = [w for w, c in zip(vocab, counts) for _ in range(c)]
        random.Random(f"fwe-order-{key}-{n}").shuffle(seq)
        return f"{FWE_INTRO[lang]}\n\n{' '.join(seq)}\n\n{FWE_ASK[lang]}"

    _, q, tokens = fit_units(build, _counter(tokenizer), target, n_hint=max(1, words_est // 2),
                             n_max=8 * len(vocab))
    return _row("fwe", q, top, lang, target, tokens)


GENERATORS = {"niah": make_niah, "qa": make_qa, "cwe": make_cwe, "fwe": make_fwe}


def make_synthetic(tokenizer, lengths: list[int], per_task: int, seed: int = 0,
                   tasks: tuple[str, ...] = TASKS, langs: tuple[str, ...] = ("en", "zh")) -> list[dict]:
    """`per_task` rows of each task at each target length; languages alternate within a task."""
    rows = []
    for length in lengths:
        for task in tasks:
            if task not in GENERATORS:
                raise ValueError(f"unknown synthetic task {task!r}; choose from {', '.join(TASKS)}")
            for i in range(per_task):
                lang = langs[i % len(langs)]
                rows.append(GENERATORS[task](tokenizer, length, lang, f"{seed}-{length}-{i}"))
    return rows
