//! Text encoded pre-token by pre-token, each pre-token's ids kept, gives the ids of the
//! `tokenizers` crate's own `encode` on the whole text: for any text, on both fixture
//! tokenizers and on the Llama 3 and Qwen 2 pre-tokenizer shape (a regex `Split`, then
//! `ByteLevel`); a tokenizer outside the shapes it knows is encoded by the tokenizer itself.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};

use kvplane_tokenize::ModelTokenizer;
use proptest::strategy::Strategy;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// Llama 3's split pattern, as its `tokenizer.json` gives it.
const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen 2's split pattern, as its `tokenizer.json` gives it.
const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A change to a `tokenizer.json`.
type Edit = Box<dyn FnOnce(&mut serde_json::Value)>;

/// The ChatML fixture with its `tokenizer.json` changed by `edit`, in a temporary directory.
fn variant(edit: impl FnOnce(&mut serde_json::Value)) -> (tempfile::TempDir, ModelTokenizer) {
    let dir = tempfile::tempdir().unwrap();
    let from = fixture("chatml-style");
    for f in std::fs::read_dir(&from).unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), dir.path().join(f.file_name())).unwrap();
    }
    let path = dir.path().join("tokenizer.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut json);
    std::fs::write(&path, serde_json::to_string(&json).unwrap()).unwrap();
    let tok = ModelTokenizer::load(dir.path()).unwrap();
    (dir, tok)
}

fn split_then_byte_level(pattern: &str) -> impl FnOnce(&mut serde_json::Value) {
    move |json| {
        json["pre_tokenizer"] = serde_json::json!({
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
            ],
        });
    }
}

fn body(system: &str, user: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({"messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": user},
    ]}))
    .unwrap()
}

/// The ids of `body`: pre-token by pre-token twice (the second time from the cache), each
/// equal to the tokenizer's own on the whole text.
fn assert_exact(
    tok: &ModelTokenizer,
    body: &[u8],
) -> Result<(), proptest::test_runner::TestCaseError> {
    let whole = tok.encode_chat_whole(body).unwrap();
    proptest::prop_assert_eq!(&tok.encode_chat(body).unwrap(), &whole);
    proptest::prop_assert_eq!(&tok.encode_chat(body).unwrap(), &whole);
    Ok(())
}

#[test]
fn the_split_then_byte_level_shape_is_encoded_by_pretokens() {
    // The third has no `\s+(?!\S)|\s+` tail: it is split by Oniguruma, not the DFA.
    let other_tail = LLAMA3_PATTERN.replace(r"|\s+(?!\S)|\s+", r"|\s+(?!\S)|\s");
    for pattern in [LLAMA3_PATTERN, QWEN2_PATTERN, other_tail.as_str()] {
        let (_dir, tok) = variant(split_then_byte_level(pattern));
        assert!(tok.by_pretokens(), "{pattern}");
        let text = "It's 12345 tokens:\r\n\n  indented\tword, AND 'QUOTED' \u{e9}t\u{e9} \u{6771}\u{4eac}!!\n";
        assert_exact(&tok, &body(&text.repeat(30), text)).unwrap();
    }
}

#[test]
fn a_tokenizer_outside_the_known_shapes_is_encoded_by_the_tokenizer_itself() {
    let shapes: [(&str, Edit); 3] = [
        (
            "a normalizer",
            Box::new(|j| j["normalizer"] = serde_json::json!({"type": "NFC"})),
        ),
        (
            "a prefix space",
            Box::new(|j| j["pre_tokenizer"]["add_prefix_space"] = serde_json::json!(true)),
        ),
        (
            "a word suffix",
            Box::new(|j| j["model"]["end_of_word_suffix"] = serde_json::json!("</w>")),
        ),
    ];
    for (what, edit) in shapes {
        let (_dir, tok) = variant(edit);
        assert!(!tok.by_pretokens(), "{what}");
        let b = body(
            &"A system prompt with words, words and more words.\n".repeat(20),
            "x",
        );
        assert_exact(&tok, &b).unwrap();
    }
}

#[test]
fn truncation_and_padding_in_the_file_are_off_as_transformers_turns_them_off() {
    let (_dir, tok) = variant(|j| {
        j["truncation"] = serde_json::json!({"max_length": 8, "strategy": "LongestFirst", "stride": 0, "direction": "Right"});
        j["padding"] = serde_json::json!({"strategy": "BatchLongest", "direction": "Right", "pad_to_multiple_of": 64, "pad_id": 0, "pad_type_id": 0, "pad_token": "<|endoftext|>"});
    });
    assert!(tok.by_pretokens());
    #[derive(serde::Deserialize)]
    struct Case {
        name: String,
        body: String,
        ids: Vec<u32>,
    }
    let cases: Vec<Case> = serde_json::from_str(
        &std::fs::read_to_string(fixture("chatml-style").join("cases.json")).unwrap(),
    )
    .unwrap();
    for c in cases {
        let p = kvplane_tokenize::prompt_from_body_with(c.body.as_bytes(), Some(&tok)).unwrap();
        assert_eq!(p.tokens, c.ids, "{}: transformers' ids", c.name);
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(96))]

    /// Any text - any characters, whitespace runs, contractions, digits - gives the
    /// tokenizer's own ids, on each shape.
    #[test]
    fn any_text_gives_the_tokenizers_own_ids(
        words in proptest::collection::vec(proptest::prop_oneof![
            "\\PC{0,12}",
            "[ \t\r\n]{1,5}",
            proptest::sample::select(vec!["'s", "'T", "'ll", " 2024", "123456", "🚀", "  word", "x\u{a0}y"])
                .prop_map(str::to_owned),
        ], 0..60),
        repeat in 1usize..30,
        shape in 0usize..4,
    ) {
        let text: String = words.concat();
        let (_dir, tok) = match shape {
            0 => (None, ModelTokenizer::load(&fixture("chatml-style")).unwrap()),
            1 => (None, ModelTokenizer::load(&fixture("llama3-style")).unwrap()),
            2 => { let (d, t) = variant(split_then_byte_level(LLAMA3_PATTERN)); (Some(d), t) }
            _ => { let (d, t) = variant(split_then_byte_level(QWEN2_PATTERN)); (Some(d), t) }
        };
        proptest::prop_assert!(tok.by_pretokens());
        assert_exact(&tok, &body(&text.repeat(repeat), &text))?;
    }
}
