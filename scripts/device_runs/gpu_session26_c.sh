#!/usr/bin/env bash
# Twenty-sixth session: run 141 put fp8 KV pages 0.5% behind bf16 pages at 128K (5.046 / 5.042 against
# 5.014 / 5.025 ms). At context 131072 every measured step writes a page's first token, where the fp8
# store sets the page's scale (amax of the step's tokens) before it quantizes; in real decoding that is
# 1 step in 64. The same A/B one token past the middle of a page (131103 = 131072 + 31), where the store
# only quantizes with the page's scale, interleaved over four processes.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
for i in 1 2; do
  profile_graph "mid-bf16-$i" --context 131103
  profile_graph "mid-fp8-$i" --context 131103 --kv-cache-dtype fp8_e4m3
done
