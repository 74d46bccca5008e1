"""Tensor parallelism (--tp-size N): the process group and the sharding rules.

    group.py    TPGroup: this rank, the world size and the collectives the model needs (a no-op
                group for one rank); init_group over torch.distributed (NCCL on CUDA, gloo on the CPU)
    shard.py    which slice of each weight a rank holds, its local head counts (local_config) and
                the checks that a model can be split N ways
    ops.py      TensorParallelOps: a kernel backend wrapper that all-reduces the row-parallel
                linears' partial sums and the Lightning o_norm's statistics

The processes themselves (rank 0 runs the engine, ranks 1..N-1 follow its steps) are started by
engine/tp_workers.py. This package sits with the weight formats (state layer): the model and the
engine import it, it imports only config and quant.
"""
