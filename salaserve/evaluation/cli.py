"""`salaserve eval`: run SOAR-style correctness evaluation against a server (`salaserve eval
--data ...`), or write synthetic rows in the same format (`salaserve eval make-synthetic ...`)."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

from salaserve.argparsing import ArgumentParser
from salaserve.evaluation.client import (DEFAULT_MAX_TOKENS, fetch_model_id, run_eval,
                                         stop_words_for)
from salaserve.evaluation.scoring import score_rows

DEFAULT_URL = "http://127.0.0.1:30000"


def read_jsonl(path: str | Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _eval_parser() -> ArgumentParser:
    ap = ArgumentParser(prog="salaserve eval",
                        description="SOAR-style correctness evaluation over /v1/chat/completions, as the "
                                    "toolkit's eval_model.py runs it.",
                        epilog="salaserve eval make-synthetic --help: write synthetic niah/qa/cwe/fwe rows "
                               "in the same format.")
    ap.add_argument("--data", required=True, help="jsonl rows with task, question, gold")
    ap.add_argument("--url", default=DEFAULT_URL, help="the server")
    ap.add_argument("--model", help="model name to send (default: first id of GET /v1/models)")
    ap.add_argument("--model-path", help="local model dir for stop words (default: --model if a dir)")
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    ap.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="max_tokens of each request")
    ap.add_argument("--limit", type=int, help="only the first N rows")
    ap.add_argument("--tasks", help="comma-separated tasks to keep, e.g. mcq,niah")
    ap.add_argument("--out", help="write summary and per-row predictions to this JSON file")
    ap.add_argument("--trust-remote-code", action="store_true", help="let the model directory's own Python code load its tokenizer (off: built-in tokenizer classes only)")
    return ap


def _synthetic_parser() -> ArgumentParser:
    ap = ArgumentParser(prog="salaserve eval make-synthetic",
                        description="Write seeded niah/qa/cwe/fwe rows (perf_public_set format).")
    ap.add_argument("--out", required=True, help="output jsonl file")
    ap.add_argument("--model", required=True, help="model dir whose tokenizer measures lengths")
    ap.add_argument("--lengths", required=True, help="comma-separated target lengths in tokens")
    ap.add_argument("--per-task", type=int, required=True, help="rows per task and length")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tasks", default="niah,qa,cwe,fwe", help="comma-separated")
    ap.add_argument("--langs", default="en,zh", help="languages, alternating within each task")
    ap.add_argument("--trust-remote-code", action="store_true", help="let the model directory's own Python code load its tokenizer (off: built-in tokenizer classes only)")
    return ap


def make_synthetic_main(argv: list[str]) -> int:
    args = _synthetic_parser().parse_args(argv)
    from salaserve.evaluation.synthetic import make_synthetic
    from salaserve.model.hf_tokenizer import load_tokenizer

    tok = load_tokenizer(args.model, trust_remote_code=args.trust_remote_code)
    rows = make_synthetic(tok, [int(x) for x in args.lengths.split(",")], args.per_task,
                          args.seed, tuple(args.tasks.split(",")), tuple(args.langs.split(",")))
    with open(args.out, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"wrote {len(rows)} rows to {args.out}")
    return 0


def eval_main(argv: list[str]) -> int:
    args = _eval_parser().parse_args(argv)
    rows = read_jsonl(args.data)
    if args.tasks:
        keep = set(args.tasks.split(","))
        rows = [r for r in rows if r.get("task") in keep]
    if args.limit is not None:
        rows = rows[:args.limit]
    if not rows:
        print("no rows to evaluate", file=sys.stderr)
        return 2
    try:
        model = args.model or asyncio.run(fetch_model_id(args.url))
    except Exception as e:  # noqa: BLE001 - any failure here means no server to talk to
        print(f"cannot get the model id from {args.url}/v1/models: {e}", file=sys.stderr)
        return 1
    stop = stop_words_for(model, args.model_path, trust_remote_code=args.trust_remote_code)
    print(f"{len(rows)} rows -> {args.url} model={model} stop={stop} "
          f"concurrency={args.concurrency} max_tokens={args.max_tokens}", flush=True)
    done = [0]
    t0 = time.perf_counter()

    def progress(i: int, p) -> None:
        done[0] += 1
        err = f" error: {p.error}" if p.error else ""
        print(f"[{done[0]}/{len(rows)}] row {i} {p.latency_s:.1f}s{err}", flush=True)

    preds = asyncio.run(run_eval(args.url, model, rows, args.concurrency, args.max_tokens, stop,
                                 on_done=progress))
    wall = time.perf_counter() - t0
    report = score_rows(rows, [p.content for p in preds])
    print()
    print(report.table())
    print(f"wall time {wall:.1f} s")
    if args.out:
        summary = report.to_dict() | {"model": model, "url": args.url, "data": args.data,
                                      "wall_s": round(wall, 2), "stop": stop,
                                      "max_tokens": args.max_tokens, "concurrency": args.concurrency}
        per_row = [{"index": i, "task": r.get("task"), "gold": r.get("gold"), "score": s,
                    **p.to_dict()} for i, (r, p, s) in enumerate(zip(rows, preds, report.scores))]
        Path(args.out).write_text(json.dumps({"summary": summary, "rows": per_row},
                                             ensure_ascii=False, indent=1) + "\n")
        print(f"results written to {args.out}")
    return 0


def main(argv: list[str]) -> int:
    """`argv`: the arguments after `salaserve eval`."""
    if argv and argv[0] == "make-synthetic":
        return make_synthetic_main(argv[1:])
    return eval_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
