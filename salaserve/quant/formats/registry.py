"""The registered quantized weight formats, by name (formats/__init__.py registers the built-in ones)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from salaserve.quant.formats.base import Format

_FORMATS: dict[str, Format] = {}


def register(fmt: Format) -> Format:
    """Add a format under fmt.name (refused if the name, or a stored alias, is taken)."""
    taken = {n for f in _FORMATS.values() for n in (f.name, *f.stored_aliases)}
    clash = {fmt.name, *fmt.stored_aliases} & taken
    if not fmt.name or clash:
        raise ValueError(f"cannot register format {fmt.name!r}: name taken or empty ({sorted(clash)})")
    _FORMATS[fmt.name] = fmt
    return fmt


def unregister(name: str) -> None:
    """Remove a format (tests that register a toy one)."""
    _FORMATS.pop(name, None)


def get(name: str) -> Format:
    """The format called `name` (QuantizedLinearWeights.format)."""
    try:
        return _FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown weight format {name!r} (known: {', '.join(_FORMATS)})") from None


def names() -> tuple[str, ...]:
    return tuple(_FORMATS)


def quantization_choices() -> tuple[str, ...]:
    """The values of --quantization / EngineArgs.quantization: the quantized formats' names and
    their stored aliases ("bf16" is no quantization)."""
    return tuple(n for f in _FORMATS.values() if f.name != "bf16" for n in (f.name, *f.stored_aliases))


def for_quantization(requested: str) -> Optional[Format]:
    """The format a --quantization value selects (a name or a stored alias), or None."""
    for f in _FORMATS.values():
        if requested == f.name or requested in f.stored_aliases:
            return f
    return None


def for_quant_method(method: str) -> Optional[Format]:
    """The format whose checkpoints carry quantization_config.quant_method == method, or None."""
    for f in _FORMATS.values():
        if f.quant_method is not None and f.quant_method == method:
            return f
    return None
