//! Bedrock's ConverseStream answer (`application/vnd.amazon.eventstream`: binary frames, each a
//! JSON event, decoded by the AWS SDK's own `aws-smithy-eventstream`) told as OpenAI's
//! server-sent events while it arrives: `messageStart` opens the answer (a chat's role chunk),
//! each `contentBlockDelta`'s text is a chunk, `messageStop` is the chunk with the
//! `finish_reason`, `metadata` carries the usage (a chunk of its own when the client asked for
//! it), and the end of the stream is `[DONE]`. An exception frame ends the answer with an
//! OpenAI-shaped error event and no `[DONE]`. Only text is told: a delta of reasoning or of a
//! tool call is left out (tools are refused before the call), so a reasoning model's first
//! token is its first text.

use aws_smithy_eventstream::frame::read_message_from;
use aws_smithy_types::event_stream::{HeaderValue, Message};
use bytes::{Bytes, BytesMut};
use serde_json::{Value, json};

use super::{Asked, BedrockError, Used, finish_reason};

/// The content type of ConverseStream's answer.
pub(crate) const CONTENT_TYPE: &str = "application/vnd.amazon.eventstream";

/// The largest frame read: Converse's events are a text delta or a few counts each, far below
/// the event stream format's own limit (16 MiB of payload); a larger one is not Bedrock's.
const MAX_FRAME_BYTES: usize = 1 << 20;

/// One ConverseStream answer being told as OpenAI's events.
#[derive(Debug)]
pub(crate) struct ConverseStream {
    /// What arrived of the frame not yet whole.
    pending: BytesMut,
    asked: Asked,
    /// The events' common fields: id, object, created, model.
    head: Value,
    /// A frame came: Bedrock took the request (and counts its tokens).
    began: bool,
    /// The answer's text has begun (its first token).
    text_started: bool,
    stopped: bool,
    used: Option<Used>,
}

impl ConverseStream {
    /// For a request asked as `asked`, served as `model` under id `id` at `created` (Unix
    /// seconds).
    pub(crate) fn new(asked: Asked, model: &str, id: &str, created: u64) -> Self {
        let object = if asked.chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        Self {
            pending: BytesMut::new(),
            asked,
            head: json!({"id": id, "object": object, "created": created, "model": model}),
            began: false,
            text_started: false,
            stopped: false,
            used: None,
        }
    }

    /// Whether the answer's text has begun.
    pub(crate) fn text_started(&self) -> bool {
        self.text_started
    }

    /// Whether a frame came, so Bedrock took the request: what it used is then unknown until
    /// the stream's `metadata` says it, even if the answer fails.
    pub(crate) fn began(&self) -> bool {
        self.began
    }

    /// What the request used, once the stream's `metadata` said it.
    pub(crate) fn used(&self) -> Option<Used> {
        self.used
    }

    /// The events for the frames `bytes` completes (none while a frame is incomplete), and
    /// the error that ends the answer after them: a frame that cannot be read, or an exception
    /// Bedrock sent (see [`Self::error_event`]).
    pub(crate) fn feed(&mut self, bytes: &[u8]) -> (Bytes, Option<BedrockError>) {
        let mut sse = String::new();
        let error = self.frames(bytes, &mut sse).err();
        (Bytes::from(sse), error)
    }

    /// Appends to `sse` the events of the frames `bytes` completes.
    fn frames(&mut self, bytes: &[u8], sse: &mut String) -> Result<(), BedrockError> {
        self.pending.extend_from_slice(bytes);
        // A frame starts with its whole length (a big-endian u32, the prelude included); the
        // crate checks the rest (the prelude's and the message's checksums, the headers).
        while let Some(prefix) = self.pending.first_chunk::<4>() {
            let total = usize::try_from(u32::from_be_bytes(*prefix)).unwrap_or(usize::MAX);
            if total > MAX_FRAME_BYTES {
                return Err(BedrockError::Answer(format!(
                    "an event stream frame of {total} bytes (at most {MAX_FRAME_BYTES})"
                )));
            }
            if self.pending.len() < total {
                break;
            }
            let frame = self.pending.split_to(total).freeze();
            let message = read_message_from(frame)
                .map_err(|e| BedrockError::Answer(format!("an event stream frame: {e}")))?;
            if let Some(event) = self.event(&message)? {
                push_event(sse, &event);
            }
        }
        Ok(())
    }

    /// The events that close an answer whose stream ended: `[DONE]`, or an error when the
    /// stream ended before its `messageStop` or in the middle of a frame.
    pub(crate) fn finish(&self) -> Result<Bytes, BedrockError> {
        if !self.pending.is_empty() {
            return Err(BedrockError::Answer(
                "the event stream ended in the middle of a frame".into(),
            ));
        }
        if !self.stopped {
            return Err(BedrockError::Answer(
                "the event stream ended before its messageStop".into(),
            ));
        }
        Ok(Bytes::from_static(b"data: [DONE]\n\n"))
    }

    /// The event that ends an answer with `error` (OpenAI's error shape, as its API streams
    /// one).
    pub(crate) fn error_event(error: &BedrockError) -> Bytes {
        let mut sse = String::new();
        push_event(
            &mut sse,
            &json!({"error": {"message": error.to_string(), "type": "server_error",
                "param": null, "code": "bad_gateway"}}),
        );
        Bytes::from(sse)
    }

    /// The OpenAI event for one frame, if it makes one.
    fn event(&mut self, message: &Message) -> Result<Option<Value>, BedrockError> {
        let header = |name: &str| {
            message
                .headers()
                .iter()
                .find(|h| h.name().as_str() == name)
                .and_then(|h| match h.value() {
                    HeaderValue::String(s) => Some(s.as_str().to_owned()),
                    _ => None,
                })
        };
        self.began = true;
        match header(":message-type").as_deref() {
            Some("event") => {}
            Some("exception") => {
                return Err(BedrockError::Stream {
                    kind: header(":exception-type").unwrap_or_else(|| "an exception".into()),
                    message: super::error_message(message.payload()),
                });
            }
            Some("error") => {
                return Err(BedrockError::Stream {
                    kind: header(":error-code").unwrap_or_else(|| "an error".into()),
                    message: header(":error-message").unwrap_or_default(),
                });
            }
            other => {
                return Err(BedrockError::Answer(format!(
                    "an event stream message of type {}",
                    other.unwrap_or("none")
                )));
            }
        }
        let payload: Value = if message.payload().is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(message.payload())
                .map_err(|e| BedrockError::Answer(format!("an event's payload: {e}")))?
        };
        Ok(match header(":event-type").as_deref() {
            Some("messageStart") if self.asked.chat => {
                Some(self.chunk(json!({"role": "assistant", "content": ""}), Value::Null))
            }
            Some("contentBlockDelta") => match payload["delta"]["text"].as_str() {
                Some(text) if !text.is_empty() => {
                    self.text_started = true;
                    let content = if self.asked.chat {
                        json!({ "content": text })
                    } else {
                        json!(text)
                    };
                    Some(self.chunk(content, Value::Null))
                }
                _ => None,
            },
            Some("messageStop") => {
                self.stopped = true;
                let finish = finish_reason(payload["stopReason"].as_str());
                let empty = if self.asked.chat {
                    json!({})
                } else {
                    json!("")
                };
                Some(self.chunk(empty, json!(finish)))
            }
            Some("metadata") => {
                let (used, usage) = Used::from_converse(&payload["usage"]);
                self.used = Some(used);
                self.asked.include_usage.then(|| {
                    let mut e = self.head.clone();
                    e["choices"] = json!([]);
                    e["usage"] = usage;
                    e
                })
            }
            // contentBlockStart/Stop, a completion's messageStart, events added later.
            _ => None,
        })
    }

    /// A chunk whose one choice is `content` (a chat's delta, a completion's text).
    fn chunk(&self, content: Value, finish: Value) -> Value {
        let key = if self.asked.chat { "delta" } else { "text" };
        let mut e = self.head.clone();
        e["choices"] = json!([{"index": 0, key: content, "finish_reason": finish}]);
        e
    }
}

fn push_event(sse: &mut String, event: &Value) {
    sse.push_str("data: ");
    sse.push_str(&event.to_string());
    sse.push_str("\n\n");
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use aws_smithy_eventstream::frame::write_message_to;
    use aws_smithy_types::event_stream::Header;

    use super::*;

    /// A frame as Bedrock sends it, encoded by the AWS SDK's own encoder.
    fn frame(message_type: &str, kind: (&str, &str), payload: Value) -> Vec<u8> {
        let message = Message::new(payload.to_string())
            .add_header(Header::new(
                ":message-type",
                HeaderValue::String(message_type.to_owned().into()),
            ))
            .add_header(Header::new(
                kind.0.to_owned(),
                HeaderValue::String(kind.1.to_owned().into()),
            ))
            .add_header(Header::new(
                ":content-type",
                HeaderValue::String("application/json".into()),
            ));
        let mut out = Vec::new();
        write_message_to(&message, &mut out).unwrap();
        out
    }

    fn event(kind: &str, payload: Value) -> Vec<u8> {
        frame("event", (":event-type", kind), payload)
    }

    fn answer() -> Vec<u8> {
        [
            event("messageStart", json!({"role": "assistant"})),
            event("contentBlockDelta", json!({"contentBlockIndex": 0, "delta": {"text": "Hello"}})),
            event("contentBlockDelta", json!({"contentBlockIndex": 0, "delta": {"text": " world"}})),
            event("contentBlockStop", json!({"contentBlockIndex": 0})),
            event("messageStop", json!({"stopReason": "max_tokens"})),
            event(
                "metadata",
                json!({"usage": {"inputTokens": 12, "outputTokens": 2, "totalTokens": 14}, "metrics": {"latencyMs": 9}}),
            ),
        ]
        .concat()
    }

    fn events(sse: &[u8]) -> Vec<String> {
        String::from_utf8(sse.to_vec())
            .unwrap()
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: ").map(str::to_owned))
            .collect()
    }

    const CHAT: Asked = Asked {
        chat: true,
        stream: true,
        include_usage: true,
    };

    #[test]
    fn a_converse_stream_fed_a_byte_at_a_time_becomes_openais_events() {
        let mut s = ConverseStream::new(CHAT, "m", "id-1", 7);
        let mut sse = Vec::new();
        for b in answer() {
            let (events, error) = s.feed(&[b]);
            assert!(error.is_none(), "{error:?}");
            sse.extend_from_slice(&events);
        }
        sse.extend_from_slice(&s.finish().unwrap());
        let events = events(&sse);
        assert_eq!(events.len(), 6, "{events:#?}");
        assert_eq!(events[5], "[DONE]");
        let e: Vec<Value> = events[..5]
            .iter()
            .map(|e| serde_json::from_str(e).unwrap())
            .collect();
        assert_eq!(e[0]["choices"][0]["delta"]["role"], "assistant");
        let text: String = e
            .iter()
            .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
            .collect();
        assert_eq!(text, "Hello world");
        assert_eq!(e[3]["choices"][0]["finish_reason"], "length");
        assert_eq!(e[4]["usage"]["total_tokens"], 14);
        assert_eq!(e[1]["object"], "chat.completion.chunk");
        assert_eq!(
            (e[1]["id"].as_str(), e[1]["created"].as_u64()),
            (Some("id-1"), Some(7))
        );
        assert_eq!(
            s.used(),
            Some(Used {
                prompt_tokens: 12,
                completion_tokens: 2
            })
        );
    }

    #[test]
    fn a_completion_streams_text_and_the_usage_only_when_asked() {
        let asked = Asked {
            chat: false,
            stream: true,
            include_usage: false,
        };
        let mut s = ConverseStream::new(asked, "m", "id-2", 7);
        let sse = [s.feed(&answer()).0, s.finish().unwrap()].concat();
        let events = events(&sse);
        let e: Value = serde_json::from_str(&events[0]).unwrap();
        assert_eq!(
            (e["object"].as_str(), e["choices"][0]["text"].as_str()),
            (Some("text_completion"), Some("Hello"))
        );
        assert_eq!(
            events.len(),
            4,
            "two texts, the finish, [DONE]: {events:#?}"
        );
        assert!(s.used().is_some(), "counted for the report all the same");
    }

    #[test]
    fn an_exception_or_a_stream_cut_short_is_an_error() {
        let head = [
            event("messageStart", json!({"role": "assistant"})),
            event(
                "contentBlockDelta",
                json!({"contentBlockIndex": 0, "delta": {"text": "par"}}),
            ),
        ]
        .concat();
        let mut cut = ConverseStream::new(CHAT, "m", "id-3", 7);
        assert_eq!(events(&cut.feed(&head).0).len(), 2);
        assert!(cut.text_started());
        let e = cut.finish().unwrap_err();
        assert!(e.to_string().contains("before its messageStop"), "{e}");
        let exception = frame(
            "exception",
            (":exception-type", "modelStreamErrorException"),
            json!({"message": "the model stopped"}),
        );
        // The events before the exception, read at once with it, are told all the same.
        let mut s = ConverseStream::new(CHAT, "m", "id-4", 7);
        let (told, e) = s.feed(&[head, exception].concat());
        assert_eq!(events(&told).len(), 2);
        let e = e.unwrap();
        assert_eq!(
            e.to_string(),
            "bedrock ended the answer with modelStreamErrorException: the model stopped"
        );
        let error: Value =
            serde_json::from_str(&events(&ConverseStream::error_event(&e))[0]).unwrap();
        assert_eq!(error["error"]["code"], "bad_gateway");
        // Not JSON, and no type: still the exception, in words.
        let message = Message::new("throttled, slow down").add_header(Header::new(
            ":message-type",
            HeaderValue::String("exception".into()),
        ));
        let mut bare = Vec::new();
        write_message_to(&message, &mut bare).unwrap();
        let e = ConverseStream::new(CHAT, "m", "id-7", 7)
            .feed(&bare)
            .1
            .unwrap();
        assert_eq!(
            e.to_string(),
            "bedrock ended the answer with an exception: throttled, slow down"
        );
        let mut half = ConverseStream::new(CHAT, "m", "id-5", 7);
        let whole = answer();
        assert!(half.feed(&whole[..whole.len() - 3]).1.is_none());
        let e = half.finish().unwrap_err();
        assert!(e.to_string().contains("middle of a frame"), "{e}");
        let mut bad = ConverseStream::new(CHAT, "m", "id-6", 7);
        let mut broken = event("messageStart", json!({}));
        let last = broken.len() - 1;
        broken[last] ^= 1;
        assert!(
            bad.feed(&broken).1.is_some(),
            "a frame whose checksum is wrong"
        );
    }
}
