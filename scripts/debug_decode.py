"""Debug helper for the device: one decode step at batch B, eager or graph, with blocking launches."""
import os
import sys
import tempfile

import torch

from salaserve.bench.micro import fake_decoding_requests
from salaserve.config import EngineArgs
from salaserve.engine.runner import ModelRunner
from salaserve.engine.scheduler import ScheduledWork
from salaserve.model.checkpoint import write_checkpoint

B, ctx, graphs, maxrun = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "graph", int(sys.argv[4])
d = tempfile.mkdtemp()
write_checkpoint(d, "full", weights=False)
args = EngineArgs(model=d, backend="triton", load_format="dummy", dtype="bfloat16", max_running_requests=maxrun,
                  max_total_tokens=int(os.environ.get("TOK", "600000")), enable_cuda_graph=graphs)
r = ModelRunner(args, d)
reqs = fake_decoding_requests(r, B, ctx)
out = r.forward([ScheduledWork(q, 1) for q in reqs])
torch.cuda.synchronize()
print("OK", B, ctx, graphs, maxrun, float(out.float().std()))
