#!/usr/bin/env python3
"""Generates the tokenizer parity fixtures in tokenize/tests/fixtures/ (committed).

For each model family it writes a directory with `tokenizer.json`, `tokenizer_config.json` and
`chat_template.jinja` (as Hugging Face `save_pretrained` does), and `cases.json`: requests and the
prompt token ids Hugging Face transformers computes for them - `apply_chat_template(messages,
tools=..., add_generation_prompt=True, tokenize=True)` for chat, `tokenizer(prompt)` for
completions. That is what vLLM computes too: it renders the template, then encodes without
adding special tokens for chat, with them for completions. Chat content given as a list of text
parts is joined with "\\n" first, as vLLM does for templates that take string content.

The tokenizer is a small byte-level BPE trained here on the text below (so no download is
needed), with the special tokens of both template styles: Llama 3 (a BOS token the template
writes and the post-processor adds for completions) and ChatML / Qwen 2 (no BOS, tools).

Needs: pip install "transformers>=4.45" tokenizers jinja2 (no torch).
Run: python3 scripts/gen-tokenizer-fixtures.py
"""

import json
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

OUT = os.path.join(os.path.dirname(__file__), "..", "tokenize", "tests", "fixtures")

CORPUS = """
The quick brown fox jumps over the lazy dog. A cache hit saves the prefill of every block it covers.
Routing a request to the engine that already holds its system prompt avoids recomputing thousands of tokens.
You are a helpful assistant. Answer briefly and precisely. Think step by step before answering.
What is the capital of France? The capital of France is Paris. What about Germany? Berlin.
def route(request, engines):\n    return min(engines, key=lambda e: e.predicted_ttft(request))\n
SELECT tenant, sum(tokens) FROM usage WHERE window = 60 GROUP BY tenant;
Large language models generate text one token at a time; the first token waits for the prefill.
Kubernetes runs the control plane as a StatefulSet with three replicas and a persistent volume each.
Les modèles de langage répondent en français, avec des accents: é, è, ê, à, ç, ô, ü.
Der schnelle braune Fuchs springt über den faulen Hund. Größe, Straße, Übung.
日本語のテキストも扱えます。東京は日本の首都です。中文：缓存命中可以节省预填充时间。
Emoji and symbols: 🚀 ✅ ❤️ 👍 → ← ∑ ∞ ≈ ≠ €100 £20 ¥3000.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2024 3.14159 -42 1e10.
JSON: {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
Tool calls return results that the model reads before it answers the user.
"""

SPECIALS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eot_id|>", "<|python_tag|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>",
]

LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{%- if tools is not none %}
    {%- set system_message = system_message + "\\n\\nYou have access to the following functions:\\n\\n" %}
    {%- for t in tools %}
        {%- set system_message = system_message + (t | tojson(indent=4)) + "\\n\\n" %}
    {%- endfor %}
{%- endif %}
{%- if system_message %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system_message + '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant', 'tool'] %}
        {{- raise_exception('roles must be user, assistant or tool after the system message') }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

CHATML_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- else %}
        {{- 'You are a helpful assistant.\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'tool' %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content.strip() + '\\n</tool_response><|im_end|>\\n' }}
    {%- elif message.role == 'assistant' and message.tool_calls %}
        {{- '<|im_start|>assistant\\n' + (message.content or '') }}
        {%- for call in message.tool_calls %}
            {{- '\\n<tool_call>\\n' + {'name': call.function.name, 'arguments': call.function.arguments} | tojson + '\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def train():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1200,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([line for line in CORPUS.splitlines() if line] * 3, trainer)
    return tok


def save(name, tok, template, bos, eos, add_bos):
    d = os.path.join(OUT, name)
    os.makedirs(d, exist_ok=True)
    tok = Tokenizer.from_str(tok.to_str())
    if add_bos:
        bos_id = tok.token_to_id(bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = template
    fast.save_pretrained(d)
    return fast


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city, now.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}

LONG = " ".join([CORPUS.replace("\n", " ")] * 12)

CHATS = [
    ("plain", {"messages": [{"role": "user", "content": "What is the capital of France?"}]}),
    ("system", {"messages": [
        {"role": "system", "content": "You are a helpful assistant. Answer briefly."},
        {"role": "user", "content": "Why does a cache hit help?"}]}),
    ("multi-turn", {"messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Germany?"}]}),
    ("unicode", {"messages": [
        {"role": "user", "content": "日本語のテキスト 🚀 Größe, Straße — été ça? ∑≈∞"}]}),
    ("whitespace", {"messages": [
        {"role": "system", "content": "  padded system  \n"},
        {"role": "user", "content": "\n\n  spaced   out\ttabs\t\n"}]}),
    ("text-parts", {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "First part."}, {"type": "text", "text": "Second part."}]}]}),
    ("long", {"messages": [
        {"role": "system", "content": LONG},
        {"role": "user", "content": "Summarize the text above."}]}),
    ("tools", {"messages": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": " {\"temperature\": 21, \"unit\": \"celsius\"} "}],
        "tools": [WEATHER]}),
]

COMPLETIONS = [
    ("plain", "The quick brown fox"),
    ("unicode", "東京は日本の首都です 🚀 Übung"),
    ("spaces", "  leading and trailing spaces  "),
    ("long", LONG),
]


def text_content(messages):
    out = []
    for m in messages:
        m = dict(m)
        if isinstance(m.get("content"), list):
            m["content"] = "\n".join(p["text"] for p in m["content"] if p.get("type") == "text")
        out.append(m)
    return out


def request(body):
    """The request body as a gateway sends it: JSON text (key order matters to `tojson`)."""
    return json.dumps(body, ensure_ascii=False)


def compact(cases):
    """cases.json with one line per case."""
    return "[\n" + ",\n".join(json.dumps(c, ensure_ascii=False) for c in cases) + "\n]\n"


def cases(fast, family):
    out = []
    for name, body in CHATS:
        if family == "llama3-style" and name == "tools":
            continue  # that template has no tool-call rendering
        ids = fast.apply_chat_template(
            text_content(body["messages"]), tools=body.get("tools"),
            add_generation_prompt=True, tokenize=True,
        )
        if hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        out.append({"name": f"chat/{name}", "body": request(dict(body, model=family)), "ids": list(ids)})
    if family == "llama3-style":
        body = {"messages": CHATS[1][1]["messages"], "tools": [WEATHER], "model": family}
        ids = fast.apply_chat_template(body["messages"], tools=body["tools"], add_generation_prompt=True, tokenize=True)
        out.append({"name": "chat/tools-in-system", "body": request(body), "ids": list(ids)})
    for name, prompt in COMPLETIONS:
        out.append({"name": f"completions/{name}", "body": request({"model": family, "prompt": prompt}),
                    "ids": fast(prompt)["input_ids"]})
    return out


def main():
    tok = train()
    families = [
        ("llama3-style", LLAMA3_TEMPLATE, "<|begin_of_text|>", "<|eot_id|>", True),
        ("chatml-style", CHATML_TEMPLATE, "<|endoftext|>", "<|im_end|>", False),
    ]
    for name, template, bos, eos, add_bos in families:
        fast = save(name, tok, template, bos, eos, add_bos)
        with open(os.path.join(OUT, name, "cases.json"), "w", encoding="utf-8") as f:
            f.write(compact(cases(fast, name)))
        print(name, "ok")


if __name__ == "__main__":
    main()
