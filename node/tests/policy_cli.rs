//! `kvplane validate` and `kvplane crds` as a user runs them.

#![allow(clippy::unwrap_used)]

use std::process::Command;

fn kvplane(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kvplane"))
        .args(args)
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .output()
        .unwrap()
}

#[test]
fn validate_accepts_the_examples() {
    let out = kvplane(&["validate", "examples/policies"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("ok: 2 worker sets, 3 pools, 1 providers, 5 policies"),
        "{stdout}"
    );
}

#[test]
fn validate_prints_every_error_with_its_path_and_fails() {
    let out = kvplane(&["validate", "examples/policies-broken"]);
    assert!(!out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 12, "{stdout}");
    assert!(
        lines
            .iter()
            .all(|l| l.starts_with("examples/policies-broken/broken.yaml (document ")),
        "{stdout}"
    );
    assert!(
        stdout.contains("spec.rules[0].filter.maxQueud: unknown field"),
        "{stdout}"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("12 problems found"), "{stderr}");
}

#[test]
fn crds_prints_six_definitions() {
    let out = kvplane(&["crds"]);
    assert!(out.status.success());
    let yaml = String::from_utf8_lossy(&out.stdout);
    assert_eq!(yaml.matches("kind: CustomResourceDefinition").count(), 6);
}

#[test]
fn validate_reports_every_problem_of_an_access_policy() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("access.yaml"),
        "apiVersion: kvplane.io/v1alpha1\nkind: AccessPolicy\nmetadata: {name: too-wide}\nspec: {identities: ['*'], rights: [route]}\n---\napiVersion: kvplane.io/v1alpha1\nkind: AccessPolicy\nmetadata: {name: typo}\nspec: {identities: ['spiffe://a/gw'], rights: [rout]}\n",
    )
    .unwrap();
    let out = kvplane(&["validate", dir.path().to_str().unwrap()]);
    assert!(!out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    for want in [
        "AccessPolicy/too-wide spec.identities[0]",
        "AccessPolicy/too-wide spec.tenants: route needs the tenants it covers",
        "spec.rights[0]: unknown variant `rout`",
    ] {
        assert!(stdout.contains(want), "{want}: {stdout}");
    }
}

#[test]
fn explain_shows_what_an_identity_may_do_and_whether_it_may_route_the_tenant() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("access.yaml"),
        "apiVersion: kvplane.io/v1alpha1\nkind: AccessPolicy\nmetadata: {name: cluster-a}\nspec: {identities: ['spiffe://a/*'], rights: [route, read], tenants: [acme]}\n",
    )
    .unwrap();
    let explain = |identity: &str, tenant: &str| {
        let out = kvplane(&[
            "explain",
            "--policies",
            "examples/policies",
            "--policies",
            dir.path().to_str().unwrap(),
            "--identity",
            identity,
            "--model",
            "chat",
            "--tenant",
            tenant,
            "--prompt",
            "hello",
        ]);
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let a = explain("spiffe://a/gw", "acme");
    assert!(
        a.contains("access: spiffe://a/gw holds route, read (AccessPolicy cluster-a), route for tenants [\"acme\"]"),
        "{a}"
    );
    assert!(
        a.contains("access: spiffe://a/gw may route for tenant \"acme\""),
        "{a}"
    );
    let other = explain("spiffe://a/gw", "globex");
    assert!(
        other.contains(
            "may not route for tenant \"globex\": Route would be refused PERMISSION_DENIED"
        ),
        "{other}"
    );
    let b = explain("spiffe://b/gw", "acme");
    assert!(
        b.contains("access: spiffe://b/gw: no AccessPolicy names it, no right"),
        "{b}"
    );
}

/// Offline explain decides as a replica in `--cluster` would: a `sameLocality` rule drops the
/// other cluster's worker set with its words, `--rtt` adds the round trip to its predicted
/// TTFT, and a round trip with no cluster of one's own is refused.
#[test]
fn explain_decides_as_a_replica_in_the_cluster_it_is_told() {
    let dir = tempfile::tempdir().unwrap();
    let set = |name: &str, cluster: &str, ip: &str| {
        format!(
            "apiVersion: kvplane.io/v1alpha1\nkind: InferenceWorkerSet\nmetadata: {{name: {name}}}\nspec:\n  model: m\n  labels: {{kvplane.io/cluster: {cluster}}}\n  endpoints: [{{worker: {name}0, address: \"http://{ip}:8000\"}}]\n---\n"
        )
    };
    let yaml = set("near", "b", "10.0.0.1")
        + &set("far", "c", "10.0.1.1")
        + "apiVersion: kvplane.io/v1alpha1\nkind: InferencePool\nmetadata: {name: all}\nspec: {workerSets: [near, far]}\n---\n"
        + "apiVersion: kvplane.io/v1alpha1\nkind: GatewayBackend\nmetadata: {name: m}\nspec: {publicModel: m, backends: [{pool: all}], policies: [local-pii]}\n---\n"
        + "apiVersion: kvplane.io/v1alpha1\nkind: InferencePolicy\nmetadata: {name: local-pii}\nspec:\n  rules:\n  - {name: stay, match: {tags: [pii]}, filter: {sameLocality: Cluster}}\n";
    std::fs::write(dir.path().join("p.yaml"), yaml).unwrap();
    let policies = dir.path().to_str().unwrap();
    let run = |extra: &[&str]| {
        let mut args = vec![
            "explain",
            "--policies",
            policies,
            "--model",
            "m",
            "--prompt",
            "hi",
        ];
        args.extend_from_slice(extra);
        kvplane(&args)
    };
    let explain = |extra: &[&str]| {
        let out = run(&[extra, &["--json"]].concat());
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let x = explain(&["--tag", "pii", "--cluster", "b", "--rtt", "c=40"]);
    let far = x["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["pool"] == "far")
        .unwrap();
    assert_eq!(far["filtered_by"], "same_locality");
    assert_eq!(far["network_ms"], 40.0);
    assert_eq!(x["decision"]["endpoint"]["pool"], "near", "{x}");
    // Not told its cluster: the rule keeps its promise by refusing.
    let x = explain(&["--tag", "pii"]);
    assert!(x["decision"]["rejection"].is_object(), "{x}");
    let out = run(&["--rtt", "c=40"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--cluster is needed with round trips"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
