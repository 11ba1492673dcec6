"""Train vt's built-in default model: a tiny Qwen3.5-MoE on the Python standard library's sources.

Usage (CPU; the committed weights: 33 min on two threads, final loss ~1.6):
    /opt/oracle-venv/bin/python tools/train_default/train.py --out models/default --minutes 33 --threads 2

Writes config.json, generation_config.json, model.safetensors (bf16), tokenizer.json and
tokenizer_config.json (with a ChatML chat template) to --out, then prints a sample from transformers.
The data is CPython's Lib/*.py (PSF licence), read from the local Python installation.
"""

import argparse
import glob
import json
import math
import os
import random
import sys
import sysconfig
import time

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

EOS, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}" + IM_START + "{{ message.role }}\n{{ message.content }}" + IM_END + "\n"
    "{% endfor %}{% if add_generation_prompt %}" + IM_START + "assistant\n{% endif %}"
)


def sources(lib_dir):
    files = sorted(glob.glob(os.path.join(lib_dir, "*.py")))
    texts = []
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            texts.append(fh.read())
    return files, texts


def train_tokenizer(texts, vocab_size):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def model_config(vocab, eos_id):
    return Qwen3_5MoeTextConfig(
        vocab_size=vocab, hidden_size=160, num_hidden_layers=4, full_attention_interval=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=40,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=40,
        linear_conv_kernel_dim=4,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=160, shared_expert_intermediate_size=160,
        rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "mrope_section": [4, 3, 3], "mrope_interleaved": True},
        output_router_logits=True, router_aux_loss_coef=0.01,
        eos_token_id=eos_id, bos_token_id=None, pad_token_id=eos_id,
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="models/default")
    ap.add_argument("--lib", default=sysconfig.get_paths()["stdlib"])
    ap.add_argument("--minutes", type=float, default=25.0)
    ap.add_argument("--vocab", type=int, default=3072)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    os.makedirs(args.out, exist_ok=True)

    files, texts = sources(args.lib)
    print(f"{len(files)} files, {sum(map(len, texts))} chars from {args.lib}", flush=True)
    tok = train_tokenizer(texts, args.vocab)
    eos_id = tok.token_to_id(EOS)
    ids = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids + [eos_id])
    data = torch.tensor(ids, dtype=torch.long)
    print(f"{len(data)} tokens, vocab {tok.get_vocab_size()}", flush=True)

    cfg = model_config(tok.get_vocab_size(), eos_id)
    model = Qwen3_5MoeForCausalLM(cfg)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)

    budget, warmup = args.minutes * 60, 50
    t0, step = time.time(), 0
    model.train()
    while (elapsed := time.time() - t0) < budget:
        # time-based cosine schedule: the budget, not a step count, is what we control on a shared CPU
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * elapsed / budget)))
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, len(data) - args.seq - 1, (args.batch,))
        x = torch.stack([data[s : s + args.seq] for s in starts])
        out = model(input_ids=x, labels=x)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 25 == 0:
            print(f"step {step} {elapsed:.0f}s lr {lr:.2e} loss {out.loss.item():.3f}", flush=True)
        step += 1

    model.eval()
    model.config.output_router_logits = False
    model.to(torch.bfloat16).save_pretrained(args.out)
    tok.save(os.path.join(args.out, "tokenizer.json"))
    with open(os.path.join(args.out, "tokenizer_config.json"), "w") as fh:
        json.dump({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": EOS, "pad_token": EOS, "bos_token": None,
            "add_bos_token": False, "model_max_length": 4096,
            "chat_template": CHAT_TEMPLATE,
        }, fh, indent=2)

    # check with transformers that the saved checkpoint reads back and writes Python
    from transformers import AutoTokenizer
    m = Qwen3_5MoeForCausalLM.from_pretrained(args.out, dtype=torch.float32).eval()
    t = AutoTokenizer.from_pretrained(args.out)
    x = t("def ", return_tensors="pt").input_ids
    with torch.no_grad():
        y = m.generate(x, max_new_tokens=64, do_sample=False)
    print("sample:", repr(t.decode(y[0])), flush=True)


if __name__ == "__main__":
    sys.exit(main())
