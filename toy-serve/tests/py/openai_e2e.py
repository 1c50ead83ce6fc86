"""End-to-end check of `toy serve` with the official `openai` Python client.

Usage: openai_e2e.py BASE_URL API_KEY PROMPT MAX_TOKENS
Prints one JSON object (the greedy chat reply and other facts the Rust test compares with
`toy infer`); any failed check raises (exit status 1, with the reason).
"""

import base64
import json
import math
import struct
import urllib.request

import openai

from harness import check, connect

client, base, key, args = connect(timeout=120)
prompt, max_tokens = args[:2]
# "tools": the template writes tool calls (Granite's <|tool_call|>[...]); else it has no syntax.
template_has_tools = args[2:] == ["tools"]
max_tokens = int(max_tokens)


# --- models
models = client.models.list()
check(len(models.data) == 1, f"one model listed: {models}")
model = models.data[0].id
check(models.data[0].object == "model", "object is 'model'")
check(client.models.retrieve(model).id == model, "GET /v1/models/{id}")

messages = [{"role": "user", "content": prompt}]

# --- chat, plain, greedy
r = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=max_tokens)
check(r.object == "chat.completion", f"object: {r.object}")
check(r.id.startswith("chatcmpl-"), f"id: {r.id}")
check(r.created > 1_600_000_000, "created is a Unix time")
check(r.model == model, "model echoed")
check(len(r.choices) == 1 and r.choices[0].index == 0, "one choice")
c = r.choices[0]
check(c.message.role == "assistant", "assistant role")
check(c.finish_reason in ("stop", "length"), f"finish_reason {c.finish_reason}")
greedy = c.message.content
check(greedy, "a non-empty reply")
u = r.usage
check(u.total_tokens == u.prompt_tokens + u.completion_tokens, "usage adds up")
check(0 < u.completion_tokens <= max_tokens, f"completion tokens {u.completion_tokens}")
check((c.finish_reason == "length") == (u.completion_tokens == max_tokens), "length iff max_tokens used")

# --- chat, streamed: the same text, in several chunks, usage at the end
stream = client.chat.completions.create(
    model=model, messages=messages, temperature=0, max_tokens=max_tokens, stream=True,
    stream_options={"include_usage": True},
)
parts, finish, usage, roles = [], None, None, 0
for chunk in stream:
    check(chunk.object == "chat.completion.chunk", f"chunk object {chunk.object}")
    if chunk.usage is not None:
        usage = chunk.usage
        check(chunk.choices == [], "the usage chunk has no choices")
        continue
    for ch in chunk.choices:
        if ch.delta.role:
            roles += 1
        if ch.delta.content:
            parts.append(ch.delta.content)
        if ch.finish_reason:
            finish = ch.finish_reason
streamed = "".join(parts)
check(streamed == greedy, f"streamed {streamed!r} != plain {greedy!r}")
check(len(parts) > 1, f"streamed in {len(parts)} chunks")
check(roles == 1, "one role delta")
check(finish == c.finish_reason, f"stream finish {finish}")
check(usage is not None and usage.completion_tokens == u.completion_tokens, f"stream usage {usage}")

# --- n > 1 with a seed: reproducible, as many choices as asked
kw = dict(model=model, messages=messages, temperature=0.9, max_tokens=12, n=3, seed=7)
a = client.chat.completions.create(**kw)
b = client.chat.completions.create(**kw)
check([x.index for x in a.choices] == [0, 1, 2], "n=3 gives indexes 0..2")
check([x.message.content for x in a.choices] == [x.message.content for x in b.choices], "same seed, same text")

# --- chat logprobs: one entry per token, alternatives sorted, greedy picks the top one
r = client.chat.completions.create(
    model=model, messages=messages, temperature=0, max_tokens=6, logprobs=True, top_logprobs=3
)
content = r.choices[0].logprobs.content
check(len(content) == r.usage.completion_tokens, f"{len(content)} logprob entries")
for e in content:
    check(e.logprob <= 0 and len(e.top_logprobs) == 3, "logprob <= 0 and 3 alternatives")
    tops = [t.logprob for t in e.top_logprobs]
    check(tops == sorted(tops, reverse=True), "alternatives sorted")
    check(abs(e.top_logprobs[0].logprob - e.logprob) < 1e-6 and e.top_logprobs[0].token == e.token, "greedy = top")
    check(bytes(e.bytes).decode("utf-8", "replace") == e.token or e.bytes is not None, "bytes")

# --- completions with logprobs (string and token-id prompts agree)
text_prompt = "The capital of France is"
r = client.completions.create(model=model, prompt=text_prompt, max_tokens=8, temperature=0, logprobs=2)
check(r.object == "text_completion" and r.id.startswith("cmpl-"), "completion object and id")
lp = r.choices[0].logprobs
check(len(lp.tokens) == r.usage.completion_tokens == len(lp.token_logprobs), "one logprob per token")
check(all(x <= 0 for x in lp.token_logprobs), "log-probabilities <= 0")
check(all(len(t) >= 1 for t in lp.top_logprobs), "alternatives present")
check("".join(lp.tokens) == r.choices[0].text or r.choices[0].finish_reason == "stop", "tokens spell the text")
completion_text = r.choices[0].text

req = urllib.request.Request(
    base + "/tokenize", data=json.dumps({"content": text_prompt, "add_special": True}).encode(),
    headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
)
ids = json.load(urllib.request.urlopen(req))["tokens"]
r2 = client.completions.create(model=model, prompt=ids, max_tokens=8, temperature=0)
check(r2.choices[0].text == completion_text, "token-id prompt gives the same text")

# streamed completion: same text
s = client.completions.create(model=model, prompt=text_prompt, max_tokens=8, temperature=0, stream=True)
check("".join(ch.choices[0].text for ch in s if ch.choices) == completion_text, "streamed completion text")

# streamed with echo (with and without logprobs): the prompt comes first
for lp_arg in ({}, {"logprobs": 1}):
    s = client.completions.create(model=model, prompt=text_prompt, max_tokens=8, temperature=0, stream=True, echo=True, **lp_arg)
    got = "".join(ch.choices[0].text for ch in s if ch.choices)
    check(got == text_prompt + completion_text, f"streamed echo {lp_arg}: {got!r}")

# echo + logprobs + max_tokens 0: score the prompt (first token has no logprob)
r = client.completions.create(model=model, prompt=text_prompt, max_tokens=0, echo=True, logprobs=1)
lp = r.choices[0].logprobs
check(r.choices[0].text == text_prompt, "echo returns the prompt")
check(len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None, "prompt scored, first None")
check(all(x is not None and x <= 0 for x in lp.token_logprobs[1:]), "prompt logprobs")
prompt_nll = -sum(lp.token_logprobs[1:])

# --- embeddings: float and base64 (the client's default), normalized, deterministic
inputs = ["hello world", "hello world", "A cat sleeps on the warm windowsill."]
e = client.embeddings.create(model=model, input=inputs, encoding_format="float")
check(e.object == "list" and len(e.data) == 3, "three embeddings")
vecs = [d.embedding for d in e.data]
check([d.index for d in e.data] == [0, 1, 2], "indexes")
dim = len(vecs[0])
check(all(abs(math.sqrt(sum(x * x for x in v)) - 1) < 1e-4 for v in vecs), "unit length")
check(vecs[0] == vecs[1], "same input, same vector")
cos = sum(x * y for x, y in zip(vecs[0], vecs[2]))
check(cos < 0.9999, f"different inputs differ (cos {cos})")
check(e.usage.prompt_tokens > 0, "embedding usage")
e64 = client.embeddings.create(model=model, input="hello world")  # base64 by default
check(len(e64.data[0].embedding) == dim, "base64 decoded to the same dimension")
check(max(abs(x - y) for x, y in zip(e64.data[0].embedding, vecs[0])) < 1e-6, "base64 = float")
req = urllib.request.Request(
    base + "/v1/embeddings", data=json.dumps({"model": model, "input": "hello world", "encoding_format": "base64"}).encode(),
    headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
)
raw = base64.b64decode(json.load(urllib.request.urlopen(req))["data"][0]["embedding"])
check(list(struct.unpack(f"<{dim}f", raw)) == vecs[0], "base64 is little-endian f32")

# --- errors, as the client sees them
def expect(exc, fn, needle=""):
    try:
        fn()
    except exc as err:
        check(needle in str(err), f"{exc.__name__} message {err} lacks {needle!r}")
        return err
    raise AssertionError(f"expected {exc.__name__}")

expect(openai.NotFoundError, lambda: client.chat.completions.create(model="no-such-model", messages=messages), "model_not_found")
bad = openai.OpenAI(base_url=base + "/v1", api_key="wrong-key", max_retries=0)
expect(openai.AuthenticationError, lambda: bad.models.list(), "incorrect API key")
expect(openai.BadRequestError, lambda: client.chat.completions.create(model=model, messages=messages, max_tokens=10**6), "maximum context length")
expect(openai.BadRequestError, lambda: client.chat.completions.create(model=model, messages=messages, response_format={"type": "xml"}), "response_format")
expect(openai.BadRequestError, lambda: client.chat.completions.create(model=model, messages=messages, temperature=5), "temperature")
TOOL = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
if template_has_tools:
    # A forced call in the template's own syntax comes back as an OpenAI tool call (the
    # round trip in Hermes syntax is tools_e2e.py's).
    no_args = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}}]
    r = client.chat.completions.create(model=model, messages=messages, tools=no_args, max_tokens=48,
                                       tool_choice={"type": "function", "function": {"name": "f"}})
    choice = r.choices[0]
    check(choice.finish_reason == "tool_calls", f"finish_reason {choice.finish_reason}: {choice.message}")
    calls = choice.message.tool_calls or []
    check(len(calls) == 1 and calls[0].function.name == "f", f"tool calls {calls}")
    check(json.loads(calls[0].function.arguments) == {}, f"arguments {calls[0].function.arguments}")
else:
    # The template has no tool-call syntax: a clear 400 (tools_e2e.py covers one that has).
    expect(openai.BadRequestError, lambda: client.chat.completions.create(model=model, messages=messages, tools=TOOL), "no tool-call syntax")

print(json.dumps({
    "model": model,
    "greedy_chat": greedy,
    "greedy_finish": c.finish_reason,
    "completion_text": completion_text,
    "prompt_nll": prompt_nll,
    "embedding_dim": dim,
}))
