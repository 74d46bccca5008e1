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
    # no calibration plans read from or written to the home directory (tests/test_plan_cache.py
    # points SALASERVE_PLAN_CACHE at a temporary directory)
    os.environ.setdefault("SALASERVE_PLAN_CACHE", "0")
    # torch's intra-op threads spin-wait on a busy 2-core machine and make the tiny model's
    # small ops 100x slower; one thread is the fast setting for these sizes
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dir, tmp_path_factory):
    """`salaserve serve` on the tiny checkpoint (CPU), shared by the server test modules that need
    no special flags. At most 16 running requests, so larger bursts exercise the queue."""
    from server_utils import run_server, tiny_server_args

    args = tiny_server_args(tiny_model_dir, "--max-running-requests", "16", "--enable-metrics")
    with run_server(args, str(tmp_path_factory.mktemp("server-logs"))) as server:
        yield server
