"""`salaserve bench e2e`'s bookkeeping on the CPU: TTFT excess, floors, and --append."""

import json

import pytest

from salaserve.bench.e2e import Shape, decode_floor_s, previous_configs, server_args, ttft_excess
from salaserve.bench.floors import Ceilings
from salaserve.config import preset_config


def test_ttft_excess_counts_only_prompts_still_queued_when_sent():
    rate = 0.001  # s per prompt token
    records = [
        {"success": True, "sent_s": 0.0, "ttft_s": 1.0, "prompt_len": 1000},  # alone: no excess
        {"success": True, "sent_s": 0.5, "ttft_s": 2.5, "prompt_len": 1000},  # behind the first: 1 s its own
        {"success": True, "sent_s": 5.0, "ttft_s": 4.0, "prompt_len": 1000},  # nothing queued: 3 s excess
        {"success": False, "sent_s": 0.1, "ttft_s": 0.0, "prompt_len": 10_000},  # failed: ignored
    ]
    got = ttft_excess(records, rate)
    assert got == pytest.approx([0.0, 2.5 - 2.0, 3.0])


def test_decode_floor_grows_with_lower_concurrency():
    cfg = preset_config("full")
    ceil = Ceilings(copy_gbps=3000.0, matmul_tflops=700.0)
    shapes = [Shape(4000, 100)] * 8
    one_at_a_time = decode_floor_s(cfg, shapes, 1, ceil, 2.0)
    all_at_once = decode_floor_s(cfg, shapes, None, ceil, 2.0)
    assert one_at_a_time > 4 * all_at_once > 0  # the weights are read once per step, not per request


def test_append_keeps_other_configurations_of_the_same_workload(tmp_path):
    out = tmp_path / "latest.json"
    assert previous_configs(out, "soar-quick", 0) == {}  # no file yet
    out.write_text(json.dumps({"workload": "soar-quick", "seed": 0, "configs": {"bf16": {"startup_s": 1.0}}}))
    assert previous_configs(out, "soar-quick", 0) == {"bf16": {"startup_s": 1.0}}
    assert previous_configs(out, "soar-quick", 1) == {}  # another seed is another measurement
    assert previous_configs(out, "soar", 0) == {}
    out.write_text("{not json")
    assert previous_configs(out, "soar-quick", 0) == {}


def test_table_shows_what_was_built_after_ready():
    from salaserve.bench.e2e import table

    tier = {"duration_s": 10.0, "floor_s": 8.0, "floor_over_achieved": 0.8, "ttft_ms": {"p50": 1.0, "p90": 2.0},
            "itl_ms": {"p50": 5.0, "p99": 9.0}, "max_ttft_excess_s": 0.5}
    summary = {"configs": {"bf16": {"startup_s": 99.0, "cold_builds_after_ready": 0, "tiers": {"S1": tier}}}}
    row = table(summary).splitlines()[-1]
    assert row == "| bf16 | S1 | 10.0 | 8.0 | 0.80 | 1 / 2 | 5.0 / 9 | 0.5 | 99 | 0 |"


def test_cold_builds_are_read_where_the_server_reports_them(tiny_server):
    from salaserve.bench.e2e import cold_builds_after_ready

    assert cold_builds_after_ready(tiny_server.server_info()) == 0  # CPU: no Triton, nothing built
    assert cold_builds_after_ready({"internal_states": [{"cold_builds_after_ready": 3}]}) == 3
    assert cold_builds_after_ready(None) is None


def test_config_may_name_its_own_tiers(monkeypatch, tmp_path, capsys):
    """`--config NAME@TIERS=FLAGS`: a variant that only some tiers tell apart runs only those, in the
    same call as the full configurations."""
    import salaserve.bench.e2e as e2e
    from salaserve.bench.cli import e2e_main

    seen = {}

    def fake_run(configs, out_json, work_dir, argv, **kw):
        seen.update(configs=configs, **kw)
        return {"configs": {}}

    monkeypatch.setattr(e2e, "run_e2e", fake_run)
    out = str(tmp_path / "l.json")
    assert e2e_main(["--out", out, "--config", "bf16=", "--config", "bf16-lof@Smax=--schedule-policy lof"]) in (0, None)
    assert seen["configs"] == {"bf16": "", "bf16-lof": "--schedule-policy lof"}
    assert seen["config_tiers"] == {"bf16-lof": ("Smax",)}
    assert seen["tiers"] == ("S1", "S8", "Smax")
    with pytest.raises(SystemExit):
        e2e_main(["--out", out, "--config", "x@S9=--quantization fp8"])
    assert "tiers must be among" in capsys.readouterr().err


def test_servers_run_with_the_platform_flags_unless_a_configuration_overrides_them():
    from salaserve.server.args import parse_args

    engine, server, _ = parse_args(["--model-path", "/m", *server_args("--quantization w4a16").split()])
    assert engine.max_running_requests == 32 and server.enable_metrics and engine.load_format == "dummy"
    assert engine.quantization == "w4a16"
    engine, _, _ = parse_args(["--model-path", "/m", *server_args("--max-running-requests 64").split()])
    assert engine.max_running_requests == 64
    engine, _, _ = parse_args(["--model-path", "/m"])
    assert engine.max_running_requests == 64  # the server's own default, which the platform overrides
