"""Drives a running `specee serve` with the official `openai` Python package and checks every answer.

Run by crates/cli/tests/server.rs, which starts the server and passes, in the environment:
  SPECEE_BASE_URL   e.g. http://127.0.0.1:PORT/v1
  SPECEE_EXPECT     JSON: {"model": id, "chat": {"prompt", "max_tokens", "text"},
                           "completion": {"prompt", "max_tokens", "text"}}
where the expected texts come from `specee generate` (greedy) with the same settings.
Exits non-zero, naming the check, on any mismatch.
"""

import json
import os

import openai

from checks import check, conclude, refused


def main():
    expect = json.loads(os.environ["SPECEE_EXPECT"])
    client = openai.OpenAI(base_url=os.environ["SPECEE_BASE_URL"], api_key="sk-unused", max_retries=0, timeout=300)
    model = expect["model"]
    chat, comp = expect["chat"], expect["completion"]
    messages = [{"role": "user", "content": chat["prompt"]}]

    models = client.models.list()
    ids = [m.id for m in models.data]
    check("models.list names the served model", ids == [model], ids)
    check("models.retrieve", client.models.retrieve(model).id == model)
    try:
        client.models.retrieve("no-such-model")
        check("unknown model is 404", False, "no error")
    except openai.NotFoundError:
        check("unknown model is 404", True)

    # Chat, not streamed.
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=chat["max_tokens"], temperature=0, seed=7)
    got = r.choices[0].message.content
    check("chat greedy equals `specee generate --chat`", got == chat["text"], f"{got!r} != {chat['text']!r}")
    check("chat role", r.choices[0].message.role == "assistant", r.choices[0].message.role)
    check("chat finish_reason", r.choices[0].finish_reason in ("stop", "length"), r.choices[0].finish_reason)
    u = r.usage
    check("chat usage", u.completion_tokens > 0 and u.prompt_tokens > 0 and u.total_tokens == u.prompt_tokens + u.completion_tokens, u)
    check("chat object", r.object == "chat.completion" and r.model == model, (r.object, r.model))

    # Chat, streamed, with usage at the end.
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=chat["max_tokens"], temperature=0, stream=True, stream_options={"include_usage": True}
    )
    text, finish, usage, roles = "", None, None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.role:
                roles.append(c.delta.role)
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    check("streamed chat equals `specee generate --chat`", text == chat["text"], f"{text!r} != {chat['text']!r}")
    check("streamed chat finish_reason", finish == r.choices[0].finish_reason, finish)
    check("streamed chat role once", roles == ["assistant"], roles)
    check("streamed chat usage", usage is not None and usage.completion_tokens == u.completion_tokens, usage)

    # A stop string cuts the answer, streamed or not, without leaking part of it.
    full = chat["text"]
    stop = next((s for s in ("2.", "\n", " ") if s in full), None)
    if stop is not None:
        want = full[: full.find(stop)]
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=chat["max_tokens"], temperature=0, stop=[stop])
        check("chat stop string", r.choices[0].message.content == want and r.choices[0].finish_reason == "stop",
              (r.choices[0].message.content, r.choices[0].finish_reason, want))
        text = "".join(
            c.delta.content or ""
            for chunk in client.chat.completions.create(
                model=model, messages=messages, max_tokens=chat["max_tokens"], temperature=0, stop=stop, stream=True
            )
            for c in chunk.choices
        )
        check("streamed chat stop string", text == want, f"{text!r} != {want!r}")

    # The specee extension object selects the mode.
    r = client.chat.completions.create(
        model=model, messages=messages, max_tokens=chat["max_tokens"], temperature=0, extra_body={"specee": {"mode": "dense"}}
    )
    check("specee.mode dense", r.choices[0].message.content == chat["text"], r.choices[0].message.content)
    # eagle (the shipped draft head) is lossless: the same greedy text; specee (shipped predictors) is lossy.
    r = client.chat.completions.create(
        model=model, messages=messages, max_tokens=chat["max_tokens"], temperature=0, extra_body={"specee": {"mode": "eagle"}}
    )
    check("specee.mode eagle equals dense", r.choices[0].message.content == chat["text"], r.choices[0].message.content)
    check("eagle reported", (r.model_dump().get("specee") or {}).get("mode") == "eagle", r.model_dump().get("specee"))
    r = client.chat.completions.create(
        model=model, messages=messages, max_tokens=chat["max_tokens"], temperature=0, extra_body={"specee": {"mode": "specee"}}
    )
    check("specee.mode specee answers", bool(r.choices[0].message.content) and r.usage.completion_tokens > 0, r)
    r = client.chat.completions.create(
        model=model, messages=messages, max_tokens=chat["max_tokens"], temperature=0,
        extra_body={"specee": {"mode": "specee-eagle"}},
    )
    check("specee.mode specee-eagle answers", bool(r.choices[0].message.content) and r.usage.completion_tokens > 0, r)
    check("specee-eagle reported", (r.model_dump().get("specee") or {}).get("mode") == "specee-eagle", r.model_dump().get("specee"))
    try:
        client.chat.completions.create(
            model=model, messages=messages, max_tokens=4, temperature=0.7, extra_body={"specee": {"mode": "specee"}}
        )
        check("specee mode with sampling is 400", False, "no error")
    except openai.BadRequestError as e:
        check("specee mode with sampling is 400", "greedily" in str(e), str(e))

    # Completions, not streamed and streamed.
    r = client.completions.create(model=model, prompt=comp["prompt"], max_tokens=comp["max_tokens"], temperature=0)
    got = r.choices[0].text
    check("completion greedy equals `specee generate`", got == comp["text"], f"{got!r} != {comp['text']!r}")
    check("completion usage", r.usage.completion_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens, r.usage)
    text, finish = "", None
    for chunk in client.completions.create(model=model, prompt=comp["prompt"], max_tokens=comp["max_tokens"], temperature=0, stream=True):
        for c in chunk.choices:
            text += c.text
            finish = c.finish_reason or finish
    check("streamed completion equals `specee generate`", text == comp["text"], f"{text!r} != {comp['text']!r}")
    check("streamed completion finish_reason", finish == r.choices[0].finish_reason, finish)

    # Sampling with a seed is reproducible.
    a, b = (
        client.completions.create(model=model, prompt=comp["prompt"], max_tokens=comp["max_tokens"], temperature=0.9, seed=42).choices[0].text
        for _ in range(2)
    )
    check("seeded sampling reproducible", a == b, f"{a!r} != {b!r}")

    # Unsupported features are refused with a 400 the client raises.
    for name, kwargs in [
        ("n=2", {"n": 2}),
        ("tools", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]}),
        ("top_logprobs above 20", {"logprobs": True, "top_logprobs": 21}),
        ("unknown response_format", {"response_format": {"type": "xml"}}),
        ("unusable json schema", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}}),
        ("unknown mode", {"extra_body": {"specee": {"mode": "warp"}}}),
        ("unknown field", {"extra_body": {"frobnicate": True}}),
    ]:
        e = refused(name, lambda: client.chat.completions.create(model=model, messages=messages, max_tokens=2, **kwargs))
        body = e.body if e is not None and isinstance(e.body, dict) else {}
        check(f"{name} error has a message", isinstance(body.get("message"), str), e and e.body)

    conclude("openai client")


if __name__ == "__main__":
    main()
