//! From an OpenAI-style request body to prompt token ids.
//!
//! Until real tokenizers are loaded per model, kvplane and its engine simulator share one
//! documented, deterministic text tokenizer ([`WordTokenizer`]): the same text always gives
//! the same ids, and texts that share a prefix share a token prefix. That is all prefix-cache
//! routing needs from it.

mod body;
mod word;

pub use body::{Prompt, PromptSource, prompt_from_body, render_chat};
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
}
