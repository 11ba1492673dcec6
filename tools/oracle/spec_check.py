#!/usr/bin/env python3
"""Independent re-implementation of the three families, written from NOTES.md only (no
transformers import): reads a fixture's config.json + safetensors, runs one float32 forward over
prompt_ids ++ greedy_ids[:-1] and compares with reference.safetensors.

It exists to check that NOTES.md describes what transformers computes; it is also a compact
readable spec. GDN uses the token-by-token recurrence (not the chunked form).

    python tools/oracle/spec_check.py fixtures/*
"""

import json
import math
import os
import sys

import torch
import torch.nn.functional as F
from safetensors import safe_open

torch.set_num_threads(1)


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def nvfp4(packed, scale, multiplier):
    """NVFP4 from its definition: byte j of a row holds elements 2j (low nibble) and 2j+1 (high
    nibble), bit 3 of a nibble is the sign; one fp8 e4m3 scale per 16 elements; one f32 multiplier."""
    codes = torch.stack([packed & 15, packed >> 4], -1).flatten(-2).long()
    return E2M1[codes] * scale.float().repeat_interleave(16, -1) * multiplier.float()


def load_weights(d):
    idx = os.path.join(d, "model.safetensors.index.json")
    files = sorted(set(json.load(open(idx))["weight_map"].values())) if os.path.exists(idx) else ["model.safetensors"]
    raw = {}
    for f in files:
        with safe_open(os.path.join(d, f), "pt") as fh:
            for k in fh.keys():
                raw[k] = fh.get_tensor(k)
    w = {k: v.float() for k, v in raw.items()}
    # NVFP4 modules: compressed-tensors (weight_packed, global scale a divisor) or ModelOpt (u8
    # weight, weight_scale_2 a multiplier).
    for k, v in raw.items():
        if k.endswith(".weight_packed"):
            m = k[: -len(".weight_packed")]
            w[m + ".weight"] = nvfp4(v, raw[m + ".weight_scale"], 1.0 / raw[m + ".weight_global_scale"])
        elif k.endswith(".weight_scale_2"):
            m = k[: -len(".weight_scale_2")]
            w[m + ".weight"] = nvfp4(raw[m + ".weight"], raw[m + ".weight_scale"], raw[k])
    return w


def rms(x, w, eps, centered=False):
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x * ((1.0 + w) if centered else w)


def rope_tables(inv_freq, T, scale=1.0):
    pos = torch.arange(T, dtype=torch.float32)
    f = pos[:, None] * inv_freq[None, :]
    emb = torch.cat([f, f], -1)
    return emb.cos() * scale, emb.sin() * scale


def apply_rope(x, cos, sin):  # x [H, T, D]; rotates the first cos.shape[-1] dims, NeoX halves
    r = cos.shape[-1]
    xr, xp = x[..., :r], x[..., r:]
    x1, x2 = xr[..., : r // 2], xr[..., r // 2:]
    rot = torch.cat([-x2, x1], -1)
    return torch.cat([xr * cos + rot * sin, xp], -1)


def attention(q, k, v, window=None):  # q [Hq,T,D], k/v [Hkv,T,D]
    Hq, T, D = q.shape
    rep = Hq // k.shape[0]
    k = k.repeat_interleave(rep, 0)  # query head h uses kv head h // rep
    v = v.repeat_interleave(rep, 0)
    s = q @ k.transpose(1, 2) / math.sqrt(D)
    i = torch.arange(T)[:, None]
    j = torch.arange(T)[None, :]
    ok = j <= i
    if window is not None:
        ok = ok & (j > i - window)  # exactly `window` keys visible, the query's own included
    s = s.masked_fill(~ok, float("-inf"))
    return torch.softmax(s, -1) @ v  # [Hq,T,D]


def swiglu(x, g, u, dn):
    return (F.silu(x @ g.T) * (x @ u.T)) @ dn.T


def experts_of(w, p, E):
    """Return per-expert (gate [I,H], up [I,H], down [H,I]) from either naming."""
    if p + "experts.gate_up_proj" in w:
        gu, dn = w[p + "experts.gate_up_proj"], w[p + "experts.down_proj"]
        I = gu.shape[1] // 2
        return [(gu[e, :I], gu[e, I:], dn[e]) for e in range(E)]  # first half = gate
    return [(w[f"{p}experts.{e}.gate_proj.weight"], w[f"{p}experts.{e}.up_proj.weight"],
             w[f"{p}experts.{e}.down_proj.weight"]) for e in range(E)]


def moe(x, weights, idx, experts):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            g, u, dn = experts[int(idx[t, j])]
            out[t] += weights[t, j] * swiglu(x[t:t + 1], g, u, dn)[0]
    return out


# ---------------------------------------------------------------- Qwen3.5-MoE
def qwen35(cfg, w, ids):
    if "text_config" in cfg:
        c, pre = cfg["text_config"], "model.language_model."
    else:
        c, pre = cfg, "model."
    H, eps = c["hidden_size"], c["rms_norm_eps"]
    lt = c.get("layer_types") or ["linear_attention" if (i + 1) % c.get("full_attention_interval", 4) else
                                  "full_attention" for i in range(c["num_hidden_layers"])]
    T = len(ids)
    x = w[pre + "embed_tokens.weight"][ids]
    rp = c["rope_parameters"]
    hd = c["head_dim"]
    rdim = int(hd * rp.get("partial_rotary_factor", 0.25))
    inv = 1.0 / (rp["rope_theta"] ** (torch.arange(0, rdim, 2, dtype=torch.float32) / rdim))
    cos, sin = rope_tables(inv, T)
    nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    E, K = c["num_experts"], c["num_experts_per_tok"]
    for i, kind in enumerate(lt):
        p = f"{pre}layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"], eps, centered=True)
        if kind == "linear_attention":
            a = p + "linear_attn."
            qkv = h @ w[a + "in_proj_qkv.weight"].T  # [T, 2*nk*dk + nv*dv]
            z = (h @ w[a + "in_proj_z.weight"].T).view(T, nv, dv)
            b = h @ w[a + "in_proj_b.weight"].T
            al = h @ w[a + "in_proj_a.weight"].T
            cw = w[a + "conv1d.weight"][:, 0, :]  # [C, Kc]
            Kc = cw.shape[1]
            xp = torch.cat([torch.zeros(Kc - 1, qkv.shape[1]), qkv], 0)
            conv = sum(xp[j:j + T] * cw[:, j] for j in range(Kc))  # causal depthwise conv
            conv = F.silu(conv)
            q, k, v = conv.split([nk * dk, nk * dk, nv * dv], -1)
            q, k, v = q.view(T, nk, dk), k.view(T, nk, dk), v.view(T, nv, dv)
            rep = nv // nk
            q = q.repeat_interleave(rep, 1)  # value head j uses key head j // rep
            k = k.repeat_interleave(rep, 1)
            q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
            k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
            q = q / math.sqrt(dk)
            beta = torch.sigmoid(b)  # [T, nv]
            g = -w[a + "A_log"].exp() * F.softplus(al + w[a + "dt_bias"])  # [T, nv]
            S = torch.zeros(nv, dk, dv)
            o = torch.zeros(T, nv, dv)
            for t in range(T):
                S = S * g[t].exp()[:, None, None]
                kv = (S * k[t][:, :, None]).sum(1)  # [nv, dv]  = k^T S
                delta = (v[t] - kv) * beta[t][:, None]
                S = S + k[t][:, :, None] * delta[:, None, :]
                o[t] = (S * q[t][:, :, None]).sum(1)
            o = rms(o, w[a + "norm.weight"], eps) * F.silu(z)  # gated norm, plain weight
            out = o.reshape(T, nv * dv) @ w[a + "out_proj.weight"].T
        else:
            a = p + "self_attn."
            nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
            qg = (h @ w[a + "q_proj.weight"].T).view(T, nh, 2 * hd)
            q, gate = qg[..., :hd], qg[..., hd:]  # per head: [q_h | gate_h]
            k = (h @ w[a + "k_proj.weight"].T).view(T, nkv, hd)
            v = (h @ w[a + "v_proj.weight"].T).view(T, nkv, hd)
            q = rms(q, w[a + "q_norm.weight"], eps, centered=True).transpose(0, 1)
            k = rms(k, w[a + "k_norm.weight"], eps, centered=True).transpose(0, 1)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            o = attention(q, k, v.transpose(0, 1)).transpose(0, 1).reshape(T, nh * hd)
            o = o * torch.sigmoid(gate.reshape(T, nh * hd))
            out = o @ w[a + "o_proj.weight"].T
        x = x + out
        h = rms(x, w[p + "post_attention_layernorm.weight"], eps, centered=True)
        m = p + "mlp."
        probs = torch.softmax(h @ w[m + "gate.weight"].T, -1)
        tv, ti = probs.topk(K, -1)
        tv = tv / tv.sum(-1, keepdim=True)
        y = moe(h, tv, ti, experts_of(w, m, E))
        sh = swiglu(h, w[m + "shared_expert.gate_proj.weight"], w[m + "shared_expert.up_proj.weight"],
                    w[m + "shared_expert.down_proj.weight"])
        y = y + torch.sigmoid(h @ w[m + "shared_expert_gate.weight"].T) * sh
        x = x + y
    x = rms(x, w[pre + "norm.weight"], eps, centered=True)
    lm = w.get("lm_head.weight", w[pre + "embed_tokens.weight"])
    return x @ lm.T


# ---------------------------------------------------------------- Laguna
def yarn_inv_freq(p, hd):
    dim = int(hd * p.get("partial_rotary_factor", 1.0))
    base = p["rope_theta"]
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if p["rope_type"] == "default":
        return 1.0 / pos_freqs, 1.0
    factor = p["factor"]
    att = p.get("attention_factor")
    if att is None:
        att = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    bf, bs = p.get("beta_fast") or 32, p.get("beta_slow") or 1
    omax = p["original_max_position_embeddings"]

    def cdim(rot):
        return dim * math.log(omax / (rot * 2 * math.pi)) / (2 * math.log(base))
    low, high = max(math.floor(cdim(bf)), 0), min(math.ceil(cdim(bs)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extra = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
    return inv, att


def laguna(c, w, ids):
    H, eps, hd, T = c["hidden_size"], c["rms_norm_eps"], c["head_dim"], len(ids)
    x = w["model.embed_tokens.weight"][ids]
    tabs = {}
    for lt, p in c["rope_parameters"].items():
        inv, sc = yarn_inv_freq(p, hd)
        tabs[lt] = rope_tables(inv, T, sc)
    E, K = c["num_experts"], c["num_experts_per_tok"]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        nh, nkv = c["num_attention_heads_per_layer"][i], c["num_key_value_heads"]
        lt = c["layer_types"][i]
        h = rms(x, w[p + "input_layernorm.weight"], eps)
        q = (h @ w[a + "q_proj.weight"].T).view(T, nh, hd)
        k = (h @ w[a + "k_proj.weight"].T).view(T, nkv, hd)
        v = (h @ w[a + "v_proj.weight"].T).view(T, nkv, hd)
        q = rms(q, w[a + "q_norm.weight"], eps).transpose(0, 1)
        k = rms(k, w[a + "k_norm.weight"], eps).transpose(0, 1)
        cos, sin = tabs[lt]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        win = c["sliding_window"] if lt == "sliding_attention" else None
        o = attention(q, k, v.transpose(0, 1), win).transpose(0, 1)  # [T, nh, hd]
        gate = F.softplus(h @ w[a + "g_proj.weight"].T)
        if c["gating"] is True or c["gating"] == "per-head":
            o = o * gate[:, :, None]  # g_proj [nh, H]
        else:
            o = o * gate.view(T, nh, hd)  # g_proj [nh*hd, H]
        x = x + o.reshape(T, nh * hd) @ w[a + "o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"], eps)
        m = p + "mlp."
        if c["mlp_layer_types"][i] == "dense":
            y = swiglu(h, w[m + "gate_proj.weight"], w[m + "up_proj.weight"], w[m + "down_proj.weight"])
        else:
            logits = h @ w[m + "gate.weight"].T
            cap = c["moe_router_logit_softcapping"]
            if cap > 0:
                logits = torch.tanh(logits / cap) * cap
            s = torch.sigmoid(logits)
            bias = w.get(m + "gate.e_score_correction_bias", w.get(m + "experts.e_score_correction_bias"))
            _, ti = (s + bias).topk(K, -1)  # bias only for selection
            tv = s.gather(-1, ti)
            tv = tv / tv.sum(-1, keepdim=True)
            y = moe(h, tv, ti, experts_of(w, m, E)) * c["moe_routed_scaling_factor"]
            sp = m + ("shared_experts." if m + "shared_experts.gate_proj.weight" in w else "shared_expert.")
            y = y + swiglu(h, w[sp + "gate_proj.weight"], w[sp + "up_proj.weight"], w[sp + "down_proj.weight"])
        x = x + y
    x = rms(x, w["model.norm.weight"], eps)
    return x @ w.get("lm_head.weight", w["model.embed_tokens.weight"]).T


# ---------------------------------------------------------------- Qwen3-MoE
def qwen3moe(c, w, ids):
    eps, T = c["rms_norm_eps"], len(ids)
    hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    x = w["model.embed_tokens.weight"][ids]
    inv, _ = yarn_inv_freq(c["rope_parameters"], hd)
    cos, sin = rope_tables(inv, T)
    # transformers 5 serialises Qwen3MoeConfig.num_experts as "num_local_experts" (attribute_map);
    # real checkpoints say "num_experts".
    E, K = c.get("num_experts", c.get("num_local_experts")), c["num_experts_per_tok"]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
        h = rms(x, w[p + "input_layernorm.weight"], eps)
        q = rms((h @ w[a + "q_proj.weight"].T).view(T, nh, hd), w[a + "q_norm.weight"], eps).transpose(0, 1)
        k = rms((h @ w[a + "k_proj.weight"].T).view(T, nkv, hd), w[a + "k_norm.weight"], eps).transpose(0, 1)
        v = (h @ w[a + "v_proj.weight"].T).view(T, nkv, hd).transpose(0, 1)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        x = x + attention(q, k, v).transpose(0, 1).reshape(T, nh * hd) @ w[a + "o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"], eps)
        m = p + "mlp."
        sparse = i not in c.get("mlp_only_layers", []) and E > 0 and (i + 1) % c["decoder_sparse_step"] == 0
        if sparse:
            probs = torch.softmax(h @ w[m + "gate.weight"].T, -1)
            tv, ti = probs.topk(K, -1)
            if c["norm_topk_prob"]:
                tv = tv / tv.sum(-1, keepdim=True)
            y = moe(h, tv, ti, experts_of(w, m, E))
        else:
            y = swiglu(h, w[m + "gate_proj.weight"], w[m + "up_proj.weight"], w[m + "down_proj.weight"])
        x = x + y
    x = rms(x, w["model.norm.weight"], eps)
    return x @ w.get("lm_head.weight", w["model.embed_tokens.weight"]).T


def check(d):
    cfg = json.load(open(os.path.join(d, "config.json")))
    w = load_weights(d)
    with safe_open(os.path.join(d, "reference.safetensors"), "pt") as fh:
        ref = {k: fh.get_tensor(k) for k in fh.keys()}
    ids = torch.cat([ref["prompt_ids"], ref["greedy_ids"][:-1]])
    mt = cfg["model_type"]
    with torch.no_grad():
        if mt.startswith("qwen3_5_moe"):
            out = qwen35(cfg, w, ids)
        elif mt == "laguna":
            out = laguna(cfg, w, ids)
        elif mt == "qwen3_moe":
            out = qwen3moe(cfg, w, ids)
        else:
            raise SystemExit(f"{d}: unknown model_type {mt}")
    T = len(ref["prompt_ids"])
    diff = float((out - ref["logits"]).abs().max())
    greedy_ok = torch.equal(out[T - 1:].argmax(-1), ref["greedy_ids"])
    print(f"{os.path.basename(d)}: max|dlogit|={diff:.2e} (max|logit|={float(ref['logits'].abs().max()):.2f}) "
          f"greedy {'ok' if greedy_ok else 'MISMATCH'}")
    return diff < 1e-3 and greedy_ok


if __name__ == "__main__":
    ok = all([check(d) for d in sys.argv[1:]])
    sys.exit(0 if ok else 1)
