"""PNG plots (matplotlib, Agg backend: no display needed).

- `plot_latencies`: per tier, the TTFT, ITL and E2E distributions of a `bench run` result, with
  the p50/p90/p99 marks of its summary.
- `plot_micro`: from `python -m benchmarks.micro --json` output, decode step time against
  batch and against context, prefill time against length, each beside its floor.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the backend
from matplotlib.ticker import FuncFormatter, MaxNLocator, NullFormatter  # noqa: E402

# 4096 -> "4K", 8 -> "8", 0.5 -> "0.5": powers of two read better than 2^12
_TOKENS = FuncFormatter(lambda v, _: f"{v / 1024:g}K" if v >= 1024 else f"{v:g}")

_PCT_STYLE = {"p50": ":", "p90": "--", "p99": "-."}


def _hist(ax, values_ms: list[float], summary: dict | None, title: str) -> None:
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.xaxis.set_major_locator(MaxNLocator(5))
    if values_ms:
        ax.hist(values_ms, bins=min(60, max(5, len(values_ms) // 4)), color="tab:blue", alpha=0.75)
    elif summary is None:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    for k, style in _PCT_STYLE.items():
        if summary and summary.get(k) is not None:
            ax.axvline(summary[k], color="black", linestyle=style, linewidth=1, label=f"{k} {summary[k]:.1f}")
    if summary:
        ax.legend(fontsize=7)


def plot_latencies(result: dict, out_dir: str | Path) -> dict[str, Path]:
    """`latency_<tier>.png` for each tier; E2E per request is absent for the official client,
    whose printed percentiles are then the only marks."""
    out = Path(out_dir)
    paths = {}
    for tier, r in result.get("tiers", {}).items():
        recs = [x for x in r.get("per_request", []) if x["success"]]
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
        _hist(axes[0], [x["ttft_s"] * 1e3 for x in recs], r.get("ttft_ms"), "TTFT")
        _hist(axes[1], [v * 1e3 for x in recs for v in x["itl_s"]], r.get("itl_ms"), "ITL")
        _hist(axes[2], [x["e2e_s"] * 1e3 for x in recs if x.get("e2e_s") is not None], r.get("e2e_ms"),
              "E2E latency")
        axes[0].set_ylabel("count")
        fig.suptitle(f"{tier}: concurrency {r.get('max_concurrency') or 'unlimited'}, "
                     f"{r.get('successes')}/{r.get('requests')} ok, {r.get('duration_s', 0):.2f} s")
        fig.tight_layout()
        paths[tier] = out / f"latency_{tier}.png"
        fig.savefig(paths[tier], dpi=110)
        plt.close(fig)
    return paths


def _series(ax, xs, ys, floors, label, color) -> None:
    ax.plot(xs, ys, "o-", color=color, label=label)
    ax.plot(xs, floors, "--", color=color, alpha=0.6, label=f"{label} floor")


def plot_micro(micro: dict, out_dir: str | Path) -> dict[str, Path]:
    """decode_vs_batch.png, decode_vs_context.png and prefill.png (those with data)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    title = (f"{micro.get('gpu', '?')}, backend {micro.get('backend', '?')}; floors from copy "
             f"{micro.get('copy_gbps', 0):.0f} GB/s, matmul {micro.get('matmul_tflops', 0):.0f} TFLOP/s")
    decode = micro.get("decode", [])
    paths = {}
    for name, group_key, x_key in (("decode_vs_batch", "context", "batch"),
                                   ("decode_vs_context", "batch", "context")):
        if not decode:
            break
        fig, ax = plt.subplots(figsize=(7.5, 4.8))
        for i, g in enumerate(sorted({d[group_key] for d in decode})):
            rows = sorted((d for d in decode if d[group_key] == g), key=lambda d: d[x_key])
            _series(ax, [d[x_key] for d in rows], [d["device_ms"] for d in rows], [d["floor_ms"] for d in rows],
                    f"{group_key} {g}", colors[i % len(colors)])
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(_TOKENS)
        ax.set_xlabel(x_key)
        ax.set_ylabel("decode step, device ms")
        ax.set_title(title, fontsize=8)
        ax.legend(fontsize=7, ncol=2)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        paths[name] = out / f"{name}.png"
        fig.savefig(paths[name], dpi=110)
        plt.close(fig)
    prefill = sorted(micro.get("prefill", []), key=lambda p: p["tokens"])
    if prefill:
        fig, ax = plt.subplots(figsize=(7.5, 4.8))
        _series(ax, [p["tokens"] for p in prefill], [p["seconds"] for p in prefill],
                [p["floor_s"] for p in prefill], "prefill", colors[0])
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(_TOKENS)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("seconds")
        ax.set_title(title, fontsize=8)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        paths["prefill"] = out / "prefill.png"
        fig.savefig(paths["prefill"], dpi=110)
        plt.close(fig)
    return paths
