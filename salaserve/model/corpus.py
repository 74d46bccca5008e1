"""The project's text corpus: the Python standard library's own `.py` sources.

The base BPE (`tools/train_tokenizer.py`) and the small models (`tools/train_small.py`) were
trained on it, and GPTQ calibrates on it by default (`quant/calib.py`); all of them use the same
deterministic train / held-out split, which lives here.

The file list is every `.py` file under `os.path.dirname(os.__file__)`, minus third-party
packages, test suites, generated tables and data dumps (see `_EXCLUDED_DIRS` / `_is_excluded`),
sorted by its path relative to that directory (POSIX separators), and capped at
`DEFAULT_MAX_BYTES` of source in that order. A file whose index in the sorted list is a multiple
of `HELDOUT_EVERY` is held out; all others are for training. The list depends on the Python
version that runs it (the stdlib differs between versions) but not on the install prefix.
"""

from __future__ import annotations

import os
from functools import lru_cache

HELDOUT_EVERY = 20  # sorted index % 20 == 0  ->  held out (5 %)
DEFAULT_MAX_BYTES = 48 * 1024 * 1024  # the stdlib minus tests is ~10 MB, so this rarely bites

# Directory names pruned anywhere in the tree.
_EXCLUDED_DIRS = frozenset({
    "site-packages", "dist-packages",  # third-party code
    "test", "tests",  # test suites (deliberately odd encodings, invalid syntax, huge data files)
    "idlelib",  # the IDLE GUI
    "__pycache__",
    "encodings",  # generated codec tables
    "pydoc_data",  # one 750 KB dict literal of documentation text
    "lib-dynload",
})


def stdlib_dir() -> str:
    return os.path.dirname(os.__file__)


def _is_excluded(rel: str) -> bool:
    parts = rel.split("/")
    if any(p in _EXCLUDED_DIRS or p.startswith("config-") for p in parts[:-1]):
        return True
    # Machine-generated build configuration (differs between installs).
    return parts[-1].startswith("_sysconfigdata")


@lru_cache(maxsize=None)
def _all_files(root: str, max_bytes: int) -> tuple[str, ...]:
    rels: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDED_DIRS)
        for name in filenames:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/")
                if not _is_excluded(rel):
                    rels.append(rel)
    rels.sort()
    out: list[str] = []
    total = 0
    for rel in rels:
        path = os.path.join(root, *rel.split("/"))
        try:
            size = os.path.getsize(path)
            if size == 0:
                continue
            with open(path, "rb") as f:
                f.read().decode("utf-8")  # keep only files that are valid UTF-8
        except (OSError, UnicodeDecodeError):
            continue
        if total + size > max_bytes:
            break
        total += size
        out.append(path)
    return tuple(out)


def stdlib_corpus_files(split: str = "train", *, max_bytes: int = DEFAULT_MAX_BYTES,
                        root: str | None = None) -> list[str]:
    """Absolute paths of the corpus files of `split` ("train", "heldout" or "all"), sorted.

    Deterministic for a given Python installation; "train" and "heldout" are disjoint and
    together make up "all".
    """
    files = _all_files(os.path.abspath(root or stdlib_dir()), int(max_bytes))
    if split == "all":
        return list(files)
    if split == "train":
        return [p for i, p in enumerate(files) if i % HELDOUT_EVERY != 0]
    if split == "heldout":
        return [p for i, p in enumerate(files) if i % HELDOUT_EVERY == 0]
    raise ValueError(f"unknown split {split!r} (expected 'train', 'heldout' or 'all')")


def read_corpus_file(path: str) -> str:
    """The text of one corpus file (UTF-8; `stdlib_corpus_files` only lists files that decode)."""
    with open(path, encoding="utf-8", newline="") as f:
        return f.read()
