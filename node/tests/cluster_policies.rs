//! Policies from a directory through the Raft cluster: every replica switches to a change at
//! the same log index, and an invalid directory changes nothing.

#![allow(clippy::unwrap_used)]

mod harness;

use std::path::Path;
use std::time::Duration;

use harness::{Cluster, NodeOptions, eventually};

const EXAMPLES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/policies");

fn copy_examples(to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for f in std::fs::read_dir(EXAMPLES).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, to.join(f.file_name().unwrap())).unwrap();
    }
}

/// Waits until all replicas report the same policy generation, past `after`, with `objects`
/// policy objects; returns the generation.
async fn generation(cluster: &Cluster, after: u64, objects: u32) -> u64 {
    eventually(
        "every replica at one policy generation",
        Duration::from_secs(30),
        || async {
            let mut seen = Vec::new();
            for n in &cluster.nodes {
                let s = n.status().await;
                seen.push((
                    s.config_index,
                    s.policy_objects.values().sum::<u32>(),
                    s.state_digest,
                ));
            }
            let (g, count, _) = seen[0].clone();
            (g > after && count == objects && seen.iter().all(|s| *s == seen[0])).then_some(g)
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_change_reaches_every_replica_at_the_same_index() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("policies");
    copy_examples(&dir);
    let o = NodeOptions {
        policy_dir: Some(dir.clone()),
        ..Default::default()
    };
    let (cluster, _js) = harness::started(&o).await;
    let first = generation(&cluster, 0, 14).await;
    let s = cluster.nodes[2].status().await;
    assert_eq!(s.policy_objects["InferencePolicy"], 5);
    assert_eq!(s.policy_objects["GatewayBackend"], 3);

    // An invalid edit is refused: nothing changes, the problem is counted.
    std::fs::write(dir.join("7-broken.yaml"), "apiVersion: kvplane.io/v1alpha1\nkind: InferencePool\nmetadata: {name: x}\nspec: {workerSets: [nope]}\n").unwrap();
    let leader = cluster.leader(&[0, 1, 2]).await.unwrap();
    eventually(
        "the leader to refuse the directory",
        Duration::from_secs(20),
        || async {
            let m = cluster.nodes[leader].metrics().await;
            (harness::metric_value(&m, "kvplane_policy_source_invalid_reads_total") >= 1.0)
                .then_some(())
        },
    )
    .await;
    assert_eq!(cluster.nodes[0].status().await.config_index, first);

    // A valid edit (a backend removed) is one new generation everywhere.
    std::fs::remove_file(dir.join("7-broken.yaml")).unwrap();
    std::fs::remove_file(dir.join("5-aliasing.yaml")).unwrap();
    let second = generation(&cluster, first, 13).await;
    assert!(second > first);
}
