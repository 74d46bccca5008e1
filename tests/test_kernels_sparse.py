"""InfLLM-v2 selection and block-sparse attention kernels (salaserve/kernels/sparse.py).

CPU: the Triton kernels run under the interpreter (TRITON_INTERPRET=1, tiny config, fp32) in
subprocesses (one per part of the cases) started once per session, since the interpreter must be
chosen before triton is imported and other test files import triton normally. The cases live in
_sparse_kernel_cases.py.

Exactness of the selection. The kernel and the reference compute the same fp32 expression in a
different order (tl.dot vs einsum, exp2 of a base-2 lse vs exp of logsumexp, tree vs sequential
head sum), then round to bf16. Almost always both round to the same bf16 value; when the fp32
value sits within a few fp32 ulps of a bf16 rounding midpoint they can land one bf16 step apart,
and if that block is at the top-k boundary the selected set changes. Measured under the
interpreter (fp32, 48 random batches like these, 14,448 (group, token) rows): 4 of 143,904 causal
block scores one bf16 step off, no row with a different selection. So the tests require
  - every block score within 1 bf16 step of the reference's and >= 99% bit-equal;
  - the selection rule (pooling, forced/future, top-k, lower-index tie-break) exact: applied to
    the kernel's own block scores, the reference rule gives the kernel's selection in every row;
  - every row whose selection differs from the reference has a block score that differs (only
    rounding may explain a difference), and at most 1% of rows differ.
Where rounding cannot differ (all scores tied, dense sequences) the selection must be equal.

GPU (`-m gpu`): the same checks at real shapes in bf16 against the fp32 reference, with the
tolerances written in each test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@pytest.fixture(scope="session")
def interp():
    """Run the parts of _sparse_kernel_cases.py under the interpreter, in parallel."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    procs = {part: subprocess.Popen([sys.executable, os.path.join(HERE, "_sparse_kernel_cases.py"), part],
                                    cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for part in ("select", "attention", "topk", "topk_blocks", "prompt")}
    results = {}
    for part, p in procs.items():
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, f"interpreter part {part!r} failed:\n{err[-4000:]}"
        results.update(json.loads(out.strip().splitlines()[-1]))
    return results


SELECT_CASES = ["select_long_interior", "select_long_interior_t8_bb8",
                "select_oneshot_struct", "select_oneshot_noise", "select_chunked_struct", "select_chunked_noise",
                "select_mixed", "select_small_topk", "select_splits"]


def _assert_selection(r: dict, name: str) -> None:
    msg = f"{name}: {r}"
    assert r["rule_mismatch"] == 0, msg  # pooling / forcing / top-k / ties exact on the kernel's scores
    assert r["rows_unexplained"] == 0, msg  # a different selection needs a different (rounded) score
    assert r["score_max_ulp"] <= 1, msg
    assert r["score_exact"] >= 0.99 * r["scores"], msg
    assert r["rows_differ"] <= 0.01 * r["rows"], msg
    assert r["blocks_common"] >= 0.99 * r["blocks"], msg


@pytest.mark.parametrize("name", SELECT_CASES)
def test_prefill_selection_matches_reference(interp, name):
    r = interp[name]
    _assert_selection(r, name)
    assert r["sorted_ok"] and r["dense_rows_ok"], r
    assert r["rows"] > 0


def test_decode_selection_of_long_sequences_matches_reference(interp):
    r = interp["decode_long"]
    _assert_selection(r, "decode_long")
    assert r["layout_ok"] and r["dense_rows_ok"], r


@pytest.mark.parametrize("name", ["prompt_oneshot", "prompt_chunked"])
def test_prefill_selection_follows_the_prompt_rule(interp, name):
    """Stage 1 with each sequence's prompt length (D1): prompts at the C2 residue (15 mod 16 in the
    tiny config) in one shot and in chunks, one crossing the prompt's end (a recompute). The kernel
    equals the reference's prompt rule; the natural rule would give other block scores and other
    selections in these rows, so the lag is exercised."""
    r = interp[name]
    _assert_selection(r, name)
    assert r["rows_differ"] == 0 and r["score_exact"] == r["scores"], r
    assert r["natural_scores_differ"] > 0 and r["natural_differ"] > 0, r


def test_decode_selection_follows_the_prompt_rule(interp):
    """One-token rows that are a prompt's last token (a one-token prefill chunk, possibly in a
    CUDA-graph decode step) see the prompt rule; decode rows past the prompt see every entry."""
    r = interp["prompt_decode"]
    _assert_selection(r, "prompt_decode")
    assert r["layout_ok"] and r["rows_differ"] == 0 and r["natural_scores_differ"] >= 18, r


def test_stage1_overflow_stays_inf(interp):
    """D4: a C1 entry whose exp(s*q.C1 - lse) overflows fp32 scores +inf in the kernel, as in the
    reference (the official wrapper keeps +inf), so its block is chosen in every row where it is
    not forced anyway."""
    r = interp["prompt_overflow"]
    _assert_selection(r, "prompt_overflow")
    assert r["inf_rows"] == r["eligible"] > 0 and r["chosen_rows"] == r["free_rows"] > 0, r


def test_prefill_selection_width_grows_for_dense_sequences(interp):
    assert interp["select_small_topk"]["width"] == 5  # topk 3 + 2 local blocks
    assert interp["select_chunked_struct"]["width"] == 8  # every sequence sparse: topk_eff
    assert interp["select_mixed"]["width"] == 8  # dense sequence of 90 tokens: 6 blocks <= 8


def test_selection_ties_go_to_lower_blocks(interp):
    """q = 0: every stage-1 score ties, so the choice is the tie rule alone and must be exact."""
    r = interp["select_all_ties"]
    assert r["rows_differ"] == 0 and r["rule_mismatch"] == 0 and r["sorted_ok"], r
    d = interp["decode_all_ties"]
    assert d["rows_differ"] == 0 and d["rule_mismatch"] == 0 and d["layout_ok"] and d["dense_rows_ok"], d


def test_decode_selection_matches_reference(interp):
    r = interp["decode"]
    _assert_selection(r, "decode")
    assert r["layout_ok"] and r["dense_rows_ok"], r


def test_decode_selection_does_not_depend_on_table_width_or_batch(interp):
    """The same pages and bit-equal keys with a CUDA graph's wide static table and a padded
    batch as with the tight eager table (the lse partials in fixed ranges)."""
    r = interp["decode_width_invariant"]
    assert r["wide"] and r["wide_padded_batch"] and r["splits"] >= 3, r


@pytest.mark.parametrize("name", ["attention", "attention_shuffled", "attention_window4", "attention_window8_shuffled",
                                  "attention_window8"])
def test_sparse_prefill_attention_matches_twin(interp, name):
    r = interp[name]
    assert r["dtype_ok"] and r["max_abs"] < 1e-5 and r["rel"] < 1e-5, r


@pytest.mark.parametrize("name", ["full_chunked", "full_mixed", "full_oneshot", "full_mixed_window", "prompt_full"])
def test_sparse_attention_matches_torch_backend(interp, name):
    r = interp[name]
    assert r["dtype_ok"], r
    assert r["rows_differ"] <= 0.01 * r["rows"], r  # rows whose selection moved by a rounding flip
    assert r["max_abs"] < 1e-5 and r["rel"] < 1e-5, r


@pytest.mark.parametrize("case", ["topk_pages_0", "topk_pages_1", "topk_pages_2", "topk_pages_ties",
                                  "topk_pages_segmented_0", "topk_pages_segmented_1", "topk_pages_segmented_ties"])
def test_fused_topk_pages_equals_torch_path(interp, case):
    """The fused decode top-k kernel picks the same pages as the torch path: forced and -inf blocks,
    ties, dense rows and rows shorter than top-k; also through the segment + merge kernels that
    wide rows (256K-512K contexts) take. The *_ties cases draw scores from 3 values, so the
    threshold search's tie step decides most rows."""
    r = interp[case]
    assert r["equal"], r
    assert any(c != [8, 8] for c in r["counts"])  # short and dense rows were in the case


@pytest.mark.parametrize("case", [  # _sparse_kernel_cases.TOPK_BLOCKS_*
    "stage1", "stage1_rows_ties", "stage1_narrow_init3", "random_rows", "random_limit3_ties", "random_limit1",
    "segmented_stage1_rows", "segmented_random_ties"])
def test_fused_topk_blocks_equals_torch_path(interp, case):
    """The fused prefill top-k (topk_blocks) gives _topk_blocks' block indices bit for bit: int and
    per-row limits (dense rows mixed in), ties, nb < width and > width, rows with few causal
    blocks, forced future init blocks; on stage-1 keys and on arbitrary keys, where a non-causal
    key can outrank causal ones and the row lists fewer blocks (as the torch function does);
    one pass and segmented (wide rows)."""
    r = interp[f"blocks_{case}"]
    assert r["equal"], r
    if "random" in case:
        assert r["short"] > 0, r  # rows that lost blocks to non-causal keys were in the case
    else:
        assert r["short"] == 0, r  # stage-1 keys: every row gets min(limit, causal blocks)


@pytest.mark.parametrize("case", ["fused_sparse_chunks", "fused_mixed", "fused_dense_narrow"])
def test_prefill_selection_fused_topk_equals_torch(interp, case):
    """select_blocks_prefill with the fused top-k and with the torch function in its place: the same
    output (every sequence sparse over several chunks; a dense one mixed in; all dense with nb <
    width)."""
    r = interp[case]
    assert r["equal"] and r["fused"] >= 1 and r["torch"] == r["fused"] and r["width"] == 8, r
    if case == "fused_sparse_chunks":
        assert r["fused"] >= 2, r  # topk_blocks wrote into slices of the output


def test_unpack_keys_inverts_packing():
    """The key layout (high half: monotone bf16 bits, low half: 65535 - block) in plain torch."""
    from salaserve.kernels.sparse import pack_keys, unpack_keys

    scores = torch.tensor([0.0, 1.5, 3e-3, float("inf"), float("-inf"), 2.0**-130, 1.0])
    blocks = torch.tensor([0, 1, 2, 3, 4, 5, 65535])
    bits = scores.to(torch.bfloat16).view(torch.int16).int()
    key = torch.where(bits < 0, bits ^ 0x7FFF, bits) * 65536 + (65535 - blocks)
    # the torch twin (block = index there: the first six, whose blocks are 0..5)
    assert torch.equal(pack_keys(scores)[:6], key[:6].int())
    s, b = unpack_keys(key.int())
    assert torch.equal(b, blocks.int()) and torch.equal(s, scores.to(torch.bfloat16).float())
    order = key.argsort(descending=True)  # inf, 2.0 ... ; ties (none here) would prefer low blocks
    assert s[order].tolist() == sorted(s.tolist(), reverse=True)


# ---------------------------------------------------------------------------------------------
# GPU: real shapes, bf16, against the fp32 reference
# ---------------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _real_case(seqs, seed):
    import _sparse_kernel_cases as C

    from salaserve.config import preset_config

    return C, C.make_case(preset_config("full"), seqs, seed=seed, dtype=torch.bfloat16, device="cuda")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("seqs", [
    [(65535, 1)],  # B=1 at 64K
    [(9000, 1), (16383, 1), (20000, 1), (33000, 1), (40959, 1), (50000, 1), (65000, 1), (5000, 1)],  # B=8, one dense
])
def test_gpu_decode_selection(seqs):
    C, case = _real_case(seqs, seed=21)
    r = C.check_decode_selection(case, max_sel=128)
    assert r["layout_ok"] and r["dense_rows_ok"], r
    assert r["rule_mismatch"] == 0 and r["rows_unexplained"] == 0, r
    assert r["score_exact"] >= 0.99 * r["scores"], r  # bf16 inputs, fp32 accumulation in both
    assert r["blocks_common"] >= 0.99 * r["blocks"], r  # selection overlap >= 99% of blocks


@pytest.mark.gpu
@gpu
def test_gpu_prefill_selection_chunk_2048_at_16k():
    C, case = _real_case([(16384, 2048)], seed=22)
    r = C.check_prefill_selection(case)
    assert r["sorted_ok"] and r["rule_mismatch"] == 0 and r["rows_unexplained"] == 0, r
    assert r["score_exact"] >= 0.99 * r["scores"], r
    assert r["blocks_common"] >= 0.99 * r["blocks"], r


@pytest.mark.gpu
@gpu
def test_gpu_selection_follows_the_prompt_rule():
    """D1 at the real geometry: the last chunk of a 9023-token prompt (= 63 mod 64: stage 1 hides
    the newest C2 entry from its tokens) and, as a one-token step, its last token."""
    C, case = _real_case([(8192, 831, 9023)], seed=25)
    r = C.check_prefill_selection(case)
    assert r["sorted_ok"] and r["rule_mismatch"] == 0 and r["rows_unexplained"] == 0, r
    assert r["score_exact"] >= 0.99 * r["scores"] and r["blocks_common"] >= 0.99 * r["blocks"], r
    assert r["natural_scores_differ"] > 0, r
    C, case = _real_case([(9022, 1, 9023), (9100, 1, 9023)], seed=26)
    d = C.check_decode_selection(case, max_sel=128)
    assert d["layout_ok"] and d["rule_mismatch"] == 0 and d["rows_unexplained"] == 0, d
    assert d["score_exact"] >= 0.99 * d["scores"] and d["natural_scores_differ"] == 2, d  # the prompt row only


@pytest.mark.gpu
@gpu
def test_gpu_sparse_attention_chunk_2048_at_16k():
    C, case = _real_case([(16384, 2048), (9000, 300)], seed=23)
    r = C.check_attention(case)  # kernel vs torch twin on the same selection
    assert r["dtype_ok"] and r["rel"] < 1e-2, r
    f = C.check_full(case)  # selection + attention vs TorchBackend.sparse_attention (fp32 math)
    assert f["dtype_ok"] and f["rel_all"] < 1e-2 and f["rows_differ"] <= 0.05 * f["rows"], f


@pytest.mark.gpu
@gpu
def test_gpu_decode_selection_replays_in_cuda_graph():
    """select_blocks_decode captured once, replayed on new queries / lengths (same shapes), equals
    the eager call: no host sync, no data-dependent shape."""
    from salaserve.config import preset_config
    from salaserve.kernels.sparse import select_blocks_decode

    C, case = _real_case([(20000, 1), (33000, 1), (5000, 1), (8191, 1)], seed=24)
    sc = preset_config("full").sparse
    q, comp, batch = case["q"].clone(), case["comp"], case["batch"]
    seq_lens = batch.seq_lens.clone()
    args = (comp, C.LAYER, batch.page_table, seq_lens, sc, 128 ** -0.5, 128)
    select_blocks_decode(q, *args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        table, count = select_blocks_decode(q, *args)
    for step in range(3):
        q.copy_(torch.randn_like(q))
        seq_lens.copy_(batch.seq_lens - step)  # still within each sequence's pages
        graph.replay()
        want_table, want_count = select_blocks_decode(q, *args)
        assert torch.equal(count, want_count) and torch.equal(table, want_table)


@pytest.mark.parametrize("kernel,width,warps", [("one_pass", 512, 4), ("one_pass", 4096, 8), ("segment", 2048, 8),
                                                ("merge", 8 * 128, 4)])
def test_topk_pages_kernels_compile_for_sm90_without_spills(kernel, width, warps):
    """The fused top-k kernels hold a row (or segment, or the candidates) in registers: compiled
    ahead of time for sm_90 at the widths topk_pages gives them, with its warp counts (no GPU)."""
    from kernel_checks import compile_sm90_without_spills

    from salaserve.kernels import sparse as S

    i32 = "*i32"
    if kernel == "one_pass":
        fn, ptrs, consts = S._topk_pages_kernel, dict(keys_ptr=i32, page_table_ptr=i32, seq_lens_ptr=i32,
                                                       out_ptr=i32, count_ptr=i32), dict(BS=64, W=width, MAX_SEL=128)
    elif kernel == "segment":
        fn, ptrs, consts = S._topk_segment_kernel, dict(keys_ptr=i32, seq_lens_ptr=i32, cand_key_ptr=i32,
                                                         cand_blk_ptr=i32), dict(BS=64, SEG=width, MAX_SEL=128)
        assert width == S.TOPK_SEGMENT
    else:
        fn, ptrs, consts = S._topk_merge_kernel, dict(cand_key_ptr=i32, cand_blk_ptr=i32, page_table_ptr=i32,
                                                       seq_lens_ptr=i32, out_ptr=i32, count_ptr=i32), \
            dict(BS=64, N_CAND=width, MAX_SEL=128)
    compile_sm90_without_spills(fn, ptrs, consts, warps, fp_fusion=True)


@pytest.mark.parametrize("kernel,width,warps,per_row", [
    ("one_pass", 2048, 4, False), ("one_pass", 2048, 4, True), ("one_pass", 4096, 8, True),
    ("segment", 2048, 8, True), ("merge", 32 * 128, 8, True), ("merge", 4 * 128, 4, False)])
def test_topk_blocks_kernels_compile_for_sm90_without_spills(kernel, width, warps, per_row):
    """The fused prefill top-k kernels (topk_blocks) at the widths and warp counts it gives them
    for width 96 (128 output slots): one pass up to 4096 blocks, 2048-block segments, merges of 4
    (512K) to 32 (4M tokens) segments; int (every row sparse) and per-row limits; no spills."""
    from kernel_checks import compile_sm90_without_spills

    from salaserve.kernels import sparse as S

    i32, i64 = "*i32", "*i64"
    common = dict(LIMIT_PER_ROW=per_row)
    if kernel == "one_pass":
        fn, ptrs, consts = S._topk_blocks_kernel, dict(keys_ptr=i32, qb_ptr=i64, limit_ptr=i64, out_ptr=i32), \
            dict(W=width, OUT_W=128)
        assert width <= S.TOPK_ONE_PASS_BLOCKS
    elif kernel == "segment":
        fn, ptrs, consts = S._topk_blocks_segment_kernel, dict(keys_ptr=i32, limit_ptr=i64, cand_key_ptr=i32,
                                                                cand_blk_ptr=i32), dict(SEG=width, MAX_SEL=128)
        assert width == S.TOPK_SEGMENT
    else:
        fn, ptrs, consts = S._topk_blocks_merge_kernel, dict(cand_key_ptr=i32, cand_blk_ptr=i32, qb_ptr=i64,
                                                              limit_ptr=i64, out_ptr=i32), \
            dict(N_CAND=width, OUT_W=128)
        assert width <= S._TOPK_MAX_CANDIDATES
    compile_sm90_without_spills(fn, ptrs, dict(consts, **common), warps, fp_fusion=True)


@pytest.mark.parametrize("block_t,bb,warps,maxnreg,stages", [(4, 32, 8, None, 3), (8, 16, 8, 128, 2),
                                                              (1, 16, 4, None, 3)])
def test_stage1_kernels_compile_for_sm90_without_spills(block_t, bb, warps, maxnreg, stages):
    """The stage-1 kernels at the real shapes (16 query heads per KV group, head dim 128, C1 4 per
    64-token block), as prefill (8 tokens, 16 blocks per step, capped at 128 registers:
    sparse.STAGE1_PREFILL_TILE / STAGE1_PREFILL_LAUNCH, two stages; and 4 tokens, 32 blocks) and
    decode (1 token, 16) launch them: both dots on tensor cores, nothing spilled, the C1 loads
    prefetched."""
    from kernel_checks import compile_sm90_without_spills

    from salaserve.kernels import sparse as S

    i32 = "*i32"
    ptrs = dict(q_ptr="*bf16", c1_ptr="*bf16", c2_ptr="*bf16", page_table_ptr=i32, seq_lens_ptr=i32,
                positions_ptr="*i64", prompt_lens_ptr=i32, tile_seq_ptr=i32, tile_tok0_ptr=i32, tile_ntok_ptr=i32, m_part_ptr="*fp32",
                l_part_ptr="*fp32", keys_ptr=i32)
    keys = compile_sm90_without_spills(
        S._stage1_block_keys_kernel, ptrs, dict(GROUP=16, GP=16, D=128, BLOCK_T=block_t, BB=bb, C1PB=4, PAD=1, K1=32,
                                                S1=16, BS=64, INIT=1, LOCAL=2, DOT_PREC=None), warps,
        fp_fusion=True, maxnreg=maxnreg, floats=("qk_scale2",), num_stages=stages)
    assert "wgmma" in keys.asm["ptx"] or "mma.sync" in keys.asm["ptx"]
    # the C1 loads are outside the interior/masked branch, so they are prefetched
    assert "async_copy_global_to_local" in keys.asm["ttgir"]
    lse = compile_sm90_without_spills(
        S._stage1_lse_kernel, ptrs, dict(GROUP=16, GP=16, D=128, BLOCK_T=block_t, BLOCK_N=64, K2=128, S2=64,
                                         C2PP=1, DOT_PREC=None), 4, fp_fusion=True)
    assert "wgmma" in lse.asm["ptx"] or "mma.sync" in lse.asm["ptx"]


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("window_tokens", [4, 8])
def test_sparse_window_kernels_compile_for_sm90_without_spills(fp8, window_tokens):
    """The window kernel (forced blocks per tile of tokens) and the per-token kernel that continues
    from its softmax state, at the real shapes: dots on tensor cores, nothing spilled."""
    from kernel_checks import compile_sm90_without_spills

    import triton.language as tl

    from salaserve.kernels import sparse as S

    pool = "*fp8e4nv" if fp8 else "*bf16"
    common = dict(GROUP=16, GP=16, D=128, BS=64, DOT_PREC=None, KV_FP8=fp8, COMPUTE_DT=tl.bfloat16, HKV=2)
    win = compile_sm90_without_spills(
        S._sparse_window_attn_kernel,
        dict(q_ptr="*bf16", k_ptr=pool, v_ptr=pool, m_part_ptr="*fp32", l_part_ptr="*fp32", acc_part_ptr="*fp32",
             page_table_ptr="*i32", positions_ptr="*i64", tile_seq_ptr="*i32", tile_tok0_ptr="*i32",
             tile_ntok_ptr="*i32", k_scale_ptr="*fp32", v_scale_ptr="*fp32"),
        dict(common, BLOCK_T=window_tokens, INIT=1, LOCAL=32), 4 if window_tokens * 16 <= 64 else 8, fp_fusion=True)
    assert "mma" in win.asm["ptx"]
    # the per-token kernel as launched (pages from a list; warps by the pages' dtype, _PER_TOKEN_WARPS),
    # after the window kernel and on its own
    for after_window in (True, False):
        per_token = compile_sm90_without_spills(
            S._sparse_prefill_attn_kernel,
            dict(q_ptr="*bf16", k_ptr=pool, v_ptr=pool, o_ptr="*bf16", block_idx_ptr="*i32", page_idx_ptr="*i32",
                 positions_ptr="*i64", k_scale_ptr="*fp32", v_scale_ptr="*fp32",
                 m_part_ptr="*fp32", l_part_ptr="*fp32", acc_part_ptr="*fp32"),
            dict(common, W=128, AFTER_WINDOW=after_window, INIT=1, LOCAL=32), S._PER_TOKEN_WARPS[fp8], fp_fusion=True)
        assert "mma" in per_token.asm["ptx"]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("window_tokens", [4, 8])
def test_gpu_sparse_attention_window_kernel(window_tokens):
    """The window kernel + the per-token kernel over the scored blocks (the default route)
    against the torch twin at the real shapes, bf16, on the kernel's own selection (in order and
    shuffled); the per-token kernel's bound."""
    C, case = _real_case([(16384, 2048), (9000, 300)], seed=23)
    for shuffle in (False, True):
        r = C.check_attention(case, shuffle=shuffle, window_tokens=window_tokens)
        assert r["dtype_ok"] and r["rel"] < 1e-2, r


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("levels", [0, 5])
@pytest.mark.parametrize("nb", [272, 2064, 4112, 8192, 8224])
def test_gpu_fused_topk_pages(nb, levels):
    """The fused decode top-k kernel at the real config and the graph widths it serves, against
    the torch path; levels 5: scores from 5 values (ties at the threshold in every row)."""
    import _sparse_kernel_cases as C

    from salaserve.config import preset_config

    sc = preset_config("full").sparse  # block 64, dense_len 8192, topk_eff 96
    lens = [nb * 64, 8192, 8191, 5000, (nb // 2) * 64 + 7, 9000]
    r = C.check_topk_pages(nb, sc=sc, nb=nb, max_sel=128, seq_lens=lens, device="cuda", levels=levels)
    assert r["equal"], r


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("levels", [0, 5])
@pytest.mark.parametrize("nb", [2048, 4096, 8224])
def test_gpu_fused_topk_blocks(nb, levels):
    """The fused prefill top-k (topk_blocks) against _topk_blocks at
    a 128K and a 256K prompt's widths (one pass) and past 512K (segments + merge), 8192 rows of a
    selection chunk: every row sparse (width 96), dense rows mixed in (width 128, sparse rows 96),
    and arbitrary keys (non-causal ones outranking causal ones); levels 5: scores from 5 values
    (ties at the threshold in every row)."""
    import _sparse_kernel_cases as C

    common = dict(rows=8192, nb=nb, levels=levels, device="cuda")
    for kw in (dict(width=96), dict(width=128, limit="rows", sparse_limit=96),
               dict(width=128, limit="rows", sparse_limit=96, keys="random")):
        r = C.check_topk_blocks(nb, **common, **kw)
        assert r["equal"], (kw, r)
        assert (r["short"] > 0) == (kw.get("keys") == "random"), (kw, r)


@pytest.mark.parametrize("preset, max_blocks", [("tiny", 40), ("full", 8192), ("full", 131072 // 64 + 1),
                                                ("full", 1048576 // 64)])
def test_prefill_topk_warm_up_covers_every_kernel_class_a_prompt_can_meet(preset, max_blocks):
    """Every (nb, width, limit form) select_blocks_prefill can pass topk_blocks for sequences up to
    max_blocks blocks runs a plan (compiled kernel) that warm_up_prefill_topk builds at start-up."""
    from salaserve.config import preset_config
    from salaserve.kernels.sparse.topk import prefill_topk_classes, topk_blocks_plan

    sc = preset_config(preset).sparse
    warmed = {topk_blocks_plan(nb, w, min(w, nb), per_row) for nb, w, per_row in prefill_topk_classes(sc, max_blocks)}
    dense_blocks = -(-sc.dense_len // sc.block_size)
    widths = range(sc.topk_eff, max(sc.topk_eff, dense_blocks) + 1)  # prefill_width's range
    nbs = sorted({*range(dense_blocks, min(max_blocks, 5000) + 1), *range(dense_blocks, max_blocks + 1, 97), max_blocks})
    for nb in nbs:  # the step's widest sequence: a sparse one, at least dense_len long
        needed = {topk_blocks_plan(nb, sc.topk_eff, min(sc.topk_eff, nb), False)}  # every sequence sparse
        needed |= {topk_blocks_plan(nb, w, min(w, nb), True) for w in widths}  # dense ones beside
        missing = needed - warmed - {("torch",)}
        assert not missing, (nb, missing)
