#!/usr/bin/env python3
"""Hugging Face transformers' own decode speed (eager, batch 1, greedy) on a config.json with
random bf16 weights made on the GPU: the end-to-end peer of `vt bench --load-format dummy`.
flash-linear-attention is used when importable (PYTHONPATH=/tmp/site), as transformers does.

usage: hf_decode.py CONFIG_DIR [PROMPT_LEN] [STEPS]
"""
import sys
import time

import torch
import transformers

cfg_dir = sys.argv[1]
prompt_len = int(sys.argv[2]) if len(sys.argv) > 2 else 32
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 16
cfg = transformers.AutoConfig.from_pretrained(cfg_dir)
t0 = time.time()
with torch.device("cuda"):
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
print(f"hf: built {sum(p.numel() for p in model.parameters()) / 1e9:.1f}B parameters in {time.time() - t0:.0f} s", flush=True)
ids = torch.randint(0, cfg.vocab_size, (1, prompt_len), device="cuda")
with torch.no_grad():
    out = model(ids, use_cache=True)
    cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
    times = []
    for _ in range(steps + 3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = model(tok, past_key_values=cache, use_cache=True)
        cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
tpot = sorted(times[3:])[len(times[3:]) // 2]
print(f"hf decode batch 1: TPOT {tpot * 1e3:.1f} ms, {1 / tpot:.2f} tok/s (median of {steps} steps)")
