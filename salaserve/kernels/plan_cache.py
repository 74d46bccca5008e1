"""Start-up calibration picks kept on disk ("plans"): a restart skips the timing, and with an
empty Triton kernel cache compiles only the kernels that were picked instead of every candidate
(an fp8 engine's cold start-up: 117 s calibrating, 84 s with a plan).

    load(device, options) -> int            picks restored into the calibration tables (0: none on file)
    save(device, options) -> Path | None    this device's picks written (merged with the file's)

The tables: every tuning.PickTable of the imported kernel families (gemv's bf16 GEMV config and
whether it beats cuBLAS, per M bucket and shape; quant_gemm's fp8 GEMV and int4 ones), each stored
as [[bucket, *shape], pick] pairs under its name. The calibrations skip keys already present, so a
load before them leaves only new shapes to time.

File: KernelOptions.plan_cache_dir (`--plan-cache-dir`; default ~/.cache/salaserve/plans; None
turns plans off) / plan-<fingerprint>.json. The fingerprint holds everything that can make a pick
stale: the GPU's name and compute capability, torch, triton and salaserve versions, the kernel
sources (_SOURCES: gemv, quant_gemm/ and the tuner, so any kernel or candidate-list change starts
over) and the options that change the candidates (KernelOptions.pick_switches). Entries of every model shape seen accumulate in one file per fingerprint. A pick can only be
slower than a fresh one, never wrong: each is a config the kernels accept at that shape. An
unreadable file is ignored with a warning, never a failed start-up.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Optional

import torch

from salaserve.kernels.options import KernelOptions
from salaserve.kernels.tuning import device_key, tables

log = logging.getLogger(__name__)

PLAN_FORMAT = 1

# the kernel sources a pick depends on (files or packages under salaserve/kernels): any kernel or
# candidate-list change there starts a new plan
_SOURCES = ("gemv", "quant_gemm", "tuning.py")


def fingerprint(device, options: KernelOptions) -> dict:
    """What the picks depend on besides the shapes (see the module docstring)."""
    import triton

    from salaserve._version import __version__

    d = torch.device(device)
    if d.type == "cuda":
        gpu = torch.cuda.get_device_name(d)
        capability = list(torch.cuda.get_device_capability(d))
    else:
        gpu, capability = d.type, []
    kernels = Path(__file__).parent
    sources = hashlib.sha256()
    for name in _SOURCES:
        for path in sorted((kernels / name).glob("*.py")) if (kernels / name).is_dir() else [kernels / name]:
            sources.update(path.name.encode() + b"\0" + path.read_bytes())
    return dict(format=PLAN_FORMAT, gpu=gpu, capability=capability, torch=torch.__version__,
                triton=triton.__version__, salaserve=__version__, kernels=sources.hexdigest()[:16],
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
    dev = device_key(device)
    restored = 0
    try:
        for table in tables():
            for key, value in data["tables"].get(table.name, []):
                restored += table.restore((dev, *key), table.decode(value))
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
    dev = device_key(device)
    old = _read(path) or {"tables": {}}
    on_file = dict(old["tables"])  # tables of families not imported here stay as they were
    for table in tables():
        entries = {json.dumps(k): v for k, v in old["tables"].get(table.name, [])}
        for key, value in table.items():
            if key[0] == dev:
                entries[json.dumps(list(key[1:]))] = table.encode(value)
        on_file[table.name] = [[json.loads(k), v] for k, v in sorted(entries.items())]
    if not any(on_file.values()):
        return None
    data = dict(format=PLAN_FORMAT, fingerprint=fp, tables=on_file)
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
