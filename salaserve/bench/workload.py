"""Speed workloads in the SOAR toolkit format: one `{"question", "model_response"}` row per request.

The benchmark client (`sglang.bench_serving --dataset-name custom`) sends `question` raw and sets
each request's output length to `len(tokenizer.encode(model_response))`, BOS included
(serving_protocol.md section 1.4), so every `model_response` here is built to exactly its
intended token count under the given tokenizer. Prompt lengths are close to their targets;
the measured count is recorded.

Workloads (tiers S1 / S8 / Smax, as run with concurrency 1 / 8 / unlimited):
- `soar`: 12 / 36 / 96 requests shaped like the official sets (section 5.1, 5.7): about 21%
  short (~1K-token) algorithm problems with ~10K-token answers, the rest 11K-175K-token
  documents (median ~118K) with 200-2.5K-token answers.
- `soar-quick`: the same requests with input and output lengths divided by 8.
- `micro`: fixed shapes, 4 requests each of 1K / 8K / 32K input, 256 output, in every tier.
- `toy`: 12 requests per tier, 20-300 token prompts, 4-40 token outputs, for CPU tests.
"""

from __future__ import annotations

import bisect
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

from salaserve.bench.documents import (SentencePool, code_problem, long_documents, plain_prompt,
                                       response_units)
from salaserve.bench.tokfit import exact_length_text

TIERS = ("S1", "S8", "Smax")
SOAR_COUNTS = {"S1": 12, "S8": 36, "Smax": 96}
WORKLOADS = ("soar", "soar-quick", "micro", "toy")

# Long-document prompt tokens by quantile: 11K-175K, median ~118K, p90 ~145K and mean ~97K,
# from the official deepresearch rows at ~1.57 chars/token (serving_protocol.md section 5.1).
_DOC_QUANTILES = ((0.0, 11_000), (0.1, 25_000), (0.25, 55_000), (0.5, 118_000),
                  (0.75, 132_000), (0.9, 145_000), (1.0, 175_000))
SHORT_FRACTION = 0.21  # 2/8, 6/24, 12/64 code rows in the competitor copy of the official sets


@dataclass(frozen=True)
class Shape:
    category: str  # "code" (short prompt, long answer), "doc" (long document), "micro", "toy"
    input_tokens: int  # target, BOS included
    output_tokens: int  # exact, BOS included


def _doc_input(u: float) -> int:
    qs = [q for q, _ in _DOC_QUANTILES]
    k = min(max(bisect.bisect_right(qs, u), 1), len(qs) - 1)
    (q0, v0), (q1, v1) = _DOC_QUANTILES[k - 1], _DOC_QUANTILES[k]
    return round(v0 + (v1 - v0) * (u - q0) / (q1 - q0))


def soar_shapes(n: int, rng: random.Random, scale: int = 1) -> list[Shape]:
    """`n` SOAR-like request shapes; stratified quantiles keep even small tiers representative."""
    n_short = round(SHORT_FRACTION * n)
    n_long = n - n_short
    shapes = [Shape("code", rng.randint(900, 1150) // scale, rng.randint(8000, 12000) // scale)
              for _ in range(n_short)]
    ins = [(i + rng.random()) / n_long for i in range(n_long)]
    outs = [(i + rng.random()) / n_long for i in range(n_long)]
    rng.shuffle(outs)  # pair input and output quantiles independently
    lo, hi = math.log(200), math.log(2500)
    for u, v in zip(ins, outs):
        shapes.append(Shape("doc", _doc_input(u) // scale, round(math.exp(lo + v * (hi - lo))) // scale))
    rng.shuffle(shapes)
    return shapes


def workload_shapes(name: str, seed: int, counts: dict[str, int] | None = None) -> dict[str, list[Shape]]:
    """Per-tier request shapes of a named workload; `counts` overrides the requests per tier."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    out: dict[str, list[Shape]] = {}
    for tier in TIERS:
        family = "soar" if name == "soar-quick" else name  # quick = the soar shapes / 8
        rng = random.Random(f"shapes-{family}-{seed}-{tier}")
        if name in ("soar", "soar-quick"):
            n = (counts or SOAR_COUNTS)[tier]
            out[tier] = soar_shapes(n, rng, scale=8 if name == "soar-quick" else 1)
        elif name == "micro":
            base = [Shape("micro", i, 256) for i in (1024, 8192, 32768) for _ in range(4)]
            out[tier] = base[:counts[tier]] if counts else base
        else:
            n = counts[tier] if counts else 12
            out[tier] = [Shape("toy", rng.randint(20, 300), rng.randint(4, 40)) for _ in range(n)]
    return out


def make_workload(name: str, tokenizer, seed: int = 0,
                  counts: dict[str, int] | None = None) -> dict[str, list[dict]]:
    """Rows per tier: `question`, `model_response`, plus `category`, `target_input_tokens`,
    `input_tokens` (measured) and `output_tokens` (exact) for the manifest.

    Deterministic in (name, seed, counts, tokenizer). Each tier gets its own texts.
    """
    shapes = workload_shapes(name, seed, counts)
    needs_pool = any(s.category in ("doc", "micro") for ss in shapes.values() for s in ss)
    pool = SentencePool(tokenizer, seed) if needs_pool else None
    out: dict[str, list[dict]] = {}
    for tier, tier_shapes in shapes.items():
        key = f"{name}-{seed}-{tier}"
        prompts: list[tuple[str, int] | None] = [None] * len(tier_shapes)
        doc_ids = [i for i, s in enumerate(tier_shapes) if s.category in ("doc", "micro")]
        docs = long_documents(tokenizer, pool, [tier_shapes[i].input_tokens for i in doc_ids],
                              seed=key) if doc_ids else []
        for i, d in zip(doc_ids, docs):
            prompts[i] = d
        rows = []
        for i, s in enumerate(tier_shapes):
            if s.category == "code":
                prompts[i] = code_problem(tokenizer, s.input_tokens, f"{key}-{i}")
            elif s.category == "toy":
                prompts[i] = plain_prompt(tokenizer, s.input_tokens, f"{key}-{i}")
            question, n_in = prompts[i]
            units = response_units(s.output_tokens, f"{key}-resp-{i}",
                                   lang_mix=0.7 if s.category == "code" else 0.3)
            response = exact_length_text(tokenizer, units, s.output_tokens)
            rows.append({"question": question, "model_response": response, "category": s.category,
                         "target_input_tokens": s.input_tokens, "input_tokens": n_in,
                         "output_tokens": s.output_tokens})
        out[tier] = rows
    return out


def write_workload(out_dir: str | Path, name: str, tokenizer, seed: int = 0,
                   counts: dict[str, int] | None = None,
                   workload: dict[str, list[dict]] | None = None) -> dict:
    """Write `{tier}.jsonl` (toolkit rows: `question`, `model_response`) and `manifest.json`.

    Pass `workload` to write one already made with `make_workload`. Returns the manifest.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    workload = workload if workload is not None else make_workload(name, tokenizer, seed, counts)
    manifest = {"name": name, "seed": seed,
                "tokenizer": str(getattr(tokenizer, "name_or_path", "")),
                "token_counting": "len(tokenizer.encode(text)), add_special_tokens=True (BOS counted)",
                "tiers": {}}
    for tier, rows in workload.items():
        with open(out / f"{tier}.jsonl", "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps({"question": row["question"],
                                    "model_response": row["model_response"]},
                                   ensure_ascii=False) + "\n")
        manifest["tiers"][tier] = {
            "file": f"{tier}.jsonl", "requests": len(rows),
            "input_tokens": sum(r["input_tokens"] for r in rows),
            "output_tokens": sum(r["output_tokens"] for r in rows),
            "rows": [{k: r[k] for k in ("category", "target_input_tokens", "input_tokens",
                                         "output_tokens")} for r in rows]}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
    return manifest


def main(argv: list[str]) -> int:
    """`salaserve bench make-workload --workload NAME --model DIR --out DIR [--seed S]`."""
    from salaserve.argparsing import ArgumentParser

    ap = ArgumentParser(prog="salaserve bench make-workload", description=__doc__.split("\n")[0])
    ap.add_argument("--workload", dest="name", required=True, choices=WORKLOADS, help="which workload")
    ap.add_argument("--model", required=True, help="model directory (its tokenizer sizes the texts)")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--seed", type=int, default=0, help="workload seed")
    ap.add_argument("--trust-remote-code", action="store_true", help="let the model directory's own Python code load its tokenizer (off: built-in tokenizer classes only)")
    args = ap.parse_args(argv)
    from salaserve.model.hf_tokenizer import load_tokenizer

    tok = load_tokenizer(args.model, trust_remote_code=args.trust_remote_code)
    t0 = time.perf_counter()
    m = write_workload(args.out, args.name, tok, args.seed)
    for tier, info in m["tiers"].items():
        print(f"{tier}: {info['requests']} requests, {info['input_tokens']} input tokens, "
              f"{info['output_tokens']} output tokens")
    print(f"written to {args.out} in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    import sys
    sys.exit(main(sys.argv[1:]))
