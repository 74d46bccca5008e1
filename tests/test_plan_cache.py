"""kernels/plan_cache.py: the start-up calibration picks written to disk and read back (CPU: the
pick tables filled by hand, as the GPU calibrations would fill them for device "cpu")."""

import dataclasses
import json
import logging

import pytest

from salaserve.kernels import gemv as G
from salaserve.kernels import plan_cache, tuning
from salaserve.kernels.options import KernelOptions
from salaserve.kernels.quant_gemm import fp8, w4_decode


@pytest.fixture
def opts(tmp_path):
    """Kernel options with a plan directory of the test's own."""
    return KernelOptions(plan_cache_dir=str(tmp_path / "plans"))


@pytest.fixture
def tables():
    """Empty pick tables (the process's picks back after the test), by name."""
    with tuning.isolated_tables():
        yield {t.name: t for t in tuning.tables()}


def _fill(t, dev="cpu"):
    """One pick of each kind, as the calibrations record them (fp8: a config and a w8a16 win)."""
    t["gemv"].put(dev, 1, (4096, 4096), G.Choice(G.GemvConfig(4, 1024, 4), 10.5, 12.25))
    t["gemv"].put(dev, 32, (4096, 16384), G.Choice(G.GemvConfig(128, 128, 8, 3, split_k=4, dot=True), 40.0, 38.0))
    t["fp8_gemv"].put(dev, 1, (32768, 4096), G.GemvConfig(32, 512, 8, 4, split_k=1, stream=True))
    t["fp8_gemv"].put(dev, 8, (32768, 4096), None)
    t["w4"].put(dev, 1, (16384, 4096, 128), ("fma", (64, 16, 4, 1), 8))
    t["w4_rounded"].put(dev, 1, (16384, 4096, 128), ("dp2a_rounded", (64, 16, 2, 4, 2, False), 8))


def _snapshot(t):
    return {name: dict(table.items()) for name, table in t.items()}


def test_picks_round_trip_and_drive_the_dispatch(tables, opts):
    _fill(tables)
    _fill(tables, dev="cuda:1")  # another device's picks stay out of this device's plan
    want = {name: {k: v for k, v in table.items() if k[0] == "cpu"} for name, table in _snapshot(tables).items()}
    path = plan_cache.save("cpu", opts)
    assert path is not None and path.exists()
    for table in tables.values():
        table.clear()
    assert plan_cache.load("cpu", opts) == 6
    assert _snapshot(tables) == want
    # the restored picks are what the kernels' dispatch reads
    assert G.choose_config(1, 4096, 4096, "cpu") == G.GemvConfig(4, 1024, 4)
    assert G.uses_gemv(1, 4096, 4096, "cpu") and not G.uses_gemv(32, 4096, 16384, "cpu")
    w = type("W", (), dict(out_features=32768, in_features=4096))()
    assert fp8.fp8_gemv_choice(1, w, "cpu") == G.GemvConfig(32, 512, 8, 4, split_k=1, stream=True)
    assert fp8.fp8_gemv_choice(8, w, "cpu") is None
    w4 = type("W4", (), dict(format="w4a16", out_features=16384, in_features=4096, group_size=128))()
    assert w4_decode.w4_rounded_choice(1, w4, "cpu") == ("dp2a_rounded", (64, 16, 2, 4, 2, False), 8)
    assert w4_decode.w4_rounded_choice(2, w4, "cpu") is None


def test_picks_in_the_tables_win_and_saves_merge(tables, opts):
    _fill(tables)
    plan_cache.save("cpu", opts)
    newer = G.Choice(G.GemvConfig(2, 1024, 4), 9.0, 12.0)
    for table in tables.values():
        table.clear()
    tables["gemv"].put("cpu", 1, (4096, 4096), newer)  # calibrated in this process: kept
    tables["gemv"].put("cpu", 2, (8704, 4096), G.Choice(G.GemvConfig(2, 1024, 4), 11.0, 15.0))  # new shape
    assert plan_cache.load("cpu", opts) == 5
    assert tables["gemv"].get("cpu", 1, (4096, 4096)) == newer
    plan_cache.save("cpu", opts)
    data = json.loads(plan_cache.plan_path("cpu", opts).read_text())
    keys = [k for k, _ in data["tables"]["gemv"]]
    assert [1, 4096, 4096] in keys and [2, 8704, 4096] in keys and [32, 4096, 16384] in keys
    assert data["fingerprint"]["gpu"] == "cpu"


def test_a_changed_option_or_kernel_source_is_another_plan(tables, opts):
    _fill(tables)
    first = plan_cache.save("cpu", opts)
    no_wgmma = dataclasses.replace(opts, w4_wgmma=False)  # the candidates differ: the picks may be stale
    assert plan_cache.plan_path("cpu", no_wgmma) != first
    for table in tables.values():
        table.clear()
    assert plan_cache.load("cpu", no_wgmma) == 0
    # options that leave the candidates alone share the plan
    assert plan_cache.plan_path("cpu", dataclasses.replace(opts, parallel_compile=False, w4a16_prefill="bf16")) == first
    fp = plan_cache.fingerprint("cpu", opts)
    assert len(fp["kernels"]) == 16 and fp["switches"] == {"w4_wgmma": True}


def test_bad_files_and_unwritable_directories_never_fail_a_start_up(tables, opts, tmp_path, caplog):
    _fill(tables)
    path = plan_cache.save("cpu", opts)
    for table in tables.values():
        table.clear()
    caplog.set_level(logging.WARNING, logger="salaserve.kernels.plan_cache")
    path.write_text("{not json")
    assert plan_cache.load("cpu", opts) == 0 and "unreadable" in caplog.text
    path.write_text(json.dumps(dict(format=plan_cache.PLAN_FORMAT, tables=dict(gemv=[[[1, 4096], {"gemv": {}}]]))))
    assert plan_cache.load("cpu", opts) == 0 and "malformed" in caplog.text
    assert all(not len(t) for t in tables.values())
    # a plan directory that cannot be made (a file in its place): a warning, no plan
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    _fill(tables)
    blocked = KernelOptions(plan_cache_dir=str(blocker / "plans"))
    assert plan_cache.save("cpu", blocked) is None and "could not write" in caplog.text


def test_plans_off(tables):
    opts = KernelOptions(plan_cache_dir=None)
    _fill(tables)
    assert plan_cache.plan_path("cpu", opts) is None
    assert plan_cache.save("cpu", opts) is None and plan_cache.load("cpu", opts) == 0


def test_nothing_to_save_writes_no_file(tables, opts):
    assert plan_cache.save("cpu", opts) is None
    assert not plan_cache.plan_path("cpu", opts).exists()


def test_backend_start_up_loads_then_saves(monkeypatch):
    """TritonBackend.prepare reads the plan before its calibrations and writes it after."""
    from salaserve.config import preset_config
    from salaserve.kernels.triton_backend import TritonBackend

    calls = []
    monkeypatch.setattr(plan_cache, "load", lambda device, opts: calls.append(("load", str(device))) or 0)
    monkeypatch.setattr(TritonBackend, "_calibrate", lambda self, *a: calls.append(("calibrate",)))
    monkeypatch.setattr(plan_cache, "save", lambda device, opts: calls.append(("save", str(device))))
    TritonBackend().prepare(preset_config("tiny"), "cpu")
    assert calls == [("load", "cpu"), ("calibrate",), ("save", "cpu")]


def test_a_save_keeps_the_tables_of_families_not_imported(tables, opts):
    """Picks on file under a table no imported family registered stay in the file across saves."""
    _fill(tables)
    path = plan_cache.save("cpu", opts)
    data = json.loads(path.read_text())
    data["tables"]["other_family"] = [[[1, 64, 64], "pick"]]
    path.write_text(json.dumps(data))
    assert plan_cache.save("cpu", opts) == path
    assert json.loads(path.read_text())["tables"]["other_family"] == [[[1, 64, 64], "pick"]]
