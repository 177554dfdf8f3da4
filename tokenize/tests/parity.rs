//! kvplane's prompt token ids equal Hugging Face transformers' for the same tokenizer files:
//! `apply_chat_template(..., add_generation_prompt=True, tokenize=True)` for chat bodies,
//! `tokenizer(prompt)` for completions. The fixtures (a small byte-level BPE trained for the
//! purpose, a Llama 3 style and a ChatML / Qwen 2 style template, and the expected ids) come
//! from `scripts/gen-tokenizer-fixtures.py`.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};

use kvplane_tokenize::{ModelTokenizer, PromptSource, TokenizeError, prompt_from_body_with};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

#[derive(serde::Deserialize)]
struct Case {
    name: String,
    body: String,
    ids: Vec<u32>,
}

fn cases(family: &str) -> Vec<Case> {
    serde_json::from_str(&std::fs::read_to_string(fixture(family).join("cases.json")).unwrap())
        .unwrap()
}

fn check_family(family: &str) -> usize {
    let tok = ModelTokenizer::load(&fixture(family)).unwrap();
    assert!(
        tok.by_pretokens(),
        "{family}: chat text goes pre-token by pre-token"
    );
    let cases = cases(family);
    for c in &cases {
        let p = prompt_from_body_with(c.body.as_bytes(), Some(&tok))
            .unwrap_or_else(|e| panic!("{family} {}: {e}", c.name));
        if p.tokens != c.ids {
            let rendered = tok.render_chat(c.body.as_bytes()).unwrap_or_default();
            panic!(
                "{family} {}: ids differ\n kvplane:      {:?}\n transformers: {:?}\n rendered: {rendered:?}",
                c.name, p.tokens, c.ids
            );
        }
        let chat = c.name.starts_with("chat/");
        if chat {
            // Twice: the second time from the piece cache; and the tokenizer on the whole text.
            let again = prompt_from_body_with(c.body.as_bytes(), Some(&tok)).unwrap();
            assert_eq!(again.tokens, c.ids, "{family} {} from the cache", c.name);
            assert_eq!(tok.encode_chat_whole(c.body.as_bytes()).unwrap(), c.ids);
        }
        assert_eq!(
            p.source,
            if chat {
                PromptSource::Chat
            } else {
                PromptSource::Completions
            }
        );
    }
    cases.len()
}

#[test]
fn llama3_style_template_and_tokenizer_match_transformers() {
    assert!(check_family("llama3-style") >= 12);
}

#[test]
fn chatml_style_template_with_tools_matches_transformers() {
    assert!(check_family("chatml-style") >= 12);
}

#[test]
fn the_template_writes_the_only_bos_and_completions_get_the_tokenizers() {
    let tok = ModelTokenizer::load(&fixture("llama3-style")).unwrap();
    let chat = prompt_from_body_with(
        br#"{"messages":[{"role":"user","content":"hi"}]}"#,
        Some(&tok),
    )
    .unwrap();
    let completion = prompt_from_body_with(br#"{"prompt":"hi"}"#, Some(&tok)).unwrap();
    let bos = completion.tokens[0];
    assert_eq!(chat.tokens[0], bos);
    assert_ne!(chat.tokens[1], bos, "no double BOS");
    assert_eq!(completion.tokens.iter().filter(|t| **t == bos).count(), 1);
}

#[test]
fn bad_files_fail_at_load_and_unsupported_content_is_refused_with_a_reason() {
    let dir = tempfile::tempdir().unwrap();
    let err = ModelTokenizer::load(dir.path()).unwrap_err().to_string();
    assert!(err.contains("tokenizer.json"), "{err}");
    std::fs::copy(
        fixture("chatml-style").join("tokenizer.json"),
        dir.path().join("tokenizer.json"),
    )
    .unwrap();
    std::fs::write(
        dir.path().join("chat_template.jinja"),
        "{% for m in messages %}",
    )
    .unwrap();
    let err = ModelTokenizer::load(dir.path()).unwrap_err().to_string();
    assert!(err.contains("chat template does not compile"), "{err}");

    let tok = ModelTokenizer::load(&fixture("chatml-style")).unwrap();
    let image = br#"{"messages":[{"role":"user","content":[{"type":"text","text":"what is it?"},{"type":"image_url","image_url":{"url":"x"}}]}]}"#;
    match prompt_from_body_with(image, Some(&tok)) {
        Err(TokenizeError::Unsupported { reason, .. }) => {
            assert!(reason.contains("image_url"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    let llama = ModelTokenizer::load(&fixture("llama3-style")).unwrap();
    let bad_role =
        br#"{"messages":[{"role":"system","content":"a"},{"role":"narrator","content":"b"}]}"#;
    match prompt_from_body_with(bad_role, Some(&llama)) {
        Err(TokenizeError::Template(reason)) => {
            assert!(reason.contains("roles must be user"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn an_encoding_that_is_not_remembered_leaves_the_piece_cache_as_it_was() {
    let tok = ModelTokenizer::load(&fixture("chatml-style")).unwrap();
    let system = "A long system prompt, line after line.\nThe next line says more.\n".repeat(200);
    let body = serde_json::to_vec(&serde_json::json!({"messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": "and now?"},
    ]}))
    .unwrap();
    let stop = |ids: &[u32]| ids.len() < 64;
    // Not remembered (Explain): the next encoding still stops early.
    tok.encode_chat_until(&body, &mut |_| true, false).unwrap();
    let (_, rest) = tok
        .encode_chat_until(&body, &mut |ids| stop(ids), true)
        .unwrap();
    assert!(rest > 0, "nothing was cached");
    // Remembered: the whole system prompt is a cached piece, and comes back whole.
    let (whole, _) = tok.encode_chat_until(&body, &mut |_| true, true).unwrap();
    let (ids, rest) = tok
        .encode_chat_until(&body, &mut |ids| stop(ids), true)
        .unwrap();
    assert_eq!(rest, 0);
    assert_eq!(ids, whole);
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

    /// The piece cache gives the tokenizer's own ids for any text, special tokens written
    /// inside message content included.
    #[test]
    fn pieces_from_the_cache_are_the_tokenizers_ids(
        parts in proptest::collection::vec(proptest::sample::select(vec![
            "hello ", "world", "<|im_end|>", "<|im_start|>user\n", "\n\n", "  ", "Größe ",
            "東京 ", "🚀", "You are a helpful assistant. ", "<|endoftext|>", "x",
        ]), 0..80),
        repeat in 1usize..40,
    ) {
        let tok = ModelTokenizer::load(&fixture("chatml-style")).unwrap();
        let system: String = parts.concat().repeat(repeat);
        let body = serde_json::to_vec(&serde_json::json!({"messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": parts.concat()},
        ]})).unwrap();
        let whole = tok.encode_chat_whole(&body).unwrap();
        proptest::prop_assert_eq!(tok.encode_chat(&body).unwrap(), whole.clone());
        proptest::prop_assert_eq!(tok.encode_chat(&body).unwrap(), whole);
    }

    /// A long prompt encoded chunk by chunk (cut at pre-tokenization boundaries) gives the
    /// tokenizer's own ids, on both fixture tokenizers; stopped early, its ids are a prefix of
    /// them and the estimate of the rest is of the right size.
    #[test]
    fn chunked_encoding_is_exact_and_an_early_stop_is_a_prefix(
        parts in proptest::collection::vec(proptest::sample::select(vec![
            "hello ", "world", "\n", "\nNext line", "  \n", "\n\n", "def f(x):\n    return x\n",
            "1234", "Größe ", "東京\n", "🚀", " - item\n", "\tTab", "x", "<|im_end|>", ".\nThen",
        ]), 1..60),
        repeat in 20usize..120,
        family in proptest::sample::select(vec!["chatml-style", "llama3-style"]),
        stop_at in 1usize..400,
    ) {
        let tok = ModelTokenizer::load(&fixture(family)).unwrap();
        proptest::prop_assert!(tok.stops_early(), "{family}: no normalizer, the probe agrees");
        let system: String = parts.concat().repeat(repeat);
        let body = serde_json::to_vec(&serde_json::json!({"messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "and now?"},
        ]})).unwrap();
        let whole = tok.encode_chat_whole(&body).unwrap();
        let (ids, rest) = tok.encode_chat_until(&body, &mut |_| true, true).unwrap();
        proptest::prop_assert_eq!(rest, 0);
        proptest::prop_assert_eq!(&ids, &whole);
        let fresh = ModelTokenizer::load(&fixture(family)).unwrap();
        let (prefix, rest) = fresh.encode_chat_until(&body, &mut |ids| ids.len() < stop_at, true).unwrap();
        proptest::prop_assert_eq!(&whole[..prefix.len()], &prefix[..]);
        if rest > 0 {
            let estimate = prefix.len() + rest;
            proptest::prop_assert!(
                estimate * 2 >= whole.len() && estimate <= whole.len() * 2,
                "estimated {} tokens of {}", estimate, whole.len()
            );
        }
    }
}
