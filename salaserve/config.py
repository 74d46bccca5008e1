"""Model configuration: parses a MiniCPM-SALA HF `config.json` and derives what the engine needs.

Every field of the spec's section 0 is read here. Sparse (InfLLM-v2) parameters come from
`sparse_config` and are never hard-coded elsewhere; the derived quantities (C2 compression,
pooling window, effective top-k) follow the spec's section 3.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

SPARSE_MIXER = "minicpm4"
LIGHTNING_MIXERS = ("lightning", "lightning_attn", "lightning-attn")
LIGHTNING_MIXER = "lightning-attn"  # the spelling we write


class ConfigError(ValueError):
    """A config.json that salaserve cannot serve; the message says which field and why."""


@dataclass(frozen=True)
class SparseConfig:
    """InfLLM-v2 block-sparse attention parameters (spec section 3)."""

    kernel_size: int = 32  # C1 compression window
    kernel_stride: int = 16  # C1 compression stride
    block_size: int = 64  # attention block = one KV page
    topk: int = 64  # data-dependent blocks; the local window is added on top (topk_eff)
    init_blocks: int = 1  # always-selected blocks at the start of the sequence
    window_size: int = 2048  # local window in tokens (always selected)
    dense_len: int = 8192  # total length at which the sparse path takes over
    use_nope: bool = False  # irrelevant: sparse layers use no RoPE at all

    # Level 2 compression is 4x level 1 (spec 3.3: kernel 4*32, stride 4*16).
    @property
    def c2_kernel_size(self) -> int:
        return 4 * self.kernel_size

    @property
    def c2_kernel_stride(self) -> int:
        return 4 * self.kernel_stride

    @property
    def local_blocks(self) -> int:
        return self.window_size // self.block_size

    @property
    def topk_eff(self) -> int:
        # HF: self.topk = topk + window_size // block_size (spec 3.4)
        return self.topk + self.local_blocks

    @property
    def c1_per_block(self) -> int:
        """Pooling stride: C1 entries whose window starts inside one block."""
        return self.block_size // self.kernel_stride

    @property
    def pool_padding(self) -> int:
        """C1 windows that start before a block but overlap it (1 for kernel 32 / stride 16)."""
        return self.kernel_size // self.kernel_stride - 1

    @property
    def pool_kernel(self) -> int:
        """C1 entries overlapping one block: indices [c1_per_block*b - pad, c1_per_block*(b+1) - 1]."""
        return self.c1_per_block + self.pool_padding

    def prompt_class(self, prompt_len: int) -> int:
        """What the values computed for a prompt's tokens depend on besides the tokens: the
        stage-1 prompt rule (reference.visible_count) hides the newest C2 entry from every prompt
        token when prompt_len = c2_kernel_stride - 1 (mod c2_kernel_stride), bit 0, and the newest
        C1 entry when prompt_len = kernel_stride - 1 (mod kernel_stride), bit 1. Bit 1 is left
        out (always 0) where it cannot change a selection: the hidden C1 entry's window ends in the
        query's last kernel_stride tokens, so it pools into blocks qb-1 .. qb only, which are forced
        (local window >= 1 block), when kernel_size + kernel_stride - 2 <= block_size (true for
        the real and the preset configs). The prefix cache keys entries on it."""
        c2 = int(prompt_len % self.c2_kernel_stride == self.c2_kernel_stride - 1)
        c1 = int(prompt_len % self.kernel_stride == self.kernel_stride - 1)
        c1_selects = self.kernel_size + self.kernel_stride - 2 > self.block_size
        return c2 | (c1 << 1 if c1_selects else 0)

    def validate(self) -> None:
        s = self
        for name in ("kernel_size", "kernel_stride", "block_size", "topk", "window_size", "dense_len"):
            if getattr(s, name) <= 0:
                raise ConfigError(f"sparse_config.{name} must be positive, got {getattr(s, name)}")
        if s.init_blocks < 0:
            raise ConfigError(f"sparse_config.init_blocks must be >= 0, got {s.init_blocks}")
        if s.kernel_size % s.kernel_stride != 0:
            raise ConfigError(
                f"sparse_config.kernel_size ({s.kernel_size}) must be a multiple of kernel_stride "
                f"({s.kernel_stride})"
            )
        if s.block_size % s.kernel_stride != 0:
            raise ConfigError(
                f"sparse_config.block_size ({s.block_size}) must be a multiple of kernel_stride "
                f"({s.kernel_stride}) so that C1 entries pool onto blocks"
            )
        if s.window_size % s.block_size != 0:
            raise ConfigError(
                f"sparse_config.window_size ({s.window_size}) must be a multiple of block_size "
                f"({s.block_size})"
            )


@dataclass(frozen=True)
class ModelConfig:
    """Parsed `config.json` of a MiniCPM-SALA model (spec section 0)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    mixer_types: tuple[str, ...]
    sparse: SparseConfig
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Any = None
    max_position_embeddings: int = 524288
    scale_emb: float = 12.0
    scale_depth: float = 1.4
    dim_model_base: int = 256
    mup_denominator: int = 32  # present in the config, never read by the HF forward (spec Q9)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    attention_dropout: float = 0.0
    initializer_range: float = 0.1
    bos_token_id: int = 1
    eos_token_id: tuple[int, ...] = (2, 73440)
    pad_token_id: int = 2
    torch_dtype: str = "bfloat16"
    attn_use_rope: bool = False
    attn_use_output_gate: bool = True
    lightning_use_rope: bool = True
    lightning_nh: int = 32
    lightning_nkv: int = 32
    lightning_head_dim: int = 128
    lightning_scale: str = "1/sqrt(d)"
    qk_norm: bool = True
    use_output_norm: bool = True
    use_output_gate: bool = True
    architectures: tuple[str, ...] = ("MiniCPMSALAForCausalLM",)
    model_type: str = "minicpm_sala"
    # Everything else found in config.json (auto_map, transformers_version, quantization_config...).
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    # ---- derived quantities -------------------------------------------------------------
    @property
    def sparse_layers(self) -> tuple[int, ...]:
        return tuple(i for i, m in enumerate(self.mixer_types) if m == SPARSE_MIXER)

    @property
    def lightning_layers(self) -> tuple[int, ...]:
        return tuple(i for i, m in enumerate(self.mixer_types) if m in LIGHTNING_MIXERS)

    def is_sparse_layer(self, layer: int) -> bool:
        return self.mixer_types[layer] == SPARSE_MIXER

    @property
    def residual_scale(self) -> float:
        """muP branch scale r = scale_depth / sqrt(num_hidden_layers) (spec section 1)."""
        return self.scale_depth / math.sqrt(self.num_hidden_layers)

    @property
    def logit_divisor(self) -> float:
        """muP logit divisor hidden_size / dim_model_base (16 for the real model)."""
        return self.hidden_size / self.dim_model_base

    @property
    def gqa_group_size(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def lightning_size(self) -> int:
        return self.lightning_nh * self.lightning_head_dim

    @property
    def lightning_attn_scale(self) -> float:
        return self.lightning_head_dim ** -0.5

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.eos_token_id

    def lightning_slopes(self) -> list[float]:
        """Per-head decay slopes (ALiBi slopes for lightning_nh heads, spec 4.3), Python doubles."""
        return alibi_slopes(self.lightning_nh)

    def num_parameters(self) -> int:
        h, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        n = 2 * v * h + h  # embeddings, lm_head, final norm
        for layer in range(self.num_hidden_layers):
            n += 3 * h * f + 2 * h  # MLP and two norms
            if self.is_sparse_layer(layer):
                n += 2 * h * self.q_size + 2 * h * self.kv_size + h * self.q_size  # q, o, k, v, o_gate
            else:
                ls = self.lightning_size
                n += 5 * h * ls + 2 * self.lightning_head_dim + ls  # q k v o z + q/k/o norms
        return n

    # ---- parsing --------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike) -> "ModelConfig":
        path = os.path.join(os.fspath(model_dir), "config.json")
        if not os.path.isfile(path):
            raise ConfigError(f"no config.json in {model_dir!s}")
        with open(path, encoding="utf-8") as f:
            try:
                raw = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        if not isinstance(raw, dict):
            raise ConfigError("config must be a JSON object")
        raw = dict(raw)
        model_type = raw.get("model_type")
        if model_type is not None and model_type != "minicpm_sala":
            raise ConfigError(f"model_type is {model_type!r}; salaserve serves 'minicpm_sala' only")

        required = (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "mixer_types", "sparse_config",
        )
        missing = [k for k in required if k not in raw]
        if missing:
            raise ConfigError(f"config.json is missing required field(s): {', '.join(missing)}")

        sc_raw = raw.pop("sparse_config")
        if not isinstance(sc_raw, dict):
            raise ConfigError("sparse_config must be an object")
        sc_fields = {f.name for f in dataclasses.fields(SparseConfig)}
        sc_missing = [k for k in ("kernel_size", "kernel_stride", "block_size", "topk", "window_size",
                                  "dense_len") if k not in sc_raw]
        if sc_missing:
            raise ConfigError(f"sparse_config is missing field(s): {', '.join(sc_missing)}")
        sparse = SparseConfig(**{k: v for k, v in sc_raw.items() if k in sc_fields})

        known = {f.name for f in dataclasses.fields(cls)} - {"sparse", "extra"}
        kwargs: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for k, v in raw.items():
            (kwargs if k in known else extra)[k] = v
        if "head_dim" not in kwargs:
            kwargs["head_dim"] = kwargs["hidden_size"] // kwargs["num_attention_heads"]
        eos = kwargs.get("eos_token_id", cls.eos_token_id)
        kwargs["eos_token_id"] = tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
        kwargs["mixer_types"] = tuple(kwargs["mixer_types"])
        if "architectures" in kwargs and kwargs["architectures"] is not None:
            kwargs["architectures"] = tuple(kwargs["architectures"])
        # Lightning fields default to the attention geometry when absent (HF builds the module
        # from num_attention_heads / head_dim; spec 4.1).
        kwargs.setdefault("lightning_nh", kwargs["num_attention_heads"])
        kwargs.setdefault("lightning_nkv", kwargs["lightning_nh"])
        kwargs.setdefault("lightning_head_dim", kwargs["head_dim"])
        try:
            cfg = cls(sparse=sparse, extra=extra, **kwargs)
        except TypeError as e:
            raise ConfigError(f"bad config: {e}") from None
        cfg.validate()
        return cfg

    def validate(self) -> None:
        ints = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "lightning_nh",
                "lightning_nkv", "lightning_head_dim")
        for name in ints:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        if len(self.mixer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"mixer_types has {len(self.mixer_types)} entries but num_hidden_layers is "
                f"{self.num_hidden_layers}"
            )
        for i, m in enumerate(self.mixer_types):
            if m != SPARSE_MIXER and m not in LIGHTNING_MIXERS:
                raise ConfigError(
                    f"mixer_types[{i}] = {m!r} is not a known mixer "
                    f"(expected {SPARSE_MIXER!r} or one of {LIGHTNING_MIXERS})"
                )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) is not divisible by "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.lightning_nh != self.lightning_nkv:
            raise ConfigError(
                f"lightning_nh ({self.lightning_nh}) != lightning_nkv ({self.lightning_nkv}): "
                "grouped Lightning heads are not supported"
            )
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        if self.attn_use_rope:
            raise ConfigError("attn_use_rope=true is not supported: MiniCPM-SALA sparse layers are NoPE")
        if not (self.attn_use_output_gate and self.qk_norm and self.use_output_norm
                and self.use_output_gate and self.lightning_use_rope):
            raise ConfigError(
                "this build supports the released MiniCPM-SALA variant only: attn_use_output_gate, "
                "qk_norm, use_output_norm, use_output_gate and lightning_use_rope must be true"
            )
        if self.lightning_scale not in ("1/sqrt(d)",):
            raise ConfigError(f"lightning_scale {self.lightning_scale!r} is not supported")
        if self.rope_scaling not in (None, {}):
            raise ConfigError(f"rope_scaling {self.rope_scaling!r} is not supported (plain RoPE only)")
        if self.attention_bias:
            raise ConfigError("attention_bias=true is not supported")
        if self.tie_word_embeddings:
            raise ConfigError("tie_word_embeddings=true is not supported (MiniCPM-SALA has an untied lm_head)")
        if self.lightning_head_dim % 2:
            raise ConfigError("lightning_head_dim must be even for RoPE")
        self.sparse.validate()

    def to_dict(self) -> dict:
        """The config.json contents (HF field names), suitable for writing a checkpoint."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name in ("sparse", "extra"):
                continue
            v = getattr(self, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else v
        out["sparse_config"] = dataclasses.asdict(self.sparse)
        out.update(self.extra)
        return out


def alibi_slopes(n_heads: int) -> list[float]:
    """ALiBi slopes as HF `_build_slope_tensor` computes them (spec 4.3): 2^(-8(h+1)/n) for a
    power-of-two n, with the standard interleaving extension otherwise."""

    def power_of_2(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start ** i for i in range(n)]

    if math.log2(n_heads).is_integer():
        return power_of_2(n_heads)
    closest = 2 ** math.floor(math.log2(n_heads))
    return power_of_2(closest) + alibi_slopes(2 * closest)[0::2][: n_heads - closest]


# ---- presets ---------------------------------------------------------------------------------
# Layer schedule of the released model (spec section 2): sparse layers 0, 9, 16, 17, 22, 29, 30, 31.
FULL_SPARSE_LAYERS = (0, 9, 16, 17, 22, 29, 30, 31)

# Token-id layout shared by every checkpoint we write: the BPE vocabulary first, then (full only)
# reserved fillers, then the 8 tail ids. The real model has <|im_end|> = vocab-8 = 73440.
TAIL_SPECIAL_TOKENS = ("<|im_end|>", "<|im_start|>", "<think>", "</think>",
                       "<|reserved_tail_0|>", "<|reserved_tail_1|>", "<|reserved_tail_2|>",
                       "<|reserved_tail_3|>")


def _mixers(n_layers: int, sparse: tuple[int, ...]) -> list[str]:
    return [SPARSE_MIXER if i in sparse else LIGHTNING_MIXER for i in range(n_layers)]


def preset_config(name: str, vocab_size: int | None = None) -> ModelConfig:
    """`full`: the released MiniCPM-SALA config (9.48B). `tiny`: same structure, few MB, with a
    scaled sparse_config so that every path (sparse included) runs on short CPU inputs. `small`:
    the shape of the built-in trained default model."""
    if name == "full":
        v = 73448 if vocab_size is None else vocab_size
        raw = dict(
            vocab_size=v, hidden_size=4096, intermediate_size=16384, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=2, head_dim=128,
            mixer_types=_mixers(32, FULL_SPARSE_LAYERS),
            sparse_config=dict(kernel_size=32, kernel_stride=16, block_size=64, topk=64,
                               init_blocks=1, window_size=2048, dense_len=8192, use_nope=False),
            lightning_nh=32, lightning_nkv=32, lightning_head_dim=128,
            eos_token_id=[2, v - 8],
        )
    elif name == "tiny":
        v = 8192 if vocab_size is None else vocab_size
        # 8 layers, 2 sparse (first and last, as in the real schedule), 1:3 like the real model.
        raw = dict(
            vocab_size=v, hidden_size=128, intermediate_size=512, num_hidden_layers=8,
            num_attention_heads=8, num_key_value_heads=2, head_dim=16,
            mixer_types=_mixers(8, (0, 7)),
            sparse_config=dict(kernel_size=8, kernel_stride=4, block_size=16, topk=4,
                               init_blocks=1, window_size=64, dense_len=128, use_nope=False),
            lightning_nh=8, lightning_nkv=8, lightning_head_dim=16,
            max_position_embeddings=65536, dim_model_base=8, scale_depth=1.4,
            eos_token_id=[2, v - 8],
        )
    elif name == "small":
        v = 8192 if vocab_size is None else vocab_size
        # The built-in trained model (tools/train_small.py): 8 layers, sparse first and
        # last (1:3), ~11.4M parameters so that bf16 weights stay under 25 MB. The sparse_config is
        # scaled so InfLLM-v2 runs from 256 tokens and is truly sparse past 12 blocks (384 tokens);
        # block 32 is a multiple of the C2 stride 4 x 8, as the page-aligned compressed-key pool requires.
        raw = dict(
            vocab_size=v, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            mixer_types=_mixers(8, (0, 7)),
            sparse_config=dict(kernel_size=16, kernel_stride=8, block_size=32, topk=8,
                               init_blocks=1, window_size=128, dense_len=256, use_nope=False),
            lightning_nh=4, lightning_nkv=4, lightning_head_dim=64,
            max_position_embeddings=4096, dim_model_base=64, scale_depth=1.4,
            eos_token_id=[2, v - 8],
        )
    else:
        raise ConfigError(f"unknown preset {name!r} (expected 'tiny', 'small' or 'full')")
    base = dict(
        architectures=["MiniCPMSALAForCausalLM"], model_type="minicpm_sala",
        auto_map={
            "AutoConfig": "configuration_minicpm_sala.MiniCPMSALAConfig",
            "AutoModel": "modeling_minicpm_sala.MiniCPMSALAModel",
            "AutoModelForCausalLM": "modeling_minicpm_sala.MiniCPMSALAForCausalLM",
        },
        hidden_act="silu", rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
        max_position_embeddings=524288, scale_emb=12, scale_depth=1.4, dim_model_base=256,
        mup_denominator=32, tie_word_embeddings=False, attention_bias=False,
        attention_dropout=0.0, initializer_range=0.1, pretraining_tp=1, use_cache=True,
        shift_labels=True, bos_token_id=1, pad_token_id=2, torch_dtype="bfloat16",
        transformers_version="4.56.1",
        attn_use_rope=False, attn_use_output_gate=True, lightning_use_rope=True,
        lightning_scale="1/sqrt(d)", qk_norm=True, use_output_norm=True, use_output_gate=True,
    )
    base.update(raw)
    return ModelConfig.from_dict(base)


# ---- engine arguments ------------------------------------------------------------------------
def default_plan_cache_dir() -> str | None:
    """EngineArgs.plan_cache_dir's default: $SALASERVE_PLAN_CACHE (a directory; "0": no plans, as
    the tests set it), else ~/.cache/salaserve/plans."""
    value = os.environ.get("SALASERVE_PLAN_CACHE", "")
    if value == "0":
        return None
    return value or "~/.cache/salaserve/plans"


@dataclass
class EngineArgs:
    """Knobs of one engine instance; names follow `sglang.launch_server` where one exists."""

    model: str | None = None  # model directory; None = the built-in default model
    backend: str = "auto"  # "torch" | "triton" | "auto" (triton on CUDA, torch on CPU)
    device: str = "auto"  # "cpu" | "cuda" | "cuda:N" | "auto"
    dtype: str = "auto"  # "auto" (bf16 on CUDA, fp32 on CPU) | "bfloat16" | "float32" | "float16"
    load_format: str = "auto"  # "auto" | "safetensors" | "dummy"
    seed: int = 0  # dummy weights and the global sampling generator
    max_running_requests: int = 64  # Smax measured -3.3% (bf16, H100) and -5.3% (w4a16, H200) against 32
    chunked_prefill_size: int = 8192  # prefill token budget per step
    schedule_policy: str = "fcfs"  # admission order of waiting requests (core/request.ADMISSION_ORDERS)
    mem_fraction_static: float = 0.88  # share of GPU memory for weights + caches
    max_total_tokens: int | None = None  # override the KV page budget (tokens)
    context_length: int | None = None  # default: max_position_embeddings
    state_dtype: str = "float32"  # Lightning state slots
    kv_cache_dtype: str = "auto"  # "auto": the model dtype; "fp8_e4m3": fp8 K/V, scale per page and head
    quantization: str | None = None  # a quant/formats name (fp8, w4a16) or gptq; None: as the checkpoint says
    # int4 weights at prefill sizes on the GPU: "fp8" (an fp8 copy of each int4 linear, w8a8 on fp8
    # tensor cores, where the GPU has them) or "bf16" (the int4 weights dequantized for a bf16 GEMM)
    w4a16_prefill: str = "fp8"
    # int4 weights on the GPU: a repacked copy of each linear for the wgmma decode GEMV at 4-16 rows
    # (qweight's bytes again); False gives that memory to KV pages
    w4_wgmma: bool = True
    # where the start-up calibration's picks are kept across restarts; None: no plans. Default:
    # $SALASERVE_PLAN_CACHE ("0": none), else ~/.cache/salaserve/plans
    plan_cache_dir: str | None = field(default_factory=default_plan_cache_dir)
    parallel_compile: bool = True  # start-up compiles (calibration, warm-up autotune) in a thread pool
    quantize_lm_head: bool = False  # quantize-on-load (fp8 / w4a16 of a bf16 checkpoint) takes lm_head too
    speculative_algorithm: str | None = None  # None | "NGRAM" | "EAGLE3"
    speculative_num_draft_tokens: int = 4  # most draft tokens per verify step
    speculative_draft_model_path: str | None = None  # EAGLE3: the head's directory
    speculative_num_steps: int | None = None  # EAGLE3: draft depth (default: speculative_num_draft_tokens)
    speculative_eagle_topk: int = 1  # EAGLE3: candidates per tree level (the verify takes the first path)
    speculative_eagle_window: int = 128  # EAGLE3: recent positions the head attends to
    speculative_max_batch: int = 8  # no speculation when more requests decode at once
    speculative_ngram_max: int = 4
    speculative_ngram_min: int = 1
    # draft shape by load (spec/policy.py): levels max_batch:depth[:topk], the first level whose
    # max_batch holds the decoding requests gives the step's depth and tree width (capped by the
    # configured ones), past the last level no drafts; a level changes after `patience` steps in it
    speculative_load_levels: str = "1:5:4,4:3:2,8:2:1"
    speculative_policy_patience: int = 4
    # EAGLE3: a prompt-lookup match of at least this many tokens drafts the step instead of the
    # head (spec/routing.py); 0 (default): the head always drafts (on held-out code routing lowered
    # the shipped head's accept length: docs/eagle3.md)
    speculative_ngram_route: int = 0
    enable_cuda_graph: bool = True
    overlap_schedule: bool = True  # launch step N+1 before step N's tokens reach the host
    prefix_cache_slots: int = 4  # prompts kept for reuse as prefixes (a Lightning state slot each); 0: off
    prefix_cache_min_tokens: int = 256  # shorter prompts are not kept
    cuda_graph_max_bs: int | None = None  # default: max_running_requests
    warmup: bool = True  # on CUDA: run warm-up requests through the engine at start-up (engine/warmup.py)
    step_trace: str | None = None  # a file that gets one JSON line per engine step (scheduler trace)
    # tensor parallelism: ranks that each hold 1/tp_size of the heads and MLP (one GPU each on CUDA,
    # NCCL; processes on the CPU, gloo); rank 0 runs this engine, the others follow its steps
    tp_size: int = 1
    dist_timeout: float = 600.0  # seconds a rank waits for the others (rendezvous, collectives) before failing
    log_level: str = "info"

    def validate(self) -> None:
        if self.backend not in ("auto", "torch", "triton"):
            raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {self.backend!r}")
        if self.dtype not in ("auto", "bfloat16", "float32", "float16"):
            raise ValueError(f"dtype must be auto/bfloat16/float32/float16, got {self.dtype!r}")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"load_format must be auto/safetensors/dummy, got {self.load_format!r}")
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.chunked_prefill_size < 1:
            raise ValueError(f"chunked_prefill_size must be >= 1, got {self.chunked_prefill_size}")
        if self.prefix_cache_slots < 0:
            raise ValueError(f"prefix_cache_slots must be >= 0, got {self.prefix_cache_slots}")
        if self.prefix_cache_min_tokens < 1:
            raise ValueError(f"prefix_cache_min_tokens must be >= 1, got {self.prefix_cache_min_tokens}")
        if not 0.05 <= self.mem_fraction_static <= 0.99:
            raise ValueError(f"mem_fraction_static must be in [0.05, 0.99], got {self.mem_fraction_static}")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ValueError(f"max_total_tokens must be >= 1, got {self.max_total_tokens}")
        if self.speculative_algorithm not in (None, "NGRAM", "EAGLE3"):
            raise ValueError("speculative_algorithm must be None, 'NGRAM' or 'EAGLE3', got "
                             f"{self.speculative_algorithm!r}")
        if (self.speculative_algorithm == "EAGLE3") != (self.speculative_draft_model_path is not None):
            raise ValueError("speculative_draft_model_path (the EAGLE-3 head) goes with speculative_algorithm "
                             "EAGLE3, and EAGLE3 needs it")
        if self.speculative_num_steps is not None and self.speculative_num_steps < 1:
            raise ValueError(f"speculative_num_steps must be >= 1, got {self.speculative_num_steps}")
        if self.speculative_eagle_topk < 1 or self.speculative_eagle_window < 1:
            raise ValueError("speculative_eagle_topk and speculative_eagle_window must be >= 1, got "
                             f"{self.speculative_eagle_topk}, {self.speculative_eagle_window}")
        if self.speculative_policy_patience < 1 or self.speculative_ngram_route < 0:
            raise ValueError("speculative_policy_patience must be >= 1 and speculative_ngram_route >= 0, got "
                             f"{self.speculative_policy_patience}, {self.speculative_ngram_route}")
        if not 1 <= self.speculative_num_draft_tokens <= 64:
            raise ValueError("speculative_num_draft_tokens must be in [1, 64], got "
                             f"{self.speculative_num_draft_tokens}")
        # the format names are checked against the registry when the model loads (quant/scheme.py)
        if self.quantization is not None and not isinstance(self.quantization, str):
            raise ValueError(f"quantization must be a format name (or unset), got {self.quantization!r}")
        if self.quantize_lm_head and self.quantization is None:
            raise ValueError("quantize_lm_head quantizes lm_head on load: it needs a quantization (e.g. fp8 or "
                             "w4a16); a prepared checkpoint says itself whether its lm_head is quantized "
                             "(prepare-model --quantize-lm-head)")
        if self.w4a16_prefill not in ("fp8", "bf16"):
            raise ValueError(f"w4a16_prefill must be fp8 or bf16, got {self.w4a16_prefill!r}")
        if self.kv_cache_dtype not in ("auto", "fp8_e4m3"):
            raise ValueError(f"kv_cache_dtype must be auto or fp8_e4m3, got {self.kv_cache_dtype!r}")
        if isinstance(self.tp_size, bool) or not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ValueError(f"tp_size must be a positive integer, got {self.tp_size!r}")
        if not self.dist_timeout > 0:
            raise ValueError(f"dist_timeout must be positive, got {self.dist_timeout!r}")
        if self.state_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"state_dtype must be float32 or bfloat16, got {self.state_dtype!r}")
