//! Provider fallback that really reaches a provider: the reference gateway calls an
//! OpenAI-compatible provider over HTTPS - Envoy (a real proxy) terminating TLS with a test CA's
//! certificate and accepting only the provider's API key on the API's path, in front of an
//! OpenAI-compatible engine - with the key from a mounted-Secret layout, the base URL joined as
//! OpenAI's SDKs join it and the body naming the provider's model; a streamed answer comes back
//! whole; a wrong key is a clear 502.

#![allow(clippy::unwrap_used)]

mod harness;

use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::Duration;

use harness::{Cluster, NodeOptions, Proc, eventually, free_port};
use serde_json::json;

const KEY: &str = "sk-test-provider-key";

/// A test CA and a certificate it signed for 127.0.0.1: (ca.pem, cert.pem, key.pem) in `dir`.
fn test_ca(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, SanType};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(DnType::CommonName, "kvplane test CA");
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca, ca_key);
    let key = KeyPair::generate().unwrap();
    let mut leaf = CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
    leaf.subject_alt_names
        .push(SanType::IpAddress("127.0.0.1".parse().unwrap()));
    let cert = leaf.signed_by(&key, &issuer).unwrap();
    let paths = (
        dir.join("ca.pem"),
        dir.join("cert.pem"),
        dir.join("key.pem"),
    );
    std::fs::write(&paths.0, ca_cert.pem()).unwrap();
    std::fs::write(&paths.1, cert.pem()).unwrap();
    std::fs::write(&paths.2, key.serialize_pem()).unwrap();
    paths
}

/// The provider: Envoy on HTTPS at `port` (cert and key), answering only `POST
/// /v1/chat/completions` with `Authorization: Bearer KEY` (from the engine at `backend`),
/// everything else 401; its access log at `log`.
fn provider(dir: &Path, port: u16, (cert, key): (&Path, &Path), backend: u16, log: &Path) -> Child {
    let admin = free_port();
    let config = format!(
        r#"
admin: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {admin}}}}}}}
static_resources:
  listeners:
  - name: provider
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    filter_chains:
    - transport_socket:
        name: envoy.transport_sockets.tls
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext
          common_tls_context:
            tls_certificates:
            - certificate_chain: {{filename: {cert}}}
              private_key: {{filename: {key}}}
      filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: provider
          access_log:
          - name: envoy.access_loggers.file
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog
              path: {log}
              log_format: {{text_format_source: {{inline_string: "%REQ(:METHOD)% %REQ(:PATH)% %RESPONSE_CODE% cookie=%REQ(COOKIE)%\n"}}}}
          route_config:
            virtual_hosts:
            - name: provider
              domains: ["*"]
              routes:
              - match:
                  path: /v1/chat/completions
                  headers: [{{name: authorization, string_match: {{exact: "Bearer {KEY}"}}}}]
                route: {{cluster: backend, timeout: 60s}}
              - match: {{prefix: /}}
                direct_response:
                  status: 401
                  body: {{inline_string: '{{"error":{{"message":"invalid api key","type":"invalid_request_error","code":"invalid_api_key"}}}}'}}
          http_filters:
          - name: envoy.filters.http.router
            typed_config: {{"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}}
  clusters:
  - name: backend
    type: STATIC
    connect_timeout: 5s
    load_assignment:
      cluster_name: backend
      endpoints: [{{lb_endpoints: [{{endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {backend}}}}}}}}}]}}]
"#,
        cert = cert.display(),
        key = key.display(),
        log = log.display(),
    );
    harness::spawn_envoy(dir, "provider-envoy", &config)
}

/// The gateway's answer to `request` when provider `cloud` refused its credentials: a 502
/// saying so; its message.
async fn refused_credentials(request: reqwest::RequestBuilder) -> String {
    let r = request.send().await.unwrap();
    assert_eq!(r.status().as_u16(), 502);
    let body: serde_json::Value = r.json().await.unwrap();
    let msg = body["error"]["message"].as_str().unwrap().to_owned();
    assert!(
        msg.contains("provider cloud refused the gateway's credentials"),
        "{msg}"
    );
    msg
}

/// Policies: public model `chat` on worker set `local` (no workers), falling back to provider
/// `cloud` at `endpoint`, its key in Secret `cloud-api`, key `token`.
fn policies(dir: &Path, endpoint: &str) {
    fallback_to(
        dir,
        &format!(
            "  endpoint: {endpoint}\n  api: OpenAI\n  model: gpt-cloud\n  credentials: {{name: cloud-api, key: token}}\n"
        ),
        None,
    );
}

/// Policies: public model `chat` on worker set `local` (no workers), falling back to provider
/// `cloud` of spec `provider` (YAML lines under `spec:`) - after provider `first` of that spec,
/// when given.
fn fallback_to(dir: &Path, provider: &str, first: Option<&str>) {
    let (first_object, first_name) = first.map_or((String::new(), ""), |spec| {
        (
            format!(
                "apiVersion: kvplane.io/v1alpha1\nkind: InferenceProvider\nmetadata: {{name: first}}\nspec:\n{spec}---\n"
            ),
            "first, ",
        )
    });
    std::fs::write(
        dir.join("fleet.yaml"),
        format!(
            r#"apiVersion: kvplane.io/v1alpha1
kind: InferenceWorkerSet
metadata: {{name: local}}
spec: {{model: llama-8b, blockSize: 16}}
---
apiVersion: kvplane.io/v1alpha1
kind: InferencePool
metadata: {{name: local}}
spec: {{workerSets: [local]}}
---
apiVersion: kvplane.io/v1alpha1
kind: InferenceProvider
metadata: {{name: cloud}}
spec:
{provider}---
{first_object}apiVersion: kvplane.io/v1alpha1
kind: GatewayBackend
metadata: {{name: chat}}
spec:
  publicModel: chat
  backends: [{{pool: local}}]
  policies: [burst]
---
apiVersion: kvplane.io/v1alpha1
kind: InferencePolicy
metadata: {{name: burst}}
spec:
  rules:
    - name: burst
      candidates: {{pools: [local]}}
      onEmpty:
        action: Fallback
        fallback: {{providers: [{first_name}cloud]}}
"#
        ),
    )
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_falls_back_to_a_provider_over_https_with_its_key_and_streams_its_answer() {
    let work = tempfile::tempdir().unwrap();
    let dir = work.path();
    let (ca, cert, key) = test_ca(dir);
    // The provider's engine (OpenAI's API, any model name), and Envoy in front of it.
    let engine = Proc::start(
        vec![
            "sim".into(),
            "engine".into(),
            "--http-listen".into(),
            "127.0.0.1:0".into(),
            "--zmq-pub".into(),
            format!("tcp://127.0.0.1:{}", free_port()),
            "--zmq-replay".into(),
            format!("tcp://127.0.0.1:{}", free_port()),
            "--speedup".into(),
            "10".into(),
        ],
        dir.join("provider-engine.log"),
        "kvplane-sim ready",
    );
    let backend: u16 = engine
        .field("http")
        .rsplit(':')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let https = free_port();
    let access = dir.join("provider-access.log");
    let mut envoy = provider(dir, https, (&cert, &key), backend, &access);
    // kvplane: the provider's base URL as OpenAI's SDKs take it (with /v1).
    let policy_dir = dir.join("policies");
    std::fs::create_dir_all(&policy_dir).unwrap();
    policies(&policy_dir, &format!("https://127.0.0.1:{https}/v1"));
    let cluster = Cluster::start_with(
        1,
        &NodeOptions {
            policy_dir: Some(policy_dir),
            ..Default::default()
        },
    );
    let node = &cluster.nodes[0];
    // The key where a Kubernetes Secret `cloud-api` mounted per name puts it.
    let secrets = dir.join("secrets");
    std::fs::create_dir_all(secrets.join("cloud-api")).unwrap();
    std::fs::write(secrets.join("cloud-api").join("token"), format!("{KEY}\n")).unwrap();
    let gw = harness::gateway_with(
        &node.endpoint(),
        &[
            "--secrets-dir".into(),
            secrets.display().to_string(),
            "--provider-ca-file".into(),
            ca.display().to_string(),
        ],
        dir.join("gateway.log"),
    );
    let url = format!("http://{}/v1/chat/completions", gw.field("http"));
    let ask = |stream: bool| {
        json!({"model": "chat", "max_tokens": 4, "stream": stream,
            "stream_options": {"include_usage": true},
            "messages": [{"role": "user", "content": "hello"}]})
    };
    let client = reqwest::Client::new();
    // Until the node holds the policies and Envoy listens. The client's own credentials and
    // cookies are not the provider's business.
    let r = eventually("the provider answers", Duration::from_secs(30), || async {
        let r = client
            .post(&url)
            .header("authorization", "Bearer the-clients-own-key")
            .header("cookie", "session=the-clients")
            .json(&ask(true))
            .send()
            .await
            .ok()?;
        r.status().is_success().then_some(r)
    })
    .await;
    assert_eq!(r.headers()["x-kvplane-worker"], "provider:cloud");
    let (text, events) = harness::sse_events(r).await;
    assert!(events.len() >= 2, "{text}");
    // The body that reached the provider named the provider's model.
    assert!(events.iter().all(|e| e["model"] == "gpt-cloud"), "{text}");
    assert!(
        events
            .iter()
            .any(|e| e["usage"]["completion_tokens"].as_u64() > Some(0)),
        "{text}"
    );
    // Envoy's own record (flushed every second): the API's path (not /v1/v1/...), answered 200
    // (the provider's key matched, not the client's), no cookie of the client's.
    let log = eventually(
        "the provider's access log",
        Duration::from_secs(10),
        || async {
            let log = std::fs::read_to_string(&access).unwrap_or_default();
            (!log.is_empty()).then_some(log)
        },
    )
    .await;
    assert!(
        log.lines()
            .any(|l| l == "POST /v1/chat/completions 200 cookie=-"),
        "{log}"
    );

    // A rotated key that the provider does not accept: a clear answer, not a pass-through.
    std::fs::write(secrets.join("cloud-api").join("token"), "sk-wrong").unwrap();
    let msg = refused_credentials(client.post(&url).json(&ask(false))).await;
    assert!(
        !msg.contains("sk-wrong"),
        "a credential is never repeated: {msg}"
    );
    let _ = envoy.kill();
    let _ = envoy.wait();
}

/// A Bedrock provider: the gateway translates OpenAI's chat to the Converse API and signs it
/// with SigV4 from the provider's Secret; the endpoint is a Converse server whose checks are
/// botocore's own signer (`tests/clients/bedrock_converse.py`), so the signature is the one the
/// AWS SDK computes. The answer comes back in OpenAI's shape, whole and streamed, and keys the
/// signer does not accept are a clear 502.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_calls_a_bedrock_provider_with_a_signature_the_aws_sdk_computes_too() {
    let work = tempfile::tempdir().unwrap();
    let b = BedrockFleet::start(work.path(), &[]);
    let (keys, url) = (b.keys.clone(), b.url.clone());
    let ask = |stream: bool| {
        json!({"model": "chat", "max_tokens": 4, "stream": stream,
            "stream_options": {"include_usage": true},
            "messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": "hello"}]})
    };
    let client = reqwest::Client::new();
    let r = b.answers().await;
    assert_eq!(r.headers()["x-kvplane-worker"], "provider:cloud");
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["model"], "amazon.nova-lite-v1:0");
    assert_eq!(
        body["choices"][0]["message"]["content"], "amazon.nova-lite-v1:0 heard: hello",
        "the model id reached its path, the last message its body"
    );
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    assert_eq!(body["usage"]["total_tokens"], 8);
    // Streamed (ConverseStream, its event stream): OpenAI's events, the role first, the
    // text as it came, the finish, the usage when asked, [DONE].
    let r = client.post(&url).json(&ask(true)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    let (text, events) = harness::sse_events(r).await;
    assert_eq!(
        events[0]["choices"][0]["delta"]["role"], "assistant",
        "{text}"
    );
    assert_eq!(
        deltas(&events),
        "amazon.nova-lite-v1:0 heard: hello",
        "{text}"
    );
    assert!(
        events
            .iter()
            .any(|e| e["choices"][0]["finish_reason"] == "stop"),
        "{text}"
    );
    assert!(
        events.iter().any(|e| e["usage"]["completion_tokens"] == 3),
        "{text}"
    );
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    // Throttled: a 429 keeping the provider's Retry-After. The model failing: a 502.
    let say = |text: &str| json!({"model": "chat", "max_tokens": 4, "messages": [{"role": "user", "content": text}]});
    let r = client.post(&url).json(&say("busy")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 429);
    assert_eq!(r.headers()["retry-after"], "7");
    let r = client.post(&url).json(&say("fail")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 502);
    let body: serde_json::Value = r.json().await.unwrap();
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("provider cloud failed: The model failed"),
        "{body}"
    );
    // A secret key botocore's signer does not agree with: refused there, a clear 502 here.
    std::fs::write(keys.join("aws_secret_access_key"), "not-the-key").unwrap();
    refused_credentials(client.post(&url).json(&ask(false))).await;
}

/// The text of a chat stream's events, joined.
fn deltas(events: &[serde_json::Value]) -> String {
    events
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
        .collect()
}

/// A Bedrock stream reaches the client while the provider is still answering: the provider
/// holds its stream after the first text until the test releases it, and by then the client
/// has that text and the node the first token's report. An exception Bedrock sends in the
/// middle of a stream ends the client's with an error event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bedrock_stream_reaches_the_client_as_it_arrives_and_its_exception_as_an_error_event() {
    let work = tempfile::tempdir().unwrap();
    let b = BedrockFleet::start(work.path(), &[]);
    b.answers().await;
    let node = &b.cluster.nodes[0];
    let say = |text: &str| {
        json!({"model": "chat", "max_tokens": 4, "stream": true,
            "messages": [{"role": "user", "content": text}]})
    };
    let client = reqwest::Client::new();
    let mut r = client.post(&b.url).json(&say("hold")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let mut text = String::new();
    while !text.contains("heard:") {
        let chunk = tokio::time::timeout(Duration::from_secs(20), r.chunk())
            .await
            .expect("the first text while the provider holds the rest")
            .unwrap()
            .expect("the stream is still open");
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(!text.contains("[DONE]"), "{text}");
    eventually(
        "the first token's report, the answer still open",
        Duration::from_secs(10),
        || async {
            let m = node.metrics().await;
            m.contains(r#"kvplane_usage_reports_total{outcome="first_token"} 1"#)
                .then_some(())
        },
    )
    .await;
    let released = client
        .post(format!("{}/release", b.converse_url))
        .send()
        .await
        .unwrap();
    assert!(released.status().is_success());
    while let Some(chunk) = r.chunk().await.unwrap() {
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    let events = harness::sse_json(&text);
    assert_eq!(
        deltas(&events),
        "amazon.nova-lite-v1:0 heard: hold",
        "{text}"
    );
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");

    let r = client
        .post(&b.url)
        .json(&say("break"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "the answer had begun");
    let text = r.text().await.unwrap();
    let events = harness::sse_json(&text);
    assert_eq!(deltas(&events), "amazon.nova-lite-v1:0 heard:", "{text}");
    let error = events.last().unwrap();
    assert_eq!(
        error["error"]["message"],
        "bedrock ended the answer with modelStreamErrorException: The model stopped",
        "{text}"
    );
    assert!(!text.contains("[DONE]"), "{text}");
    eventually("both answers reported", Duration::from_secs(10), || async {
        let m = node.metrics().await;
        (m.contains(r#"kvplane_usage_reports_total{outcome="first_token"} 2"#)
            && m.contains(r#"kvplane_usage_reports_total{outcome="known"} 3"#))
        .then_some(())
    })
    .await;
}

/// Two providers: the one picked first (the lower expected TTFT) does not answer; the gateway
/// passes the request to the other before any byte reached the client, and the answer is that
/// provider's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_that_does_not_answer_passes_the_request_to_the_next_provider() {
    let work = tempfile::tempdir().unwrap();
    let dead = format!(
        "  endpoint: http://127.0.0.1:{}/v1\n  api: OpenAI\n  model: gpt-gone\n  expectedTtftMs: 10\n",
        free_port()
    );
    let b = BedrockFleet::start_after(work.path(), &[], Some(&dead));
    let r = b.answers().await;
    assert_eq!(r.headers()["x-kvplane-worker"], "provider:cloud");
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["model"], "amazon.nova-lite-v1:0", "{body}");
    let metrics = harness::http_get(&format!("http://{}/metrics", b.gateway.field("http"))).await;
    assert_eq!(
        harness::metric_value(&metrics, "kvplane_gateway_upstream_retries_total"),
        1.0,
        "{metrics}"
    );
}

/// A provider that sends no headers within `--upstream-timeout-seconds` (a Converse call
/// answered after 30 s): the client gets a 504 in OpenAI's shape at the deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_that_sends_no_headers_in_time_is_a_504() {
    let work = tempfile::tempdir().unwrap();
    let b = BedrockFleet::start(
        work.path(),
        &["--upstream-timeout-seconds".into(), "1".into()],
    );
    b.answers().await;
    let slow = json!({"model": "chat", "messages": [{"role": "user", "content": "slow"}]});
    let sent = std::time::Instant::now();
    let r = reqwest::Client::new()
        .post(&b.url)
        .json(&slow)
        .send()
        .await
        .unwrap();
    let took = sent.elapsed();
    assert_eq!(r.status().as_u16(), 504);
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(3),
        "answered after {took:?}"
    );
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(
        (&body["error"]["type"], &body["error"]["code"]),
        (&json!("server_error"), &json!("timeout")),
        "{body}"
    );
}

/// A stopping gateway gives a request in flight its drain deadline (`--drain-seconds 1`), then
/// cuts it and exits, though the provider would answer it only after 30 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_gateway_cuts_open_requests_at_its_drain_deadline() {
    let work = tempfile::tempdir().unwrap();
    let mut b = BedrockFleet::start(work.path(), &["--drain-seconds".into(), "1".into()]);
    b.answers().await;
    let slow = json!({"model": "chat", "messages": [{"role": "user", "content": "slow"}]});
    let url = b.url.clone();
    let open =
        tokio::spawn(async move { reqwest::Client::new().post(&url).json(&slow).send().await });
    let log = b.log.clone();
    eventually(
        "the request at the provider",
        Duration::from_secs(30),
        || async {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            text.contains("slow request received").then_some(())
        },
    )
    .await;
    let stopping = std::time::Instant::now();
    let child = b.gateway.child.as_ref().unwrap();
    assert!(kvplane_testkit::process::signal(child, "-TERM"));
    let exited = b.gateway.child.take().unwrap().wait().unwrap();
    let took = stopping.elapsed();
    assert!(exited.success(), "{exited}");
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(10),
        "exited after {took:?}"
    );
    let cut = open.await.unwrap();
    assert!(
        cut.is_err() || !cut.as_ref().unwrap().status().is_success(),
        "{cut:?}"
    );
}

/// A Bedrock provider `cloud` (a Converse endpoint checked by botocore's signer, model
/// `amazon.nova-lite-v1:0`, region eu-central-1) behind public model `chat`, one kvplane node,
/// and a gateway with `gateway_args` reading the provider's keys from a mounted-Secret layout.
struct BedrockFleet {
    converse: std::process::Child,
    /// The Converse endpoint's base URL.
    converse_url: String,
    cluster: Cluster,
    gateway: Proc,
    /// The Secret's directory (its keys' files).
    keys: PathBuf,
    /// The gateway's chat completions URL.
    url: String,
    /// The Converse endpoint's log.
    log: PathBuf,
}

impl BedrockFleet {
    fn start(dir: &Path, gateway_args: &[String]) -> Self {
        Self::start_after(dir, gateway_args, None)
    }

    /// As [`Self::start`], with provider `first` (its spec's YAML lines) tried before `cloud`.
    fn start_after(dir: &Path, gateway_args: &[String], first: Option<&str>) -> Self {
        let (akid, secret, token) = (
            "AKIDKVPLANETEST",
            "kvplane/test/secret+key",
            "session-token-1",
        );
        let args: Vec<String> = vec![
            concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/tests/clients/bedrock_converse.py"
            )
            .into(),
            akid.into(),
            secret.into(),
            token.into(),
            "eu-central-1".into(),
        ];
        let (converse, ready) = kvplane_testkit::process::start(kvplane_testkit::process::Spec {
            program: &harness::test_python(),
            args: &args,
            env: &[],
            log: &dir.join("converse.log"),
            ready: Some("ready"),
        })
        .unwrap();
        let port = ready.trim().rsplit(' ').next().unwrap().to_owned();
        let policy_dir = dir.join("policies");
        std::fs::create_dir_all(&policy_dir).unwrap();
        fallback_to(
            &policy_dir,
            &format!(
                "  endpoint: http://127.0.0.1:{port}\n  api: Bedrock\n  region: eu-central-1\n  model: amazon.nova-lite-v1:0\n  credentials: {{name: aws, key: unused}}\n  expectedTtftMs: 1000\n"
            ),
            first,
        );
        let cluster = Cluster::start_with(
            1,
            &NodeOptions {
                policy_dir: Some(policy_dir),
                ..Default::default()
            },
        );
        let secrets = dir.join("secrets");
        let keys = secrets.join("aws");
        std::fs::create_dir_all(&keys).unwrap();
        for (k, v) in [
            ("aws_access_key_id", akid),
            ("aws_secret_access_key", secret),
            ("aws_session_token", token),
        ] {
            std::fs::write(keys.join(k), v).unwrap();
        }
        let mut args = vec!["--secrets-dir".into(), secrets.display().to_string()];
        args.extend_from_slice(gateway_args);
        let gateway =
            harness::gateway_with(&cluster.nodes[0].endpoint(), &args, dir.join("gateway.log"));
        let url = format!("http://{}/v1/chat/completions", gateway.field("http"));
        Self {
            converse,
            converse_url: format!("http://127.0.0.1:{port}"),
            cluster,
            gateway,
            keys,
            url,
            log: dir.join("converse.log"),
        }
    }

    /// Waits until a request through the gateway is answered (the node holds the policies).
    async fn answers(&self) -> reqwest::Response {
        let client = reqwest::Client::new();
        let hello = json!({"model": "chat", "max_tokens": 4, "messages": [
            {"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]});
        eventually("bedrock answers", Duration::from_secs(30), || async {
            let r = client.post(&self.url).json(&hello).send().await.ok()?;
            r.status().is_success().then_some(r)
        })
        .await
    }

    fn stop(&mut self) {
        let _ = self.converse.kill();
        let _ = self.converse.wait();
    }
}

impl Drop for BedrockFleet {
    /// A failed assertion leaves no Converse endpoint running.
    fn drop(&mut self) {
        self.stop();
    }
}
