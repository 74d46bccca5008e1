"""salaserve: a fast, dependable inference engine and server for MiniCPM-SALA."""

from salaserve._version import __version__


def __getattr__(name):
    # Lazy, so that `import salaserve` (the CLI) does not pay for torch until needed.
    if name == "LLM":
        from salaserve.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from salaserve.core.sampling_params import SamplingParams

        return SamplingParams
    if name == "EngineArgs":
        from salaserve.config import EngineArgs

        return EngineArgs
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "EngineArgs", "__version__"]
