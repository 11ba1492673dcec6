#!/usr/bin/env python3
"""Oracle fixture generator for vt.

Builds tiny random-init checkpoints of the model families vt serves, saves them exactly as
Hugging Face checkpoints look (config.json + bf16 safetensors), reloads them in float32 and
writes a float32 reference (prompt, greedy continuation, full-forward logits).

    python tools/oracle/make_fixtures.py [--only NAME ...] --out fixtures

Everything is seeded; the torch fallback paths are used (no fla / causal-conv1d / kernels);
attention is "eager"; one CPU thread.
"""

import argparse
import importlib.util
import json
import math
import os
import shutil
import sys
import time

# Must be set before torch initialises its RNG / BLAS.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import transformers  # noqa: E402
import mtp as mtp_oracle  # noqa: E402  (tools/oracle/mtp.py)
import nvfp4  # noqa: E402  (tools/oracle/nvfp4.py)
import fp8  # noqa: E402  (tools/oracle/fp8.py)
from transformers.utils import logging as hf_logging  # noqa: E402

hf_logging.set_verbosity_error()
try:  # the "Writing model shards" progress bar
    hf_logging.disable_progress_bar()
except Exception:  # pragma: no cover
    pass

# The fast paths must not be importable: we want the pure-torch reference implementations
# (torch_chunk_gated_delta_rule / torch_recurrent_gated_delta_rule / F.conv1d causal conv).
for _pkg in ("fla", "causal_conv1d", "kernels"):
    if importlib.util.find_spec(_pkg) is not None:
        sys.exit(f"package {_pkg!r} is installed; uninstall it so the torch fallback paths are used")

torch.use_deterministic_algorithms(True)
torch.set_num_threads(1)
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

DEVICE = "cpu"


# --------------------------------------------------------------------------------------------
# random init
# --------------------------------------------------------------------------------------------

ZERO_CENTERED_NORMS = {"Qwen3_5MoeRMSNorm"}  # y = x_hat * (1 + w)


def randomize(model, seed, *, lm_std=None, emb_std=0.5, router_gain=2.0, extra=None):
    """Give every parameter a non-trivial deterministic value (float32 model)."""
    g = torch.Generator().manual_seed(seed)

    def normal(shape, std, mean=0.0):
        return torch.randn(shape, generator=g, dtype=torch.float32) * std + mean

    norm_params = {}
    for mname, mod in model.named_modules():
        cls = type(mod).__name__
        if "Norm" in cls:
            for pname, _ in mod.named_parameters(recurse=False):
                full = f"{mname}.{pname}" if mname else pname
                norm_params[full] = (cls, pname)

    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = p.shape
            if name in norm_params:
                cls, pname = norm_params[name]
                if pname == "bias":
                    v = normal(shape, 0.05)
                elif cls in ZERO_CENTERED_NORMS:
                    v = normal(shape, 0.1)
                else:
                    v = normal(shape, 0.1, 1.0)
            elif name.endswith("A_log"):
                v = torch.log(torch.rand(shape, generator=g) * 0.98 + 0.02)  # A in [0.02, 1.0]
            elif name.endswith("dt_bias"):
                v = normal(shape, 0.5)
            elif name.endswith("conv1d.weight"):
                v = normal(shape, 0.4)
            elif name.endswith("embed_tokens.weight"):
                v = normal(shape, emb_std)
            elif name.endswith("lm_head.weight"):
                v = normal(shape, lm_std if lm_std is not None else 1.0 / math.sqrt(shape[-1]))
            elif "e_score_correction_bias" in name:
                v = normal(shape, 0.5)
            elif name.endswith("mlp.gate.weight") or name.endswith("router.weight"):
                v = normal(shape, router_gain / math.sqrt(shape[-1]))
            elif p.dim() >= 2:
                fan_in = shape[-1] if p.dim() in (2, 3) else int(np.prod(shape[1:]))
                v = normal(shape, 1.0 / math.sqrt(fan_in))
            else:  # biases and other vectors
                v = normal(shape, 0.1)
            if extra is not None:
                v = extra(name, v, normal)
            p.copy_(v)


# --------------------------------------------------------------------------------------------
# checkpoint IO helpers
# --------------------------------------------------------------------------------------------

def st_files(d):
    refs = ("reference.safetensors", MTP_REFERENCE)
    return sorted(f for f in os.listdir(d) if f.endswith(".safetensors") and f not in refs)


def read_all(d):
    out = {}
    for f in st_files(d):
        with safe_open(os.path.join(d, f), "pt") as fh:
            for k in fh.keys():
                out[k] = (fh.get_tensor(k), f)
    return out


def write_single(d, tensors):
    """Rewrite the checkpoint as one model.safetensors (removing whatever was there)."""
    for f in st_files(d):
        os.remove(os.path.join(d, f))
    idx = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(idx):
        os.remove(idx)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(d, "model.safetensors"),
              metadata={"format": "pt"})


def edit_config(d, fn):
    path = os.path.join(d, "config.json")
    with open(path) as fh:
        cfg = json.load(fh)
    fn(cfg)
    with open(path, "w") as fh:
        fh.write(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def dump_tensor_list(d):
    lines = []
    for f in st_files(d):
        with safe_open(os.path.join(d, f), "pt") as fh:
            for k in sorted(fh.keys()):
                sl = fh.get_slice(k)
                lines.append(f"{k}\t{sl.get_dtype()}\t{list(sl.get_shape())}\t{f}")
    lines.sort()
    with open(os.path.join(d, "tensors.txt"), "w") as fh:
        fh.write("\n".join(lines) + "\n")


# --------------------------------------------------------------------------------------------
# reference
# --------------------------------------------------------------------------------------------

@torch.no_grad()
def forward_logits(model, ids):
    out = model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=False)
    return out.logits[0].float()


@torch.no_grad()
def make_reference(model, vocab, T, N, seed, min_gap=2e-2, tries=40):
    """Pick a random prompt whose greedy continuation has no near ties (top-2 gap >= min_gap) and
    is not degenerate (at least N/2 distinct tokens); return the reference."""
    best, best_score = None, None
    for t in range(tries):
        g = torch.Generator().manual_seed(seed * 1000 + t)
        prompt = torch.randint(0, vocab, (T,), generator=g).tolist()
        ids = list(prompt)
        for _ in range(N):  # greedy argmax loop, one full forward (no cache) per token
            row = forward_logits(model, ids)[-1]
            ids.append(int(torch.argmax(row)))
        greedy = ids[T:]
        full = forward_logits(model, prompt + greedy[:-1])
        assert full.shape == (T + N - 1, vocab), full.shape
        am = torch.argmax(full[T - 1:], dim=-1).tolist()
        top2 = torch.topk(full[T - 1:], 2, dim=-1).values
        gap = float((top2[:, 0] - top2[:, 1]).min())
        if am != greedy:  # the long forward disagrees with the loop: a near tie, skip this prompt
            continue
        distinct = len(set(greedy))
        cand = dict(prompt=prompt, greedy=greedy, logits=full, min_gap=gap, tries=t + 1)
        score = (gap >= min_gap, distinct >= N // 2, gap)
        if best is None or score > best_score:
            best, best_score = cand, score
        if gap >= min_gap and distinct >= N // 2:
            break
    assert best is not None, "greedy loop never matched the full forward"
    return best


@torch.no_grad()
def cached_decode_check(model, ref, T, N):
    """HF's own cached path (GDN recurrent step / conv update / KV cache) must give the same greedy
    ids; returns max |logit difference| against the no-cache reference rows T-1..."""
    prompt = torch.tensor([ref["prompt"]], dtype=torch.long)
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=N, min_new_tokens=N,
                         do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    new = out.sequences[0, T:].tolist()
    assert new == ref["greedy"], (new, ref["greedy"])
    lg = torch.stack(out.logits, 1)[0].float()
    return float((lg - ref["logits"][T - 1:]).abs().max())


def finish(d, model, vocab, T, N, seed, layer_info, started):
    ref = make_reference(model, vocab, T, N, seed)
    cached_diff = cached_decode_check(model, ref, T, N)
    logits = ref["logits"].contiguous()
    save_file(
        {
            "prompt_ids": torch.tensor(ref["prompt"], dtype=torch.int64),
            "greedy_ids": torch.tensor(ref["greedy"], dtype=torch.int64),
            "logits": logits.to(torch.float32),
        },
        os.path.join(d, "reference.safetensors"),
        metadata={"format": "pt"},
    )
    dump_tensor_list(d)
    size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
    info = {
        "T": T,
        "N": N,
        "vocab_size": vocab,
        "layers": layer_info,
        "max_abs_logit": round(float(logits.abs().max()), 4),
        "logit_std": round(float(logits.std()), 4),
        "min_greedy_top2_gap": round(ref["min_gap"], 5),
        "greedy_ids": ref["greedy"],
        "prompt_tries": ref["tries"],
        "hf_cached_generate_max_abs_logit_diff": float(f"{cached_diff:.2e}"),
        "torch": torch.__version__.split("+")[0],
        "transformers": transformers.__version__,
    }
    with open(os.path.join(d, "info.json"), "w") as fh:
        fh.write(json.dumps(info, indent=2) + "\n")
    print(f"[{os.path.basename(d)}] T={T} N={N} max|logit|={info['max_abs_logit']} std={info['logit_std']} "
          f"min_gap={info['min_greedy_top2_gap']} tries={ref['tries']} size={size/1e3:.0f}kB "
          f"({time.time()-started:.1f}s)")
    return info


def check_loaded(model_cls, d, orig_sd, rename=lambda k: k):
    """Reload in float32 (eager), check every weight came back equal to the bf16-rounded original."""
    model, info = model_cls.from_pretrained(d, dtype=torch.float32, attn_implementation="eager",
                                            output_loading_info=True)
    model.eval()
    # keys the class is told to ignore (mtp.*) are not reported as unexpected
    for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info.get(k), (k, info[k])
    sd = model.state_dict()
    for k, v in orig_sd.items():
        k2 = rename(k)
        assert k2 in sd, f"{k2} missing after reload"
        ref = v.to(torch.bfloat16).to(torch.float32)
        assert torch.equal(sd[k2], ref), f"{k2} differs after reload"
    return model


def layer_list(types):
    return [f"{i}:{t}" for i, t in enumerate(types)]


# --------------------------------------------------------------------------------------------
# Qwen3.5-MoE
# --------------------------------------------------------------------------------------------

MTP_REFERENCE = "mtp_reference.safetensors"
MTP_DRAFTS = 4


def mtp_layer(text_config, seed):
    """A random MTP layer (tools/oracle/mtp.py) for a Qwen3.5-MoE fixture; its own seed, so the target's weights
    and reference do not depend on it."""
    return mtp_oracle.make(text_config, seed, randomize)


def finish_mtp(d, mtp, model, text_model, info):
    """Writes the MTP reference next to the fixture's: the target's hidden states over the fixture's
    prompt ++ greedy[:-1], the MTP's logits on every row, and a greedy chain of MTP_DRAFTS drafts that starts at
    the prompt's last row. `mtp` is rebuilt on the loaded (eager) config."""
    ref = mtp_oracle.Mtp(text_model.config).eval()
    ref.load_state_dict(mtp.state_dict())
    with safe_open(os.path.join(d, "reference.safetensors"), "pt") as fh:
        ids = fh.get_tensor("prompt_ids").tolist() + fh.get_tensor("greedy_ids").tolist()
    out, gap = mtp_oracle.reference(ref, text_model, model.lm_head, ids, info["T"] - 1, MTP_DRAFTS)
    save_file(out, os.path.join(d, MTP_REFERENCE), metadata={"format": "pt"})
    info["mtp"] = {"rows": len(ids) - 1, "draft_start": info["T"] - 1, "draft_ids": out["draft_ids"].tolist(),
                   "min_draft_top2_gap": round(gap, 5),
                   "reference": "tools/oracle/mtp.py (transformers has no MTP module for qwen3_5_moe)"}
    write_json(os.path.join(d, "info.json"), info)
    print(f"[{os.path.basename(d)}] MTP drafts {info['mtp']['draft_ids']} min_gap={info['mtp']['min_draft_top2_gap']}")
    return info

def qwen35moe_nested(d, seed=11):
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    t0 = time.time()
    T, N = 100, 16
    layer_types = ["linear_attention", "linear_attention", "full_attention", "linear_attention", "full_attention"]
    text = dict(
        vocab_size=384, hidden_size=72, num_hidden_layers=5, layer_types=layer_types,
        num_attention_heads=4, num_key_value_heads=2, head_dim=40,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=24, linear_value_head_dim=20,
        linear_conv_kernel_dim=4,
        num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40,
        rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 2, 1], "mrope_interleaved": True},
        bos_token_id=None, eos_token_id=383,
    )
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=48, patch_size=4, temporal_patch_size=2,
                  spatial_merge_size=2, out_hidden_size=72, num_position_embeddings=16)
    cfg = Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=True,
                           image_token_id=380, video_token_id=381, vision_start_token_id=378, vision_end_token_id=379)
    torch.manual_seed(seed)
    model = Qwen3_5MoeForConditionalGeneration(cfg).eval()
    # tied: the embedding is also the lm head; std 2/sqrt(H) gives logits std ~2
    randomize(model, seed, emb_std=2.0 / math.sqrt(72))
    orig_sd = {k: v.clone() for k, v in model.state_dict().items()}
    model.to(torch.bfloat16)
    # save_original_format=False keeps the stacked experts (gate_up_proj/down_proj) and the
    # model.language_model. prefix, which is what real Qwen3.5-MoE checkpoints contain.
    model.save_pretrained(d, save_original_format=False)
    tensors = {k: v for k, (v, _) in read_all(d).items()}
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in tensors, sorted(tensors)[:20]
    # The multi-token-prediction layer as real checkpoints carry it (stacked experts, like the target's).
    mtp = mtp_layer(cfg.text_config, seed + 1)
    tensors.update(mtp_oracle.checkpoint_tensors(mtp, stacked=True))
    write_single(d, tensors)
    edit_config(d, lambda c: c["text_config"].__setitem__("mtp_num_hidden_layers", 1))
    del model

    model = check_loaded(Qwen3_5MoeForConditionalGeneration, d, orig_sd)
    # sanity: the text-only path of the VLM equals the bare text model + lm_head
    ids = torch.arange(0, 70).unsqueeze(0) % 384
    with torch.no_grad():
        a = model(input_ids=ids, use_cache=False).logits
        h = model.model.language_model(input_ids=ids, use_cache=False).last_hidden_state
        b = model.lm_head(h)
    assert torch.allclose(a, b, atol=0, rtol=0), float((a - b).abs().max())
    info = finish(d, model, 384, T, N, seed, layer_list(layer_types), t0)
    return finish_mtp(d, mtp, model, model.model.language_model, info)


def qwen35moe_text(d, seed=12):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    t0 = time.time()
    T, N = 137, 12
    cfg = Qwen3_5MoeTextConfig(
        vocab_size=307, hidden_size=80, num_hidden_layers=4, full_attention_interval=2,
        num_attention_heads=6, num_key_value_heads=2, head_dim=36,
        linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=20, linear_value_head_dim=28,
        linear_conv_kernel_dim=4,
        num_experts=8, num_experts_per_tok=3, moe_intermediate_size=20, shared_expert_intermediate_size=28,
        rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5,
                         "mrope_section": [3, 3, 3], "mrope_interleaved": True},
        eos_token_id=306,
    )
    layer_types = list(cfg.layer_types)
    assert layer_types == ["linear_attention", "full_attention"] * 2, layer_types
    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(cfg).eval()
    randomize(model, seed, emb_std=1.0, lm_std=2.0 / math.sqrt(80))
    orig_sd = {k: v.clone() for k, v in model.state_dict().items()}
    model.to(torch.bfloat16)
    # default save_original_format=True reverts the qwen2_moe expert fusion -> per-expert names.
    total = sum(v.numel() * 2 for v in model.state_dict().values())
    model.save_pretrained(d, max_shard_size=f"{int(total / 2.5 / 1000)}KB")
    names = read_all(d)
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in names, sorted(names)[:20]
    assert "model.layers.0.mlp.experts.gate_up_proj" not in names
    nshards = len(st_files(d))
    assert 2 <= nshards <= 3, st_files(d)
    assert os.path.exists(os.path.join(d, "model.safetensors.index.json"))

    def use_interval(c):
        # real Qwen3-Next/3.5 style: the pattern instead of an explicit list
        del c["layer_types"]
        c["full_attention_interval"] = 2
        c["mtp_num_hidden_layers"] = 1
    edit_config(d, use_interval)
    # The MTP layer with per-expert names (as this checkpoint's experts), in a shard of its own.
    mtp = mtp_layer(cfg, seed + 1)
    mtp_tensors = mtp_oracle.checkpoint_tensors(mtp, stacked=False)
    save_file(mtp_tensors, os.path.join(d, "model-mtp.safetensors"), metadata={"format": "pt"})
    index_path = os.path.join(d, "model.safetensors.index.json")
    with open(index_path) as fh:
        index = json.load(fh)
    index["weight_map"].update({k: "model-mtp.safetensors" for k in mtp_tensors})
    write_json(index_path, index)
    del model
    model = check_loaded(Qwen3_5MoeForCausalLM, d, orig_sd)
    assert list(model.config.layer_types) == layer_types
    info = finish(d, model, 307, T, N, seed, layer_list(layer_types), t0)
    return finish_mtp(d, mtp, model, model.model, info)


def dims_model(seed):
    """qwen35moe_dims' model (random f32, seeded) and its layer types."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    layer_types = ["linear_attention", "full_attention"]
    cfg = Qwen3_5MoeTextConfig(
        vocab_size=320, hidden_size=64, num_hidden_layers=2, layer_types=layer_types,
        num_attention_heads=4, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
        rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        eos_token_id=319,
    )
    assert list(cfg.layer_types) == layer_types, cfg.layer_types
    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(cfg).eval()
    randomize(model, seed, emb_std=1.0, lm_std=2.0 / math.sqrt(64))
    return model, layer_types


# Seed 14: its greedy continuations repeat the speculative tests' periodic prompts, so prompt
# lookup drafts on it (crates/vt/tests/speculative.rs asks for drafts on every fixture; 13's drafted
# none).
def qwen35moe_dims(d, seed=14):
    """Qwen3.5-MoE at Qwen3.5-35B-A3B's head dimensions (delta-net keys and values of 128, attention
    heads of 256 with a quarter rotary, two value heads a key head, a shared expert as wide as the
    routed ones), tiny elsewhere: the shapes at which vt-cuda runs its own decode and prefill
    kernels (one-launch delta-net step, chunked delta rule, flash and split-key attention, fused
    MoE), where the other fixtures' odd sizes take its general kernels. Splits over 2 and 4 ranks;
    has an MTP layer, which then drafts at those shapes too."""
    from transformers import Qwen3_5MoeForCausalLM

    t0 = time.time()
    T, N = 100, 12
    model, layer_types = dims_model(seed)
    cfg = model.config
    orig_sd = {k: v.clone() for k, v in model.state_dict().items()}
    model.to(torch.bfloat16)
    model.save_pretrained(d)
    # The MTP layer (per-expert names, as this checkpoint's experts) in the one file.
    mtp = mtp_layer(cfg, seed + 1)
    tensors = {k: v for k, (v, _) in read_all(d).items()}
    write_single(d, {**tensors, **mtp_oracle.checkpoint_tensors(mtp, stacked=False)})
    edit_config(d, lambda c: c.__setitem__("mtp_num_hidden_layers", 1))
    del model
    model = check_loaded(Qwen3_5MoeForCausalLM, d, orig_sd)
    info = finish(d, model, 320, T, N, seed, layer_list(layer_types), t0)
    return finish_mtp(d, mtp, model, model.model, info)


# --------------------------------------------------------------------------------------------
# Laguna
# --------------------------------------------------------------------------------------------

def rope_info(model):
    re = model.model.rotary_emb
    out = {}
    for lt in sorted(set(model.config.layer_types)):
        out[lt] = {
            "rope_parameters": model.config.rope_parameters[lt],
            "inv_freq": [float(x) for x in getattr(re, f"{lt}_inv_freq")],
            "attention_scaling": float(getattr(re, f"{lt}_attention_scaling")),
        }
    return out


def _laguna(d, seed, T, N, cfg_kwargs, save_original_format, emb_std, lm_std):
    from transformers import LagunaConfig, LagunaForCausalLM

    t0 = time.time()
    cfg = LagunaConfig(**cfg_kwargs)
    torch.manual_seed(seed)
    model = LagunaForCausalLM(cfg).eval()
    randomize(model, seed, emb_std=emb_std, lm_std=lm_std)
    orig_sd = {k: v.clone() for k, v in model.state_dict().items()}
    model.to(torch.bfloat16)
    model.save_pretrained(d, save_original_format=save_original_format)
    del model
    model = check_loaded(LagunaForCausalLM, d, orig_sd)
    c = model.config
    layers = [f"{i}:{c.layer_types[i]}/{c.mlp_layer_types[i]}/heads={c.num_attention_heads_per_layer[i]}"
              for i in range(c.num_hidden_layers)]
    info = finish(d, model, c.vocab_size, T, N, seed, layers, t0)
    info["rope"] = rope_info(model)
    with open(os.path.join(d, "info.json"), "w") as fh:
        fh.write(json.dumps(info, indent=2) + "\n")
    return info


def laguna_a(d, seed=21):
    # Default save_pretrained (save_original_format=True) = the original checkpoint layout:
    # per-expert mlp.experts.{e}.*, mlp.shared_expert.*, mlp.experts.e_score_correction_bias.
    kw = dict(
        vocab_size=320, hidden_size=72, intermediate_size=88, num_hidden_layers=4,
        num_attention_heads=6, num_key_value_heads=2, head_dim=20,
        num_attention_heads_per_layer=[6, 4, 6, 2],
        layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
        sliding_window=24,
        mlp_layer_types=["dense", "sparse", "dense", "sparse"],
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=32,
        moe_routed_scaling_factor=1.5, moe_router_logit_softcapping=3.0,
        gating="per-head", rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=4096,
        rope_parameters={
            "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "partial_rotary_factor": 0.5,
                               "factor": 4.0, "original_max_position_embeddings": 32,
                               "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.15},
            "sliding_attention": {"rope_type": "default", "rope_theta": 20000.0, "partial_rotary_factor": 0.6},
        },
        eos_token_id=319,
    )
    info = _laguna(d, seed, 96, 16, kw, True, 1.0, 2.0 / math.sqrt(72))
    names = read_all(d)
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in names
    assert "model.layers.1.mlp.shared_expert.gate_proj.weight" in names
    assert "model.layers.1.mlp.experts.e_score_correction_bias" in names
    return info


def laguna_b(d, seed=22):
    # save_original_format=False = transformers' own module names: stacked experts
    # (mlp.experts.gate_up_proj / down_proj), mlp.shared_experts.*, mlp.gate.e_score_correction_bias.
    kw = dict(
        vocab_size=288, hidden_size=64, intermediate_size=76, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, head_dim=24,
        num_attention_heads_per_layer=[4, 8, 4],
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=17,
        mlp_layer_types=["sparse", "dense", "sparse"],
        num_experts=5, num_experts_per_tok=3, moe_intermediate_size=28, shared_expert_intermediate_size=20,
        moe_routed_scaling_factor=1.0, moe_router_logit_softcapping=0.0,
        gating="per-element", rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=4096,
        rope_parameters={
            "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "partial_rotary_factor": 0.5,
                               "factor": 2.0, "original_max_position_embeddings": 64},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
        },
        eos_token_id=1,
    )
    info = _laguna(d, seed, 83, 18, kw, False, 2.0 / math.sqrt(64), None)
    names = read_all(d)
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    assert "model.layers.0.mlp.shared_experts.gate_proj.weight" in names
    assert "model.layers.0.mlp.gate.e_score_correction_bias" in names
    assert "lm_head.weight" not in names
    return info


# --------------------------------------------------------------------------------------------
# Qwen3-MoE
# --------------------------------------------------------------------------------------------

def qwen3moe(d, seed=31):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    t0 = time.time()
    T, N = 90, 20
    cfg = Qwen3MoeConfig(
        vocab_size=280, hidden_size=64, intermediate_size=72, num_hidden_layers=6,
        num_attention_heads=6, num_key_value_heads=2, head_dim=24,
        decoder_sparse_step=2, mlp_only_layers=[5],
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=28, norm_topk_prob=True,
        rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        use_sliding_window=False, eos_token_id=279,
    )
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg).eval()
    randomize(model, seed, emb_std=1.0, lm_std=2.0 / math.sqrt(64))
    orig_sd = {k: v.clone() for k, v in model.state_dict().items()}
    model.to(torch.bfloat16)
    model.save_pretrained(d)  # original format: per-expert names, as real Qwen3-MoE checkpoints
    del model
    names = read_all(d)
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in names
    model = check_loaded(Qwen3MoeForCausalLM, d, orig_sd)
    c = model.config
    kinds = []
    for i in range(c.num_hidden_layers):
        sparse = (i not in c.mlp_only_layers) and (c.num_experts > 0 and (i + 1) % c.decoder_sparse_step == 0)
        kinds.append(f"{i}:full_attention/{'sparse' if sparse else 'dense'}")
    return finish(d, model, c.vocab_size, T, N, seed, kinds, t0)


# --------------------------------------------------------------------------------------------
# NVFP4 (compressed-tensors and ModelOpt encodings of the same codes and scales)
# --------------------------------------------------------------------------------------------

def _nvfp4(d, seed, model_cls, model, T, N, layer_info, targets, ignore, exclude, modelopt_in_config, t0, mtp=None):
    """Saves `model` (random f32) as a compressed-tensors NVFP4 checkpoint in `d` and its ModelOpt twin in
    `d + "_modelopt"`, with the MTP layer `mtp` (quantized by the same rules) where one is given. The
    references are transformers (f32) and tools/oracle/mtp.py on the f32 decompression of the codes."""
    scheme = nvfp4.ct_scheme(targets)
    vocab = model.config.vocab_size
    model.to(torch.bfloat16)
    model.save_pretrained(d)  # original format: per-expert names, what NVFP4 exporters write
    del model
    tensors = {k: v for k, (v, _) in read_all(d).items()}
    if mtp is not None:
        tensors.update(mtp_oracle.checkpoint_tensors(mtp, stacked=False))
    ct, dense = nvfp4.quantize_tensors(tensors, targets, ignore, scheme)
    modules = sorted(dense)
    # Gate and up of one expert keep their own global scales (vt must not assume one per pair); equal
    # ones only where both halves' bf16 maxima happen to coincide.
    pairs = [(m, m[: -len("gate_proj")] + "up_proj") for m in modules if m.endswith(".gate_proj") and ".experts." in m]
    differ = sum(not torch.equal(ct[f"{g}.weight_global_scale"], ct[f"{u}.weight_global_scale"]) for g, u in pairs)
    assert differ >= 0.8 * len(pairs), (differ, len(pairs))

    # The reference: transformers on a float32 checkpoint holding the decompressed weights.
    f32_dir = d + ".f32.tmp"
    shutil.rmtree(f32_dir, ignore_errors=True)
    shutil.copytree(d, f32_dir)
    decompressed = {**tensors, **{f"{m}.weight": w for m, w in dense.items()}}
    write_single(f32_dir, {k: v for k, v in decompressed.items() if not k.startswith("mtp.")})
    ref_model, info = model_cls.from_pretrained(f32_dir, dtype=torch.float32, attn_implementation="eager",
                                                output_loading_info=True)
    for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info.get(k), (k, info[k])
    ref_model.eval()
    shutil.rmtree(f32_dir)

    write_single(d, ct)
    edit_config(d, lambda c: c.__setitem__("quantization_config", nvfp4.ct_config(targets, ignore, scheme)))
    if mtp is not None:
        edit_config(d, lambda c: c.__setitem__("mtp_num_hidden_layers", 1))
    out = finish(d, ref_model, vocab, T, N, seed, layer_info, t0)
    if mtp is not None:
        out = finish_mtp(d, mtp_oracle.with_weights(mtp, decompressed), ref_model, ref_model.model, out)

    hf_note = check_hf_compressed_tensors_load(model_cls, d, ref_model, ct, dense)
    out["nvfp4"] = {
        "encoding": "compressed-tensors",
        "quantized_modules": len(modules),
        "experts_with_distinct_gate_up_global_scales": f"{differ}/{len(pairs)}",
        "reference": "transformers f32 on compressed-tensors' unpack + dequantize of the codes, kept in f32",
        "transformers_compressed_tensors_load": hf_note,
    }
    write_json(os.path.join(d, "info.json"), out)
    print(f"[{os.path.basename(d)}] {len(modules)} NVFP4 modules; transformers' own load: {hf_note}")

    # ModelOpt twin: same codes and scales, multiplier 1/g, exclude_modules instead of ignore/targets.
    mo = d + "_modelopt"
    shutil.rmtree(mo, ignore_errors=True)
    os.makedirs(mo)
    for f in ("config.json", "generation_config.json", "reference.safetensors", MTP_REFERENCE):
        if os.path.exists(os.path.join(d, f)):
            shutil.copy(os.path.join(d, f), mo)
    all_linear = [k[: -len(".weight")] for k, v in tensors.items()
                  if k.endswith(".weight") and v.dim() == 2 and "embed_tokens" not in k]
    nvfp4.check_modelopt_exclude(modules, all_linear, exclude)
    write_single(mo, nvfp4.to_modelopt(ct, modules))
    section = nvfp4.modelopt_quant_config(exclude)
    if modelopt_in_config:  # newer exports: config.json's quantization_config, `ignore` for the list
        qc = {"quant_method": "modelopt", "quant_algo": section["quant_algo"], "group_size": section["group_size"],
              "ignore": exclude, "kv_cache_scheme": None, "producer": {"name": "modelopt"}}
        edit_config(mo, lambda c: c.__setitem__("quantization_config", qc))
    else:  # hf_quant_config.json only
        edit_config(mo, lambda c: c.pop("quantization_config"))
        write_json(os.path.join(mo, "hf_quant_config.json"), {"producer": {"name": "modelopt"}, "quantization": section})
    dump_tensor_list(mo)
    mo_info = dict(out)
    mo_info["nvfp4"] = {"encoding": "modelopt", "quantized_modules": len(modules),
                        "note": f"same codes and scales as {os.path.basename(d)} (weight_scale_2 = 1/weight_global_scale "
                                "in f32); reference copied from it"}
    write_json(os.path.join(mo, "info.json"), mo_info)
    return out


# --------------------------------------------------------------------------------------------
# FP8 (block-scaled e4m3, transformers' FineGrainedFP8 format as Qwen publishes it)
# --------------------------------------------------------------------------------------------

def qwen35moe_fp8(d, seed=51):
    """Qwen's FP8 layout: every linear but lm_head, the router, the shared-expert gate and GDN's
    in_proj_a/b in e4m3 with [32, 32] block scales. The experts' intermediate size 48 gives partial
    blocks in both dimensions (gate/up rows, down inputs); hidden 64 and the attention widths whole ones.
    The reference is transformers (f32) on transformers' own dequantization of the stored values."""
    from transformers import Qwen3_5MoeForCausalLM

    t0 = time.time()
    block = (32, 32)
    model, layer_types = tiny_quantized_qwen35moe(seed, moe_intermediate=48)
    # Qwen's lists name every module in full; a suffix and a regex entry exercise transformers' other rules.
    skip = ["lm_head", "model.embed_tokens", "mlp.shared_expert_gate", r"model\.layers\.\d+\.mlp\.gate"]
    skip += [f"model.layers.{i}.linear_attn.in_proj_{x}" for i, t in enumerate(layer_types) if t == "linear_attention"
             for x in "ab"]
    vocab = model.config.vocab_size
    model.to(torch.bfloat16)
    model.save_pretrained(d)  # per-expert names, as Qwen's FP8 checkpoints store experts
    del model
    tensors = {k: v for k, (v, _) in read_all(d).items()}
    q, dense, partial = fp8.quantize_tensors(tensors, skip, block)
    modules = sorted(dense)
    assert any(".experts." in m for m in partial) and any(m.endswith("down_proj") for m in partial), partial

    f32_dir = d + ".f32.tmp"
    shutil.rmtree(f32_dir, ignore_errors=True)
    shutil.copytree(d, f32_dir)
    write_single(f32_dir, {**tensors, **{f"{m}.weight": w for m, w in dense.items()}})
    ref_model, info = Qwen3_5MoeForCausalLM.from_pretrained(f32_dir, dtype=torch.float32, attn_implementation="eager",
                                                            output_loading_info=True)
    for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info.get(k), (k, info[k])
    ref_model.eval()
    shutil.rmtree(f32_dir)

    write_single(d, q)
    edit_config(d, lambda c: c.__setitem__("quantization_config", fp8.config(skip, block)))
    out = finish(d, ref_model, vocab, T=64, N=12, seed=seed, layer_info=layer_list(layer_types), started=t0)
    hf_note = check_hf_fp8_load(d, ref_model, dense, partial)
    out["fp8"] = {
        "weight_block_size": list(block),
        "quantized_modules": len(modules),
        "modules_with_partial_blocks": len(partial),
        "reference": "transformers f32 on _dequantize_fp8_weight of the stored e4m3 values and f32 scales",
        "transformers_fp8_load_on_cpu": hf_note,
    }
    write_json(os.path.join(d, "info.json"), out)
    print(f"[{os.path.basename(d)}] {len(modules)} FP8 modules ({len(partial)} with partial blocks); "
          f"transformers' own load: {hf_note}")
    return out


def check_hf_fp8_load(d, ref_model, dense, partial):
    """transformers' own load of the FP8 checkpoint on CPU: with no GPU the FineGrainedFP8 quantizer switches to
    `dequantize=True` and `Fp8Dequantize` expands each weight in float32. It derives the block size from the
    scale grid (rows // scale_rows), which is right only when every dimension is a multiple of the block: the
    whole-block modules must come back equal to the reference's, the partial-block ones differ."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    ref_sd, hf_sd = ref_model.state_dict(), hf.state_dict()
    assert set(ref_sd) == set(hf_sd), sorted(set(ref_sd) ^ set(hf_sd))
    differ = sorted(k for k in ref_sd if not torch.equal(ref_sd[k], hf_sd[k]))
    partial_keys = {k for k in differ if any(k.startswith(m.split(".experts.")[0] + ".experts.") or k.startswith(m + ".")
                                             for m in partial)}
    assert set(differ) == partial_keys, f"differences outside partial-block modules: {sorted(set(differ) - partial_keys)}"
    return (f"dequantizes on CPU in f32; equal to the reference except the {len(differ)} tensors with partial blocks "
            "(Fp8Dequantize takes block = dim / scale-grid dim there)")


def check_hf_compressed_tensors_load(model_cls, d, ref_model, ct, dense):
    """Cross-check against transformers' own compressed-tensors load of the checkpoint. Dense modules come
    back as the reference's weights rounded to bf16 (compressed-tensors' decompress rounds). Routed experts
    come back multiplied by their global scale: transformers 5.24.0 decompresses experts through a module
    that carries no `weight_global_scale` (integrations/compressed_tensors.py), so it cannot be the oracle
    for NVFP4 experts. Asserts exactly that and returns a note for info.json."""
    from transformers import CompressedTensorsConfig

    hf = model_cls.from_pretrained(d, dtype=torch.float32, attn_implementation="eager",
                                   quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    ref_sd, hf_sd = ref_model.state_dict(), hf.state_dict()
    assert set(ref_sd) == set(hf_sd), sorted(set(ref_sd) ^ set(hf_sd))
    bf16 = lambda t: t.to(torch.bfloat16)  # noqa: E731
    experts = 0
    for k, v in ref_sd.items():
        if torch.equal(hf_sd[k].float(), bf16(v).float()):
            continue
        layer, proj = k.rsplit(".mlp.experts.", 1)
        assert proj in ("gate_up_proj", "down_proj"), f"{k}: transformers' load differs"
        halves = ("gate_proj", "up_proj") if proj == "gate_up_proj" else ("down_proj",)
        for e in range(v.shape[0]):
            mods = [f"{layer}.mlp.experts.{e}.{h}" for h in halves]
            undivided = torch.cat([dense[m] * ct[f"{m}.weight_global_scale"] for m in mods])
            assert torch.equal(hf_sd[k][e], bf16(undivided)), f"{k}[{e}]: not the missing-global-scale case"
        experts += 1
    if not experts:
        return "equal to the reference's weights rounded to bf16"
    return (f"dense modules equal to the reference's weights rounded to bf16; {experts} stacked expert tensors "
            "come back multiplied by weight_global_scale (transformers 5.24.0 drops it for experts)")


def write_json(path, obj):
    with open(path, "w") as fh:
        fh.write(json.dumps(obj, indent=2) + "\n")


def tiny_quantized_qwen35moe(seed, moe_intermediate):
    """The quantized fixtures' Qwen3.5-MoE: 4 layers (GDN, attention, GDN, attention), 8 experts of
    `moe_intermediate`, random f32 weights. Returns (model, layer_types)."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    layer_types = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
    cfg = Qwen3_5MoeTextConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=4, layer_types=layer_types,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=moe_intermediate,
        shared_expert_intermediate_size=moe_intermediate,
        rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True},
        eos_token_id=255,
    )
    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(cfg).eval()
    randomize(model, seed, emb_std=1.0, lm_std=2.0 / math.sqrt(64))
    return model, layer_types


def qwen35moe_nvfp4(d, seed=41):
    # Experts and shared expert quantized, selected the way llm-compressor recipes do: class target
    # `Linear` minus an ignore list of plain names and `re:` patterns.
    from transformers import Qwen3_5MoeForCausalLM

    t0 = time.time()
    model, layer_types = tiny_quantized_qwen35moe(seed, moe_intermediate=32)
    ignore = ["lm_head", r"re:.*mlp\.gate$", r"re:.*shared_expert_gate$", r"re:.*linear_attn\..*", r"re:.*self_attn\..*"]
    exclude = ["lm_head", "*mlp.gate", "*shared_expert_gate", "*linear_attn*", "*self_attn*"]
    return _nvfp4(d, seed, Qwen3_5MoeForCausalLM, model, 64, 12, layer_list(layer_types), ["Linear"], ignore, exclude,
                  modelopt_in_config=False, t0=t0)


def qwen35moe_dims_nvfp4(d, seed=43):
    # qwen35moe_dims' shapes with what `vt bench --load-format dummy-nvfp4` quantizes (every linear
    # but the LM head, the router, the shared-expert gate and GDN's in_proj_a/b): the delta net's
    # in_proj and out_proj and attention's q/k/v/o in NVFP4 too, at the real head dimensions. Its
    # MTP layer is quantized by the same rules (fc, attention, experts), as a checkpoint that
    # quantizes it would store it.
    from transformers import Qwen3_5MoeForCausalLM

    t0 = time.time()
    model, layer_types = dims_model(seed)
    mtp = mtp_layer(model.config, seed + 1)
    ignore = ["lm_head", r"re:.*mlp\.gate$", r"re:.*shared_expert_gate$", r"re:.*linear_attn\.in_proj_[ab]$"]
    exclude = ["lm_head", "*mlp.gate", "*shared_expert_gate", "*linear_attn.in_proj_a", "*linear_attn.in_proj_b"]
    return _nvfp4(d, seed, Qwen3_5MoeForCausalLM, model, 100, 12, layer_list(layer_types), ["Linear"], ignore, exclude,
                  modelopt_in_config=True, t0=t0, mtp=mtp)


def laguna_nvfp4(d, seed=42):
    # Attention projections (q, k, v, o, g) and routed experts quantized, selected by `re:` targets.
    from transformers import LagunaConfig, LagunaForCausalLM

    t0 = time.time()
    kw = dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_attention_heads_per_layer=[4, 8, 4],
        layer_types=["full_attention", "sliding_attention", "full_attention"],
        sliding_window=20,
        mlp_layer_types=["dense", "sparse", "sparse"],
        num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        moe_routed_scaling_factor=1.5, moe_router_logit_softcapping=3.0,
        gating="per-head", rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=4096,
        rope_parameters={
            "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "partial_rotary_factor": 0.5,
                               "factor": 4.0, "original_max_position_embeddings": 32,
                               "beta_fast": 16.0, "beta_slow": 2.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 20000.0, "partial_rotary_factor": 1.0},
        },
        eos_token_id=255,
    )
    cfg = LagunaConfig(**kw)
    torch.manual_seed(seed)
    model = LagunaForCausalLM(cfg).eval()
    randomize(model, seed, emb_std=1.0, lm_std=2.0 / math.sqrt(64))
    c = model.config
    layers = [f"{i}:{c.layer_types[i]}/{c.mlp_layer_types[i]}/heads={c.num_attention_heads_per_layer[i]}"
              for i in range(c.num_hidden_layers)]
    targets = [r"re:.*self_attn\.[qkvog]_proj$", r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"]
    exclude = ["lm_head", "*mlp.gate", "model.layers.0.mlp*", "*shared_expert*"]
    return _nvfp4(d, seed, LagunaForCausalLM, model, 64, 12, layers, targets, ["lm_head"], exclude,
                  modelopt_in_config=True, t0=t0)


FIXTURES = {
    "qwen35moe_nested": qwen35moe_nested,
    "qwen35moe_text": qwen35moe_text,
    "qwen35moe_dims": qwen35moe_dims,
    "laguna_a": laguna_a,
    "laguna_b": laguna_b,
    "qwen3moe": qwen3moe,
    "qwen35moe_nvfp4": qwen35moe_nvfp4,
    "qwen35moe_dims_nvfp4": qwen35moe_dims_nvfp4,
    "laguna_nvfp4": laguna_nvfp4,
    "qwen35moe_fp8": qwen35moe_fp8,
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", default=None, help="fixture names (default: all)")
    ap.add_argument("--out", default="fixtures")
    args = ap.parse_args()
    names = args.only or list(FIXTURES)
    for n in names:
        if n not in FIXTURES:
            sys.exit(f"unknown fixture {n!r}; known: {', '.join(FIXTURES)}")
    os.makedirs(args.out, exist_ok=True)
    t_all = time.time()
    for n in names:
        d = os.path.join(args.out, n)
        if os.path.exists(d):
            shutil.rmtree(d)
        os.makedirs(d)
        FIXTURES[n](d)
    print(f"done in {time.time() - t_all:.1f}s")


if __name__ == "__main__":
    main()
