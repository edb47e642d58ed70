#!/usr/bin/env python3
"""The strides torch.compile's GPT-2 step hands to cuDNN's SDPA (torch.profiler record_shapes: the trace's
"Input Dims" / "Input Strides" of the attention ops). Usage: anchor_sdpa_strides.py <dir of torch_anchor.py>"""
import json, os, sys, tempfile, torch
sys.path.insert(0, sys.argv[1])
import torch_anchor as ta
from torch.profiler import profile, ProfilerActivity
fam, V, T, L, C, H, KV, F_ = ta.PRESETS[sys.argv[2] if len(sys.argv) > 2 else "gpt2-124M"]
B = int(sys.argv[3]) if len(sys.argv) > 3 else 16
m = ta.Decoder(fam, V, T, L, C, H, KV, F_).cuda()
opt = torch.optim.AdamW(m.parameters(), lr=3e-4, fused=True)
f = torch.compile(m)
x = torch.randint(0, V, (B, T), device="cuda"); y = torch.randint(0, V, (B, T), device="cuda")
def step():
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = f(x, y)
    loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
for _ in range(4):
    step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
    step(); torch.cuda.synchronize()
p = os.path.join(tempfile.mkdtemp(), "t.json"); prof.export_chrome_trace(p)
seen = set()
for e in json.load(open(p))["traceEvents"]:
    n = e.get("name", "")
    if e.get("cat") == "cpu_op" and ("attention" in n or "sdpa" in n):
        a = e.get("args", {})
        key = (n, str(a.get("Input Dims")), str(a.get("Input Strides")))
        if key in seen: continue
        seen.add(key)
        print(json.dumps({"op": n, "dims": a.get("Input Dims"), "strides": a.get("Input Strides")})[:600])
