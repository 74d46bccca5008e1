import os

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random-weight MiniCPM-SALA checkpoint in the exact HF layout (written once)."""
    from salaserve.model.checkpoint import write_checkpoint

    d = tmp_path_factory.mktemp("tiny-model")
    write_checkpoint(str(d), "tiny", seed=0)
    return str(d)


def pytest_configure(config):
    # keep CPU tests deterministic and light on the 2-core CI machine
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
