#!/usr/bin/env python3
"""Peers of vt's prefill kernels, measured on the GPU machine right after `prefill_bench OUT`
(crates/vt-cuda/examples/prefill_bench.rs), on the same shapes and the same MoE routing (the
bench leaves the MoE input and router weight in OUT): torch grouped_mm for the routed experts,
torch SDPA (flash backend) for causal attention (a sliding-window case has no peer: that backend
takes no window), flash-linear-attention's chunk_gated_delta_rule for the gated delta rule. Prints
vt's time beside its ceiling and the peer's, and writes OUT/peers.json.

usage: prefill_peers.py OUT   (fla-core importable, e.g. PYTHONPATH=/tmp/site)
"""
import json
import os
import sys
import time

import torch
import torch.nn.functional as F


def median_ms(fn, warmup=3, iters=20):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return sorted(times)[len(times) // 2]


def gpu_warm(seconds=0.5):
    """Keeps the GPU busy for about `seconds`, so that its clocks are up when an autotuning peer
    (flash-linear-attention's Triton kernels) times its candidate configurations on first call."""
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(8):
            x @ x
        torch.cuda.synchronize()


def best_of(fn, rounds=3, iters=10):
    """The least of `rounds` medians: a peer's time varies from process to process (FLA's took
    0.54 to 1.29 ms over this project's device calls); each round is printed to stderr."""
    meds = [median_ms(fn, iters=iters) for _ in range(rounds)]
    print(f"rounds (ms): {', '.join(f'{m:.3f}' for m in meds)}", file=sys.stderr)
    return min(meds)


def grouped_mm(a, w, offs):
    """a [slots, K] @ w[e]^T for each expert's rows; w [E, N, K] (row-major, as stored)."""
    gmm = getattr(F, "grouped_mm", None) or torch._grouped_mm
    return gmm(a, w.transpose(1, 2), offs=offs)


def moe_peers(out):
    t, h, inter, n_exp, top_k = 4096, 2048, 512, 256, 8
    dev = "cuda"
    x = torch.frombuffer(bytearray(open(os.path.join(out, "moe_x.bin"), "rb").read()), dtype=torch.bfloat16).view(t, h).to(dev)
    router = torch.frombuffer(bytearray(open(os.path.join(out, "moe_router.bin"), "rb").read()), dtype=torch.bfloat16)
    router = router.view(n_exp, h).to(dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    scale = h ** -0.5
    w_gu = (torch.rand(n_exp, 2 * inter, h, device=dev, generator=gen) * 2 - 1).mul_(scale).bfloat16()
    w_d = (torch.rand(n_exp, h, inter, device=dev, generator=gen) * 2 - 1).mul_(scale).bfloat16()

    def route():
        logits = x.float() @ router.float().t()
        w, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
        return w / w.sum(-1, keepdim=True), ids

    weights, ids = route()
    order = torch.argsort(ids.flatten(), stable=True)
    tok = (order // top_k).to(torch.int64)
    offs = torch.cumsum(torch.bincount(ids.flatten(), minlength=n_exp), 0).to(torch.int32)

    def experts(tok, offs):
        g = grouped_mm(x[tok], w_gu, offs)
        return grouped_mm(F.silu(g[:, :inter]) * g[:, inter:], w_d, offs)

    def full():
        weights, ids = route()
        order = torch.argsort(ids.flatten(), stable=True)
        offs = torch.cumsum(torch.bincount(ids.flatten(), minlength=n_exp), 0).to(torch.int32)
        tok = order // top_k
        y = experts(tok, offs) * weights.flatten()[order].unsqueeze(1).bfloat16()
        return torch.zeros(t, h, device=dev, dtype=torch.bfloat16).index_add_(0, tok, y)

    return {
        "torch grouped_mm experts (gather + gate_up + SwiGLU + down)": median_ms(lambda: experts(tok, offs)),
        "torch grouped_mm block (router + top-k + sort + experts + combine)": median_ms(full),
    }


def attention_case(name):
    """(t, hq, hkv, d, window or None) of a prefill_bench attention case name."""
    field = dict(part.split("=") for part in name.split()[1:] if "=" in part)
    window = int(field["window"]) if "window" in field else None
    return int(field["t"]), int(field["hq"]), int(field["hkv"]), int(field["d"]), window


def attention_peer(name):
    t, hq, hkv, d, window = attention_case(name)
    if window is not None:
        return {}  # SDPA's flash backend has no sliding window, and a mask would leave it
    q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16).transpose(0, 1).unsqueeze(0)
    k = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16).transpose(0, 1).unsqueeze(0)
    v = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16).transpose(0, 1).unsqueeze(0)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        try:
            ms = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
            how = "GQA"
        except RuntimeError:
            k, v = (z.repeat_interleave(hq // hkv, dim=1) for z in (k, v))
            ms = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
            how = f"k/v repeated to {hq} heads"
    return {f"torch SDPA flash ({how})": ms}


def gdn_peer():
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    t, kh, vh, d = 8192, 16, 32, 128
    dev = "cuda"
    q = torch.rand(1, t, kh, d, device=dev).mul(2).sub(1).bfloat16()
    k = torch.rand(1, t, kh, d, device=dev).mul(2).sub(1).bfloat16()
    v = torch.rand(1, t, vh, d, device=dev).mul(2).sub(1).bfloat16()
    a = torch.rand(1, t, vh, device=dev).mul(4).sub(2).bfloat16()
    b = torch.rand(1, t, vh, device=dev).mul(4).sub(2).bfloat16()
    a_log = torch.rand(vh, device=dev).mul(2).sub(1)
    dt_bias = torch.rand(vh, device=dev).mul(2).sub(1)
    state = torch.zeros(1, vh, d, d, device=dev)

    def fused():  # gates, sigmoid and l2norm inside FLA's kernels, as vt does inside its own
        return chunk_gated_delta_rule(q, k, v, a, b, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                      use_gate_in_kernel=True, A_log=a_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True)

    # Both of FLA's forms: vt's target is the faster of them, though the plain one leaves the gates
    # (computed here, outside the timed call) out of its time.
    g = -a_log.exp() * F.softplus(a.float() + dt_bias)
    beta = torch.sigmoid(b.float()).bfloat16()

    def plain():
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)

    gpu_warm()
    times = {"fla chunk_gated_delta_rule (gates precomputed, untimed)": best_of(plain)}
    try:
        times["fla chunk_gated_delta_rule (gates fused)"] = best_of(fused)
    except Exception as e:  # older FLA: no fused gates
        print(f"fla fused gates unavailable ({e})", file=sys.stderr)
    return times


def main():
    out = sys.argv[1]
    rows = [json.loads(l) for l in open(os.path.join(out, "vt.json")) if l.strip()]
    peers = {}
    for row in rows:
        name = row["name"]
        try:
            if name.startswith("moe"):
                peers[name] = moe_peers(out)
            elif name.startswith("attention"):
                peers[name] = attention_peer(name)
            elif name.startswith("gdn"):
                peers[name] = gdn_peer()
        except Exception as e:
            print(f"peer for {name} failed: {e!r}", file=sys.stderr)
        torch.cuda.empty_cache()
    json.dump(peers, open(os.path.join(out, "peers.json"), "w"), indent=1)
    print(f"ceilings from copy {rows[0]['copy_tb_s']:.2f} TB/s and bf16 GEMM {rows[0]['gemm_tflop_s']:.0f} TFLOP/s (same process)")
    print(f"{'case':<48} {'vt ms':>8} {'ceil ms':>8} {'ceil/vt':>8}   peer (ms, peer/vt: >1 = vt faster)")
    for row in rows:
        ms, ceil = row["ms"], row["ceiling_ms"]
        tflops = row["flops"] / ms / 1e9
        print(f"{row['name']:<48} {ms:8.3f} {ceil:8.3f} {ceil / ms:8.2f}   ({tflops:.0f} TFLOP/s)")
        for peer, pms in peers.get(row["name"], {}).items():
            print(f"    {peer:<72} {pms:8.3f} ms  peer/vt = {pms / ms:.2f}")


if __name__ == "__main__":
    main()
