"""Training data for an EAGLE-3 head: the target's own continuations and its hidden states.

Prompts are random windows of the corpus's training split; the target continues each greedily
through the engine (so the head learns what the target says, not what the corpus says). The
reference model then reads prompt + continuation once and gives, from the prompt's last `context`
positions on (where a drafter's context starts: the engine's prefill captures the hidden states of
the prompt's last speculative_eagle_window positions), the three aux hidden states and the
target's top-k next-token distribution.

A sample (positions c = P-context .. T-1 (from 0 at the least) of a T-token sequence with a
P-token prompt):
  aux [m, 3H] fp16, next [m] (token at c + 1, -1 at the end), pos0 (= max(0, P - context)),
  top_ids [m, K] / top_p [m, K] fp16 (the target's distribution at c, in target ids).
"""

from __future__ import annotations

import random

import torch
from tqdm import tqdm


def corpus_prompts(tok, n: int, min_len: int, max_len: int, seed: int, split: str = "train") -> list[list[int]]:
    """n prompts: BOS + a random window of a random corpus file of the split."""
    from salaserve.model.corpus import read_corpus_file, stdlib_corpus_files
    from salaserve.model.tokenizer import BOS_ID

    rng = random.Random(seed)
    files = stdlib_corpus_files(split)
    out = []
    while len(out) < n:
        ids = tok(read_corpus_file(rng.choice(files)), add_special_tokens=False).input_ids
        length = rng.randint(min_len, max_len)
        if len(ids) < length + 8:
            continue
        start = rng.randint(0, len(ids) - length)
        out.append([BOS_ID] + ids[start:start + length - 1])
    return out


def continue_greedily(model_dir: str, prompts: list[list[int]], new_tokens: int, batch: int = 64,
                      device: str = "cpu") -> list[list[int]]:
    """The target's greedy continuation of each prompt (the serving engine)."""
    from salaserve.core.sampling_params import SamplingParams
    from salaserve.engine.llm import LLM

    llm = LLM(model_dir, device=device, max_running_requests=batch)
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    outs = []
    for i in tqdm(range(0, len(prompts), batch), desc="target continuations", unit="batch"):
        outs += [o.token_ids for o in llm.generate(prompts[i:i + batch], params)]
    return outs


@torch.no_grad()
def target_features(model_dir: str, seqs: list[tuple[list[int], list[int]]], aux_layers, top_k: int = 16,
                    device: str = "cpu", context: int = 1) -> list[dict]:
    """Per (prompt, continuation): the sample dict of the module docstring (reference model)."""
    from salaserve.model.reference import ReferenceModel

    ref = ReferenceModel.from_pretrained(model_dir, dtype=torch.float32, device=device)
    samples = []
    for prompt, cont in tqdm(seqs, desc="target hidden states", unit="seq"):
        ids = prompt + cont
        logits, aux = ref.forward(ids, ref.new_state(), aux_layers=tuple(aux_layers))
        c0 = max(0, len(prompt) - context)
        probs = torch.softmax(logits[c0:], dim=-1)
        top = probs.topk(top_k, dim=-1)
        nxt = torch.tensor(ids[c0 + 1:] + [-1])
        samples.append({"aux": aux[c0:].half(), "next": nxt, "pos0": c0, "top_ids": top.indices.int(),
                        "top_p": top.values.half()})
    return samples


def draft_vocab(samples: list[dict], size: int, vocab_size: int) -> torch.Tensor:
    """The `size` target ids the target most often puts first (sorted): the draft vocabulary."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in samples:
        counts += torch.bincount(s["top_ids"][:, 0].long(), minlength=vocab_size)
    ids = counts.topk(min(size, vocab_size)).indices
    return ids.sort().values
