"""A model directory's tokenizer through transformers, with MiniCPM-SALA known to transformers.

`AutoTokenizer.from_pretrained` reads config.json first, to learn the model type. 'minicpm_sala'
is not a type transformers ships, so it would fall back to a bare `PretrainedConfig`, warn "You
are using a model of type `minicpm_sala` to instantiate a model of type ``... can yield errors",
and (transformers 5) warn that `rope_scaling` is deprecated. Registering a config class for the
type parses config.json as what it is. A model directory that brings its own configuration code
(`auto_map`, loaded with trust_remote_code) keeps using that code.
"""

from __future__ import annotations

from transformers import AutoConfig, AutoTokenizer, PretrainedConfig

MODEL_TYPE = "minicpm_sala"


class MiniCPMSALAConfig(PretrainedConfig):
    """config.json's fields as attributes. The engine reads salaserve's own ModelConfig; this
    class tells transformers the model type."""

    model_type = MODEL_TYPE

    def __init__(self, rope_scaling=None, **kwargs):
        # MiniCPM-SALA's config.json says rope_scaling: null (plain RoPE); transformers 5
        # deprecates the key and warns on any value it is given, so a null is not passed on.
        if rope_scaling is not None:
            kwargs["rope_scaling"] = rope_scaling
        super().__init__(**kwargs)


def register_config() -> None:
    """Make 'minicpm_sala' a model type transformers' Auto classes know (idempotent)."""
    AutoConfig.register(MODEL_TYPE, MiniCPMSALAConfig, exist_ok=True)


def load_tokenizer(model_dir: str, trust_remote_code: bool = False):
    """`AutoTokenizer.from_pretrained(model_dir)` with the model type registered. An explicit
    trust_remote_code=False keeps transformers from asking on stdin about remote code."""
    register_config()
    return AutoTokenizer.from_pretrained(model_dir, trust_remote_code=bool(trust_remote_code))
