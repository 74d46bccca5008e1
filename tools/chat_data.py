"""Chat examples made from code, so the default model answers `/v1/chat/completions` requests.

There is no instruction data offline, but documented functions are natural (request, answer)
pairs: the user asks for a function by name, signature and the docstring's summary; the
assistant answers with the function's source in a fenced block. Each example is rendered with
the model's ChatML chat template (`<|im_start|>role\\n...<|im_end|>\\n`, as
`salaserve.model.tokenizer` writes it), so training and serving see the same format.
"""

from __future__ import annotations

import ast
import hashlib
import textwrap

MAX_SOURCE_CHARS = 1500
REQUESTS = (
    "Write a Python function `{sig}`: {summary}",
    "{Summary} Implement it in Python as `{sig}`.",
    "Implement `{name}` in Python: {summary}",
    "Can you write `{sig}`? {Summary}",
)


def _summary(doc: str) -> str | None:
    """The docstring's first sentence, lower-cased first letter; None if unusable."""
    first = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
    first = " ".join(first.split())
    if not 12 <= len(first) <= 200 or first.startswith((">>>", ":", "@")):
        return None
    if not first.endswith("."):
        first += "."
    return first[0].lower() + first[1:]


def function_examples(text: str) -> list[tuple[str, str]]:
    """(request, answer) for each documented top-level function of a module's source."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines()
    out = []
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        summary = _summary(doc) if doc else None
        if summary is None:
            continue
        start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
        source = textwrap.dedent("\n".join(lines[start:node.end_lineno]))
        if len(source) > MAX_SOURCE_CHARS:
            continue
        sig = f"{node.name}({ast.unparse(node.args)})"
        pick = int(hashlib.sha1(sig.encode()).hexdigest(), 16) % len(REQUESTS)
        request = REQUESTS[pick].format(sig=sig, name=node.name, summary=summary,
                                        Summary=summary[0].upper() + summary[1:])
        out.append((request, f"```python\n{source}\n```"))
    return out


def render(request: str, answer: str) -> str:
    """One exchange in the chat template's format (without the leading `<s>`)."""
    return f"<|im_start|>user\n{request}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n"


def chat_texts(texts, max_examples: int) -> list[str]:
    """Up to `max_examples` rendered exchanges from the sources, spread over them by a hash."""
    pairs = [p for t in texts for p in function_examples(t)]
    pairs.sort(key=lambda p: hashlib.sha1(p[0].encode()).hexdigest())
    return [render(q, a) for q, a in pairs[:max_examples]]
