"""Structured output through a running `specee serve`, with the official `openai` Python client (issue #37).

Sends `response_format` JSON-schema requests built from a fixed, seeded family of varied schemas (objects of
strings, integers and numbers with ranges, booleans, enums, arrays, nested objects) with a prompt that asks for
each, validates every answer with the `jsonschema` package, and checks:
  - every answer parses and validates (`finish_reason` "stop": the grammar's end ends generation);
  - greedy answers are the same in the server's default mode (eagle) and with `specee.mode` dense;
  - `json_object`, a streamed schema request, the client's own `chat.completions.parse` with a pydantic model;
  - an unusable schema is a 400 (`openai.BadRequestError`) naming `response_format`.

Environment: SPECEE_BASE_URL (…/v1), SPECEE_CASES (how many schema/prompt pairs, default 60), SPECEE_CLIENTS
(concurrent clients, default 1), SPECEE_COMPARE_DENSE (1: also ask dense and compare, default 1), SPECEE_MODE
(`specee.mode` of the schema requests, e.g. the lossy `specee` or `specee-eagle`: then compare with 0; default:
the server's).
Also a benchmark: `python3 crates/cli/tests/server/structured_output.py` against any server prints a summary line
`structured: N/N valid, M/M eagle == dense, mean T tokens, W s`. Exits non-zero, naming the check, on failure.
"""

import concurrent.futures
import decimal
import json
import os
import random
import time

import jsonschema
import openai
import pydantic

from checks import check, conclude, refused


# Strings, numbers and arrays are bounded (lengths, ranges, a precision): a 135M model left free writes one
# number or string forever (`37.8192123123…`, `1111…`) until max_tokens — the grammar cannot end what the model
# will not. Schemas for small models should bound them, as these do.
NAMES = ["city", "person", "book", "movie", "recipe", "planet", "car", "song", "country", "animal", "company", "game"]
FIELDS = {
    "name": {"type": "string", "maxLength": 32},
    "title": {"type": "string", "maxLength": 40},
    "description": {"type": "string", "maxLength": 80},
    "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
    "count": {"type": "integer", "minimum": 0, "maximum": 1000},
    "rating": {"type": "number", "minimum": 0, "maximum": 10, "multipleOf": 0.1},
    "price": {"type": "number", "minimum": 0, "maximum": 100000, "multipleOf": 0.01},
    "available": {"type": "boolean"},
    "color": {"enum": ["red", "green", "blue", "yellow", "black", "white"]},
    "size": {"enum": ["small", "medium", "large"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 4},
    "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100}, "maxItems": 5},
    "location": {
        "type": "object",
        "properties": {"country": {"type": "string", "maxLength": 32}, "latitude": {"type": "number", "minimum": -90, "maximum": 90, "multipleOf": 0.01}},
        "required": ["country", "latitude"],
        "additionalProperties": False,
    },
}


def cases(n, seed=37):
    """`n` (name, schema, prompt) triples, the same for every run."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        thing = NAMES[i % len(NAMES)]
        keys = rng.sample(sorted(FIELDS), rng.randint(2, 5))
        schema = {
            "type": "object",
            "properties": {k: FIELDS[k] for k in keys},
            "required": keys,
            "additionalProperties": False,
        }
        if i % 7 == 6:  # now and then a list of such objects
            schema = {
                "type": "object",
                "properties": {"items": {"type": "array", "items": schema, "minItems": 1, "maxItems": 3}},
                "required": ["items"],
                "additionalProperties": False,
            }
            prompt = f"List one to three {thing}s with their {', '.join(keys)}, as JSON."
        else:
            prompt = f"Describe a {thing} as JSON with its {', '.join(keys)}."
        out.append((f"{thing}-{i}", schema, prompt))
    return out


def _multiple_of(validator, divisor, instance, schema):
    # jsonschema divides floats: 37.77 / 0.01 = 3777.0000000000005 fails `multipleOf: 0.01`. Decimals of the
    # numbers as written are exact.
    if not validator.is_type(instance, "number"):
        return
    if decimal.Decimal(repr(instance)) % decimal.Decimal(repr(divisor)) != 0:
        yield jsonschema.ValidationError(f"{instance!r} is not a multiple of {divisor}")


_Validator = jsonschema.validators.extend(jsonschema.Draft202012Validator, {"multipleOf": _multiple_of})


def validate(value, schema):
    """`jsonschema.validate` with an exact `multipleOf` for decimal numbers (raises ValidationError)."""
    _Validator(schema).validate(value)


def ask(client, model, schema, prompt, mode=None, stream=False):
    extra = {"specee": {"mode": mode}} if mode else None
    args = dict(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        temperature=0,
        max_tokens=256,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}},
        extra_body=extra,
    )
    if not stream:
        r = client.chat.completions.create(**args)
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **args):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish, None


def run_case(client, model, case, compare, mode):
    name, schema, prompt = case
    text, finish, tokens = ask(client, model, schema, prompt, mode=mode)
    try:
        value = json.loads(text)
        validate(value, schema)
        valid = True
    except (json.JSONDecodeError, jsonschema.ValidationError) as e:
        valid = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    same = None
    if compare:
        dense, _, _ = ask(client, model, schema, prompt, mode="dense")
        same = dense == text
    return name, text, finish, tokens, valid, same


def main():
    client = openai.OpenAI(base_url=os.environ["SPECEE_BASE_URL"], api_key="sk-unused", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    n = int(os.environ.get("SPECEE_CASES", "60"))
    clients = int(os.environ.get("SPECEE_CLIENTS", "1"))
    compare = os.environ.get("SPECEE_COMPARE_DENSE", "1") == "1"
    mode = os.environ.get("SPECEE_MODE") or None

    start = time.time()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda c: run_case(client, model, c, compare, mode), cases(n)))
    wall = time.time() - start
    for name, text, finish, tokens, valid, same in results:
        check(f"{name}: parses and validates", valid is True, f"{valid}: {text!r}")
        check(f"{name}: ends where the JSON ends", finish == "stop", f"finish_reason {finish}: {text!r}")
        if compare:
            check(f"{name}: eagle == dense", same, text)
    n_valid = sum(r[4] is True for r in results)
    n_same = sum(bool(r[5]) for r in results)
    mean_tokens = sum(r[3] or 0 for r in results) / max(1, len(results))
    print(
        f"structured: {n_valid}/{n} valid, {n_same}/{n if compare else 0} eagle == dense, "
        f"mean {mean_tokens:.1f} tokens, {wall:.1f} s" + (f" (mode {mode})" if mode else ""),
        flush=True,
    )
    if mode:
        conclude("structured-output")
        return

    # json_object: any JSON object.
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Give me a JSON object about Paris."}],
        temperature=0,
        max_tokens=96,
        response_format={"type": "json_object"},
    )
    text = r.choices[0].message.content
    try:
        ok = isinstance(json.loads(text), dict) or r.choices[0].finish_reason == "length"
    except json.JSONDecodeError:
        ok = r.choices[0].finish_reason == "length"  # cut by max_tokens: a prefix of an object
    check("json_object gives a JSON object", ok and text.startswith("{"), text)

    # Streamed: the same text as not streamed.
    _, schema, prompt = cases(1)[0]
    plain, _, _ = ask(client, model, schema, prompt)
    streamed, finish, _ = ask(client, model, schema, prompt, stream=True)
    check("streamed schema answer equals the unstreamed one", streamed == plain and finish == "stop", streamed)

    # The client's own types: a pydantic model as response_format, parsed by the client.
    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=30)
        country: str = pydantic.Field(max_length=30)
        population: int = pydantic.Field(ge=0, le=100_000_000)

    parsed = client.chat.completions.parse(
        model=model,
        messages=[{"role": "user", "content": "Describe the city of Paris as JSON."}],
        temperature=0,
        max_tokens=128,
        response_format=City,
    )
    city = parsed.choices[0].message.parsed
    check("chat.completions.parse returns the pydantic model", isinstance(city, City), parsed.choices[0].message)

    # Unusable schemas are 400s naming the field.
    for bad in [{"type": "no-such-type"}, {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}]:
        e = refused(f"bad schema {bad}", lambda: ask(client, model, bad, "x"))
        check(f"bad schema {bad}'s 400 names response_format", "response_format" in str(e), str(e))

    conclude("structured-output")


if __name__ == "__main__":
    main()
