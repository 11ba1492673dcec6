#!/usr/bin/env python3
"""A stand-in tokenizer.json at a production vocabulary's size, for `vt bench --json-schema` on
dummy weights (the benchmark configs in tools/gpu/configs have no tokenizer, and none can be
downloaded here or on the GPU machine).

The grammar engine's cost per step grows with the vocabulary's token trie, so the stand-in has as
many tokens as the model's logits (`vocab_size` of the config) and tokens shaped like a real
byte-level BPE vocabulary's: the built-in model's 3072, then the most frequent words and word
pieces (with and without a leading space) of CPython's standard library sources, then numbers.
Only the vocabulary matters to the benchmark (its prompts are token ids), so it has no merges.

Usage: bench_tokenizer.py CONFIG_DIR OUT_DIR   (writes OUT_DIR/config.json and tokenizer.json)
"""
import collections
import json
import os
import re
import shutil
import sys
import sysconfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def byte_level(text):
    """GPT-2's byte-to-unicode mapping, as byte-level BPE vocabularies spell their tokens."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, map(chr, cs)))
    return "".join(table[b] for b in text.encode("utf-8"))


def main():
    config_dir, out = sys.argv[1], sys.argv[2]
    cfg = json.load(open(os.path.join(config_dir, "config.json")))
    vocab = (cfg.get("text_config") or cfg)["vocab_size"]
    base = json.load(open(os.path.join(ROOT, "models/default/tokenizer.json")))
    tokens = dict(base["model"]["vocab"])
    counts = collections.Counter()
    lib = sysconfig.get_paths()["stdlib"]
    for d, _, files in os.walk(lib):
        for f in files:
            if f.endswith(".py"):
                try:
                    text = open(os.path.join(d, f), encoding="utf-8").read()
                except (UnicodeDecodeError, OSError):
                    continue
                for w in re.findall(r" ?[A-Za-z_]+| ?[0-9]+| ?[^\sA-Za-z0-9_]+", text):
                    counts[w] += 1
                    for k in range(2, len(w)):  # word pieces
                        counts[w[:k]] += 0.1
    for w, _ in counts.most_common():
        if len(tokens) >= vocab:
            break
        tokens.setdefault(byte_level(w), len(tokens))
    i = 0
    while len(tokens) < vocab:
        tokens.setdefault(byte_level(f" {i}"), len(tokens))
        i += 1
    base["model"]["vocab"] = tokens
    base["model"]["merges"] = []
    os.makedirs(out, exist_ok=True)
    json.dump(base, open(os.path.join(out, "tokenizer.json"), "w"), ensure_ascii=False)
    shutil.copy(os.path.join(config_dir, "config.json"), os.path.join(out, "config.json"))
    print(f"{out}/tokenizer.json: {len(tokens)} tokens")


if __name__ == "__main__":
    main()
