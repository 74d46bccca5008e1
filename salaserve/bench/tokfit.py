"""Token counting and fitting text to a token length under a given tokenizer.

Counts follow `sglang.bench_serving`: `len(tokenizer.encode(text))` with the default
`add_special_tokens=True`, so BOS is counted (serving_protocol.md section 1.4).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def count_tokens(tokenizer, text: str, add_special_tokens: bool = True) -> int:
    """Tokens in `text` exactly as the benchmark client counts them."""
    return len(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def count_tokens_batch(tokenizer, texts: Sequence[str], add_special_tokens: bool = True) -> list[int]:
    """Token counts of many texts through the Rust backend when there is one.

    A fast tokenizer's `encode` is its backend's encode, so the ids are the same;
    `encode_batch_fast` skips offsets (about 2x faster) and spreads texts over all cores.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not texts:
        return [count_tokens(tokenizer, t, add_special_tokens) for t in texts]
    enc = getattr(backend, "encode_batch_fast", backend.encode_batch)
    return [len(e.ids) for e in enc(list(texts), add_special_tokens=add_special_tokens)]


def fit_units(build: Callable[[int], str], count: Callable[[str], int], target: int,
              n_hint: int = 16, n_max: int | None = None) -> tuple[int, str, int]:
    """An `n` with `count(build(n)) <= target`, found with few calls to `count`.

    It is the largest such `n` (up to `n_max`, where `build` runs out of material) unless an
    `n` hits `target` exactly first. `build(n)` must be deterministic and grow with `n` (more
    sentences, more list entries). Counts are nearly linear in `n`, so secant steps land close
    and a short bisection finishes; counting a long text is the expensive part.
    Returns (n, text, tokens).
    """
    cache: dict[int, int] = {}

    def tokens(n: int) -> int:
        if n not in cache:
            cache[n] = count(build(n))
        return cache[n]

    base = tokens(0)
    cap = n_max if n_max is not None else 1 << 40
    if base > target or cap == 0:
        return 0, build(0), base
    lo, hi = 0, None  # tokens(lo) <= target < tokens(hi)
    n = min(max(1, n_hint), cap)
    for _ in range(6):
        c = tokens(n)
        if c == target:
            return n, build(n), c
        if c < target:
            lo = max(lo, n)
        else:
            hi = n if hi is None else min(hi, n)
        if (hi is not None and hi - lo <= 1) or (hi is None and lo == cap):
            break
        rate = max((c - base) / n, 1e-3)
        nxt = int(n + (target - c) / rate)
        nxt = min(max(nxt, lo + 1), cap if hi is None else hi - 1)
        if nxt == n:
            break
        n = nxt
    while hi is None and lo < cap:  # still under target: double until over or out of material
        n = min(max(lo, 1) * 2, cap)
        if tokens(n) <= target:
            lo = n
        else:
            hi = n
    while hi is not None and hi - lo > 1:
        mid = (lo + hi) // 2
        if tokens(mid) <= target:
            lo = mid
        else:
            hi = mid
    return lo, build(lo), tokens(lo)


# Short pieces tried, in order, to close the last few tokens of a gap exactly.
FILLERS = (" a", " the", " and", " of", ".", ",", " I", " it", " to", " is", " so", "\n",
           " we", " on", "!", "?", " x", "的", "。", "，")


def exact_length_text(tokenizer, units: Sequence[str], target: int) -> str:
    """A prefix of `"".join(units)`, topped up with short fillers, of exactly `target` tokens.

    `units` are whole words (with their leading space) or single CJK characters, so the text is
    cut only at word boundaries. The count is always re-measured on the whole string: BPE merges
    across a boundary can make a piece cost more or fewer tokens than it does alone. Fitting uses
    the backend's fast counts; the result is checked with `tokenizer.encode` itself, and refitted
    with it should the two ever disagree.
    """
    fast = _fit_exact(units, target, lambda s: count_tokens_batch(tokenizer, [s])[0])
    if fast is not None and count_tokens(tokenizer, fast) == target:
        return fast
    text = _fit_exact(units, target, lambda s: count_tokens(tokenizer, s))
    if text is None:
        raise ValueError(f"could not make a text of exactly {target} tokens from these units")
    return text


def _fit_exact(units: Sequence[str], target: int, count: Callable[[str], int]) -> str | None:
    k, _, c = fit_units(lambda n: "".join(units[:n]), count, target,
                        n_hint=max(1, target // 2), n_max=len(units))
    if k == len(units) and c < target - 16:
        raise ValueError(f"units hold only {c} of the {target} tokens asked for")
    for drop in range(0, min(k, 8) + 1):  # rarely needed: back off a word when fillers can't land
        text = "".join(units[:k - drop])
        c = count(text)
        for _ in range(64):
            if c == target:
                return text
            for f in FILLERS:
                c2 = count(text + f)
                if c < c2 <= target:
                    text, c = text + f, c2
                    break
            else:
                break
    return None
