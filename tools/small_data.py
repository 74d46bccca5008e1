"""The small models' data.

1. The stdlib corpus' training split divided into train and validation files (`train_val_files`),
   each file one token document (`encode_documents`).
2. More code (`collect`, `python -m tools.small_data --out .corpus/code.jsonl.xz`): the Python
   sources of installed, permissively licensed packages, in one compressed JSON-lines file.
   Each line is {"path": "package/relative/path.py", "text": ...}; a manifest (packages,
   versions, licences, file and byte counts) is written beside it as `<out>.manifest.json`. Only
   packages named in `PACKAGES` are read, and only where they are installed. Test suites,
   vendored copies, generated or data-like files, and files that repeat the standard library
   (which holds the held-out evaluation set) are left out. Large packages are capped at
   `--max-package-bytes`, keeping a spread of their files (ordered by a hash of the path) rather
   than a prefix of one folder.
3. Chat exchanges made from code (`chat_texts`), so the default model answers
   `/v1/chat/completions` requests. There is no instruction data offline, but documented
   functions are natural (request, answer) pairs: the user asks for a function by name,
   signature and the docstring's summary; the assistant answers with the function's source in a
   fenced block. Each is rendered in the model's ChatML chat template
   (`<|im_start|>role\\n...<|im_end|>\\n`, as `salaserve.model.tokenizer` writes it), so training
   and serving see the same format.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.metadata as metadata
import json
import lzma
import os
import sys
import textwrap

from salaserve.model.corpus import read_corpus_file, stdlib_corpus_files

VAL_EVERY, VAL_OFFSET = 20, 10  # validation files: train-split index % 20 == 10


def train_val_files(max_files: int | None = None) -> tuple[list[str], list[str]]:
    """The training split of the corpus, divided into (train, validation) files."""
    files = stdlib_corpus_files("train")
    train = [p for i, p in enumerate(files) if i % VAL_EVERY != VAL_OFFSET]
    val = [p for i, p in enumerate(files) if i % VAL_EVERY == VAL_OFFSET]
    if max_files is not None:  # small runs (tests): a prefix of each list
        train, val = train[:max_files], val[:max(1, max_files // 4)]
    return train, val


def load_tokenizer(model_dir: str):
    """The raw `tokenizers` tokenizer of a model directory (no transformers)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))


def encode_documents(tok, files: list[str]) -> list[list[int]]:
    """Each file as <s> + text + </s> (ids 1 and 2), without the tokenizer's own BOS."""
    return encode_texts(tok, [read_corpus_file(p) for p in files])


def encode_texts(tok, texts: list[str]) -> list[list[int]]:
    """Each text as <s> + text + </s> (ids 1 and 2), without the tokenizer's own BOS."""
    from salaserve.model.tokenizer import BOS_ID, EOS_TEXT_ID

    return [[BOS_ID] + e.ids + [EOS_TEXT_ID] for e in tok.encode_batch(texts, add_special_tokens=False)]


# ---------------------------------------------------------------------------------------------
# Package sources
# ---------------------------------------------------------------------------------------------

# Top-level package -> its licence (as the project states it). All permissive.
PACKAGES = {
    "torch": "BSD-3-Clause", "torchgen": "BSD-3-Clause", "triton": "MIT",
    "transformers": "Apache-2.0", "huggingface_hub": "Apache-2.0", "datasets": "Apache-2.0",
    "sglang": "Apache-2.0", "openai": "Apache-2.0", "aiohttp": "Apache-2.0", "pyarrow": "Apache-2.0",
    "numpy": "BSD-3-Clause", "pandas": "BSD-3-Clause", "sympy": "BSD-3-Clause", "mpmath": "BSD-3-Clause",
    "networkx": "BSD-3-Clause", "matplotlib": "PSF-based (matplotlib licence)", "IPython": "BSD-3-Clause",
    "pygments": "BSD-2-Clause", "jinja2": "BSD-3-Clause", "click": "BSD-3-Clause", "fsspec": "BSD-3-Clause",
    "prompt_toolkit": "BSD-3-Clause", "pydantic": "MIT", "fastapi": "MIT", "rich": "MIT", "jedi": "MIT",
    "anyio": "MIT", "fontTools": "MIT", "_pytest": "MIT",
}
EXCLUDED_DIRS = frozenset({"test", "tests", "testing", "_vendor", "vendor", "vendored", "third_party",
                           "__pycache__", "benchmarks", "examples"})
MAX_FILE_BYTES = 256 * 1024
LONG_LINE = 300  # a file with more than 1% of such lines is data, not code
STDLIB_OVERLAP = 0.3  # a file sharing more of its distinctive lines with the stdlib is a copy
MIN_DISTINCTIVE = 30  # characters for a stripped line to count as distinctive


def package_dirs(names) -> dict[str, str]:
    """Installed directory of each named top-level package (missing ones left out)."""
    out = {}
    for path in sys.path:
        for name in names:
            d = os.path.join(path, name)
            if name not in out and os.path.isfile(os.path.join(d, "__init__.py")):
                out[name] = d
    return out


def _distinctive(text: str) -> set[str]:
    return {s for s in (line.strip() for line in text.splitlines()) if len(s) >= MIN_DISTINCTIVE}


def stdlib_lines() -> set[str]:
    """Distinctive lines of every standard-library corpus file (both splits)."""
    lines: set[str] = set()
    for p in stdlib_corpus_files("all"):
        lines |= _distinctive(read_corpus_file(p))
    return lines


def keep_file(text: str, stdlib: set[str]) -> bool:
    lines = text.splitlines()
    if not lines or sum(len(x) > LONG_LINE for x in lines) > 0.01 * len(lines):
        return False
    mine = _distinctive(text)
    return not mine or len(mine & stdlib) / len(mine) <= STDLIB_OVERLAP


def package_files(root: str) -> list[str]:
    """The package's .py files outside excluded folders, sorted by relative path."""
    found = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in EXCLUDED_DIRS and not x.startswith("."))
        paths = (os.path.join(d, f) for f in files if f.endswith(".py"))
        found += [p for p in paths if os.path.getsize(p) <= MAX_FILE_BYTES]
    return sorted(found, key=lambda p: os.path.relpath(p, root))


def collect(max_package_bytes: int, packages=None) -> tuple[list[dict], dict]:
    """(documents, manifest) for the installed packages of `packages` (default: all of PACKAGES)."""
    names = list(packages or PACKAGES)
    dirs = package_dirs(names)
    stdlib = stdlib_lines()
    distributions = metadata.packages_distributions()
    docs, manifest = [], {"packages": {}, "max_package_bytes": max_package_bytes,
                          "python": sys.version.split()[0]}
    for name in names:
        if name not in dirs:
            continue
        root = dirs[name]
        files = sorted(package_files(root), key=lambda p: hashlib.sha1(os.path.relpath(p, root).encode()).hexdigest())
        kept, nbytes, dropped = [], 0, 0
        for p in files:
            try:
                text = read_corpus_file(p)
            except (UnicodeDecodeError, OSError):
                dropped += 1
                continue
            size = len(text.encode("utf-8"))
            if nbytes + size > max_package_bytes:
                break
            if not keep_file(text, stdlib):
                dropped += 1
                continue
            kept.append({"path": f"{name}/{os.path.relpath(p, root)}", "text": text})
            nbytes += size
        kept.sort(key=lambda d: d["path"])
        docs += kept
        dist = distributions.get(name, [name])[0]
        try:
            version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            version = None
        manifest["packages"][name] = {"distribution": dist, "version": version, "licence": PACKAGES.get(name),
                                      "files": len(kept), "bytes": nbytes, "dropped": dropped}
    manifest["files"] = len(docs)
    manifest["bytes"] = sum(m["bytes"] for m in manifest["packages"].values())
    return docs, manifest


def write_corpus(path: str, docs: list[dict]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with lzma.open(path, "wt", encoding="utf-8", preset=6) as f:
        for d in docs:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")


def read_corpus(path: str) -> list[dict]:
    """The documents of a corpus file written by `write_corpus`."""
    with lzma.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


# ---------------------------------------------------------------------------------------------
# Chat exchanges
# ---------------------------------------------------------------------------------------------

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


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m tools.small_data",
                                description="Collect the package-source corpus (more training code for the default model).")
    p.add_argument("--out", required=True, help="output file (.jsonl.xz)")
    p.add_argument("--max-package-bytes", type=int, default=24 * 10**6, help="cap per package (default 24 MB)")
    p.add_argument("--packages", default=None, help="comma-separated subset of the known packages")
    a = p.parse_args(argv)
    packages = a.packages.split(",") if a.packages else None
    unknown = [x for x in packages or [] if x not in PACKAGES]
    if unknown:
        p.error(f"not in the permissive list: {', '.join(unknown)}")
    docs, manifest = collect(a.max_package_bytes, packages)
    write_corpus(a.out, docs)
    manifest["compressed_bytes"] = os.path.getsize(a.out)
    with open(a.out + ".manifest.json", "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    print(f"{manifest['files']} files, {manifest['bytes'] / 1e6:.1f} MB of source -> {a.out} "
          f"({manifest['compressed_bytes'] / 1e6:.1f} MB)")
    return manifest


if __name__ == "__main__":
    main()
