"""The start-up tuner: one recipe that picks, per weight shape and M bucket, the fastest launch of a
kernel family, measured on this GPU, and the one table type its dispatch reads.

    PickTable(name, encode, decode)   (device, M bucket, *shape) -> pick; kept on disk by the plan cache
    Family                            a kernel family's tuning: its candidates, operands and record
    tune(family, items, device, m_values, parallel_compile=)   the recipe below
    Stopwatch.fastest(trials, calls)  the timing step a family's `tune_bucket` calls

The recipe (`tune`), for one family and the items it tunes (weight shapes, or weights):
  1. work: per item, the M buckets (powers of two) the family tunes there that have no pick yet;
     picks restored from a plan (plan_cache.load) count, so a restart times only new shapes;
  2. compile ahead: every candidate launch of the whole work in one batch on a thread pool
     (compile_ahead.precompile; the Triton compiles dominated a cold start-up);
  3. time: per item, L2-busting operand copies made once (timing.l2_busting_count), then per bucket
     each candidate in a CUDA graph of back-to-back calls cycling through the copies
     (timing.graph_time_us); the fastest wins, the first one on a tie;
  4. record the winner in the family's table(s), which the family's dispatch reads.

Its parts beside it: timing.py (the CUDA-graph stopwatch), compile_ahead.py (the parallel compiles),
plan_cache.py (the tables on disk). The families: gemv/tuning.py's bf16 GEMV against cuBLAS,
quant_gemm/fp8.py's fp8 GEMV against w8a16, quant_gemm/w4_decode.py's int4 decode kernels (and
the rounded-x route). Every PickTable registers itself at construction, so the plan cache holds
every family whose module is imported (TritonBackend.prepare imports them all first).

GPU only: off the GPU `tune` times nothing unless it is handed a stopwatch (the CPU tests fake one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch

from salaserve.kernels.compile_ahead import precompile
from salaserve.kernels.timing import graph_time_us

# ---------------------------------------------------------------------------------------------
# The table type
# ---------------------------------------------------------------------------------------------

_TABLES: dict[str, "PickTable"] = {}


def device_key(device) -> str:
    """The tables' device name: "cuda" (the runner's device) and x.device ("cuda:0") must meet."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return str(d)


def m_bucket(M: int) -> int:
    """The M bucket of M rows: the power of two >= M (1 for M <= 1)."""
    return 1 if M <= 1 else 1 << (M - 1).bit_length()


def _identity(v):
    return v


class PickTable:
    """One family's picks: (device, M bucket, *shape) -> pick. A pick may be None (the family's
    baseline won, e.g. w8a16 over the fp8 GEMV), which differs from no pick (not tuned: `has`).
    encode / decode turn a pick into JSON and back for the plan cache; the plan file stores the keys
    without the device, as [bucket, *shape]."""

    def __init__(self, name: str, encode: Callable[[Any], Any] = _identity,
                 decode: Callable[[Any], Any] = _identity):
        if name in _TABLES:
            raise ValueError(f"a pick table named {name!r} exists already")
        self.name, self.encode, self.decode = name, encode, decode
        self._picks: dict[tuple, Any] = {}
        _TABLES[name] = self

    def get(self, device, M: int, shape: tuple):
        """The pick for M rows (its bucket) at this shape, or None (the dispatch's lookup: eager
        steps make one per linear, so it stays a single dict probe)."""
        return self._picks.get((device_key(device), m_bucket(M), *shape))

    def has(self, device, M: int, shape: tuple) -> bool:
        return (device_key(device), m_bucket(M), *shape) in self._picks

    def put(self, device, M: int, shape: tuple, pick) -> None:
        self._picks[(device_key(device), m_bucket(M), *(int(s) for s in shape))] = pick

    def items(self) -> list[tuple[tuple, Any]]:
        """Every (key, pick), key = (device, bucket, *shape)."""
        return list(self._picks.items())

    def restore(self, key: tuple, pick) -> bool:
        """Set key (device, bucket, *shape) unless a pick is there already (the plan cache's load:
        picks of this process win). Returns whether it was set."""
        if key in self._picks:
            return False
        self._picks[key] = pick
        return True

    def clear(self) -> None:
        self._picks.clear()

    def __len__(self) -> int:
        return len(self._picks)


def tables() -> list[PickTable]:
    """Every pick table of the imported kernel families, in registration order."""
    return list(_TABLES.values())


class isolated_tables:
    """Within the block the given pick tables (default: all) start empty; their picks from before
    are back after it (tests that fill the tables by hand, or run without a family's picks)."""

    def __init__(self, *tables: PickTable):
        self._tables = tables or tuple(_TABLES.values())

    def __enter__(self):
        self._saved = [(t, t._picks) for t in self._tables]
        for t in self._tables:
            t._picks = {}
        return self

    def __exit__(self, *exc):
        for t, picks in self._saved:
            t._picks = picks
        return False


# ---------------------------------------------------------------------------------------------
# The recipe
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Trial:
    """One candidate ready to time: `run(i)` makes call i of the timing graph (i cycles through the
    operand copies); `pick` is what the table records if it wins."""

    pick: Any
    run: Callable[[int], object]
    label: str = ""


class Stopwatch:
    """Times trials in CUDA graphs of `calls` back-to-back calls (timing.graph_time_us, or `timer`);
    prints every time after `label` when verbose."""

    def __init__(self, timer: Callable[[Callable[[int], object], int], float] = None, verbose: bool = False):
        self.timer = timer or (lambda run, calls: graph_time_us(run, calls=calls))
        self.verbose = verbose

    def time(self, run: Callable[[int], object], calls: int) -> float:
        return self.timer(run, calls)

    def fastest(self, trials: Iterable[Trial], calls: int, label: str = "",
                against: str = "") -> Optional[tuple[Trial, float]]:
        """(the fastest trial, its us), the first one on a tie; None without trials. against: printed
        after each time (verbose), e.g. the baseline's."""
        best = None
        for trial in trials:
            us = self.time(trial.run, calls)
            if self.verbose:
                print(f"  {label} {trial.label}: {us:.1f} us{against}")
            if best is None or us < best[1]:
                best = (trial, us)
        return best


class Family:
    """A kernel family's start-up tuning, run by `tune`. A subclass says:

        table                 the PickTable its dispatch reads (others it fills: `tables`)
        shape(item)           the table key of an item past the bucket, e.g. (N, K)
        wants(item, m, dev)   whether it tunes this item at bucket m at all (default: yes)
        launches(item, m, dev)  one fn per candidate making exactly the launch its timing will make
                              (for compile_ahead.precompile)
        operands(item, dev)   the item's L2-busting copies (made once, for all its buckets)
        tune_bucket(item, m, operands, dev, stopwatch)   time the candidates, record the winner
    """

    table: PickTable

    @property
    def tables(self) -> tuple[PickTable, ...]:
        return (self.table,)

    def shape(self, item) -> tuple:
        raise NotImplementedError

    def wants(self, item, m: int, device) -> bool:
        return True

    def launches(self, item, m: int, device) -> Iterable[Callable[[], object]]:
        raise NotImplementedError

    def operands(self, item, device):
        raise NotImplementedError

    def tune_bucket(self, item, m: int, operands, device, stopwatch: Stopwatch) -> None:
        raise NotImplementedError


def tune(family: Family, items, device, m_values, *, parallel_compile: bool = True, verbose: bool = False,
         stopwatch: Optional[Stopwatch] = None) -> dict:
    """The recipe (module docstring) for `family` over `items` at the buckets of m_values. Returns
    {(bucket, *shape): pick} for every item and bucket with a pick afterwards (tuned now or before).
    Off the GPU nothing is timed (returns {}) unless a stopwatch is given."""
    device = torch.device(device)
    if device.type != "cuda" and stopwatch is None:
        return {}
    stopwatch = stopwatch or Stopwatch(verbose=verbose)
    buckets = list(dict.fromkeys(m_bucket(m) for m in m_values))
    unique = {}
    for item in items:  # one item per table key: the last of each shape, in first-seen order
        unique[family.shape(item)] = item
    work = []
    for shape, item in unique.items():
        todo = [m for m in buckets if family.wants(item, m, device) and not family.table.has(device, m, shape)]
        if todo:
            work.append((item, todo))
    if work:  # every compile below in one batch across the threads
        precompile((fn for item, todo in work for m in todo for fn in family.launches(item, m, device)),
                   parallel_compile)
    for item, todo in work:
        operands = family.operands(item, device)
        for m in todo:
            family.tune_bucket(item, m, operands, device, stopwatch)
        del operands
    return {(m, *shape): family.table.get(device, m, shape)
            for shape in unique for m in buckets if family.table.has(device, m, shape)}
