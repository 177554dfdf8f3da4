//! The simulator speaks vLLM's formats: its KV events decode with the decoder kvplane uses for
//! real vLLM batches, and its `/metrics` parse with kvplane's scraper.

#![allow(clippy::unwrap_used)]

use kvplane_ingest::scrape::parse_vllm_metrics;
use kvplane_sim::model::EngineStats;
use kvplane_sim::server::render_metrics;

#[test]
fn sim_metrics_parse_with_the_scraper() {
    let stats = EngineStats {
        running: 3,
        waiting: 5,
        kv_cache_usage: 0.5,
        prefix_cache_queries: 1000,
        prefix_cache_hits: 250,
        ..Default::default()
    };
    let text = render_metrics("m", &stats, &(vec![0; 22], 0.0, 0));
    let m = parse_vllm_metrics(&text).unwrap();
    assert_eq!(m.num_requests_running, 3);
    assert_eq!(m.num_requests_waiting, 5);
    assert_eq!(m.kv_cache_usage_perc, 0.5);
    assert_eq!(m.prefix_cache_hit_rate, 0.25);
}
