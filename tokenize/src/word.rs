//! The shared deterministic text tokenizer.
//!
//! Text is split into pieces: each maximal run of alphanumeric characters is one piece, and
//! every other non-whitespace character is a piece of its own; whitespace separates pieces and
//! yields none. A piece's id is `FIRST_ID + xxh3_64(piece) % (VOCAB_SIZE - FIRST_ID)`, so ids
//! fall in `FIRST_ID..VOCAB_SIZE` and ids below `FIRST_ID` stay free for special tokens.
//! English text comes out at roughly one token per word, close to real BPE tokenizers.

use xxhash_rust::xxh3::xxh3_64;

/// Ids are below this value.
pub const VOCAB_SIZE: u32 = 32_000;
/// Ids below this are reserved for special tokens.
pub const FIRST_ID: u32 = 256;

/// The deterministic word tokenizer; stateless, cheap to copy.
#[derive(Debug, Clone, Copy, Default)]
pub struct WordTokenizer;

impl WordTokenizer {
    /// Appends the ids of `text` to `out`.
    pub fn encode_into(self, text: &str, out: &mut Vec<u32>) {
        let mut start: Option<usize> = None;
        for (i, c) in text.char_indices() {
            if c.is_alphanumeric() {
                start.get_or_insert(i);
                continue;
            }
            if let Some(s) = start.take() {
                out.push(piece_id(&text[s..i]));
            }
            if !c.is_whitespace() {
                out.push(piece_id(&text[i..i + c.len_utf8()]));
            }
        }
        if let Some(s) = start {
            out.push(piece_id(&text[s..]));
        }
    }

    /// The ids of `text`.
    pub fn encode(self, text: &str) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 4 + 1);
        self.encode_into(text, &mut out);
        out
    }
}

fn piece_id(piece: &str) -> u32 {
    let span = u64::from(VOCAB_SIZE - FIRST_ID);
    // The remainder is below `span`, which fits in u32.
    FIRST_ID + u32::try_from(xxh3_64(piece.as_bytes()) % span).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn words_and_punctuation_are_separate_pieces() {
        let ids = WordTokenizer.encode("Hello, world!");
        assert_eq!(ids.len(), 4);
        assert_eq!(ids[0], WordTokenizer.encode("Hello")[0]);
        assert_eq!(ids[1], WordTokenizer.encode(",")[0]);
    }

    #[test]
    fn whitespace_yields_no_tokens() {
        assert!(WordTokenizer.encode(" \n\t ").is_empty());
        assert_eq!(WordTokenizer.encode("a  b"), WordTokenizer.encode("a b"));
    }

    #[test]
    fn ids_are_stable_across_releases() {
        // Changing these breaks prefix matching against running simulators: bump deliberately.
        assert_eq!(WordTokenizer.encode("kvplane routes"), vec![7372, 29161]);
    }

    proptest! {
        #[test]
        fn ids_stay_in_vocabulary(s in "\\PC{0,200}") {
            for id in WordTokenizer.encode(&s) {
                prop_assert!((FIRST_ID..VOCAB_SIZE).contains(&id));
            }
        }

        #[test]
        fn shared_text_prefix_gives_shared_token_prefix(a in "[a-z ]{0,80}", b in "[a-z ]{0,80}") {
            let prefix = format!("{a} ");
            let whole = format!("{prefix}{b}");
            let p = WordTokenizer.encode(&prefix);
            let w = WordTokenizer.encode(&whole);
            prop_assert_eq!(&w[..p.len()], &p[..]);
        }
    }
}
