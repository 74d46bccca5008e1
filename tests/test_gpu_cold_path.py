"""Nothing is compiled, autotuned or captured after start-up: a serving-like mix of requests on the
full-size engine (dummy bf16 weights) builds no Triton kernel specialisation, runs no autotune
search and captures no CUDA graph once the engine is ready. A cold path there stalls every request
of the step for the compile's seconds (the S8 tier's first requests waited ~40 s for it)."""

import random

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def full_dir(tmp_path_factory):
    from salaserve.model.checkpoint import write_checkpoint

    d = str(tmp_path_factory.mktemp("full"))
    write_checkpoint(d, "full", weights=False)
    return d


def serve_like(engine, shapes, concurrency, rng):
    """Run (prompt_len, output_len, params) requests with at most `concurrency` in flight, a new one
    added as soon as one finishes (as a benchmark client at that concurrency does)."""
    from salaserve.core.sampling_params import SamplingParams

    vocab = engine.cfg.vocab_size
    pending = list(enumerate(shapes))
    active = 0
    while pending or engine.has_unfinished():
        while pending and active < concurrency:
            i, (n_in, n_out, extra) = pending.pop(0)
            prompt = [rng.randrange(16, vocab - 16) for _ in range(n_in)]
            engine.add_request(f"r{i}", prompt, SamplingParams(max_new_tokens=n_out, ignore_eos=True, **extra))
            active += 1
        for out in engine.step():
            active -= out.finished


def test_serving_mix_builds_nothing_after_start_up(full_dir):
    from salaserve.engine.engine import Engine
    from salaserve.kernels.compile_watch import WATCH

    engine = Engine(model=full_dir, device="cuda", dtype="bfloat16", backend="triton", load_format="dummy",
                    max_running_requests=16, chunked_prefill_size=8192, max_total_tokens=300_000)
    assert WATCH.ready
    before = WATCH.num_after_ready
    rng = random.Random(0)
    greedy, sampled = {"temperature": 0.0}, {"temperature": 0.8, "top_p": 0.9, "top_k": 40}
    # soar-quick-like: documents crossing dense_len (8192) and short prompts with longer answers,
    # 8 at once and then one per finished request; lengths in every class (odd, multiples of 16, 1)
    shapes = [(19964, 12, greedy), (3306, 20, sampled), (133, 40, greedy), (118, 30, greedy),
              (14276, 16, sampled), (17535, 9, greedy), (1, 8, greedy), (130, 25, greedy),
              (4534, 14, greedy), (9000, 6, sampled), (64, 17, greedy), (8191, 5, greedy),
              (8193, 5, greedy), (2048, 11, greedy), (777, 30, sampled), (12000, 4, greedy)]
    serve_like(engine, shapes, 8, rng)
    serve_like(engine, shapes[:12], 16, rng)  # more at once: larger decode and prefill batches
    events = WATCH.after_ready()[before:] if before else WATCH.after_ready()
    report = "\n".join(f"{e.kind} {e.name} {e.seconds:.2f}s {e.detail[:400]}" for e in events)
    assert not events, f"{len(events)} builds after start-up:\n{report}"


def test_gemv_row_counts_of_one_bucket_share_one_build():
    """A mixed step hands the GEMV any row count; counts of one M bucket (here 17..32) must run on one
    build, whether or not they are multiples of 16 (a new class compiled after start-up in S8 once)."""
    from salaserve.kernels.compile_watch import CompileWatch
    from salaserve.kernels.gemv import default_config, gemv

    watch = CompileWatch()
    assert watch.install()
    gen = torch.Generator(device="cuda").manual_seed(0)
    N, K = 512, 2048
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    cfg = default_config(32, N, K)
    gemv(torch.randn(32, K, device="cuda", dtype=torch.bfloat16, generator=gen), w, config=cfg)
    before = len(watch.events)
    for m in (17, 31, 20, 32):
        x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16, generator=gen)
        out = gemv(x, w, config=cfg)
        torch.testing.assert_close(out.float(), (x.float() @ w.float().T).bfloat16().float(), rtol=2e-2, atol=2e-2)
    assert [e.detail for e in watch.events[before:] if e.name == "_gemv_kernel"] == []
