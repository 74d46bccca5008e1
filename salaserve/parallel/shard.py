"""Which slice of each weight a tensor-parallel rank holds, and the checks that a model splits.

Sharding works on the checkpoint's HF names (load_state_dict's output), before the serving model
fuses its linears, so that every fused part is cut by its own rule:

  column-parallel (output channels split, no communication): q_proj, k_proj, v_proj, o_gate,
      z_proj by heads (rank r holds heads [r*H/N, (r+1)*H/N) of each, so q, k, v and the gate of
      one head stay on one rank, and a KV head's query group with it); gate_proj, up_proj by the
      intermediate dim
  row-parallel (input channels split; the ranks' partial outputs are summed by one all-reduce,
      ops.TensorParallelOps): o_proj, down_proj
  split with their heads: o_norm (the Lightning output norm's weight [H*d]; its statistics are
      all-reduced, ops.py)
  replicated KV heads (tp_size a multiple of num_key_value_heads): a sparse layer's k_proj / v_proj
      rows of one KV head on each of its kv_replicas ranks, whose query heads are that head's group
      cut in kv_replicas runs (kv_shard)
  replicated: embed_tokens, lm_head (every rank computes the full logits; simplest, and only rank 0
      samples), the RMSNorm weights, q_norm / k_norm (one [d] vector shared by all heads)

Quantized linears are sharded after they are quantized (as stored, or quantized on load from the
full matrix), through their format's slice_out / slice_in, so every rank holds exactly its rows or
columns of the TP=1 weights: fp8 scales go with their rows, int4 groups must not straddle ranks.
The Lightning decay slopes are per global head: SalaModel slices them with head_range.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from salaserve.config import ModelConfig
from salaserve.quant.formats.registry import get as get_format


class TPConfigError(ValueError):
    """A model (or its quantization) that cannot be split over the asked number of ranks."""


def check_tp(cfg: ModelConfig, size: int) -> None:
    """Raise TPConfigError, naming the field, unless every split of `cfg` is even over `size` ranks:
    size divides the query heads, the Lightning heads and the MLP width, and either divides the KV
    heads (each rank holds KV heads of its own) or is a multiple of them (each KV head replicated
    on size / num_key_value_heads ranks, kv_replicas)."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise TPConfigError(f"tp_size must be a positive integer, got {size!r}")
    if size == 1:
        return
    kv = cfg.num_key_value_heads
    if kv % size and size % kv:
        raise TPConfigError(f"tp_size {size} does not divide num_key_value_heads = {kv} (KV heads of the sparse "
                            f"layers) and is not a multiple of it: every rank must hold the same KV heads, its own "
                            f"or a replica of one, so tp_size must divide {kv} or be a multiple of {kv}")
    splits = (("num_attention_heads", cfg.num_attention_heads, "query heads of the sparse layers"),
              ("lightning_nh", cfg.lightning_nh, "Lightning heads"),
              ("intermediate_size", cfg.intermediate_size, "MLP intermediate dim"))
    for name, n, what in splits:
        if n % size:
            raise TPConfigError(f"tp_size {size} does not divide {name} = {n} ({what}); every rank must hold "
                                f"the same number, so tp_size must divide {n}")


def kv_replicas(cfg: ModelConfig, size: int) -> int:
    """On how many ranks each KV head of the sparse layers lives: 1 when size divides the KV heads,
    else size / num_key_value_heads (those ranks hold the head's query heads between them and
    all-reduce its stage-1 scores over their sub-group)."""
    kv = cfg.num_key_value_heads
    return 1 if kv % size == 0 else size // kv


def check_tp_backend(cfg: ModelConfig, size: int, backend: str) -> None:
    """Replicated KV heads need the stage-1 hook (TorchBackend.sparse_attention's score_reduce);
    the Triton kernels rank blocks inside the stage-1 kernel, before any partial sum could be
    all-reduced, so that combination is refused."""
    if backend != "torch" and kv_replicas(cfg, size) > 1:
        raise TPConfigError(f"tp_size {size} > num_key_value_heads = {cfg.num_key_value_heads} (replicated KV "
                            f"heads) needs --backend torch: the {backend} backend's block selection cannot sum a "
                            f"KV group's stage-1 scores across ranks; use a tp_size that divides "
                            f"{cfg.num_key_value_heads} or --backend torch")


def head_range(n: int, rank: int, size: int) -> slice:
    """The contiguous block of n heads (or channels) that `rank` of `size` holds."""
    per = n // size
    return slice(rank * per, (rank + 1) * per)


def local_config(cfg: ModelConfig, rank: int, size: int) -> ModelConfig:
    """cfg as one rank sees it: its head counts and MLP width (one KV head when they are replicated,
    and then a GQA group of num_attention_heads / size query heads: the part of the head's group
    this rank holds). Head dims, the sparse config and the hidden size are unchanged. Not for lightning_slopes(): the slopes of the local
    head count are not the global heads' (slice the global ones with head_range)."""
    if size == 1:
        return cfg
    check_tp(cfg, size)
    return dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // size,
                               num_key_value_heads=cfg.num_key_value_heads * kv_replicas(cfg, size) // size,
                               lightning_nh=cfg.lightning_nh // size, lightning_nkv=cfg.lightning_nkv // size,
                               intermediate_size=cfg.intermediate_size // size)


# ---- one linear ------------------------------------------------------------------------------
def slice_out(w, lo: int, hi: int):
    """Output channels [lo, hi) of W [N, K] (a tensor or QuantizedLinearWeights)."""
    if isinstance(w, torch.Tensor):
        return w[lo:hi].contiguous()
    return get_format(w.format).slice_out(w, lo, hi)


def slice_in(w, lo: int, hi: int):
    """Input channels [lo, hi) of W [N, K]: x[:, lo:hi] @ slice^T summed over the ranks is x @ W^T."""
    if isinstance(w, torch.Tensor):
        return w[:, lo:hi].contiguous()
    return get_format(w.format).slice_in(w, lo, hi)


def _out_features(w) -> int:
    return w.shape[0] if isinstance(w, torch.Tensor) else w.out_features


def _in_features(w) -> int:
    return w.shape[1] if isinstance(w, torch.Tensor) else w.in_features


def column_shard(w, rank: int, size: int):
    r = head_range(_out_features(w), rank, size)
    return slice_out(w, r.start, r.stop)


def row_shard(w, rank: int, size: int):
    r = head_range(_in_features(w), rank, size)
    return slice_in(w, r.start, r.stop)


# ---- the whole model -------------------------------------------------------------------------
COLUMN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_gate", "self_attn.z_proj",
          "mlp.gate_proj", "mlp.up_proj")
ROW = ("self_attn.o_proj", "mlp.down_proj")


KV = ("self_attn.k_proj", "self_attn.v_proj")


def kv_shard(cfg: ModelConfig, w, rank: int, size: int):
    """A sparse layer's k_proj / v_proj: rank's KV heads, or (replicated, kv_replicas > 1) all rows
    of the one KV head its query heads belong to: ranks [h*R, (h+1)*R) hold head h whole."""
    reps = kv_replicas(cfg, size)
    return column_shard(w, rank // reps, size // reps)


def shard_state_dict(cfg: ModelConfig, w: dict, rank: int, size: int) -> dict:
    """This rank's part of a loaded state dict (HF names), in place: the full tensors are dropped as
    their slices are made. Splitting whole heads keeps q/k/v/gate of a head on one rank because
    every one of them is cut into `size` equal runs of whole heads (a sparse layer's k/v into
    num_key_value_heads runs when size is a multiple of them: kv_shard)."""
    if size == 1:
        return w
    check_tp(cfg, size)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for kind, names, cut in (("column", COLUMN, column_shard), ("row", ROW, row_shard)):
            for n in names:
                name = p + n + ".weight"
                if name not in w:
                    continue
                how = functools.partial(kv_shard, cfg) if cfg.is_sparse_layer(i) and n in KV else cut
                try:
                    w[name] = how(w[name], rank, size)
                except ValueError as e:
                    raise TPConfigError(f"{name}: cannot split it {kind}-parallel over {size} ranks: {e}") from None
        o_norm = p + "self_attn.o_norm.weight"
        if o_norm in w:
            w[o_norm] = w[o_norm][head_range(w[o_norm].shape[0], rank, size)].contiguous()
    return w
