#!/usr/bin/env python3
"""How far Hugging Face transformers itself moves from its own f32 reference when it runs a
fixture in bf16 (weights and activations) on the GPU: the yardstick for vt-cuda's end-to-end
bound (crates/vt-cuda/tests/parity.rs). Prints, per bf16 fixture, max |Δlogit| and how many
positions exceed 8·2^-8·max|logit|. Run on the GPU machine from the repository root."""
import glob
import os

import torch
import transformers
from safetensors.torch import load_file

for ref in sorted(glob.glob("fixtures/*/reference.safetensors")):
    d = os.path.dirname(ref)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).cuda().eval()
    except Exception as e:  # NVFP4 fixtures need compressed-tensors / modelopt loaders
        print(f"hf-bf16 {os.path.basename(d)}: skipped ({type(e).__name__})")
        continue
    r = load_file(ref)
    seq = torch.cat([r["prompt_ids"], r["greedy_ids"][:-1]]).long().cuda()[None]
    try:
        with torch.no_grad():
            logits = model(seq).logits[0].float().cpu()
    except RuntimeError as e:  # e.g. cuBLAS refusing bf16 rows that are not 16-byte aligned
        print(f"hf-bf16 {os.path.basename(d)}: failed ({e})")
        continue
    want = r["logits"].float()
    tol = 8 * 2**-8 * want.abs().max().item()
    per_row = (logits - want).abs().max(dim=1).values
    over = (per_row > tol).nonzero().flatten().tolist()
    print(f"hf-bf16 {os.path.basename(d)}: max |dlogit| bf16-f32 = {per_row.max().item():.3e}; bound {tol:.3e} exceeded at {len(over)} of {len(per_row)} positions {over[:20]}")
