//! A model's own tokenizer: Hugging Face `tokenizer.json` and the chat template of
//! `tokenizer_config.json` (or `chat_template.jinja`), giving the prompt token ids vLLM gives.
//!
//! - Chat (`/v1/chat/completions`): the template is rendered as transformers renders it (Jinja
//!   with `trim_blocks` and `lstrip_blocks`, Python string methods, `raise_exception`,
//!   `strftime_now`, a `tojson` that writes what Python's `json.dumps` writes) with `messages`,
//!   `tools`, `add_generation_prompt` (default true), the special tokens and the request's
//!   `chat_template_kwargs`; the text is then encoded **without** adding special tokens (the
//!   template writes its own BOS, so there is never a second one).
//! - Message content as text parts is joined with `\n` (as vLLM does for string-content
//!   templates); image, audio, video and file parts are refused with the part's type, since their
//!   placeholder tokens depend on the engine's processor. Tool-call `arguments` given as a JSON
//!   string are passed to the template as the object they encode, as vLLM does.
//! - Completions (`/v1/completions`): the prompt is encoded **with** the tokenizer's special
//!   tokens (its post-processor, e.g. a BOS).
//!
//! A tokenizer is loaded once (the template compiled once) and shared by reference; bad or
//! missing files are a [`LoadError`] at load, never a failure at request time.

use std::path::{Path, PathBuf};

use minijinja::value::{Value as JValue, ValueKind};
use minijinja::{Environment, ErrorKind};
use serde_json::Value;

use crate::TokenizeError;

/// Why a model's tokenizer files could not be loaded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    #[error("{path}: {reason}")]
    File { path: PathBuf, reason: String },
    #[error("{path}: the chat template does not compile: {reason}")]
    Template { path: PathBuf, reason: String },
}

/// One model's tokenizer and chat template.
pub struct ModelTokenizer {
    dir: PathBuf,
    tokenizer: tokenizers::Tokenizer,
    /// Holds the template named `chat` when the model has one.
    env: Environment<'static>,
    has_template: bool,
    /// Special tokens the template may use (`bos_token`, `eos_token`, ...).
    special: Vec<(&'static str, String)>,
    /// Chat prompts piece by piece, repeated pieces from a cache (see [`crate::segments`]).
    segments: Option<crate::segments::Segmenter>,
}

impl std::fmt::Debug for ModelTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelTokenizer")
            .field("dir", &self.dir)
            .field("has_template", &self.has_template)
            .finish_non_exhaustive()
    }
}

fn read(path: &Path) -> Result<String, LoadError> {
    std::fs::read_to_string(path).map_err(|e| LoadError::File {
        path: path.to_owned(),
        reason: e.to_string(),
    })
}

/// A special token in `tokenizer_config.json`: a string, or an added-token object.
fn token_text(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_owned),
        _ => None,
    }
}

impl ModelTokenizer {
    /// Loads `dir/tokenizer.json`, and `dir/tokenizer_config.json` with its chat template (or
    /// `dir/chat_template.jinja`, which takes precedence, as in transformers).
    pub fn load(dir: &Path) -> Result<Self, LoadError> {
        // One request, one thread: a server tokenizes many requests at once, and splitting one
        // prompt over the thread pool only adds jitter under load.
        if !tokenizers::utils::parallelism::is_parallelism_configured() {
            tokenizers::utils::parallelism::set_parallelism(false);
        }
        let tokenizer_path = dir.join("tokenizer.json");
        let mut tokenizer =
            tokenizers::Tokenizer::from_file(&tokenizer_path).map_err(|e| LoadError::File {
                path: tokenizer_path.clone(),
                reason: e.to_string(),
            })?;
        // transformers turns off the file's truncation and padding on every call that does not
        // ask for them (`set_truncation_and_padding`), and vLLM asks for neither: the prompt's
        // ids are all of them, unpadded.
        tokenizer
            .with_truncation(None)
            .map_err(|e| LoadError::File {
                path: tokenizer_path.clone(),
                reason: e.to_string(),
            })?
            .with_padding(None);
        let config_path = dir.join("tokenizer_config.json");
        let config: Value = match std::fs::read_to_string(&config_path) {
            Ok(text) => serde_json::from_str(&text).map_err(|e| LoadError::File {
                path: config_path.clone(),
                reason: format!("not json: {e}"),
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Value::Null,
            Err(e) => {
                return Err(LoadError::File {
                    path: config_path,
                    reason: e.to_string(),
                });
            }
        };
        let jinja_path = dir.join("chat_template.jinja");
        let template = if jinja_path.exists() {
            Some((read(&jinja_path)?, jinja_path))
        } else {
            match config.get("chat_template") {
                Some(Value::String(t)) => Some((t.clone(), config_path.clone())),
                // A list of named templates: the one named "default".
                Some(Value::Array(list)) => list
                    .iter()
                    .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                    .and_then(|t| t.get("template").and_then(Value::as_str))
                    .map(|t| (t.to_owned(), config_path.clone())),
                _ => None,
            }
        };
        let mut special = Vec::new();
        for key in ["bos_token", "eos_token", "unk_token", "pad_token"] {
            if let Some(t) = config.get(key).and_then(token_text) {
                special.push((key, t));
            }
        }
        let mut env = environment();
        let has_template = template.is_some();
        if let Some((source, path)) = template {
            env.add_template_owned("chat", source)
                .map_err(|e| LoadError::Template {
                    path,
                    reason: e.to_string(),
                })?;
        }
        let segments = crate::segments::Segmenter::new(&tokenizer);
        Ok(Self {
            dir: dir.to_owned(),
            tokenizer,
            env,
            has_template,
            special,
            segments,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn encode(&self, text: &str, special: bool) -> Result<Vec<u32>, TokenizeError> {
        self.tokenizer
            .encode_fast(text, special)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TokenizeError::Tokenizer(e.to_string()))
    }

    /// A completions prompt, with the tokenizer's special tokens.
    pub fn encode_completion(&self, prompt: &str) -> Result<Vec<u32>, TokenizeError> {
        self.encode(prompt, true)
    }

    /// The text the chat template renders for a chat body (`messages`, `tools`, ...). The body
    /// is read from its bytes so that objects keep their key order (what `tojson` writes).
    pub fn render_chat(&self, body: &[u8]) -> Result<String, TokenizeError> {
        if !self.has_template {
            return Err(TokenizeError::Unsupported {
                field: "messages",
                reason: format!(
                    "the tokenizer in {} has no chat template",
                    self.dir.display()
                ),
            });
        }
        let body: JValue =
            serde_json::from_slice(body).map_err(|e| TokenizeError::InvalidJson(e.to_string()))?;
        let messages = attr(&body, "messages").ok_or(TokenizeError::NoPrompt)?;
        let messages = template_messages(&messages)?;
        let tools = attr(&body, "tools").unwrap_or_else(|| JValue::from(()));
        let add_generation_prompt = attr(&body, "add_generation_prompt")
            .map(|v| v.is_true())
            .unwrap_or(true);
        let mut ctx: Vec<(JValue, JValue)> = Vec::new();
        if let Some(kwargs) = attr(&body, "chat_template_kwargs")
            && kwargs.kind() == ValueKind::Map
        {
            for k in kwargs.try_iter().into_iter().flatten() {
                let v = kwargs.get_item(&k).unwrap_or_default();
                ctx.push((k, v));
            }
        }
        for (k, v) in &self.special {
            ctx.push((JValue::from(*k), JValue::from(v.as_str())));
        }
        ctx.push((JValue::from("messages"), messages));
        ctx.push((JValue::from("tools"), tools));
        ctx.push((
            JValue::from("add_generation_prompt"),
            JValue::from(add_generation_prompt),
        ));
        let template = self
            .env
            .get_template("chat")
            .map_err(|e| TokenizeError::Template(e.to_string()))?;
        template
            .render(JValue::from_pairs(ctx))
            .map_err(|e| TokenizeError::Template(template_error(&e)))
    }

    /// A chat body's prompt ids: the rendered template, without added special tokens.
    pub fn encode_chat(&self, body: &[u8]) -> Result<Vec<u32>, TokenizeError> {
        let text = self.render_chat(body)?;
        match &self.segments {
            Some(s) => s
                .encode(&self.tokenizer, &text)
                .map_err(|e| TokenizeError::Tokenizer(e.to_string())),
            None => self.encode(&text, false),
        }
    }

    /// As [`ModelTokenizer::encode_chat`], encoding only as far as `still_cached(ids so far)`
    /// says some engine may cache the prompt (see [`crate::segments`]); also returns the
    /// estimated number of tokens after the ids returned (0: they are the whole prompt).
    /// `remember`: whether the pieces encoded enter the piece cache (not for Explain).
    pub fn encode_chat_until(
        &self,
        body: &[u8],
        still_cached: &mut dyn FnMut(&[u32]) -> bool,
        remember: bool,
    ) -> Result<(Vec<u32>, usize), TokenizeError> {
        let text = self.render_chat(body)?;
        match &self.segments {
            Some(s) => s
                .encode_until(&self.tokenizer, &text, still_cached, remember)
                .map_err(|e| TokenizeError::Tokenizer(e.to_string())),
            None => Ok((self.encode(&text, false)?, 0)),
        }
    }

    /// Whether [`ModelTokenizer::encode_chat_until`] can stop inside a long piece (the
    /// tokenizer has no normalizer and its chunked encoding agreed with the whole at load).
    pub fn stops_early(&self) -> bool {
        self.segments.as_ref().is_some_and(|s| s.chunked())
    }

    /// Whether text never seen is encoded pre-token by pre-token, each pre-token's ids kept
    /// (a byte-level BPE tokenizer whose probe agreed at load; see [`crate::pretokens`]).
    pub fn by_pretokens(&self) -> bool {
        self.segments.as_ref().is_some_and(|s| s.by_pretokens())
    }

    /// [`ModelTokenizer::encode_chat`] without the piece cache: the tokenizer on the whole text.
    pub fn encode_chat_whole(&self, body: &[u8]) -> Result<Vec<u32>, TokenizeError> {
        let text = self.render_chat(body)?;
        self.encode(&text, false)
    }
}

fn template_error(e: &minijinja::Error) -> String {
    match e.kind() {
        ErrorKind::InvalidOperation => e.detail().map_or_else(
            || e.to_string(),
            |d| format!("the chat template refused it: {d}"),
        ),
        _ => e.to_string(),
    }
}

/// A present, non-null field of a map.
fn attr(v: &JValue, name: &str) -> Option<JValue> {
    v.get_attr(name)
        .ok()
        .filter(|x| !x.is_undefined() && !x.is_none())
}

/// A map with one field replaced, in the same key order.
fn with_field(map: &JValue, name: &str, value: JValue) -> JValue {
    JValue::from_pairs(map.try_iter().into_iter().flatten().map(|k| {
        let v = if k.as_str() == Some(name) {
            value.clone()
        } else {
            map.get_item(&k).unwrap_or_default()
        };
        (k, v)
    }))
}

/// The messages as the template sees them (see the module's documentation).
fn template_messages(messages: &JValue) -> Result<JValue, TokenizeError> {
    if messages.kind() != ValueKind::Seq {
        return Err(TokenizeError::Unsupported {
            field: "messages",
            reason: "must be an array".into(),
        });
    }
    let mut out = Vec::new();
    for (i, m) in messages.try_iter().into_iter().flatten().enumerate() {
        if m.kind() != ValueKind::Map {
            return Err(TokenizeError::Unsupported {
                field: "messages",
                reason: format!("message {i} is not an object"),
            });
        }
        let mut m = m;
        if let Some(content) = attr(&m, "content") {
            match content.kind() {
                ValueKind::Seq => {
                    m = with_field(&m, "content", JValue::from(text_parts(i, &content)?))
                }
                ValueKind::String => {}
                _ => {
                    return Err(TokenizeError::Unsupported {
                        field: "messages",
                        reason: format!("message {i} content must be a string or an array"),
                    });
                }
            }
        }
        if let Some(calls) = attr(&m, "tool_calls")
            && calls.kind() == ValueKind::Seq
        {
            let calls: Vec<JValue> = calls
                .try_iter()
                .into_iter()
                .flatten()
                .map(|c| tool_call(&c))
                .collect();
            m = with_field(&m, "tool_calls", JValue::from(calls));
        }
        out.push(m);
    }
    Ok(JValue::from(out))
}

fn text_parts(i: usize, parts: &JValue) -> Result<String, TokenizeError> {
    let mut texts = Vec::new();
    for p in parts.try_iter().into_iter().flatten() {
        let kind = attr(&p, "type");
        let text = attr(&p, "text");
        match (
            kind.as_ref().and_then(JValue::as_str),
            text.as_ref().and_then(JValue::as_str),
        ) {
            (Some("text"), Some(t)) => texts.push(t.to_owned()),
            (kind, _) => {
                return Err(TokenizeError::Unsupported {
                    field: "messages",
                    reason: format!(
                        "message {i} has a content part of type {} (its tokens depend on the engine's processor; send token_ids or text)",
                        kind.unwrap_or("unknown")
                    ),
                });
            }
        }
    }
    Ok(texts.join("\n"))
}

/// A tool call whose `function.arguments` is a JSON string gets the object it encodes.
fn tool_call(call: &JValue) -> JValue {
    let Some(function) = attr(call, "function") else {
        return call.clone();
    };
    let parsed = attr(&function, "arguments")
        .and_then(|a| a.as_str().map(str::to_owned))
        .and_then(|s| serde_json::from_str::<JValue>(&s).ok())
        .filter(|v| v.kind() == ValueKind::Map);
    match parsed {
        Some(args) => with_field(call, "function", with_field(&function, "arguments", args)),
        None => call.clone(),
    }
}

/// The Jinja environment transformers renders chat templates in.
fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    if let Ok(syntax) = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
    {
        env.set_syntax(syntax);
    }
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |msg: String| -> Result<JValue, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        },
    );
    env.add_function("strftime_now", |fmt: String| {
        crate::pytime::strftime_now(&fmt)
    });
    env.add_filter("tojson", crate::pyjson::tojson);
    env
}
