//! The Kubernetes manifests in deploy/: every overlay renders with `kubectl kustomize`, every
//! rendered object parses strictly as its Kubernetes type (unknown or misplaced fields fail),
//! and what the code defines - the CRDs, the node configuration, the kinds the watcher needs -
//! is what the manifests say.

#![allow(clippy::unwrap_used)]

#[path = "deploy_types/cert_manager.rs"]
mod cert_manager;
#[path = "deploy_types/gateway_api.rs"]
mod gateway_api;
#[path = "deploy_types/istio.rs"]
mod istio;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Service, ServiceAccount};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde::de::DeserializeOwned;
use serde_json::Value;

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

/// `kubectl kustomize` of a directory under deploy/, as JSON documents.
fn render(dir: &str) -> Vec<Value> {
    let out = std::process::Command::new("kubectl")
        .args(["kustomize"])
        .arg(deploy_dir().join(dir))
        .output()
        .unwrap_or_else(|e| panic!("kubectl is needed to render deploy/ ({e})"));
    assert!(
        out.status.success(),
        "kubectl kustomize {dir}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    yaml_documents(&String::from_utf8(out.stdout).unwrap())
}

fn yaml_documents(text: &str) -> Vec<Value> {
    use serde::Deserialize;
    serde_yaml_ng::Deserializer::from_str(text)
        .map(|d| Value::deserialize(d).unwrap())
        .filter(|v| !v.is_null())
        .collect()
}

/// `doc` as a `T`, failing when any field of it is not one of `T`'s (a typo, a field at the
/// wrong level, a field of another API version): the typed value must serialize back to the
/// very same document.
fn strict<T: DeserializeOwned + serde::Serialize>(doc: &Value) -> T {
    let typed: T = serde_path_to_error::deserialize(doc.clone()).unwrap_or_else(|e| {
        panic!("{}: {e}", name_of(doc));
    });
    let back = serde_json::to_value(&typed).unwrap();
    if let Some(path) = first_difference(doc, &back, String::new()) {
        panic!("{}: field {path} is not part of its kind", name_of(doc));
    }
    typed
}

fn name_of(doc: &Value) -> String {
    format!(
        "{}/{}",
        doc["kind"].as_str().unwrap_or("?"),
        doc["metadata"]["name"].as_str().unwrap_or("?")
    )
}

fn first_difference(a: &Value, b: &Value, path: String) -> Option<String> {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => x.iter().find_map(|(k, v)| match y.get(k) {
            None => Some(format!("{path}.{k}")),
            Some(w) => first_difference(v, w, format!("{path}.{k}")),
        }),
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => x
            .iter()
            .zip(y)
            .enumerate()
            .find_map(|(i, (v, w))| first_difference(v, w, format!("{path}[{i}]"))),
        // Numbers may come back as another representation of the same value.
        (Value::Number(x), Value::Number(y)) if x.as_f64() == y.as_f64() => None,
        _ if a == b => None,
        _ => Some(path),
    }
}

/// Every object of a rendering, parsed by kind.
#[derive(Default)]
struct Rendered {
    statefulsets: Vec<StatefulSet>,
    services: Vec<Service>,
    pdbs: Vec<PodDisruptionBudget>,
    roles: Vec<Role>,
    config_maps: Vec<ConfigMap>,
    crds: Vec<CustomResourceDefinition>,
    deployments: Vec<Deployment>,
    kvplane_objects: Vec<Value>,
    inference_pools: Vec<gateway_api::InferencePool>,
    /// The same, as rendered.
    inference_pool_docs: Vec<Value>,
    gateways: Vec<gateway_api::Gateway>,
    http_routes: Vec<gateway_api::HttpRoute>,
    issuers: Vec<cert_manager::Issuer>,
    certificates: Vec<cert_manager::Certificate>,
    destination_rules: Vec<istio::DestinationRule>,
}

fn parse(docs: &[Value]) -> Rendered {
    let mut r = Rendered::default();
    for d in docs {
        match (d["apiVersion"].as_str(), d["kind"].as_str()) {
            (Some("v1"), Some("Namespace")) => drop(strict::<Namespace>(d)),
            (Some("v1"), Some("ServiceAccount")) => drop(strict::<ServiceAccount>(d)),
            (Some("v1"), Some("Service")) => r.services.push(strict(d)),
            (Some("v1"), Some("ConfigMap")) => r.config_maps.push(strict(d)),
            (Some("apps/v1"), Some("StatefulSet")) => r.statefulsets.push(strict(d)),
            (Some("apps/v1"), Some("Deployment")) => r.deployments.push(strict(d)),
            (Some("policy/v1"), Some("PodDisruptionBudget")) => r.pdbs.push(strict(d)),
            (Some("rbac.authorization.k8s.io/v1"), Some("Role")) => r.roles.push(strict(d)),
            (Some("rbac.authorization.k8s.io/v1"), Some("RoleBinding")) => {
                drop(strict::<RoleBinding>(d));
            }
            (Some("apiextensions.k8s.io/v1"), Some("CustomResourceDefinition")) => {
                r.crds.push(strict(d));
            }
            (Some("kvplane.io/v1alpha1"), Some(kind)) => {
                let mut docs = kvplane_policy::Documents::default();
                docs.add_file(kind, &serde_yaml_ng::to_string(d).unwrap());
                let (_, problems) = docs.check();
                assert!(problems.is_empty(), "{}: {problems:?}", name_of(d));
                r.kvplane_objects.push(d.clone());
            }
            (Some("inference.networking.k8s.io/v1"), Some("InferencePool")) => {
                r.inference_pools.push(strict(d));
                r.inference_pool_docs.push(d.clone());
            }
            (Some("gateway.networking.k8s.io/v1"), Some("Gateway")) => r.gateways.push(strict(d)),
            (Some("gateway.networking.k8s.io/v1"), Some("HTTPRoute")) => {
                r.http_routes.push(strict(d));
            }
            (Some("cert-manager.io/v1"), Some("Issuer")) => r.issuers.push(strict(d)),
            (Some("cert-manager.io/v1"), Some("Certificate")) => r.certificates.push(strict(d)),
            (Some("networking.istio.io/v1"), Some("DestinationRule")) => {
                r.destination_rules.push(strict(d));
            }
            other => panic!("{}: no strict check for {other:?}", name_of(d)),
        }
    }
    r
}

const CONTROL_PLANE: [(&str, &str); 2] = [
    ("app.kubernetes.io/name", "kvplane"),
    ("app.kubernetes.io/component", "control-plane"),
];

fn check_control_plane(overlay: &str, replicas: i32) -> Rendered {
    let r = parse(&render(overlay));
    assert_eq!(r.statefulsets.len(), 1, "{overlay}");
    let set = &r.statefulsets[0];
    let spec = set.spec.as_ref().unwrap();
    assert_eq!(spec.replicas, Some(replicas), "{overlay}");
    assert_eq!(spec.pod_management_policy.as_deref(), Some("Parallel"));
    assert_eq!(spec.service_name.as_deref(), Some("kvplane-peers"));
    let claims = spec.volume_claim_templates.as_ref().unwrap();
    assert_eq!(claims[0].metadata.name.as_deref(), Some("data"));
    let retention = spec
        .persistent_volume_claim_retention_policy
        .as_ref()
        .unwrap();
    assert_eq!(
        retention.when_scaled.as_deref(),
        Some("Delete"),
        "ids are never reused"
    );
    let selector = spec.selector.match_labels.as_ref().unwrap();
    for (k, v) in CONTROL_PLANE {
        assert_eq!(selector.get(k).map(String::as_str), Some(v));
    }
    let pod = spec.template.spec.as_ref().unwrap();
    assert!(
        pod.affinity
            .as_ref()
            .and_then(|a| a.pod_anti_affinity.as_ref())
            .is_some(),
        "{overlay}: anti-affinity"
    );
    let c = &pod.containers[0];
    let port = |name: &str| {
        c.ports
            .as_ref()
            .unwrap()
            .iter()
            .find(|p| p.name.as_deref() == Some(name))
            .map(|p| p.container_port)
    };
    assert_eq!((port("grpc"), port("http")), (Some(7070), Some(7071)));
    let probe_path = |p: &Option<k8s_openapi::api::core::v1::Probe>| {
        let g = p.as_ref().unwrap().http_get.as_ref().unwrap();
        assert_eq!(g.port, IntOrString::String("http".into()));
        g.path.clone().unwrap()
    };
    assert_eq!(probe_path(&c.liveness_probe), "/healthz");
    assert_eq!(probe_path(&c.readiness_probe), "/readyz");

    // The disruption budget keeps a quorum: at most (n - 1) / 2 members down.
    let pdb = r.pdbs[0].spec.as_ref().unwrap();
    let down = match &pdb.max_unavailable {
        Some(IntOrString::Int(n)) => *n,
        Some(IntOrString::String(s)) => panic!("maxUnavailable {s:?}: give a count"),
        None => {
            replicas
                - pdb.min_available.as_ref().map_or(0, |m| match m {
                    IntOrString::Int(n) => *n,
                    IntOrString::String(s) => panic!("minAvailable {s:?}: give a count"),
                })
        }
    };
    assert!(
        down >= 1 && down <= (replicas - 1) / 2,
        "{overlay}: {down} of {replicas} may be down"
    );

    // Peers reach each other through the headless Service, also before they are ready.
    let peers = r
        .services
        .iter()
        .find(|s| s.metadata.name.as_deref() == Some("kvplane-peers"))
        .unwrap()
        .spec
        .clone()
        .unwrap();
    assert_eq!(peers.cluster_ip.as_deref(), Some("None"));
    assert_eq!(peers.publish_not_ready_addresses, Some(true));
    assert!(
        r.services
            .iter()
            .any(|s| s.metadata.name.as_deref() == Some("kvplane"))
    );
    r
}

#[test]
fn every_overlay_renders_and_each_object_parses_strictly_as_its_kind() {
    let dev = check_control_plane("overlays/dev", 3);
    let prod = check_control_plane("overlays/prod", 5);
    for r in [&dev, &prod] {
        assert_eq!(r.crds.len(), 6);
        assert_eq!(r.roles.len(), 1);
        assert_eq!(r.config_maps.len(), 1);
    }
    let vllm = parse(&render("examples/vllm"));
    assert_eq!(vllm.deployments.len(), 1);
    assert_eq!(vllm.kvplane_objects.len(), 1);
    let pod = vllm.deployments[0]
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .unwrap();
    let names: Vec<&str> = pod.containers.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["vllm", "kvplane-bridge"]);
    let bridge = &pod.containers[1];
    let args = bridge.args.as_ref().unwrap();
    assert_eq!(args[0], "bridge");
    // The bridge's flags are ones `kvplane bridge` takes.
    for a in &args[1..] {
        let flag = a.split('=').next().unwrap();
        let help = kvplane_help(&["bridge", "--help"]);
        assert!(help.contains(flag), "kvplane bridge has no {flag}");
    }
}

fn kvplane_help(args: &[&str]) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvplane"))
        .args(args)
        .output()
        .unwrap();
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn the_crds_in_deploy_are_the_ones_the_code_generates() {
    let committed = std::fs::read_to_string(deploy_dir().join("base/crds.yaml")).unwrap();
    assert!(
        committed == kvplane_policy::crds_yaml(),
        "deploy/base/crds.yaml drifted from the code: run `kvplane crds > deploy/base/crds.yaml`"
    );
}

#[test]
fn the_role_grants_exactly_what_the_watchers_read_and_write() {
    let r = parse(&render("overlays/dev"));
    let plurals: BTreeSet<String> = r.crds.iter().map(|c| c.spec.names.plural.clone()).collect();
    assert_eq!(plurals.len(), kvplane_policy::Kind::ALL.len());
    let rules = r.roles[0].rules.clone().unwrap();
    let granted = |group: &str, verbs: &[&str]| -> BTreeSet<String> {
        rules
            .iter()
            .filter(|x| x.api_groups.as_deref() == Some(&[group.to_owned()][..]))
            .filter(|x| x.verbs.iter().map(String::as_str).eq(verbs.iter().copied()))
            .flat_map(|x| x.resources.clone().unwrap_or_default())
            .collect()
    };
    assert_eq!(granted("kvplane.io", &["get", "list", "watch"]), plurals);
    let status: BTreeSet<String> = plurals.iter().map(|p| format!("{p}/status")).collect();
    assert_eq!(granted("kvplane.io", &["get", "patch", "update"]), status);
    // Besides: reading its own StatefulSet, and watching the engines' pods and InferencePools.
    let other: BTreeSet<(String, String, String, Vec<String>)> = rules
        .iter()
        .filter(|x| x.api_groups.as_deref() != Some(&["kvplane.io".to_owned()][..]))
        .flat_map(|x| {
            let group = x.api_groups.clone().unwrap_or_default().join(",");
            let names = x.resource_names.clone().unwrap_or_default().join(",");
            x.resources
                .clone()
                .unwrap_or_default()
                .into_iter()
                .map(move |r| (group.clone(), r, names.clone(), x.verbs.clone()))
        })
        .collect();
    let read = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    let want: BTreeSet<(String, String, String, Vec<String>)> = [
        ("apps", "statefulsets", "kvplane", read(&["get"])),
        ("", "pods", "", read(&["get", "list", "watch"])),
        (
            "inference.networking.k8s.io",
            "inferencepools",
            "",
            read(&["get", "list", "watch"]),
        ),
    ]
    .into_iter()
    .map(|(g, r, n, v)| (g.to_owned(), r.to_owned(), n.to_owned(), v))
    .collect();
    assert_eq!(other, want);
    // The plural the engines' watcher reads is the one granted.
    assert_eq!(
        kvplane_node::sources::kube_engines::inference_pool_resource().plural,
        "inferencepools"
    );
}

#[test]
fn the_inference_extension_example_points_its_inference_pool_at_kvplane_and_its_engines() {
    let control_plane = parse(&render("overlays/dev"));
    let r = parse(&render("examples/inference-extension"));
    let [pool] = &r.inference_pools[..] else {
        panic!("one InferencePool")
    };
    let spec = &pool.spec;
    // The picker is kvplane's client Service, on the port that serves the picker (gRPC).
    let picker = control_plane
        .services
        .iter()
        .find(|s| s.metadata.name.as_deref() == Some(spec.endpoint_picker_ref.name.as_str()))
        .unwrap_or_else(|| panic!("no Service {}", spec.endpoint_picker_ref.name));
    let port = spec.endpoint_picker_ref.port.as_ref().unwrap().number;
    let grpc = picker.spec.as_ref().unwrap().ports.as_ref().unwrap();
    assert!(
        grpc.iter()
            .any(|p| p.name.as_deref() == Some("grpc") && p.port == i32::from(port)),
        "the picker port {port} is not the Service's grpc port"
    );
    assert_eq!(
        pool.metadata.namespace, picker.metadata.namespace,
        "an endpointPickerRef names a Service of its own namespace"
    );
    // Its selector takes the Deployment's pods, on vLLM's port.
    let [deployment] = &r.deployments[..] else {
        panic!("one Deployment")
    };
    let template = &deployment.spec.as_ref().unwrap().template;
    let labels = template.metadata.as_ref().unwrap().labels.clone().unwrap();
    for (k, v) in &spec.selector.match_labels {
        assert_eq!(labels.get(k), Some(v), "the pods lack label {k}");
    }
    let vllm = &template.spec.as_ref().unwrap().containers[0];
    let ports: Vec<i32> = vllm
        .ports
        .iter()
        .flatten()
        .map(|p| p.container_port)
        .collect();
    assert_eq!(ports, [i32::from(spec.target_ports[0].number)]);
    // The worker set finds its engines through it - as the nodes' watcher reads it - and the
    // route sends requests to it.
    let [ws] = &r.kvplane_objects[..] else {
        panic!("one worker set")
    };
    let ws_spec: kvplane_policy::kinds::InferenceWorkerSetSpec =
        serde_json::from_value(ws["spec"].clone()).unwrap();
    let pools = std::collections::BTreeMap::from([(
        pool.metadata.name.clone().unwrap(),
        r.inference_pool_docs[0]["spec"].clone(),
    )]);
    let of = kvplane_node::sources::kube_engines::pods_of(&ws_spec, Some(&pools))
        .unwrap()
        .unwrap();
    assert_eq!((of.labels, i32::from(of.port)), (labels.clone(), ports[0]));
    assert_eq!(
        ws["spec"]["inferencePoolRef"],
        pool.metadata.name.clone().unwrap().as_str()
    );
    let route = &r.http_routes[0];
    assert_eq!(
        route.spec.parent_refs[0].name,
        r.gateways[0].metadata.name.clone().unwrap()
    );
    let backend = &route.spec.rules[0].backend_refs[0];
    assert_eq!(
        (
            backend.group.as_str(),
            backend.kind.as_str(),
            Some(&backend.name)
        ),
        (
            "inference.networking.k8s.io",
            "InferencePool",
            pool.metadata.name.as_ref()
        )
    );
    // Everything in kvplane's namespace, which the nodes watch for engines.
    for ns in r
        .deployments
        .iter()
        .map(|d| d.metadata.namespace.clone())
        .chain(r.http_routes.iter().map(|h| h.metadata.namespace.clone()))
    {
        assert_eq!(ns.as_deref(), Some("kvplane"));
    }
}

#[test]
fn the_istio_example_gives_the_gateways_proxy_a_certificate_kvplane_trusts_and_the_right_to_route()
{
    use cert_manager::KeyUsage;
    let control_plane = parse(&render("overlays/dev"));
    let r = parse(&render("examples/istio"));
    assert_eq!(r.gateways[0].spec.gateway_class_name, "istio");
    let gateway = r.gateways[0].metadata.name.clone().unwrap();
    // The proxy's client certificate: from the CA the members' certificate comes from (the
    // node's [tls] ca), for client authentication.
    let member = control_plane
        .certificates
        .iter()
        .find(|c| c.metadata.name.as_deref() == Some("kvplane-member"))
        .unwrap();
    let [client] = &r.certificates[..] else {
        panic!("one Certificate")
    };
    assert_eq!(client.spec.issuer_ref.name, member.spec.issuer_ref.name);
    assert_eq!(client.spec.issuer_ref.kind, member.spec.issuer_ref.kind);
    assert!(client.spec.usages.contains(&KeyUsage::ClientAuth));
    let [identity] = &client.spec.uris[..] else {
        panic!("one URI: the proxy's identity")
    };
    // The AccessPolicy, read by kvplane's own catalog: that identity may route for any tenant
    // (the picker's right), and nothing more.
    let mut docs = kvplane_policy::Documents::default();
    for d in &r.kvplane_objects {
        docs.add_file("example", &serde_yaml_ng::to_string(d).unwrap());
    }
    let (catalog, problems) = docs.check();
    assert!(problems.is_empty(), "{problems:?}");
    let grants = catalog.grants(identity);
    assert!(grants.may_route_for("acme"), "{grants:?}");
    assert_eq!(
        grants.rights,
        BTreeSet::from([kvplane_policy::kinds::Right::Route])
    );
    assert!(
        !catalog
            .grants("spiffe://cluster.local/ns/kvplane/sa/other")
            .may_route_for("acme")
    );
    // The DestinationRule: only the gateway's proxy, to the InferencePool's endpoint picker
    // (kvplane's client Service, its picker port), mutual TLS with the certificate's Secret,
    // checking kvplane's certificate for a name and an identity it holds.
    let [rule] = &r.destination_rules[..] else {
        panic!("one DestinationRule")
    };
    let picker = &r.inference_pools[0].spec.endpoint_picker_ref;
    let ns = control_plane.services[0]
        .metadata
        .namespace
        .clone()
        .unwrap();
    assert_eq!(
        rule.spec.host,
        format!("{}.{ns}.svc.cluster.local", picker.name)
    );
    assert_eq!(
        rule.spec.workload_selector.as_ref().unwrap().match_labels,
        std::collections::BTreeMap::from([(
            "gateway.networking.k8s.io/gateway-name".to_owned(),
            gateway.clone()
        )])
    );
    let [port] = &rule.spec.traffic_policy.port_level_settings[..] else {
        panic!("one port's settings")
    };
    assert_eq!(port.port.number, picker.port.as_ref().unwrap().number);
    let tls = &port.tls;
    assert_eq!(tls.mode, istio::TlsMode::Mutual);
    assert_eq!(tls.credential_name.as_ref(), Some(&client.spec.secret_name));
    assert_eq!(tls.subject_alt_names, member.spec.uris);
    let names: Vec<&str> = member.spec.dns_names.iter().map(String::as_str).collect();
    let sni = tls.sni.as_deref().unwrap();
    assert!(
        verifies_for(&member.spec.uris[0], &names, sni).is_ok(),
        "{sni}"
    );
    // The Secret Istio reads is in the proxy's namespace, as is everything else.
    for n in [
        &client.metadata.namespace,
        &rule.metadata.namespace,
        &r.gateways[0].metadata.namespace,
    ] {
        assert_eq!(n.as_deref(), Some(ns.as_str()));
    }
}

/// A rendering's one ConfigMap, its `kvplane.toml` written to a file (in the directory
/// returned, kept as long as it is).
fn config_file(r: &Rendered) -> (&ConfigMap, tempfile::TempDir, std::path::PathBuf) {
    let [map] = &r.config_maps[..] else {
        panic!("one ConfigMap")
    };
    let text = map.data.as_ref().unwrap()["kvplane.toml"].clone();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kvplane.toml");
    std::fs::write(&path, &text).unwrap();
    (map, dir, path)
}

/// A learner's published Service: a load balancer in the pods' namespace that publishes a pod
/// before it is ready (a learner is ready only once the leader reached it through this).
fn published_where_the_pods_are(s: &Service) {
    let name = s.metadata.name.as_deref().unwrap_or_default();
    assert_eq!(s.metadata.namespace.as_deref(), Some("kvplane"), "{name}");
    let spec = s.spec.as_ref().unwrap();
    assert_eq!(spec.type_.as_deref(), Some("LoadBalancer"), "{name}");
    assert_eq!(spec.publish_not_ready_addresses, Some(true), "{name}");
}

/// The members' certificate of a rendering.
fn member_certificate(r: &Rendered) -> &cert_manager::Certificate {
    r.certificates
        .iter()
        .find(|c| c.metadata.name.as_deref() == Some("kvplane-member"))
        .unwrap()
}

#[test]
fn the_remote_learner_overlay_joins_as_a_learner_under_a_name_the_members_certificate_holds() {
    let r = parse(&render("overlays/remote-learner"));
    let [set] = &r.statefulsets[..] else {
        panic!("one StatefulSet")
    };
    let spec = set.spec.as_ref().unwrap();
    assert_eq!(spec.replicas, Some(1), "its raft id is fixed: one pod");
    assert!(
        r.pdbs.is_empty(),
        "a learner is not part of the quorum's budget"
    );
    // No root of its own: its certificate comes from the copied CA of cluster A.
    assert!(r.issuers.iter().all(|i| i.spec.self_signed.is_none()));
    assert!(r.issuers.iter().any(|i| {
        i.spec
            .ca
            .as_ref()
            .is_some_and(|c| c.secret_name == "kvplane-ca")
    }));
    assert!(
        r.certificates
            .iter()
            .all(|c| c.metadata.name.as_deref() != Some("kvplane-ca"))
    );
    // Its configuration, as the node reads it: valid, a learner that joins and relays through
    // A's published name, no StatefulSet identity, and the StatefulSet mounts this very
    // ConfigMap.
    let (map, _dir, path) = config_file(&r);
    let mut cfg = kvplane_node::config::Config::from_file(&path).unwrap();
    cfg.node_id = "kvplane-0".into();
    assert_eq!(cfg.problems(), Vec::<String>::new());
    assert!(cfg.raft.kubernetes.is_none());
    let m = cfg.raft.membership(&cfg.grpc_listen).unwrap();
    assert!(
        m.learner && m.relay_through_join && m.initial.is_empty() && !m.join.is_empty(),
        "{m:?}"
    );
    assert_eq!(cfg.locality.cluster.as_deref(), Some("cluster-b"));
    assert!(cfg.locality.rtt_ms.contains_key("cluster-a"));
    let volumes = spec
        .template
        .spec
        .as_ref()
        .unwrap()
        .volumes
        .as_ref()
        .unwrap();
    assert!(volumes.iter().any(|v| {
        v.config_map.as_ref().map(|c| c.name.as_str()) == map.metadata.name.as_deref()
    }));
    // The members in A dial it at its advertised name: the member certificate holds it.
    let member = member_certificate(&r);
    let names: Vec<&str> = member.spec.dns_names.iter().map(String::as_str).collect();
    let host = m.addr.rsplit_once(':').unwrap().0;
    assert!(
        verifies_for(&member.spec.uris[0], &names, host).is_ok(),
        "{host} in {names:?}"
    );
    // ...published by a load balancer on the grpc port of the StatefulSet's pods.
    let external = r
        .services
        .iter()
        .find(|s| s.metadata.name.as_deref() == Some("kvplane-external"))
        .unwrap();
    published_where_the_pods_are(external);
    let external = external.spec.as_ref().unwrap();
    let labels = spec
        .template
        .metadata
        .as_ref()
        .unwrap()
        .labels
        .clone()
        .unwrap();
    for (k, v) in external.selector.as_ref().unwrap() {
        assert_eq!(labels.get(k), Some(v), "the pods lack label {k}");
    }
    let port = m.addr.rsplit_once(':').unwrap().1.parse::<i32>().unwrap();
    assert!(
        external
            .ports
            .as_ref()
            .unwrap()
            .iter()
            .any(|p| p.port == port)
    );
}

/// The learner-set form: each pod of the StatefulSet, as the node reads its configuration under
/// its own pod name, is a learner recorded under a published name of its own, which a
/// LoadBalancer Service selecting that pod alone publishes on the advertised port and the
/// members' certificate holds; ordinal 0 may read its StatefulSet (scale-downs).
#[test]
fn the_remote_learner_set_overlay_records_each_pod_under_a_published_name_of_its_own() {
    let r = parse(&render("overlays/remote-learner-set"));
    let [set] = &r.statefulsets[..] else {
        panic!("one StatefulSet")
    };
    let set_name = set.metadata.name.clone().unwrap();
    let replicas = set.spec.as_ref().unwrap().replicas.unwrap();
    assert!(replicas >= 2, "a set, not one pod");
    assert!(r.pdbs.is_empty(), "learners are not in the quorum's budget");
    assert!(
        r.services
            .iter()
            .all(|s| s.metadata.name.as_deref() != Some("kvplane-external")),
        "no one name for the set"
    );
    let (_, _dir, path) = config_file(&r);
    let member = member_certificate(&r);
    let names: Vec<&str> = member.spec.dns_names.iter().map(String::as_str).collect();
    for ordinal in 0..u64::try_from(replicas).unwrap() {
        let pod = format!("{set_name}-{ordinal}");
        let mut cfg = kvplane_node::config::Config::from_file(&path).unwrap();
        cfg.node_id.clone_from(&pod);
        let k = cfg.raft.kubernetes.as_mut().expect("[raft.kubernetes]");
        k.pod_name = Some(pod.clone());
        k.namespace = Some("kvplane".into());
        assert_eq!(cfg.problems(), Vec::<String>::new(), "{pod}");
        let m = cfg.raft.membership(&cfg.grpc_listen).unwrap();
        assert!(
            m.learner && m.relay_through_join && m.initial.is_empty() && !m.join.is_empty(),
            "{m:?}"
        );
        assert_eq!(m.pod.as_ref().map(|p| p.ordinal), Some(ordinal));
        let (host, port) = m.addr.rsplit_once(':').unwrap();
        assert!(host.starts_with(&format!("{pod}.")), "{host}");
        assert!(
            verifies_for(&member.spec.uris[0], &names, host).is_ok(),
            "{host} in {names:?}"
        );
        // Published by a load balancer that selects this pod alone, on the advertised port.
        let port: i32 = port.parse().unwrap();
        let published = r.services.iter().find(|s| {
            s.spec
                .as_ref()
                .and_then(|s| s.selector.as_ref())
                .is_some_and(|sel| {
                    sel.len() == 1 && sel.get("statefulset.kubernetes.io/pod-name") == Some(&pod)
                })
        });
        let published = published.unwrap_or_else(|| panic!("no Service publishes {pod}"));
        published_where_the_pods_are(published);
        let published = published.spec.as_ref().unwrap();
        assert!(
            published
                .ports
                .as_ref()
                .unwrap()
                .iter()
                .any(|p| p.port == port),
            "{pod}"
        );
    }
    // Ordinal 0 follows the set's scale-downs: it may read the set.
    assert!(
        r.roles
            .iter()
            .flat_map(|x| x.rules.iter().flatten())
            .any(|rule| {
                rule.resources
                    .as_ref()
                    .is_some_and(|v| v.contains(&"statefulsets".to_owned()))
                    && rule
                        .resource_names
                        .as_ref()
                        .is_some_and(|n| n.contains(&set_name))
                    && rule.verbs.contains(&"get".to_owned())
            })
    );
}

#[test]
fn the_node_configuration_in_the_config_map_is_valid() {
    for overlay in ["overlays/dev", "overlays/prod"] {
        let r = parse(&render(overlay));
        let text = r.config_maps[0].data.as_ref().unwrap()["kvplane.toml"].clone();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kvplane.toml");
        std::fs::write(&path, &text).unwrap();
        let mut cfg = kvplane_node::config::Config::from_file(&path)
            .unwrap_or_else(|e| panic!("{overlay}: {e}"));
        // What the pod's environment gives it.
        cfg.node_id = "kvplane-0".into();
        let k = cfg.raft.kubernetes.as_mut().unwrap();
        k.pod_name = Some("kvplane-0".into());
        k.namespace = Some("kvplane".into());
        assert_eq!(cfg.problems(), Vec::<String>::new(), "{overlay}");
        assert!(cfg.policy_kubernetes.is_some());
        assert!(cfg.kubernetes_engines.is_some());
        assert_eq!(cfg.http_listen, "0.0.0.0:7071");
        assert_eq!(cfg.grpc_listen, "0.0.0.0:7070");
    }
}

#[test]
fn the_members_certificate_names_what_peers_dial_and_the_node_reads_it_from_its_mount() {
    use cert_manager::KeyUsage;
    let r = parse(&render("overlays/dev"));
    let cert = |name: &str| {
        r.certificates
            .iter()
            .find(|c| c.metadata.name.as_deref() == Some(name))
            .unwrap_or_else(|| panic!("no Certificate {name}"))
    };
    let issuer = |name: &str| {
        r.issuers
            .iter()
            .find(|i| i.metadata.name.as_deref() == Some(name))
            .unwrap_or_else(|| panic!("no Issuer {name}"))
    };
    // The chain: self-signed root -> kvplane's CA (isCA) -> members and operator.
    let ca = cert("kvplane-ca");
    assert_eq!(ca.spec.is_ca, Some(true));
    assert!(issuer(&ca.spec.issuer_ref.name).spec.self_signed.is_some());
    let ca_issuer = issuer("kvplane-ca");
    assert_eq!(
        ca_issuer.spec.ca.as_ref().unwrap().secret_name,
        ca.spec.secret_name
    );
    let member = cert("kvplane-member");
    let operator = cert("kvplane-operator");
    for c in [member, operator] {
        assert_eq!(c.spec.issuer_ref.name, "kvplane-ca");
        assert!(c.spec.usages.contains(&KeyUsage::ClientAuth));
    }
    assert!(member.spec.usages.contains(&KeyUsage::ServerAuth));

    // Members dial each other at the addresses the [raft.kubernetes] section makes: a
    // certificate with the manifest's names passes rustls's own check for that address.
    let text = r.config_maps[0].data.as_ref().unwrap()["kvplane.toml"].clone();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kvplane.toml");
    std::fs::write(&path, &text).unwrap();
    let mut cfg = kvplane_node::config::Config::from_file(&path).unwrap();
    let k = cfg.raft.kubernetes.as_mut().unwrap();
    k.pod_name = Some("kvplane-2".into());
    k.namespace = Some("kvplane".into());
    let membership = cfg.raft.membership("0.0.0.0:7070").unwrap();
    let host = membership.addr.rsplit_once(':').unwrap().0.to_owned();
    let names: Vec<&str> = member.spec.dns_names.iter().map(String::as_str).collect();
    let verified = verifies_for(&member.spec.uris[0], &names, &host);
    assert!(verified.is_ok(), "{host} with {names:?}: {verified:?}");
    assert!(
        verifies_for(
            &member.spec.uris[0],
            &names,
            "kvplane-0.elsewhere.svc.cluster.local"
        )
        .is_err(),
        "the check itself refuses a name the certificate does not hold"
    );
    // The node reads the member secret's files where the StatefulSet mounts it, and knows the
    // operator by its certificate's URI; the members by their own (access.members empty).
    let tls = cfg.tls.as_ref().expect("a [tls] section");
    let pod = r.statefulsets[0]
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .unwrap();
    let volume = pod
        .volumes
        .as_ref()
        .unwrap()
        .iter()
        .find(|v| {
            v.secret.as_ref().and_then(|s| s.secret_name.as_deref())
                == Some(member.spec.secret_name.as_str())
        })
        .expect("the member secret is a volume");
    let mount = pod.containers[0]
        .volume_mounts
        .as_ref()
        .unwrap()
        .iter()
        .find(|m| m.name == volume.name)
        .expect("and mounted");
    for (file, key) in [
        (&tls.ca, "ca.crt"),
        (&tls.cert, "tls.crt"),
        (&tls.key, "tls.key"),
    ] {
        assert_eq!(*file, Path::new(&mount.mount_path).join(key));
    }
    assert!(cfg.access.members.is_empty());
    assert_eq!(cfg.access.admins, operator.spec.uris);
}

/// Whether a certificate naming `identity` and `names` (from a CA of ours) passes rustls's
/// server check for `host`.
fn verifies_for(identity: &str, names: &[&str], host: &str) -> Result<(), rustls::Error> {
    use rustls::client::danger::ServerCertVerifier as _;
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
    let ca = kvplane_tls::dev_ca::DevCa::new("deploy test ca").unwrap();
    let issued = ca.issue(identity, names).unwrap();
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(ca.ca_pem().as_bytes()).unwrap())
        .unwrap();
    let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
        std::sync::Arc::new(roots),
        std::sync::Arc::new(rustls::crypto::ring::default_provider()),
    )
    .build()
    .unwrap();
    let leaf = CertificateDer::from_pem_slice(issued.cert.as_bytes()).unwrap();
    verifier
        .verify_server_cert(
            &leaf,
            &[],
            &ServerName::try_from(host.to_owned()).unwrap(),
            &[],
            UnixTime::now(),
        )
        .map(|_| ())
}
