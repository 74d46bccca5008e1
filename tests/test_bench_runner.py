"""`salaserve bench`: the tier runner against the tiny-model server, our client against the
official one, the stream-parsing rules, the report files, compare's SOAR score, micro plots."""

import asyncio
import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

from salaserve.bench import official
from salaserve.bench.cli import main as bench_main
from salaserve.bench.dataset import read_pairs, sample_requests
from salaserve.bench.runner import RunConfig, run_bench
from paced_server import PacedServer
from server_utils import CPU_ARGS

REPO = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TIER_KEYS = {"max_concurrency", "requests", "successes", "failures", "duration_s", "total_output_tokens",
             "request_throughput", "output_throughput", "ttft_ms", "itl_ms", "e2e_ms", "length_check",
             "per_request", "accept_length"}


def _check_tier(t: dict, n: int) -> None:
    assert t["requests"] == t["successes"] == n and t["failures"] == 0
    assert t["length_check"] == {"ok": True, "mismatches": []}
    for r in t["per_request"]:  # every output exactly the requested length
        assert r["success"] and r["completion_tokens"] == r["output_len"] >= 2
    assert t["total_output_tokens"] == sum(r["output_len"] for r in t["per_request"])
    for key in ("ttft_ms", "itl_ms"):
        assert set(t[key]) == {"mean", "p50", "p90", "p99"} and t[key]["p50"] > 0


def test_run_toy_starts_server_and_writes_report(tiny_model_dir, tmp_path):
    """A toy-sized run of all three tiers; the runner starts and stops its own server."""
    out = tmp_path / "run"
    counts = {"S1": 3, "S8": 8, "Smax": 12}
    rc = bench_main(["run", "--workload", "toy", "--counts", "S1=3,S8=8,Smax=12", "--model", tiny_model_dir,
                     "--server-args", " ".join(CPU_ARGS), "--out", str(out), "--no-progress"])
    assert rc == 0
    result = json.loads((out / "result.json").read_text())
    for key in ("command", "git_commit", "gpu", "date", "client", "model_id", "server_config", "workload"):
        assert result[key] is not None, key
    assert result["command"].startswith("salaserve bench run --workload toy")
    import torch

    assert result["gpu"] == (torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    assert result["client"] == "ours" and result["model_id"] == tiny_model_dir
    assert result["server_config"]["model_path"] == tiny_model_dir
    assert list(result["tiers"]) == ["S1", "S8", "Smax"]
    for tier, n in counts.items():
        t = result["tiers"][tier]
        assert TIER_KEYS <= set(t)
        _check_tier(t, n)
        assert t["max_concurrency"] == {"S1": 1, "S8": 8, "Smax": None}[tier]
        assert (out / f"latency_{tier}.png").read_bytes()[:8] == PNG_MAGIC
    md = (out / "report.md").read_text()
    assert "| tier | concurrency | ok/requests | duration (s) |" in md and "| Smax | unlimited | 12/12 |" in md
    assert (out / "workload" / "manifest.json").is_file() and (out / "server.log").is_file()


def _official_missing() -> str | None:
    why = official.available()
    missing = [m for m in ("aiohttp", "numpy", "requests", "tqdm", "pybase64", "PIL", "datasets")
               if importlib.util.find_spec(m) is None]
    return why or (f"its client dependencies are missing: {', '.join(missing)}" if missing else None)


needs_official = pytest.mark.skipif(_official_missing() is not None,
                                    reason=f"sglang.bench_serving not runnable: {_official_missing()}")


@pytest.fixture(scope="module")
def decode_workload(tiny_model_dir, tmp_path_factory):
    """An S1 file whose duration is mostly decoding: 3 short prompts, 100-120-token answers."""
    from transformers import AutoTokenizer

    from salaserve.bench.documents import response_units
    from salaserve.bench.tokfit import exact_length_text

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    d = tmp_path_factory.mktemp("decode-workload")
    with open(d / "S1.jsonl", "w", encoding="utf-8") as f:
        for i, n in enumerate((100, 110, 120)):
            answer = exact_length_text(tok, response_units(n, f"agree-{i}"), n)
            f.write(json.dumps({"question": f"Question {i}: describe the sea in detail.",
                                "model_response": answer}) + "\n")
    return d


def _both_clients(url: str, workload: Path, out: Path) -> tuple[dict, dict]:
    runs = {}
    for client in ("ours", "sglang"):
        cfg = RunConfig(out=out / client, tiers=("S1",), workload_dir=str(workload), url=url, client=client,
                        progress=False)
        runs[client] = run_bench(cfg, ["run"])["tiers"]["S1"]
    return runs["ours"], runs["sglang"]


def _rel_diff(ours: dict, theirs: dict) -> float:
    return abs(ours["duration_s"] - theirs["duration_s"]) / theirs["duration_s"]


@needs_official
def test_ours_and_official_time_the_same_window(tiny_model_dir, decode_workload, tmp_path):
    """Against a server with fixed token pacing (so machine load cannot move the numbers), our
    client's duration agrees with sglang.bench_serving's; the 1 s post-flush sleep or the warm-up
    inside the window would be 30% off. Both send the same requests in the same order."""
    server = PacedServer(tiny_model_dir, ttft_s=0.02, itl_s=0.01).start()
    try:
        ours, theirs = _both_clients(server.url, decode_workload, tmp_path)
    finally:
        server.stop()
    _check_tier(ours, 3)
    _check_tier(theirs, 3)
    # each client: warm-up (32 tokens), flush, 3 timed requests, in the same order
    gens = [b["sampling_params"]["max_new_tokens"] for b in server.requests]
    assert gens[:4] == [32, *[r["output_len"] for r in ours["per_request"]]] and gens[4:] == gens[:4]
    assert server.requests[0] == server.requests[4]  # identical payloads
    assert theirs["official"]["order_matches"]
    expected = sum(0.02 + (r["output_len"] - 1) * 0.01 for r in ours["per_request"])  # ~3.3 s
    assert expected - 0.01 <= theirs["duration_s"] < expected + 0.5
    # the requirement is 10%; seen: 0.2%, so anything past 5% means the windows differ
    assert _rel_diff(ours, theirs) < 0.05, (ours["duration_s"], theirs["duration_s"])


@needs_official
def test_official_client_against_tiny_server(tiny_server, decode_workload, tmp_path):
    """Both clients against the real server: same requests, every one exact.

    Durations are only checked for the same order of magnitude here: on this shared 2-core CPU
    identical runs of the official client alone took 1.8 to 3.3 s, so a 10% bound on the real
    model is noise; the paced server above checks the timed windows to well under 10%."""
    ours, theirs = _both_clients(tiny_server.url, decode_workload, tmp_path)
    _check_tier(ours, 3)
    _check_tier(theirs, 3)
    assert theirs["official"]["order_matches"] and theirs["official"]["returncode"] == 0
    assert [r["output_len"] for r in ours["per_request"]] == [r["completion_tokens"] for r in theirs["per_request"]]
    assert 0.5 < ours["duration_s"] / theirs["duration_s"] < 2.0, (ours["duration_s"], theirs["duration_s"])


def test_failed_tier_records_zero(tiny_model_dir, decode_workload, tmp_path):
    """Every /generate failing: the warm-up fails, the tier records duration 0 (the toolkit's
    value) with every request failed, and `bench run` exits with status 3."""
    server = PacedServer(tiny_model_dir, fail_generate=True).start()
    try:
        rc = bench_main(["run", "--workload-dir", str(decode_workload), "--tiers", "S1", "--url", server.url,
                         "--out", str(tmp_path), "--no-progress", "--no-plots"])
    finally:
        server.stop()
    assert rc == 3
    t = json.loads((tmp_path / "result.json").read_text())["tiers"]["S1"]
    assert t["duration_s"] == 0.0 and t["failures"] == 3 and t["output_throughput"] is None
    assert "warm-up failed" in t["error"] and not t["length_check"]["ok"]
    assert "| S1 | 1 | 0/3 | 0.00 | - | - | 0 | no (3) |" in (tmp_path / "report.md").read_text()


# --------------------------------------------------------------------------- stream parsing


def test_stream_parsing_rules(tmp_path):
    """Multi-token chunks split their gap into per-token ITLs, a chunk with no new tokens and an
    error chunk are skipped, [DONE] still moves E2E, lengths are the last completion_tokens."""
    from aiohttp import web

    from salaserve.bench.client import stream_request

    events = [{"text": "a", "meta_info": {"completion_tokens": 1}},
              {"text": "ab", "meta_info": {"completion_tokens": 1}},  # no new token: skipped
              {"text": "abcd", "meta_info": {"completion_tokens": 4}},  # 3 tokens at once
              {"error": {"message": "ignored"}},
              {"text": "abcde", "meta_info": {"completion_tokens": 5}}]

    async def generate(request):
        body = await request.json()
        assert body["sampling_params"] == {"temperature": 0.0, "max_new_tokens": 5, "ignore_eos": True}
        assert body["stream"] is True and body["text"] == "hi"
        resp = web.StreamResponse()
        await resp.prepare(request)
        for ev in events:
            await asyncio.sleep(0.03)
            await resp.write(f"data: {json.dumps(ev)}\n\n".encode())
        await asyncio.sleep(0.05)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def main():
        app = web.Application()
        app.router.add_post("/generate", generate)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            return await stream_request(f"http://127.0.0.1:{port}/generate", "hi", 2, 5)
        finally:
            await runner.cleanup()

    r = asyncio.run(main())
    assert r.success and r.completion_tokens == 5 and r.text == "abcde"
    assert len(r.itl) == 4  # 3 (split) + 1
    assert r.itl[0] == r.itl[1] == r.itl[2] and r.itl[0] == pytest.approx(0.06 / 3, abs=0.012)
    assert r.ttft == pytest.approx(0.03, abs=0.02)
    assert r.latency > r.ttft + sum(r.itl) + 0.03  # E2E runs to the [DONE] line


def test_dataset_sampling_prunes_and_orders(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = [{"question": f"prompt number {i}", "model_response": "an answer of some words"} for i in range(6)]
    rows.append({"question": "no answer here"})  # -> "placeholder"
    rows.append({"question": "x", "model_response": "too short prompt"})  # BOS + 1 token: 2, kept
    rows.append({"question": "", "model_response": "empty prompt"})  # BOS only: pruned
    p = tmp_path / "S1.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pairs = read_pairs(p)
    assert ("no answer here", "placeholder") in pairs
    reqs = sample_requests(pairs, tok)
    assert len(reqs) == len(rows) - 1
    assert reqs == sample_requests(pairs, tok)  # deterministic (seed 1)
    assert [r.prompt for r in reqs] != [q for q, _ in pairs if q]  # shuffled, not file order
    for r in reqs:
        assert r.output_len == len(tok.encode(dict(pairs)[r.prompt]))


def test_parse_printed_report():
    text = ("============ Serving Benchmark Result ============\nBackend:                                 sglang\n"
            "Max request concurrency:                 not set   \nSuccessful requests:                     12        \n"
            "Benchmark duration (s):                  3.21      \nMean E2E Latency (ms):                   100.50    \n"
            "Median E2E Latency (ms):                 90.00     \nP90 E2E Latency (ms):                    150.25    \n"
            "P99 E2E Latency (ms):                    199.00    \n")
    printed = official.parse_report(text)
    assert printed["Benchmark duration (s)"] == 3.21 and printed["Successful requests"] == 12
    assert "Backend" not in printed
    assert official.printed_latency_ms(printed, "E2E Latency") == {"mean": 100.5, "p50": 90.0, "p90": 150.25,
                                                                  "p99": 199.0}


# --------------------------------------------------------------------------- compare and plots


def _result(path: Path, s1: float, s8: float, smax: float) -> str:
    path.write_text(json.dumps({"tiers": {"S1": {"duration_s": s1}, "S8": {"duration_s": s8},
                                          "Smax": {"duration_s": smax}}}))
    return str(path)


def test_compare_soar_score(tmp_path, capsys):
    # champion as the reference, the stock baseline scored against it (serving_protocol.md 5.3/5.4)
    champion = _result(tmp_path / "a.json", 105.93, 239.77, 659.34)
    baseline = _result(tmp_path / "b.json", 1029.49, 1298.65, 2544.34)
    assert bench_main(["compare", champion, baseline]) == 0
    out = capsys.readouterr().out
    assert "SOAR score of B against A = 17.43" in out  # 0.4*10.29 + 0.3*18.46 + 0.3*25.91
    assert "| S1 | 105.93 | 1029.49 | 0.103x | 10.29 |" in out

    assert bench_main(["compare", champion, baseline, "--coefficient", "0.96"]) == 0
    assert "= 16.73" in capsys.readouterr().out
    ev = tmp_path / "eval.json"
    ev.write_text(json.dumps({"summary": {"overall_accuracy": 98.5}}))  # C = 0.96
    assert bench_main(["compare", champion, baseline, "--eval", str(ev)]) == 0
    assert "C = 0.96; SOAR score of B against A = 16.73" in capsys.readouterr().out

    # B faster than A in S1 is the best there (100); a failed tier (0 s) scores 0
    a = _result(tmp_path / "c.json", 10.0, 10.0, 10.0)
    b = _result(tmp_path / "d.json", 5.0, 20.0, 0.0)
    assert bench_main(["compare", a, b]) == 0
    out = capsys.readouterr().out
    assert "| S1 | 10.00 | 5.00 | 2.000x | 100.00 |" in out and "| Smax | 10.00 | 0.00 | - | 0.00 |" in out
    assert "SOAR score of B against A = 55.00" in out  # 0.4*100 + 0.3*50 + 0


def test_plot_micro(tmp_path):
    src = REPO / "tests" / "data" / "micro-h200.json"  # a micro-benchmark JSON of the H200
    assert bench_main(["plot-micro", str(src), "--out", str(tmp_path)]) == 0
    for name in ("decode_vs_batch", "decode_vs_context", "prefill"):
        assert (tmp_path / f"{name}.png").read_bytes()[:8] == PNG_MAGIC, name


def test_cli_dispatch(capsys):
    from salaserve.cli import main

    assert main(["bench", "--help"]) == 0
    assert "salaserve bench run" in capsys.readouterr().out
    assert main(["bench", "run", "--url", "http://127.0.0.1:9", "--workload", "toy",
                 "--workload-dir", os.devnull]) == 2  # one of --workload / --workload-dir


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_profile_step_tool_runs_on_cpu(tmp_path, kv):
    """The per-kernel step profiler (a GPU tool) also runs on CPU, where it lists torch ops."""
    import json

    from benchmarks.profile_step import main
    from salaserve.model.checkpoint import write_checkpoint

    model = tmp_path / "tiny"
    write_checkpoint(str(model), "tiny", weights=False)
    out = tmp_path / "prof.json"
    assert main(["--model", str(model), "--batch", "2", "--context", "150", "--verify-k", "2",
                 "--top", "5", "--kv-cache-dtype", kv, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["total_us"] > 0 and data["kernels"]
    assert any("mm" in k["name"] or "linear" in k["name"] for k in data["kernels"])


def test_profile_step_prefill_mode_runs_on_cpu(tmp_path):
    """--prefill profiles one chunked prompt (CPU ops without a GPU) and writes its rows."""
    import json

    from benchmarks.profile_step import main
    from salaserve.model.checkpoint import write_checkpoint

    model = tmp_path / "tiny"
    write_checkpoint(str(model), "tiny", weights=False)
    out = tmp_path / "prefill.json"
    assert main(["--model", str(model), "--prefill", "300", "--top", "5", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["prefill"] == 300 and data["seconds"] > 0 and data["total_us"] > 0
    assert any("mm" in k["name"] or "linear" in k["name"] for k in data["kernels"])
    with pytest.raises(SystemExit):
        main(["--model", str(model), "--prefill", "300", "--graph"])


def test_profile_step_mixed_mode_times_a_prefill_carrying_step_on_cpu(tmp_path):
    """--mixed times one eager step of decode rows plus a prompt chunk (CPU ops here), gives every
    page and slot back, and refuses to mix with --graph."""
    import json

    from benchmarks import profile_step
    from salaserve.config import EngineArgs
    from salaserve.engine.runner import ModelRunner
    from salaserve.model.checkpoint import write_checkpoint

    model = tmp_path / "tiny"
    write_checkpoint(str(model), "tiny", weights=False)
    out = tmp_path / "mixed.json"
    assert profile_step.main(["--model", str(model), "--mixed", "40", "--batch", "3", "--context", "150",
                              "--top", "5", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["batch"] == 3 and data["prefill_tokens"] == 40
    assert 0 < data["build_ms"] and 0 < data["host_ms"] <= data["wall_ms"] and data["rows"]
    with pytest.raises(SystemExit):
        profile_step.main(["--model", str(model), "--mixed", "40", "--graph"])
    runner = ModelRunner(EngineArgs(model=str(model), load_format="dummy", max_running_requests=4,
                                    max_total_tokens=2048), str(model))
    pages, slots = runner.caches.kv.allocator.num_free, runner.caches.states.num_free
    profile_step.profile_mixed(runner, 2, 100, 30, iters=1)
    assert (runner.caches.kv.allocator.num_free, runner.caches.states.num_free) == (pages, slots)


def test_profile_step_quantized_lm_head_and_no_pdl_on_cpu(tmp_path):
    """--quantization w4a16 --quantize-lm-head --no-pdl profiles a step (CPU ops here) with lm_head
    quantized; --quantize-lm-head alone is refused with a usage error."""
    import json

    from benchmarks.profile_step import main
    from salaserve.kernels import _triton_utils
    from salaserve.model.checkpoint import write_checkpoint

    model = tmp_path / "tiny"
    write_checkpoint(str(model), "tiny", weights=False)
    out = tmp_path / "prof.json"
    before = _triton_utils._PDL
    try:
        assert main(["--model", str(model), "--batch", "1", "--context", "100", "--quantization", "w4a16",
                     "--quantize-lm-head", "--no-pdl", "--json", str(out)]) == 0
        assert _triton_utils._PDL is False
    finally:
        _triton_utils.set_pdl(before)
    assert json.loads(out.read_text())["total_us"] > 0
    with pytest.raises(SystemExit) as e:
        main(["--model", str(model), "--quantize-lm-head"])
    assert e.value.code == 2


def test_linear_breakdown_names_the_chain_linears():
    """profile_step's per-linear table: GEMV-like kernels in order qkv, o_proj, gate_up, down per layer,
    grouped by layer kind, then lm_head; other kernels ignored; None when the count does not fit."""
    from benchmarks.profile_step import linear_breakdown

    kinds = ["sparse", "lightning", "lightning"]
    seq = []
    for layer, kind in enumerate(kinds):
        for j, name in enumerate(["_w4_gemv_dp2a_kernel", "_gemv_kernel", "nvjet_sm90_tst", "_w4_gemv_dp2a_kernel"]):
            seq.append({"name": "_add_rms_norm_kernel", "dur_us": 2.0})
            seq.append({"name": name, "dur_us": 10.0 * (j + 1) + layer})
    seq.append({"name": "_gemv_kernel", "dur_us": 130.0})
    rows = {(r["layers"], r["linear"]): r for r in linear_breakdown(seq, kinds)}
    assert set(rows) == {(k, n) for k in ("sparse", "lightning") for n in ("qkv", "o_proj", "gate_up", "down")} | {
        ("", "lm_head")}
    assert rows[("sparse", "qkv")]["calls"] == 1 and rows[("sparse", "qkv")]["mean_us"] == 10.0
    assert rows[("lightning", "gate_up")]["calls"] == 2
    assert (rows[("lightning", "gate_up")]["min_us"], rows[("lightning", "gate_up")]["max_us"]) == (31.0, 32.0)
    assert rows[("", "lm_head")]["total_us"] == 130.0
    assert linear_breakdown(seq[:-1], kinds) is None


def test_kernel_timeline_span_busy_and_gaps():
    """Graph-replay timeline: overlapping kernels count once, gaps run from the end of everything so
    far (named by the kernel that ended last) to the next start, and non-kernel events are ignored."""
    from benchmarks.profile_step import kernel_timeline

    ev = [{"cat": "kernel", "ph": "X", "name": "b", "ts": 112.0, "dur": 5.0},
          {"cat": "kernel", "ph": "X", "name": "a", "ts": 100.0, "dur": 10.0},
          {"cat": "kernel", "ph": "X", "name": "a2", "ts": 104.0, "dur": 3.0},  # inside a
          {"cat": "gpu_memcpy", "ph": "X", "name": "copy", "ts": 90.0, "dur": 50.0},
          {"cat": "kernel", "ph": "X", "name": "c", "ts": 130.0, "dur": 2.0}]
    tl = kernel_timeline(ev)
    assert tl["kernels"] == 4
    assert tl["span_us"] == 32.0 and tl["busy_us"] == 17.0 and tl["idle_us"] == 15.0
    assert [(g["gap_us"], g["after"], g["before"]) for g in tl["gaps"]] == [(13.0, "b", "c"), (2.0, "a", "b")]
    assert [k["name"] for k in tl["sequence"]] == ["a", "a2", "b", "c"]
    assert kernel_timeline([])["kernels"] == 0


def test_profile_step_graph_mode_needs_captured_graphs(tmp_path):
    """--graph on a machine without CUDA graphs ends with a message, not a traceback."""
    from benchmarks.profile_step import main
    from salaserve.model.checkpoint import write_checkpoint

    model = tmp_path / "tiny"
    write_checkpoint(str(model), "tiny", weights=False)
    with pytest.raises(SystemExit, match="no captured decode graph"):
        main(["--model", str(model), "--batch", "1", "--context", "100,150", "--graph"])


def test_profile_step_ab_parses_switches_and_refuses_bad_ones(tmp_path):
    """--ab module:ATTR=v1,v2: values take the attribute's type (bools from 0/1); a malformed spec, an
    unknown module or attribute, a value of the wrong type, one value, or --ab without --graph give
    a CLI message."""
    from benchmarks.profile_step import main, parse_ab
    from salaserve.kernels import _triton_utils

    module, attr, values = parse_ab("salaserve.kernels._triton_utils:_PDL=0,1")
    assert module is _triton_utils and attr == "_PDL" and values == [False, True]
    assert parse_ab("salaserve.kernels.quant_gemm._common:SPLIT_K_CTAS_PER_SM=4, 8")[2] == [4, 8]
    for bad, msg in (("_PDL=0,1", "module:ATTR"), ("no.such.module:X=0,1", "cannot import"),
                     ("salaserve.kernels._triton_utils:NOPE=0,1", "no attribute"),
                     ("salaserve.kernels._triton_utils:_PDL=0,2", "not 0/1"),
                     ("salaserve.kernels.quant_gemm._common:SPLIT_K_CTAS_PER_SM=4,x", "is int"),
                     ("salaserve.kernels._triton_utils:_PDL=1", "two distinct values"),
                     ("salaserve.kernels._triton_utils:_PDL=1,true", "two distinct values")):
        with pytest.raises(ValueError, match=msg):
            parse_ab(bad)
    with pytest.raises(SystemExit):
        main(["--ab", "salaserve.kernels._triton_utils:_PDL=0,1"])  # no --graph


def test_profile_step_ab_times_each_value_with_its_own_graphs(monkeypatch):
    """ab_graph_replays captures one set of graphs per value (the switch set while capturing), then times
    the variants in interleaved rounds, each replayed with its own graphs and its switch value; the
    switch is restored afterwards and the runner keeps the first value's graphs."""
    import types

    from benchmarks import profile_step as ps

    module = types.SimpleNamespace(SWITCH=False)
    calls = []

    class Runner:
        graphs = None

        def _capture_graphs(self):
            self.graphs = ("graphs captured with", module.SWITCH)

        def build_batch(self, work):
            return "batch"

    def timer(runner, batch):
        assert runner.graphs == ("graphs captured with", module.SWITCH) and batch == "batch"
        calls.append(module.SWITCH)
        return (2.0 if module.SWITCH else 3.0) + len(calls) / 1000, True

    monkeypatch.setattr(ps, "fake_decoding_requests", lambda runner, b, ctx: [])
    monkeypatch.setattr(ps, "release", lambda runner, reqs: None)
    runner = Runner()
    times = ps.ab_graph_replays(runner, 1, 4096, module, "SWITCH", [False, True], rounds=3, timer=timer)
    assert calls == [False, True] * 3
    assert times == {False: [3.001, 3.003, 3.005], True: [2.002, 2.004, 2.006]}
    assert module.SWITCH is False and runner.graphs == ("graphs captured with", False)


@pytest.mark.parametrize("own_dtype", ["auto", "fp8_e4m3"])
def test_profile_step_ab_kv_cache_times_both_formats_on_the_same_pages(tiny_model_dir, own_dtype):
    """ab_kv_cache_replays: graphs captured on the runner's KV pool and on a second pool of the other
    format (fp8 <-> the model dtype) that holds the same pages' contents rounded to its format and
    shares the compressed keys and states; the rounds alternate the two with each one's own graphs;
    afterwards the runner has its own caches and graphs back and every page and slot returned."""
    from benchmarks import profile_step as ps
    from salaserve.cache.pages import FP8
    from salaserve.config import EngineArgs
    from salaserve.engine.runner import ModelRunner

    runner = ModelRunner(EngineArgs(model=tiny_model_dir, device="cpu", dtype="float32", backend="torch",
                                    max_running_requests=2, kv_cache_dtype=own_dtype), tiny_model_dir)
    own = runner.caches
    free_pages, free_slots = own.kv.allocator.num_free, own.states.num_free
    runner._capture_graphs = lambda: setattr(runner, "graphs", ("captured on", runner.caches))
    seen = []

    def timer(r, batch):
        assert r.graphs == ("captured on", r.caches)  # each variant replays its own graphs
        assert r.caches.compressed is own.compressed and r.caches.states is own.states
        seen.append(r.caches)
        return 1.0 + len(seen), True

    times = ps.ab_kv_cache_replays(runner, 2, 100, rounds=3, timer=timer)
    own_label = "fp8_e4m3 pages" if own_dtype == "fp8_e4m3" else "float32 pages"
    other_label = "float32 pages" if own_dtype == "fp8_e4m3" else "fp8_e4m3 pages"
    assert list(times) == [own_label, other_label]
    assert times == {own_label: [2.0, 4.0, 6.0], other_label: [3.0, 5.0, 7.0]}
    other = seen[1]
    assert [c is own for c in seen] == [True, False] * 3 and all(c is other for c in seen[1::2])
    assert other.kv.k.dtype == (torch.float32 if own_dtype == "fp8_e4m3" else FP8)
    for src, dst in ((own.kv.k, other.kv.k), (own.kv.v, other.kv.v)):
        assert src.float().abs().sum() > 0  # the requests' pages were filled
        assert torch.equal(dst.float(), src.float().to(dst.dtype).float())
    assert runner.caches is own and runner.graphs == ("captured on", own)
    assert (own.kv.allocator.num_free, own.states.num_free) == (free_pages, free_slots)


def test_micro_engine_decode_timing_returns_every_resource(tiny_model_dir):
    """micro's engine-loop timing (fake prefilled requests driven by Engine.step, overlap on and
    off) runs on the CPU too and gives back every page, slot and compressed entry."""
    from benchmarks.micro import time_engine_decode
    from salaserve.engine.engine import Engine

    engine = Engine(model=tiny_model_dir, device="cpu", dtype="float32", backend="torch", max_running_requests=4)
    initial = engine.resource_counters()
    for overlap in (True, False):
        ms = time_engine_decode(engine, batch=3, context=40, overlap=overlap, steps=4)
        assert ms > 0
        assert engine.resource_counters() == initial and not engine.has_unfinished()
    # 9 steps each; with overlap the last step's tokens were still in flight at the abort: dropped
    assert engine.stats["generated_tokens"] == 3 * (5 + 4 - 1) + 3 * (5 + 4)


def test_working_tree_id_names_the_commit_even_with_stale_git_metadata(tmp_path):
    """The GPU machine runs a copy of the working tree whose .git is older than its files:
    the tree id still equals the tree of the commit those files were committed in."""
    import shutil
    import subprocess

    from salaserve.bench.report import working_tree_id

    repo = tmp_path / "repo"
    repo.mkdir()

    def git(*args, cwd=repo):
        return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    (repo / ".gitignore").write_text("ignored/\n")
    (repo / "a.py").write_text("x = 1\n")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    stale = tmp_path / "stale"
    shutil.copytree(repo, stale)  # the copy's .git stops at "one"
    assert working_tree_id(str(repo)) == git("rev-parse", "HEAD^{tree}")

    (repo / "a.py").write_text("x = 2\n")
    (repo / "b.py").write_text("y = 1\n")  # a new file: untracked in the stale copy
    (repo / "ignored").mkdir()
    (repo / "ignored" / "cache.bin").write_text("junk")
    git("add", "a.py", "b.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "two")
    for name in ("a.py", "b.py", ".gitignore"):
        shutil.copy(repo / name, stale / name)
    (stale / "ignored").mkdir()
    (stale / "ignored" / "other.bin").write_text("other junk")
    want = git("rev-parse", "HEAD^{tree}")
    assert working_tree_id(str(repo)) == want
    assert working_tree_id(str(stale)) == want != git("rev-parse", "HEAD^{tree}", cwd=stale)
    # the checkouts' own indexes are untouched: b.py is still untracked in the stale copy
    assert "?? b.py" in git("status", "--porcelain", cwd=stale).splitlines()
    assert git("diff", "--cached", "--name-only", cwd=stale) == ""
