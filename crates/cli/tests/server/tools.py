"""Tool calls through a running `specee serve` (a model whose chat template has a tools section: Qwen2.5-Coder),
with the official `openai` Python client (issue #37).

Checks: `tool_choice` auto answers a weather question with a call the client parses (`message.tool_calls`,
`finish_reason` "tool_calls", arguments valid JSON); `required` and a named function force one call whose
arguments follow the function's schema; the round trip (call -> `role: "tool"` message -> final answer that
uses the tool's result); streaming delivers the calls as `delta.tool_calls`; `tool_choice` none answers in text;
malformed `tools` are 400s. Environment: SPECEE_BASE_URL (…/v1). Exits non-zero, naming the check, on failure.
"""

import json
import os

import openai

from checks import check, conclude, refused


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The current time in a time zone",
                                         "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 30}}, "required": ["zone"]}}}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def main():
    client = openai.OpenAI(base_url=os.environ.get("SPECEE_BASE_URL", "http://127.0.0.1:8080/v1"), api_key="none")
    model = client.models.list().data[0].id
    ask = lambda messages, **kw: client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=120, **kw)

    for choice in ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}]:
        r = ask(QUESTION, tools=[WEATHER, TIME], tool_choice=choice)
        c = r.choices[0]
        calls = c.message.tool_calls or []
        ok = c.finish_reason == "tool_calls" and len(calls) >= 1 and calls[0].function.name == "get_weather"
        check(f"tool_choice {json.dumps(choice)}: a get_weather call", ok, c)
        if calls:
            args = json.loads(calls[0].function.arguments)
            check(f"tool_choice {json.dumps(choice)}: arguments follow the schema", isinstance(args.get("city"), str) and set(args) <= {"city", "unit"}, args)
            check(f"tool_choice {json.dumps(choice)}: call id and type", calls[0].id.startswith("call_") and calls[0].type == "function", calls[0])

    # Named forcing picks the other function even for this question.
    r = ask(QUESTION, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = r.choices[0].message.tool_calls or []
    check("a named choice forces that function", len(calls) == 1 and calls[0].function.name == "get_time", r.choices[0])

    # The round trip: the call, the tool's answer, the final text answer using it.
    r = ask(QUESTION, tools=[WEATHER], tool_choice="required")
    msg = r.choices[0].message
    call = msg.tool_calls[0]
    # A 0.5B model given the tool's answer keeps writing calls unless told to answer and offered no tools.
    system = [{"role": "system", "content": "You are a helpful assistant. Once a tool has answered, reply to the user in one plain sentence."}]
    follow = system + QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"city": "Paris", "temperature_celsius": 23, "sky": "sunny"})},
    ]
    final = ask(follow, tools=[WEATHER], tool_choice="none")
    text = final.choices[0].message.content or ""
    check("round trip: a text answer", final.choices[0].finish_reason == "stop" and not final.choices[0].message.tool_calls and text, final.choices[0])
    check("round trip: the answer uses the tool's result", "23" in text or "sunny" in text.lower(), text)

    # Streaming: the calls arrive as delta.tool_calls, no text.
    text, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=120, tools=[WEATHER], tool_choice="required", stream=True):
        for c in chunk.choices:
            text += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                calls.setdefault(tc.index, {"name": "", "arguments": ""})
                calls[tc.index]["name"] += tc.function.name or ""
                calls[tc.index]["arguments"] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    check("streamed calls", finish == "tool_calls" and calls.get(0, {}).get("name") == "get_weather" and text == "", (finish, calls, text))
    check("streamed arguments equal the full response's", calls.get(0, {}).get("arguments") == call.function.arguments, (calls, call))

    # tool_choice none: a text answer.
    r = ask(QUESTION, tools=[WEATHER], tool_choice="none")
    check("tool_choice none answers in text", r.choices[0].finish_reason in ("stop", "length") and not r.choices[0].message.tool_calls, r.choices[0])

    for name, kwargs in [
        ("tools not an array", {"tools": {"type": "function"}}),
        ("tool without a function", {"tools": [{"type": "function"}]}),
        ("bad function name", {"tools": [{"type": "function", "function": {"name": "get weather"}}]}),
        ("tool_choice names an unknown function", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "fly"}}}),
        ("required without tools", {"tool_choice": "required"}),
        ("unusable parameters schema", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "no-such-type"}}}], "tool_choice": "required"}),
    ]:
        refused(name, lambda: ask(QUESTION, **kwargs))

    conclude("tool")


if __name__ == "__main__":
    main()
