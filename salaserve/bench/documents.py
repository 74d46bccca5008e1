"""Prompt and response texts for speed workloads, sized in tokens.

Two families, as in the official SOAR speed sets (serving_protocol.md section 5.1):
long research documents (mostly Chinese, some English) ending with a report request, and short
Chinese algorithm problems. Long documents are assembled from a pool of sentences with
estimated token counts, so their length is found by adding estimates instead of re-encoding
hundreds of thousands of tokens per try; one batch measurement then corrects the estimate.
"""

from __future__ import annotations

import random
import re

from salaserve.bench.textgen import TextGen
from salaserve.bench.tokfit import count_tokens, count_tokens_batch, exact_length_text, fit_units

# Whole words with their leading space, or one non-space character (CJK, punctuation).
_WORD_RE = re.compile(r"\s*[A-Za-z0-9']+|\s*[^\sA-Za-z0-9']")

_ZH_REQUESTS = (
    "请根据以上材料，撰写一份结构清晰的研究综述，概括主要事实、关键人物和时间线，并指出材料中相互矛盾之处。",
    "请仔细阅读上述文档，总结其中涉及的主要问题，分析各方观点的依据，并给出你的结论和建议。",
    "基于以上全部内容，请整理一份调研报告：先列出核心发现，再逐条说明证据来源，最后提出三条后续研究方向。",
    "阅读以上资料后，请回答：文中提到的各项计划分别由谁提出、在何时实施、结果如何？请分点作答并给出总结。",
)
_EN_REQUESTS = (
    "Based on the documents above, write a structured research summary that lists the key facts, "
    "the people involved and the timeline, and point out any contradictions.",
    "Read the material above carefully and produce a report: main findings first, then the "
    "evidence for each, then three open questions for further research.",
)


class SentencePool:
    """Pre-generated sentences with estimated token counts, for fast assembly.

    Estimates are characters divided by each language's chars-per-token, measured once on a
    sample: encoding every sentence separately would cost more than it saves, and documents
    are measured exactly at the end anyway.
    """

    def __init__(self, tokenizer, seed: int | str, n_zh: int = 30000, n_en: int = 10000) -> None:
        gen = TextGen(f"pool-{seed}")
        self.zh = [gen.zh_sentence() for _ in range(n_zh)]
        # English sentences are joined with a space, so they carry it.
        self.en = [" " + gen.en_sentence() for _ in range(n_en)]
        zh_sample, en_sample = "".join(self.zh[:3000]), "".join(self.en[:3000])
        n_zh_tok, n_en_tok = count_tokens_batch(tokenizer, [zh_sample, en_sample], False)
        self.zh_tok = [len(t) * n_zh_tok / len(zh_sample) for t in self.zh]
        self.en_tok = [len(t) * n_en_tok / len(en_sample) for t in self.en]


class LongDocument:
    """A long document as paragraphs of pool sentence ids; `text()` renders it."""

    def __init__(self, pool: SentencePool, rng: random.Random, title: str, request: str) -> None:
        self.pool, self.rng = pool, rng
        self.head = f"{title}\n\n"
        self.tail = f"\n\n{request}"
        self.paras: list[tuple[str, list[int]]] = []  # (lang, pool sentence ids)
        self.headings: dict[int, str] = {}  # paragraph index -> heading shown before it
        self.est = 0  # estimated body tokens
        self.fixed = 0  # measured tokens of head, request and BOS

    def grow(self, tokens: int) -> None:
        """Append paragraphs until the body estimate grows by `tokens`."""
        r, pool = self.rng, self.pool
        goal = self.est + tokens
        while self.est < goal:
            if len(self.paras) % 12 == 0:
                n = len(self.headings) + 1
                self.headings[len(self.paras)] = f"第{n}节" if r.random() < 0.8 else f"Section {n}"
                self.est += 4
            lang = "en" if r.random() < 0.2 else "zh"
            toks = pool.en_tok if lang == "en" else pool.zh_tok
            ids: list[int] = []
            for _ in range(r.randint(3, 8)):
                i = r.randrange(len(toks))
                ids.append(i)
                self.est += toks[i]
                if self.est >= goal:
                    break
            self.est += 1  # paragraph break
            self.paras.append((lang, ids))

    def shrink(self, tokens: int) -> None:
        """Drop sentences from the end until the body estimate falls by `tokens`."""
        goal = self.est - tokens
        while self.est > goal and self.paras:
            lang, ids = self.paras[-1]
            toks = self.pool.en_tok if lang == "en" else self.pool.zh_tok
            self.est -= toks[ids.pop()]
            if not ids:
                self.paras.pop()
                self.est -= 1
                if self.headings.pop(len(self.paras), None) is not None:
                    self.est -= 4

    def text(self) -> str:
        out = [self.head]
        for k, (lang, ids) in enumerate(self.paras):
            if k in self.headings:
                out.append(f"## {self.headings[k]}\n\n")
            sents = self.pool.en if lang == "en" else self.pool.zh
            out.append("".join(sents[i] for i in ids).lstrip() + "\n\n")
        out.append(self.tail.lstrip("\n"))
        return "".join(out)


def long_documents(tokenizer, pool: SentencePool, targets: list[int], seed: int | str,
                   rel_tol: float = 0.002, rounds: int = 5) -> list[tuple[str, int]]:
    """Documents of about `targets[i]` tokens (BOS included): [(text, measured tokens)].

    Estimates come from the pool's counts, scaled by the measured/estimated ratio of one
    calibration document (joining sentences changes counts a little, but uniformly). Each round
    measures all documents still off by more than `rel_tol` (at least 8 tokens) in one parallel
    batch and grows or shrinks them by the difference, scaled by their own ratio.
    """
    cal = LongDocument(pool, random.Random(f"calibrate-{seed}"), "", "")
    cal.grow(20_000)
    scale = (count_tokens(tokenizer, cal.text()) - count_tokens(tokenizer, "")) / cal.est
    docs = []
    for i, t in enumerate(targets):
        rng = random.Random(f"doc-{seed}-{i}")
        gen = TextGen(f"doc-title-{seed}-{i}")
        lang = "en" if rng.random() < 0.1 else "zh"
        request = rng.choice(_EN_REQUESTS if lang == "en" else _ZH_REQUESTS)
        doc = LongDocument(pool, rng, gen.title(lang), request)
        doc.fixed = count_tokens(tokenizer, doc.head + request)  # includes BOS
        doc.grow(max(round((t - doc.fixed) / scale), 0))
        docs.append(doc)
    measured = [0] * len(docs)
    todo = list(range(len(docs)))
    for _ in range(rounds):
        texts = [docs[i].text() for i in todo]
        for i, n in zip(todo, count_tokens_batch(tokenizer, texts)):
            measured[i] = n
        nxt = []
        for i in todo:
            diff = targets[i] - measured[i]
            if abs(diff) <= max(8, rel_tol * targets[i]):
                continue
            ratio = (measured[i] - docs[i].fixed) / max(docs[i].est, 1)
            step = round(diff / ratio) if ratio > 0 else diff
            (docs[i].grow if step > 0 else docs[i].shrink)(abs(step))
            nxt.append(i)
        if not nxt:
            break
        todo = nxt
    else:
        texts = [docs[i].text() for i in todo]
        for i, n in zip(todo, count_tokens_batch(tokenizer, texts)):
            measured[i] = n
    return [(d.text(), m) for d, m in zip(docs, measured)]


# ----------------------------------------------------------------------------- code problems

_STORY = (
    "农夫约翰有{n}头奶牛，它们排成一行站在牧场上，第i头奶牛的编号为i，产奶量为a_i。",
    "贝茜正在玩一个关于数组的游戏：给定一个长度为{n}的整数序列，她每次可以选择一个区间并把其中所有数加一。",
    "在一个{n}个点、{m}条边的无向图中，每条边都有一个正整数权值，约翰想从1号点出发走到n号点。",
    "牧场上有{n}块草地，排成一个环，每块草地上有若干单位的青草，奶牛们希望以最小的代价吃完所有青草。",
    "给定一个由小写字母组成、长度为{n}的字符串，你需要统计其中满足特定条件的子串数量。",
)
_TASK = (
    "请求出在最优策略下，最少需要多少次操作才能达到目标状态。",
    "请计算所有合法方案的数量，答案对1000000007取模。",
    "请输出满足条件的最大值；如果不存在合法方案，请输出-1。",
    "请求出最短路径的长度，以及有多少条不同的最短路径。",
)


def code_problem(tokenizer, target: int, seed: int | str) -> tuple[str, int]:
    """A USACO-style Chinese problem statement of about `target` tokens: (text, measured).

    The background section is cut at a character, so the prompt lands within a token or two of
    the target; a target smaller than the bare statement gets the statement truncated.
    """
    rng = random.Random(f"code-{seed}")
    gen = TextGen(f"code-text-{seed}")
    n, m = rng.randint(5, 2 * 10**5), rng.randint(5, 4 * 10**5)
    story = rng.choice(_STORY).format(n=n, m=m)
    task = rng.choice(_TASK)
    sample_in = "\n".join(" ".join(str(rng.randint(1, 100)) for _ in range(rng.randint(2, 6)))
                          for _ in range(rng.randint(3, 6)))
    sample_out = str(rng.randint(0, 10**6))
    title = gen.title("zh")
    background = _WORD_RE.findall("".join(gen.zh_sentence() for _ in range(max(8, target // 4))))

    def build(k: int) -> str:
        return (f"题目：{title}\n\n【题目背景】\n{''.join(background[:k])}\n\n【题目描述】\n{story}{task}\n\n"
                f"【输入格式】\n第一行包含两个整数n和m。接下来若干行，每行描述一个操作。\n\n"
                f"【输出格式】\n输出一行一个整数，表示答案。\n\n【样例输入】\n{sample_in}\n\n"
                f"【样例输出】\n{sample_out}\n\n【数据范围】\n对于100%的数据，1≤n≤{n}，1≤m≤{m}。\n\n"
                f"请用C++编写程序解决这个问题，并解释你的思路。")

    def count(s: str) -> int:
        return count_tokens(tokenizer, s)

    if count(build(0)) > target:
        text = exact_length_text(tokenizer, _WORD_RE.findall(build(len(background))), target)
        return text, count(text)
    _, text, tokens = fit_units(build, count, target, n_hint=max(1, target // 2),
                                n_max=len(background))
    return text, tokens


def plain_prompt(tokenizer, target: int, seed: int | str) -> tuple[str, int]:
    """Mixed English/Chinese sentences of exactly `target` tokens: (text, target)."""
    gen = TextGen(f"plain-{seed}")
    rng = random.Random(f"plain-mix-{seed}")
    text = " ".join(gen.sentence("en" if rng.random() < 0.5 else "zh")
                    for _ in range(max(4, target // 3)))
    return exact_length_text(tokenizer, _WORD_RE.findall(text), target), target


# ----------------------------------------------------------------------------- responses

def response_units(target: int, seed: int | str, lang_mix: float = 0.5) -> list[str]:
    """Whole-word units of a reasoning-style reply, comfortably more than `target` tokens.

    Starts with `<think>` as the official reference answers do; only its token length matters
    to the benchmark, but natural words keep it realistic.
    """
    gen = TextGen(f"resp-{seed}")
    rng = random.Random(f"resp-mix-{seed}")
    paras: list[str] = []
    chars = 0
    while chars < 8 * target + 64:  # ~4 chars per English token at most; 8 leaves a margin
        lang = "en" if rng.random() < lang_mix else "zh"
        paras.append(gen.paragraph(lang, rng.randint(2, 5)))
        chars += len(paras[-1])
    return ["<think>\n"] + _WORD_RE.findall("\n\n".join(paras))
