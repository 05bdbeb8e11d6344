"""Log probabilities through a running `specee serve`, with the official `openai` Python client (issue #37).

Checks, on chat completions and completions, streamed and not:
  - greedy answers' `logprobs` in the server's default mode (eagle) equal dense's (`specee.mode` dense) within
    1e-4: the same tokens, values and alternatives in the same order;
  - the entries describe the answer: their bytes join to the content, the greedy token is the most likely
    alternative, values are log probabilities (<= 0, alternatives' mass <= 1);
  - streamed chunks carry exactly the non-streamed entries; completions' `tokens`, `token_logprobs`,
    `top_logprobs` (text -> value) and `text_offset` agree with the text;
  - sampled answers carry entries too; `top_logprobs` above 20 and `top_logprobs` without `logprobs` are 400s.

Environment: SPECEE_BASE_URL (…/v1), SPECEE_CLIENTS (concurrent clients for the batched server, default 1),
SPECEE_COMPARE_EAGLE (1: compare eagle with dense, default 1). Exits non-zero, naming the check, on failure.
"""

import concurrent.futures
import math
import os

import openai

from checks import check, conclude, refused


PROMPTS = [
    "Write a Python function that returns the square of a number.",
    "Name three primary colors.",
    "Was ist die Hauptstadt von Frankreich? Antworte kurz.",
    "Write a haiku about the sea, with an emoji.",
]


def chat(client, model, prompt, mode=None, stream=False, top=5, **kw):
    extra = {"specee": {"mode": mode}} if mode else {}
    args = dict(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=40, temperature=0,
                logprobs=True, top_logprobs=top, extra_body=extra, **kw)
    if not stream:
        r = client.chat.completions.create(**args)
        c = r.choices[0]
        return c.message.content, c.logprobs.content, c.finish_reason
    text, entries, finish = "", [], None
    for chunk in client.chat.completions.create(stream=True, **args):
        for c in chunk.choices:
            text += c.delta.content or ""
            if c.logprobs is not None:
                entries.extend(c.logprobs.content)
            finish = c.finish_reason or finish
    return text, entries, finish


def same_entries(a, b, tol=1e-4):
    """Why two chat logprob lists differ, or None."""
    if len(a) != len(b):
        return f"{len(a)} vs {len(b)} entries"
    for i, (x, y) in enumerate(zip(a, b)):
        if x.token != y.token or x.bytes != y.bytes or abs(x.logprob - y.logprob) > tol:
            return f"token {i}: {x.token!r} {x.logprob} vs {y.token!r} {y.logprob}"
        if [t.token for t in x.top_logprobs] != [t.token for t in y.top_logprobs]:
            return f"token {i}: alternatives {[t.token for t in x.top_logprobs]} vs {[t.token for t in y.top_logprobs]}"
        if any(abs(s.logprob - t.logprob) > tol for s, t in zip(x.top_logprobs, y.top_logprobs)):
            return f"token {i}: alternative values differ"
    return None


def describes(text, entries, top, greedy=True):
    """Why `entries` do not describe `text`, or None."""
    joined = b"".join(bytes(e.bytes) for e in entries).decode("utf-8", "replace")
    if joined != text:
        return f"bytes join to {joined!r}, content {text!r}"
    for i, e in enumerate(entries):
        if not (e.logprob <= 0 and len(e.top_logprobs) == top):
            return f"token {i}: logprob {e.logprob}, {len(e.top_logprobs)} alternatives"
        if sum(math.exp(t.logprob) for t in e.top_logprobs) > 1 + 1e-4:
            return f"token {i}: alternatives' mass above 1"
        if greedy and top and (e.top_logprobs[0].token != e.token or e.top_logprobs[0].logprob != e.logprob):
            return f"token {i}: greedy token {e.token!r} is not the most likely {e.top_logprobs[0].token!r}"
    return None


def main():
    client = openai.OpenAI(base_url=os.environ.get("SPECEE_BASE_URL", "http://127.0.0.1:8080/v1"), api_key="none")
    model = client.models.list().data[0].id
    clients = int(os.environ.get("SPECEE_CLIENTS", "1"))
    compare = os.environ.get("SPECEE_COMPARE_EAGLE", "1") == "1"

    # Chat, not streamed, several clients at once (the batching server runs them in one forward).
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        answers = list(pool.map(lambda p: chat(client, model, p), PROMPTS))
    for p, (text, entries, finish) in zip(PROMPTS, answers):
        check(f"chat entries describe the answer to {p[:24]!r}", describes(text, entries, 5) is None, describes(text, entries, 5))
        dense = chat(client, model, p, mode="dense")
        check(f"the same answer again in dense ({p[:24]!r})", same_entries(entries, dense[1]) is None, same_entries(entries, dense[1]))
    if compare:
        models = client.models.list().data[0].model_extra.get("specee", {}).get("modes", [])
        check("the server offers eagle", "eagle" in models, models)
        for p in PROMPTS:
            e, d = chat(client, model, p, mode="eagle"), chat(client, model, p, mode="dense")
            why = same_entries(e[1], d[1])
            check(f"eagle's logprobs equal dense's ({p[:24]!r})", e[0] == d[0] and why is None, why)

    # Streaming carries the same entries, chunk by chunk.
    text, entries, _ = chat(client, model, PROMPTS[3], stream=True)
    full = chat(client, model, PROMPTS[3])
    check("streamed chat text", text == full[0], f"{text!r} vs {full[0]!r}")
    check("streamed chat logprobs equal the full response's", same_entries(entries, full[1], 0) is None, same_entries(entries, full[1], 0))
    text, entries, _ = chat(client, model, PROMPTS[1], top=0)
    check("top_logprobs 0: entries without alternatives", describes(text, entries, 0) is None, describes(text, entries, 0))

    # Sampled answers carry entries of the model's distribution too.
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=24,
                                       temperature=0.9, seed=7, logprobs=True, top_logprobs=3)
    c = r.choices[0]
    why = describes(c.message.content, c.logprobs.content, 3, greedy=False)
    check("sampled chat entries", why is None, why)

    # Completions: tokens, token_logprobs, top_logprobs by text, text_offset.
    prompt = "def fibonacci(n):\n"
    r = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0, logprobs=3)
    c = r.choices[0]
    lp = c.logprobs
    n = len(lp.tokens)
    offsets = [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    check("completion logprobs are per token", n == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) and n > 0, lp)
    check("completion text_offset", lp.text_offset == offsets, (lp.text_offset, offsets))
    check("completion tokens join to the text", "".join(lp.tokens) == c.text, (lp.tokens, c.text))
    check("completion top_logprobs by text", all(0 < len(t) <= 3 and max(t.values()) <= 0 for t in lp.top_logprobs), lp.top_logprobs)
    check("completion greedy token most likely", all(abs(max(t.values()) - v) < 1e-6 for t, v in zip(lp.top_logprobs, lp.token_logprobs)))
    streamed = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0, logprobs=3, stream=True):
        for ch in chunk.choices:
            if ch.logprobs is not None:
                for k in streamed:
                    streamed[k].extend(getattr(ch.logprobs, k))
    check("streamed completion logprobs equal the full response's",
          streamed == {"tokens": lp.tokens, "token_logprobs": lp.token_logprobs, "text_offset": lp.text_offset}, streamed)

    # Bad counts are 400s the client raises.
    for name, kwargs in [("top_logprobs 21", {"logprobs": True, "top_logprobs": 21}), ("top_logprobs without logprobs", {"top_logprobs": 2})]:
        refused(name, lambda: client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2, **kwargs))

    conclude("logprobs")


if __name__ == "__main__":
    main()
