"""Speed-set files to benchmark requests, the way the SOAR toolkit and `sglang.bench_serving` do it.

Two steps, both from serving_protocol.md:
- `bench_serving.sh` turns each toolkit row into a user/assistant pair: the prompt is `question`,
  else `input`, else `prompt`; the assistant text is `model_response`, or the literal
  `"placeholder"` when the row has none (section 1.1).
- `bench_serving --dataset-name custom` shuffles the pairs with `random.seed(1)` (its default
  `--seed`), keeps the first `--num-prompts`, counts `len(tokenizer.encode(...))` of both texts
  (BOS included), and drops rows where either count is below 2 (section 1.4). The assistant
  count is the request's `max_new_tokens`; the first request after the shuffle is the warm-up.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

CLIENT_SEED = 1  # bench_serving's --seed default; the toolkit does not pass one
PLACEHOLDER = "placeholder"
# The platform's file names for the three tiers, accepted beside our own `{tier}.jsonl`.
TOOLKIT_FILES = {"S1": "speed_bench_c1.jsonl", "S8": "speed_bench_c8.jsonl",
                 "Smax": "speed_bench_cunlimited.jsonl"}


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    prompt_len: int  # tokens, BOS included (reporting only)
    output_len: int  # max_new_tokens, exactly what every response must have


def tier_file(workload_dir: str | Path, tier: str) -> Path:
    """`{tier}.jsonl` (what `write_workload` writes) or the platform's `speed_bench_*.jsonl`."""
    d = Path(workload_dir)
    for name in (f"{tier}.jsonl", TOOLKIT_FILES.get(tier, "")):
        if name and (d / name).is_file():
            return d / name
    raise FileNotFoundError(f"no {tier}.jsonl or {TOOLKIT_FILES.get(tier)} in {d}")


def read_pairs(path: str | Path) -> list[tuple[str, str]]:
    """(prompt, assistant text) per row, as bench_serving.sh converts a speed-set file."""
    pairs = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            prompt = row.get("question") or row.get("input") or row.get("prompt") or ""
            pairs.append((prompt, row.get("model_response", PLACEHOLDER)))
    return pairs


def write_conversations(pairs: list[tuple[str, str]], path: str | Path) -> None:
    """The `conversations` file bench_serving.sh hands to `--dataset-name custom`."""
    with open(path, "w", encoding="utf-8") as f:
        for prompt, answer in pairs:
            f.write(json.dumps({"conversations": [{"role": "user", "content": prompt},
                                                  {"role": "assistant", "content": answer}]},
                               ensure_ascii=False) + "\n")


def sample_requests(pairs: list[tuple[str, str]], tokenizer, num_prompts: int | None = None,
                    seed: int = CLIENT_SEED) -> list[BenchRequest]:
    """The requests, in the order the official client sends them (warm-up = the first).

    The client seeds the global `random` with `seed` and shuffles once before anything else
    draws from it; a fresh `random.Random(seed)` gives the same permutation.
    """
    shuffled = list(pairs)
    random.Random(seed).shuffle(shuffled)
    limit = len(shuffled) if num_prompts is None else num_prompts
    out: list[BenchRequest] = []
    for prompt, answer in shuffled:
        if len(out) == limit:
            break
        n_in, n_out = len(tokenizer.encode(prompt)), len(tokenizer.encode(answer))
        if n_in < 2 or n_out < 2:
            continue  # the client prunes these
        out.append(BenchRequest(prompt, n_in, n_out))
    return out
