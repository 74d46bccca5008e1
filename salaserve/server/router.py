"""Which engine replica (--dp-size) gets a request: the least loaded one, unless a recent request
with the same long prompt prefix went to another that is not much busier (prefix-cache affinity).

Load is the number of sequences the server has in flight on a replica (sent and not finished):
what the engine will count as running + queued, known at send time. The engines' own counters
arrive once per step, so a burst routed on them would see equal loads and land on one replica.

Affinity: a prompt's first `max_blocks` x `block_tokens` tokens are cut into blocks, and each
block's hash is chained to the blocks before it, so a chain hash stands for a whole prefix. An
LRU maps chain hashes to the replica that last got them. A new prompt looks up its longest
chain; if that covers at least `min_match_tokens` (the engine's --prefix-cache-min-tokens: a
shorter common prefix is not kept in the prefix cache anyway) and that replica has at most
`slack` more sequences in flight than the least loaded one, the prompt goes there. Every routed
prompt then records its chains under the replica it went to.
"""

from __future__ import annotations

from collections import OrderedDict

BLOCK_TOKENS = 64
MAX_BLOCKS = 32  # the first 2048 tokens: enough to tell apart prompts that share a document
LRU_ENTRIES = 8192  # chain hashes remembered (8 bytes of key and a small int each)


class NoReplica(RuntimeError):
    """No replica is serving."""


class PrefixAffinityRouter:
    def __init__(self, num_replicas: int, min_match_tokens: int, slack: int, block_tokens: int = BLOCK_TOKENS,
                 max_blocks: int = MAX_BLOCKS, lru_entries: int = LRU_ENTRIES):
        """min_match_tokens: the shortest common prefix worth following (None or 0: no affinity)."""
        self.num_replicas = num_replicas
        self.min_match_tokens = min_match_tokens
        self.slack = slack
        self.block_tokens = block_tokens
        self.max_blocks = max_blocks
        self.lru_entries = lru_entries
        self.routed = [0] * num_replicas  # requests sent to each replica (a tie-break: spread sequential traffic)
        self.affinity_hits = 0  # requests that went to their prefix's replica
        self._owner: OrderedDict[int, int] = OrderedDict()  # chain hash -> replica

    def chain_hashes(self, prompt_ids: list[int]) -> list[int]:
        """The hash of each whole-block prefix of the prompt, shortest first."""
        out, h = [], 0
        b = self.block_tokens
        for start in range(0, min(len(prompt_ids), b * self.max_blocks) - b + 1, b):
            h = hash((h, tuple(prompt_ids[start:start + b])))
            out.append(h)
        return out

    def choose(self, prompt_ids: list[int], loads: list[int | None]) -> int:
        """The replica for a request whose (first) prompt is `prompt_ids`; loads[i] is replica i's
        sequences in flight, None for one that is not serving. Records the choice."""
        serving = [i for i, load in enumerate(loads) if load is not None]
        if not serving:
            raise NoReplica("no engine replica is serving")
        least = min(serving, key=lambda i: (loads[i], self.routed[i], i))
        chains = self.chain_hashes(prompt_ids) if self.min_match_tokens else []
        target = least
        preferred = self._longest_match(chains)
        if preferred is not None and loads[preferred] is not None and loads[preferred] <= loads[least] + self.slack:
            target = preferred
            self.affinity_hits += 1
        self._record(chains, target)
        self.routed[target] += 1
        return target

    def _longest_match(self, chains: list[int]) -> int | None:
        # (a prefix cache that keeps only prompts longer than the window: the whole window is the best evidence)
        min_blocks = max(1, min(-(-self.min_match_tokens // self.block_tokens), self.max_blocks))
        for k in range(len(chains) - 1, min_blocks - 2, -1):
            replica = self._owner.get(chains[k])
            if replica is not None:
                return replica
        return None

    def _record(self, chains: list[int], replica: int) -> None:
        for h in chains:
            self._owner[h] = replica
            self._owner.move_to_end(h)
        while len(self._owner) > self.lru_entries:
            self._owner.popitem(last=False)
