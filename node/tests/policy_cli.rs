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
