"""`async for delta in engine.stream(...)`: the engine in its own process, driven from asyncio."""

import asyncio

from salaserve.core.sampling_params import SamplingParams
from salaserve.engine.llm import LLM
from salaserve.server.async_engine import AsyncEngine


def test_stream_matches_offline_and_early_exit_frees(tiny_model_dir):
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    want = LLM(tiny_model_dir, device="cpu", dtype="float32", backend="torch").generate("hello world", params)[0]

    async def main():
        engine = AsyncEngine(model=tiny_model_dir, device="cpu", dtype="float32", backend="torch")
        await engine.start()
        try:
            deltas = [d async for d in engine.stream("hello world", params)]
            # leave a second stream after two updates: the request is aborted and freed
            n = 0
            async for _ in engine.stream("hello again", SamplingParams(max_new_tokens=500, ignore_eos=True)):
                n += 1
                if n == 2:
                    break
            for _ in range(100):  # counters arrive with the engine's next step
                await asyncio.sleep(0.05)
                if engine.client.stats.get("pages_used") == 0:
                    break
            return deltas, dict(engine.client.stats)
        finally:
            engine.close()

    deltas, stats = asyncio.run(main())
    assert [t for d in deltas for t in d.token_ids] == want.token_ids
    assert "".join(d.text for d in deltas) == want.text
    assert deltas[-1].finished and deltas[-1].finish_reason == {"type": "length", "length": 12}
    assert stats["pages_used"] == 0 and stats["slots_used"] == 0
