"""Structured output: SGLang's `json_schema` / `regex` / `ebnf` sampling params (and OpenAI's
`response_format`, which the server maps onto `json_schema`), through xgrammar.

A request's grammar is compiled when it is added (errors are a ValueError naming the field, so the
server answers 400) and gets its own matcher. Each step, the sampler masks the logits of such
rows with the matcher's bitmask of allowed next tokens; each token the request keeps advances its
matcher. Once the grammar is complete only a stop token is allowed, and the request ends when its
matcher has accepted one (whatever ignore_eos says).

xgrammar is imported on first use: where it is missing (e.g. a GPU machine set up from carried
wheels), a request that asks for structured output is refused with a message saying so.
"""

from __future__ import annotations

import json
import re

import torch

from salaserve.core.sampling_params import GRAMMAR_KEYS, grammar_spec


class GrammarCompiler:
    """Compiles requests' grammars for one model's tokenizer (xgrammar caches what it compiled)."""

    def __init__(self, tokenizer_dir: str, vocab_size: int, stop_token_ids):
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._compiler = None

    def _xgr(self):
        try:
            import xgrammar
        except ImportError:
            raise ValueError(f"structured output ({', '.join(GRAMMAR_KEYS)}) needs xgrammar, which is not "
                             "installed here (pip install 'xgrammar>=0.2.9,<0.3')") from None
        return xgrammar

    def compiler(self):
        if self._compiler is None:
            from salaserve.model.hf_tokenizer import load_tokenizer

            xgr = self._xgr()
            tokenizer = load_tokenizer(self.tokenizer_dir)
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info)
        return self._compiler

    def matcher(self, params):
        """A fresh matcher for the request's constraint, or None when it has none."""
        spec = grammar_spec(params)
        if spec is None:
            return None
        key, value = spec
        compiler = self.compiler()
        try:
            if key == "json_schema":
                check_local_refs(json.loads(value))
                # compact JSON (no free whitespace between tokens): with any whitespace allowed,
                # small or unsure models can emit blanks until max_new_tokens
                compiled = compiler.compile_json_schema(value, any_whitespace=False)
            elif key == "regex":
                compiled = compiler.compile_regex(value)
            elif key == "structural_tag":
                compiled = self._compile_structural_tag(compiler, value)
            else:
                compiled = compiler.compile_grammar(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"sampling_params.{key}: not valid JSON: {e}") from None
        except Exception as e:  # xgrammar reports bad schemas, regexes and grammars as RuntimeError
            raise ValueError(f"sampling_params.{key}: {_message(e)}") from None
        return self._xgr().GrammarMatcher(compiled)


    def _compile_structural_tag(self, compiler, value: str):
        """SGLang's structural_tag (a JSON string): its original form {"structures": [{"begin",
        "schema", "end"}, ...], "triggers": [...]} (free text until a trigger, then the structure
        it starts), or xgrammar's newer {"type": "structural_tag", "format": ...}."""
        tag = json.loads(value)
        check_local_refs(tag)  # (the schemas inside it)
        if isinstance(tag, dict) and "structures" in tag and "triggers" in tag:
            xgr = self._xgr()
            structures, triggers = tag["structures"], tag["triggers"]
            if (not isinstance(structures, list) or not isinstance(triggers, list)
                    or not all(isinstance(t, str) and t for t in triggers)):
                raise ValueError("structures and triggers must be lists (triggers of non-empty strings)")
            items = []
            for s in structures:
                if not isinstance(s, dict) or not {"begin", "end"} <= set(s) or not isinstance(s.get("schema", {}), dict):
                    raise ValueError("each structure needs begin, end and a JSON schema object")
                items.append(xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"]))
            return compiler.compile_structural_tag(items, triggers)
        return compiler.compile_structural_tag(value)


REF_KEYS = ("$ref", "$dynamicRef", "$recursiveRef")


def check_local_refs(schema) -> None:
    """ValueError for a reference that is not local to the schema (`#...`): xgrammar cannot
    resolve a remote or file:// one and would leave that part of the output unconstrained; and
    the server must not fetch URLs or read files a client names."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key in REF_KEYS:
                ref = node.get(key)
                if isinstance(ref, str) and not ref.startswith("#"):
                    raise ValueError(f"{key} {ref!r} cannot be resolved: only references within the schema ('#/...') "
                                     "are supported")
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def _message(e: Exception) -> str:
    """xgrammar's error text without its "[time] source.cc:line: " prefix."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return re.sub(r"^\[[0-9:]+\]\s+\S+:\d+:\s*", "", text)


def apply_grammar_masks(logits: torch.Tensor, rows: list[int], matchers: list) -> None:
    """Sets the logits of the tokens each row's matcher does not allow next to -inf, in place."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(rows), logits.shape[1])
    for j, m in enumerate(matchers):
        m.fill_next_token_bitmask(bitmask, j)
    sub = logits[rows]
    xgr.apply_token_bitmask_inplace(sub, bitmask.to(logits.device))
    logits[rows] = sub
