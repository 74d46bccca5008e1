"""Host time of ForwardBatch.build on this machine's GPU: the one-copy staging (to_device) against
the per-field construction it replaced (torch.tensor per field, one host->device copy each), for
decode batches of 1, 8 and 128 sequences at a 2K context. Prints us per build (median of 5 x 200)."""

import random
import statistics
import time

import torch

from salaserve.engine.batch import ForwardBatch, SeqWork


def per_field_build(work, block_size, device):
    """The replaced construction (fields only, as before the staging change)."""
    ids, pos, slot_map, logit_rows, cu = [], [], [], [], [0]
    for w in work:
        ids.extend(w.token_ids)
        for p in range(w.cache_len, w.seq_len):
            pos.append(p)
            slot_map.append(w.pages[p // block_size] * block_size + p % block_size)
        cu.append(cu[-1] + len(w.token_ids))
        logit_rows.append(cu[-1] - 1)
    max_pages = max(len(w.pages) for w in work)
    table = [w.pages + [0] * (max_pages - len(w.pages)) for w in work]

    def t(x, dtype):
        return torch.tensor(x, dtype=dtype).to(device, non_blocking=True)

    return (t(ids, torch.int64), t(pos, torch.int64), t(cu, torch.int32), t([w.seq_len for w in work], torch.int32),
            t([w.cache_len for w in work], torch.int32), t(table, torch.int32), t(slot_map, torch.int64),
            t([w.state_slot for w in work], torch.int64), t([False] * len(work), torch.bool),
            t(logit_rows, torch.int64))


def timed(fn, n=200, repeats=5):
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(out)


def main():
    dev = torch.device("cuda")
    print(f"{'batch':>5} {'per-field us':>12} {'staged us':>10}")
    for B in (1, 8, 128):
        work = [SeqWork(state_slot=i, pages=random.sample(range(100000), 33), cache_len=2048, token_ids=[7],
                        need_logits=True) for i in range(B)]
        old = timed(lambda: per_field_build(work, 64, dev))
        new = timed(lambda: ForwardBatch.build(work, 64, 8192, dev))
        print(f"{B:>5} {old:>12.1f} {new:>10.1f}")


if __name__ == "__main__":
    main()
