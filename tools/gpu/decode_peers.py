#!/usr/bin/env python3
"""Peers of vt's decode kernels (crates/vt-cuda/examples/decode_bench.rs) on the same shapes, in the
same device call: the Hugging Face transformers Qwen3.5-MoE sparse block (its own eager speed,
synchronised per call, as a user sees it), flash-linear-attention's fused_recurrent_gated_delta_rule
(alone, and after its causal_conv1d_update with the gates fused: vt's step),
torch F.linear (cuBLAS) and SDPA decode (device time, queued behind torch.cuda._sleep as vt's
bench queues behind a spin). Writes `name µs` lines to OUT/peers.txt for decode_bench.

usage: decode_peers.py OUT   (fla-core importable, e.g. PYTHONPATH=/tmp/site)
"""
import os
import sys
import time

import torch
import torch.nn.functional as F

OUT = sys.argv[1]
dev = "cuda"
res = {}


def device_us(fn, iters=100, spin_ms=30):
    """Device time per call, the calls queued behind a spin so that Python's overhead is hidden."""
    fn(0)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(spin_ms * 1.98e6))
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(iters):
        fn(i)
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) * 1e3 / iters


def wall_us(fn, iters=30):
    """Median wall time per call, synchronised: what an eager caller waits."""
    for i in range(3):
        fn(i)
    torch.cuda.synchronize()
    times = []
    for i in range(iters):
        t0 = time.perf_counter()
        fn(i)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    return sorted(times)[len(times) // 2]


def measure(name, thunk):
    try:
        res[name] = thunk()
        print(f"{name} {res[name]:.2f} us", flush=True)
    except Exception as e:  # one missing peer must not hide the others
        print(f"{name}: failed: {type(e).__name__}: {e}", flush=True)


def hf_moe():
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

    cfg = Qwen3_5MoeTextConfig(hidden_size=2048, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                               shared_expert_intermediate_size=512)
    blocks = []
    for _ in range(4):  # 4 x 1.6 GB: each call's experts are out of L2
        blk = m.Qwen3_5MoeSparseMoeBlock(cfg).to(dev, torch.bfloat16).eval()
        with torch.no_grad():
            for p in blk.parameters():
                p.uniform_(-0.04, 0.04)
        blocks.append(blk)
    for t in (1, 4):
        xs = [torch.randn(1, t, 2048, device=dev, dtype=torch.bfloat16) for _ in blocks]

        def call(i):
            with torch.no_grad():
                return blocks[i % 4](xs[i % 4])
        measure(f"hf_moe_block_t{t}", lambda: wall_us(call))
        measure(f"hf_moe_block_t{t}_device", lambda: device_us(call, iters=20))
    del blocks
    torch.cuda.empty_cache()


def fla_gdn():
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    for b in (1, 16, 64):
        h, d = 32, 128
        sets = max(256 // b, 2)
        q = torch.randn(b, 1, h, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(b, 1, h, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn(b, 1, h, d, device=dev, dtype=torch.bfloat16)
        g = -torch.rand(b, 1, h, device=dev, dtype=torch.float32)
        beta = torch.rand(b, 1, h, device=dev, dtype=torch.bfloat16)
        states = [torch.randn(b, h, d, d, device=dev, dtype=torch.float32) for _ in range(sets)]

        def call(i):
            return fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=states[i % sets],
                                                    output_final_state=True, use_qk_l2norm_in_kernel=True)
        measure(f"fla_fused_recurrent_b{b}", lambda: device_us(call))
        measure(f"fla_fused_recurrent_b{b}_wall", lambda: wall_us(call))

        # Like for like with vt's step (decode_bench's peer): FLA's conv update (SiLU) over the q/k/v
        # channels of 16 key and 32 value heads, then its recurrent kernel with the gates and beta's
        # sigmoid fused, from the raw a and b as vt takes them.
        kh = 16
        ch = (2 * kh + h) * d
        x = torch.randn(b, ch, device=dev, dtype=torch.bfloat16)
        conv_w = torch.randn(ch, 4, device=dev, dtype=torch.bfloat16)
        caches = [torch.zeros(b, ch, 4, device=dev, dtype=torch.bfloat16) for _ in range(sets)]
        a_raw = torch.randn(b, 1, h, device=dev, dtype=torch.bfloat16)
        b_raw = torch.randn(b, 1, h, device=dev, dtype=torch.bfloat16)
        a_log = torch.rand(h, device=dev)
        dt_bias = torch.rand(h, device=dev)

        def step(i):
            from fla.modules.causal_conv1d.ops import causal_conv1d_update  # inside: a failure is measure()'s

            y, _ = causal_conv1d_update(x, caches[i % sets], weight=conv_w, activation="silu")
            qq, kk, vv = torch.split(y, [kh * d, kh * d, h * d], dim=-1)
            return fused_recurrent_gated_delta_rule(
                qq.reshape(b, 1, kh, d), kk.reshape(b, 1, kh, d), vv.reshape(b, 1, h, d), g=a_raw, beta=b_raw,
                initial_state=states[i % sets], output_final_state=True, use_qk_l2norm_in_kernel=True,
                use_gate_in_kernel=True, A_log=a_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True)
        measure(f"fla_conv_recurrent_b{b}", lambda: device_us(step))


def linears():
    for n, k, t in ((248320, 2048, 1), (8192, 2048, 1), (8192, 2048, 8), (2048, 4096, 1)):
        copies = max(1, int(256e6 // (n * k * 2)) + 1)
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
        x = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
        measure(f"torch_linear_{n}x{k}_bf16_t{t}", lambda: device_us(lambda i: F.linear(x, ws[i % copies])))
        del ws


def argmax():
    # A greedy pick over Qwen3.5's vocabulary, read back to the host (decode_bench's argmax row).
    xs = [torch.randn(1, 248320, device=dev, dtype=torch.bfloat16) for _ in range(8)]
    measure("torch_argmax_1x248320_wall", lambda: wall_us(lambda i: torch.argmax(xs[i % 8], dim=-1).cpu()))


def sdpa():
    # (hq, hkv, d, keys): Qwen3.5-35B-A3B's full attention at 4000 keys, Laguna-XS.2's global
    # layers at 4000 and 32000 and its sliding ones at their 512-key window (decode_bench's cases).
    for hq, hkv, d, keys in ((16, 2, 256, 4000), (64, 8, 128, 4000), (64, 8, 128, 32000), (48, 8, 128, 512)):
        caches = [(torch.randn(1, hkv, keys, d, device=dev, dtype=torch.bfloat16),
                   torch.randn(1, hkv, keys, d, device=dev, dtype=torch.bfloat16)) for _ in range(8)]
        q = torch.randn(1, hq, 1, d, device=dev, dtype=torch.bfloat16)

        def call(i):
            kk, vv = caches[i % 8]
            return F.scaled_dot_product_attention(q, kk, vv, enable_gqa=True)
        measure(f"torch_sdpa_decode_{hq}x{hkv}x{d}_keys{keys}", lambda: device_us(call))


for part in (linears, argmax, sdpa, fla_gdn, hf_moe):
    try:
        part()
    except Exception as e:
        print(f"{part.__name__}: failed: {type(e).__name__}: {e}", flush=True)
with open(os.path.join(OUT, "peers.txt"), "w") as f:
    for k, v in res.items():
        f.write(f"{k} {v}\n")
