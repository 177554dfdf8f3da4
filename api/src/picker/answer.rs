//! A Route answer as the proxy takes it: the picked endpoint (`ip:port`, with the others to
//! retry on when configured) as header and `envoy.lb` metadata, a provider as a header the
//! proxy's routes can match, a refusal as an immediate answer in OpenAI's error shape.

use envoy_types::pb::envoy::service::ext_proc::v3::ProcessingResponse;
use envoy_types::pb::google::protobuf::Struct;
use kvplane_policy::filters::host_port;
use kvplane_proto::v1::{RejectCode, RouteResponse, route_response::Decision};

use super::envoy::{self, DESTINATION};

/// The header naming the provider a request was routed to (no destination endpoint then).
pub const PROVIDER_HEADER: &str = "x-kvplane-provider";

/// Where a request goes.
#[derive(Debug)]
pub(crate) struct Picked {
    /// The metric label: `routed` or `provider`.
    pub(crate) outcome: &'static str,
    /// `pool/worker` or `provider:name`.
    pub(crate) label: String,
    /// The picked `ip:port` (empty for a provider).
    pub(crate) endpoint: String,
    /// The destination list: the pick, then the endpoints to retry on.
    destination: String,
    provider: Option<String>,
}

impl Picked {
    /// The request headers to set, for a body of `body_len` bytes.
    pub(crate) fn headers(&self, body_len: usize) -> Vec<(&'static str, String)> {
        let mut h = vec![("content-length", body_len.to_string())];
        match &self.provider {
            Some(p) => h.push((PROVIDER_HEADER, p.clone())),
            None => h.push((DESTINATION, self.destination.clone())),
        }
        h
    }

    /// The request headers to remove: the other kind of destination, should the client have
    /// sent it (the proxy's routes would otherwise follow the client's word, not the pick).
    pub(crate) fn removed_headers(&self) -> [&'static str; 1] {
        if self.provider.is_some() {
            [DESTINATION]
        } else {
            [PROVIDER_HEADER]
        }
    }

    /// The `envoy.lb` metadata (workers only).
    pub(crate) fn metadata(&self) -> Option<Struct> {
        self.provider
            .is_none()
            .then(|| envoy::lb_metadata(&self.destination))
    }
}

/// A refusal: its HTTP status, its kind (the metric label and the error's `code`), why, and
/// when to retry.
#[derive(Debug)]
pub(crate) struct Refused {
    pub(crate) status: u16,
    /// Its metric label (`kvplane_picker_requests_total{outcome}`).
    pub(crate) kind: &'static str,
    /// Its OpenAI-style error code (the gateway's for the same refusal).
    pub(crate) code: &'static str,
    pub(crate) message: String,
    pub(crate) retry_after_ms: u64,
}

impl Refused {
    pub(crate) fn new(status: u16, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            kind,
            code: kind,
            message: message.into(),
            retry_after_ms: 0,
        }
    }

    /// The immediate answer: `status`, an OpenAI-shaped error body, `Retry-After` (whole
    /// seconds, rounded up) when set.
    pub(crate) fn answer(&self) -> ProcessingResponse {
        let body = kvplane_proto::front::openai_error(self.status, self.code, &self.message);
        let mut headers = vec![("content-type", "application/json".to_owned())];
        if self.retry_after_ms > 0 {
            headers.push((
                "retry-after",
                self.retry_after_ms.div_ceil(1000).to_string(),
            ));
        }
        envoy::immediate(
            self.status,
            headers,
            body.to_string().into_bytes(),
            &format!("kvplane_{}", self.kind),
        )
    }
}

/// Where `resp` sends the request (`fallbacks`: how many other endpoints to list after the
/// pick), or why it is refused.
pub(crate) fn picked(resp: &RouteResponse, fallbacks: usize) -> Result<Picked, Refused> {
    match &resp.decision {
        Some(Decision::Endpoint(e)) if !e.provider.is_empty() => Ok(Picked {
            outcome: "provider",
            label: format!("provider:{}", e.provider),
            endpoint: String::new(),
            destination: String::new(),
            provider: Some(e.provider.clone()),
        }),
        Some(Decision::Endpoint(e)) if e.address.is_empty() => Err(Refused {
            retry_after_ms: 1000,
            ..Refused::new(
                503,
                "no_address",
                format!(
                    "worker {}/{} has not announced an address",
                    e.pool, e.worker_id
                ),
            )
        }),
        Some(Decision::Endpoint(e)) => {
            let endpoint = host_port(&e.address).to_owned();
            let mut destination = endpoint.clone();
            for a in resp
                .alternatives
                .iter()
                // Workers serving the pick's model only: the body streamed back names it.
                .filter(|a| {
                    !a.address.is_empty()
                        && a.provider.is_empty()
                        && (a.model.is_empty() || a.model == resp.model)
                })
                .take(fallbacks)
            {
                destination.push(',');
                destination.push_str(host_port(&a.address));
            }
            Ok(Picked {
                outcome: "routed",
                label: format!("{}/{}", e.pool, e.worker_id),
                endpoint,
                destination,
                provider: None,
            })
        }
        Some(Decision::Rejection(r)) => {
            let code = RejectCode::try_from(r.code).unwrap_or(RejectCode::Unspecified);
            let label = crate::Reject::from_code(code).label();
            let (status, openai_code) = kvplane_proto::front::refusal_answer(code);
            Err(Refused {
                retry_after_ms: r.retry_after_ms,
                code: openai_code,
                ..Refused::new(status, label, r.reason.clone())
            })
        }
        None => Err(Refused {
            retry_after_ms: 1000,
            ..Refused::new(503, "unavailable", "kvplane gave no decision")
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Out;
    use kvplane_proto::v1::{Endpoint, Rejection};

    fn rejected(code: RejectCode, retry_after_ms: u64) -> RouteResponse {
        RouteResponse {
            decision: Some(Decision::Rejection(Rejection {
                code: code.into(),
                reason: "why".into(),
                retry_after_ms,
            })),
            ..Default::default()
        }
    }

    fn worker(name: &str) -> Endpoint {
        Endpoint {
            address: format!("http://10.0.0.{}:8000", name.len()),
            worker_id: name.into(),
            pool: "gpu".into(),
            ..Default::default()
        }
    }

    #[test]
    fn each_refusal_has_the_protocols_status_and_retry_after_in_whole_seconds() {
        // The endpoint picker protocol's codes: 429 to shed, 503 when nothing can serve.
        for (code, status, retry_ms, retry_after) in [
            (RejectCode::RateLimited, 429, 1_500, Some("2")),
            (RejectCode::NoCapacity, 503, 0, None),
            (RejectCode::Policy, 403, 0, None),
            (RejectCode::UnknownModel, 404, 0, None),
            (RejectCode::InvalidRequest, 400, 0, None),
        ] {
            let refused = picked(&rejected(code, retry_ms), 0).unwrap_err();
            let Some(Out::ImmediateResponse(i)) = refused.answer().response else {
                panic!("{code:?}: not an immediate answer");
            };
            assert_eq!(i.status.unwrap().code, status, "{code:?}");
            let headers: Vec<(String, Vec<u8>)> = i
                .headers
                .unwrap()
                .set_headers
                .into_iter()
                .filter_map(|o| o.header)
                .map(|h| (h.key, h.raw_value))
                .collect();
            let retry = headers
                .iter()
                .find(|(k, _)| k == "retry-after")
                .map(|(_, v)| String::from_utf8(v.clone()).unwrap());
            assert_eq!(retry.as_deref(), retry_after, "{code:?}");
            let body: serde_json::Value = serde_json::from_slice(&i.body).unwrap();
            assert_eq!(body["error"]["message"], "why");
            assert!(body["error"]["param"].is_null());
        }
    }

    #[test]
    fn a_worker_is_named_by_ip_and_port_with_its_fallbacks_only_when_asked() {
        let resp = RouteResponse {
            decision: Some(Decision::Endpoint(worker("a"))),
            alternatives: vec![
                worker("bb"),
                Endpoint {
                    provider: "cloud".into(),
                    ..worker("dddd")
                },
                worker("ccc"),
                Endpoint {
                    model: "another-model".into(),
                    ..worker("eeeee")
                },
                Endpoint::default(),
            ],
            ..Default::default()
        };
        let alone = picked(&resp, 0).unwrap();
        assert_eq!(
            alone.headers(10)[1],
            ("x-gateway-destination-endpoint", "10.0.0.1:8000".into())
        );
        let listed = picked(&resp, 3).unwrap();
        assert_eq!(
            listed.headers(10)[1],
            (
                DESTINATION,
                "10.0.0.1:8000,10.0.0.2:8000,10.0.0.3:8000".into()
            ),
            "providers, other models and alternatives without an address are left out"
        );
        assert!(listed.metadata().is_some());
        assert_eq!(alone.headers(10)[0], ("content-length", "10".into()));
        assert_eq!(alone.removed_headers(), [PROVIDER_HEADER]);
    }

    #[test]
    fn a_provider_is_named_in_its_header_and_a_destination_the_client_sent_is_removed() {
        let resp = RouteResponse {
            decision: Some(Decision::Endpoint(Endpoint {
                address: "https://api.example/v1".into(),
                provider: "cloud".into(),
                ..Default::default()
            })),
            ..Default::default()
        };
        let p = picked(&resp, 0).unwrap();
        assert_eq!(p.headers(3)[1], ("x-kvplane-provider", "cloud".into()));
        assert_eq!(p.removed_headers(), [DESTINATION]);
        assert!(p.metadata().is_none());
        assert_eq!(
            (p.outcome, p.label.as_str()),
            ("provider", "provider:cloud")
        );
    }
}
