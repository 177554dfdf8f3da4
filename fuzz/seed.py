#!/usr/bin/env python3
"""Writes the fuzz targets' seed corpus (fuzz/corpus/<target>/) from the repository's own
fixtures: vLLM-generated KV-event batches (ingest/tests/fixtures), the policy examples, the
tokenizer parity cases' request bodies, and ext_proc conversations built from them. Run from
anywhere; rerun when the fixtures change (the files are committed)."""

import glob
import hashlib
import json
import os
import struct

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "fuzz", "corpus")


def put(target, data):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    name = hashlib.sha1(data).hexdigest()
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def field(tag, wire, payload):
    key = varint((tag << 3) | wire)
    if wire == 2:
        return key + varint(len(payload)) + payload
    return key + payload


def headers_msg(pairs, end_of_stream):
    values = b"".join(
        field(1, 2, field(1, 2, k.encode()) + field(3, 2, v.encode())) for k, v in pairs
    )
    http_headers = field(1, 2, values) + (field(3, 0, varint(1)) if end_of_stream else b"")
    return field(2, 2, http_headers)  # ProcessingRequest.request_headers


def body_msg(tag, body, end_of_stream):
    http_body = field(1, 2, body) + (field(2, 0, varint(1)) if end_of_stream else b"")
    return field(tag, 2, http_body)  # request_body = 4, response_body = 5


def framed(messages):
    return b"".join(struct.pack(">H", len(m)) + m for m in messages)


def main():
    # Engine messages: subject line, then payload.
    for path in sorted(glob.glob(os.path.join(ROOT, "ingest/tests/fixtures/vllm-events/*.json"))):
        case = json.load(open(path))
        for b in case.get("batches", [])[:6]:
            payload = bytes.fromhex(b["payload"])
            subject = "kvplane.kv.default.%s" % b["worker"]
            if b.get("dp_rank"):
                subject += ".%d" % b["dp_rank"]
            put("ingest_message", subject.encode() + b"\n" + payload)
    for path in sorted(glob.glob(os.path.join(ROOT, "ingest/tests/fixtures/vllm-kv-events/*.msgpack"))):
        put("ingest_message", b"kvplane.kv.default.w0\n" + open(path, "rb").read())
    put(
        "ingest_message",
        b'kvplane.metrics.default.w0\n{"num_requests_running":3,"num_requests_waiting":1,'
        b'"kv_cache_usage_perc":0.42,"prefix_cache_hit_rate":0.5,'
        b'"time_to_first_token_seconds_sum":12.5,"time_to_first_token_seconds_count":80}',
    )
    put("ingest_message", b'kvplane.worker.default.w0\n{"status":"up","address":"http://10.0.0.7:8000"}')
    put("ingest_message", b'kvplane.worker.default.w0\n{"status":"down"}')

    # vLLM's /metrics text.
    put(
        "vllm_metrics_text",
        b"# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        b"# TYPE vllm:num_requests_running gauge\n"
        b'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
        b'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0\n'
        b'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.42\n'
        b'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0\n'
        b'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 500.0\n'
        b'vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 12.5\n'
        b'vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 80.0\n',
    )

    # Policy files.
    for path in sorted(
        glob.glob(os.path.join(ROOT, "examples/policies/*.yaml"))
        + glob.glob(os.path.join(ROOT, "examples/policies-broken/*.yaml"))
    ):
        put("policy_yaml", open(path, "rb").read())
    put(
        "policy_yaml",
        b"apiVersion: kvplane.io/v1alpha1\nkind: AccessPolicy\nmetadata: {name: a}\n"
        b"spec: {identities: ['spiffe://a/*'], rights: [route, read], tenants: [acme]}\n",
    )

    # Request bodies: the tokenizer parity cases, and completions.
    bodies = []
    for path in sorted(glob.glob(os.path.join(ROOT, "tokenize/tests/fixtures/*/cases.json"))):
        for case in json.load(open(path)):
            bodies.append(case["body"].encode())
    for model in ["chat", "assistant", "standard-model", "llama-8b"]:
        bodies.append(json.dumps({"model": model, "prompt": "hello world " * 20, "max_tokens": 16}).encode())
        bodies.append(json.dumps({"model": model, "messages": [{"role": "user", "content": "my email is a@b.co"}]}).encode())
    for b in bodies:
        put("route_body", b)
        put("chat_template", b)

    # ext_proc: headers then the body (whole or in two chunks), then an SSE answer.
    for b in bodies[:12]:
        h = headers_msg(
            [(":method", "POST"), (":path", "/v1/chat/completions"), ("content-type", "application/json"), ("x-tenant", "acme"), ("x-request-id", "r1")],
            False,
        )
        half = len(b) // 2
        answer = [
            headers_msg([(":status", "200"), ("content-type", "text/event-stream")], False).replace(b"\x12", b"\x1a", 1),
            body_msg(5, b'data: {"choices":[],"usage":{"prompt_tokens":8,"completion_tokens":2}}\n\ndata: [DONE]\n\n', True),
        ]
        put("ext_proc", framed([h, body_msg(4, b, True)] + answer))
        put("ext_proc", framed([h, body_msg(4, b[:half], False), body_msg(4, b[half:], True)]))


if __name__ == "__main__":
    main()
