#!/usr/bin/env python3
"""Fingerprints of the CPU logits of every fixture, for "bit-identical before and after" checks.

    tools/snapshot/logits.py VT_BINARY > before.txt   # then, after a change:
    tools/snapshot/logits.py VT_BINARY > after.txt && diff before.txt after.txt

For each fixture it runs `vt logits --backend cpu` over the reference's prompt ++ greedy ids (one
full forward) and `vt generate` greedily from the prompt (prefill, then decode steps), and prints
the sha256 of the f32 logits bytes and the generated ids. Needs only the standard library.
"""
import hashlib, json, pathlib, struct, subprocess, sys, tempfile

def tensors(path):
    raw = pathlib.Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    body = raw[8 + n :]
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        a, b = meta["data_offsets"]
        out[name] = (meta["dtype"], meta["shape"], body[a:b])
    return out

def ints(t):
    dtype, _, data = t
    fmt = {"I64": "q", "I32": "i"}[dtype]
    return list(struct.unpack(f"<{len(data) // struct.calcsize(fmt)}{fmt}", data))

def main():
    vt = sys.argv[1]
    root = pathlib.Path(__file__).resolve().parents[2] / "fixtures"
    for fx in sorted(p for p in root.iterdir() if (p / "reference.safetensors").exists()):
        ref = tensors(fx / "reference.safetensors")
        prompt, greedy = ints(ref["prompt_ids"]), ints(ref["greedy_ids"])
        ids = ",".join(map(str, prompt + greedy[:-1]))
        with tempfile.TemporaryDirectory() as d:
            out = pathlib.Path(d) / "l.safetensors"
            subprocess.run([vt, "logits", "--backend", "cpu", "--model", str(fx), "--prompt-ids", ids,
                            "--out", str(out)], check=True, capture_output=True)
            digest = hashlib.sha256(tensors(out)["logits"][2]).hexdigest()
        gen = subprocess.run([vt, "generate", "--backend", "cpu", "--model", str(fx), "--prompt-ids",
                              ",".join(map(str, prompt)), "--max-new-tokens", str(len(greedy)),
                              "--temperature", "0", "--json"], check=True, capture_output=True, text=True)
        last = json.loads(gen.stdout.strip().splitlines()[-1])
        print(f"{fx.name} logits {digest} greedy {last['token_ids']}")

main()
