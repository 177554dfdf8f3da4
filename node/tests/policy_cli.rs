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
