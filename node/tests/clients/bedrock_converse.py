"""A Bedrock Converse endpoint for kvplane's tests, whose checks are botocore's: every request's
SigV4 signature is computed again by botocore's own signer (the AWS SDK for Python's) from the
keys given here, over the request as it arrived (method, path, the headers it names as signed,
body, its x-amz-date). A request that is not signed for service `bedrock` in the region with
these keys gets 403 with Bedrock's words; one that is gets a Converse answer naming the model
of its path and echoing its last message - unless that message is `busy` (429 with
`Retry-After: 7`, as a throttled provider), `fail` (424, the model failed) or `slow` (answered
after 30 s).

ConverseStream (`/model/<id>/converse-stream`) answers the same text as an event stream
(`application/vnd.amazon.eventstream`): messageStart, the text in two contentBlockDeltas,
contentBlockStop, messageStop, metadata with the usage. Every frame is read back by botocore's
own event-stream parser before it is sent. The last message `hold` stops the stream after its
first delta until `POST /release`; `break` sends a modelStreamErrorException after it.

Usage: bedrock_converse.py ACCESS_KEY_ID SECRET_ACCESS_KEY SESSION_TOKEN REGION
Prints "ready <port>" once listening on 127.0.0.1.
"""

import json
import struct
import sys
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote

from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from botocore.eventstream import EventStreamBuffer

AKID, SECRET, TOKEN, REGION = sys.argv[1:5]
PREFIX = "AWS4-HMAC-SHA256 "
RELEASE = threading.Event()


def frame(headers, payload):
    """One event-stream frame: string headers, a JSON payload; checked by botocore's parser."""
    encoded = b""
    for name, value in headers.items():
        n, v = name.encode(), value.encode()
        encoded += struct.pack(">B", len(n)) + n + b"\x07" + struct.pack(">H", len(v)) + v
    body = json.dumps(payload).encode()
    total = 12 + len(encoded) + len(body) + 4
    prelude = struct.pack(">II", total, len(encoded))
    prelude += struct.pack(">I", zlib.crc32(prelude))
    message = prelude + encoded + body
    message += struct.pack(">I", zlib.crc32(message))
    parser = EventStreamBuffer()
    parser.add_data(message)
    [parsed] = list(parser)
    assert parsed.headers == headers and parsed.payload == body, "botocore reads it back"
    return message


def event(kind, payload):
    return frame(
        {":message-type": "event", ":event-type": kind, ":content-type": "application/json"},
        payload,
    )


class Converse(BaseHTTPRequestHandler):
    def answer(self, status, body, headers=()):
        data = json.dumps(body).encode()
        self.send_response(status)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def refuse(self, why):
        self.answer(403, {"message": why})

    def stream(self, model, last):
        """The ConverseStream answer, frame by frame."""
        self.send_response(200)
        self.send_header("content-type", "application/vnd.amazon.eventstream")
        self.end_headers()
        self.wfile.write(event("messageStart", {"role": "assistant"}))
        self.wfile.write(
            event("contentBlockDelta", {"contentBlockIndex": 0, "delta": {"text": "%s heard:" % model}})
        )
        self.wfile.flush()
        if last == "hold":
            print("holding the stream", file=sys.stderr, flush=True)
            RELEASE.wait(60)
        if last == "break":
            self.wfile.write(
                frame(
                    {
                        ":message-type": "exception",
                        ":exception-type": "modelStreamErrorException",
                        ":content-type": "application/json",
                    },
                    {"message": "The model stopped"},
                )
            )
            return
        for kind, payload in [
            ("contentBlockDelta", {"contentBlockIndex": 0, "delta": {"text": " %s" % last}}),
            ("contentBlockStop", {"contentBlockIndex": 0}),
            ("messageStop", {"stopReason": "end_turn"}),
            (
                "metadata",
                {
                    "usage": {"inputTokens": 5, "outputTokens": 3, "totalTokens": 8},
                    "metrics": {"latencyMs": 1},
                },
            ),
        ]:
            self.wfile.write(event(kind, payload))

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        if self.path == "/release":
            RELEASE.set()
            return self.answer(200, {})
        auth = self.headers.get("authorization", "")
        if not auth.startswith(PREFIX):
            return self.refuse("Missing Authentication Token")
        parts = dict(p.strip().split("=", 1) for p in auth[len(PREFIX):].split(","))
        scope = parts.get("Credential", "").split("/")
        if len(scope) != 5 or scope[0] != AKID or scope[2:] != [REGION, "bedrock", "aws4_request"]:
            return self.refuse("The security token included in the request is invalid.")
        if self.headers.get("x-amz-security-token") != TOKEN:
            return self.refuse("The security token included in the request is invalid.")
        signed = parts.get("SignedHeaders", "").split(";")
        # What Bedrock needs signed: the host and the date, and the session token when sent.
        if not {"host", "x-amz-date", "x-amz-security-token"} <= set(signed):
            return self.refuse("Signed headers must include host, x-amz-date and x-amz-security-token")
        request = AWSRequest(
            method=self.command,
            url="http://%s%s" % (self.headers["host"], self.path),
            data=body,
            headers={h: self.headers[h] for h in signed},
        )
        request.context["timestamp"] = self.headers.get("x-amz-date", "")
        signer = SigV4Auth(Credentials(AKID, SECRET, TOKEN), "bedrock", REGION)
        canonical = signer.canonical_request(request)
        expected = signer.signature(signer.string_to_sign(request, canonical), request)
        if expected != parts.get("Signature"):
            return self.refuse(
                "The request signature we calculated does not match the signature you provided."
            )
        path = self.path.split("/")
        if len(path) != 4 or path[1] != "model" or path[3] not in ("converse", "converse-stream"):
            return self.answer(404, {"message": "unknown operation %s" % self.path})
        model = unquote(path[2])
        converse = json.loads(body)
        last = converse["messages"][-1]["content"][-1]["text"]
        if last == "busy":
            return self.answer(429, {"message": "Too many requests"}, [("retry-after", "7")])
        if last == "fail":
            return self.answer(424, {"message": "The model failed"})
        if last == "slow":
            print("slow request received", file=sys.stderr, flush=True)
            time.sleep(30)
        if path[3] == "converse-stream":
            return self.stream(model, last)
        self.answer(
            200,
            {
                "output": {
                    "message": {
                        "role": "assistant",
                        "content": [{"text": "%s heard: %s" % (model, last)}],
                    }
                },
                "stopReason": "end_turn",
                "usage": {"inputTokens": 5, "outputTokens": 3, "totalTokens": 8},
                "metrics": {"latencyMs": 1},
            },
        )

    def log_message(self, *args):
        pass


server = ThreadingHTTPServer(("127.0.0.1", 0), Converse)
print("ready %d" % server.server_address[1], flush=True)
server.serve_forever()
