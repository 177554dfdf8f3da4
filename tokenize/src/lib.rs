//! From an OpenAI-style request body to prompt token ids.
//!
//! - A model with tokenizer files ([`ModelTokenizer`]: Hugging Face `tokenizer.json` and its
//!   chat template) gets the very ids vLLM computes (parity tests against transformers in
//!   `tests/parity.rs`).
//! - Without them, kvplane and its engine simulator share one documented, deterministic text
//!   tokenizer ([`WordTokenizer`]): the same text always gives the same ids, and texts that
//!   share a prefix share a token prefix.

mod body;
mod hf;
mod pretokens;
mod pyjson;
mod pytime;
mod segments;
mod word;

pub use body::{
    BodyFields, Prompt, PromptSource, body_fields, prompt_from_body, prompt_from_body_until,
    prompt_from_body_with, render_chat,
};
pub use hf::{LoadError, ModelTokenizer};
pub use word::{VOCAB_SIZE, WordTokenizer};

/// Why a request body could not be turned into a prompt.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TokenizeError {
    #[error("request body is not valid json: {0}")]
    InvalidJson(String),
    #[error("request body has neither `prompt` nor `messages`")]
    NoPrompt,
    #[error("unsupported {field}: {reason}")]
    Unsupported { field: &'static str, reason: String },
    #[error("chat template: {0}")]
    Template(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
}
