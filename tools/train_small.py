"""Train the built-in small MiniCPM-SALA-architecture model on Python sources.

    python -m tools.small_data --out .corpus/code.jsonl.xz
    python -m tools.train_small --out OUT/default_model --minutes 5 --seed 0 \
        --extra-corpus .corpus/code.jsonl.xz --stdlib-repeat 2 --chat-examples 20000

trains (bf16 autocast on CUDA), keeps the weights with the best validation loss, writes an HF
checkpoint (config.json, generation_config.json, tokenizer files, model.safetensors in bf16,
README.md) and runs the held-out evaluation (`tools.eval_small`) into metrics.json.
Copy the directory to salaserve/assets/default_model/ to ship it.

Data: the training split of `salaserve.model.corpus` (the stdlib), minus every 20th of its files
(offset 10) which is kept as a validation set for checkpoint selection and early annealing; the
held-out split is only read by the final evaluation. Optionally more code (`--extra-corpus`, the
permissively licensed packages `tools.small_data` collects, with stdlib copies left out) and chat
exchanges made from documented functions (`--chat-examples`). Each file is one
document, `<s>` + text + `</s>`; training windows of seq_len + 1 tokens start at uniformly random
offsets of the concatenated stream.

Optimiser: AdamW with the muP learning-rate rule MiniCPM uses: matrices get lr / width_mult
(width_mult = hidden_size / dim_model_base), the embedding and norm weights the base lr; init
std is initializer_range / sqrt(width_mult) for matrices (see `TrainModel.init_weights`). Schedule: linear warm-up, constant,
then linear decay to zero over the last `--decay-frac` of the steps (warmup-stable-decay).

Step budget: `--steps N` fixes it (reproducible from the seed). With `--minutes M` instead, the
first `--probe-steps` steps are timed and the budget is set from them; and the decay starts
early when the validation loss has not improved for `--patience` evaluations (the stdlib alone is
~2M tokens, so a long constant phase would overfit). metrics.json records the realised
schedule as a command (`reproduce`) that replays the run without any timing decision: the same
data order, init, dropout masks and lr at every step (exact on CPU; on CUDA, atomics in some
backward kernels make the last bits differ; and only for runs of at least 5 x warmup steps,
shorter ones shrink the warm-up after the probe).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from salaserve.config import ModelConfig, preset_config
from salaserve.model.corpus import read_corpus_file, stdlib_dir
from tools.small_data import chat_texts, encode_documents, encode_texts, load_tokenizer, read_corpus, train_val_files
from tools.train_model import TrainModel

# Every GPU run carries the whole working tree, shipped weights included, within 64 MiB (with the
# wheels and, for training, the corpus): the checkpoint must leave room for them.
MAX_CHECKPOINT_BYTES = 35 * 10**6


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


class TokenStream:
    """All documents concatenated; random training windows and fixed evaluation windows."""

    def __init__(self, docs: list[list[int]], device):
        self.tokens = torch.tensor([t for d in docs for t in d], dtype=torch.long, device=device)

    def __len__(self) -> int:
        return self.tokens.numel()

    def random_batch(self, batch_size: int, seq_len: int, gen: torch.Generator):
        if len(self) < seq_len + 1:
            raise ValueError(f"only {len(self)} training tokens, fewer than seq_len + 1 = {seq_len + 1}")
        starts = torch.randint(0, len(self) - seq_len, (batch_size,), generator=gen).to(self.tokens.device)
        w = self.tokens[starts[:, None] + torch.arange(seq_len + 1, device=self.tokens.device)]
        return w[:, :-1], w[:, 1:]

    def eval_windows(self, seq_len: int) -> torch.Tensor:
        """Consecutive windows of seq_len + 1 tokens, overlapping by one (each target once);
        a short tail is dropped. [n, seq_len + 1]."""
        n = (len(self) - 1) // seq_len
        if n == 0:
            raise ValueError(f"only {len(self)} tokens, fewer than seq_len + 1 = {seq_len + 1}")
        idx = torch.arange(n, device=self.tokens.device)[:, None] * seq_len + torch.arange(
            seq_len + 1, device=self.tokens.device)
        return self.tokens[idx]


def training_texts(stdlib_files: list[str], stdlib_repeat: int, extra_corpus: str | None,
                   chat_examples: int) -> tuple[list[str], dict]:
    """The training documents: the stdlib training files (`stdlib_repeat` times, as the held-out
    evaluation is stdlib code), the extra corpus' files and up to `chat_examples` chat
    exchanges made from all of them (both from `tools.small_data`). Returns the texts
    and their counts."""
    stdlib = [read_corpus_file(p) for p in stdlib_files]
    extra = [d["text"] for d in read_corpus(extra_corpus)] if extra_corpus else []
    chats = chat_texts(stdlib + extra, chat_examples) if chat_examples else []
    composition = {"stdlib_files": len(stdlib), "stdlib_repeat": stdlib_repeat, "extra_files": len(extra),
                   "chat_examples": len(chats)}
    return stdlib * stdlib_repeat + extra + chats, composition


# ---------------------------------------------------------------------------------------------
# Optimiser and schedule
# ---------------------------------------------------------------------------------------------


def param_groups(model: TrainModel, lr: float, weight_decay: float) -> list[dict]:
    """muP (MiniCPM): matrices lr / width_mult with weight decay; embedding and norms base lr."""
    cfg = model.cfg
    width_mult = cfg.hidden_size / cfg.dim_model_base
    matrices, embedding, vectors = [], [], []
    for name, p in model.named_parameters():
        if p.ndim == 1:
            vectors.append(p)
        elif name == "model.embed_tokens.weight":
            embedding.append(p)
        else:
            matrices.append(p)
    return [
        {"params": matrices, "lr": lr / width_mult, "weight_decay": weight_decay, "name": "matrices"},
        {"params": embedding, "lr": lr, "weight_decay": 0.0, "name": "embedding"},
        {"params": vectors, "lr": lr, "weight_decay": 0.0, "name": "norms"},
    ]


@dataclass
class Schedule:
    """Warmup-stable-decay: lr factor ramps to 1 over `warmup` steps, stays at 1 until
    `decay_start`, then falls linearly to 0 at `total`."""

    warmup: int
    decay_start: int
    total: int

    def factor(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if step < self.decay_start:
            return 1.0
        return max(0.0, (self.total - step) / max(1, self.total - self.decay_start))


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------


def autocast(device: torch.device, enabled: bool):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


@torch.no_grad()
def mean_loss(model: TrainModel, windows: torch.Tensor, batch_size: int, bf16: bool) -> float:
    """Mean next-token loss (nats) over evaluation windows [n, T+1], dropout off."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch_size):
        w = windows[i:i + batch_size]
        with autocast(w.device, bf16):
            loss = model.loss(w[:, :-1], w[:, 1:], reduction="sum")
        total += loss.item()
        count += w[:, 1:].numel()
    model.train(was_training)
    return total / count


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def log(msg: str) -> None:
    print(msg, flush=True)


def train(args, cfg: ModelConfig, tok, device: torch.device) -> tuple[TrainModel, dict]:
    """Train per `args`; returns the model holding the best-validation weights and a record."""
    torch.manual_seed(args.seed)
    bf16 = device.type == "cuda" and not args.fp32

    t0 = time.perf_counter()
    train_files, val_files = train_val_files(args.max_train_files)
    train_texts, composition = training_texts(train_files, args.stdlib_repeat, args.extra_corpus, args.chat_examples)
    train_data = TokenStream(encode_texts(tok, train_texts), device)
    val_data = TokenStream(encode_documents(tok, val_files), device)
    val_windows = val_data.eval_windows(min(args.seq_len, len(val_data) - 1))
    if args.max_val_tokens is not None:  # quick runs: a prefix of the validation windows
        val_windows = val_windows[:max(1, args.max_val_tokens // args.seq_len)]
    log(f"data: {composition}; {len(train_data):,} tokens; {len(val_files)} validation "
        f"files, {len(val_data):,} tokens ({time.perf_counter() - t0:.1f} s)")

    model = TrainModel(cfg, dropout=args.dropout).to(device)
    model.init_weights(args.seed, init_std=cfg.initializer_range)
    model.train()
    groups = param_groups(model, args.lr, args.weight_decay)
    for g in groups:
        g["base_lr"] = g["lr"]
    fused = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW(groups, betas=(0.9, 0.95), eps=1e-8, **fused)
    step_fn = torch.compile(model) if args.compile else model
    gen = torch.Generator().manual_seed(args.seed + 1)

    tokens_per_step = args.batch_size * args.seq_len
    steps_per_epoch = max(1, len(train_data) // tokens_per_step)
    eval_every = args.eval_every or max(10, steps_per_epoch)
    max_steps_by_epochs = int(args.max_epochs * len(train_data) / tokens_per_step) if args.max_epochs else None
    fixed = args.steps is not None
    if fixed:
        total = args.steps
        warmup = max(1, min(args.warmup, total // 5))
        decay_start = args.decay_start if args.decay_start is not None else total - round(args.decay_frac * total)
        sched = Schedule(warmup, decay_start, total)
    else:  # the total is set after the timing probe; nothing decays before then
        warmup = args.warmup
        sched = Schedule(warmup, 10**12, 10**12)
    planned = fixed
    record: dict = {"events": [], "history": []}

    best = {"val": mean_loss(model, val_windows, args.batch_size, bf16), "step": 0, "state": None}
    record["initial_val_loss"] = best["val"]
    log(f"step 0: val {best['val']:.4f}")
    best["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    no_improve = 0
    train_losses: list[float] = []
    t_train = time.perf_counter()
    t_probe_start = None
    step = 0
    while step < sched.total:
        for g in opt.param_groups:
            g["lr"] = g["base_lr"] * sched.factor(step)
        x, y = train_data.random_batch(args.batch_size, args.seq_len, gen)
        with autocast(device, bf16):
            loss = next_token_loss(step_fn, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        step += 1
        if step % args.log_every == 0 or step == sched.total or step <= 3:
            train_losses.append(loss.item())
            elapsed = time.perf_counter() - t_train
            log(f"step {step}/{sched.total if sched.total < 10**12 else '?'}: loss {train_losses[-1]:.4f} "
                f"lr {opt.param_groups[0]['lr']:.2e} {step * tokens_per_step / elapsed:,.0f} tok/s "
                f"{elapsed:.0f} s")

        # Timing probe (time budget mode): fix the number of steps.
        if not fixed and step == 3:
            _sync(device)
            t_probe_start = time.perf_counter()
        if not fixed and step == args.probe_steps:
            _sync(device)
            t_step = (time.perf_counter() - t_probe_start) / (args.probe_steps - 3)
            t_eval0 = time.perf_counter()
            mean_loss(model, val_windows, args.batch_size, bf16)
            _sync(device)
            t_eval = time.perf_counter() - t_eval0
            remaining = args.minutes * 60 - (time.perf_counter() - t_train)
            total = step + int(remaining / (t_step + t_eval / eval_every))
            if max_steps_by_epochs is not None:
                total = min(total, max_steps_by_epochs)
            total = max(total, step + 1)
            sched = Schedule(min(warmup, max(1, total // 5)), total - round(args.decay_frac * total), total)
            planned = True
            record["events"].append({"step": step, "event": "planned", "total": total,
                                     "seconds_per_step": t_step, "seconds_per_eval": t_eval})
            log(f"probe: {t_step * 1e3:.1f} ms/step ({tokens_per_step / t_step:,.0f} tok/s), eval "
                f"{t_eval:.2f} s -> {total} steps ({total * tokens_per_step / len(train_data):.1f} epochs)")

        if step % eval_every == 0 or step == sched.total:
            val = mean_loss(model, val_windows, args.batch_size, bf16)
            epochs = step * tokens_per_step / len(train_data)
            record["history"].append({"step": step, "epochs": round(epochs, 3), "val_loss": val,
                                      "lr_factor": sched.factor(step - 1)})
            improved = val < best["val"] - args.min_delta
            if val < best["val"]:
                best.update(val=val, step=step, state={k: v.detach().clone() for k, v in model.state_dict().items()})
            no_improve = 0 if improved else no_improve + 1
            log(f"step {step}: val {val:.4f} (best {best['val']:.4f} at {best['step']}), {epochs:.1f} epochs")
            # Early annealing: the validation loss stalled while the lr is still constant.
            if (planned and not fixed and args.patience and no_improve >= args.patience
                    and sched.warmup <= step < sched.decay_start):
                decay = max(1, round(step * args.decay_frac / (1 - args.decay_frac)))
                sched = Schedule(sched.warmup, step, step + decay)
                record["events"].append({"step": step, "event": "early_decay", "total": sched.total})
                log(f"validation stalled for {no_improve} evaluations: decaying over {decay} steps")
    _sync(device)
    train_seconds = time.perf_counter() - t_train

    model.load_state_dict(best["state"])
    record.update(
        steps=step, warmup=sched.warmup, decay_start=sched.decay_start, eval_every=eval_every,
        batch_size=args.batch_size,
        seq_len=args.seq_len, tokens_per_step=tokens_per_step, tokens_seen=step * tokens_per_step,
        epochs=step * tokens_per_step / len(train_data), train_seconds=train_seconds,
        tokens_per_second=step * tokens_per_step / train_seconds, best_val_loss=best["val"],
        best_step=best["step"], final_train_loss=train_losses[-1] if train_losses else None,
        first_train_loss=train_losses[0] if train_losses else None,
        train_files=len(train_files), train_composition=composition, train_tokens=len(train_data),
        val_files=len(val_files), val_tokens=len(val_data), precision="bf16 autocast" if bf16 else "fp32",
    )
    record["train_token_counts"] = torch.bincount(train_data.tokens, minlength=cfg.vocab_size).cpu()
    return model, record


def next_token_loss(forward, x, y):
    """Mean cross-entropy; `forward` is the model or its torch.compile'd wrapper."""
    return F.cross_entropy(forward(x).flatten(0, 1), y.flatten())


# ---------------------------------------------------------------------------------------------
# Checkpoint
# ---------------------------------------------------------------------------------------------


def save_checkpoint(model: TrainModel, out_dir: str) -> int:
    """HF layout: config.json, generation_config.json, model.safetensors (bf16). Returns bytes."""
    from safetensors.torch import save_file

    from salaserve.model.checkpoint import write_config_files

    # No auto_map: the directory has no modeling code, and transformers would otherwise ask
    # whether to run remote code each time the tokenizer is loaded.
    extra = {k: v for k, v in model.cfg.extra.items() if k != "auto_map"}
    write_config_files(out_dir, dataclasses.replace(model.cfg, extra=extra))
    path = os.path.join(out_dir, "model.safetensors")
    save_file(model.hf_state_dict(torch.bfloat16), path, metadata={"format": "pt"})
    return os.path.getsize(path)


def training_sources(composition: dict) -> str:
    parts = ["the standard library's training split"]
    if composition.get("extra_files"):
        parts.append(f"{composition['extra_files']:,} files of permissively licensed packages (`tools.small_data`)")
    if composition.get("chat_examples"):
        parts.append(f"{composition['chat_examples']:,} chat exchanges made from documented functions "
                     "(`tools.small_data`)")
    return ", ".join(parts)


def model_card(cfg: ModelConfig, metrics: dict) -> str:
    t = metrics["training"]
    ev = metrics.get("eval", {})
    ppl = ev.get("perplexity", {})
    comp = ev.get("completion", {})
    lines = [
        "# salaserve default model",
        "",
        "A small model with the MiniCPM-SALA architecture (InfLLM-v2 sparse attention layers 0 and "
        f"{cfg.num_hidden_layers - 1}, Lightning simple-GLA layers in between, muP scalings), trained by "
        "`tools.train_small` on Python sources: " + training_sources(t.get("train_composition", {})) + ". "
        "It writes Python and answers requests for functions in chat; it is a quality yardstick and a "
        "working default, not a general assistant.",
        "",
        f"- parameters: {metrics['parameters']['total']:,} ({metrics['parameters']['embedding']:,} in "
        f"embed_tokens + lm_head, {metrics['parameters']['non_embedding']:,} other)",
        f"- hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, {cfg.num_attention_heads} heads x "
        f"{cfg.head_dim} ({cfg.num_key_value_heads} KV heads), vocab {cfg.vocab_size}, sparse_config "
        f"{json.dumps(metrics['config']['sparse_config'])}",
        f"- training: {t['steps']} steps x {t['tokens_per_step']:,} tokens ({t['epochs']:.1f} epochs of "
        f"{t['train_tokens']:,} tokens), context {t['seq_len']}, {t['train_seconds'] / 60:.1f} min on "
        f"{metrics['environment']['device']}; best validation loss {t['best_val_loss']:.4f} nats/token",
    ]
    if ppl:
        lines.append(f"- held-out ({ppl['files']} files, {ppl['tokens']:,} tokens): {ppl['nats_per_token']:.4f} "
                     f"nats/token (ppl {ppl['ppl']:.2f}); add-one unigram {ppl['unigram_nats_per_token']:.4f} "
                     f"(ppl {ppl['unigram_ppl']:.1f})")
    chat = ev.get("chat", {})
    if chat:
        lines.append(f"- chat ({chat['n']} requests for a function, greedy): {chat['answers_ok']:.2f} answer with a "
                     "parsing function of the requested name")
    if comp:
        lines.append(f"- completion of {comp['n']} held-out functions (greedy, through salaserve.engine.llm.LLM): "
                     f"next line exact {comp['next_line_exact']:.2f}, first 3 lines exact "
                     f"{comp['first3_exact']:.2f}, body parses {comp['body_parses']:.2f}")
    lines += ["", "Reproduce: `" + metrics["reproduce"] + "`", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m tools.train_small", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output model directory")
    p.add_argument("--preset", default="small", choices=["small", "tiny"])
    p.add_argument("--seed", type=int, default=0)
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--minutes", type=float, default=8.0, help="training time budget (default 8)")
    budget.add_argument("--steps", type=int, default=None, help="fixed number of steps (reproducible)")
    p.add_argument("--decay-start", type=int, default=None, help="with --steps: step where the lr decay starts")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--lr", type=float, default=1e-2, help="base lr; matrices get lr / width_mult")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--decay-frac", type=float, default=0.2)
    p.add_argument("--max-epochs", type=float, default=None, help="cap on the planned steps (time mode)")
    p.add_argument("--eval-every", type=int, default=None, help="validation interval (default: 1 epoch)")
    p.add_argument("--patience", type=int, default=3, help="stalled validations before early decay (0: off)")
    p.add_argument("--min-delta", type=float, default=0.002, help="validation improvement that counts (nats)")
    p.add_argument("--probe-steps", type=int, default=30)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--max-train-files", type=int, default=None, help="use only the first N files (tests)")
    p.add_argument("--stdlib-repeat", type=int, default=1, help="times the stdlib training files are included")
    p.add_argument("--extra-corpus", default=None, help="more training files: a tools.small_data corpus")
    p.add_argument("--chat-examples", type=int, default=0, help="chat exchanges made from the training code")
    p.add_argument("--max-val-tokens", type=int, default=None, help="validate on about N tokens only (CPU runs)")
    p.add_argument("--device", default="auto")
    p.add_argument("--fp32", action="store_true", help="no bf16 autocast on CUDA")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (1 avoids OpenMP spinning on busy CPUs)")
    p.add_argument("--compile", action="store_true", help="torch.compile the training forward (experimental)")
    p.add_argument("--no-eval", action="store_true", help="skip the held-out evaluation and the guard sample")
    p.add_argument("--eval-functions", type=int, default=50)
    p.add_argument("--eval-max-new-tokens", type=int, default=128)
    p.add_argument("--eval-backend", default="auto", help="kernel backend for the completion task")
    a = p.parse_args(argv)
    if a.steps is not None:
        a.minutes = None
    if a.probe_steps < 5:
        p.error("--probe-steps must be >= 5")
    return a


def main(argv=None) -> dict:
    args = parse_args(argv)
    from salaserve.model.tokenizer import write_tokenizer

    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # fp32 GLA / stage-1 matmuls: TF32 is plenty for training
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = preset_config(args.preset)
    os.makedirs(args.out, exist_ok=True)
    write_tokenizer(args.out, cfg.vocab_size)
    tok = load_tokenizer(args.out)

    t_start = time.perf_counter()
    model, record = train(args, cfg, tok, device)
    nbytes = save_checkpoint(model, args.out)
    log(f"wrote {args.out}: model.safetensors {nbytes / 1e6:.2f} MB")
    if nbytes > MAX_CHECKPOINT_BYTES:
        log(f"WARNING: the checkpoint is larger than {MAX_CHECKPOINT_BYTES / 1e6:.0f} MB")

    emb = 2 * cfg.vocab_size * cfg.hidden_size
    counts = record.pop("train_token_counts")
    # Everything that shapes the weights, with the realised schedule instead of the time budget.
    flags = {"preset": args.preset, "seed": args.seed, "steps": record["steps"], "decay-start": record["decay_start"],
             "warmup": record["warmup"], "eval-every": record["eval_every"], "batch-size": args.batch_size,
             "seq-len": args.seq_len, "lr": args.lr, "weight-decay": args.weight_decay, "dropout": args.dropout,
             "grad-clip": args.grad_clip, "max-train-files": args.max_train_files,
             "max-val-tokens": args.max_val_tokens, "stdlib-repeat": args.stdlib_repeat,
             "extra-corpus": args.extra_corpus, "chat-examples": args.chat_examples}
    reproduce = "python -m tools.train_small --out OUT " + " ".join(
        f"--{k} {v}" for k, v in flags.items() if v is not None) + (" --fp32" if args.fp32 else "")
    metrics = {
        "format": 1,
        "config": cfg.to_dict(),
        "parameters": {"total": cfg.num_parameters(), "embedding": emb, "non_embedding": cfg.num_parameters() - emb},
        "checkpoint_bytes": nbytes,
        "args": vars(args),
        "reproduce": reproduce,
        "training": record,
        "environment": {
            "python": platform.python_version(), "torch": torch.__version__,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "stdlib": stdlib_dir(),
        },
    }
    if not args.no_eval:
        from tools import eval_small

        del model  # evaluate what was written: the bf16 checkpoint
        metrics["eval"] = eval_small.evaluate(
            args.out, device=device, train_counts=counts, ctx=args.seq_len,
            n_functions=args.eval_functions, max_new_tokens=args.eval_max_new_tokens,
            backend=args.eval_backend, max_train_files=args.max_train_files,
        )
        metrics["guard"] = eval_small.make_guard(args.out, tok)
    metrics["total_seconds"] = time.perf_counter() - t_start
    with open(os.path.join(args.out, "metrics.json"), "w", encoding="utf-8") as f:
        json.dump(metrics, f, indent=1, default=str)
        f.write("\n")
    with open(os.path.join(args.out, "README.md"), "w", encoding="utf-8") as f:
        f.write(model_card(cfg, metrics))
    log(f"done in {metrics['total_seconds'] / 60:.1f} min; metrics in {os.path.join(args.out, 'metrics.json')}")
    return metrics


if __name__ == "__main__":
    main()
    sys.exit(0)
