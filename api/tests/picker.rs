//! The Envoy endpoint picker (ext_proc) on the real routing service over a real state, driven
//! by an ext_proc client built from Envoy's own protos playing a proxy's message sequences:
//! headers then a body in chunks (the protocol's full-duplex mode) or whole (buffered), the
//! subset hint, refusals, and the answer's headers and SSE body read for the request's usage.

#![allow(clippy::unwrap_used)]

mod support;

use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    CommonResponse, HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse,
    ProtocolConfiguration, body_mutation, processing_request::Request as In,
    processing_response::Response as Out,
};
use envoy_types::pb::google::protobuf::{ListValue, Struct, Value, value::Kind};
use kvplane_api::{ApiMetrics, CostModel, EndpointPicker, Escrow, PickerConfig, RouterService};
use kvplane_state::{Command, QuotaAsk, QuotaBatch};
use kvplane_testkit::ext_proc::{header_map, message as msg};
use support::{ACME_LIMIT, EXAMPLES, TestFleet, apply_policies, escrowed_service, pools_node};
use tokio::sync::mpsc;
use tonic::transport::Channel;

/// A picker serving `svc` on a loopback port, and a client of it.
async fn picker(svc: RouterService) -> ExternalProcessorClient<Channel> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(EndpointPicker::new(svc, PickerConfig::default()).server())
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );
    ExternalProcessorClient::connect(format!("http://{addr}"))
        .await
        .unwrap()
}

/// One HTTP request's stream, as a proxy holds it.
struct Proxy {
    tx: mpsc::Sender<ProcessingRequest>,
    rx: tonic::Streaming<ProcessingResponse>,
}

impl Proxy {
    async fn open(client: &mut ExternalProcessorClient<Channel>) -> Self {
        Self::open_with(client, &[]).await
    }

    /// A stream whose gRPC metadata is `metadata` (what Envoy's `initial_metadata` adds).
    async fn open_with(
        client: &mut ExternalProcessorClient<Channel>,
        metadata: &[(&'static str, &str)],
    ) -> Self {
        let (tx, rx) = mpsc::channel::<ProcessingRequest>(16);
        let out =
            futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) });
        let mut req = tonic::Request::new(out);
        for (k, v) in metadata {
            req.metadata_mut().insert(*k, v.parse().unwrap());
        }
        let rx = client.process(req).await.unwrap().into_inner();
        Self { tx, rx }
    }

    /// A request `id` sent whole in the protocol's full-duplex mode (`metadata`: the proxy's).
    async fn ask(
        client: &mut ExternalProcessorClient<Channel>,
        id: &str,
        body: &[u8],
        metadata: Option<Metadata>,
    ) -> Self {
        Self::ask_from(client, &[], id, body, metadata).await
    }

    /// The same on a stream whose gRPC metadata is `stream` (see [`Self::open_with`]).
    async fn ask_from(
        client: &mut ExternalProcessorClient<Channel>,
        stream: &[(&'static str, &str)],
        id: &str,
        body: &[u8],
        metadata: Option<Metadata>,
    ) -> Self {
        let p = Self::open_with(client, stream).await;
        p.send(request_headers(
            id,
            BodySendMode::FullDuplexStreamed,
            metadata,
        ))
        .await;
        p.send(body_chunk(body, true)).await;
        p
    }

    async fn send(&self, msg: ProcessingRequest) {
        self.tx.send(msg).await.unwrap();
    }

    async fn recv(&mut self) -> Out {
        self.rx.message().await.unwrap().unwrap().response.unwrap()
    }

    async fn recv_whole(&mut self) -> ProcessingResponse {
        self.rx.message().await.unwrap().unwrap()
    }
}

/// A POST's request headers, as Envoy sends them (in `mode`, told in `protocol_config`).
fn request_headers(id: &str, mode: BodySendMode, extra: Option<Metadata>) -> ProcessingRequest {
    ProcessingRequest {
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: mode.into(),
            response_body_mode: BodySendMode::FullDuplexStreamed.into(),
            send_body_without_waiting_for_header_response: false,
        }),
        metadata_context: extra,
        ..msg(In::RequestHeaders(HttpHeaders {
            headers: header_map(&[
                (":method", "POST"),
                (":path", "/v1/completions"),
                ("content-type", "application/json"),
                ("x-request-id", id),
                ("x-tenant", "acme"),
            ]),
            end_of_stream: false,
            ..Default::default()
        }))
    }
}

fn body_chunk(bytes: &[u8], end_of_stream: bool) -> ProcessingRequest {
    msg(In::RequestBody(HttpBody {
        body: bytes.to_vec(),
        end_of_stream,
        ..Default::default()
    }))
}

/// A completion request for `model` whose prompt is 80 words.
fn completion(model: &str) -> Vec<u8> {
    let words: Vec<String> = (0..80).map(|i| format!("word{i}")).collect();
    format!(
        r#"{{"model":"{model}","prompt":"{}","max_tokens":8,"stream":true}}"#,
        words.join(" ")
    )
    .into_bytes()
}

/// The ids the router computes for `body` (the engines here cache exactly those).
fn ids(body: &[u8]) -> Vec<u32> {
    kvplane_tokenize::prompt_from_body(body).unwrap().tokens
}

fn set_header(c: &CommonResponse, name: &str) -> Option<String> {
    c.header_mutation
        .as_ref()?
        .set_headers
        .iter()
        .filter_map(|o| o.header.as_ref())
        .find(|h| h.key == name)
        .map(|h| String::from_utf8(h.raw_value.clone()).unwrap())
}

fn lb_destination(r: &ProcessingResponse) -> Option<String> {
    let lb = r.dynamic_metadata.as_ref()?.fields.get("envoy.lb")?;
    let Some(Kind::StructValue(s)) = &lb.kind else {
        return None;
    };
    match &s.fields.get("x-gateway-destination-endpoint")?.kind {
        Some(Kind::StringValue(v)) => Some(v.clone()),
        _ => None,
    }
}

/// The body a run of streamed body answers carries, until the one ending the stream.
async fn streamed_body(p: &mut Proxy) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Out::RequestBody(b) = p.recv().await else {
            panic!("expected the request body streamed back");
        };
        let Some(body_mutation::Mutation::StreamedResponse(s)) =
            b.response.unwrap().body_mutation.unwrap().mutation
        else {
            panic!("expected a streamed body");
        };
        out.extend(s.body);
        if s.end_of_stream {
            return out;
        }
    }
}

fn subset_hint(endpoints: &[&str]) -> Metadata {
    let list = ListValue {
        values: endpoints
            .iter()
            .map(|e| Value {
                kind: Some(Kind::StringValue((*e).into())),
            })
            .collect(),
    };
    Metadata {
        filter_metadata: [(
            "envoy.lb.subset_hint".to_owned(),
            Struct {
                fields: [(
                    "x-gateway-destination-endpoint-subset".to_owned(),
                    Value {
                        kind: Some(Kind::ListValue(list)),
                    },
                )]
                .into_iter()
                .collect(),
            },
        )]
        .into_iter()
        .collect(),
        ..Default::default()
    }
}

/// The status and JSON body of an immediate answer.
fn immediate(out: Out) -> (i32, serde_json::Value, Vec<(String, String)>) {
    let Out::ImmediateResponse(i) = out else {
        panic!("expected an immediate answer, got {out:?}");
    };
    let headers = i
        .headers
        .unwrap_or_default()
        .set_headers
        .into_iter()
        .filter_map(|o| o.header)
        .map(|h| (h.key, String::from_utf8(h.raw_value).unwrap()))
        .collect();
    (
        i.status.unwrap().code,
        serde_json::from_slice(&i.body).unwrap(),
        headers,
    )
}

/// The pools node with `w1` caching `body`'s prompt; the service and its metrics.
fn w1_caches(body: &[u8]) -> (TestFleet, RouterService, Arc<ApiMetrics>) {
    caching("w1", body)
}

/// The pools node with `worker` caching `body`'s prompt; the service and its metrics.
fn caching(worker: &str, body: &[u8]) -> (TestFleet, RouterService, Arc<ApiMetrics>) {
    let mut f = pools_node(&[]);
    f.caches("default", worker, &ids(body), 16, None, None);
    let metrics = Arc::new(ApiMetrics::default());
    let svc = RouterService::new(f.sm.handle(), CostModel::default(), metrics.clone());
    (f, svc, metrics)
}

#[tokio::test]
async fn a_full_duplex_request_gets_the_caching_worker_and_its_body_back_and_its_answer_settles_it()
{
    let body = completion("m");
    let (_f, svc, metrics) = w1_caches(&body);
    let mut client = picker(svc).await;
    let mut p = Proxy::open(&mut client).await;
    p.send(request_headers(
        "r1",
        BodySendMode::FullDuplexStreamed,
        None,
    ))
    .await;
    let third = body.len() / 3;
    p.send(body_chunk(&body[..third], false)).await;
    p.send(body_chunk(&body[third..2 * third], false)).await;
    p.send(body_chunk(&body[2 * third..], true)).await;

    // The headers are answered only once the body is whole: the pick, as header and metadata.
    let first = p.recv_whole().await;
    let Some(Out::RequestHeaders(h)) = &first.response else {
        panic!("expected the headers' answer first, got {first:?}");
    };
    let common = h.response.as_ref().unwrap();
    assert_eq!(
        set_header(common, "x-gateway-destination-endpoint").as_deref(),
        Some("w1:8000")
    );
    assert_eq!(lb_destination(&first).as_deref(), Some("w1:8000"));
    assert_eq!(
        set_header(common, "content-length"),
        Some(body.len().to_string())
    );
    assert!(common.clear_route_cache);
    assert_eq!(
        streamed_body(&mut p).await,
        body,
        "the body comes back unchanged"
    );

    // The answer: headers, then SSE chunks, the last with the usage.
    p.send(msg(In::ResponseHeaders(HttpHeaders {
        headers: header_map(&[(":status", "200"), ("content-type", "text/event-stream")]),
        ..Default::default()
    })))
    .await;
    let Out::ResponseHeaders(h) = p.recv().await else {
        panic!("expected the answer's headers' answer");
    };
    assert_eq!(
        set_header(h.response.as_ref().unwrap(), "x-kvplane-worker").as_deref(),
        Some("default/w1")
    );
    let chunks: [&[u8]; 2] = [
        b"data: {\"choices\":[{\"text\":\"a\"}]}\n\n",
        b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":80,\"completion_tokens\":8}}\n\ndata: [DONE]\n\n",
    ];
    for (i, c) in chunks.iter().enumerate() {
        p.send(msg(In::ResponseBody(HttpBody {
            body: c.to_vec(),
            end_of_stream: i == 1,
            ..Default::default()
        })))
        .await;
        let Out::ResponseBody(b) = p.recv().await else {
            panic!("expected the answer's body streamed back");
        };
        let Some(body_mutation::Mutation::StreamedResponse(s)) =
            b.response.unwrap().body_mutation.unwrap().mutation
        else {
            panic!("expected a streamed body");
        };
        assert_eq!((s.body.as_slice(), s.end_of_stream), (*c, i == 1));
    }
    // Reported as a gateway reports: its first token at the first chunk, then its end.
    assert_eq!(metrics.usage_reports("first_token"), 1);
    assert_eq!(metrics.usage_reports("known"), 1);
    assert_eq!(metrics.picker_requests("routed"), 1);
}

/// The pools node with `w1` caching `body`'s prompt, under a limit for tenant `acme` of which
/// this replica holds a 10,000-token grant; the service admits through that escrow.
fn under_a_limit(body: &[u8]) -> (TestFleet, RouterService, Arc<Escrow>, Arc<ApiMetrics>) {
    support::well_inside_a_minute();
    let mut f = pools_node(&[]);
    // Windows are the wall clock's: the entries are stamped with it.
    f.at(kvplane_api::wall_ms());
    f.caches("default", "w1", &ids(body), 16, None, None);
    apply_policies(&mut f, ACME_LIMIT);
    f.command(Command::Quota(QuotaBatch {
        replica: 1,
        incarnation: 1,
        seq: 1,
        asks: vec![QuotaAsk {
            key: kvplane_policy::LimitKey {
                tenant: "acme".into(),
                model: String::new(),
                provider: String::new(),
            },
            tokens: 10_000,
            requests: 0,
        }],
        releases: Vec::new(),
        settles: Vec::new(),
    }));
    let (svc, escrow, metrics) = escrowed_service(&f);
    (f, svc, escrow, metrics)
}

/// Tokens the tenant's window has spent on this replica.
fn spent(escrow: &Escrow) -> u64 {
    escrow.status().iter().map(|s| s.spent_tokens).sum()
}

/// The answer's headers (`status`, SSE) and its first body chunk, without ending it.
async fn answer_begins(p: &mut Proxy, status: &str) {
    p.send(msg(In::ResponseHeaders(HttpHeaders {
        headers: header_map(&[(":status", status), ("content-type", "text/event-stream")]),
        ..Default::default()
    })))
    .await;
    let Out::ResponseHeaders(_) = p.recv().await else {
        panic!("expected the answer's headers' answer");
    };
    p.send(msg(In::ResponseBody(HttpBody {
        body: b"data: {\"choices\":[{\"text\":\"a\"}]}\n\n".to_vec(),
        end_of_stream: false,
        ..Default::default()
    })))
    .await;
    let Out::ResponseBody(_) = p.recv().await else {
        panic!("expected the chunk back");
    };
}

#[tokio::test]
async fn the_answers_usage_settles_the_tenants_reservation_at_what_it_used() {
    let body = completion("m");
    let (_f, svc, escrow, _) = under_a_limit(&body);
    let mut client = picker(svc).await;
    let mut p = Proxy::ask(&mut client, "q1", &body, None).await;
    let Out::RequestHeaders(_) = p.recv().await else {
        panic!("expected the pick");
    };
    streamed_body(&mut p).await;
    let reserved = spent(&escrow);
    assert!(
        reserved >= 80 + 8,
        "the reservation holds the prompt and max_tokens: {reserved}"
    );
    answer_begins(&mut p, "200").await;
    p.send(msg(In::ResponseBody(HttpBody {
        body: b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":80,\"completion_tokens\":3}}\n\ndata: [DONE]\n\n".to_vec(),
        end_of_stream: true,
        ..Default::default()
    })))
    .await;
    p.recv().await;
    assert_eq!(spent(&escrow), 80 + 3, "what the answer says it used");
}

#[tokio::test]
async fn a_request_over_the_tenants_limit_is_429() {
    let body = completion("m");
    let (_f, svc, escrow, metrics) = under_a_limit(&body);
    let mut client = picker(svc).await;
    // More than the 10,000 tokens this replica holds, and no refiller to ask for more.
    let mut greedy: serde_json::Value = serde_json::from_slice(&body).unwrap();
    greedy["max_tokens"] = 50_000.into();
    let greedy = serde_json::to_vec(&greedy).unwrap();
    let mut p = Proxy::ask(&mut client, "g1", &greedy, None).await;
    let (status, b, _) = immediate(p.recv().await);
    assert_eq!(
        (status, b["error"]["code"].as_str()),
        (429, Some("rate_limit_exceeded")),
        "{b}"
    );
    assert_eq!(metrics.picker_requests("rate_limited"), 1);
    assert_eq!(spent(&escrow), 0, "nothing was admitted");
}

#[tokio::test]
async fn an_answer_cut_off_keeps_its_reservation_and_one_that_never_came_is_refunded() {
    let body = completion("m");
    let (_f, svc, escrow, metrics) = under_a_limit(&body);
    let mut client = picker(svc).await;

    // Cut off after its first chunk: its usage is unknown, it keeps what was reserved.
    let mut p = Proxy::ask(&mut client, "c1", &body, None).await;
    p.recv().await;
    streamed_body(&mut p).await;
    let reserved = spent(&escrow);
    answer_begins(&mut p, "200").await;
    drop(p);
    eventually_reports(&metrics, 1).await;
    assert_eq!(spent(&escrow), reserved);

    // No answer at all (the proxy gave up before the engine's headers): refunded.
    let mut p = Proxy::ask(&mut client, "c2", &body, None).await;
    p.recv().await;
    streamed_body(&mut p).await;
    assert_eq!(spent(&escrow), 2 * reserved);
    drop(p);
    eventually_reports(&metrics, 2).await;
    assert_eq!(spent(&escrow), reserved);
}

/// The proxy's word that `endpoint` served the request (`envoy.lb` metadata, as Envoy's
/// load balancer writes it).
fn served_by(endpoint: &str) -> Metadata {
    Metadata {
        filter_metadata: [(
            "envoy.lb".to_owned(),
            Struct {
                fields: [(
                    "x-gateway-destination-endpoint-served".to_owned(),
                    Value {
                        kind: Some(Kind::StringValue(endpoint.into())),
                    },
                )]
                .into_iter()
                .collect(),
            },
        )]
        .into_iter()
        .collect(),
        ..Default::default()
    }
}

#[tokio::test]
async fn an_answer_the_proxy_got_from_another_endpoint_runs_there_and_teaches_the_pick_nothing() {
    let body = completion("m");
    let (_f, svc, metrics) = w1_caches(&body);
    let predictor = Arc::new(kvplane_api::predict::Predictor::new(Arc::new(|| 1_000)));
    let svc = svc.with_predictor(predictor.clone());
    let running = |svc: &RouterService| {
        support::explain(svc, support::request("x", "m", &[], vec![7; 16]))
            .candidates
            .iter()
            .map(|c| (c.endpoint.as_ref().unwrap().worker_id.clone(), c.running))
            .collect::<std::collections::BTreeMap<String, u32>>()
    };
    let mut client = picker(svc.clone()).await;
    let mut p = Proxy::ask(&mut client, "f1", &body, None).await;
    let first = p.recv_whole().await;
    assert_eq!(lb_destination(&first).as_deref(), Some("w1:8000"));
    streamed_body(&mut p).await;
    // w1 did not answer; the proxy's fallback w0 did, and its metadata says so.
    p.send(ProcessingRequest {
        request: Some(In::ResponseHeaders(HttpHeaders {
            headers: header_map(&[(":status", "200"), ("content-type", "text/event-stream")]),
            ..Default::default()
        })),
        metadata_context: Some(served_by("w0:8000")),
        ..Default::default()
    })
    .await;
    p.recv().await;
    p.send(msg(In::ResponseBody(HttpBody {
        body: b"data: {\"choices\":[{\"text\":\"a\"}]}\n\n".to_vec(),
        end_of_stream: false,
        ..Default::default()
    })))
    .await;
    p.recv().await;
    kvplane_testkit::eventually(
        "the first token reported",
        std::time::Duration::from_secs(5),
        || async { (metrics.usage_reports("first_token") == 1).then_some(()) },
    )
    .await;
    assert_eq!(metrics.picker_requests("served_elsewhere"), 1);
    let now = running(&svc);
    assert_eq!(
        (now["w0"], now["w1"]),
        (1, 0),
        "it runs on w0, which served it"
    );
    assert_eq!(predictor.calibration("default"), 1.0, "w1 learned nothing");
    p.send(msg(In::ResponseBody(HttpBody {
        body: b"data: [DONE]\n\n".to_vec(),
        end_of_stream: true,
        ..Default::default()
    })))
    .await;
    p.recv().await;
    eventually_reports(&metrics, 1).await;
    assert_eq!(running(&svc)["w0"], 0, "ended there");
}

/// Waits until `n` final reports were settled.
async fn eventually_reports(metrics: &ApiMetrics, n: u64) {
    kvplane_testkit::eventually(
        &format!("{n} final reports"),
        std::time::Duration::from_secs(5),
        || async { (metrics.usage_reports("known") >= n).then_some(()) },
    )
    .await;
}

#[tokio::test]
async fn an_error_answer_is_no_first_token_and_settles_once_at_its_headers_end() {
    let body = completion("m");
    let (_f, svc, metrics) = w1_caches(&body);
    let mut client = picker(svc).await;
    let mut p = Proxy::ask(&mut client, "e1", &body, None).await;
    p.recv().await;
    streamed_body(&mut p).await;
    // A 503 with a body (the proxy's own, when the engine cannot be reached).
    p.send(msg(In::ResponseHeaders(HttpHeaders {
        headers: header_map(&[(":status", "503"), ("content-type", "text/plain")]),
        ..Default::default()
    })))
    .await;
    p.recv().await;
    p.send(msg(In::ResponseBody(HttpBody {
        body: b"upstream connect error".to_vec(),
        end_of_stream: true,
        ..Default::default()
    })))
    .await;
    p.recv().await;
    assert_eq!(metrics.usage_reports("first_token"), 0);
    assert_eq!(metrics.usage_reports("known"), 1);
    // An answer with headers only ends there, settled once for all what follows.
    let mut p = Proxy::ask(&mut client, "e2", &body, None).await;
    p.recv().await;
    streamed_body(&mut p).await;
    p.send(msg(In::ResponseHeaders(HttpHeaders {
        headers: header_map(&[(":status", "204")]),
        end_of_stream: true,
        ..Default::default()
    })))
    .await;
    p.recv().await;
    // Settled as the headers ended, before their answer came back.
    assert_eq!(metrics.usage_reports("known"), 2);
    p.send(msg(In::ResponseTrailers(Default::default()))).await;
    let Out::ResponseTrailers(_) = p.recv().await else {
        panic!("expected the trailers' answer");
    };
    assert_eq!(metrics.usage_reports("unknown"), 0, "no second report");
}

#[tokio::test]
async fn a_buffered_body_that_ends_with_trailers_is_picked_at_the_body_and_the_trailers_answered() {
    let body = completion("m");
    let (_f, svc, _) = w1_caches(&body);
    let mut client = picker(svc).await;
    let mut p = Proxy::open(&mut client).await;
    p.send(request_headers("t1", BodySendMode::Buffered, None))
        .await;
    let Out::RequestHeaders(_) = p.recv().await else {
        panic!("expected the headers' answer");
    };
    p.send(body_chunk(&body, false)).await;
    let r = p.recv_whole().await;
    assert_eq!(lb_destination(&r).as_deref(), Some("w1:8000"));
    p.send(msg(In::RequestTrailers(Default::default()))).await;
    let Out::RequestTrailers(_) = p.recv().await else {
        panic!("expected the trailers' answer");
    };
}

#[tokio::test]
async fn a_body_over_the_limit_is_413() {
    let (_f, svc, metrics) = caching("w1", &completion("m"));
    let mut client = picker(svc).await;
    let mut p = Proxy::open(&mut client).await;
    p.send(request_headers(
        "big",
        BodySendMode::FullDuplexStreamed,
        None,
    ))
    .await;
    let mib = vec![b' '; 1 << 20];
    let chunks = (16 << 20) / mib.len() + 1;
    for _ in 0..chunks {
        p.send(body_chunk(&mib, false)).await;
    }
    let (status, b, _) = immediate(p.recv().await);
    assert_eq!(
        (status, b["error"]["code"].as_str()),
        (413, Some("body_too_large"))
    );
    assert_eq!(metrics.picker_requests("body_too_large"), 1);
}

#[tokio::test]
async fn the_pick_is_the_worker_that_caches_the_prompt() {
    let body = completion("m");
    for worker in ["w0", "w1"] {
        let (_f, svc, _) = caching(worker, &body);
        let mut client = picker(svc).await;
        let mut p = Proxy::ask(&mut client, worker, &body, None).await;
        let Out::RequestHeaders(h) = p.recv().await else {
            panic!("expected the pick");
        };
        assert_eq!(
            set_header(
                h.response.as_ref().unwrap(),
                "x-gateway-destination-endpoint"
            ),
            Some(format!("{worker}:8000"))
        );
        // A provider the client named itself is not where the request goes.
        assert_eq!(
            h.response.unwrap().header_mutation.unwrap().remove_headers,
            ["x-kvplane-provider"]
        );
    }
}

/// Where the proxy runs is its stream's metadata (Envoy's `grpc_service.initial_metadata`):
/// a replica of cluster c asked by a proxy that says it runs in b keeps a `sameLocality` rule
/// in b; without the word, in c, the replica's own cluster.
#[tokio::test]
async fn a_proxy_that_says_where_it_runs_is_decided_for_as_from_there() {
    let mut f = TestFleet::with_yaml(concat!(
        "apiVersion: kvplane.io/v1alpha1\nkind: InferenceWorkerSet\nmetadata: {name: near}\n",
        "spec: {model: m, labels: {kvplane.io/cluster: b}}\n---\n",
        "apiVersion: kvplane.io/v1alpha1\nkind: InferenceWorkerSet\nmetadata: {name: far}\n",
        "spec: {model: m, labels: {kvplane.io/cluster: c}}\n---\n",
        "apiVersion: kvplane.io/v1alpha1\nkind: InferencePolicy\nmetadata: {name: stay}\n",
        "spec:\n  appliesToModels: [m]\n  rules:\n  - name: home\n",
        "    filter: {sameLocality: Cluster}\n",
    ));
    f.up("near", &["n0"]).up("far", &["f0"]);
    let metrics = Arc::new(ApiMetrics::default());
    let svc = RouterService::new(f.sm.handle(), CostModel::default(), metrics.clone()).with_origin(
        kvplane_policy::Origin {
            cluster: Some("c".into()),
            ..Default::default()
        },
    );
    let mut client = picker(svc).await;
    let body = completion("m");
    let places: [(&[(&'static str, &str)], &str); 3] = [
        (&[], "f0:8000"),
        (&[("x-kvplane-cluster", "b")], "n0:8000"),
        (
            &[("x-kvplane-cluster", "c"), ("x-kvplane-zone", "c-1")],
            "f0:8000",
        ),
    ];
    for (i, (metadata, endpoint)) in places.into_iter().enumerate() {
        let mut p = Proxy::ask_from(&mut client, metadata, &format!("o{i}"), &body, None).await;
        let Out::RequestHeaders(h) = p.recv().await else {
            panic!("expected the pick");
        };
        assert_eq!(
            set_header(
                h.response.as_ref().unwrap(),
                "x-gateway-destination-endpoint"
            ),
            Some(endpoint.to_owned()),
            "{metadata:?}"
        );
    }
    // A value that is not text (the proxy's configuration is wrong): the stream fails, counted.
    let (_tx, rx) = mpsc::channel::<ProcessingRequest>(1);
    let out = futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) });
    let mut req = tonic::Request::new(out);
    req.metadata_mut().insert(
        "x-kvplane-cluster",
        tonic::metadata::MetadataValue::try_from(&b"b\xff"[..]).unwrap(),
    );
    let refused = client.process(req).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused}");
    assert_eq!(refused.message(), "x-kvplane-cluster is not text");
    assert_eq!(metrics.picker_requests("bad_origin"), 1);
}

#[tokio::test]
async fn a_buffered_request_is_answered_at_its_headers_and_picked_in_its_bodys_answer() {
    let body = completion("m");
    let (_f, svc, _) = w1_caches(&body);
    let mut client = picker(svc).await;
    let mut p = Proxy::open(&mut client).await;
    p.send(request_headers("r2", BodySendMode::Buffered, None))
        .await;
    // The proxy waits for this before it sends the body.
    let Out::RequestHeaders(h) = p.recv().await else {
        panic!("expected the headers' answer");
    };
    assert!(h.response.is_none_or(|c| c.header_mutation.is_none()));
    p.send(body_chunk(&body, true)).await;
    let r = p.recv_whole().await;
    let Some(Out::RequestBody(b)) = &r.response else {
        panic!("expected the body's answer, got {r:?}");
    };
    let common = b.response.as_ref().unwrap();
    assert_eq!(
        set_header(common, "x-gateway-destination-endpoint").as_deref(),
        Some("w1:8000")
    );
    assert!(common.body_mutation.is_none(), "the body is not rewritten");
    assert_eq!(lb_destination(&r).as_deref(), Some("w1:8000"));
}

#[tokio::test]
async fn an_aliased_model_streams_back_the_body_naming_the_served_model_with_its_length() {
    let mut f = TestFleet::with_policies(EXAMPLES);
    f.up("large-a100", &["a0", "a1"]).up("small-l4", &["l0"]);
    let mut client = picker(f.service()).await;
    let sent = completion("standard-model");
    let mut p = Proxy::ask(&mut client, "r3", &sent, None).await;
    let Out::RequestHeaders(h) = p.recv().await else {
        panic!("expected the headers' answer");
    };
    let length = set_header(h.response.as_ref().unwrap(), "content-length").unwrap();
    let back = streamed_body(&mut p).await;
    assert_eq!(length, back.len().to_string());
    let v: serde_json::Value = serde_json::from_slice(&back).unwrap();
    let served = v["model"].as_str().unwrap();
    // examples/policies/5-aliasing.yaml: standard-model is served as llama-70b or llama-8b.
    assert!(["llama-70b", "llama-8b"].contains(&served), "{served}");
    assert_ne!(
        served, "standard-model",
        "the engine is asked for the model it serves"
    );
    let original: serde_json::Value = serde_json::from_slice(&sent).unwrap();
    assert_eq!(v["prompt"], original["prompt"]);
}

#[tokio::test]
async fn the_subset_hint_limits_the_pick_and_an_empty_or_foreign_subset_is_503() {
    let body = completion("m");
    let (_f, svc, metrics) = w1_caches(&body);
    let mut client = picker(svc).await;
    let cases: [(&[&str], Option<&str>); 3] = [
        (&["w0:8000"], Some("w0:8000")),
        (&[], None),
        (&["10.9.9.9:8000"], None),
    ];
    for (i, (subset, want)) in cases.iter().enumerate() {
        let mut p = Proxy::ask(
            &mut client,
            &format!("s{i}"),
            &body,
            Some(subset_hint(subset)),
        )
        .await;
        match want {
            Some(endpoint) => {
                let Out::RequestHeaders(h) = p.recv().await else {
                    panic!("expected the pick");
                };
                assert_eq!(
                    set_header(
                        h.response.as_ref().unwrap(),
                        "x-gateway-destination-endpoint"
                    )
                    .as_deref(),
                    Some(*endpoint),
                    "w1 caches the prompt, but the proxy may only use w0"
                );
            }
            None => {
                let (status, body, _) = immediate(p.recv().await);
                assert_eq!(status, 503, "subset {subset:?}: {body}");
                assert_eq!(body["error"]["code"], "no_capacity");
            }
        }
    }
    assert_eq!(metrics.picker_requests("no_capacity"), 2);
}

#[tokio::test]
async fn refusals_are_immediate_answers_in_openais_error_shape() {
    let body = completion("m");
    let (f, _, _) = w1_caches(&body);
    let mut client = picker(f.service()).await;

    // A request with no body names no model.
    let mut p = Proxy::open(&mut client).await;
    let mut headers_only = request_headers("x1", BodySendMode::FullDuplexStreamed, None);
    if let Some(In::RequestHeaders(h)) = &mut headers_only.request {
        h.end_of_stream = true;
    }
    p.send(headers_only).await;
    let (status, b, headers) = immediate(p.recv().await);
    assert_eq!(status, 400);
    assert_eq!(b["error"]["type"], "invalid_request_error");
    assert!(b["error"]["message"].as_str().unwrap().contains("body"));
    assert!(headers.contains(&("content-type".into(), "application/json".into())));

    // A body that is not JSON.
    let mut p = Proxy::ask(&mut client, "x2", b"not json", None).await;
    let (status, b, _) = immediate(p.recv().await);
    assert_eq!(
        (status, b["error"]["code"].as_str()),
        (400, Some("invalid_request"))
    );

    // No worker set of the policies' catalog serves the model.
    let mut policies = TestFleet::with_policies(EXAMPLES);
    policies.up("large-a100", &["a0"]);
    let mut client = picker(policies.service()).await;
    let mut p = Proxy::ask(&mut client, "x3", &completion("no-such-model"), None).await;
    let (status, b, _) = immediate(p.recv().await);
    assert_eq!(
        (status, b["error"]["code"].as_str()),
        (404, Some("model_not_found"))
    );
}

#[tokio::test]
async fn a_node_with_no_state_ends_the_stream_unavailable_for_the_proxys_failure_mode() {
    let f = TestFleet::new();
    let mut client = picker(f.service()).await;
    let mut p = Proxy::ask(&mut client, "u1", &completion("m"), None).await;
    let status = p.rx.message().await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status}");
}

/// Two proxies' identities: `proxy-a` may route for acme, `proxy-b` only for globex.
const PROXY_ACCESS: &str = "apiVersion: kvplane.io/v1alpha1\nkind: AccessPolicy\nmetadata: {name: proxy-a}\nspec: {identities: ['spiffe://test/proxy-a'], rights: [route], tenants: [acme]}\n---\napiVersion: kvplane.io/v1alpha1\nkind: AccessPolicy\nmetadata: {name: proxy-b}\nspec: {identities: ['spiffe://test/proxy-b'], rights: [route], tenants: [globex]}\n";

#[tokio::test]
async fn a_proxy_whose_certificate_may_not_route_for_the_tenant_is_answered_403() {
    use kvplane_tls::dev_ca::DevCa;
    use kvplane_tls::{Dialer, Tls, TlsMetrics};
    let body = completion("m");
    let mut f = pools_node(&[]);
    f.caches("default", "w1", &ids(&body), 16, None, None);
    apply_policies(&mut f, PROXY_ACCESS);
    let dir = tempfile::tempdir().unwrap();
    let ca = DevCa::new("test ca").unwrap();
    let load = |name: &str, id: &str| {
        let s = ca
            .write(&dir.path().join(name), id, &["127.0.0.1"])
            .unwrap();
        Tls::load(&s, TlsMetrics::default()).unwrap()
    };
    let server = load("picker", "spiffe://test/kvplane");
    let access = kvplane_api::Access::new(
        true,
        vec!["spiffe://test/kvplane".into()],
        Vec::new(),
        f.sm.handle(),
        kvplane_api::AccessMetrics::default(),
    );
    let metrics = Arc::new(ApiMetrics::default());
    let svc = RouterService::new(f.sm.handle(), CostModel::default(), metrics.clone())
        .with_access(access.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(
        tonic::transport::Server::builder()
            .layer(kvplane_api::AccessLayer(access))
            .add_service(EndpointPicker::new(svc, PickerConfig::default()).server())
            .serve_with_incoming(kvplane_tls::incoming(listener, Some(server))),
    );
    let client = |tls: Tls| {
        let addr = addr.clone();
        async move { ExternalProcessorClient::new(Dialer::new(Some(tls)).connect(&addr).await.unwrap()) }
    };

    // acme's request (the x-tenant header) from proxy B: refused in OpenAI's shape.
    let mut b = client(load("proxy-b", "spiffe://test/proxy-b")).await;
    let mut p = Proxy::ask(&mut b, "b1", &body, None).await;
    let (status, answer, _) = immediate(p.recv().await);
    assert_eq!(status, 403, "{answer}");
    assert_eq!(answer["error"]["code"], "permission_denied", "{answer}");
    let message = answer["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("spiffe://test/proxy-b") && message.contains("\"acme\""),
        "{message}"
    );
    assert_eq!(metrics.picker_requests("permission_denied"), 1);

    // The same request from proxy A gets its pick.
    let mut a = client(load("proxy-a", "spiffe://test/proxy-a")).await;
    let mut p = Proxy::ask(&mut a, "a1", &body, None).await;
    let Out::RequestHeaders(_) = p.recv().await else {
        panic!("expected the pick");
    };
}
