"""Where one compiled decode step spends GPU and CPU time (torch.profiler), DeepSeek-V3.2 sizes, B=64, ctx 4096.

    python benchmarks/profile_decode.py
"""

import time

import torch
from torch.profiler import ProfilerActivity, profile

from nsa_inductor.indexer import Indexer, IndexerConfig
from nsa_inductor.layout import KCacheLayout
from nsa_inductor.workload import decode_batch
t0 = time.time()
cfg = IndexerConfig.deepseek_v32(max_model_len=4096); L = KCacheLayout(64)
m = Indexer(cfg, L).cuda(); m.reset_parameters()
b = decode_batch(cfg, L, [4096 - i for i in range(64)], max_len=4096, device="cuda")
f = torch.compile(m.decode, backend="nsa_rocm", options={"nsa.layout": "paged", "nsa.page_size": 64})
with torch.no_grad():
    for _ in range(3): f(*b.args)
    torch.cuda.synchronize(); print("setup", time.time() - t0, flush=True)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as p:
        for _ in range(5): f(*b.args)
        torch.cuda.synchronize()
print(p.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
print(p.key_averages().table(sort_by="cpu_time_total", row_limit=8, max_name_column_width=60))
