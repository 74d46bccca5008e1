"""Batched next-token sampler (CPU or CUDA tensors), one row of logits per sequence.

Order of operations, per row (each step only touches the rows that need it):

1. repetition penalty (HF/SGLang): for tokens seen in prompt + output, positive logits are
   divided by the penalty and negative ones multiplied by it;
2. frequency / presence penalties (OpenAI): `logit -= freq * count + pres * (count > 0)`, counts
   over output tokens only;
3. logit_bias (OpenAI, SGLang): each listed token's bias is added to its logit;
   structured output: tokens the request's grammar does not allow next get -inf;
   min_new_tokens: EOS ids and stop_token_ids get -inf until that many tokens were generated
   (whatever ignore_eos says: ignore_eos is the stop logic's business, not the sampler's);
   -- logprobs are read here: log_softmax of the penalised logits, before temperature and
      filtering (SGLang with SGLANG_RETURN_ORIGINAL_LOGPROB=1; pass
      `logprobs_after_temperature=True` for SGLang's default, which divides by the temperature);
4. temperature;  5. top-k;  6. top-p over what top-k kept (renormalised);  7. min-p (relative to
   the most likely token);  8. draw.

Greedy rows (temperature < 1e-6 or top_k == 1) take the argmax of the penalised logits (ties ->
lowest id) and draw no random numbers.

The draw is an exponential race: token = argmax(p / E) with E ~ Exp(1) i.i.d. per vocabulary
entry, which picks token i with probability p_i / sum(p). Its noise is indexed by token id, so
a seeded row's draw depends only on (seed, step, its own probabilities): never on batch size,
row order or how wide the other rows made the top-k window. Seeded rows re-seed their own
generator with mix(seed, step) each step; unseeded rows share the sampler's generator.
(Streams differ between CPU and CUDA generators: a seed reproduces on the same device kind.)

Penalty state is per request (`SamplingState.counts` / `.seen`, [V] tensors updated in O(1) per
new token); a step stacks the rows that need them, which costs O(V) per row, never O(context).

One host sync per step: ids (and any logprobs, packed into one float64 tensor) come back with a
single `.tolist()`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from salaserve.core.distribution import effective_top_k, keep_mask, mix_seed
from salaserve.core.sampling_params import SamplingParams
from salaserve.engine.grammar import apply_grammar_masks

# Use torch.topk instead of a full sort when every sampled row has top_k <= this.
_TOPK_FAST_MAX = 1024
class SamplingState:
    """One request's sampling state: params, token history and penalty counters.

    Penalty tensors live on the logits' device and are created on first use; `append` updates
    them in O(1), so a step costs O(new tokens), not O(context).
    """

    def __init__(
        self,
        params: SamplingParams,
        prompt_ids: Sequence[int] = (),
        eos_token_ids: Iterable[int] = (),
    ):
        self.params = params
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        # Tokens masked while num_generated < min_new_tokens.
        self.min_tokens_block = sorted(set(eos_token_ids) | set(params.stop_token_ids or ()))
        self.counts: torch.Tensor | None = None  # [V] float32, output-token counts
        self.seen: torch.Tensor | None = None  # [V] bool, tokens in prompt + output
        self._bias: tuple[torch.Tensor, torch.Tensor] | None = None  # logit_bias as (ids, values)
        self._generator: torch.Generator | None = None
        self.grammar = None  # structured output: the request's xgrammar matcher (engine/grammar.py)

    @property
    def num_generated(self) -> int:
        return len(self.output_ids)

    @property
    def needs_freq_presence(self) -> bool:
        return self.params.frequency_penalty != 0.0 or self.params.presence_penalty != 0.0

    @property
    def needs_repetition(self) -> bool:
        return self.params.repetition_penalty != 1.0

    @property
    def blocks_stop(self) -> bool:
        return self.num_generated < self.params.min_new_tokens and bool(self.min_tokens_block)

    def append(self, token_id: int) -> None:
        self.output_ids.append(token_id)
        if self.grammar is not None and not self.grammar.is_terminated():
            self.grammar.accept_token(token_id)
        if self.counts is not None:
            self.counts[token_id] += 1
        if self.seen is not None:
            self.seen[token_id] = True

    def ensure_tensors(self, vocab_size: int, device: torch.device) -> None:
        """Build the penalty tensors once (O(context)); later steps only update them."""
        if self.needs_freq_presence and (self.counts is None or self.counts.device != device):
            out = torch.tensor(self.output_ids, dtype=torch.long)
            self.counts = torch.bincount(out, minlength=vocab_size)[:vocab_size].float().to(device)
        if self.needs_repetition and (self.seen is None or self.seen.device != device):
            seen = torch.zeros(vocab_size, dtype=torch.bool)
            ids = torch.tensor(self.prompt_ids + self.output_ids, dtype=torch.long)
            seen[ids[ids < vocab_size]] = True
            self.seen = seen.to(device)

    def bias_tensors(self, vocab_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """params.logit_bias as (token ids int64, biases fp32) on `device`, ids inside the vocabulary;
        built once, so a step does not rebuild them from the map."""
        if self._bias is None or self._bias[0].device != device:
            items = [(t, b) for t, b in (self.params.logit_bias or {}).items() if t < vocab_size]
            ids = torch.tensor([t for t, _ in items], dtype=torch.long)
            vals = torch.tensor([b for _, b in items], dtype=torch.float32)
            self._bias = ids.to(device), vals.to(device)
        return self._bias

    def generator(self, device: torch.device) -> torch.Generator:
        """This request's generator, positioned for the current step."""
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
        self._generator.manual_seed(mix_seed(self.params.seed, self.num_generated))
        return self._generator


@dataclass
class SampleOutput:
    token_ids: list[int]
    token_tensor: torch.Tensor  # [B] int64 on the logits' device, for the next forward
    # Per row; None for rows that did not ask (or all None when no row asked).
    logprobs: list[float | None] | None = None
    top_logprobs: list[list[tuple[int, float]] | None] | None = None


class Sampler:
    def __init__(self, seed: int | None = None, logprobs_after_temperature: bool = False):
        self.seed = seed  # for unseeded rows; None: torch's default generator
        self.logprobs_after_temperature = logprobs_after_temperature
        self._generators: dict[torch.device, torch.Generator] = {}

    def _global_generator(self, device: torch.device) -> torch.Generator | None:
        if self.seed is None:
            return None
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]

    @torch.no_grad()
    def sample(
        self, logits: torch.Tensor, states: Sequence[SamplingState], commit: bool = True
    ) -> SampleOutput:
        """Pick one token per row. `commit` appends the tokens to the states (penalty counts,
        step counter); pass False to sample without advancing them."""
        logits, next_ids = self._pick(logits, states)
        lp_rows = [i for i, s in enumerate(states) if s.params.wants_logprobs]
        if lp_rows:
            out = self._with_logprobs(logits, states, lp_rows, next_ids)
        else:
            out = SampleOutput(token_ids=next_ids.tolist(), token_tensor=next_ids)
        if commit:
            for s, t in zip(states, out.token_ids):
                s.append(t)
        return out

    @torch.no_grad()
    def sample_on_device(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
        """`sample`'s token ids [B] int64 left on the device (no host sync) and the states not
        advanced: the caller appends each id once it has read them (overlap scheduling). Only
        for rows whose draw does not depend on their history: no penalties, no seed, no
        logprobs (`needs_history`)."""
        if any(needs_history(s) for s in states):
            raise ValueError("sample_on_device: a row needs its token history (penalties, seed or logprobs)")
        return self._pick(logits, states)[1]

    def _pick(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> tuple[torch.Tensor, torch.Tensor]:
        """(penalised fp32 logits, token ids [B] int64 on the logits' device)."""
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(f"logits must be [{len(states)}, V], got {tuple(logits.shape)}")
        device = logits.device
        logits = apply_penalties(logits.float(), states)

        greedy_ids = logits.argmax(dim=-1)
        # Unseeded rows first, so that their noise comes from one generator call.
        rows = [i for i, s in enumerate(states) if not s.params.is_greedy]
        rows.sort(key=lambda i: states[i].params.seed is not None)
        if rows:
            next_ids = greedy_ids.clone()
            next_ids[_to_device(rows, torch.long, device)] = self._sample_rows(logits, states, rows)
        else:
            next_ids = greedy_ids
        return logits, next_ids

    def _sample_rows(
        self, logits: torch.Tensor, states: Sequence[SamplingState], rows: list[int]
    ) -> torch.Tensor:
        """Filtered draw for the non-greedy `rows` (unseeded first); their token ids, in order."""
        device, vocab = logits.device, logits.shape[1]
        ps = [states[i].params for i in rows]
        knobs = _to_device(
            [[p.temperature, effective_top_k(p, vocab), p.top_p, p.min_p] for p in ps], torch.float32, device
        )
        temp, top_k, top_p, min_p = knobs.unbind(1)
        probs = torch.softmax(logits[_to_device(rows, torch.long, device)] / temp[:, None], dim=-1)

        n_free = sum(p.seed is None for p in ps)
        shared = self._global_generator(device)
        noise = [torch.empty(n_free, vocab, device=device).exponential_(generator=shared)]
        for i in rows[n_free:]:
            own = states[i].generator(device)
            noise.append(torch.empty(1, vocab, device=device).exponential_(generator=own))
        # E == 0 would give inf/nan scores; clamping keeps p / E finite.
        noise = torch.cat(noise).clamp_min_(torch.finfo(torch.float32).tiny)

        need_k = any(effective_top_k(p, vocab) < vocab for p in ps)
        need_p = any(p.top_p < 1.0 for p in ps)
        need_min_p = any(p.min_p > 0.0 for p in ps)
        if need_k or need_p:
            width = max(effective_top_k(p, vocab) for p in ps)
            if width <= _TOPK_FAST_MAX:
                sorted_p, sorted_idx = probs.topk(width, dim=-1)
            else:
                sorted_p, sorted_idx = probs.sort(dim=-1, descending=True)
            keep = keep_mask(sorted_p, top_k, top_p, min_p, need_p, need_min_p)
            scores = sorted_p.masked_fill(~keep, 0.0) / noise.gather(1, sorted_idx)
            picked = sorted_idx.gather(1, scores.argmax(dim=-1, keepdim=True)).squeeze(1)
        else:
            if need_min_p:
                floor = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
                probs = probs.masked_fill(probs < floor, 0.0)
            picked = (probs / noise).argmax(dim=-1)
        return picked

    def _with_logprobs(
        self,
        logits: torch.Tensor,
        states: Sequence[SamplingState],
        lp_rows: list[int],
        next_ids: torch.Tensor,
    ) -> SampleOutput:
        device = logits.device
        idx = _to_device(lp_rows, torch.long, device)
        sel = logits[idx]
        if self.logprobs_after_temperature:
            ps = [states[i].params for i in lp_rows]
            temps = [1.0 if p.is_greedy else p.temperature for p in ps]
            sel = sel / _to_device(temps, torch.float32, device)[:, None]
        n_top = max(states[i].params.top_logprobs for i in lp_rows)
        ids, lp_vals, row_tops = read_logprobs(torch.log_softmax(sel, dim=-1), next_ids[idx], n_top, head=next_ids)

        b = len(states)
        logprobs: list[float | None] = [None] * b
        tops: list[list[tuple[int, float]] | None] = [None] * b
        for j, i in enumerate(lp_rows):
            logprobs[i] = lp_vals[j]
            tops[i] = row_tops[j][:states[i].params.top_logprobs]
        return SampleOutput([int(t) for t in ids], next_ids, logprobs=logprobs, top_logprobs=tops)


def read_logprobs(lsm: torch.Tensor, targets: torch.Tensor, n_top: int, head: torch.Tensor | None = None):
    """From log-softmax rows lsm [m, V] and a target token per row: (head's values, the targets'
    logprobs, each row's n_top best [(token id, logprob), ...]), in one host read (`head`, an
    optional tensor, rides along in it: e.g. a step's sampled ids)."""
    parts = ([head.double()] if head is not None else []) + [lsm.gather(1, targets[:, None]).squeeze(1).double()]
    if n_top:
        top_lp, top_id = lsm.topk(n_top, dim=-1)
        parts += [top_lp.double().flatten(), top_id.double().flatten()]
    flat = torch.cat(parts).tolist()  # the one host sync
    h, m = (0 if head is None else head.numel()), targets.numel()
    vals, ids = flat[h + m:h + m + m * n_top], flat[h + m + m * n_top:]
    tops = [[(int(ids[j * n_top + c]), vals[j * n_top + c]) for c in range(n_top)] for j in range(m)]
    return flat[:h], flat[h:h + m], tops


def needs_history(state: SamplingState) -> bool:
    """Whether a row's next draw reads its own past (penalty counts, the seeded generator's step,
    the min_new_tokens mask) or returns logprobs: such rows are sampled with the host in step."""
    p = state.params
    return (state.needs_freq_presence or state.needs_repetition or p.seed is not None or p.wants_logprobs
            or p.min_new_tokens > 0 or state.grammar is not None)


def apply_penalties(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """Steps 1-3 of the module docstring on float32 logits; returns a new tensor if any apply."""
    device, vocab = logits.device, logits.shape[1]
    rep = [i for i, s in enumerate(states) if s.needs_repetition]
    fp = [i for i, s in enumerate(states) if s.needs_freq_presence]
    bias = [i for i, s in enumerate(states) if s.params.logit_bias]
    # (a grammar decides where its output ends: min_new_tokens does not hold back its stop token)
    block = [(i, t) for i, s in enumerate(states) if s.blocks_stop and s.grammar is None for t in s.min_tokens_block]
    block = [(i, t) for i, t in block if t < vocab]
    grammar = [i for i, s in enumerate(states) if s.grammar is not None and not s.grammar.is_terminated()]
    if not (rep or fp or bias or block or grammar):
        return logits
    logits = logits.clone()
    for i in rep + fp:
        states[i].ensure_tensors(vocab, device)
    if rep:
        idx = _to_device(rep, torch.long, device)
        penalty = [states[i].params.repetition_penalty for i in rep]
        penalty = _to_device(penalty, torch.float32, device)[:, None]
        seen = torch.stack([states[i].seen for i in rep])
        x = logits[idx]
        logits[idx] = torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)
    if fp:
        idx = _to_device(fp, torch.long, device)
        coef = _to_device(
            [[states[i].params.frequency_penalty, states[i].params.presence_penalty] for i in fp],
            torch.float32,
            device,
        )
        counts = torch.stack([states[i].counts for i in fp])
        logits[idx] -= coef[:, :1] * counts + coef[:, 1:] * (counts > 0)
    if bias:  # (row, token) pairs are unique: a row's map has each token once
        ids, vals = zip(*(states[i].bias_tensors(vocab, device) for i in bias))
        counts = [t.numel() for t in ids]
        rows = torch.repeat_interleave(_to_device(bias, torch.long, device), _to_device(counts, torch.long, device),
                                       output_size=sum(counts))  # (output_size: no host sync)
        logits[rows, torch.cat(ids)] += torch.cat(vals)
    if block:
        pos = _to_device(block, torch.long, device)
        logits[pos[:, 0], pos[:, 1]] = float("-inf")
    if grammar:
        apply_grammar_masks(logits, grammar, [states[i].grammar for i in grammar])
    return logits


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host list -> device tensor without stalling the stream (pinned, non-blocking copy)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)
