"""`salaserve train-draft`: train an EAGLE-3 head for a target model on the CPU or a GPU.

    salaserve train-draft --out DIR [--model MODEL] [--samples 768] [--minutes 10] [--resume]

1. Data (`data.py`, cached in DIR/data.pt): corpus prompts, the target's greedy continuations,
   the target's aux hidden states and top-k distributions.
2. Training (`ttt.py`): multi-step train-time test, loss (1 - lam) * KL + lam * TV, lam rising
   with the step-1 greedy acceptance (from 0 at `--lam-from` to `--lam-max` at `--lam-to`), step s
   weighted `--step-decay`^(s-1); random RoPE offsets on half the samples.
3. Output: DIR/head (the SGLang-format checkpoint), DIR/state.pt (resume: weights, optimizer,
   step, RNG, data order), DIR/curves.json (loss and acceptance per logged step).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time

import torch
from tqdm import tqdm

from salaserve.config import ModelConfig
from salaserve.model.eagle3 import Eagle3Config, init_head, save_eagle3
from salaserve.spec_train.data import continue_greedily, corpus_prompts, draft_vocab, target_features
from salaserve.spec_train.ttt import accept_length, batch_tensors, step_losses, ttt_forward


def parse_args(argv):
    p = argparse.ArgumentParser(prog="salaserve train-draft", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output directory (checkpoints, data cache, curves)")
    p.add_argument("--model", default=None, help="target model directory (default: the built-in model)")
    p.add_argument("--samples", type=int, default=768, help="training prompts (plus --heldout for validation)")
    p.add_argument("--heldout", type=int, default=32, help="validation prompts (from the corpus's held-out split)")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(24, 192), metavar=("MIN", "MAX"))
    p.add_argument("--gen-len", type=int, default=64, help="target tokens generated per prompt")
    p.add_argument("--context", type=int, default=128,
                   help="prompt positions a sample starts with (the drafter's context at serving: the prefill "
                        "captures the prompt's last speculative_eagle_window positions, default 128)")
    p.add_argument("--draft-vocab", type=int, default=2048, help="draft vocabulary size (most frequent targets)")
    p.add_argument("--top-k", type=int, default=16, help="target probabilities kept per position")
    p.add_argument("--ttt-steps", type=int, default=5, help="draft steps trained (train-time test depth)")
    p.add_argument("--step-decay", type=float, default=0.8, help="loss weight of step s is decay^(s-1)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--steps", type=int, default=600, help="optimizer steps (the cosine schedule's length)")
    p.add_argument("--minutes", type=float, default=None, help="stop (and save) after this much training time")
    p.add_argument("--stop-at", type=int, default=None, help="stop (and save) after this step; --resume goes on")
    p.add_argument("--lam-from", type=float, default=0.3, help="step-1 acceptance where TV starts to count")
    p.add_argument("--lam-to", type=float, default=0.7, help="acceptance where TV's weight reaches --lam-max")
    p.add_argument("--lam-max", type=float, default=0.9)
    p.add_argument("--max-offset", type=int, default=None, help="largest RoPE offset (default: the target's "
                                                                "max_position_embeddings)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--resume", action="store_true", help="continue from OUT/state.pt")
    return p.parse_args(argv)


def collect(a, model_dir: str, cfg: ModelConfig, aux_layers) -> dict:
    from salaserve.engine.llm import load_tokenizer

    tok = load_tokenizer(model_dir)
    data = {}
    for split, n, seed in (("train", a.samples, a.seed), ("heldout", a.heldout, a.seed + 1)):
        prompts = corpus_prompts(tok, n, a.prompt_len[0], a.prompt_len[1], seed, split=split)
        conts = continue_greedily(model_dir, prompts, a.gen_len, device=a.device)
        data[split] = target_features(model_dir, list(zip(prompts, conts)), aux_layers, a.top_k, device=a.device,
                                        context=a.context)
    data["vocab"] = draft_vocab(data["train"], a.draft_vocab, cfg.vocab_size)
    return data


def warm_start(head, ref_w: dict, cfg: ModelConfig) -> None:
    """lm_head from the target's rows of the draft vocab (scaled as the target's logits), the final
    norm from the target's: the head starts by reading its hidden state as the target would."""
    ids = head.target_ids(torch.arange(head.cfg.draft_vocab_size))
    with torch.no_grad():
        head.lm_head.weight.copy_(ref_w["lm_head.weight"][ids] / cfg.logit_divisor)
        head.norm.weight.copy_(ref_w["model.norm.weight"])


def lam_of(acc: float, a) -> float:
    x = (acc - a.lam_from) / max(1e-6, a.lam_to - a.lam_from)
    return a.lam_max * min(1.0, max(0.0, x))


@torch.no_grad()
def evaluate(head, samples, t2d_index, steps: int, batch: int) -> dict:
    head.eval()
    matches, valids, lengths, weights = [0] * steps, [0] * steps, [], []
    for i in range(0, len(samples), batch):
        chunk = samples[i:i + batch]
        outs = ttt_forward(head, batch_tensors(chunk, t2d_index, head.cfg.draft_vocab_size, [0] * len(chunk)),
                           steps)
        res = [step_losses(head, o) for o in outs]
        for s, r in enumerate(res):
            matches[s] += int(r["match"].sum())
            valids[s] += int(r["valid"].sum())
        lengths.append(accept_length(res))
        weights.append(int(outs[-1]["valid"].sum()))
    head.train()
    return {"acc": [m / max(1, v) for m, v in zip(matches, valids)],
            "accept_length": sum(x * w for x, w in zip(lengths, weights)) / max(1, sum(weights))}


def main(argv=None) -> int:
    a = parse_args(argv)
    from salaserve.model.default import default_model_dir
    from salaserve.model.loader import load_state_dict

    if a.threads:
        torch.set_num_threads(a.threads)
    model_dir = a.model or default_model_dir()
    cfg = ModelConfig.from_pretrained(model_dir)
    os.makedirs(a.out, exist_ok=True)
    state_path, data_path = os.path.join(a.out, "state.pt"), os.path.join(a.out, "data.pt")
    hcfg = Eagle3Config.for_target(cfg, draft_vocab_size=a.draft_vocab)
    hcfg.prompt_context = a.context  # (serving then hands the drafter no more of the prompt)
    t0 = time.perf_counter()
    if os.path.isfile(data_path):
        data = torch.load(data_path)
    else:
        data = collect(a, model_dir, cfg, hcfg.aux_layer_ids)
        torch.save(data, data_path)
    collect_s = time.perf_counter() - t0
    hcfg.draft_vocab_size = int(data["vocab"].numel())
    ref_w = load_state_dict(model_dir, cfg, dtype=torch.float32, device="cpu")
    head = init_head(hcfg, seed=a.seed)
    head.set_vocab_map(data["vocab"])
    warm_start(head, ref_w, cfg)
    head.attach_target(ref_w["model.embed_tokens.weight"], cfg.scale_emb)
    head.embed.requires_grad_(False)
    t2d_index = torch.full((cfg.vocab_size,), -1, dtype=torch.long)
    t2d_index[data["vocab"]] = torch.arange(data["vocab"].numel())
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=a.lr, weight_decay=0.0,
                            betas=(0.9, 0.95))
    step, acc_ema, curves, train_s = 0, 0.0, [], 0.0
    rng = random.Random(a.seed)
    if a.resume and os.path.isfile(state_path):
        st = torch.load(state_path, weights_only=False)
        head.load_state_dict(st["head"])
        opt.load_state_dict(st["opt"])
        step, acc_ema, curves, train_s = st["step"], st["acc_ema"], st["curves"], st["train_s"]
        rng.setstate(st["rng"])
    max_offset = a.max_offset if a.max_offset is not None else cfg.max_position_embeddings

    def save():
        save_eagle3(head, os.path.join(a.out, "head"))
        torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "step": step, "acc_ema": acc_ema,
                    "curves": curves, "train_s": train_s, "rng": rng.getstate(), "args": vars(a)}, state_path)
        with open(os.path.join(a.out, "curves.json"), "w") as f:
            json.dump({"args": vars(a), "collect_seconds": collect_s, "train_seconds": train_s, "curves": curves},
                      f, indent=1)

    train = data["train"]
    bar = tqdm(total=a.steps, initial=step, desc="train-draft", unit="step")
    head.train()
    stop = min(a.steps, a.stop_at or a.steps)
    while step < stop and (a.minutes is None or train_s < a.minutes * 60):
        ts = time.perf_counter()
        chunk = rng.sample(train, min(a.batch_size, len(train)))
        offsets = [rng.randint(0, max(0, max_offset - s["pos0"] - s["aux"].shape[0] - 1)) if rng.random() < 0.5 else 0
                   for s in chunk]
        outs = ttt_forward(head, batch_tensors(chunk, t2d_index, hcfg.draft_vocab_size, offsets), a.ttt_steps)
        res = [step_losses(head, o) for o in outs]
        lam = lam_of(acc_ema, a)
        loss = sum(a.step_decay ** s * ((1 - lam) * r["kl"] + lam * r["tv"]) for s, r in enumerate(res))
        lr = a.lr * min(1.0, (step + 1) / a.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / a.steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        step += 1
        acc1 = float(res[0]["match"].sum()) / max(1, int(res[0]["valid"].sum()))
        acc_ema = acc1 if step == 1 else 0.9 * acc_ema + 0.1 * acc1
        train_s += time.perf_counter() - ts
        bar.update(1)
        loss = loss.detach()
        bar.set_postfix(loss=f"{float(loss):.3f}", acc1=f"{acc_ema:.3f}", lam=f"{lam:.2f}")
        if step % a.log_every == 0 or step == stop:
            point = {"step": step, "seconds": round(train_s, 1), "loss": float(loss), "lam": lam, "lr": lr,
                     "kl": [r["kl"].item() for r in res], "tv": [r["tv"].item() for r in res],
                     "train_acc": [float(r["match"].sum()) / max(1, int(r["valid"].sum())) for r in res],
                     "train_accept_length": accept_length(res)}
            if step % (a.log_every * 5) == 0 or step == stop:
                point["heldout"] = evaluate(head, data["heldout"], t2d_index, a.ttt_steps, a.batch_size)
            curves.append(point)
            save()
    bar.close()
    final = evaluate(head, data["heldout"], t2d_index, a.ttt_steps, a.batch_size)
    curves.append({"step": step, "seconds": round(train_s, 1), "heldout": final})
    save()
    print(json.dumps({"steps": step, "train_seconds": round(train_s, 1), "collect_seconds": round(collect_s, 1),
                      "heldout": final, "head": os.path.join(a.out, "head")}, indent=1))
    return 0
