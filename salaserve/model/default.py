"""The built-in default model, used when no model directory is given."""

from __future__ import annotations

import os

PACKAGED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "default_model")


def default_model_dir() -> str:
    """The trained small model shipped with the package when present; otherwise a tiny
    random-weight checkpoint written once to the user's cache directory."""
    if os.path.isfile(os.path.join(PACKAGED, "config.json")):
        return PACKAGED
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "salaserve",
                         "tiny-random-v1")
    if not os.path.isfile(os.path.join(cache, "model.safetensors.index.json")):
        from salaserve.model.checkpoint import write_checkpoint

        tmp = cache + f".tmp{os.getpid()}"
        write_checkpoint(tmp, "tiny", seed=0)
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        try:
            os.replace(tmp, cache)
        except OSError:  # another process won the race
            pass
    return cache


if __name__ == "__main__":  # `python -m salaserve.model.default`: where the built-in model is
    print(default_model_dir())
