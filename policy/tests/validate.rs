//! Validation reports every problem of a directory at once, each located by file, document
//! and field path.

#![allow(clippy::unwrap_used)]

use kvplane_policy::Documents;

fn problems() -> Vec<String> {
    let file = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/policies-broken/broken.yaml"
    );
    let mut docs = Documents::default();
    docs.add_file("broken.yaml", &std::fs::read_to_string(file).unwrap());
    let (_, problems) = docs.check();
    problems.iter().map(ToString::to_string).collect()
}

#[test]
fn every_problem_of_the_broken_examples_is_reported_with_its_path() {
    let p = problems();
    let expect = [
        "broken.yaml (document 1) InferenceWorkerSet/gpu-a spec.blockSize: must be within 1..=1024, got 0",
        "broken.yaml (document 2) InferencePool/pool-a spec.workerSets[1]: InferenceWorkerSet \"gpu-missing\" does not exist",
        "broken.yaml (document 3) InferencePolicy/rules spec.rules[0].filter.maxKvCacheUsage: must be within 0..1, got 1.5",
        "broken.yaml (document 3) InferencePolicy/rules spec.rules[1].match: unreachable: rule \"everything\" before it matches every request this one matches",
        "broken.yaml (document 3) InferencePolicy/rules spec.rules[1].onEmpty.fallback: Fallback needs fallback targets",
        "broken.yaml (document 4) InferencePolicy/typo spec.rules[0].filter.maxQueud: unknown field `maxQueud`",
        "broken.yaml (document 5) GatewayBackend/loop-a spec.backends: model aliases form a cycle: a -> b -> a",
        "broken.yaml (document 6) GatewayBackend/loop-b spec.policies[0]: InferencePolicy \"missing-policy\" does not exist",
        "broken.yaml (document 7) InferencePool/pool-a metadata.name: defined twice (first in broken.yaml document 2)",
        "broken.yaml (document 8) InferencePool/wrong-version apiVersion: \"kvplane.io/v2\" is not \"kvplane.io/v1alpha1\"",
        "broken.yaml (document 10) GatewayBackend/shadowed spec.policies[1]: rule pii-later/pii (spec.rules[0]) is unreachable here: rule rules/everything of an earlier policy matches every request it matches",
    ];
    for e in expect {
        assert!(
            p.iter().any(|x| x.starts_with(e)),
            "missing {e:?} in\n{}",
            p.join("\n")
        );
    }
}

#[test]
fn a_policy_no_backend_lists_and_that_names_no_model_is_reported() {
    let mut docs = Documents::default();
    docs.add_file(
        "p.yaml",
        "apiVersion: kvplane.io/v1alpha1\nkind: InferenceWorkerSet\nmetadata: {name: ws}\nspec: {model: m}\n---\napiVersion: kvplane.io/v1alpha1\nkind: InferencePolicy\nmetadata: {name: loose}\nspec:\n  rules: [{name: r, filter: {maxQueued: 1}}]\n---\napiVersion: kvplane.io/v1alpha1\nkind: InferencePolicy\nmetadata: {name: attached}\nspec:\n  appliesToModels: [m]\n  rules: [{name: r, filter: {maxQueued: 1}}]\n---\napiVersion: kvplane.io/v1alpha1\nkind: InferencePolicy\nmetadata: {name: limits-only}\nspec:\n  limits: [{tenant: t, tokensPerMinute: 10}]\n",
    );
    let (_, problems) = docs.check();
    let p: Vec<String> = problems.iter().map(ToString::to_string).collect();
    assert_eq!(p.len(), 1, "{p:#?}");
    assert!(
        p[0].contains("InferencePolicy/loose spec.rules: its rules apply to no request"),
        "{p:#?}"
    );
}

#[test]
fn where_a_worker_sets_engines_are_is_checked() {
    let mut docs = Documents::default();
    let set = |name: &str, spec: &str| {
        format!(
            "apiVersion: kvplane.io/v1alpha1\nkind: InferenceWorkerSet\nmetadata: {{name: {name}}}\nspec: {spec}\n---\n"
        )
    };
    let text = [
        set(
            "no-scheme",
            "{model: m, endpoints: [{worker: w0, address: '10.0.0.1:8000'}]}",
        ),
        set(
            "no-host",
            "{model: m, endpoints: [{worker: w0, address: 'http://:8000'}]}",
        ),
        set(
            "empty-selector",
            "{model: m, selector: {matchLabels: {}, port: 0}}",
        ),
        set(
            "two-sources",
            "{model: m, selector: {matchLabels: {app: a}, port: 8000}, inferencePoolRef: p}",
        ),
        set("bad-ref", "{model: m, inferencePoolRef: 'Not A Name'}"),
        set(
            "fine",
            "{model: m, endpoints: [{worker: w0, address: 'https://[fd00::1]:8000/'}]}",
        ),
        set("by-pool", "{model: m, inferencePoolRef: llama}"),
    ]
    .concat();
    docs.add_file("w.yaml", &text);
    let (_, problems) = docs.check();
    let p: Vec<String> = problems.iter().map(ToString::to_string).collect();
    let expect = [
        "InferenceWorkerSet/no-scheme spec.endpoints[0].address: \"10.0.0.1:8000\" is not an http(s) URL",
        "InferenceWorkerSet/no-host spec.endpoints[0].address: \"http://:8000\" is not an http(s) URL",
        "InferenceWorkerSet/empty-selector spec.selector.matchLabels: must hold a label",
        "InferenceWorkerSet/empty-selector spec.selector.port: must be a port number",
        "InferenceWorkerSet/two-sources spec: give one of endpoints, selector and inferencePoolRef",
        "InferenceWorkerSet/bad-ref spec.inferencePoolRef: \"Not A Name\" is not a valid object name",
    ];
    for e in expect {
        assert!(
            p.iter().any(|x| x.contains(e)),
            "missing {e:?} in\n{}",
            p.join("\n")
        );
    }
    assert_eq!(p.len(), expect.len(), "{p:#?}");
}

#[test]
fn a_rule_after_a_wider_one_is_unreachable_within_and_across_policies() {
    let policy = |name: &str, rules: &str| {
        format!(
            "---\napiVersion: kvplane.io/v1alpha1\nkind: InferencePolicy\nmetadata: {{name: {name}}}\nspec:\n  rules:\n{rules}"
        )
    };
    let mut docs = Documents::default();
    docs.add_file(
        "p.yaml",
        &[
            "apiVersion: kvplane.io/v1alpha1\nkind: InferenceWorkerSet\nmetadata: {name: ws}\nspec: {model: m}\n".to_owned(),
            "---\napiVersion: kvplane.io/v1alpha1\nkind: GatewayBackend\nmetadata: {name: b}\nspec: {publicModel: pub, backends: [{workerSet: ws}], policies: [first, second]}\n".to_owned(),
            policy("first", "    - {name: pii, match: {tags: [pii]}}\n    - {name: pii-batch, match: {tags: [batch, pii]}}\n    - {name: acme, match: {tenants: [acme]}}\n"),
            policy("second", "    - {name: acme-pii, match: {tenants: [acme], tags: [pii]}}\n    - {name: beta, match: {tenants: [beta]}}\n"),
        ]
        .concat(),
    );
    let (_, problems) = docs.check();
    let p: Vec<String> = problems.iter().map(ToString::to_string).collect();
    assert_eq!(p.len(), 2, "{p:#?}");
    assert!(
        p[0].contains("GatewayBackend/b spec.policies[1]: rule second/acme-pii (spec.rules[0]) is unreachable here: rule first/pii"),
        "{p:#?}"
    );
    assert!(
        p[1].contains("InferencePolicy/first spec.rules[1].match: unreachable: rule \"pii\""),
        "{p:#?}"
    );
}

#[test]
fn the_examples_directory_is_valid() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/policies");
    let docs = Documents::read(&[dir.into()]).unwrap();
    let (catalog, problems) = docs.check();
    assert!(problems.is_empty(), "{problems:#?}");
    assert_eq!(
        (
            catalog.worker_sets.len(),
            catalog.pools.len(),
            catalog.providers.len()
        ),
        (2, 3, 1)
    );
    assert_eq!((catalog.policies.len(), catalog.backends.len()), (5, 3));
    // What a gateway's /v1/models lists: the three public names and the two models the worker
    // sets run (the provider's model is not a client's to name).
    let names: Vec<(&str, &str)> = catalog.model_names().into_iter().collect();
    assert_eq!(
        names,
        [
            ("assistant", "public"),
            ("chat", "public"),
            ("llama-70b", "served"),
            ("llama-8b", "served"),
            ("standard-model", "public"),
        ]
    );
}

#[test]
fn the_generated_crds_cover_the_six_kinds_in_our_group_with_status() {
    let yaml = kvplane_policy::crds_yaml();
    for kind in [
        "InferenceWorkerSet",
        "InferencePool",
        "InferenceProvider",
        "InferencePolicy",
        "GatewayBackend",
        "AccessPolicy",
    ] {
        assert!(yaml.contains(&format!("kind: {kind}\n")), "{kind}");
    }
    assert_eq!(yaml.matches("group: kvplane.io").count(), 6);
    assert_eq!(yaml.matches("status: {}").count(), 6, "status subresources");
}
