"""Held-out evaluation of a small MiniCPM-SALA checkpoint (the built-in default model).

    python -m tools.eval_small [--model DIR] [--out metrics.json]

1. Perplexity on the held-out split of `salaserve.model.corpus` (files the model never saw).
   Each file is `<s>` + text + `</s>`, cut into consecutive chunks of `ctx` + 1 tokens that
   overlap by one, so every token after the first `<s>` is predicted exactly once, each chunk
   as a fresh sequence (no context carried across chunks). Reported: tokens, nats/token,
   perplexity, bits per UTF-8 byte; and the same for a unigram model fitted on the training
   tokens with add-one smoothing, p(t) = (count(t) + 1) / (N + V), on the same targets.
   Computed with the batched training forward (`train_model.TrainModel`, which the tests hold
   equal to the reference model), for speed.

2. Code completion, through the serving path (`salaserve.engine.llm.LLM`), so it doubles as an
   engine check. Candidates are functions of the held-out files (methods and nested functions
   included) with a docstring, a body that starts on the line after it, at least 3 non-blank
   body lines, and whose reference source parses; the first `n` by SHA-256 of "path:line" are
   used (deterministic for a given Python installation). The prompt is the file text up to the
   end of the docstring, without the newline after it (the BPE merges a newline with the next
   line's indentation, so the model writes that newline itself); when longer than
   `ctx - max_new_tokens` tokens it keeps the tail (without `<s>`, as training windows start
   mid-file). Greedy generation of `max_new_tokens`; the body is the generated lines up to the
   first non-blank line indented no deeper than the `def` (a line cut by the token limit is
   dropped). Scores, over non-blank lines compared after stripping trailing whitespace:
     next_line_exact  first body line identical to the reference;
     first3_exact     first three body lines identical;
     body_exact       whole body identical;
     body_parses      `def` header + docstring + generated body parses with `ast` (and the body
                      has at least one line).
   Generated code is never executed. `self_contained` (a static `ast` check: every name the
   function reads is a parameter, a name it binds, or a builtin) is recorded per function, for
   a future execution-based score on that subset.

   Chat (`chat_task`, same engine): greedy answers to six requests for a named function,
   through the model's chat template; `answers_ok` is the share holding a ```python block that
   parses and defines that name.

3. `make_guard`: a fixed sample (first 512 tokens of the first 3 held-out files that long), its
   token ids, the loss the reference model gives it and the reference's greedy continuation of
   each sample's first 300 tokens, stored in metrics.json so that a test can recheck a shipped
   checkpoint (loader, reference and engine) without depending on this machine's stdlib.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import hashlib
import importlib.util
import json
import math
import os
import textwrap
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from salaserve.config import ModelConfig
from salaserve.model.corpus import read_corpus_file, stdlib_corpus_files, stdlib_dir

GUARD_FILES, GUARD_TOKENS = 3, 512
GUARD_GREEDY_PROMPT, GUARD_GREEDY_TOKENS = 300, 12


def _rel(path: str) -> str:
    return os.path.relpath(path, stdlib_dir()).replace(os.sep, "/")


def load_train_model(model_dir: str, device):
    from salaserve.model.loader import load_state_dict
    from tools.train_model import TrainModel

    cfg = ModelConfig.from_pretrained(model_dir)
    model = TrainModel(cfg).to(device)
    model.load_hf_state_dict(load_state_dict(model_dir, cfg, dtype=torch.float32, device=device))
    return model.eval()


# ---------------------------------------------------------------------------------------------
# 1. Perplexity
# ---------------------------------------------------------------------------------------------


def chunk_documents(docs: list[list[int]], ctx: int) -> list[list[int]]:
    """Chunks of at most ctx + 1 tokens overlapping by one: each target scored once."""
    chunks = []
    for d in docs:
        for s in range(0, len(d) - 1, ctx):
            chunks.append(d[s:s + ctx + 1])
    return chunks


@torch.no_grad()
def perplexity(model, docs: list[list[int]], n_bytes: int, ctx: int, train_counts: torch.Tensor,
               batch_size: int = 16) -> dict:
    device = next(model.parameters()).device
    bf16 = device.type == "cuda"
    V = model.cfg.vocab_size
    counts = train_counts.to(torch.float64).cpu()
    unigram_logp = torch.log((counts + 1) / (counts.sum() + V))  # add-one smoothing
    chunks = chunk_documents(docs, ctx)
    by_len: dict[int, list[list[int]]] = {}
    for c in chunks:
        by_len.setdefault(len(c), []).append(c)
    nats = uni_nats = 0.0
    tokens = 0
    for length, group in sorted(by_len.items()):
        for i in range(0, len(group), batch_size):
            w = torch.tensor(group[i:i + batch_size], dtype=torch.long, device=device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                nats += model.loss(w[:, :-1], w[:, 1:], reduction="sum").item()
            uni_nats -= unigram_logp[w[:, 1:].cpu()].sum().item()
            tokens += w[:, 1:].numel()
    return {
        "files": len(docs), "tokens": tokens, "bytes": n_bytes, "ctx": ctx,
        "nats_per_token": nats / tokens, "ppl": math.exp(nats / tokens),
        "bits_per_byte": nats / n_bytes / math.log(2),
        "unigram_nats_per_token": uni_nats / tokens, "unigram_ppl": math.exp(uni_nats / tokens),
        "unigram_bits_per_byte": uni_nats / n_bytes / math.log(2),
        "train_tokens_for_unigram": int(counts.sum().item()),
    }


# ---------------------------------------------------------------------------------------------
# 2. Code completion
# ---------------------------------------------------------------------------------------------


@dataclass
class FunctionCase:
    file: str  # path relative to the stdlib directory
    name: str  # qualified name
    lineno: int  # line of the `def`
    prompt: str  # file text up to the end of the docstring (no trailing newline)
    header: list[str]  # source lines from the `def` to the end of the docstring
    indent: int  # column of the `def`
    body: list[str] = field(default_factory=list)  # reference body, non-blank lines, rstripped
    self_contained: bool = False


def _nonblank(lines: list[str]) -> list[str]:
    return [ln.rstrip() for ln in lines if ln.strip()]


def _parses(header: list[str], body: list[str]) -> bool:
    try:
        ast.parse(textwrap.dedent("\n".join(header + body)))
        return True
    except (SyntaxError, ValueError):
        return False


def is_self_contained(fn: ast.AST) -> bool:
    """Every name the function reads is a parameter, bound inside it, or a builtin."""
    bound = set(dir(builtins))
    for node in ast.walk(fn):
        if isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node is not fn:
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return all(n.id in bound for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load))


def find_functions(path: str, text: str) -> list[FunctionCase]:
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.split("\n")  # ast counts lines the same way (\n and \r\n alike)
    out: list[FunctionCase] = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                case = _case(child, prefix + child.name)
                if case is not None:
                    out.append(case)
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    def _case(fn, qualname):
        body = fn.body
        if len(body) < 2 or ast.get_docstring(fn, clean=False) is None:
            return None
        doc = body[0]
        if body[1].lineno <= doc.end_lineno or doc.lineno <= fn.lineno:
            return None
        doc_line = lines[doc.end_lineno - 1]
        if doc_line.encode("utf-8")[doc.end_col_offset:].strip():  # code after the docstring
            return None
        ref_body = _nonblank(lines[doc.end_lineno:fn.end_lineno])
        header = [ln.rstrip() for ln in lines[fn.lineno - 1:doc.end_lineno]]
        if len(ref_body) < 3 or not _parses(header, ref_body):
            return None
        prompt = "\n".join(lines[:doc.end_lineno - 1] + [doc_line.rstrip()])
        return FunctionCase(file=_rel(path), name=qualname, lineno=fn.lineno, prompt=prompt, header=header,
                            indent=fn.col_offset, body=ref_body, self_contained=is_self_contained(fn))

    visit(tree, "")
    return out


def select_functions(files: list[str], n: int) -> list[FunctionCase]:
    cases = [c for p in files for c in find_functions(p, read_corpus_file(p))]
    cases.sort(key=lambda c: hashlib.sha256(f"{c.file}:{c.lineno}".encode()).hexdigest())
    return cases[:n]


def generated_body(text: str, indent: int, truncated: bool) -> list[str]:
    """The generated function body: lines after the docstring's line, up to the first non-blank
    line indented no deeper than the `def`; a last line cut by the token limit is dropped."""
    lines = text.split("\n")[1:]  # [0] is the rest of the docstring's line (normally empty)
    if truncated and lines:
        lines = lines[:-1]
    body = []
    for ln in lines:
        if ln.strip() and len(ln) - len(ln.lstrip()) <= indent:
            break
        body.append(ln)
    return _nonblank(body)


def score_case(case: FunctionCase, text: str, truncated: bool) -> dict:
    gen = generated_body(text, case.indent, truncated)
    ref = case.body
    return {
        "file": case.file, "name": case.name, "lineno": case.lineno,
        "next_line_exact": bool(gen) and gen[0] == ref[0],
        "first3_exact": gen[:3] == ref[:3],
        "body_exact": gen == ref,
        "body_parses": bool(gen) and _parses(case.header, gen),
        "self_contained": case.self_contained,
        "reference_head": ref[:3], "generated_head": gen[:3],
    }


def _pick_backend(backend: str, device: str) -> str:
    # the triton backend is optional: fall back to torch where this build does not have it
    if backend == "auto" and (device == "cpu" or importlib.util.find_spec("salaserve.kernels.triton_backend") is None):
        return "torch"
    return backend


def evaluation_llm(model_dir: str, n: int, ctx: int, max_new_tokens: int, device: str, backend: str = "auto",
                   dtype: str = "auto"):
    """One engine for the completion and chat tasks: up to 32 of `n` requests at once, each with
    room for `ctx` + `max_new_tokens` tokens."""
    from salaserve.engine.llm import LLM

    max_running = max(1, min(32, n))
    cfg = ModelConfig.from_pretrained(model_dir)
    return LLM(model_dir, device=device, backend=_pick_backend(backend, device), dtype=dtype,
               max_running_requests=max_running,
               max_total_tokens=max_running * (ctx + max_new_tokens + 2 * cfg.sparse.block_size))


def completion_task(llm, cases: list[FunctionCase], ctx: int, max_new_tokens: int) -> dict:
    from salaserve.core.sampling_params import SamplingParams
    from salaserve.model.tokenizer import BOS_ID

    budget = ctx - max_new_tokens
    prompts, truncated_prompt = [], []
    for c in cases:
        ids = llm.tokenizer(c.prompt, add_special_tokens=False).input_ids
        if len(ids) + 1 <= budget:
            prompts.append([BOS_ID] + ids)
            truncated_prompt.append(False)
        else:
            prompts.append(ids[-budget:])
            truncated_prompt.append(True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens))
    seconds = time.perf_counter() - t0
    details = []
    for c, out, p, cut in zip(cases, outs, prompts, truncated_prompt):
        d = score_case(c, out.text, truncated=out.finish_reason.get("type") == "length")
        d.update(prompt_tokens=len(p), prompt_truncated=cut, completion_tokens=out.completion_tokens)
        details.append(d)
    n = len(details)
    rate = lambda key: sum(d[key] for d in details) / n if n else 0.0  # noqa: E731
    return {
        "n": n, "ctx": ctx, "max_new_tokens": max_new_tokens, "backend": llm.engine.runner.backend_name,
        "device": str(llm.engine.runner.device), "dtype": str(llm.engine.runner.dtype).replace("torch.", ""),
        "next_line_exact": rate("next_line_exact"), "first3_exact": rate("first3_exact"),
        "body_exact": rate("body_exact"), "body_parses": rate("body_parses"),
        "self_contained": sum(d["self_contained"] for d in details),
        "generated_tokens": sum(d["completion_tokens"] for d in details), "seconds": seconds,
        "details": details,
    }


CHAT_REQUESTS = (
    ("fibonacci", "Write a Python function `fibonacci(n)` that returns the n-th Fibonacci number."),
    ("is_palindrome", "Write a Python function `is_palindrome(s)`: return True if the string reads the same backwards."),
    ("flatten", "Implement `flatten` in Python: flatten a list of lists into a single list."),
    ("count_words", "Can you write `count_words(text)`? Count how often each word occurs in the text."),
    ("read_json", "Write a Python function `read_json(path)`: load and return the JSON document stored at path."),
    ("gcd", "Write a Python function `gcd(a, b)` that returns the greatest common divisor of a and b."),
)


def chat_answer_ok(name: str, answer: str) -> bool:
    """The answer holds a ```python block that parses and defines `name`."""
    if "```python\n" not in answer:
        return False
    code = answer.split("```python\n", 1)[1].split("```", 1)[0]
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return False
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name for n in ast.walk(tree))


def chat_task(llm, max_new_tokens: int = 192) -> dict:
    """Greedy answers to `CHAT_REQUESTS` through the chat template; the share that is a parsing
    function of the requested name."""
    from salaserve.core.sampling_params import SamplingParams

    prompts = [llm.chat_ids([{"role": "user", "content": q}]) for _, q in CHAT_REQUESTS]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens))
    answers = [{"request": q, "answer": o.text, "ok": chat_answer_ok(name, o.text)}
               for (name, q), o in zip(CHAT_REQUESTS, outs)]
    return {"n": len(answers), "answers_ok": sum(a["ok"] for a in answers) / len(answers), "answers": answers}


# ---------------------------------------------------------------------------------------------
# 3. Guard sample
# ---------------------------------------------------------------------------------------------


def reference_loss(model_dir: str, token_ids: list[list[int]]) -> float:
    """Mean next-token loss (nats) of the reference model (fp32, CPU) over the sequences."""
    from salaserve.model.reference import ReferenceModel

    ref = ReferenceModel.from_pretrained(model_dir, dtype=torch.float32, device="cpu")
    total, count = 0.0, 0
    for ids in token_ids:
        logits = ref.forward(ids[:-1], ref.new_state())
        total += F.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum").item()
        count += len(ids) - 1
    return total / count


def reference_greedy(model_dir: str, prompts: list[list[int]], n: int) -> list[dict]:
    """Greedy continuations of the reference model (fp32, CPU), with each step's top-2 logit
    margin: a comparison with another implementation is only meaningful while it is not tiny."""
    from salaserve.model.reference import ReferenceModel

    ref = ReferenceModel.from_pretrained(model_dir, dtype=torch.float32, device="cpu")
    out = []
    for prompt in prompts:
        state = ref.new_state()
        logits = ref.forward(prompt, state)[-1]
        tokens, margins = [], []
        for _ in range(n):
            top = logits.topk(2).values
            tokens.append(int(logits.argmax()))
            margins.append(float(top[0] - top[1]))
            logits = ref.forward([tokens[-1]], state)[-1]
        out.append({"prompt_tokens": len(prompt), "tokens": tokens, "margins": margins})
    return out


def make_guard(model_dir: str, tok, n_files: int = GUARD_FILES, n_tokens: int = GUARD_TOKENS,
               greedy_prompt: int = GUARD_GREEDY_PROMPT, greedy_tokens: int = GUARD_GREEDY_TOKENS) -> dict:
    """The loss of the reference model on a fixed sample, and its greedy continuation of each
    sample's first `greedy_prompt` tokens (long enough for the sparse path of the small model)."""
    from salaserve.model.tokenizer import BOS_ID

    files, seqs = [], []
    for p in stdlib_corpus_files("heldout"):
        ids = [BOS_ID] + tok.encode(read_corpus_file(p), add_special_tokens=False).ids
        if len(ids) >= n_tokens + 1:
            files.append(_rel(p))
            seqs.append(ids[:n_tokens + 1])
        if len(seqs) == n_files:
            break
    return {"files": files, "n_tokens": n_tokens, "method": "ReferenceModel fp32 CPU, one-shot prefill",
            "nats_per_token": reference_loss(model_dir, seqs), "token_ids": seqs,
            "greedy": reference_greedy(model_dir, [s[:greedy_prompt] for s in seqs], greedy_tokens)}


# ---------------------------------------------------------------------------------------------
# Everything
# ---------------------------------------------------------------------------------------------


def evaluate(model_dir: str, device=None, train_counts: torch.Tensor | None = None, ctx: int = 2048,
             n_functions: int = 50, max_new_tokens: int = 128, backend: str = "auto",
             max_train_files: int | None = None, max_heldout_files: int | None = None,
             max_tokens_per_file: int | None = None) -> dict:
    """Perplexity (model and unigram) and the completion task; returns a JSON-able dict."""
    from tools.small_data import encode_documents, load_tokenizer, train_val_files

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    tok = load_tokenizer(model_dir)
    if train_counts is None:
        train_files, _ = train_val_files(max_train_files)
        stream = torch.tensor([t for d in encode_documents(tok, train_files) for t in d])
        train_counts = torch.bincount(stream, minlength=tok.get_vocab_size())
    files = stdlib_corpus_files("heldout")[:max_heldout_files]
    docs = encode_documents(tok, files)
    texts_bytes = sum(len(read_corpus_file(p).encode("utf-8")) for p in files)
    if max_tokens_per_file is not None:  # quick runs: a prefix of each file (bytes then approximate)
        docs = [d[:max_tokens_per_file] for d in docs]
    t0 = time.perf_counter()
    model = load_train_model(model_dir, device)
    ppl = perplexity(model, docs, texts_bytes, ctx, train_counts)
    ppl["seconds"] = time.perf_counter() - t0
    del model
    print(f"held-out: {ppl['tokens']:,} tokens, {ppl['nats_per_token']:.4f} nats/token (ppl {ppl['ppl']:.2f}); "
          f"unigram {ppl['unigram_nats_per_token']:.4f} (ppl {ppl['unigram_ppl']:.1f})", flush=True)
    result = {"heldout_files": [_rel(p) for p in files], "perplexity": ppl}
    if n_functions > 0:
        cases = select_functions(files, n_functions)
        llm = evaluation_llm(model_dir, len(cases), ctx, max_new_tokens, device.type, backend)
        comp = completion_task(llm, cases, ctx, max_new_tokens)
        print(f"completion ({comp['n']} functions, {comp['seconds']:.1f} s): next line {comp['next_line_exact']:.2f}, "
              f"first 3 lines {comp['first3_exact']:.2f}, body exact {comp['body_exact']:.2f}, "
              f"parses {comp['body_parses']:.2f}", flush=True)
        result["completion"] = comp
        chat = chat_task(llm)
        print(f"chat: {chat['answers_ok']:.2f} of {chat['n']} answers define the requested function", flush=True)
        result["chat"] = chat
    return result


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m tools.eval_small", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: the built-in model)")
    p.add_argument("--device", default=None)
    p.add_argument("--backend", default="auto")
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--functions", type=int, default=50)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-heldout-files", type=int, default=None)
    p.add_argument("--max-tokens-per-file", type=int, default=None)
    p.add_argument("--max-train-files", type=int, default=None, help="unigram fitted on the first N train files")
    p.add_argument("--out", default=None, help="write the result as JSON here")
    a = p.parse_args(argv)
    from salaserve.model.default import default_model_dir

    result = evaluate(a.model or default_model_dir(), a.device, ctx=a.ctx, n_functions=a.functions,
                      max_new_tokens=a.max_new_tokens, backend=a.backend, max_train_files=a.max_train_files,
                      max_heldout_files=a.max_heldout_files, max_tokens_per_file=a.max_tokens_per_file)
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    return result


if __name__ == "__main__":
    main()
