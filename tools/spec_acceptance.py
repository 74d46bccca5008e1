"""Real speculative acceptance on code completion with the built-in trained model.

    python -m tools.spec_acceptance [--model DIR] [--functions 20] [--max-new-tokens 64]
                                              [--draft-tokens 4] [--device cpu]
    python -m tools.spec_acceptance --functions 32 --eagle HEAD_DIR --depths 1 2 3 4 5
    python -m tools.spec_acceptance --functions 32 --eagle HEAD_DIR --depths 5 --topk 3 --no-ngram

Completes held-out standard-library functions greedily twice, without and with NGRAM
speculation, checks that the outputs are token-identical (exact verify), and reports the average
accept length (tokens emitted per verify step), the share of tokens that came from accepted
drafts, and the engine steps each run took. With --eagle: for each depth of --depths, EAGLE3
(chain drafting, that many tokens per verify) and NGRAM (at most that many) on the same prompts,
each checked against the plain output. --topk K drafts trees of K candidates per level (verified
whole on the torch backend, else by their first path).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from salaserve.core.sampling_params import SamplingParams
from salaserve.engine.llm import LLM, load_tokenizer
from salaserve.model.corpus import stdlib_corpus_files
from salaserve.model.default import default_model_dir
from salaserve.model.tokenizer import BOS_ID
from tools.eval_small import select_functions


def run(model_dir: str, prompts: list[list[int]], new_tokens: int, spec: bool, k: int, device: str,
        eagle: str | None = None, topk: int = 1, route: int = 0) -> dict:
    # the whole batch drafts the configured shape (one load level up to the batch): acceptance,
    # not the load policy, is measured here
    kw = dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=k, speculative_max_batch=len(prompts),
              speculative_load_levels=f"{len(prompts)}:{k}:{topk}") if spec else {}
    if spec and eagle:
        kw.update(speculative_algorithm="EAGLE3", speculative_draft_model_path=eagle, speculative_eagle_topk=topk,
                  speculative_ngram_route=route)
    llm = LLM(model_dir, device=device, max_running_requests=len(prompts), **kw)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True))
    e = llm.engine
    return {"tokens": [o.token_ids for o in outs], "seconds": time.perf_counter() - t0,
            "steps": e.stats["steps"], "stats": dict(e.stats), "accept": e.avg_spec_accept_length}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--functions", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--json", default=None)
    ap.add_argument("--eagle", default=None, help="an EAGLE-3 head: compare it with NGRAM by depth")
    ap.add_argument("--depths", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    ap.add_argument("--topk", type=int, default=1, help="EAGLE3 candidates per tree level (trees are verified "
                                                        "whole where the backend can: the torch backend)")
    ap.add_argument("--ngram-route", type=int, default=0,
                    help="EAGLE3: prompt-lookup matches of this many tokens draft instead of the head (0: off)")
    ap.add_argument("--no-ngram", action="store_true", help="with --eagle: leave out the NGRAM runs")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    model_dir = a.model or default_model_dir()
    tok = load_tokenizer(model_dir)
    cases = select_functions(stdlib_corpus_files("heldout"), a.functions)
    budget = a.ctx - a.max_new_tokens
    prompts = []
    for c in cases:
        ids = tok(c.prompt, add_special_tokens=False).input_ids
        prompts.append([BOS_ID] + ids if len(ids) + 1 <= budget else ids[-budget:])
    plain = run(model_dir, prompts, a.max_new_tokens, False, a.draft_tokens, a.device)
    if a.eagle:
        return by_depth(a, model_dir, prompts, plain)
    spec = run(model_dir, prompts, a.max_new_tokens, True, a.draft_tokens, a.device)
    s = spec["stats"]
    result = {
        "model": model_dir, "functions": len(prompts), "max_new_tokens": a.max_new_tokens,
        "draft_tokens": a.draft_tokens, "identical": plain["tokens"] == spec["tokens"],
        "avg_spec_accept_length": spec["accept"], "verify_steps": s["spec_verify_steps"],
        "draft_tokens_proposed": s["spec_draft_tokens"], "draft_tokens_accepted": s["spec_accepted_tokens"],
        "accepted_share_of_output": s["spec_accepted_tokens"] / max(1, s["generated_tokens"]),
        "steps_plain": plain["steps"], "steps_spec": spec["steps"],
        "seconds_plain": plain["seconds"], "seconds_spec": spec["seconds"],
    }
    print(json.dumps(result, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


def by_depth(a, model_dir: str, prompts: list[list[int]], plain: dict) -> dict:
    rows = []
    for d in a.depths:
        row = {"depth": d}
        for name, eagle in (("eagle3", a.eagle),) + ((("ngram", None),) if not a.no_ngram else ()):
            r = run(model_dir, prompts, a.max_new_tokens, True, d, a.device, eagle=eagle, topk=a.topk,
                    route=a.ngram_route)
            row[name] = {"avg_spec_accept_length": r["accept"], "identical": r["tokens"] == plain["tokens"],
                         "verify_steps": r["stats"]["spec_verify_steps"], "steps": r["steps"],
                         "draft_tokens": r["stats"]["spec_draft_tokens"],
                         "accepted_tokens": r["stats"]["spec_accepted_tokens"], "seconds": round(r["seconds"], 2),
                         "head_drafts": r["stats"].get("spec_head_drafts", 0),
                         "ngram_routed": r["stats"].get("spec_ngram_routed", 0)}
        print(json.dumps(row))
        rows.append(row)
    result = {"model": model_dir, "eagle": a.eagle, "topk": a.topk, "ngram_route": a.ngram_route, "functions": len(prompts), "max_new_tokens": a.max_new_tokens,
              "steps_plain": plain["steps"], "seconds_plain": round(plain["seconds"], 2), "by_depth": rows}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
