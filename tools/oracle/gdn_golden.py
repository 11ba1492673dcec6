#!/usr/bin/env python3
"""Golden values for vt-cpu's Gated DeltaNet and causal-conv ops, computed by transformers' torch
fallbacks themselves (models/qwen3_5_moe/modeling_qwen3_5_moe.py):

  * torch_chunk_gated_delta_rule / torch_recurrent_gated_delta_rule, called as
    Qwen3_5MoeGatedDeltaNet.forward calls them (use_qk_l2norm_in_kernel=True, an initial state,
    output_final_state=True), with beta / g from the forward's gate math;
  * causal_conv1d_fn (prefill, no state) and causal_conv1d_update (with a state), activation silu.

    /opt/oracle-venv/bin/python tools/oracle/gdn_golden.py [--out crates/vt-cpu/tests/data/gdn_golden.json]

Layouts in the JSON are vt's (row-major, batch dropped): q, k [t, key_heads, key_dim];
v [t, value_heads, value_dim]; a, b [t, value_heads]; states [value_heads, key_dim, value_dim];
outputs [t, value_heads, value_dim]; conv x / out [t, channels] (time-major), w [channels, k],
conv state [channels, k-1]. Numbers are float32 values written with 9 significant digits
(round-trips exactly). Fixed seed, one CPU thread, float32 throughout.
"""

import argparse
import importlib.util
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m  # noqa: E402

# The decorators would swap in fla / causal-conv1d kernels if those packages were installed; the
# golden values must come from the torch fallbacks.
for pkg in ("fla", "causal_conv1d"):
    assert importlib.util.find_spec(pkg) is None, f"{pkg} is installed: not the torch fallback"


def flat(x: torch.Tensor) -> list:
    return [float(f"{v:.9g}") for v in x.detach().to(torch.float32).reshape(-1).tolist()]


def gdn_case(name, t, hk, hv, dk, dv, seed, big_a=()):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.rand(*shape, generator=gen) * 2 - 1) * scale

    # Round every input to its 9-digit JSON value first, so torch and Rust see identical inputs.
    def fix(x):
        return torch.tensor(flat(x), dtype=torch.float32).reshape(x.shape)

    q = fix(rnd(1, t, hk, dk, scale=1.5))
    k = fix(rnd(1, t, hk, dk, scale=1.5))
    v = fix(rnd(1, t, hv, dv, scale=2.0))
    a = rnd(1, t, hv, scale=3.0)
    for s, h, val in big_a:  # exercise softplus' linear branch (a + dt_bias > 20)
        a[0, s, h] = val
    a = fix(a)
    b = fix(rnd(1, t, hv, scale=3.0))
    # HF init: A ~ U(0.01, 16), A_log = log(A); dt_bias around 1.
    a_log = fix(torch.log(torch.rand(hv, generator=gen) * 15.99 + 0.01))
    dt_bias = fix(1.0 + rnd(hv, scale=0.5))
    state0 = fix(rnd(1, hv, dk, dv, scale=0.5))

    # Gate math, exactly as in Qwen3_5MoeGatedDeltaNet.forward.
    beta = b.sigmoid()
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)

    out = {
        "name": name,
        "dims": {"t": t, "key_heads": hk, "value_heads": hv, "key_dim": dk, "value_dim": dv},
        "q": flat(q), "k": flat(k), "v": flat(v), "a": flat(a), "b": flat(b),
        "a_log": flat(a_log), "dt_bias": flat(dt_bias), "initial_state": flat(state0),
        "g": flat(g), "beta": flat(beta),  # [t, value_heads], for checking the gate math alone
    }
    o, s = m.torch_chunk_gated_delta_rule(
        q, k, v, g=g, beta=beta, initial_state=state0.clone(), output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    out["chunk_out"], out["chunk_state"] = flat(o[0]), flat(s[0])
    o, s = m.torch_recurrent_gated_delta_rule(
        q, k, v, g=g, beta=beta, initial_state=state0.clone(), output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    out["recurrent_out"], out["recurrent_state"] = flat(o[0]), flat(s[0])
    return out


def conv_case(name, t, c, ksz, seed, with_state):
    gen = torch.Generator().manual_seed(seed)

    def fix(x):
        return torch.tensor(flat(x), dtype=torch.float32).reshape(x.shape)

    x = fix((torch.rand(1, c, t, generator=gen) * 2 - 1) * 2.0)  # HF layout [batch, channels, t]
    w = fix((torch.rand(c, ksz, generator=gen) * 2 - 1))  # conv1d.weight.squeeze(1)
    state0 = fix((torch.rand(1, c, ksz - 1, generator=gen) * 2 - 1) * 2.0)
    if with_state:
        state = state0.clone()
        y = m.causal_conv1d_update(x, state, w, None, "silu")
    else:
        state0 = torch.zeros_like(state0)
        y = m.causal_conv1d_fn(x, w, None, activation="silu")
        state = torch.cat([state0, x], dim=-1)[:, :, -(ksz - 1):]  # what a cache would keep
    return {
        "name": name, "t": t, "c": c, "k": ksz,
        "x": flat(x[0].T), "w": flat(w), "initial_state": flat(state0[0]),
        "out": flat(y[0].T), "state": flat(state[0]),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="crates/vt-cpu/tests/data/gdn_golden.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    doc = {
        "source": "tools/oracle/gdn_golden.py (transformers torch fallbacks, float32, CPU)",
        "gdn": [
            # One full chunk + a partial one; softplus threshold hit twice.
            gdn_case("t70_partial_chunk", t=70, hk=1, hv=2, dk=8, dv=4, seed=1,
                     big_a=[(5, 0, 30.0), (40, 1, 21.0)]),
            # Grouped heads (2 key heads -> 4 value heads), key_dim not a multiple of 8.
            gdn_case("t12_gqa", t=12, hk=2, hv=4, dk=12, dv=4, seed=2),
            # Single-token decode step.
            gdn_case("t1_decode", t=1, hk=2, hv=4, dk=12, dv=4, seed=3),
        ],
        "conv": [
            conv_case("prefill_t9", t=9, c=6, ksz=4, seed=4, with_state=False),
            conv_case("update_t1", t=1, c=6, ksz=4, seed=5, with_state=True),
            conv_case("update_t2", t=2, c=6, ksz=4, seed=6, with_state=True),
        ],
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes)")


if __name__ == "__main__":
    main()
