"""Cold paths (the CPU part; tests/test_gpu_cold_path.py asserts none on the GPU): the compile watch
records Triton builds relative to readiness, and the serving warm-up drives every kind of step
through the engine and leaves it as it found it."""

import json

import triton

from salaserve.kernels.compile_watch import CompileWatch


def _fake_compile(hooks, name: str) -> None:
    """What Triton's JIT does around a new specialisation: the cache hook, then the post hook."""
    from triton import knobs

    key = (name, ("i32",))

    class Fn:
        pass

    fn = Fn()
    fn.name = name
    assert not knobs.runtime.jit_cache_hook(key=key, repr=f"{name}[...]", fn=fn, compile={}, is_manual_warmup=False,
                                            already_compiled=False)
    knobs.runtime.jit_post_compile_hook(key=key, repr=f"{name}[...]", fn=fn, compile={}, is_manual_warmup=False,
                                        already_compiled=False)
    hooks.append(name)


def test_watch_counts_builds_before_and_after_ready(monkeypatch):
    from triton import knobs
    from triton.runtime.autotuner import Autotuner

    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: seen.append(kw["repr"]))
    monkeypatch.setattr(Autotuner, "prune_configs", Autotuner.prune_configs)  # restored after the test
    watch = CompileWatch()
    assert watch.install() and watch.install()  # idempotent

    calls = []
    _fake_compile(calls, "_start_up_kernel")
    watch.record("graph", "step bs=1")
    watch.mark_ready()
    _fake_compile(calls, "_cold_kernel")

    @triton.autotune(configs=[triton.Config({"B": 16}), triton.Config({"B": 32})], key=["n"])
    @triton.jit
    def _tuned(x, n, B: triton.language.constexpr):
        pass

    _tuned.prune_configs({})  # what Triton runs on an autotune key it has not searched
    assert [e.name for e in watch.after_ready()] == ["_cold_kernel", "_tuned"]
    assert [e.kind for e in watch.after_ready()] == ["compile", "autotune"]
    assert watch.counts() == {"compile": 1, "graph": 1, "compile_after_ready": 1, "autotune_after_ready": 1}
    assert watch.num_after_ready == 2
    assert seen == ["_start_up_kernel[...]", "_cold_kernel[...]"]  # an existing hook still runs


def test_serving_warmup_covers_each_step_kind_and_leaves_no_trace(tiny_model_dir, tmp_path):
    from salaserve.engine.engine import Engine
    from salaserve.engine.warmup import warm_up_engine

    trace = tmp_path / "steps.jsonl"
    engine = Engine(model=tiny_model_dir, device="cpu", backend="torch", dtype="float32", max_running_requests=8,
                    chunked_prefill_size=512, step_trace=str(trace))
    initial = engine.resource_counters()
    warm_up_engine(engine)

    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    assert any(s["prefill_seqs"] == 1 and s["decode_rows"] == 0 for s in steps)  # one sequence's chunk
    assert any(s["prefill_seqs"] >= 3 for s in steps)  # several sequences' prefill in one step
    assert any(s["prefill_seqs"] and s["decode_rows"] >= 2 for s in steps)  # decode rows beside a chunk
    assert any(s["decode_rows"] >= 4 and not s["prefill_seqs"] for s in steps)  # decode-only steps
    # as it found it: nothing running or cached, pools and counters at their start values
    assert not engine.has_unfinished() and not engine.requests
    assert engine.resource_counters() == initial
    assert engine.prefix_cache_counters()["prefix_cache_entries"] == 0
    assert set(engine.stats.values()) == {0} and engine.scheduler.num_preemptions == 0


def test_serving_warmup_with_speculation_verifies(tiny_model_dir):
    """With n-gram speculation the warm-up's repeating prompt gets drafts: verify steps run."""
    from salaserve.engine.engine import Engine
    from salaserve.engine.warmup import warm_up_engine

    engine = Engine(model=tiny_model_dir, device="cpu", backend="torch", dtype="float32", max_running_requests=8,
                    speculative_algorithm="NGRAM", speculative_num_draft_tokens=3)
    verify_steps = []
    verify = engine._verify
    engine._verify = lambda *a: verify_steps.append(1) or verify(*a)
    warm_up_engine(engine)
    assert verify_steps and engine.stats["spec_verify_steps"] == 0


def test_a_new_specialisation_names_the_arguments_that_made_it():
    """The watch's detail for a rebuilt kernel: which arguments Triton specialised differently
    (types, divisibility by 16, constexpr values) than in its nearest earlier build."""
    from salaserve.kernels.compile_watch import describe_new, specialisation

    def compile_dict(n_divisible: bool, width_one: bool):
        signature = {"x": "*bf16", "n": "i32", "width": "constexpr" if width_one else "i32", "B": "constexpr"}
        constants = {(3,): 16, **({(2,): 1} if width_one else {})}
        attrs = {(0,): [["tt.divisibility", 16]], **({(1,): [["tt.divisibility", 16]]} if n_divisible else {})}
        return {"signature": signature, "constants": constants, "configs": [attrs]}

    first = specialisation(compile_dict(True, False))
    assert first == {"x": "*bf16/16", "n": "i32/16", "width": "i32", "B": "constexpr=16"}
    assert describe_new(first, []) == ""
    second = specialisation(compile_dict(False, True))
    assert describe_new(second, [first]) == ("new specialisation: n i32/16 -> i32, "
                                             "width i32 -> constexpr=1")
