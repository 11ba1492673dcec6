"""Train the built-in default model's multi-token-prediction (MTP) layer, the model itself frozen.

Usage (CPU; after train.py):
    /work/venv-oracle/bin/python tools/train_default/train_mtp.py --model models/default --minutes 25 --threads 1

The MTP layer is tools/oracle/mtp.py's (Qwen3.5's: fc over [embedding | hidden], one full-attention
MoE decoder layer, a norm, the model's tied LM head). Row i reads the model's final-norm hidden state
at i and token i + 1 and learns the model's own greedy token at i + 2 (cross-entropy against the
argmax of the model's logits at i + 1: what a draft must match to be accepted; learning the text's
token instead reached 0.10 acceptance of 3 drafts on held-out files, the 384 windows memorised); the
decoder layer starts as a copy of the model's last full-attention layer. The model is frozen, so its
hidden states and greedy tokens over --windows training windows are computed once and reused. The model's own weights are not touched, so its logits stay what
they were. Writes the `mtp.*` tensors (bf16) into --model's model.safetensors, sets config.json's
`mtp_num_hidden_layers: 1`, then measures greedy speculative decoding with the MTP as the draft model
on held-out files (the acceptance rate vt's speculation gets with this model) and prints it.
"""

import argparse
import json
import math
import os
import sys
import sysconfig
import time

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer
from transformers import Qwen3_5MoeForCausalLM

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "oracle"))
import mtp as mtp_oracle  # noqa: E402  (tools/oracle/mtp.py)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train import sources  # noqa: E402


def init_mtp(model):
    """An MTP module whose decoder layer copies the model's last full-attention layer and whose fc
    starts small (normal, std 0.02); norms at their identity (zero-centred weights 0)."""
    cfg = model.config
    m = mtp_oracle.Mtp(cfg)
    last = max(i for i, t in enumerate(cfg.layer_types) if t == "full_attention")
    with torch.no_grad():
        m.layers[0].load_state_dict(model.model.layers[last].state_dict())
        torch.nn.init.normal_(m.fc.weight, std=0.02)
        for norm in (m.pre_fc_norm_embedding, m.pre_fc_norm_hidden, m.norm):
            norm.weight.zero_()
    return m


@torch.no_grad()
def model_hidden(model, windows, batch):
    """The model's final-norm hidden states [W, S, H] and greedy next tokens [W, S] over each window
    [W, S] (computed once: the model is frozen, so training reads them from here)."""
    hidden, greedy = [], []
    for w in windows.split(batch):
        h = model.model(input_ids=w, use_cache=False).last_hidden_state
        hidden.append(h)
        greedy.append(torch.argmax(model.lm_head(h), dim=-1))
    return torch.cat(hidden), torch.cat(greedy)


def mtp_logits(m, model, ids, hidden):
    """MTP logits of every row of `ids` [B, S] given the model's `hidden` [B, S, H]: row i predicts
    token i + 2 ([B, S - 1, V])."""
    with torch.no_grad():
        embed = model.model.embed_tokens(ids[:, 1:])
    out = torch.stack([m(e, h) for e, h in zip(embed, hidden[:, :-1])])
    return model.lm_head(out)


@torch.no_grad()
def acceptance(m, model, prompts, k, new_tokens):
    """Greedy speculative decoding of each prompt with `k` MTP drafts per step, the model verifying:
    returns (drafts accepted / drafts proposed, tokens per verification step)."""
    embed = model.model.embed_tokens
    proposed = accepted = steps = 0
    for prompt in prompts:
        ids = list(prompt)
        while len(ids) < len(prompt) + new_tokens:
            t = torch.tensor([ids])
            hidden = model.model(input_ids=t, use_cache=False).last_hidden_state[0]
            greedy_next = int(torch.argmax(model.lm_head(hidden[-1])))
            # The MTP over the sequence's rows (token i + 1 with hidden i), then its chain.
            rows_e = list(embed(torch.tensor(ids[1:] + [greedy_next])))
            rows_h = list(hidden)
            drafts = []
            for _ in range(k):
                out = m(torch.stack(rows_e), torch.stack(rows_h))[-1]
                d = int(torch.argmax(model.lm_head(out)))
                drafts.append(d)
                rows_e.append(embed(torch.tensor(d)))
                rows_h.append(out)
            # Verify: the model's greedy tokens after ids + [greedy_next] + drafts. The next round's
            # greedy_next is the one after the accepted drafts (the verification's bonus token), so a
            # round commits greedy_next and the accepted drafts for one verification.
            v = torch.tensor([ids + [greedy_next] + drafts])
            want = torch.argmax(model(input_ids=v, use_cache=False).logits[0, len(ids) : -1], dim=-1).tolist()
            n = 0
            while n < k and drafts[n] == want[n]:
                n += 1
            ids += [greedy_next] + drafts[:n]
            proposed += k
            accepted += n
            steps += 1
    return accepted / proposed, (accepted + steps) / steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/default")
    ap.add_argument("--lib", default=sysconfig.get_paths()["stdlib"])
    ap.add_argument("--minutes", type=float, default=12.0)
    ap.add_argument("--windows", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--drafts", type=int, default=3)
    ap.add_argument("--eval-prompts", type=int, default=4)
    ap.add_argument("--eval-tokens", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    files, texts = sources(args.lib)
    tok = Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))
    eos_id = tok.token_to_id("<|endoftext|>")
    # The last 5% of files are held out for the acceptance measurement.
    split = int(len(texts) * 0.95)
    ids = []
    for enc in tok.encode_batch(texts[:split]):
        ids.extend(enc.ids + [eos_id])
    data = torch.tensor(ids, dtype=torch.long)
    print(f"{len(files)} files, {len(data)} training tokens", flush=True)

    model = Qwen3_5MoeForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    m = init_mtp(model)
    m.train()
    params = [p for p in m.parameters() if p.requires_grad]
    print(f"MTP layer: {sum(p.numel() for p in params) / 1e6:.2f}M parameters", flush=True)
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)

    t0 = time.time()
    starts = torch.randint(0, len(data) - args.seq - 1, (args.windows,))
    windows = torch.stack([data[s : s + args.seq] for s in starts])
    hidden, greedy = model_hidden(model, windows, args.batch)
    print(f"the model's hidden states over {args.windows} windows of {args.seq}: {time.time() - t0:.0f}s", flush=True)

    budget, warmup = args.minutes * 60, 30
    t0, step = time.time(), 0
    while (elapsed := time.time() - t0) < budget:
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * elapsed / budget)))
        for g in opt.param_groups:
            g["lr"] = lr
        pick = torch.randint(0, args.windows, (args.batch,))
        x = windows[pick]
        # Row i's target: the model's greedy token after position i + 1.
        logits = mtp_logits(m, model, x, hidden[pick])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), greedy[pick][:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 25 == 0:
            print(f"step {step} {elapsed:.0f}s lr {lr:.2e} loss {loss.item():.3f}", flush=True)
        step += 1
    m.eval()

    # Save the weights as the checkpoint stores them (bf16) and measure with exactly those.
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    path = os.path.join(args.model, "model.safetensors")
    with safe_open(path, "pt") as fh:
        tensors = {k: fh.get_tensor(k) for k in fh.keys() if not k.startswith("mtp.")}
        meta = fh.metadata()
    tensors.update(mtp_oracle.checkpoint_tensors(m, stacked=True))
    save_file(tensors, path, metadata=meta)
    cfg_path = os.path.join(args.model, "config.json")
    with open(cfg_path) as fh:
        cfg = json.load(fh)
    cfg["mtp_num_hidden_layers"] = 1
    with open(cfg_path, "w") as fh:
        json.dump(cfg, fh, indent=2, sort_keys=True)
        fh.write("\n")

    held = [enc.ids[:64] for enc in tok.encode_batch(texts[split:]) if len(enc.ids) >= 64][: args.eval_prompts]
    model32 = Qwen3_5MoeForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    rate, per_step = acceptance(m, model32, held, args.drafts, args.eval_tokens)
    print(f"acceptance with {args.drafts} drafts on {len(held)} held-out prompts "
          f"(greedy, {args.eval_tokens} tokens each): "
          f"{rate:.3f} of drafts accepted, {per_step:.2f} tokens per verification step", flush=True)


if __name__ == "__main__":
    sys.exit(main())
