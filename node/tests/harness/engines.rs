//! A node with simulated engines behind it, as the fleet and Envoy tests start them.

use std::time::Duration;

use super::{Cluster, Engine, Node, NodeOptions, eventually};

/// Waits until `node` knows `n` workers up with an address.
pub async fn wait_workers_up(node: &Node, n: usize) {
    eventually(
        &format!("{n} workers up"),
        Duration::from_secs(30),
        || async {
            let s = node.status().await;
            (s.workers
                .iter()
                .filter(|w| w.up && !w.address.is_empty())
                .count()
                >= n)
                .then_some(())
        },
    )
    .await;
}

/// One node whose pool serves `sim-8b`, and `n` simulated engines (`engine-1`...) with their
/// bridges, every one up on the node.
pub async fn node_with_engines(n: usize) -> (Cluster, Vec<Engine>) {
    node_with_engines_under(
        n,
        &NodeOptions {
            pool_models: vec!["sim-8b".into()],
            ..Default::default()
        },
    )
    .await
}

/// The same with the node's options `o` (a policy directory declaring pool `default`...).
pub async fn node_with_engines_under(n: usize, o: &NodeOptions) -> (Cluster, Vec<Engine>) {
    let cluster = Cluster::start_with(1, o);
    let root = cluster.root.path().to_owned();
    let engines: Vec<Engine> = (1..=n)
        .map(|i| {
            Engine::start(
                &root.join("fleet"),
                &cluster.nats.url(),
                &format!("engine-{i}"),
            )
        })
        .collect();
    wait_workers_up(&cluster.nodes[0], n).await;
    (cluster, engines)
}

/// `n` words tagged `tag`, repeating after 97 (the simulated engines' and kvplane's word
/// tokenizer: a token each).
pub fn words(tag: &str, n: usize) -> String {
    (0..n)
        .map(|i| format!("{tag}{}", i % 97))
        .collect::<Vec<_>>()
        .join(" ")
}
