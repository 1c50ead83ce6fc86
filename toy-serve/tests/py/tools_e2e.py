"""Tool calls through `toy serve` with the official `openai` client.

Usage: tools_e2e.py BASE_URL API_KEY
The server runs a model whose chat template has Hermes-style tool syntax (the tests use a tiny
random-weight SmolLM3 with fixtures/chat/qwen2.5-tools.jinja). A random model does not choose to call
a tool by itself, so the calls are forced (`tool_choice` `required` or a named function, which toy
enforces with a grammar); what is checked is the API around them:
- a forced call comes back as `message.tool_calls` (`finish_reason` `tool_calls`, no content), with
  one of the offered names and `arguments` a JSON string that validates against that function's
  `parameters` schema (jsonschema); a named `tool_choice` calls that function;
- streamed, the `tool_calls` deltas (id and name, then arguments) accumulate into the same call as
  the non-streamed reply (greedy, same seed);
- the round trip: the assistant's call and a `role: tool` result sent back give an answer (`auto`
  and `none`, which renders without tools), streamed and not; the prompt grows by the call and
  the result;
- 400s: a tool_choice naming no tool, tools that are not functions, a forced call together with
  response_format.
Prints one JSON object of facts; any failed check raises (exit status 1, with the reason).
"""

import json

import jsonschema
import openai

from harness import check, connect

client, _, _, _ = connect()
model = client.models.list().data[0].id


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time there?"}]
facts = {"forced_calls": 0}


def valid_call(call, want_name=None):
    check(call.type == "function", f"call type {call.type}")
    check(call.id.startswith("call-"), f"call id {call.id!r}")
    name = call.function.name
    check(name in SCHEMAS, f"unknown tool {name!r}")
    if want_name:
        check(name == want_name, f"asked for {want_name}, got {name}")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[name])
    facts["forced_calls"] += 1
    return name, args


# --- forced calls, not streamed: required (greedy and sampled) and named
first = None
for seed in range(6):
    r = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="required",
        max_tokens=200, temperature=0 if seed == 0 else 0.9, seed=seed,
    )
    c = r.choices[0]
    check(c.finish_reason == "tool_calls", f"finish_reason {c.finish_reason}: {c.message}")
    check(c.message.content is None, f"content beside the call: {c.message.content!r}")
    check(len(c.message.tool_calls) == 1, f"{len(c.message.tool_calls)} calls without parallel_tool_calls")
    valid_call(c.message.tool_calls[0])
    if seed == 0:
        first = r
for name in ["get_time", "get_weather"]:
    r = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, max_tokens=200, temperature=0.7, seed=3,
        tool_choice={"type": "function", "function": {"name": name}},
    )
    valid_call(r.choices[0].message.tool_calls[0], name)

# --- the same greedy call, streamed
stream = client.chat.completions.create(
    model=model, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200,
    temperature=0, seed=0, stream=True,
)
calls, content, finish = {}, "", None
for chunk in stream:
    if not chunk.choices:
        continue
    d = chunk.choices[0].delta
    content += d.content or ""
    for tc in d.tool_calls or []:
        slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
        if tc.id:
            slot["id"] = tc.id
        if tc.function and tc.function.name:
            slot["name"] += tc.function.name
        if tc.function and tc.function.arguments:
            slot["arguments"] += tc.function.arguments
    finish = chunk.choices[0].finish_reason or finish
check(finish == "tool_calls", f"streamed finish_reason {finish}")
check(content == "", f"streamed content beside the call: {content!r}")
check(len(calls) == 1 and calls[0]["id"].startswith("call-"), f"streamed calls {calls}")
want = first.choices[0].message.tool_calls[0].function
check((calls[0]["name"], calls[0]["arguments"]) == (want.name, want.arguments),
      f"streamed call {calls[0]} != {want}")
facts["streamed_call"] = calls[0]["name"]

# --- the round trip: call -> role tool result -> answer
call = first.choices[0].message.tool_calls[0]
history = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function",
         "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
    {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})},
]
# The prompt without the call and its result, as each choice renders it (none: without tools).
before = {
    "auto": first.usage.prompt_tokens,
    "none": client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=1,
    ).usage.prompt_tokens,
}
check(before["none"] < before["auto"], f"tool_choice none still rendered the tools: {before}")
for choice in ["auto", "none"]:
    r = client.chat.completions.create(
        model=model, messages=history, tools=TOOLS, tool_choice=choice, max_tokens=12, temperature=0,
    )
    c = r.choices[0]
    check(c.finish_reason in ("stop", "length", "tool_calls"), f"round trip finish {c.finish_reason}")
    check(c.message.content or c.message.tool_calls, f"round trip gave nothing: {c.message}")
    if choice == "none":
        check(c.message.tool_calls is None and isinstance(c.message.content, str),
              f"tool_choice none gave calls: {c.message}")
    check(r.usage.prompt_tokens > before[choice] + 10,
          f"{choice}: the call and its result did not reach the prompt ({r.usage.prompt_tokens} vs {before[choice]})")
    whole = c.message.content
    stream = client.chat.completions.create(
        model=model, messages=history, tools=TOOLS, tool_choice=choice, max_tokens=12, temperature=0,
        stream=True,
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    if c.message.tool_calls is None:
        check(text == whole, f"streamed round trip {text!r} != {whole!r}")
    facts[f"round_trip_{choice}"] = whole
facts["round_trip_prompt_tokens"] = r.usage.prompt_tokens

# --- errors
for kwargs, param in [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
]:
    try:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=4, **kwargs)
        raise AssertionError(f"{kwargs} was accepted")
    except openai.BadRequestError as e:
        check(e.body.get("param") == param, f"{kwargs}: param {e.body.get('param')!r}, want {param}")

print(json.dumps(facts))
