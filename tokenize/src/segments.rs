//! Tokenizing a rendered chat prompt piece by piece, with the pieces' ids kept.
//!
//! A Hugging Face tokenizer splits its input on the added (special) tokens first and encodes
//! each piece between them on its own. A chat prompt is mostly pieces seen before - the system
//! prompt, earlier turns - between `<|im_start|>`-like tokens, so this does the same split and
//! keeps the ids of long pieces: the result is the tokenizer's own, and a repeated system prompt
//! costs a hash instead of an encode. Used only when every added token matches as plain text
//! (not normalized, no `lstrip`/`rstrip`/`single_word`); otherwise the whole text is encoded.
//!
//! [`Segmenter::encode_until`] stops early: a long piece never seen is encoded in chunks cut
//! at pre-tokenization boundaries (before a word's single leading space, after a newline; see
//! [`next_cut`]; used only where the tokenizer has no normalizer and a probe at load shows
//! chunked and whole encodings agree), and after each chunk the caller
//! says whether some engine may still cache the prompt so far. Once none can, the rest is not
//! encoded: its token count is estimated from its length (usage settles the difference).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use aho_corasick::{AhoCorasick, MatchKind};

use crate::pretokens::Pretokens;

/// Pieces shorter than this are encoded every time (cheaper than keeping them).
const MIN_CACHED_BYTES: usize = 256;
/// Pieces kept; past this the cache starts over.
const CAPACITY: usize = 4096;

/// The first chunk of a long uncached piece; each next one is twice as long.
const FIRST_CHUNK_BYTES: usize = 2048;

pub(crate) struct Segmenter {
    /// Whether long pieces may be encoded chunk by chunk (see the module docs).
    chunked: bool,
    matcher: AhoCorasick,
    /// The id of each pattern of `matcher`.
    ids: Vec<u32>,
    cache: Mutex<HashMap<u128, Arc<[u32]>>>,
    /// Pieces never seen, pre-token by pre-token (see [`crate::pretokens`]).
    pretokens: Option<Pretokens>,
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
        let chunked = tokenizer.get_normalizer().is_none() && chunks_agree(tokenizer);
        Some(Self {
            chunked,
            matcher,
            ids: tokens.into_iter().map(|(id, _)| id).collect(),
            cache: Mutex::default(),
            pretokens: Pretokens::new(tokenizer),
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
            self.piece(tokenizer, &text[at..m.start()], &mut out, true)?;
            out.push(self.ids[m.pattern().as_usize()]);
            at = m.end();
        }
        self.piece(tokenizer, &text[at..], &mut out, true)?;
        Ok(out)
    }

    /// As [`Self::encode`], stopping once `still_cached(ids so far)` says no engine may hold
    /// the prompt that far; then also the estimated number of tokens not encoded. `remember`:
    /// whether pieces encoded now enter the cache (Explain leaves it as it was).
    pub(crate) fn encode_until(
        &self,
        tokenizer: &tokenizers::Tokenizer,
        text: &str,
        still_cached: &mut dyn FnMut(&[u32]) -> bool,
        remember: bool,
    ) -> Result<(Vec<u32>, usize), tokenizers::Error> {
        let mut out = Vec::with_capacity(text.len() / 3);
        let mut at = 0;
        let mut specials = self.matcher.find_iter(text).peekable();
        loop {
            let end = specials.peek().map_or(text.len(), |m| m.start());
            let piece = &text[at..end];
            if let Some(done) =
                self.piece_until(tokenizer, piece, &mut out, still_cached, remember)?
            {
                let rest_bytes = piece.len() - done.bytes + (text.len() - end);
                let rest = (rest_bytes as f64 / done.bytes_per_token).ceil() as usize;
                return Ok((out, rest));
            }
            match specials.next() {
                Some(m) => {
                    out.push(self.ids[m.pattern().as_usize()]);
                    at = m.end();
                }
                None => return Ok((out, 0)),
            }
        }
    }

    /// Encodes `piece` into `out`; `Some` when it stopped early (see [`Self::encode_until`]).
    fn piece_until(
        &self,
        tokenizer: &tokenizers::Tokenizer,
        piece: &str,
        out: &mut Vec<u32>,
        still_cached: &mut dyn FnMut(&[u32]) -> bool,
        remember: bool,
    ) -> Result<Option<Early>, tokenizers::Error> {
        if !self.chunked || piece.len() < MIN_CACHED_BYTES {
            self.piece(tokenizer, piece, out, remember)?;
            return Ok(None);
        }
        let key = xxhash_rust::xxh3::xxh3_128(piece.as_bytes());
        if self.cached(key, out) {
            return Ok(None);
        }
        let first = out.len();
        let mut at = 0;
        let mut target = FIRST_CHUNK_BYTES;
        while at < piece.len() {
            let end = next_cut(piece, at + target).unwrap_or(piece.len());
            self.text(tokenizer, &piece[at..end], out, remember)?;
            at = end;
            target *= 2;
            if at < piece.len() && !still_cached(out) {
                let tokens = (out.len() - first).max(1);
                return Ok(Some(Early {
                    bytes: at,
                    bytes_per_token: at as f64 / tokens as f64,
                }));
            }
        }
        if remember {
            self.keep(key, &out[first..]);
        }
        Ok(None)
    }

    fn piece(
        &self,
        tokenizer: &tokenizers::Tokenizer,
        piece: &str,
        out: &mut Vec<u32>,
        remember: bool,
    ) -> Result<(), tokenizers::Error> {
        if piece.is_empty() {
            return Ok(());
        }
        if piece.len() < MIN_CACHED_BYTES {
            return self.text(tokenizer, piece, out, remember);
        }
        let key = xxhash_rust::xxh3::xxh3_128(piece.as_bytes());
        if self.cached(key, out) {
            return Ok(());
        }
        let first = out.len();
        self.text(tokenizer, piece, out, remember)?;
        if remember {
            self.keep(key, &out[first..]);
        }
        Ok(())
    }

    /// Appends the ids of `text` (no added token in it): pre-token by pre-token where the
    /// tokenizer allows it, else by the tokenizer on the whole.
    fn text(
        &self,
        tokenizer: &tokenizers::Tokenizer,
        text: &str,
        out: &mut Vec<u32>,
        remember: bool,
    ) -> Result<(), tokenizers::Error> {
        match &self.pretokens {
            Some(p) => p.encode(tokenizer, text, out, remember),
            None => {
                out.extend_from_slice(tokenizer.encode_fast(text, false)?.get_ids());
                Ok(())
            }
        }
    }

    /// Appends the ids kept under `key`, if any; whether there were.
    fn cached(&self, key: u128, out: &mut Vec<u32>) -> bool {
        let Some(ids) = self.lock().get(&key).cloned() else {
            return false;
        };
        out.extend_from_slice(&ids);
        true
    }

    /// Keeps a piece's ids under its key; a full cache starts over.
    fn keep(&self, key: u128, ids: &[u32]) {
        let mut cache = self.lock();
        if cache.len() >= CAPACITY {
            cache.clear();
        }
        cache.insert(key, ids.into());
    }

    pub(crate) fn by_pretokens(&self) -> bool {
        self.pretokens.is_some()
    }

    pub(crate) fn chunked(&self) -> bool {
        self.chunked
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u128, Arc<[u32]>>> {
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Where a piece's encoding stopped: bytes encoded, and their bytes per token.
struct Early {
    bytes: usize,
    bytes_per_token: f64,
}

/// The first chunk boundary at or after `from`: right after a newline that an ASCII letter
/// follows, or right before a single space between a non-space and an ASCII letter. Both are
/// pre-tokenization boundaries of the byte-level BPE tokenizers (GPT-2's, Llama 3's and Qwen
/// 2's split patterns: a word takes at most one space before it, a newline run never joins
/// the word after it); [`chunks_agree`] checks a tokenizer before they are used.
fn next_cut(text: &str, from: usize) -> Option<usize> {
    let b = text.as_bytes();
    (from.max(1)..b.len().saturating_sub(1)).find(|&i| {
        (b[i - 1] == b'\n' && b[i].is_ascii_alphabetic())
            || (b[i] == b' ' && b[i + 1].is_ascii_alphabetic() && !b[i - 1].is_ascii_whitespace())
    })
}

/// Whether encoding a probe text chunk by chunk, cut at every [`next_cut`] boundary, gives
/// the tokenizer's own ids for the whole text.
fn chunks_agree(tokenizer: &tokenizers::Tokenizer) -> bool {
    const PROBE: &str = "You are a careful assistant.\nAnswer in English, or en fran\u{e7}ais.\n  \
        Indented line, tabs\there.\nNumbers 12345 and 3.14159!\n\nA new paragraph: x = f(y);\n\
        def route(r):\n    return min(r)\nEnd \u{1f600} of the probe.  Two  spaces, it's \
        don't I'm we'll they've 'quoted' \"double\" (paren) a-b a_b A1 b2 \u{1f680}x x\u{e9}t\u{e9} \
        \u{6771}\u{4eac} z.\n\nlast";
    let whole = match tokenizer.encode_fast(PROBE, false) {
        Ok(e) => e.get_ids().to_vec(),
        Err(_) => return false,
    };
    let mut ids = Vec::new();
    let mut at = 0;
    while at < PROBE.len() {
        let end = next_cut(PROBE, at + 1).unwrap_or(PROBE.len());
        match tokenizer.encode_fast(&PROBE[at..end], false) {
            Ok(e) => ids.extend_from_slice(e.get_ids()),
            Err(_) => return false,
        }
        at = end;
    }
    ids == whole
}
