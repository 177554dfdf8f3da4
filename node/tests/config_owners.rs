//! Config objects have owners, on a real node: the policy directory, `Admin.PutConfig` and the
//! node's `[[pools]]` each keep their own objects, a write to another's is refused naming the
//! owner while that owner's changes still apply, an emptied directory deletes nothing, and
//! `kvplane config delete --owner` is the explicit act that does.

#![allow(clippy::unwrap_used)]

mod harness;

use std::path::Path;
use std::time::Duration;

use harness::{Cluster, NodeOptions, eventually, kvplane_ok, metric_value};
use kvplane_proto::v1::{DeleteConfigRequest, PutConfigRequest, StatusResponse};

const SET: &str = "apiVersion: kvplane.io/v1alpha1\nkind: InferenceWorkerSet\nmetadata: {name: gpu}\nspec: {model: m, blockSize: 16}\n";

fn provider_yaml(name: &str) -> String {
    format!(
        "apiVersion: kvplane.io/v1alpha1\nkind: InferenceProvider\nmetadata: {{name: {name}}}\nspec: {{endpoint: 'https://p.example/v1', api: OpenAI, model: x, expectedTtftMs: 500}}\n"
    )
}

fn provider_json() -> Vec<u8> {
    br#"{"endpoint":"https://admin.example/v1","api":"OpenAI","model":"y","expectedTtftMs":700}"#
        .to_vec()
}

/// `kind/name owner` from Status, sorted.
fn owners(s: &StatusResponse) -> Vec<String> {
    let mut v: Vec<String> = s
        .config_objects
        .iter()
        .map(|c| format!("{}/{} {}", c.kind, c.name, c.owner))
        .collect();
    v.sort();
    v
}

async fn wait_owners(node: &harness::Node, want: &[&str]) -> StatusResponse {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let s = node.status().await;
        if owners(&s) == want {
            return s;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "waiting for {want:?}, the node holds {:?}\n{}",
            owners(&s),
            node.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn write(dir: &Path, file: &str, text: &str) {
    // Written aside and renamed: the source never reads half a file.
    let tmp = dir.join(format!(".{file}.tmp"));
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, dir.join(file)).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_directory_and_admin_keep_their_own_objects_and_neither_overwrites_the_other() {
    let policies = tempfile::tempdir().unwrap();
    write(policies.path(), "set.yaml", SET);
    let o = NodeOptions {
        policy_dir: Some(policies.path().to_owned()),
        ..Default::default()
    };
    let cluster = Cluster::start_with(1, &o);
    let node = &cluster.nodes[0];
    wait_owners(node, &["InferenceWorkerSet/gpu directory"]).await;

    // Admin may not overwrite the directory's object: refused, the owner named.
    let mut admin = node.admin().await;
    let err = admin
        .put_config(PutConfigRequest {
            kind: "InferenceWorkerSet".into(),
            name: "gpu".into(),
            value: br#"{"model":"other","blockSize":16}"#.to_vec(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err}");
    assert!(err.message().contains("owned by directory"), "{err}");
    // Counted as a refused write through this replica.
    let refused = r#"kvplane_raft_propose_failures_total{path="replica_write",reason="refused"} 1"#;
    let metrics = node.metrics().await;
    assert!(metrics.lines().any(|l| l == refused), "{metrics}");
    // An object of its own it may write, and the directory's next pass leaves it alone.
    admin
        .put_config(PutConfigRequest {
            kind: "InferenceProvider".into(),
            name: "by-admin".into(),
            value: provider_json(),
        })
        .await
        .unwrap();
    // A directory change still applies, beside the admin's object.
    write(policies.path(), "provider.yaml", &provider_yaml("by-dir"));
    let s = wait_owners(
        node,
        &[
            "InferenceProvider/by-admin admin",
            "InferenceProvider/by-dir directory",
            "InferenceWorkerSet/gpu directory",
        ],
    )
    .await;
    assert!(s.config_index > 0);

    // The directory names the admin's object too: that one is left out (counted), the rest of
    // the change applies.
    write(
        policies.path(),
        "provider.yaml",
        &format!(
            "{}---\n{}",
            provider_yaml("by-dir-2"),
            provider_yaml("by-admin")
        ),
    );
    wait_owners(
        node,
        &[
            "InferenceProvider/by-admin admin",
            "InferenceProvider/by-dir-2 directory",
            "InferenceWorkerSet/gpu directory",
        ],
    )
    .await;
    let text = node.metrics().await;
    assert_eq!(metric_value(&text, "kvplane_policy_source_conflicts"), 1.0);
    let status = kvplane_ok(&["status", "--addr", &node.endpoint()]);
    // `kvplane status` shows each object with its owner, one per line.
    let row = |object: &str, owner: &str| {
        status
            .lines()
            .any(|l| l.split_whitespace().eq([object, owner]))
    };
    assert!(row("InferenceProvider/by-admin", "admin"), "{status}");
    assert!(row("InferenceWorkerSet/gpu", "directory"), "{status}");

    // The directory emptied (a lost mount, say): nothing is deleted...
    std::fs::remove_file(policies.path().join("provider.yaml")).unwrap();
    std::fs::remove_file(policies.path().join("set.yaml")).unwrap();
    eventually(
        "the kept objects counted",
        Duration::from_secs(20),
        || async {
            let text = node.metrics().await;
            (metric_value(&text, "kvplane_policy_source_kept_objects") == 2.0).then_some(())
        },
    )
    .await;
    assert_eq!(owners(&node.status().await).len(), 3);
    // ...until an operator deletes on the directory's behalf.
    let out = kvplane_ok(&[
        "config",
        "delete",
        "--addr",
        &node.endpoint(),
        "--kind",
        "InferenceProvider",
        "--name",
        "by-dir-2",
        "--owner",
        "directory",
    ]);
    assert!(out.contains("written"), "{out}");
    wait_owners(
        node,
        &[
            "InferenceProvider/by-admin admin",
            "InferenceWorkerSet/gpu directory",
        ],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_configs_pools_are_the_nodes_and_only_an_explicit_delete_removes_one() {
    let cluster = Cluster::start(1);
    let node = &cluster.nodes[0];
    wait_owners(node, &["pool/default node"]).await;
    let mut admin = node.admin().await;
    let err = admin
        .put_config(PutConfigRequest {
            kind: "pool".into(),
            name: "default".into(),
            value: br#"{"block_size":32,"models":[]}"#.to_vec(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err}");
    assert!(err.message().contains("owned by node"), "{err}");
    let err = admin
        .delete_config(DeleteConfigRequest {
            kind: "pool".into(),
            name: "default".into(),
            owner: String::new(),
        })
        .await
        .unwrap_err();
    assert!(err.message().contains("owned by node"), "{err}");
    let err = admin
        .delete_config(DeleteConfigRequest {
            kind: "pool".into(),
            name: "default".into(),
            owner: "root".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err}");
    // On the node's behalf, it goes.
    admin
        .delete_config(DeleteConfigRequest {
            kind: "pool".into(),
            name: "default".into(),
            owner: "node".into(),
        })
        .await
        .unwrap();
    assert!(node.status().await.config_objects.is_empty());
}
