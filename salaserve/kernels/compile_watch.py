"""Cold-path detection: every Triton kernel specialisation built, autotuner search and CUDA graph
capture, with when it happened relative to the server being ready.

Start-up (calibration, warm-up, graph capture) is meant to build everything a request will ever
need; anything built later stalls the requests of that step for the compile's seconds (a cold
Triton compile of one kernel is 0.5-5 s, an autotune search several compiles plus timing). The
watch makes such a cold path visible: `install()` once per process, `mark_ready()` when start-up
is over, then `after_ready()` lists what was built since (the engine logs each as a warning and
/get_server_info reports the count).

Triton calls `knobs.runtime.jit_cache_hook` before and `jit_post_compile_hook` after each new
specialisation enters a kernel's in-memory cache (compiled, or loaded from the on-disk cache);
an autotuner searches only on a key it has not seen (`Autotuner.prune_configs` runs then).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class BuildEvent:
    kind: str  # "compile" | "autotune" | "graph"
    name: str  # kernel or graph name
    detail: str  # specialisation / key / shape, for the log
    seconds: float  # how long it took (0 where unknown)
    after_ready: bool


class CompileWatch:
    def __init__(self):
        self.events: list[BuildEvent] = []
        self.ready = False
        self.num_after_ready = 0
        self._lock = threading.Lock()
        self._started: dict[int, float] = {}  # id of a compile's key -> start time
        self._specs: dict[str, list[dict[str, str]]] = {}  # kernel -> its builds' specialisations
        self._installed = False

    # ---- recording ---------------------------------------------------------------------------
    def record(self, kind: str, name: str, detail: str = "", seconds: float = 0.0) -> None:
        with self._lock:
            self.events.append(BuildEvent(kind, name, detail, seconds, self.ready))
            self.num_after_ready += self.ready

    def mark_ready(self) -> None:
        """Start-up is over: what is built from now on is a cold path."""
        self.ready = True

    def after_ready(self) -> list[BuildEvent]:
        with self._lock:
            return [e for e in self.events if e.after_ready]

    def counts(self) -> dict[str, int]:
        """Events per kind, before and after ready (e.g. {'compile': 412, 'compile_after_ready': 0})."""
        out: dict[str, int] = {}
        with self._lock:
            for e in self.events:
                key = f"{e.kind}_after_ready" if e.after_ready else e.kind
                out[key] = out.get(key, 0) + 1
        return out

    # ---- Triton hooks ------------------------------------------------------------------------
    def _before_compile(self, *, key, **_) -> None:
        self._started[id(key)] = time.perf_counter()
        return None  # (a true value would tell Triton to skip the compile)

    def _after_compile(self, *, key, repr, fn, compile=None, **_) -> None:
        start = self._started.pop(id(key), None)
        seconds = time.perf_counter() - start if start is not None else 0.0
        name = getattr(fn, "name", str(fn))
        detail = repr
        try:  # which arguments made this specialisation new (never let the diagnosis break a compile)
            spec = specialisation(compile or {})
            detail = describe_new(spec, self._specs.setdefault(name, [])) or repr
            self._specs[name].append(spec)
        except Exception:  # noqa: BLE001
            pass
        self.record("compile", name, detail, seconds)
        return None

    def install(self) -> bool:
        """Hook into Triton (chaining hooks already set); False where Triton or its hooks are
        missing. Idempotent."""
        if self._installed:
            return True
        try:
            from triton import knobs
            from triton.runtime.autotuner import Autotuner
        except ImportError:
            return False
        runtime = knobs.runtime
        if not hasattr(runtime, "jit_post_compile_hook"):
            return False
        runtime.jit_cache_hook = _chain(runtime.jit_cache_hook, self._before_compile)
        runtime.jit_post_compile_hook = _chain(runtime.jit_post_compile_hook, self._after_compile)

        watch = self
        prune = Autotuner.prune_configs

        def prune_configs(tuner, kwargs, *args, **kw):  # only called on a key not searched yet
            configs = prune(tuner, kwargs, *args, **kw)
            if len(configs) > 1:
                fn = tuner.fn
                while hasattr(fn, "fn"):
                    fn = fn.fn
                watch.record("autotune", getattr(fn, "__name__", str(fn)), f"{len(configs)} configs")
            return configs

        Autotuner.prune_configs = prune_configs
        self._installed = True
        return True


def specialisation(compile: dict) -> dict[str, str]:
    """Argument name -> how Triton specialised it, from a compile hook's `compile` dict: the type
    ('*bf16', 'i32', 'fp32', ...), '/16' where the value (or pointer) was divisible by 16, and
    '=value' for constexprs (an int argument equal to 1 becomes one)."""
    signature = compile.get("signature") or {}
    constants = {k[0] if isinstance(k, tuple) and len(k) == 1 else k: v
                 for k, v in (compile.get("constants") or {}).items()}
    attrs = (compile.get("configs") or [{}])[0] or {}
    divisible = {k[0] for k, v in attrs.items() if isinstance(k, tuple) and len(k) == 1
                 and any("divisibility" in str(a) for a in v)}
    out = {}
    for i, (name, ty) in enumerate(signature.items()):
        desc = str(ty) + ("/16" if i in divisible else "")
        if i in constants or name in constants:
            value = constants.get(i, constants.get(name))
            desc += f"={getattr(value, 'value', value)!r}"[:40]
        out[name] = desc
    return out


def describe_new(spec: dict[str, str], earlier: list[dict[str, str]]) -> str:
    """How `spec` differs from the nearest earlier specialisation of the same kernel, e.g.
    'new specialisation: nb i32 -> i32/16, width i32/16 -> constexpr=1' ('' for the first)."""
    if not earlier or not spec:
        return ""
    nearest = min(earlier, key=lambda e: sum(e.get(k) != v for k, v in spec.items()))
    diffs = [f"{k} {nearest.get(k)} -> {v}" for k, v in spec.items() if nearest.get(k) != v]
    return "new specialisation: " + (", ".join(diffs) if diffs else "same arguments (options or dtypes differ)")


def _chain(existing, hook):
    if existing is None:
        return hook

    def both(**kwargs):
        first = existing(**kwargs)
        second = hook(**kwargs)
        return first or second

    return both


WATCH = CompileWatch()  # one per process: Triton's hooks are process-wide
