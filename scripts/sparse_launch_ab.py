"""A/B of the launch options of the sparse layers' prefill kernels (GPU only).

    python scripts/sparse_launch_ab.py [--cache 122880] [--chunk 8192] [--reps 10] [--env best.env]

One 8K-token chunk at the end of a 128K prompt (bench_sparse's set-up: real config, random bf16
caches, pages scattered). Times, per variant of (num_warps, num_stages, maxnreg):
  stage-1   the two stage-1 kernels of the selection (sparse.STAGE1_PREFILL_LAUNCH)
  top-k     the selection's top-k on the default's keys: torch ops and the fused kernel
  attention the window kernel + the per-token kernel (SPARSE_WINDOW_LAUNCH, SPARSE_ATTN_LAUNCH,
            SPARSE_ATTN_PAGE_LIST)
with one knob changed at a time from the defaults. Each variant's output is compared with the
default's (keys bit for bit; attention max abs difference). --env writes the fastest variant of
each knob whose output agrees as SALASERVE_* lines for a later process.
Why: the 128K profile (run 52) has these kernels at 1.19 s of 5.02; the sm_90 compiles put the
stage-1 kernel at 172 registers (one 8-warp program per SM) and the per-token kernel at 128 (four
4-warp programs per SM), all waiting on gathered loads.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from salaserve.kernels import bench_sparse as B  # noqa: E402
from salaserve.kernels import sparse as ks  # noqa: E402

# stage-1: ((tokens per tile, blocks per step), launch options); only the rows at the default tile
# (sparse.STAGE1_PREFILL_TILE) can go to --env, which sets launch options only
STAGE1 = [((4, 32), {}), ((4, 32), {"maxnreg": 128}), ((8, 16), {"maxnreg": 128}),
          ((8, 16), {"maxnreg": 128, "num_stages": 2}), ((8, 16), {"maxnreg": 128, "num_stages": 3}),
          ((8, 16), {"maxnreg": 128, "num_stages": 1})]
# attention: (knob, sparse module settings) with one setting changed from the defaults; the attn
# and window launch rows can go to --env
ATTN = [("attn", {"SPARSE_ATTN_LAUNCH": o}) for o in ({}, {"num_warps": 4}, {"num_stages": 4}, {"maxnreg": 80})]
ATTN += [("window", {"SPARSE_WINDOW_LAUNCH": o}) for o in ({}, {"maxnreg": 128}, {"num_stages": 2, "maxnreg": 128})]
ATTN += [("page list", {"SPARSE_ATTN_PAGE_LIST": on}) for on in (False, True)]
ENV = {"stage1": "SALASERVE_STAGE1_LAUNCH", "attn": "SALASERVE_SPARSE_ATTN_LAUNCH",
       "window": "SALASERVE_SPARSE_WINDOW_LAUNCH"}


def _env_value(opts: dict) -> str:
    return f"{opts.get('num_warps', 0)},{opts.get('num_stages', 0)},{opts.get('maxnreg', 0)}"


def main() -> None:
    ap = argparse.ArgumentParser()
    B.last_chunk_args(ap)
    ap.add_argument("--env", default=None)
    a = ap.parse_args()
    cfg, comp, kv, batch, q = B.last_chunk_case(a.cache, a.chunk)
    sc = cfg.sparse
    scale = cfg.head_dim ** -0.5
    nb = -(-batch.seq_lens_host[0] // sc.block_size)
    tiles = {bt: ks.tile_tensors(ks._prefill_tiles(batch, bt), "cuda") for bt in (4, 8)}
    idx = ks.select_blocks_prefill(q, comp, 0, batch, sc, scale)

    def keys(shape, opts):
        bt, bb = shape
        return ks._stage1_keys(q, comp, 0, batch.page_table, batch.seq_lens, batch.positions, tiles[bt], a.chunk,
                               0, nb, scale, bt, bb, launch=opts)

    def attn():
        return ks.sparse_prefill_attention(q, kv, 0, batch, idx, scale, window=(sc.init_blocks, sc.local_blocks),
                                           ascending=True, tile_tokens=0, window_tokens=ks.SPARSE_ATTN_WINDOW)

    rows, best = [], {}
    base_keys = keys((4, 32), {})
    for shape, opts in STAGE1:
        us = B._time_us(lambda: keys(shape, opts), a.reps)
        same = bool(torch.equal(keys(shape, opts), base_keys))
        rows.append((f"stage1 {shape[0]}x{shape[1]}", opts, us, "equal" if same else "KEYS DIFFER"))
        if same and shape == ks.STAGE1_PREFILL_TILE and ("stage1" not in best or us < best["stage1"][1]):
            best["stage1"] = (opts, us)
    # the selection's top-k on those keys: torch ops vs the fused kernel (SALASERVE_FUSED_PREFILL_TOPK)
    width, qb = ks.prefill_width(batch, sc), batch.positions // sc.block_size
    ref = ks._topk_blocks(base_keys, width, sc.topk_eff, qb)
    for name, fn in (("torch", ks._topk_blocks), ("fused", ks.topk_blocks)):
        us = B._time_us(lambda: fn(base_keys, width, sc.topk_eff, qb), a.reps)
        same = bool(torch.equal(fn(base_keys, width, sc.topk_eff, qb), ref))
        rows.append((f"top-k {name}", {}, us, "equal" if same else "BLOCKS DIFFER"))
    base_out = attn().float()
    for knob, settings in ATTN:
        try:
            with ks.knobs(**settings):
                us = B._time_us(attn, a.reps)
                diff = float((attn().float() - base_out).abs().max())
        except Exception as e:  # a launch option this triton rejects: report, keep going
            rows.append((knob, settings, float("nan"), f"failed: {type(e).__name__}: {e}"[:80]))
            continue
        rows.append((knob, settings, us, f"max|diff| {diff:.1e}"))
        ok = diff <= 1e-2  # bf16 output; a different warp count may reorder the fp32 sums
        if ok and knob in ENV and (knob not in best or us < best[knob][1]):
            best[knob] = (next(iter(settings.values())), us)
    print(f"chunk {a.chunk} at {(a.cache + a.chunk) // 1024}K")
    print(f"{'kernels':14s} {'options':50s} {'us':>9s}  output vs default")
    for knob, opts, us, note in rows:
        print(f"{knob:14s} {str(opts or 'default'):50s} {us:9.1f}  {note}")
    lines = [f"export {ENV[k]}={_env_value(o)}" for k, (o, _) in best.items()]
    print("best:", "; ".join(lines))
    if a.env:
        Path(a.env).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
