"""Tensor parallelism on the CPU (gloo): the sharding rules, the sharded model against the whole
one, and --tp-size 2 engines (real processes) against --tp-size 1, token for token.

Tolerances: sharding changes only the order of fp32 sums (the row-parallel linears' partial
products, the Lightning o_norm's mean square), so TP=2 logits stay within LOGIT_ATOL of TP=1's
(observed ~4e-6 on logits of magnitude ~13 for the default model). A wrong split (heads, slopes,
groups) moves them by far more; test_rebuilt_slopes_would_be_caught shows it.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch
from engine_utils import run_requests

from salaserve.cache.compressed import CompressedKeyPool
from salaserve.cache.pages import KVPool
from salaserve.cache.state import StatePool
from salaserve.config import ModelConfig, alibi_slopes
from salaserve.core.batch import ForwardBatch, SeqWork
from salaserve.kernels.torch_ops import TorchBackend
from salaserve.model.default import default_model_dir
from salaserve.model.loader import load_state_dict
from salaserve.model.sala import Caches, SalaModel, fuse_state_dict
from salaserve.parallel.ops import TensorParallelOps
from salaserve.parallel.shard import (TPConfigError, check_tp, column_shard, kv_replicas, row_shard,
                                      shard_state_dict)
from salaserve.quant.formats import QuantizedLinearWeights, QuantScheme, get, reorder_act_order

LOGIT_ATOL = 1e-4  # fp32 logits, TP=2 vs TP=1 (module docstring)
# one row-parallel linear: fp32 dot products of K = 256 terms summed in another order; outputs
# reach ~20 here (randn x randn over 256 terms), so the bound is relative: ~80 ulp, plus 1e-5
SUM_RTOL, SUM_ATOL = 1e-5, 1e-5


@pytest.fixture(scope="module")
def default_cfg():
    return ModelConfig.from_pretrained(default_model_dir())


# ---- one linear --------------------------------------------------------------------------------
def _weights(fmt: str, n: int = 64, k: int = 256):
    torch.manual_seed(0)
    w = torch.randn(n, k)
    if fmt == "plain":
        return w
    return get(fmt).quantize(w, QuantScheme(fmt, group_size=64))


def _dense(w):
    return w if isinstance(w, torch.Tensor) else w.dequantize(torch.float32)


@pytest.mark.parametrize("fmt", ["plain", "bf16", "fp8", "w4a16"])
@pytest.mark.parametrize("size", [2, 4])
def test_column_and_row_shards_are_the_whole_weight(fmt, size):
    """Column shards are the weight's rows and row shards its columns, exactly (fp8 scales travel
    with their rows, int4 groups with their columns); the row-parallel partial outputs add up to
    the whole linear within SUM_RTOL / SUM_ATOL."""
    w = _weights("plain") if fmt == "plain" else (
        QuantizedLinearWeights.from_dense(_weights("plain")) if fmt == "bf16" else _weights(fmt))
    full = _dense(w)
    cols = [column_shard(w, r, size) for r in range(size)]
    assert torch.equal(torch.cat([_dense(c) for c in cols]), full)
    rows = [row_shard(w, r, size) for r in range(size)]
    assert torch.equal(torch.cat([_dense(r) for r in rows], dim=1), full)
    x = torch.randn(5, full.shape[1])
    k = full.shape[1] // size
    partial = sum(x[:, r * k:(r + 1) * k] @ _dense(rows[r]).t() for r in range(size))
    torch.testing.assert_close(partial, x @ full.t(), atol=SUM_ATOL, rtol=SUM_RTOL)


def test_w4a16_column_cut_inside_a_zero_word():
    """Output cuts that are not multiples of 8 repack the int4 zero points."""
    w = _weights("w4a16", n=24)
    part = get("w4a16").slice_out(w, 4, 20)
    assert torch.equal(part.dequantize(), w.dequantize()[4:20])


def test_w4a16_row_shard_must_not_cut_a_group():
    w = _weights("w4a16")  # K = 256 in groups of 64
    with pytest.raises(ValueError, match="multiple of the group size"):
        row_shard(w, 1, 8)  # 32 columns a rank
    act = reorder_act_order(QuantizedLinearWeights(
        "w4a16", w.in_features, w.out_features, qweight=w.qweight, qzeros=w.qzeros, scales=w.scales,
        g_idx=w.g_idx.flip(0).contiguous(), group_size=w.group_size, g_idx_trivial=False))
    with pytest.raises(ValueError, match="act-order"):
        row_shard(act, 0, 2)


def test_state_dict_w4a16_group_error_names_the_linear(tiny_model_dir):
    """The tiny preset's first o_proj has K = 128: 64 columns a rank at tp 2 cut its int4 groups of 128."""
    cfg = ModelConfig.from_pretrained(tiny_model_dir)
    w = load_state_dict(tiny_model_dir, cfg, dtype=torch.float32, quantization="w4a16")
    with pytest.raises(TPConfigError, match=r"model\.layers\.0\.self_attn\.o_proj\.weight.*group size"):
        shard_state_dict(cfg, w, 0, 2)


# ---- the model's splits --------------------------------------------------------------------------
@pytest.mark.parametrize("size,field", [(3, "num_key_value_heads"), (8, "num_attention_heads"),
                                        (0, "positive integer")])
def test_bad_tp_size_is_a_clear_error(default_cfg, size, field):
    with pytest.raises(TPConfigError, match=field):
        check_tp(default_cfg, size)


def test_local_config_and_global_slopes(default_cfg):
    """A rank's heads keep their global decay slopes (spec 4.3), not those of a 2-head model."""
    cfg = default_cfg
    assert cfg.lightning_nh == 4
    slopes = torch.tensor(alibi_slopes(4), dtype=torch.float32)
    for rank in range(2):
        m = SalaModel(cfg, {}, None, torch.float32, "cpu", tp_rank=rank, tp_size=2)
        assert torch.equal(m.log_decay, -slopes[2 * rank: 2 * rank + 2])
        assert (m.cfg.num_attention_heads, m.cfg.num_key_value_heads, m.cfg.lightning_nh,
                m.cfg.intermediate_size) == (2, 1, 2, cfg.intermediate_size // 2)
        assert m.cfg.gqa_group_size == cfg.gqa_group_size and m.cfg.hidden_size == cfg.hidden_size
    assert not torch.equal(SalaModel(cfg, {}, None, torch.float32, "cpu", 1, 2).log_decay,
                           -torch.tensor(alibi_slopes(2)))


# ---- the sharded model in one process: ranks as threads -------------------------------------------
class ThreadGroup:
    """A TPGroup stand-in for ranks that are threads of this process: all_reduce adds the ranks'
    tensors in rank order (the same result on every rank, as a real all-reduce)."""

    def __init__(self, shared: dict, rank: int, size: int):
        self.shared, self.rank, self.size = shared, rank, size

    def all_reduce(self, t):
        s = self.shared
        s["bufs"][self.rank] = t.clone()
        s["barrier"].wait()
        total = s["bufs"][0].clone()
        for b in s["bufs"][1:]:
            total += b
        s["barrier"].wait()
        return t.copy_(total)


def _model(cfg, w, rank, size, group, kv_dtype=torch.float32, kv_group=None):
    w = shard_state_dict(cfg, dict(w), rank, size)
    ops = TorchBackend() if size == 1 else TensorParallelOps(TorchBackend(), group, kv_group)
    m = SalaModel(cfg, fuse_state_dict(cfg, w), ops, torch.float32, "cpu", rank, size)
    lc, sc = m.cfg, cfg.sparse
    ns, nl = len(cfg.sparse_layers), len(cfg.lightning_layers)
    caches = Caches(kv=KVPool(ns, 64, sc.block_size, lc.num_key_value_heads, lc.head_dim, kv_dtype, "cpu",
                              compute_dtype=torch.float32),
                    compressed=CompressedKeyPool(sc, ns, 64, lc.num_key_value_heads, lc.head_dim, torch.float32,
                                                 "cpu"),
                    states=StatePool(2, nl, lc.lightning_nh, lc.lightning_head_dim, torch.float32, "cpu"))
    # the caches hold this rank's heads only
    assert caches.kv.k.shape[3] == max(1, cfg.num_key_value_heads // size)  # one replicated head past kv heads
    assert caches.states.state.shape[2] == cfg.lightning_nh // size
    return m, caches


def _prefill_and_decode(m, caches, ids, steps):
    sc = m.cfg.sparse
    slot = caches.states.alloc()
    pages = caches.kv.allocator.alloc(-(-(len(ids) + steps) // sc.block_size))
    out = [m.forward(ForwardBatch.build([SeqWork(slot, pages, 0, ids, True)], sc.block_size, sc.dense_len, "cpu"),
                     caches)]
    for i in range(steps):  # fixed next tokens: every step compares the same inputs
        work = [SeqWork(slot, pages, len(ids) + i, [5 + 37 * i], True)]
        out.append(m.forward(ForwardBatch.build(work, sc.block_size, sc.dense_len, "cpu"), caches))
    return torch.cat(out)


def _thread_groups(size: int, parts: int = 1) -> list[list]:
    """For each of `parts` runs of consecutive ranks (group.split_group's), its ThreadGroups."""
    per = size // parts
    runs = [{"barrier": threading.Barrier(per, timeout=60), "bufs": [None] * per} for _ in range(parts)]
    return [[ThreadGroup(runs[p], r, per) for r in range(per)] for p in range(parts)]


def _run_ranks(size: int, rank, errors: list) -> None:
    """rank(r) for every r in its own thread (the ranks of an in-process group); re-raises the
    first error a rank recorded in `errors`."""
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _sharded_logits(cfg, w, ids, steps, size=2, kv_dtype=torch.float32):
    """Every rank's logits (checked equal) with `size` ranks as threads; with replicated KV heads
    (kv_replicas > 1) the ranks sharing a head get their sub-group, as the runner gives them."""
    groups = _thread_groups(size)[0]
    reps = kv_replicas(cfg, size)
    kv_groups = sum(_thread_groups(size, size // reps), []) if reps > 1 else [None] * size
    out, errors = [None] * size, []

    def rank(r):
        try:
            m, caches = _model(cfg, w, r, size, groups[r], kv_dtype, kv_groups[r])
            out[r] = _prefill_and_decode(m, caches, ids, steps)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            for g in groups + [g for g in kv_groups if g is not None]:
                g.shared["barrier"].abort()

    _run_ranks(size, rank, errors)
    assert all(torch.equal(out[0], o) for o in out[1:])  # every rank has the same logits
    return out[0]


# 600 tokens: past dense_len (256) and past the 13 blocks a query attends (1 init + 4 local + 8
# top-k of 32 tokens), so the block selection really chooses
LONG = [3 + (i * 7919) % 8000 for i in range(600)]


@pytest.mark.parametrize("quantization,kv_dtype", [(None, torch.float32), ("fp8", torch.float32),
                                                   ("w4a16", torch.float32), (None, torch.float8_e4m3fn)],
                         ids=["fp32", "fp8-weights", "w4a16-weights", "fp8-kv"])
def test_sharded_model_equals_whole_model(default_cfg, quantization, kv_dtype):
    """fp32 on the CPU; weights unquantized or quantized on load; K/V pages in fp32 or fp8 (whose
    scales are per page and KV head, so each rank's are the TP=1 scales of its heads)."""
    cfg = default_cfg
    w = load_state_dict(default_model_dir(), cfg, dtype=torch.float32, quantization=quantization)
    for ids in (LONG, LONG[:40]):  # the sparse regime and a short dense prompt
        whole = _prefill_and_decode(*_model(cfg, w, 0, 1, None, kv_dtype), ids, 3)
        sharded = _sharded_logits(cfg, w, ids, 3, kv_dtype=kv_dtype)
        torch.testing.assert_close(sharded, whole, atol=LOGIT_ATOL, rtol=0)
        assert torch.equal(sharded.argmax(-1), whole.argmax(-1))


def test_rebuilt_slopes_would_be_caught(default_cfg, monkeypatch):
    """The tolerance is tight enough to see the classic mistake: each rank's decay slopes rebuilt
    for its local head count instead of sliced from the global heads."""
    cfg = default_cfg
    w = load_state_dict(default_model_dir(), cfg, dtype=torch.float32)
    whole = _prefill_and_decode(*_model(cfg, w, 0, 1, None), LONG[:100], 0)
    real_init = SalaModel.__init__

    def rebuilt(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self.log_decay = -torch.tensor(alibi_slopes(self.cfg.lightning_nh), dtype=torch.float32)

    monkeypatch.setattr(SalaModel, "__init__", rebuilt)
    wrong = _sharded_logits(cfg, w, LONG[:100], 0)
    assert (wrong - whole).abs().max() > 100 * LOGIT_ATOL


# ---- engines: real processes over gloo ------------------------------------------------------------
PROMPTS = ["The quick brown fox", "Once upon a time, in a small village,", LONG]


def _alive(pid: int) -> bool:
    """pid runs (a zombie, exited but not yet reaped by its parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _all_gone(pids, wait_s: float = 10.0) -> bool:
    """Whether every pid has exited, waiting up to wait_s for processes that are on their way out
    (another process's helpers, e.g. multiprocessing's resource tracker, exit after their parent)."""
    import time

    deadline = time.monotonic() + wait_s
    while any(_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.timeout(240)
@pytest.mark.parametrize("quantization", [None, "fp8", "w4a16"])
def test_tp2_greedy_equals_tp1(quantization):
    from salaserve.core.sampling_params import SamplingParams
    from salaserve.engine.llm import LLM

    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    # a second round reuses state slots (zeroed on every rank) and starts from the prefix cache's
    # copy of the long prompt (copied on every rank). Unquantized, prefill chunks of 200 tokens make
    # steps that mix the long prompt's chunks with the short prompts' decodes.
    rounds = [PROMPTS, PROMPTS[:2] + [LONG + [11, 12, 13]]]
    kw = dict(device="cpu", quantization=quantization, max_running_requests=4,
              chunked_prefill_size=200 if quantization is None else 8192)
    one = LLM(**kw)
    want = [[o.token_ids for o in one.generate(r, params)] for r in rounds]
    with LLM(tp_size=2, dist_timeout=60, **kw) as two:
        pids = two.engine.runner.followers.pids
        assert len(pids) == 1 and all(_alive(p) for p in pids)
        assert two.engine.runner.model.ops.kv_group is None  # a KV head per rank: no sub-groups
        got = [[o.token_ids for o in two.generate(r, params)] for r in rounds]
        assert two.engine.stats["cached_prompt_tokens"] == len(LONG)
    assert got == want
    assert not any(_alive(p) for p in pids)  # shutdown leaves no process behind


@pytest.mark.timeout(120)
def test_tp2_speculative_verify_equals_tp1():
    """NGRAM speculation: verify steps and the commit of accepted tokens run on every rank."""
    from salaserve.core.sampling_params import SamplingParams
    from salaserve.engine.llm import LLM

    prompt = LONG[:64] * 3  # repeats, so prompt lookup finds drafts
    params = SamplingParams(max_new_tokens=16, temperature=0.0)
    kw = dict(device="cpu", speculative_algorithm="NGRAM", max_running_requests=2)
    want = LLM(**kw).generate(prompt, params)[0].token_ids
    with LLM(tp_size=2, dist_timeout=60, **kw) as two:
        got = two.generate(prompt, params)[0].token_ids
        assert two.engine.stats["spec_verify_steps"] > 0
    assert got == want


def test_rank_devices():
    """Rank i on cuda:i; refused: more ranks than GPUs, one named GPU; the CPU when there is none."""
    from salaserve.config import EngineArgs
    from salaserve.engine.tp_workers import rank_args

    args = EngineArgs(tp_size=2, device="cuda")
    assert [rank_args(args, r, cuda_count=2).device for r in range(2)] == ["cuda:0", "cuda:1"]
    assert rank_args(EngineArgs(tp_size=2, device="auto"), 1, cuda_count=0).device == "cpu"
    with pytest.raises(ValueError, match="one GPU per rank, but 1 GPU"):
        rank_args(args, 0, cuda_count=1)
    with pytest.raises(ValueError, match="names one GPU"):
        rank_args(EngineArgs(tp_size=2, device="cuda:1"), 0, cuda_count=2)


def test_page_lists_travel_as_deltas():
    """Rank 0 sends each slot's new pages only; a follower rebuilds the same lists, and starts over
    for a new list object or a shorter list (a request that freed its pages)."""
    from salaserve.engine.tp_workers import PageLists, PageSync

    sync, lists = PageSync(), PageLists()

    def step(*pairs):
        seqs = [SeqWork(slot, pages, 0, [1], True) for slot, pages in pairs]
        sent, starts = sync.encode(seqs)
        got = lists.decode(sent, starts)
        assert [w.pages for w in got] == [pages for _, pages in pairs]
        return [len(w.pages) for w in sent], starts

    a, b = [1, 2], [7]
    assert step((0, a), (1, b)) == ([2, 1], [0, 0])
    assert step((0, a), (1, b)) == ([0, 0], [2, 1])  # nothing new
    a.extend([3, 4])
    assert step((0, a)) == ([2], [2])
    assert step((0, [9, 8])) == ([2], [0])  # a new list: from scratch
    c = [5, 6, 7]
    assert step((1, c)) == ([3], [0])
    del c[1:]  # shorter (never done by the scheduler, but handled)
    assert step((1, c)) == ([1], [0])
    with pytest.raises(RuntimeError, match="out of step"):
        PageLists().decode([SeqWork(3, [1], 0, [1], True)], [4])


@pytest.mark.timeout(120)
def test_bad_tp_size_refused_before_any_process():
    from salaserve.engine.llm import LLM

    import multiprocessing

    before = set(p.pid for p in multiprocessing.active_children())
    with pytest.raises(TPConfigError, match="tp_size 3 does not divide num_key_value_heads = 2"):
        LLM(device="cpu", tp_size=3)
    with pytest.raises(ValueError, match="tp_size must be a positive integer"):
        LLM(device="cpu", tp_size=0)
    assert set(p.pid for p in multiprocessing.active_children()) == before


@pytest.mark.timeout(120)
def test_quantization_that_cannot_split_is_reported_and_ranks_stop(tiny_model_dir):
    """The tiny checkpoint's o_proj has K = 128: 64 a rank cuts int4 groups of 128. Rank 0 says
    so itself, and its follower is gone afterwards."""
    import multiprocessing

    from salaserve.engine.llm import LLM

    before = set(p.pid for p in multiprocessing.active_children())
    with pytest.raises(TPConfigError, match="o_proj.*multiple of the group size"):
        LLM(tiny_model_dir, device="cpu", tp_size=2, quantization="w4a16", dist_timeout=60)
    assert set(p.pid for p in multiprocessing.active_children()) == before


@pytest.mark.timeout(120)
def test_a_dead_rank_is_reported_not_waited_for():
    import signal

    from salaserve.core.sampling_params import SamplingParams
    from salaserve.engine.llm import LLM
    from salaserve.engine.tp_workers import RankFailed

    llm = LLM(device="cpu", tp_size=2, max_running_requests=2, dist_timeout=60)
    try:
        proc = llm.engine.runner.followers.procs[0]
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        with pytest.raises(RankFailed, match="tensor-parallel rank 1 exited with code -9"):
            llm.generate("Hello", SamplingParams(max_new_tokens=4))
    finally:
        llm.shutdown()
    assert not _alive(proc.pid)


@pytest.mark.timeout(120)
def test_a_rank_that_fails_mid_step_is_reported_with_its_error():
    """A follower that raises (here: an operation it does not know) sends its traceback and exits;
    rank 0 reports it at its next send, or from the collective the rank left, never hangs."""
    from salaserve.core.sampling_params import SamplingParams
    from salaserve.engine.llm import LLM
    from salaserve.engine.tp_workers import RankFailed

    llm = LLM(device="cpu", tp_size=2, max_running_requests=2, dist_timeout=30)
    try:
        followers = llm.engine.runner.followers
        followers.send(("no-such-op", (), []))
        with pytest.raises(RankFailed, match="(?s)tensor-parallel rank 1.*unknown tensor-parallel operation"):
            llm.generate("Hello", SamplingParams(max_new_tokens=4))
    finally:
        llm.shutdown()
    assert not any(_alive(p) for p in followers.pids)


def _descendants(pid: int) -> set[int]:
    """Every live process below pid (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


@pytest.mark.timeout(240)
def test_serve_tp2_answers_as_tp1_and_leaves_no_process(tiny_model_dir, tmp_path):
    import httpx
    from server_utils import run_server, tiny_server_args

    from salaserve.core.sampling_params import SamplingParams
    from salaserve.engine.llm import LLM

    prompt = list(range(5, 205))  # past the tiny preset's dense_len (128): sparse layers select blocks
    want = LLM(tiny_model_dir, device="cpu", max_running_requests=2).generate(
        prompt, SamplingParams(max_new_tokens=8, temperature=0.0))[0].token_ids
    with run_server(tiny_server_args(tiny_model_dir, "--tp-size", "2", "--skip-server-warmup",
                                     "--dist-timeout", "60"), str(tmp_path)) as server:
        below = _descendants(server.proc.pid)
        assert len(below) >= 2  # the engine process and tensor-parallel rank 1 (at least)
        r = httpx.post(server.url + "/generate", json={"input_ids": prompt, "sampling_params": {
            "max_new_tokens": 8, "temperature": 0}}, timeout=60)
        assert r.status_code == 200, r.text
        got = r.json()["output_ids"]
    assert got == want
    assert _all_gone(below)


@pytest.mark.timeout(120)
def test_ranks_exit_when_rank_0_is_killed(tmp_path):
    """No orphans even when rank 0 cannot shut down: a follower sees its pipe close and exits."""
    import subprocess
    import sys

    script = tmp_path / "leader.py"
    script.write_text(
        "import sys, time\n"
        "from salaserve.engine.llm import LLM\n"
        "if __name__ == '__main__':\n"
        "    llm = LLM(device='cpu', tp_size=2, max_running_requests=1, dist_timeout=60)\n"
        "    print(*llm.engine.runner.followers.pids, flush=True)\n"
        "    time.sleep(600)\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env, cwd=root)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert pids and all(_alive(p) for p in pids)
    finally:
        proc.kill()
        proc.wait()
    assert _all_gone(pids, wait_s=30)


@pytest.mark.timeout(180)
def test_generate_cli_tp2():
    import subprocess
    import sys

    from salaserve.core.sampling_params import SamplingParams
    from salaserve.engine.llm import LLM

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    cmd = [sys.executable, "-m", "salaserve.cli", "generate", "--device", "cpu", "--prompt", "Once upon a time",
           "--max-new-tokens", "8"]
    want = LLM(device="cpu", max_running_requests=1).generate("Once upon a time", SamplingParams(
        max_new_tokens=8, temperature=0.0))[0].text
    out = subprocess.run(cmd + ["--tp-size", "2"], capture_output=True, text=True, env=env, cwd=root, timeout=150)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "Once upon a time" + want + "\n"
    bad = subprocess.run(cmd + ["--tp-size", "3"], capture_output=True, text=True, env=env, cwd=root, timeout=150)
    assert bad.returncode == 2 and "tp_size 3 does not divide num_key_value_heads" in bad.stderr


@pytest.mark.timeout(120)
def test_a_script_without_the_main_guard_is_told_why(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "noguard.py"
    script.write_text("from salaserve.engine.llm import LLM\nLLM(device='cpu', tp_size=2, dist_timeout=30)\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=root,
                         timeout=100)
    assert out.returncode != 0
    assert "RankFailed: tensor-parallel rank 1" in out.stderr and "__main__" in out.stderr


@pytest.mark.timeout(180)
@pytest.mark.parametrize("size", [2, 4])
def test_tp2_tree_verify_equals_plain_decoding(tiny_model_dir, size):
    """Draft trees (spec/tree.py) verified on two ranks: the tree oracle hides the plain output among
    wrong siblings, so greedy output must equal plain TP=1 decoding; each accepted path's commit
    (Lightning states, sparse K/V, compressed keys) runs on every rank. At 4 ranks the tiny model's
    2 KV heads are replicated (each tree row's stage-1 scores all-reduced over its head's pair)."""
    import random

    from salaserve.core.sampling_params import SamplingParams
    from salaserve.engine.engine import Engine
    from salaserve.spec.oracle import TreeOracleDrafter

    rng = random.Random(5)
    prompts = [([rng.randrange(3, 8000) for _ in range(7)] * 60)[:n] for n in (60, 140, 260)]
    params = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    kw = dict(model=tiny_model_dir, device="cpu", dtype="float32", backend="torch", chunked_prefill_size=64,
              max_running_requests=4)

    def run(engine):
        return run_requests(engine, prompts, params)

    plain = run(Engine(**kw))
    eng = Engine(tp_size=size, dist_timeout=60, speculative_algorithm="NGRAM", speculative_num_draft_tokens=6,
                 speculative_max_batch=8, **kw)
    try:
        assert eng.tree_verify
        eng.make_drafter = lambda req: TreeOracleDrafter(req.num_prompt, plain[req.rid], eng.cfg.vocab_size,
                                                         depth=4, width=3, miss_every=3, seed=0)
        trees, build = [], eng.runner.build_batch

        def spy(work):
            batch = build(work)
            trees.append(batch.trees)
            return batch

        eng.runner.build_batch = spy
        assert run(eng) == plain
        assert any(t is not None for t in trees)  # whole trees went to both ranks
        assert eng.stats["spec_accepted_tokens"] > eng.stats["spec_verify_steps"] > 0
    finally:
        eng.shutdown()
