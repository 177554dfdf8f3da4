//! An engine's `/metrics` text as the bridge scrapes it (Prometheus text format).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = kvplane_ingest::scrape::parse_vllm_metrics(text);
    }
});
