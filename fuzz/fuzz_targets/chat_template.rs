//! A chat request body rendered by a model's own chat template (minijinja) and encoded by its
//! Hugging Face tokenizer, as the router tokenizes real traffic.
#![no_main]

use std::sync::OnceLock;

use kvplane_tokenize::ModelTokenizer;
use libfuzzer_sys::fuzz_target;

fn tokenizers() -> &'static [ModelTokenizer] {
    static T: OnceLock<Vec<ModelTokenizer>> = OnceLock::new();
    T.get_or_init(|| {
        ["chatml-style", "llama3-style"]
            .iter()
            .map(|d| {
                let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                    .join("../tokenize/tests/fixtures")
                    .join(d);
                ModelTokenizer::load(&dir).expect("the fixture loads")
            })
            .collect()
    })
}

fuzz_target!(|data: &[u8]| {
    for t in tokenizers() {
        let _ = t.encode_chat(data);
    }
});
