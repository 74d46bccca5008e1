"""SGLang launch flags that `salaserve serve` accepts and ignores, each with the reason.

A launch line written for `python -m sglang.launch_server` must start salaserve too, so SGLang
flags that choose among SGLang's own kernels, backends, scheduling knobs or logging are accepted
here with a one-line notice. Only flags whose absence cannot change what a request returns belong
here; a flag that would (a context length, a tokenizer, a parser) is either implemented or left
unknown, and unknown flags are errors, as in SGLang.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

FLAG, VALUE, VALUES = "flag", "value", "values"  # how many arguments the flag takes: 0, 1, 1 or more


@dataclass(frozen=True)
class IgnoredFlag:
    arity: str  # FLAG | VALUE | VALUES
    why: str
    soar_only: bool = False  # defined in the SOAR demo's SGLang copy, not in upstream SGLang


_OWN_KERNELS = "salaserve picks its own attention kernels (see --backend)"
_ACCESS_LOG = "salaserve logs each HTTP request line at --log-level debug"

IGNORED_SGLANG_FLAGS: dict[str, IgnoredFlag] = {
    "--attention-backend": IgnoredFlag(VALUE, _OWN_KERNELS),
    "--prefill-attention-backend": IgnoredFlag(VALUE, _OWN_KERNELS),
    "--decode-attention-backend": IgnoredFlag(VALUE, _OWN_KERNELS),
    "--dense-as-sparse": IgnoredFlag(
        FLAG, "salaserve decides dense vs sparse attention per sequence from the model's dense_len", soar_only=True),
    "--sampling-backend": IgnoredFlag(VALUE, "salaserve samples with its own sampler"),
    "--grammar-backend": IgnoredFlag(VALUE, "structured output always runs on xgrammar"),
    "--enable-torch-compile": IgnoredFlag(FLAG, "salaserve runs its own kernels (CUDA graphs on the GPU), "
                                                "not torch.compile"),
    "--torch-compile-max-bs": IgnoredFlag(VALUE, "salaserve does not use torch.compile"),
    "--cuda-graph-bs": IgnoredFlag(VALUES, "decode graphs are captured at salaserve's own batch sizes up to "
                                           "--cuda-graph-max-bs"),
    "--disable-cuda-graph-padding": IgnoredFlag(FLAG, "a decode batch runs padded to the next captured size "
                                                      "(--disable-cuda-graph turns graphs off)"),
    "--page-size": IgnoredFlag(VALUE, "a KV page holds one sparse-attention block of the model"),
    "--max-prefill-tokens": IgnoredFlag(VALUE, "the prefill token budget per step is --chunked-prefill-size"),
    "--enable-mixed-chunk": IgnoredFlag(FLAG, "decodes and prefill chunks always share a step"),
    "--num-continuous-decode-steps": IgnoredFlag(VALUE, "the scheduler runs before every step"),
    "--disable-custom-all-reduce": IgnoredFlag(FLAG, "tensor parallelism all-reduces through torch.distributed "
                                                     "(NCCL); there is no custom all-reduce"),
    "--enable-p2p-check": IgnoredFlag(FLAG, "NCCL checks GPU peer access itself"),
    "--watchdog-timeout": IgnoredFlag(VALUE, "salaserve has no watchdog; a dead engine process stops the server"),
    "--log-requests": IgnoredFlag(FLAG, _ACCESS_LOG),
    "--log-requests-level": IgnoredFlag(VALUE, _ACCESS_LOG),
    "--decode-log-interval": IgnoredFlag(VALUE, "the generation throughput is in /get_server_info "
                                                "(last_gen_throughput)"),
}


def add_ignored_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("SGLang flags accepted for compatibility and ignored")
    for flag, spec in IGNORED_SGLANG_FLAGS.items():
        if spec.arity == FLAG:
            group.add_argument(flag, action="store_true", help=spec.why)
        else:
            group.add_argument(flag, nargs="+" if spec.arity == VALUES else None, default=None,
                               metavar="X", help=spec.why)


def ignored_flag_notices(ns: argparse.Namespace) -> list[str]:
    """One line per ignored flag that was given."""
    notices = []
    for flag, spec in IGNORED_SGLANG_FLAGS.items():
        if getattr(ns, flag[2:].replace("-", "_")) not in (None, False):
            notices.append(f"note: {flag} is accepted for SGLang compatibility and ignored: {spec.why}")
    return notices


# --schedule-policy values SGLang has and salaserve does not (prefix-aware or random orders): they
# change no output, only which queued request starts first, and run as fcfs
SGLANG_ONLY_POLICIES = ("lpm", "random", "dfs-weight", "priority", "routing-key")


def admission_order(policy: str, notices: list[str]) -> str:
    """The scheduler's admission order for a --schedule-policy value; a notice where it differs."""
    if policy in SGLANG_ONLY_POLICIES:
        notices.append(f"note: --schedule-policy {policy} is accepted for SGLang compatibility and runs as fcfs "
                       "(priority, then arrival)")
        return "fcfs"
    return policy
