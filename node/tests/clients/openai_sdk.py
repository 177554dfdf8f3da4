"""The official OpenAI Python SDK against kvplane's gateway (argv[1]: its base URL, /v1).

Every call is one a user of the SDK makes; each check is what the SDK itself gives back
(parsed models, its exception classes, its request id). Prints one line per check; exits
non-zero at the first that fails.
"""

import json
import sys

import openai

base = sys.argv[1]
client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)


def check(what, ok, detail=""):
    print(("ok   " if ok else "FAIL ") + what + (f": {detail}" if detail else ""), flush=True)
    if not ok:
        sys.exit(1)


# Models: the catalog's names, parsed by the SDK.
ids = [m.id for m in client.models.list()]
check("models list the public and served models", "chat" in ids and "sim-8b" in ids, ids)

# Completions, whole and streamed.
c = client.completions.create(model="chat", prompt="hello there", max_tokens=4)
check("completion text", bool(c.choices[0].text), c)
check("completion usage", c.usage.prompt_tokens > 0 and c.usage.completion_tokens == 4, c.usage)
check("completion created", c.created > 0, c.created)
c2 = client.completions.create(model="chat", prompt="hello there", max_tokens=4)
check("completion ids differ", c.id != c2.id, (c.id, c2.id))
chunks = list(client.completions.create(model="chat", prompt="stream me", max_tokens=3, stream=True))
check("streamed completion ends with a finish reason", chunks[-1].choices[0].finish_reason == "length", chunks[-1])

# Chat, whole and streamed with usage.
r = client.chat.completions.create(
    model="chat", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
)
check("chat message", r.choices[0].message.role == "assistant" and bool(r.choices[0].message.content), r)
check("chat usage", r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens, r.usage)
stream = client.chat.completions.create(
    model="chat",
    max_tokens=3,
    messages=[{"role": "user", "content": "hi"}],
    stream=True,
    stream_options={"include_usage": True},
)
events = list(stream)
check("chat stream names the assistant first", events[0].choices[0].delta.role == "assistant", events[0])
finishes = [e.choices[0].finish_reason for e in events if e.choices]
check("chat stream ends with a finish reason", finishes[-1] == "length", finishes)
check("chat stream carries usage", events[-1].usage is not None and events[-1].usage.completion_tokens == 3, events[-1])

# Request ids: the client's is echoed; without one the gateway names the request.
raw = client.chat.completions.with_raw_response.create(
    model="chat",
    max_tokens=2,
    messages=[{"role": "user", "content": "hi"}],
    extra_headers={"x-request-id": "sdk-request-1"},
)
check("a client's request id comes back", raw.headers.get("x-request-id") == "sdk-request-1", raw.headers)
r = client.chat.completions.create(model="chat", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
check("the gateway names a request without one", bool(r._request_id), r._request_id)

# Tools: the engine's call comes back through the gateway as the SDK parses it, whole and
# streamed (its arguments in pieces, joined by the client as the SDK's docs show).
weather = [{"type": "function", "function": {"name": "get_weather", "description": "the weather",
            "parameters": {"type": "object", "properties": {"text": {"type": "string"}}}}}]
t = client.chat.completions.create(
    model="chat", max_tokens=3, tools=weather, messages=[{"role": "user", "content": "weather?"}]
)
call = (t.choices[0].message.tool_calls or [None])[0]
check("a tool call comes back parsed", call is not None and call.function.name == "get_weather", t)
check("a tool call's arguments are JSON", call is not None and "text" in json.loads(call.function.arguments), call)
check("a tool call ends the answer as one", t.choices[0].finish_reason == "tool_calls", t.choices[0])
named = client.chat.completions.create(
    model="chat",
    max_tokens=2,
    tools=weather + [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}],
    tool_choice={"type": "function", "function": {"name": "get_time"}},
    messages=[{"role": "user", "content": "time?"}],
)
check("tool_choice names the function called", named.choices[0].message.tool_calls[0].function.name == "get_time", named)
none = client.chat.completions.create(
    model="chat", max_tokens=2, tools=weather, tool_choice="none", messages=[{"role": "user", "content": "hi"}]
)
check("tool_choice none writes text", none.choices[0].message.tool_calls is None and bool(none.choices[0].message.content), none)
name, arguments, finish, pieces = None, "", None, 0
for e in client.chat.completions.create(
    model="chat", max_tokens=3, tools=weather, stream=True, messages=[{"role": "user", "content": "weather?"}]
):
    for d in (e.choices[0].delta.tool_calls or []) if e.choices else []:
        name = name or (d.function.name if d.function else None)
        arguments += (d.function.arguments or "") if d.function else ""
        pieces += 1 if d.function and d.function.arguments else 0
    if e.choices and e.choices[0].finish_reason:
        finish = e.choices[0].finish_reason
check(
    "a streamed tool call's pieces join into its call",
    name == "get_weather" and "text" in json.loads(arguments) and finish == "tool_calls" and pieces >= 2,
    (name, arguments, finish, pieces),
)


def raises(what, cls, call, code=None):
    try:
        call()
    except cls as e:
        body_code = (e.body or {}).get("code") if isinstance(e.body, dict) else None
        check(what, code is None or body_code == code, f"{type(e).__name__} {e.status_code} {body_code}")
        return
    except openai.APIError as e:
        check(what, False, f"{type(e).__name__}: {e}")
    check(what, False, "no exception")


chat = lambda **kw: client.chat.completions.create(  # noqa: E731
    messages=[{"role": "user", "content": "hi"}], **kw
)
raises("an unknown model is NotFoundError", openai.NotFoundError, lambda: chat(model="no-such-model"), "model_not_found")
raises("a negative max_tokens is BadRequestError", openai.BadRequestError, lambda: chat(model="chat", max_tokens=-1))
raises("n=2 is BadRequestError", openai.BadRequestError, lambda: chat(model="chat", max_tokens=2, n=2))
raises(
    "a policy's refusal is PermissionDeniedError",
    openai.PermissionDeniedError,
    lambda: chat(model="chat", max_tokens=2, extra_headers={"x-data-class": "secret"}),
    "policy_rejected",
)
raises(
    "a tenant over its limit is RateLimitError",
    openai.RateLimitError,
    lambda: chat(model="chat", max_tokens=2, extra_headers={"x-tenant": "tiny"}),
    "rate_limit_exceeded",
)
raises(
    "a model without an engine up is InternalServerError (503)",
    openai.InternalServerError,
    lambda: chat(model="idle", max_tokens=2),
    "no_capacity",
)
try:
    chat(model="no-such-model", extra_headers={"x-request-id": "sdk-error-1"})
    check("an error names the client's request id", False, "no exception")
except openai.NotFoundError as e:
    check("an error names the client's request id", e.response.headers.get("x-request-id") == "sdk-error-1", e.response.headers)
print("openai sdk: all checks passed")
