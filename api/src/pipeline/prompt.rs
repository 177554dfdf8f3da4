//! Stage 1, prompt: the request's model, output limit and cache salt ([`fields`], before the
//! model resolves), then its token ids ([`prompt`]: given, or its body tokenized once, with
//! the served model's own tokenizer when one is loaded).
//!
//! A chat prompt is tokenized only as far as some engine may cache it: after each chunk the
//! ids so far are looked up in every prefix index, and once none holds all their blocks the
//! rest is only counted (estimated from its length; usage settles it). Where a prefix matches,
//! the ids are exactly the engine's.

use std::borrow::Cow;
use std::collections::BTreeMap;

use kvplane_policy::SetRef;
use kvplane_proto::v1::RouteRequest;
use kvplane_state::View;
use kvplane_tokenize::{PromptSource, prompt_from_body_until};

use crate::Tokenizers;

/// A request's prompt as the service resolved it (`'r`: the request, whose ids it borrows
/// when the request gave them).
#[derive(Debug, Clone)]
pub struct Prompted<'r> {
    /// The prompt's ids, exact; they may stop before the prompt's end (see `estimated_rest`).
    pub tokens: Cow<'r, [u32]>,
    /// Tokens after `tokens` that no engine can have cached, so were only counted (estimated
    /// from their length).
    pub estimated_rest: usize,
    pub source: PromptSource,
    /// The requested model: the request's, else the body's.
    pub model: String,
    /// The most output tokens: the request's, else the body's `max_tokens`.
    pub max_tokens: Option<u32>,
    /// The request's or the body's `cache_salt` (vLLM: blocks are shared only among requests
    /// with the same).
    pub cache_salt: Option<String>,
}

impl Prompted<'_> {
    /// What is known of a request whose prompt could not be read.
    pub(crate) fn unreadable(req: &RouteRequest) -> Self {
        Self {
            tokens: Cow::Borrowed(&[]),
            estimated_rest: 0,
            source: PromptSource::TokenIds,
            model: req.model.clone(),
            max_tokens: None,
            cache_salt: None,
        }
    }

    /// The prompt's length in tokens (estimated in part when `estimated_rest` > 0).
    pub fn total_tokens(&self) -> usize {
        self.tokens.len() + self.estimated_rest
    }

    pub fn prompt_tokens(&self) -> u32 {
        u32::try_from(self.total_tokens()).unwrap_or(u32::MAX)
    }
}

/// Why a request's prompt cannot be read (an invalid request).
#[derive(Debug, thiserror::Error)]
pub enum PromptError {
    #[error("request has neither token_ids nor a body")]
    Empty,
    #[error(transparent)]
    Body(#[from] kvplane_tokenize::TokenizeError),
}

/// What the request says besides its prompt: read before the model resolves.
#[derive(Debug, Clone)]
pub(crate) struct Fields {
    pub model: String,
    pub max_tokens: Option<u32>,
    pub cache_salt: Option<String>,
    /// The body's own fields, read once: the prompt is read with them.
    pub body: kvplane_tokenize::BodyFields,
}

/// The model, output limit and cache salt of `req`: its own, else its body's.
pub(crate) fn fields(req: &RouteRequest) -> Result<Fields, PromptError> {
    let text = req.token_ids.is_empty();
    if text && req.body.is_empty() {
        return Err(PromptError::Empty);
    }
    let body = if req.body.is_empty() {
        kvplane_tokenize::BodyFields::default()
    } else {
        match kvplane_tokenize::body_fields(&req.body) {
            Ok(f) => f,
            Err(e) if text => return Err(e.into()),
            // Token ids given: a body that is not JSON only lacks the defaults.
            Err(_) => kvplane_tokenize::BodyFields::default(),
        }
    };
    Ok(Fields {
        model: if req.model.is_empty() {
            body.model.clone().unwrap_or_default()
        } else {
            req.model.clone()
        },
        max_tokens: (req.max_output_tokens > 0)
            .then_some(req.max_output_tokens)
            .or(body.max_tokens),
        cache_salt: (!req.cache_salt.is_empty())
            .then(|| req.cache_salt.clone())
            .or_else(|| body.cache_salt.clone()),
        body,
    })
}

/// The prompt of `req`, for the worker sets it resolved to (their model's tokenizer; the
/// adapter each runs it under, for the prefix lookups).
pub(crate) fn prompt<'r>(
    req: &'r RouteRequest,
    f: Fields,
    view: &View,
    tokenizers: &Tokenizers,
    sets: &BTreeMap<String, SetRef>,
    explain: bool,
) -> Result<Prompted<'r>, PromptError> {
    let Fields {
        model,
        max_tokens,
        cache_salt,
        body,
    } = f;
    if !req.token_ids.is_empty() {
        return Ok(Prompted {
            tokens: Cow::Borrowed(&req.token_ids),
            estimated_rest: 0,
            source: PromptSource::TokenIds,
            model,
            max_tokens,
            cache_salt,
        });
    }
    // The tokenizer of the model the first worker set runs (the served model behind a public
    // name), else of the requested model.
    let served = sets
        .values()
        .map(|s| s.model.as_str())
        .find(|m| !m.is_empty())
        .unwrap_or(&model);
    let tokenizer = tokenizers.for_model(view, served);
    let salt = cache_salt.as_deref();
    // Explain leaves the tokenizer's piece cache as it was.
    let p = prompt_from_body_until(
        &req.body,
        Some(body),
        tokenizer.as_deref(),
        &mut |ids| still_cached(view, sets, &model, salt, ids),
        !explain,
    )?;
    Ok(Prompted {
        tokens: Cow::Owned(p.tokens),
        estimated_rest: p.estimated_rest,
        source: p.source,
        model,
        max_tokens,
        cache_salt,
    })
}

/// Whether some worker set's index holds every complete block of `ids` (under the adapter
/// that set runs the request as, and the salt): tokenizing further may still find a longer
/// cached prefix.
fn still_cached(
    view: &View,
    sets: &BTreeMap<String, SetRef>,
    requested: &str,
    salt: Option<&str>,
    ids: &[u32],
) -> bool {
    view.pools.iter().any(|(name, pool)| {
        let blocks = ids.len() / pool.index.block_size().max(1) as usize;
        if blocks == 0 {
            return true;
        }
        let model = sets.get(name).map_or(requested, |s| s.model.as_str());
        let lora = view
            .catalog
            .worker_sets
            .get(name)
            .and_then(|s| s.adapter_for(model));
        pool.index.overlaps_keyed(ids, lora, salt).best_blocks() as usize >= blocks
    })
}
