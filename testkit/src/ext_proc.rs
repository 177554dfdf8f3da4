//! Building an ext_proc stream's messages as Envoy sends them (Envoy's own protos): for the
//! endpoint picker's tests and the chaos runner's client in front of it.

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::ProcessingRequest;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request;

/// `request` as one message of the stream.
pub fn message(request: Request) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(request),
        ..Default::default()
    }
}

/// Headers as Envoy sends them (values in `raw_value`).
pub fn header_map(pairs: &[(&str, &str)]) -> Option<HeaderMap> {
    Some(HeaderMap {
        headers: pairs
            .iter()
            .map(|(k, v)| HeaderValue {
                key: (*k).into(),
                value: String::new(),
                raw_value: v.as_bytes().to_vec(),
            })
            .collect(),
    })
}
