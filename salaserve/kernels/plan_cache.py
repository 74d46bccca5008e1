"""Start-up calibration picks kept on disk ("plans"): a restart skips the timing, and with an
empty Triton kernel cache compiles only the kernels that were picked instead of every candidate
(an fp8 engine's cold start-up: 117 s calibrating, 84 s with a plan).

    load(device, options) -> int            picks restored into the calibration tables (0: none on file)
    save(device, options) -> Path | None    this device's picks written (merged with the file's)

The tables: gemv's (bf16 GEMV config and whether it beats cuBLAS, per M bucket and shape) and
quant_gemm's fp8 GEMV and int4 ones. The calibrations skip keys already present, so a load
before them leaves only new shapes to time.

File: KernelOptions.plan_cache_dir (`--plan-cache-dir`; default ~/.cache/salaserve/plans; None
turns plans off) / plan-<fingerprint>.json. The fingerprint holds everything that can make a pick
stale: the GPU's name and compute capability, torch, triton and salaserve versions, the kernel
sources (gemv.py and quant_gemm/, so any kernel or candidate-list change starts over) and the
options that change the candidates (KernelOptions.pick_switches).
Entries of every model shape seen accumulate in one file per fingerprint. A pick can only be
slower than a fresh one, never wrong: each is a config the kernels accept at that shape. An
unreadable file is ignored with a warning, never a failed start-up.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch

from salaserve.kernels.options import KernelOptions
from salaserve.kernels.quant_gemm._common import _device_key

log = logging.getLogger(__name__)

PLAN_FORMAT = 1


class _Table(NamedTuple):
    name: str
    get: Callable[[], dict]  # the live dict (looked up at call time: tests may swap it)
    device_pos: int  # where the device string sits in the key
    encode: Callable  # value -> JSON
    decode: Callable  # JSON -> value


def _gemv_config(d: Optional[dict]):
    from salaserve.kernels.gemv import GemvConfig

    return None if d is None else GemvConfig(**d)


def _tables() -> list[_Table]:
    from salaserve.kernels import gemv as G
    from salaserve.kernels.quant_gemm import fp8, w4_decode

    def choice_encode(c):
        return dict(gemv=dataclasses.asdict(c.gemv), gemv_us=c.gemv_us, cublas_us=c.cublas_us)

    def choice_decode(d):
        return G.Choice(_gemv_config(d["gemv"]), float(d["gemv_us"]), float(d["cublas_us"]))

    return [
        _Table("gemv", lambda: G._TABLE, 0, choice_encode, choice_decode),
        _Table("fp8_gemv", lambda: fp8._FP8_GEMV_TABLE, 3,
               lambda c: None if c is None else dataclasses.asdict(c), _gemv_config),
        _Table("w4", lambda: w4_decode._W4_TABLE, 4, lambda v: [v[0], list(v[1]), v[2]],
               lambda v: (str(v[0]), tuple(v[1]), int(v[2]))),
        _Table("w4_rounded", lambda: w4_decode._W4_ROUNDED_TABLE, 4, lambda v: [v[0], list(v[1]), v[2]],
               lambda v: (str(v[0]), tuple(v[1]), int(v[2]))),
    ]


def fingerprint(device, options: KernelOptions) -> dict:
    """What the picks depend on besides the shapes (see the module docstring)."""
    import triton

    import salaserve
    from salaserve.kernels import gemv

    d = torch.device(device)
    if d.type == "cuda":
        gpu = torch.cuda.get_device_name(d)
        capability = list(torch.cuda.get_device_capability(d))
    else:
        gpu, capability = d.type, []
    kernels = Path(gemv.__file__).parent
    sources = hashlib.sha256()
    for path in [kernels / "gemv.py", *sorted((kernels / "quant_gemm").glob("*.py"))]:
        sources.update(path.name.encode() + b"\0" + path.read_bytes())
    return dict(format=PLAN_FORMAT, gpu=gpu, capability=capability, torch=torch.__version__,
                triton=triton.__version__, salaserve=salaserve.__version__, kernels=sources.hexdigest()[:16],
                switches=options.pick_switches())


def _plan(device, options: KernelOptions) -> tuple[Optional[Path], Optional[dict]]:
    """(this device's plan file, its fingerprint); (None, None) with plans off."""
    root = options.plan_dir()
    if root is None:
        return None, None
    fp = fingerprint(device, options)
    digest = hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:20]
    return root / f"plan-{digest}.json", fp


def plan_path(device, options: KernelOptions) -> Optional[Path]:
    """This device's plan file (None: plans off)."""
    return _plan(device, options)[0]


def _read(path: Path) -> Optional[dict]:
    try:
        data = json.loads(path.read_text())
        if data.get("format") != PLAN_FORMAT or not isinstance(data.get("tables"), dict):
            raise ValueError(f"not a format-{PLAN_FORMAT} plan")
        return data
    except FileNotFoundError:
        return None
    except (OSError, ValueError, AttributeError) as e:
        log.warning("plan cache %s unreadable (%s): calibrating from scratch", path, e)
        return None


def load(device, options: KernelOptions) -> int:
    """Restore this device's picks from its plan file into the tables (existing keys win).
    Returns how many were restored."""
    path = plan_path(device, options)
    data = _read(path) if path is not None else None
    if data is None:
        return 0
    dev = _device_key(device)
    restored = 0
    try:
        for t in _tables():
            table = t.get()
            for key, value in data["tables"].get(t.name, []):
                full = tuple(key[:t.device_pos]) + (dev,) + tuple(key[t.device_pos:])
                if full not in table:
                    table[full] = t.decode(value)
                    restored += 1
    except (TypeError, ValueError, KeyError, IndexError) as e:
        log.warning("plan cache %s has a malformed entry (%s): ignoring the rest", path, e)
    if restored:
        log.info("plan cache: %d calibration picks restored from %s", restored, path)
    return restored


def save(device, options: KernelOptions) -> Optional[Path]:
    """Write this device's picks (merged with those already on file) to its plan file, atomically.
    Returns the path, or None (plans off, or nothing to write)."""
    path, fp = _plan(device, options)
    if path is None:
        return None
    dev = _device_key(device)
    old = _read(path) or {"tables": {}}
    tables = {}
    for t in _tables():
        entries = {json.dumps(k): v for k, v in old["tables"].get(t.name, [])}
        for key, value in t.get().items():
            if key[t.device_pos] == dev:
                short = list(key[:t.device_pos]) + list(key[t.device_pos + 1:])
                entries[json.dumps(short)] = t.encode(value)
        tables[t.name] = [[json.loads(k), v] for k, v in sorted(entries.items())]
    if not any(tables.values()):
        return None
    data = dict(format=PLAN_FORMAT, fingerprint=fp, tables=tables)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name, suffix=".tmp", delete=False) as f:
            json.dump(data, f, indent=1)
        os.replace(f.name, path)
    except OSError as e:  # a read-only home must not fail the start-up
        log.warning("plan cache: could not write %s (%s)", path, e)
        return None
    log.info("plan cache: calibration picks saved to %s", path)
    return path
