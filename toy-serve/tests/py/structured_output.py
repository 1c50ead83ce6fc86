"""Structured output through `toy serve` with the official `openai` client.

Usage: structured_output.py BASE_URL API_KEY
- `client.beta.chat.completions.parse` with a pydantic model returns a parsed object;
- 50 `json_schema` completions over 5 schemas (nested objects, enums, arrays, required fields,
  numbers with bounds), sampled at temperature 0.8 with different seeds and 10 at a time, all
  validate with `jsonschema`; streamed ones too;
- `json_object` gives a JSON object; a Lark and a GBNF `grammar` hold; a bad schema is a 400.
Prints one JSON object of facts; any failed check raises (exit status 1, with the reason).
"""

import json
from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from typing import List

import jsonschema
import openai
from pydantic import BaseModel, Field

from harness import check, connect

client, _, _, _ = connect()
model = client.models.list().data[0].id


# --- parse() with a pydantic model (strict json_schema built by the client)
class Colour(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Pet(BaseModel):
    name: str = Field(max_length=16)
    species: str = Field(max_length=16)
    age: int = Field(ge=0, le=40)
    colour: Colour


class Household(BaseModel):
    city: str = Field(max_length=20)
    pets: List[Pet] = Field(max_length=2)


parsed = client.beta.chat.completions.parse(
    model=model,
    messages=[{"role": "user", "content": "Describe a household in Paris with two pets, as JSON."}],
    response_format=Household,
    temperature=0,
    max_tokens=300,
)
msg = parsed.choices[0].message
check(parsed.choices[0].finish_reason == "stop", f"parse finished by {parsed.choices[0].finish_reason}: {msg.content!r}")
check(isinstance(msg.parsed, Household), f"parsed is a Household: {msg.content!r}")
check(all(isinstance(p.colour, Colour) for p in msg.parsed.pets), "colours are enum members")

# --- 50 completions over 5 schemas
SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "maxLength": 32},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "maxLength": 12},
                        "quantity": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["sku", "quantity"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["id", "status", "items"],
        "additionalProperties": False,
    },
    "weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "temperature_c": {"type": "number", "minimum": -60, "maximum": 60},
            "conditions": {"type": "array", "items": {"enum": ["sun", "rain", "snow", "wind", "fog"]}, "maxItems": 3},
            "alert": {"type": "boolean"},
        },
        "required": ["city", "temperature_c", "conditions", "alert"],
        "additionalProperties": False,
    },
    "book": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 40},
            "author": {
                "type": "object",
                "properties": {"first": {"type": "string", "maxLength": 16}, "last": {"type": "string", "maxLength": 16}},
                "required": ["first", "last"],
                "additionalProperties": False,
            },
            "year": {"type": "integer", "minimum": 1450, "maximum": 2030},
            "genres": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3},
        },
        "required": ["title", "author", "year", "genres"],
        "additionalProperties": False,
    },
    "answer": {
        "type": "object",
        "properties": {
            "verdict": {"enum": ["yes", "no", "unsure"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            "reasons": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 2},
        },
        "required": ["verdict", "confidence"],
        "additionalProperties": False,
    },
}
PROMPTS = {
    "person": "Invent a person and give their details as JSON.",
    "order": "Give a shop order as JSON.",
    "weather": "Report the weather in a city as JSON.",
    "book": "Describe a famous book as JSON.",
    "answer": "Is the sky blue? Answer as JSON.",
}


def one(i):
    name = list(SCHEMAS)[i % 5]
    stream = i % 10 >= 8  # two in ten streamed
    kwargs = dict(
        model=model,
        messages=[{"role": "user", "content": PROMPTS[name]}],
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}},
        temperature=0.8,
        seed=i,
        max_tokens=200,
    )
    if stream:
        text, finish = "", None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
    else:
        r = client.chat.completions.create(**kwargs)
        text, finish = r.choices[0].message.content, r.choices[0].finish_reason
    check(finish == "stop", f"{name} #{i} ended by {finish}: {text!r}")
    try:
        value = json.loads(text)
        jsonschema.validate(value, SCHEMAS[name])
    except Exception as e:
        raise AssertionError(f"{name} #{i}: {text!r}: {e}")
    return text


with ThreadPoolExecutor(10) as pool:
    outputs = list(pool.map(one, range(50)))
check(len(set(outputs)) > 5, f"sampling varied the outputs: {len(set(outputs))} distinct")

# --- json_object
r = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Give a JSON object with the keys name and age of a cat."}],
    response_format={"type": "json_object"}, temperature=0, max_tokens=200,
)
check(isinstance(json.loads(r.choices[0].message.content), dict), f"json_object: {r.choices[0].message.content!r}")

# --- grammar extension: Lark, and llama.cpp's GBNF
for grammar in ['start: ("yes" | "no") "."', 'root ::= answer "."\nanswer ::= "yes" | "no"']:
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Is water wet?"}],
        temperature=0, max_tokens=10, extra_body={"grammar": grammar},
    )
    check(r.choices[0].message.content in ("yes.", "no."), f"grammar {grammar!r}: {r.choices[0].message.content!r}")
r = client.completions.create(model=model, prompt="The answer is", max_tokens=8, temperature=0,
                              extra_body={"json_schema": {"type": "integer", "minimum": 0, "maximum": 9}})
check(r.choices[0].text.strip().isdigit(), f"completions json_schema: {r.choices[0].text!r}")

# --- errors
for bad in [{"type": "json_schema"}, {"type": "xml"},
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "required": 5}}}]:
    try:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], response_format=bad, max_tokens=4)
        raise AssertionError(f"response_format {bad} was accepted")
    except openai.BadRequestError as e:
        check(e.status_code == 400, "a 400")

print(json.dumps({"parsed": msg.content, "schema_completions": len(outputs), "distinct": len(set(outputs)), "example": outputs[0]}))
