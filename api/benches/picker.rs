//! `cargo bench -p kvplane-api --bench picker`: what the Envoy endpoint picker adds to a
//! decision. In one run, over gRPC on loopback, for bodies of about 1k and 32k prompt tokens:
//! `Router.Route` with the body; the picker in the protocol's full-duplex mode (headers, the
//! body in 16 KiB chunks as a proxy streams it, until the body is streamed back) and with a
//! buffered body; and an empty ext_proc server answering the same full-duplex sequence at once
//! (the protocol's own round trips, no decision). Prints one JSON object.
//!
//! Setup: worker set `gpu` (model `m`, block size 16), 8 workers each caching a different
//! document of the size measured; every request is one document and a question of its own, so
//! each finds its document's worker. Every exchange is finished (the answer's headers and a
//! body with its usage, not timed) and every Route reported, so queues hold only what is in
//! flight. It checks as it goes: the picker picks the worker Route picks, and the body comes
//! back whole. `-- --small` runs a few requests per size: CI checks the output and those
//! assertions, never the timings.

#![allow(clippy::unwrap_used, clippy::print_stdout, clippy::panic)]

use std::pin::Pin;
use std::time::Instant;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeadersResponse, HttpBody, HttpHeaders,
    ProcessingRequest, ProcessingResponse, ProtocolConfiguration, StreamedBodyResponse,
    body_mutation, processing_request::Request as In, processing_response::Response as Out,
};
use futures::Stream;
use kvplane_api::{ApiMetrics, CostModel, EndpointPicker, PickerConfig, RouterService};
use kvplane_proto::v1::router_client::RouterClient;
use kvplane_proto::v1::router_server::RouterServer;
use kvplane_proto::v1::{RouteRequest, UsageReport, route_response::Decision};
use kvplane_testkit::state::TestFleet;
use serde_json::json;
use tokio::sync::mpsc;
use tonic::transport::Channel;
use tonic::{Request, Response, Status, Streaming};

const WORKERS: usize = 8;
const CHUNK: usize = 16 * 1024;

/// An ext_proc server that decides nothing: headers answered at once, each body chunk
/// streamed back as it comes (the least a full-duplex processor does).
struct Empty;

type Answers = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for Empty {
    type ProcessStream = Answers;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Answers>, Status> {
        let mut inbound = request.into_inner();
        let (tx, mut rx) = mpsc::channel(16);
        tokio::spawn(async move {
            while let Ok(Some(m)) = inbound.message().await {
                let out = match m.request {
                    Some(In::RequestHeaders(_)) => Out::RequestHeaders(HeadersResponse::default()),
                    Some(In::RequestBody(b)) => Out::RequestBody(streamed(b)),
                    Some(In::ResponseHeaders(_)) => {
                        Out::ResponseHeaders(HeadersResponse::default())
                    }
                    Some(In::ResponseBody(b)) => Out::ResponseBody(streamed(b)),
                    _ => continue,
                };
                let r = ProcessingResponse {
                    response: Some(out),
                    ..Default::default()
                };
                if tx.send(Ok(r)).await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(futures::stream::poll_fn(
            move |cx| rx.poll_recv(cx),
        ))))
    }
}

fn streamed(b: HttpBody) -> BodyResponse {
    BodyResponse {
        response: Some(CommonResponse {
            body_mutation: Some(BodyMutation {
                mutation: Some(body_mutation::Mutation::StreamedResponse(
                    StreamedBodyResponse {
                        body: b.body,
                        end_of_stream: b.end_of_stream,
                        ..Default::default()
                    },
                )),
            }),
            ..Default::default()
        }),
    }
}

fn words(tag: &str, n: usize) -> String {
    (0..n)
        .map(|i| format!("{tag}{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

fn body(document: &str, question: usize) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "model": "m", "max_tokens": 16, "stream": true,
        "prompt": format!("{document} question{question}"),
    }))
    .unwrap()
}

fn msg(r: In, mode: BodySendMode) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(r),
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: mode.into(),
            response_body_mode: BodySendMode::FullDuplexStreamed.into(),
            send_body_without_waiting_for_header_response: false,
        }),
        ..Default::default()
    }
}

fn headers(id: &str, end_of_stream: bool) -> In {
    let h = |k: &str, v: &str| HeaderValue {
        key: k.into(),
        value: String::new(),
        raw_value: v.as_bytes().to_vec(),
    };
    In::RequestHeaders(HttpHeaders {
        headers: Some(HeaderMap {
            headers: vec![
                h(":method", "POST"),
                h(":path", "/v1/completions"),
                h("content-type", "application/json"),
                h("x-request-id", id),
            ],
        }),
        end_of_stream,
        ..Default::default()
    })
}

/// One request through an ext_proc server in `mode`: the time until the proxy may send it
/// upstream (headers answered, body back whole), and the destination the answer named.
async fn exchange(
    client: &mut ExternalProcessorClient<Channel>,
    id: &str,
    body: &[u8],
    mode: BodySendMode,
) -> (u64, Option<String>) {
    let (tx, rx) = mpsc::channel::<ProcessingRequest>(64);
    let started = Instant::now();
    let mut answers = client
        .process(futures::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|m| (m, rx))
        }))
        .await
        .unwrap()
        .into_inner();
    let mut destination = None;
    let mut back = Vec::new();
    let read_header = |c: &Option<CommonResponse>| {
        c.as_ref()?
            .header_mutation
            .as_ref()?
            .set_headers
            .iter()
            .filter_map(|o| o.header.as_ref())
            .find(|h| h.key == "x-gateway-destination-endpoint")
            .map(|h| String::from_utf8(h.raw_value.clone()).unwrap())
    };
    tx.send(msg(headers(id, false), mode)).await.unwrap();
    if mode == BodySendMode::Buffered {
        let Some(Out::RequestHeaders(_)) = answers.message().await.unwrap().unwrap().response
        else {
            panic!("buffered: the headers are answered first");
        };
        tx.send(msg(
            In::RequestBody(HttpBody {
                body: body.to_vec(),
                end_of_stream: true,
                ..Default::default()
            }),
            mode,
        ))
        .await
        .unwrap();
        let Some(Out::RequestBody(b)) = answers.message().await.unwrap().unwrap().response else {
            panic!("buffered: then the body");
        };
        destination = read_header(&b.response);
        back = body.to_vec();
    } else {
        let chunks: Vec<&[u8]> = body.chunks(CHUNK).collect();
        for (i, c) in chunks.iter().enumerate() {
            tx.send(msg(
                In::RequestBody(HttpBody {
                    body: c.to_vec(),
                    end_of_stream: i + 1 == chunks.len(),
                    ..Default::default()
                }),
                mode,
            ))
            .await
            .unwrap();
        }
        loop {
            match answers.message().await.unwrap().unwrap().response {
                Some(Out::RequestHeaders(h)) => {
                    if let Some(d) = read_header(&h.response) {
                        destination = Some(d);
                    }
                }
                Some(Out::RequestBody(b)) => {
                    let Some(body_mutation::Mutation::StreamedResponse(s)) =
                        b.response.unwrap().body_mutation.unwrap().mutation
                    else {
                        panic!("full duplex: the body comes back streamed");
                    };
                    back.extend(s.body);
                    if s.end_of_stream {
                        break;
                    }
                }
                other => panic!("unexpected answer {other:?}"),
            }
        }
    }
    let ns = started.elapsed().as_nanos() as u64;
    assert_eq!(back, body, "the body comes back whole");
    // The answer (not timed): headers, then the body with its usage, which settles it.
    tx.send(msg(
        In::ResponseHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: vec![HeaderValue {
                    key: ":status".into(),
                    value: String::new(),
                    raw_value: b"200".to_vec(),
                }],
            }),
            ..Default::default()
        }),
        mode,
    ))
    .await
    .unwrap();
    answers.message().await.unwrap();
    tx.send(msg(
        In::ResponseBody(HttpBody {
            body: br#"{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1}}"#.to_vec(),
            end_of_stream: true,
            ..Default::default()
        }),
        mode,
    ))
    .await
    .unwrap();
    answers.message().await.unwrap();
    (ns, destination)
}

fn stats(mut ns: Vec<u64>) -> serde_json::Value {
    ns.sort_unstable();
    let at = |p: f64| ns[((ns.len() as f64 - 1.0) * p).round() as usize] as f64 / 1000.0;
    json!({"calls": ns.len(), "p50_us": at(0.5), "p99_us": at(0.99)})
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let small = std::env::args().any(|a| a == "--small");
    let per_size = if small { 5 } else { 300 };
    let mut out = Vec::new();
    for target_tokens in [1_000usize, 32_000] {
        let documents: Vec<String> = (0..WORKERS)
            .map(|w| words(&format!("d{w}x"), target_tokens))
            .collect();
        let mut f = TestFleet::with_yaml(
            "apiVersion: kvplane.io/v1alpha1\nkind: InferenceWorkerSet\nmetadata: {name: gpu}\nspec: {model: m, blockSize: 16}\n",
        );
        let names: Vec<String> = (0..WORKERS).map(|w| format!("w{w}")).collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        f.up("gpu", &refs);
        for (w, d) in documents.iter().enumerate() {
            let ids = kvplane_tokenize::prompt_from_body(&body(d, 0))
                .unwrap()
                .tokens;
            f.caches("gpu", &names[w], &ids, 16, None, None);
        }
        let prompt_tokens = kvplane_tokenize::prompt_from_body(&body(&documents[0], 0))
            .unwrap()
            .tokens
            .len();
        let svc = RouterService::new(
            f.sm.handle(),
            CostModel::default(),
            std::sync::Arc::new(ApiMetrics::default()),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let empty_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let empty_addr = empty_listener.local_addr().unwrap();
        let server = tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(RouterServer::new(svc.clone()))
                .add_service(EndpointPicker::new(svc, PickerConfig::default()).server())
                .serve_with_incoming(
                    tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
                ),
        );
        let empty = tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(ExternalProcessorServer::new(Empty))
                .serve_with_incoming(
                    tonic::transport::server::TcpIncoming::from(empty_listener)
                        .with_nodelay(Some(true)),
                ),
        );
        let mut router = RouterClient::connect(format!("http://{addr}"))
            .await
            .unwrap();
        let mut picker = ExternalProcessorClient::connect(format!("http://{addr}"))
            .await
            .unwrap()
            .max_decoding_message_size(64 << 20);
        let mut nothing = ExternalProcessorClient::connect(format!("http://{empty_addr}"))
            .await
            .unwrap()
            .max_decoding_message_size(64 << 20);
        let (mut route, mut duplex, mut buffered, mut empty_ns) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut body_bytes = 0;
        for i in 0..per_size {
            let w = i % WORKERS;
            let b = body(&documents[w], i + 1);
            body_bytes = b.len();
            let id = format!("r{target_tokens}-{i}");
            let started = Instant::now();
            let r = router
                .route(RouteRequest {
                    request_id: id.clone(),
                    body: b.clone(),
                    ..Default::default()
                })
                .await
                .unwrap()
                .into_inner();
            route.push(started.elapsed().as_nanos() as u64);
            let Some(Decision::Endpoint(e)) = r.decision else {
                panic!("route: no endpoint for request {i}");
            };
            assert_eq!(e.worker_id, names[w], "route finds the document's worker");
            router
                .report_usage(UsageReport {
                    request_id: id,
                    prompt_tokens: 1,
                    ..Default::default()
                })
                .await
                .unwrap();
            let want = format!("{}:8000", names[w]);
            for (mode, into) in [
                (BodySendMode::FullDuplexStreamed, &mut duplex),
                (BodySendMode::Buffered, &mut buffered),
            ] {
                let (ns, d) = exchange(
                    &mut picker,
                    &format!("p{target_tokens}-{i}-{mode:?}"),
                    &b,
                    mode,
                )
                .await;
                assert_eq!(
                    d.as_deref(),
                    Some(want.as_str()),
                    "the picker picks Route's worker"
                );
                into.push(ns);
            }
            let (ns, _) = exchange(&mut nothing, "e", &b, BodySendMode::FullDuplexStreamed).await;
            empty_ns.push(ns);
        }
        server.abort();
        empty.abort();
        out.push(json!({
            "target_tokens": target_tokens,
            "prompt_tokens": prompt_tokens,
            "body_bytes": body_bytes,
            "route_grpc": stats(route),
            "picker_full_duplex": stats(duplex),
            "picker_buffered": stats(buffered),
            "empty_ext_proc_full_duplex": stats(empty_ns),
        }));
    }
    println!(
        "{}",
        serde_json::to_string_pretty(&json!({
            "workers": WORKERS,
            "chunk_bytes": CHUNK,
            "sizes": out,
        }))
        .unwrap()
    );
}
