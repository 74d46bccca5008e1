"""`python -m salaserve.soar.missing_requirements`: salaserve's requirements that are not installed
at all, one per line (a pip requirements file), for prepare_env.sh to install.

A requirement that is installed is kept even outside salaserve's tested range, with a note on
stderr: on the SOAR base image torch is a CUDA build matched to the driver and SGLang depends on
the versions it has; replacing them is not a submission's business. The `gpu` extra (Triton,
fla-core) counts when torch sees a CUDA device.
"""

from __future__ import annotations

import sys
from importlib import metadata

from packaging.requirements import Requirement


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def missing_requirements(extras: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(requirements to install, notes on installed versions outside the tested range)."""
    missing, notes = [], []
    for line in metadata.requires("salaserve") or []:
        req = Requirement(line)
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in ("", *extras)):
            continue
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            missing.append(f"{req.name}{req.specifier}")  # without the extra marker
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            notes.append(f"note: keeping the installed {req.name} {have} (salaserve is tested with {req.specifier})")
    return missing, notes


def main() -> int:
    missing, notes = missing_requirements(("gpu",) if cuda_available() else ())
    for note in notes:
        print(note, file=sys.stderr)
    for req in missing:
        print(req)
    return 0


if __name__ == "__main__":
    sys.exit(main())
