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


# The hardened server of tests/test_server_hardening.py and tests/test_server_hostile.py: keys,
# small per-request limits, a short read timeout, and a KV pool of 1024 tokens so that a handful
# of concurrent requests forces preemptions.
HARDENED_API_KEY = "user-key"
HARDENED_ADMIN_KEY = "admin-key"
HARDENED_FLAGS = ("--api-key", HARDENED_API_KEY, "--admin-api-key", HARDENED_ADMIN_KEY, "--enable-metrics",
                  "--max-batch-prompts", "8", "--max-request-sequences", "64", "--max-running-requests", "8",
                  "--max-total-tokens", "1024", "--request-read-timeout", "2", "--skip-server-warmup")


@pytest.fixture(scope="session")
def hardened_server(tiny_model_dir, tmp_path_factory):
    from server_utils import run_server, tiny_server_args

    with run_server(tiny_server_args(tiny_model_dir, *HARDENED_FLAGS), str(tmp_path_factory.mktemp("logs"))) as s:
        yield s
