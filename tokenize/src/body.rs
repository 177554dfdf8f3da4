//! Prompt extraction from `/v1/completions` and `/v1/chat/completions` bodies.

use serde_json::Value;

use crate::{ModelTokenizer, TokenizeError, WordTokenizer};

/// Where the prompt tokens came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptSource {
    /// The caller supplied token ids (in the request or as a completions token array).
    TokenIds,
    /// A completions `prompt` string.
    Completions,
    /// Chat `messages` rendered with the built-in template.
    Chat,
}

impl PromptSource {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::TokenIds => "token_ids",
            Self::Completions => "completions",
            Self::Chat => "chat",
        }
    }
}

/// A request's prompt, as kvplane sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prompt {
    pub tokens: Vec<u32>,
    /// Tokens after `tokens` that were not encoded, estimated from their length (see
    /// [`prompt_from_body_until`]; 0 otherwise).
    pub estimated_rest: usize,
    pub source: PromptSource,
    /// The body's `model`, when present.
    pub model: Option<String>,
    /// The body's `max_tokens` / `max_completion_tokens`, when present.
    pub max_tokens: Option<u32>,
}

/// The fields of a body that decide how to read the rest.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BodyFields {
    pub model: Option<String>,
    /// `max_tokens`, else `max_completion_tokens`.
    pub max_tokens: Option<u32>,
    /// vLLM's `cache_salt`.
    pub cache_salt: Option<String>,
    /// Whether the body has `messages`: a chat body, whose prompt a model's own template
    /// reads from the bytes.
    pub chat: bool,
}

#[derive(serde::Deserialize)]
struct RawFields {
    #[serde(default)]
    model: Option<Value>,
    #[serde(default)]
    max_tokens: Option<Value>,
    #[serde(default)]
    max_completion_tokens: Option<Value>,
    #[serde(default)]
    cache_salt: Option<Value>,
    /// Only whether it is there: the chat template reads the messages from the bytes.
    #[serde(default)]
    messages: Option<serde::de::IgnoredAny>,
}

fn raw_fields(body: &[u8]) -> Result<RawFields, TokenizeError> {
    serde_json::from_slice(body).map_err(|e| TokenizeError::InvalidJson(e.to_string()))
}

/// The model and output limit of a body, without reading its prompt.
pub fn body_fields(body: &[u8]) -> Result<BodyFields, TokenizeError> {
    Ok(fields_of(raw_fields(body)?))
}

fn fields_of(raw: RawFields) -> BodyFields {
    BodyFields {
        model: raw.model.and_then(|m| m.as_str().map(str::to_owned)),
        max_tokens: raw
            .max_tokens
            .or(raw.max_completion_tokens)
            .and_then(|n| n.as_u64())
            .map(|n| u32::try_from(n).unwrap_or(u32::MAX)),
        cache_salt: raw
            .cache_salt
            .and_then(|s| s.as_str().map(str::to_owned))
            .filter(|s| !s.is_empty()),
        chat: raw.messages.is_some(),
    }
}

/// Parses an OpenAI-style body and tokenizes its prompt.
///
/// Completions: `prompt` as a string, an array of token ids, or an array holding one string.
/// Chat: `messages`, each `{role, content}` with string content or an array of `{type: "text"}`
/// parts; other part types are refused. Rendering is [`render_chat`].
pub fn prompt_from_body(body: &[u8]) -> Result<Prompt, TokenizeError> {
    prompt_from_body_with(body, None)
}

/// As [`prompt_from_body`], with the model's own tokenizer and chat template when it has them
/// (see [`ModelTokenizer`]); token ids given in the body are taken as they are either way.
pub fn prompt_from_body_with(
    body: &[u8],
    tokenizer: Option<&ModelTokenizer>,
) -> Result<Prompt, TokenizeError> {
    prompt_from_body_until(body, None, tokenizer, &mut |_| true, true)
}

/// As [`prompt_from_body_with`], but a chat prompt is encoded with the model's tokenizer only
/// as far as `still_cached(ids so far)` holds (see [`ModelTokenizer::encode_chat_until`]):
/// once no engine can hold the prompt that far, the rest is only counted, roughly.
/// `remember`: whether what is encoded enters the tokenizer's piece cache. `read`: the body's
/// fields when the caller has read them already ([`body_fields`]), so the body is not read
/// for them again.
pub fn prompt_from_body_until(
    body: &[u8],
    read: Option<BodyFields>,
    tokenizer: Option<&ModelTokenizer>,
    still_cached: &mut dyn FnMut(&[u32]) -> bool,
    remember: bool,
) -> Result<Prompt, TokenizeError> {
    // A chat body for a model's own template: read once for its fields (skipping the
    // messages), once by the template, never copied into a JSON tree.
    if let Some(t) = tokenizer {
        let f = match read {
            Some(f) => f,
            None => body_fields(body)?,
        };
        if f.chat {
            let (tokens, estimated_rest) = t.encode_chat_until(body, still_cached, remember)?;
            return Ok(Prompt {
                tokens,
                estimated_rest,
                source: PromptSource::Chat,
                model: f.model,
                max_tokens: f.max_tokens,
            });
        }
    }
    let v: Value =
        serde_json::from_slice(body).map_err(|e| TokenizeError::InvalidJson(e.to_string()))?;
    let model = v.get("model").and_then(Value::as_str).map(str::to_owned);
    let max_tokens = v
        .get("max_tokens")
        .or_else(|| v.get("max_completion_tokens"))
        .and_then(Value::as_u64)
        .map(|n| u32::try_from(n).unwrap_or(u32::MAX));
    if let Some(messages) = v.get("messages") {
        let tokens = match tokenizer {
            Some(t) => t.encode_chat(body)?,
            None => WordTokenizer.encode(&render_chat(messages)?),
        };
        return Ok(Prompt {
            tokens,
            estimated_rest: 0,
            source: PromptSource::Chat,
            model,
            max_tokens,
        });
    }
    let text = |s: &str| match tokenizer {
        Some(t) => t.encode_completion(s),
        None => Ok(WordTokenizer.encode(s)),
    };
    let (tokens, source) = match v.get("prompt") {
        Some(Value::String(s)) => (text(s)?, PromptSource::Completions),
        Some(Value::Array(items)) => completions_array(items, text)?,
        Some(_) => {
            return Err(TokenizeError::Unsupported {
                field: "prompt",
                reason: "must be a string or an array".into(),
            });
        }
        None => return Err(TokenizeError::NoPrompt),
    };
    Ok(Prompt {
        tokens,
        estimated_rest: 0,
        source,
        model,
        max_tokens,
    })
}

fn completions_array(
    items: &[Value],
    text: impl Fn(&str) -> Result<Vec<u32>, TokenizeError>,
) -> Result<(Vec<u32>, PromptSource), TokenizeError> {
    match items {
        [Value::String(s)] => Ok((text(s)?, PromptSource::Completions)),
        _ => items
            .iter()
            .map(|t| {
                t.as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .ok_or_else(|| TokenizeError::Unsupported {
                        field: "prompt",
                        reason: "an array prompt must be token ids or one string".into(),
                    })
            })
            .collect::<Result<Vec<_>, _>>()
            .map(|ids| (ids, PromptSource::TokenIds)),
    }
}

/// Renders chat messages with kvplane's built-in template:
/// `<|role|>\n{content}\n` for each message, then `<|assistant|>\n` (the generation prompt).
pub fn render_chat(messages: &Value) -> Result<String, TokenizeError> {
    let Value::Array(messages) = messages else {
        return Err(TokenizeError::Unsupported {
            field: "messages",
            reason: "must be an array".into(),
        });
    };
    let mut out = String::new();
    for (i, m) in messages.iter().enumerate() {
        let role =
            m.get("role")
                .and_then(Value::as_str)
                .ok_or_else(|| TokenizeError::Unsupported {
                    field: "messages",
                    reason: format!("message {i} has no string `role`"),
                })?;
        out.push_str("<|");
        out.push_str(role);
        out.push_str("|>\n");
        match m.get("content") {
            Some(Value::String(s)) => out.push_str(s),
            Some(Value::Array(parts)) => {
                for part in parts {
                    match (
                        part.get("type").and_then(Value::as_str),
                        part.get("text").and_then(Value::as_str),
                    ) {
                        (Some("text"), Some(t)) => out.push_str(t),
                        (kind, _) => {
                            return Err(TokenizeError::Unsupported {
                                field: "messages",
                                reason: format!(
                                    "message {i} has a content part of type {} (only text is routed)",
                                    kind.unwrap_or("unknown")
                                ),
                            });
                        }
                    }
                }
            }
            Some(Value::Null) | None => {}
            Some(_) => {
                return Err(TokenizeError::Unsupported {
                    field: "messages",
                    reason: format!("message {i} content must be a string or an array"),
                });
            }
        }
        out.push('\n');
    }
    out.push_str("<|assistant|>\n");
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completions_string_prompt_is_tokenized() {
        let p =
            prompt_from_body(br#"{"model":"m","prompt":"hello world","max_tokens":7}"#).unwrap();
        assert_eq!(p.tokens, WordTokenizer.encode("hello world"));
        assert_eq!(p.source, PromptSource::Completions);
        assert_eq!(p.model.as_deref(), Some("m"));
        assert_eq!(p.max_tokens, Some(7));
    }

    #[test]
    fn completions_token_array_is_taken_as_is() {
        let p = prompt_from_body(br#"{"prompt":[1,2,3]}"#).unwrap();
        assert_eq!(p.tokens, vec![1, 2, 3]);
        assert_eq!(p.source, PromptSource::TokenIds);
    }

    #[test]
    fn chat_messages_sharing_a_system_prompt_share_a_token_prefix() {
        let a = prompt_from_body(
            br#"{"messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"hi"}]}"#,
        )
        .unwrap();
        let b = prompt_from_body(
            br#"{"messages":[{"role":"system","content":"You are terse."},{"role":"user","content":[{"type":"text","text":"bye now"}]}]}"#,
        )
        .unwrap();
        let sys = WordTokenizer.encode("<|system|>\nYou are terse.\n");
        assert_eq!(&a.tokens[..sys.len()], &sys[..]);
        assert_eq!(&b.tokens[..sys.len()], &sys[..]);
        assert_eq!(a.source, PromptSource::Chat);
    }

    #[test]
    fn bad_bodies_are_clear_errors() {
        assert!(matches!(
            prompt_from_body(b"{nope"),
            Err(TokenizeError::InvalidJson(_))
        ));
        assert_eq!(
            prompt_from_body(br#"{"model":"m"}"#),
            Err(TokenizeError::NoPrompt)
        );
        let image =
            br#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{}}]}]}"#;
        assert!(matches!(
            prompt_from_body(image),
            Err(TokenizeError::Unsupported { .. })
        ));
    }
}
