"""Qwen3.5-MoE's multi-token-prediction (MTP) layer: random weights for a fixture and its float32 reference.

transformers 5.24 has no MTP module for qwen3_5_moe (its classes ignore `mtp.*` on load), so the reference is
written here from the published model code (vLLM's and SGLang's qwen3_5_mtp, which agree), built from
transformers' own decoder layer, norm and rotary classes:

    x      = fc(cat([pre_fc_norm_embedding(embed(next token)), pre_fc_norm_hidden(hidden)], -1))
    x      = decoder layer (full gated attention + sparse MoE), its own causal attention over the MTP's rows
    out    = norm(x)                     # the MTP's final norm
    logits = lm_head(out)                # the target's (tied: the embedding)

`hidden` at row i is the target's last hidden state at position i after its final norm (what the target's
lm_head reads: vLLM's and SGLang's drafters get the target model's output, which ends with that norm), `next
token` the token at position i + 1, and the row's rotary position is i. A chain of drafts
feeds the MTP its own `out` and its own greedy token: draft j + 1 runs at row n - 1 + j with (draft j, out of the
row before).
"""

import copy

import torch
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
    Qwen3_5MoeDecoderLayer,
    Qwen3_5MoeRMSNorm,
    Qwen3_5MoeTextRotaryEmbedding,
)


class Mtp(torch.nn.Module):
    """The `mtp.*` module of a checkpoint; parameter names are the checkpoint's without `mtp.`."""

    def __init__(self, text_config):
        super().__init__()
        cfg = copy.deepcopy(text_config)
        cfg.num_hidden_layers = 1
        cfg.layer_types = ["full_attention"]
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.fc = torch.nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5MoeRMSNorm(h, eps=eps)
        self.pre_fc_norm_hidden = Qwen3_5MoeRMSNorm(h, eps=eps)
        self.layers = torch.nn.ModuleList([Qwen3_5MoeDecoderLayer(cfg, 0)])
        self.norm = Qwen3_5MoeRMSNorm(h, eps=eps)
        self.rotary = Qwen3_5MoeTextRotaryEmbedding(cfg)

    def forward(self, embed, hidden):
        """All rows at once (causal): `embed` and `hidden` [rows, H] -> the MTP's output (normed) [rows, H]."""
        rows = hidden.shape[0]
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embed), self.pre_fc_norm_hidden(hidden)], -1))[None]
        pos = torch.arange(rows)[None]
        cos_sin = self.rotary(x, pos[None].expand(3, 1, rows))
        mask = torch.full((rows, rows), torch.finfo(torch.float32).min).triu(1)[None, None]
        x = self.layers[0](x, position_embeddings=cos_sin, attention_mask=mask, position_ids=pos)
        return self.norm(x)[0]


def make(text_config, seed, randomize):
    """An MTP module with random weights (float32, already rounded to bf16 as the checkpoint stores them)."""
    mtp = Mtp(text_config).eval()
    randomize(mtp, seed, emb_std=0.0)
    with torch.no_grad():
        for p in mtp.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    return mtp


def checkpoint_tensors(mtp, stacked):
    """The module's weights as bf16 checkpoint tensors `mtp.*`: experts stacked (`experts.gate_up_proj`) or per
    expert (`experts.{e}.gate_proj.weight`, ...)."""
    out = {}
    for k, v in mtp.state_dict().items():
        if k.startswith("rotary."):
            continue
        v = v.to(torch.bfloat16)
        if not stacked and k.endswith("mlp.experts.gate_up_proj"):
            base = "mtp." + k[: -len("gate_up_proj")]
            inter = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = v[e, :inter].clone()
                out[f"{base}{e}.up_proj.weight"] = v[e, inter:].clone()
        elif not stacked and k.endswith("mlp.experts.down_proj"):
            base = "mtp." + k[: -len("down_proj")]
            for e in range(v.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = v[e].clone()
        else:
            out["mtp." + k] = v
    return out


def with_weights(mtp, tensors):
    """A copy of `mtp` holding `tensors` (checkpoint names `mtp.*`, experts per expert, as `checkpoint_tensors`
    writes them) in float32: the weights a quantized checkpoint's MTP layer decompresses to."""
    out = copy.deepcopy(mtp)
    state = {}
    for k, v in out.state_dict().items():
        if k.startswith("rotary."):
            state[k] = v
        elif k.endswith("mlp.experts.gate_up_proj"):
            base = "mtp." + k[: -len("gate_up_proj")]
            state[k] = torch.stack([torch.cat([tensors[f"{base}{e}.gate_proj.weight"], tensors[f"{base}{e}.up_proj.weight"]])
                                    for e in range(v.shape[0])])
        elif k.endswith("mlp.experts.down_proj"):
            base = "mtp." + k[: -len("down_proj")]
            state[k] = torch.stack([tensors[f"{base}{e}.down_proj.weight"] for e in range(v.shape[0])])
        else:
            state[k] = tensors["mtp." + k]
    out.load_state_dict({k: v.to(torch.float32) for k, v in state.items()})
    return out


@torch.no_grad()
def reference(mtp, text_model, lm_head, ids, first_draft_row, drafts):
    """The MTP over a sequence `ids` (the target's input) and a chain of greedy drafts.

    Returns `hidden` [L, H] (the target's last hidden states over ids[:-1] *before* its final norm, what vt hands
    its drafter, L = len(ids) - 1), `feed_logits` [L, V] (row i: the MTP fed the final-norm hidden state i and
    ids[i + 1]), and the chain that starts after row `first_draft_row`: `draft_ids` [drafts] and `draft_logits`
    [drafts, V] (row 0 is feed_logits[first_draft_row])."""
    t = torch.tensor([ids[:-1]], dtype=torch.long)
    seen = []
    hook = text_model.norm.register_forward_pre_hook(lambda _, args: seen.append(args[0][0].clone()))
    hidden = text_model(input_ids=t, use_cache=False).last_hidden_state[0]
    hook.remove()
    (pre_norm,) = seen
    assert torch.equal(text_model.norm(pre_norm), hidden)
    embed = text_model.embed_tokens
    nxt = torch.tensor(ids[1:], dtype=torch.long)
    feed_logits = lm_head(mtp(embed(nxt), hidden))

    n = first_draft_row + 1
    h_rows, e_rows = list(hidden[:n]), list(embed(nxt[:n]))
    draft_ids, draft_logits = [], []
    for _ in range(drafts):
        out = mtp(torch.stack(e_rows), torch.stack(h_rows))  # causal: earlier rows are unchanged
        logits = lm_head(out[-1])
        tok = int(torch.argmax(logits))
        draft_ids.append(tok)
        draft_logits.append(logits)
        h_rows.append(out[-1])
        e_rows.append(embed(torch.tensor(tok)))
    draft_logits = torch.stack(draft_logits)
    assert torch.allclose(draft_logits[0], feed_logits[first_draft_row], atol=1e-5), "chain row 0 != feed row"
    gaps = torch.topk(draft_logits, 2, dim=-1).values
    return {
        "hidden": pre_norm.contiguous(),
        "next_ids": nxt,
        "feed_logits": feed_logits.contiguous(),
        "draft_ids": torch.tensor(draft_ids, dtype=torch.int64),
        "draft_logits": draft_logits.contiguous(),
        "draft_start": torch.tensor([first_draft_row], dtype=torch.int64),
    }, float((gaps[:, 0] - gaps[:, 1]).min())
