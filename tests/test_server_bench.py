"""The official benchmark client against `salaserve serve`: `python -m sglang.bench_serving` from
PyPI's sglang 0.5.9 (its request and custom-dataset code is the SOAR toolkit's), run exactly as
the toolkit's bench_serving.sh runs it, at concurrency 1, 8 and unlimited.

sglang's own dependencies include a CUDA torch, so it is not in the `test` extra; install the
client alone to run this test (it is skipped otherwise):

    pip install sglang==0.5.9 --no-deps
    pip install aiohttp numpy requests tqdm transformers pybase64 IPython pillow orjson datasets
"""

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

# Checked without importing (the client's imports take seconds); the run itself imports it.
CLIENT_MODULES = ("sglang", "aiohttp", "numpy", "requests", "tqdm", "transformers", "pybase64", "PIL", "datasets")
_missing = [m for m in CLIENT_MODULES if importlib.util.find_spec(m) is None]
if _missing:
    pytest.skip(f"sglang's benchmark client is not installed (missing: {', '.join(_missing)}); "
                "pip install sglang==0.5.9 --no-deps, then its client dependencies", allow_module_level=True)

# The toolkit's speed-set rows: {"question", "model_response"}; one row without model_response
# (the toolkit then sends the literal assistant text "placeholder").
ROWS = [
    ("What is the capital of France?", "Paris is the capital and largest city of France."),
    ("Write a haiku about the sea.", "Waves fold into foam, salt wind carries gull voices, the tide keeps its time."),
    ("Explain recursion briefly.", "A function that calls itself on a smaller input until it reaches a base case."),
    ("列出三种水果。", "苹果、香蕉和橙子。"),
    ("Translate 'good morning' to Spanish.", "Buenos días."),
    ("Sum the numbers 1 to 10.", "The sum is 55."),
    ("def add(a, b):", "    return a + b"),
    ("Name a prime number greater than 100.", "101 is prime."),
    ("What does HTTP stand for?", "Hypertext Transfer Protocol, the foundation of data exchange on the web, "
                                  "defines how messages are formatted and transmitted between clients and servers."),
    ("Give one word that rhymes with cat.", "Hat."),
    ("上下文长度是什么意思？", "最大词元数。"),
    ("Say hello.", None),
]


def toolkit_rows_to_bench_file(path: str) -> list[tuple[str, str]]:
    """What bench_serving.sh writes from a speed-set file: one `conversations` row per question."""
    pairs = []
    with open(path, "w", encoding="utf-8") as f:
        for question, response in ROWS:
            answer = response if response is not None else "placeholder"
            f.write(json.dumps({"conversations": [{"role": "user", "content": question},
                                                  {"role": "assistant", "content": answer}]},
                               ensure_ascii=False) + "\n")
            pairs.append((question, answer))
    return pairs


TIERS = {"S1": 1, "S8": 8, "Smax": None}
# Runs the client's command line once per tier in one interpreter (its imports take most of the
# start-up time): the same argparse and run_benchmark as `python -m sglang.bench_serving`.
RUNNER = """
import json, runpy, sys
for tier, argv in json.loads(sys.argv[1]):
    print(f"=== tier {tier} ===", flush=True)
    sys.argv = ["bench_serving.py", *argv]
    runpy.run_module("sglang.bench_serving", run_name="__main__")
    sys.stdout.flush()
"""


@pytest.fixture(scope="module")
def bench_runs(tiny_server, tiny_model_dir, tmp_path_factory):
    """stdout and the result line of each tier, plus the lengths the requests must have."""
    from transformers import AutoTokenizer

    work = tmp_path_factory.mktemp("bench")
    data = work / "bench_eval_data.jsonl"
    pairs = toolkit_rows_to_bench_file(str(data))
    tok = AutoTokenizer.from_pretrained(tiny_model_dir, trust_remote_code=False)
    # bench_serving asks for exactly len(encode(answer)) tokens with ignore_eos
    want = sorted((len(tok.encode(q)), len(tok.encode(a))) for q, a in pairs)
    assert max(o for _, o in want) <= 36 and min(o for _, o in want) >= 2

    runs = []
    for tier, concurrency in TIERS.items():
        # the toolkit's command (bench_serving.sh), plus a result file to check each request
        argv = ["--backend", "sglang", "--host", "127.0.0.1", "--port", str(tiny_server.port),
                "--dataset-name", "custom", "--dataset-path", str(data), "--num-prompts", str(len(ROWS)),
                "--flush-cache", "--output-file", str(work / f"{tier}.jsonl"), "--output-details"]
        if concurrency is not None:
            argv += ["--max-concurrency", str(concurrency)]
        runs.append((tier, argv))
    env = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "API_KEY")}
    proc = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(runs)], cwd=work, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    outputs = dict(re.findall(r"=== tier (\w+) ===\n(.*?)(?=\n=== tier |\Z)", proc.stdout, re.S))
    results = {tier: json.loads((work / f"{tier}.jsonl").read_text().splitlines()[-1]) for tier in TIERS}
    return outputs, results, want


@pytest.mark.parametrize("tier", list(TIERS))
def test_bench_serving(bench_runs, tier):
    outputs, results, want = bench_runs
    stdout, result = outputs[tier], results[tier]
    # what bench_serving.sh greps
    m = re.search(r"Benchmark duration \(s\):\s+([0-9.]+)", stdout)
    assert m, stdout[-3000:]
    assert float(m.group(1)) > 0
    assert re.search(r"Successful requests:\s+12\b", stdout), stdout[-3000:]
    assert result["max_concurrency"] == TIERS[tier]

    assert result["completed"] == len(ROWS)
    assert all(not e for e in result["errors"]), result["errors"]
    got = sorted(zip(result["input_lens"], result["output_lens"]))
    assert got == want  # every request produced exactly the requested number of tokens
    assert result["total_output_tokens"] == sum(o for _, o in want)
    assert all(t and t > 0 for t in result["ttfts"])
