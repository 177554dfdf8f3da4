//! `kvplane bench cluster` runs end to end and reports what it measured, in JSON.

#![allow(clippy::unwrap_used)]

mod harness;

#[test]
fn the_cluster_benchmark_commits_everything_and_measures_failover() {
    let out = harness::kvplane_ok(&["bench", "cluster", "--entries", "200", "--kills", "2"]);
    let r: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(r["workload"]["kv_events"], 200 * 16);
    assert_eq!(r["cluster"]["digests_agree"], true);
    assert_eq!(r["cluster"]["indexed_blocks"], 200 * 16 * 4);
    assert!(
        r["cluster"]["committed"]["kv_events_per_s"]
            .as_f64()
            .unwrap()
            > 0.0
    );
    assert!(r["single_node_apply"]["kv_events_per_s"].as_f64().unwrap() > 0.0);
    // The catalog-size measurement ran on the same stream with 1 and 500 policy objects.
    assert_eq!(r["catalog_size"]["objects"], serde_json::json!([1, 500]));
    assert!(r["catalog_size"]["ratio"].as_f64().unwrap() > 0.0);
    let kills = r["failover"]["kill_to_first_commit_ms"].as_array().unwrap();
    assert_eq!(kills.len(), 2);
    // A new leader needs at least one election timeout and commits within a few.
    for k in kills {
        let ms = k.as_f64().unwrap();
        assert!((500.0..10_000.0).contains(&ms), "{ms} ms");
    }
}
