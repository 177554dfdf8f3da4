//! Tokenizing a rendered chat prompt piece by piece, with the pieces' ids kept.
//!
//! A Hugging Face tokenizer splits its input on the added (special) tokens first and encodes
//! each piece between them on its own. A chat prompt is mostly pieces seen before - the system
//! prompt, earlier turns - between `<|im_start|>`-like tokens, so this does the same split and
//! keeps the ids of long pieces: the result is the tokenizer's own, and a repeated system prompt
//! costs a hash instead of an encode. Used only when every added token matches as plain text
//! (not normalized, no `lstrip`/`rstrip`/`single_word`); otherwise the whole text is encoded.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use aho_corasick::{AhoCorasick, MatchKind};

/// Pieces shorter than this are encoded every time (cheaper than keeping them).
const MIN_CACHED_BYTES: usize = 256;
/// Pieces kept; past this the cache starts over.
const CAPACITY: usize = 4096;

pub(crate) struct Segmenter {
    matcher: AhoCorasick,
    /// The id of each pattern of `matcher`.
    ids: Vec<u32>,
    cache: Mutex<HashMap<u128, Arc<[u32]>>>,
}

impl Segmenter {
    /// A segmenter for `tokenizer`, when its added tokens allow one.
    pub(crate) fn new(tokenizer: &tokenizers::Tokenizer) -> Option<Self> {
        let added = tokenizer.get_added_tokens_decoder();
        if added.is_empty()
            || added.values().any(|t| {
                t.normalized || t.lstrip || t.rstrip || t.single_word || t.content.is_empty()
            })
        {
            return None;
        }
        let mut tokens: Vec<(u32, String)> =
            added.into_iter().map(|(id, t)| (id, t.content)).collect();
        tokens.sort();
        let matcher = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(tokens.iter().map(|(_, c)| c.as_str()))
            .ok()?;
        Some(Self {
            matcher,
            ids: tokens.into_iter().map(|(id, _)| id).collect(),
            cache: Mutex::default(),
        })
    }

    /// The ids of `text`, encoded without added special tokens (the post-processor's).
    pub(crate) fn encode(
        &self,
        tokenizer: &tokenizers::Tokenizer,
        text: &str,
    ) -> Result<Vec<u32>, tokenizers::Error> {
        let mut out = Vec::with_capacity(text.len() / 3);
        let mut at = 0;
        for m in self.matcher.find_iter(text) {
            self.piece(tokenizer, &text[at..m.start()], &mut out)?;
            out.push(self.ids[m.pattern().as_usize()]);
            at = m.end();
        }
        self.piece(tokenizer, &text[at..], &mut out)?;
        Ok(out)
    }

    fn piece(
        &self,
        tokenizer: &tokenizers::Tokenizer,
        piece: &str,
        out: &mut Vec<u32>,
    ) -> Result<(), tokenizers::Error> {
        if piece.is_empty() {
            return Ok(());
        }
        if piece.len() < MIN_CACHED_BYTES {
            out.extend_from_slice(tokenizer.encode_fast(piece, false)?.get_ids());
            return Ok(());
        }
        let key = xxhash_rust::xxh3::xxh3_128(piece.as_bytes());
        let cached = self.lock().get(&key).cloned();
        let ids = match cached {
            Some(ids) => ids,
            None => {
                let ids: Arc<[u32]> = tokenizer.encode_fast(piece, false)?.get_ids().into();
                let mut cache = self.lock();
                if cache.len() >= CAPACITY {
                    cache.clear();
                }
                cache.insert(key, ids.clone());
                ids
            }
        };
        out.extend_from_slice(&ids);
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u128, Arc<[u32]>>> {
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }
}
