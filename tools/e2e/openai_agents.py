#!/usr/bin/env python3
"""End-to-end test of what agent clients ask of `vt serve` (issue 29), through the official `openai`
Python client, on the built-in model (CPU):

- tools with tool_choice "required" (and a named function) return tool calls whose arguments
  validate against the tool's schema: constrained decoding makes even the tiny model comply;
- response_format json_schema output validates against the schema; json_object output parses as
  a JSON object;
- logprobs (completions and chat, streamed and not) agree with `vt logits` to 1e-4;
- n = 3 returns 3 choices; streamed usage arrives (stream_options.include_usage);
- reasoning is split into reasoning_content when the template thinks (Qwen3.6's template), and
  thinking off (chat_template_kwargs) gives plain content;
- fields vt does not implement, and image content, get a 400 naming them.

Usage: openai_agents.py VT_BINARY   (with `openai` and `jsonschema` importable)
"""
import json
import math
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request

import jsonschema
import openai

VT = sys.argv[1]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QWEN36_TEMPLATE = os.path.join(ROOT, "crates/vt/tests/templates/qwen3_6.jinja")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "days", "unit"],
            "additionalProperties": False,
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "maxLength": 16}},
            "required": ["query"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, SEARCH]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *args):
        self.port = free_port()
        self.proc = subprocess.Popen([VT, "serve", "--port", str(self.port), *args])
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2)
                break
            except OSError:
                if self.proc.poll() is not None or time.time() > deadline:
                    raise SystemExit("vt serve did not come up")
                time.sleep(0.2)
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="unused", max_retries=0)
        self.model = self.client.models.list().data[0].id

    def close(self):
        self.proc.terminate()
        self.proc.wait(timeout=60)


def check(cond, what):
    if not cond:
        raise AssertionError(what)
    print(f"ok: {what}")


def validate_calls(calls, where):
    check(bool(calls), f"{where}: tool calls returned")
    for c in calls:
        check(c.type == "function" and c.id, f"{where}: call has an id and type function")
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, PARAMS[c.function.name])
        print(f"   {c.function.name}({c.function.arguments})")
    check(True, f"{where}: every call's arguments validate against its tool's schema")


def logits_file(prompt_ids):
    """All positions' logits of `prompt_ids` from `vt logits` (safetensors, f32)."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "logits.safetensors")
        subprocess.run([VT, "logits", "--prompt-ids", ",".join(map(str, prompt_ids)), "--out", out], check=True,
                       stdout=subprocess.DEVNULL)
        data = open(out, "rb").read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])["logits"]
    rows, vocab = header["shape"]
    lo, hi = header["data_offsets"]
    flat = struct.unpack(f"<{rows * vocab}f", data[8 + n + lo:8 + n + hi])
    return [flat[r * vocab:(r + 1) * vocab] for r in range(rows)]


def log_softmax(row):
    m = max(row)
    lse = m + math.log(sum(math.exp(x - m) for x in row))
    return [x - lse for x in row]


def token_id(tok):
    assert tok.startswith("token_id:"), tok
    return int(tok[len("token_id:"):])


def check_logprobs_against_vt_logits(prompt, entries, where):
    """entries: [(chosen id, logprob, [(id, logprob)...])] of consecutive generated tokens."""
    ids = prompt + [e[0] for e in entries[:-1]]
    rows = logits_file(ids)
    worst = 0.0
    for i, (chosen, lp, top) in enumerate(entries):
        ref = log_softmax(rows[len(prompt) - 1 + i])
        worst = max(worst, abs(ref[chosen] - lp))
        for tid, tlp in top:
            worst = max(worst, abs(ref[tid] - tlp))
        want_top = sorted(range(len(ref)), key=lambda t: (-ref[t], t))[:len(top)]
        check([t for t, _ in top] == want_top, f"{where}: token {i}'s top_logprobs are the {len(top)} most likely")
    check(worst < 1e-4, f"{where}: logprobs agree with vt logits (largest difference {worst:.2e} < 1e-4)")


def main():
    s = Server()
    c = s.client
    try:
        # --- tool_choice "required" and a named function: constrained decoding ---
        msgs = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
        # One call (the tiny model would list calls until max_tokens otherwise).
        r = c.chat.completions.create(model=s.model, messages=msgs, tools=TOOLS, tool_choice="required", max_tokens=200,
                                      temperature=0.8, seed=1, parallel_tool_calls=False)
        check(r.choices[0].finish_reason == "tool_calls", "required: finish_reason tool_calls")
        validate_calls(r.choices[0].message.tool_calls, "required")
        r = c.chat.completions.create(model=s.model, messages=msgs, tools=TOOLS, max_tokens=200,
                                      tool_choice={"type": "function", "function": {"name": "search"}})
        validate_calls(r.choices[0].message.tool_calls, "named")
        check(r.choices[0].message.tool_calls[0].function.name == "search", "named: the named function is called")
        # Streamed: id and name first, then argument fragments.
        chunks = list(c.chat.completions.create(model=s.model, messages=msgs, tools=TOOLS, tool_choice="required",
                                                max_tokens=200, stream=True, parallel_tool_calls=False, seed=2))
        deltas = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [] if ch.choices else [])]
        check(deltas and deltas[0].id and deltas[0].function.name, "streamed tool call starts with id and name")
        args = "".join(d.function.arguments or "" for d in deltas if d.index == 0)
        jsonschema.validate(json.loads(args), PARAMS[deltas[0].function.name])
        check(chunks[-1].choices[0].finish_reason == "tool_calls", "streamed tool call: finish_reason tool_calls")

        # --- response_format json_schema ---
        schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                                   "age": {"type": "integer"},
                                                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 5},
                                                            "maxItems": 3}},
                  "required": ["name", "age", "tags"], "additionalProperties": False}
        r = c.chat.completions.create(model=s.model, messages=[{"role": "user", "content": "A person as JSON"}],
                                      max_tokens=200, response_format={"type": "json_schema", "json_schema": {
                                          "name": "person", "schema": schema, "strict": True}})
        out = json.loads(r.choices[0].message.content)
        jsonschema.validate(out, schema)
        check(True, f"json_schema output validates: {r.choices[0].message.content}")

        # --- response_format json_object ---
        r = c.chat.completions.create(model=s.model, messages=[{"role": "user", "content": "An object as JSON"}],
                                      max_tokens=200, temperature=0, response_format={"type": "json_object"})
        out = json.loads(r.choices[0].message.content)
        check(isinstance(out, dict) and r.choices[0].finish_reason == "stop",
              f"json_object output parses as a JSON object: {r.choices[0].message.content}")

        # --- logprobs against vt logits ---
        prompt = [5, 17, 300, 42, 7]
        r = c.completions.create(model=s.model, prompt=prompt, max_tokens=6, temperature=0, logprobs=5,
                                 extra_body={"return_tokens_as_token_ids": True})
        lp = r.choices[0].logprobs
        entries = [(token_id(t), l, [(token_id(k), v) for k, v in top.items()])
                   for t, l, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)]
        check(len(entries) == 6, "completions: one logprob entry per token")
        check_logprobs_against_vt_logits(prompt, entries, "completions")
        stream = c.completions.create(model=s.model, prompt=prompt, max_tokens=6, temperature=0, logprobs=5,
                                      stream=True, extra_body={"return_tokens_as_token_ids": True})
        streamed = [(token_id(t), l) for ch in stream if ch.choices and ch.choices[0].logprobs
                    for t, l in zip(ch.choices[0].logprobs.tokens, ch.choices[0].logprobs.token_logprobs)]
        check(streamed == [(e[0], e[1]) for e in entries], "completions: streamed logprobs equal the whole response's")
        # Sampled (the logits are read back to the host): same agreement.
        r = c.completions.create(model=s.model, prompt=prompt, max_tokens=6, temperature=1.0, seed=3, logprobs=2,
                                 extra_body={"return_tokens_as_token_ids": True})
        lp = r.choices[0].logprobs
        check_logprobs_against_vt_logits(prompt, [(token_id(t), l, [(token_id(k), v) for k, v in top.items()])
                                                  for t, l, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)],
                                         "completions sampled")
        # Chat: logprobs.content with top_logprobs, streamed and not.
        chat_msgs = [{"role": "user", "content": "Hello"}]
        r = c.chat.completions.create(model=s.model, messages=chat_msgs, max_tokens=5, temperature=0, logprobs=True,
                                      top_logprobs=3, extra_body={"return_tokens_as_token_ids": True})
        content = r.choices[0].logprobs.content
        check(len(content) == r.usage.completion_tokens and all(len(e.top_logprobs) == 3 for e in content),
              "chat: logprobs.content has each token with 3 top_logprobs")
        stream = c.chat.completions.create(model=s.model, messages=chat_msgs, max_tokens=5, temperature=0,
                                           logprobs=True, top_logprobs=3, stream=True,
                                           extra_body={"return_tokens_as_token_ids": True})
        streamed = [(e.token, e.logprob) for ch in stream if ch.choices and ch.choices[0].logprobs
                    for e in ch.choices[0].logprobs.content]
        check(streamed == [(e.token, e.logprob) for e in content], "chat: streamed logprobs equal the whole response's")

        # --- n = 3, seeds per choice, usage ---
        r = c.chat.completions.create(model=s.model, messages=chat_msgs, max_tokens=8, n=3, temperature=1.0, seed=7)
        check(sorted(ch.index for ch in r.choices) == [0, 1, 2], "n = 3 returns 3 choices")
        check(len({ch.message.content for ch in r.choices}) > 1, "n = 3: the choices differ (a seed per choice)")
        r2 = c.chat.completions.create(model=s.model, messages=chat_msgs, max_tokens=8, n=3, temperature=1.0, seed=7)
        check([ch.message.content for ch in r.choices] == [ch.message.content for ch in r2.choices],
              "n = 3 with a seed is reproducible")
        check(r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens and r.usage.completion_tokens > 8,
              f"n = 3: usage counts every choice's tokens ({r.usage.completion_tokens})")
        chunks = list(c.chat.completions.create(model=s.model, messages=chat_msgs, max_tokens=8, n=2, stream=True,
                                                stream_options={"include_usage": True}))
        check(chunks[-1].usage is not None and chunks[-1].choices == [], "streamed usage arrives in a last chunk")
        check(all(ch.usage is None for ch in chunks[:-1]), "only the last chunk carries usage")
        check(chunks[-1].usage.completion_tokens > 0, f"streamed usage counts tokens: {chunks[-1].usage}")
        check({ch.choices[0].index for ch in chunks[:-1] if ch.choices} == {0, 1}, "streamed n = 2: both choices")

        # --- fields vt does not implement, media ---
        for kwargs, name in [({"extra_body": {"suffix": "x"}}, "suffix"), ({"extra_body": {"best_of": 2}}, "best_of")]:
            try:
                c.completions.create(model=s.model, prompt="hi", max_tokens=2, **kwargs)
                check(False, f"{name} refused")
            except openai.BadRequestError as e:
                check(name in str(e), f"unsupported field `{name}` gets a 400 naming it")
        try:
            c.chat.completions.create(model=s.model, max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "text", "text": "what is this"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
            check(False, "image refused")
        except openai.BadRequestError as e:
            check("image_url" in str(e), "image content gets a 400 naming it")
        r = c.chat.completions.create(model=s.model, max_tokens=3, messages=[
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "search", "arguments": "{\"query\": \"x\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "result"}], tools=TOOLS)
        check(r.choices[0].finish_reason in ("stop", "length", "tool_calls"),
              "content parts, assistant tool_calls with null content and a tool result are accepted")
    finally:
        s.close()

    # --- reasoning, with Qwen3.6's template (it opens <think> unless thinking is off) ---
    s = Server("--chat-template", QWEN36_TEMPLATE)
    c = s.client
    try:
        msgs = [{"role": "user", "content": "Think about it."}]
        r = c.chat.completions.create(model=s.model, messages=msgs, max_tokens=10, seed=5)
        m = r.choices[0].message
        reasoning = getattr(m, "reasoning_content", None) or (m.model_extra or {}).get("reasoning_content")
        check(bool(reasoning) and not m.content, f"thinking on: the output is reasoning_content ({reasoning!r})")
        r = c.chat.completions.create(model=s.model, messages=msgs, max_tokens=10,
                                      extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        m = r.choices[0].message
        check(bool(m.content) and not (m.model_extra or {}).get("reasoning_content"),
              f"thinking off: the output is content ({m.content!r})")
        chunks = list(c.chat.completions.create(model=s.model, messages=msgs, max_tokens=10, stream=True, seed=5))
        streamed = "".join((ch.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                           for ch in chunks if ch.choices)
        check(streamed == reasoning, "streamed reasoning_content deltas add up to the whole response's")
        # Reasoning, then JSON forced after it.
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                  "additionalProperties": False}
        r = c.chat.completions.create(model=s.model, max_tokens=60, messages=[
            {"role": "user", "content": "Answer in JSON"},
            {"role": "assistant", "content": "<think>\nShort.\n</think>\n\n"}],
            extra_body={"continue_final_message": True, "add_generation_prompt": False},
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
        check(True, "continue_final_message after a closed think block: the JSON validates")
    finally:
        s.close()
    print("openai agents e2e: all passed")


if __name__ == "__main__":
    main()
