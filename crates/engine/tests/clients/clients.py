"""The official `openai` and `anthropic` Python packages against a live `cortiq serve`.

Run by crates/engine/tests/clients.rs, which starts the server (API key `sk-cortiq-test`) and
writes the expected greedy replies (the engine library's own generation of the same requests)
to a JSON file:

    python clients.py PORT EXPECTED.json

Every check raises on failure; the last line printed is `ok N checks` on success.
"""

import json
import sys

import anthropic
import openai

PORT = int(sys.argv[1])
with open(sys.argv[2]) as f:
    EXPECTED = json.load(f)
KEY = "sk-cortiq-test"
CHECKS = 0


def check(cond, what):
    global CHECKS
    if not cond:
        raise AssertionError(what)
    CHECKS += 1


oa = openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key=KEY, max_retries=0)
an = anthropic.Anthropic(base_url=f"http://127.0.0.1:{PORT}", api_key=KEY, max_retries=0)
USER = EXPECTED["user"]
MAX = EXPECTED["max_tokens"]
WANT = EXPECTED["chat"]

# --- OpenAI: models, chat whole and streamed, text completions.
models = oa.models.list()
check([m.id for m in models.data] == ["demo"], f"models: {models}")

r = oa.chat.completions.create(
    model="demo", messages=[{"role": "user", "content": USER}], temperature=0, max_tokens=MAX
)
check(r.object == "chat.completion", r.object)
check(r.choices[0].message.role == "assistant", r.choices[0].message.role)
check(r.choices[0].message.content == WANT, f"chat: {r.choices[0].message.content!r} != {WANT!r}")
check(r.usage.completion_tokens == EXPECTED["chat_tokens"], f"usage: {r.usage}")
check(r.choices[0].finish_reason in ("stop", "length"), r.choices[0].finish_reason)

stream = oa.chat.completions.create(
    model="demo",
    messages=[{"role": "user", "content": USER}],
    temperature=0,
    max_tokens=MAX,
    stream=True,
    stream_options={"include_usage": True},
)
text, usage, finishes = "", None, []
for chunk in stream:
    if chunk.usage is not None:
        usage = chunk.usage
    for c in chunk.choices:
        text += c.delta.content or ""
        if c.finish_reason:
            finishes.append(c.finish_reason)
check(text == WANT, f"streamed chat: {text!r} != {WANT!r}")
check(usage is not None and usage.completion_tokens == EXPECTED["chat_tokens"], f"usage {usage}")
check(finishes == [r.choices[0].finish_reason], f"finish reasons {finishes}")

c = oa.completions.create(model="demo", prompt=EXPECTED["prompt"], temperature=0, max_tokens=MAX)
check(c.choices[0].text == EXPECTED["text"], f"completion: {c.choices[0].text!r}")
streamed = "".join(
    ch.choices[0].text
    for ch in oa.completions.create(
        model="demo", prompt=EXPECTED["prompt"], temperature=0, max_tokens=MAX, stream=True
    )
    if ch.choices
)
check(streamed == EXPECTED["text"], f"streamed completion: {streamed!r}")

# --- Tools: offered, a tool turn sent back; the reply is a well-formed message either way.
tools = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
r = oa.chat.completions.create(
    model="demo",
    messages=[
        {"role": "user", "content": "Weather in Verona?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Verona"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ],
    tools=tools,
    temperature=0,
    max_tokens=8,
)
msg = r.choices[0].message
check(msg.role == "assistant", msg)
check(msg.tool_calls is None or all(t.type == "function" for t in msg.tool_calls), msg)

# --- Errors as the client raises them.
try:
    oa.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "a"}], temperature="hot"
    )
    check(False, "a string temperature was accepted")
except openai.BadRequestError as e:
    check(e.status_code == 400 and "temperature" in str(e), str(e))
try:
    oa.chat.completions.create(model="gpt-x", messages=[{"role": "user", "content": "a"}])
    check(False, "an unserved model was accepted")
except openai.NotFoundError as e:
    check(e.status_code == 404, str(e))
try:
    oa.chat.completions.create(model="demo", messages=[{"role": "user", "content": "a"}], n=2)
    check(False, "n=2 was accepted")
except openai.BadRequestError as e:
    check("n" in str(e), str(e))
bad = openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="wrong", max_retries=0)
try:
    bad.models.list()
    check(False, "a wrong key was accepted")
except openai.AuthenticationError as e:
    check(e.status_code == 401, str(e))

# --- Anthropic: messages whole and streamed (the SDK's own event accumulator), tokens counted.
# Newer SDKs dropped `temperature` from their signatures: it goes in the body as sent.
GREEDY = {"temperature": 0}
m = an.messages.create(
    model="demo", max_tokens=MAX, extra_body=GREEDY, messages=[{"role": "user", "content": USER}]
)
check(m.type == "message" and m.role == "assistant", m)
check(m.content[0].type == "text" and m.content[0].text == WANT, f"messages: {m.content}")
check(m.usage.output_tokens == EXPECTED["chat_tokens"], m.usage)
check(m.stop_reason in ("end_turn", "max_tokens"), m.stop_reason)

with an.messages.stream(
    model="demo", max_tokens=MAX, extra_body=GREEDY, messages=[{"role": "user", "content": USER}]
) as s:
    pieces = list(s.text_stream)
    final = s.get_final_message()
check("".join(pieces) == WANT, f"streamed messages: {''.join(pieces)!r}")
check(final.stop_reason == m.stop_reason, final.stop_reason)
check(final.usage.output_tokens == EXPECTED["chat_tokens"], final.usage)

n = an.messages.count_tokens(model="demo", messages=[{"role": "user", "content": USER}])
check(n.input_tokens == EXPECTED["prompt_tokens"], n)

m = an.messages.create(
    model="demo",
    max_tokens=8,
    extra_body=GREEDY,
    system="You are terse.",
    tools=[
        {
            "name": "get_weather",
            "description": "The weather in a city",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
        }
    ],
    messages=[
        {"role": "user", "content": "Weather in Verona?"},
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Verona"}}
            ],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]},
    ],
)
check(m.role == "assistant" and m.stop_reason in ("end_turn", "max_tokens", "tool_use"), m)

try:
    an.messages.create(
        model="demo",
        max_tokens=4,
        extra_body={"max_tokens": "lots"},
        messages=[{"role": "user", "content": "a"}],
    )
    check(False, "a string max_tokens was accepted")
except anthropic.BadRequestError as e:
    check(e.status_code == 400 and "max_tokens" in str(e), str(e))
try:
    anthropic.Anthropic(
        base_url=f"http://127.0.0.1:{PORT}", api_key="wrong", max_retries=0
    ).messages.create(model="demo", max_tokens=4, messages=[{"role": "user", "content": "a"}])
    check(False, "a wrong key was accepted")
except anthropic.AuthenticationError as e:
    check(e.status_code == 401, str(e))

print(f"ok {CHECKS} checks")
