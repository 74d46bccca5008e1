"""Train-time test: the head's multi-step forward over a batch, as drafting runs it.

Step 1 at index c reads (fc(target aux at c), token c + 1) at position c and predicts the target's
distribution at c + 1. Step s > 1 at index c reads (the head's own step s-1 output at c, token
c + s) at position c + s - 1 and predicts the target at c + s: the hidden state the drafter feeds
back. Its keys: step 1's at indices <= c (the committed context) and steps 2..s at index c only
(the draft chain it extends), exactly the drafter's cache + ancestors.

The loss mixes forward KL (a good warm start: dense gradients) and total variation (1 - TV is the
acceptance rate of sampled speculation; TV ignores mass the draft cannot use) with weight lam,
which the trainer raises as the greedy acceptance rises.
"""

from __future__ import annotations

import torch


def batch_tensors(samples: list[dict], t2d_index: torch.Tensor, draft_size: int, offsets: list[int],
                  sink: int = 4) -> dict:
    """Pad a list of samples (spec_train.data) to [B, m]; target distributions scattered onto the
    draft vocab (t2d_index: target id -> draft id or -1). offsets: a RoPE position offset per
    sample, added to positions >= sink (the first tokens keep theirs: attention sinks)."""
    B, m = len(samples), max(s["aux"].shape[0] for s in samples)
    H3 = samples[0]["aux"].shape[1]
    aux = torch.zeros(B, m, H3)
    nxt = torch.full((B, m), -1, dtype=torch.long)
    base = torch.zeros(B, m, dtype=torch.long)
    p = torch.zeros(B, m, draft_size)
    top1 = torch.full((B, m), -1, dtype=torch.long)
    length = torch.zeros(B, dtype=torch.long)
    for b, s in enumerate(samples):
        n = s["aux"].shape[0]
        length[b] = n
        aux[b, :n] = s["aux"].float()
        nxt[b, :n] = s["next"]
        absolute = s["pos0"] + torch.arange(m)
        base[b] = torch.where(absolute >= sink, absolute + offsets[b], absolute)
        d = t2d_index[s["top_ids"].long()]  # [n, K]
        keep = d >= 0
        p[b, :n].scatter_add_(-1, d.clamp(min=0), s["top_p"].float() * keep)
        top1[b, :n] = s["top_ids"][:, 0].long()
    return {"aux": aux, "next": nxt, "base": base, "p": p, "top1": top1, "length": length}


def _shift(x: torch.Tensor, s: int, fill) -> torch.Tensor:
    """x[:, c + s] at index c (fill past the end)."""
    if s == 0:
        return x
    out = torch.full_like(x, fill)
    out[:, :-s] = x[:, s:]
    return out


def ttt_forward(head, t: dict, steps: int) -> list[dict]:
    """Per step: draft-vocab logits [B, m, Vd], target p [B, m, Vd], target top-1 (target ids),
    and the mask of indices where the step is defined."""
    aux, nxt, base, length = t["aux"], t["next"], t["base"], t["length"]
    B, m = nxt.shape
    idx = torch.arange(m)
    real = idx[None, :] < length[:, None]  # [B, m]
    causal = (idx[None, :] <= idx[:, None])[None] & real[:, None, :]  # [B, m(q), m(k)]
    eye = torch.eye(m, dtype=torch.bool).expand(B, m, m)
    hidden = head.fuse(aux)
    past_k = past_v = None
    out = []
    for s in range(1, steps + 1):
        tok = _shift(nxt, s - 1, -1)  # token c + s
        pos = _shift(base, s - 1, 0)  # position c + s - 1 (with the sample's offset)
        mask = torch.cat([causal] + [eye] * (s - 1), dim=-1)  # context, then the chain's own keys
        emb = head.embed_tokens(tok.clamp(min=0))
        hidden, k, v = head.layer(emb, hidden, pos, past_k, past_v, mask)
        past_k = k if past_k is None else torch.cat([past_k, k], dim=1)
        past_v = v if past_v is None else torch.cat([past_v, v], dim=1)
        valid = real & (idx[None, :] + s < length[:, None])  # the target at c + s exists
        out.append({"logits": head.logits(hidden), "p": _shift_3d(t["p"], s), "top1": _shift(t["top1"], s, -1),
                    "valid": valid})
    return out


def _shift_3d(x: torch.Tensor, s: int) -> torch.Tensor:
    out = torch.zeros_like(x)
    out[:, :-s] = x[:, s:]
    return out


def step_losses(head, o: dict) -> dict:
    """Forward KL (cross-entropy to p, up to p's entropy), TV and greedy matches of one step."""
    logq = torch.log_softmax(o["logits"], dim=-1)
    q = logq.exp()
    v = o["valid"]
    n = v.sum().clamp(min=1)
    ce = -(o["p"] * logq).sum(-1)
    tv = 0.5 * (o["p"] - q).abs().sum(-1)
    match = head.target_ids(o["logits"].argmax(-1)) == o["top1"]
    return {"kl": (ce * v).sum() / n, "tv": (tv * v).sum() / n, "match": match & v, "valid": v}


def accept_length(steps: list[dict]) -> float:
    """Mean tokens per verify step of greedy chain drafting at the full depth, over the indices
    where every step is defined: 1 + the leading run of matches."""
    full = steps[-1]["valid"]
    run = torch.ones_like(full, dtype=torch.long)
    alive = torch.ones_like(full)
    for o in steps:
        alive = alive & o["match"]
        run = run + alive.long()
    n = int(full.sum())
    return float((run * full).sum()) / n if n else 0.0
