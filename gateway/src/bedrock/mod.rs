//! Amazon Bedrock's Converse API, for providers of `api: Bedrock`: an OpenAI chat (or
//! completions) body becomes a Converse request (`converse`, or `converse-stream` when the
//! client asked for a stream), signed with SigV4 by `aws-sigv4` (service `bedrock`, the
//! provider's region, keys from its Secret), and the answer becomes OpenAI's: a
//! `chat.completion` (or `text_completion`), or OpenAI's server-sent events told from
//! ConverseStream's event stream as it arrives ([`stream`]). Bedrock's own errors
//! (`{"message": ...}`) come back in OpenAI's error shape.

pub(crate) mod stream;

use std::time::SystemTime;

use aws_credential_types::Credentials;
use aws_sigv4::http_request::{SignableBody, SignableRequest, SigningSettings, sign};
use aws_sigv4::sign::v4;
use bytes::Bytes;
use serde_json::{Value, json};

/// The AWS keys and region a request is signed with.
#[derive(Clone)]
pub(crate) struct Aws {
    pub(crate) access_key_id: String,
    pub(crate) secret_access_key: String,
    pub(crate) session_token: Option<String>,
    pub(crate) region: String,
}

impl std::fmt::Debug for Aws {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Aws")
            .field("region", &self.region)
            .finish_non_exhaustive()
    }
}

/// What the client asked of the answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Asked {
    /// `/v1/chat/completions` (else `/v1/completions`).
    pub(crate) chat: bool,
    pub(crate) stream: bool,
    pub(crate) include_usage: bool,
}

/// A request Bedrock cannot be sent, or an answer that cannot be read.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BedrockError {
    #[error("the request cannot be sent to bedrock: {0}")]
    Request(String),
    #[error("the request cannot be signed: {0}")]
    Sign(String),
    #[error("bedrock's answer cannot be read: {0}")]
    Answer(String),
    #[error("bedrock ended the answer with {kind}: {message}")]
    Stream { kind: String, message: String },
}

/// The Converse request for OpenAI body `body` sent to `path`, and what the client asked.
pub(crate) fn converse_request(body: &[u8], path: &str) -> Result<(Vec<u8>, Asked), BedrockError> {
    let bad = |m: &str| BedrockError::Request(m.to_owned());
    let v: Value = serde_json::from_slice(body).map_err(|e| bad(&e.to_string()))?;
    let chat = path.ends_with("/chat/completions");
    for unsupported in [
        "tools",
        "tool_choice",
        "functions",
        "response_format",
        "logprobs",
    ] {
        if v.get(unsupported)
            .is_some_and(|x| !x.is_null() && *x != Value::Bool(false))
        {
            return Err(bad(&format!(
                "{unsupported} cannot be sent to bedrock through this gateway"
            )));
        }
    }
    if v.get("n").and_then(Value::as_u64).is_some_and(|n| n > 1) {
        return Err(bad("bedrock answers one choice (n must be 1)"));
    }
    let mut system = Vec::new();
    // Converse wants turns that alternate, user first: consecutive messages of one role are
    // one turn of several text blocks.
    let mut messages: Vec<(&str, Vec<Value>)> = Vec::new();
    let turn = |role: &'static str, text: String, messages: &mut Vec<(&str, Vec<Value>)>| {
        if text.trim().is_empty() {
            return;
        }
        match messages.last_mut() {
            Some((r, blocks)) if *r == role => blocks.push(json!({ "text": text })),
            _ => messages.push((role, vec![json!({ "text": text })])),
        }
    };
    if chat {
        let list = v["messages"]
            .as_array()
            .ok_or_else(|| bad("messages must be an array"))?;
        for m in list {
            let text = text_of(&m["content"]).ok_or_else(|| {
                bad("only text content can be sent to bedrock (a string, or text parts)")
            })?;
            match m["role"].as_str() {
                Some("system" | "developer") => {
                    if !text.trim().is_empty() {
                        system.push(json!({ "text": text }));
                    }
                }
                Some("user") => turn("user", text, &mut messages),
                Some("assistant") => turn("assistant", text, &mut messages),
                other => {
                    return Err(bad(&format!(
                        "a message of role {other:?} cannot be sent to bedrock"
                    )));
                }
            }
        }
    } else {
        let prompt = v["prompt"]
            .as_str()
            .ok_or_else(|| bad("prompt must be a string"))?;
        turn("user", prompt.to_owned(), &mut messages);
    }
    match messages.first() {
        None => return Err(bad("bedrock needs a message with text")),
        Some((role, _)) if *role != "user" => {
            return Err(bad(
                "bedrock needs the conversation to start with a user message",
            ));
        }
        Some(_) => {}
    }
    let messages: Vec<Value> = messages
        .into_iter()
        .map(|(role, content)| json!({"role": role, "content": content}))
        .collect();
    let mut config = serde_json::Map::new();
    let max = v
        .get("max_completion_tokens")
        .or_else(|| v.get("max_tokens"));
    if let Some(n) = max.and_then(Value::as_u64) {
        config.insert("maxTokens".into(), json!(n));
    }
    if let Some(t) = v.get("temperature").filter(|t| t.is_number()) {
        config.insert("temperature".into(), t.clone());
    }
    if let Some(t) = v.get("top_p").filter(|t| t.is_number()) {
        config.insert("topP".into(), t.clone());
    }
    match v.get("stop") {
        Some(Value::String(s)) => {
            config.insert("stopSequences".into(), json!([s]));
        }
        Some(Value::Array(a)) => {
            config.insert("stopSequences".into(), Value::Array(a.clone()));
        }
        _ => {}
    }
    let mut out = json!({ "messages": messages });
    if !system.is_empty() {
        out["system"] = Value::Array(system);
    }
    if !config.is_empty() {
        out["inferenceConfig"] = Value::Object(config);
    }
    let asked = Asked {
        chat,
        stream: v["stream"].as_bool().unwrap_or(false),
        include_usage: v["stream_options"]["include_usage"]
            .as_bool()
            .unwrap_or(false),
    };
    let bytes = serde_json::to_vec(&out).map_err(|e| bad(&e.to_string()))?;
    Ok((bytes, asked))
}

/// A message's text: a string, or the concatenated text of its text parts.
fn text_of(content: &Value) -> Option<String> {
    match content {
        Value::String(s) => Some(s.clone()),
        Value::Array(parts) => parts
            .iter()
            .map(|p| (p["type"] == "text").then(|| p["text"].as_str()).flatten())
            .collect::<Option<Vec<_>>>()
            .map(|t| t.concat()),
        _ => None,
    }
}

/// A path segment's characters left as they are (RFC 3986's unreserved ones).
const UNRESERVED: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'.')
    .remove(b'~');

/// The Converse URL of `model` under Bedrock endpoint `base` (ConverseStream's when
/// `stream`); a model id may hold `:` (`...-v1:0`), which goes in the path encoded.
pub(crate) fn converse_url(base: &str, model: &str, stream: bool) -> String {
    let id = percent_encoding::utf8_percent_encode(model, UNRESERVED);
    let operation = if stream {
        "converse-stream"
    } else {
        "converse"
    };
    format!("{}/model/{id}/{operation}", base.trim_end_matches('/'))
}

/// The headers that sign a `method` request to `url` with `headers` and `body` for AWS
/// service `service` at `time`: `x-amz-date`, `authorization` (and `x-amz-security-token`).
pub(crate) fn signature(
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    aws: &Aws,
    service: &str,
    time: SystemTime,
) -> Result<Vec<(String, String)>, BedrockError> {
    let err = |e: &dyn std::fmt::Display| BedrockError::Sign(e.to_string());
    let identity = Credentials::new(
        &aws.access_key_id,
        &aws.secret_access_key,
        aws.session_token.clone(),
        None,
        "kvplane",
    )
    .into();
    let params = v4::SigningParams::builder()
        .identity(&identity)
        .region(&aws.region)
        .name(service)
        .time(time)
        .settings(SigningSettings::default())
        .build()
        .map_err(|e| err(&e))?
        .into();
    let request = SignableRequest::new(
        method,
        url,
        headers.iter().copied(),
        SignableBody::Bytes(body),
    )
    .map_err(|e| err(&e))?;
    let (instructions, _) = sign(request, &params).map_err(|e| err(&e))?.into_parts();
    Ok(instructions
        .headers()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect())
}

/// What a Converse answer says the request used.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Used {
    pub(crate) prompt_tokens: u32,
    pub(crate) completion_tokens: u32,
}

impl Used {
    /// Converse's `usage` (`inputTokens`, `outputTokens`, `totalTokens`): what it counts and
    /// OpenAI's `usage` for it.
    pub(crate) fn from_converse(usage: &Value) -> (Used, Value) {
        let count = |k: &str| {
            usage[k]
                .as_u64()
                .map_or(0, |n| u32::try_from(n).unwrap_or(u32::MAX))
        };
        let used = Used {
            prompt_tokens: count("inputTokens"),
            completion_tokens: count("outputTokens"),
        };
        let openai = json!({
            "prompt_tokens": used.prompt_tokens,
            "completion_tokens": used.completion_tokens,
            "total_tokens": count("totalTokens"),
        });
        (used, openai)
    }
}

/// OpenAI's answer for Converse answer `converse` to a request asked as `asked` (not
/// streamed), served as `model` under id `id` at `created` (Unix seconds): the JSON body and
/// what the request used.
pub(crate) fn openai_answer(
    converse: &[u8],
    asked: Asked,
    model: &str,
    id: &str,
    created: u64,
) -> Result<(Bytes, Used), BedrockError> {
    let v: Value =
        serde_json::from_slice(converse).map_err(|e| BedrockError::Answer(e.to_string()))?;
    let text = v["output"]["message"]["content"]
        .as_array()
        .ok_or_else(|| BedrockError::Answer("no output.message.content".into()))?
        .iter()
        .filter_map(|c| c["text"].as_str())
        .collect::<String>();
    let (used, usage) = Used::from_converse(&v["usage"]);
    let finish = finish_reason(v["stopReason"].as_str());
    let (object, choice) = if asked.chat {
        (
            "chat.completion",
            json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}),
        )
    } else {
        (
            "text_completion",
            json!({"index": 0, "text": text, "finish_reason": finish}),
        )
    };
    let out = json!({
        "id": id, "object": object, "created": created, "model": model,
        "choices": [choice],
        "usage": usage,
    });
    Ok((Bytes::from(out.to_string()), used))
}

/// OpenAI's `finish_reason` for Converse's `stopReason`.
pub(crate) fn finish_reason(stop: Option<&str>) -> &'static str {
    match stop {
        Some("max_tokens") => "length",
        Some("tool_use") => "tool_calls",
        Some("content_filtered" | "guardrail_intervened") => "content_filter",
        _ => "stop",
    }
}

/// What Bedrock said in an error answer (`{"message": ...}`), else its body as text.
pub(crate) fn error_message(body: &[u8]) -> String {
    serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| {
            v.get("message")
                .or_else(|| v.get("Message"))
                .and_then(Value::as_str)
                .map(str::to_owned)
        })
        .unwrap_or_else(|| String::from_utf8_lossy(body).into_owned())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// aws-sigv4's own test suite (`aws-signing-test-suite/v4/post-vanilla`: context.json,
    /// request.txt, header-signed-request.txt), as the crate ships it.
    #[test]
    fn signing_matches_the_signing_crates_post_vanilla_vector() {
        let aws = Aws {
            access_key_id: "AKIDEXAMPLE".into(),
            secret_access_key: "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY".into(),
            session_token: None,
            region: "us-east-1".into(),
        };
        // 2015-08-30T12:36:00Z
        let time = SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_440_938_160);
        let sign = |headers: &[(&str, &str)]| {
            signature(
                "POST",
                "https://example.amazonaws.com/",
                headers,
                b"",
                &aws,
                "service",
                time,
            )
            .unwrap()
        };
        let headers = sign(&[("host", "example.amazonaws.com")]);
        assert_eq!(sign(&[]), headers, "the host is the URL's when not given");
        let get = |k: &str| {
            headers
                .iter()
                .find(|(n, _)| n.eq_ignore_ascii_case(k))
                .map(|(_, v)| v.as_str())
        };
        assert_eq!(get("x-amz-date"), Some("20150830T123600Z"));
        assert_eq!(
            get("authorization"),
            Some(
                "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20150830/us-east-1/service/aws4_request, SignedHeaders=host;x-amz-date, Signature=5da7c1a2acd57cee7505fc6676e4e544621c30862966e37dddb68e92efbe5d6b"
            )
        );
    }

    #[test]
    fn a_chat_body_becomes_a_converse_request() {
        let body = br#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"hi "},{"type":"text","text":"there"}]},{"role":"assistant","content":"hello"},{"role":"user","content":"more"}],"max_tokens":64,"temperature":0.5,"top_p":0.9,"stop":"END","stream":true,"stream_options":{"include_usage":true}}"#;
        let (req, asked) = converse_request(body, "/v1/chat/completions").unwrap();
        let v: Value = serde_json::from_slice(&req).unwrap();
        assert_eq!(
            v,
            json!({
                "system": [{"text": "be brief"}],
                "messages": [
                    {"role": "user", "content": [{"text": "hi there"}]},
                    {"role": "assistant", "content": [{"text": "hello"}]},
                    {"role": "user", "content": [{"text": "more"}]},
                ],
                "inferenceConfig": {"maxTokens": 64, "temperature": 0.5, "topP": 0.9, "stopSequences": ["END"]},
            })
        );
        assert_eq!(
            asked,
            Asked {
                chat: true,
                stream: true,
                include_usage: true
            }
        );
        let image = br#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]}"#;
        assert!(converse_request(image, "/v1/chat/completions").is_err());
    }

    #[test]
    fn turns_alternate_user_first_and_what_bedrock_cannot_take_is_refused() {
        let body = br#"{"messages":[{"role":"user","content":"a"},{"role":"user","content":""},{"role":"user","content":"b"},{"role":"assistant","content":"c"}]}"#;
        let (req, _) = converse_request(body, "/v1/chat/completions").unwrap();
        let v: Value = serde_json::from_slice(&req).unwrap();
        assert_eq!(
            v["messages"],
            json!([
                {"role": "user", "content": [{"text": "a"}, {"text": "b"}]},
                {"role": "assistant", "content": [{"text": "c"}]},
            ])
        );
        for (body, why) in [
            (
                &br#"{"messages":[{"role":"assistant","content":"a"}]}"#[..],
                "start with a user",
            ),
            (
                br#"{"messages":[{"role":"system","content":"a"}]}"#,
                "needs a message",
            ),
            (
                br#"{"messages":[{"role":"user","content":"a"}],"tools":[{}]}"#,
                "tools",
            ),
            (
                br#"{"messages":[{"role":"user","content":"a"}],"n":2}"#,
                "one choice",
            ),
        ] {
            let e = converse_request(body, "/v1/chat/completions").unwrap_err();
            assert!(e.to_string().contains(why), "{e}");
        }
    }

    #[test]
    fn a_model_id_with_a_colon_is_encoded_in_the_path() {
        assert_eq!(
            converse_url(
                "https://bedrock-runtime.us-east-1.amazonaws.com/",
                "anthropic.claude-3-haiku-20240307-v1:0",
                false
            ),
            "https://bedrock-runtime.us-east-1.amazonaws.com/model/anthropic.claude-3-haiku-20240307-v1%3A0/converse"
        );
        assert!(converse_url("https://b.example", "m", true).ends_with("/model/m/converse-stream"));
    }

    #[test]
    fn a_converse_answer_becomes_openais() {
        let converse = br#"{"output":{"message":{"role":"assistant","content":[{"text":"Hello"},{"text":" world"}]}},"stopReason":"max_tokens","usage":{"inputTokens":12,"outputTokens":2,"totalTokens":14},"metrics":{"latencyMs":100}}"#;
        let chat = Asked {
            chat: true,
            stream: false,
            include_usage: false,
        };
        let (body, used) = openai_answer(converse, chat, "m", "id-1", 7).unwrap();
        assert_eq!((used.prompt_tokens, used.completion_tokens), (12, 2));
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(v["choices"][0]["message"]["content"], "Hello world");
        assert_eq!(v["choices"][0]["finish_reason"], "length");
        assert_eq!(v["usage"]["total_tokens"], 14);
        let completion = Asked {
            chat: false,
            ..chat
        };
        let (body, _) = openai_answer(converse, completion, "m", "id-1", 7).unwrap();
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            (v["object"].as_str(), v["choices"][0]["text"].as_str()),
            (Some("text_completion"), Some("Hello world"))
        );
    }
}
