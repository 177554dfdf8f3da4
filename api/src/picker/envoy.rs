//! Envoy's ext_proc messages as the endpoint picker protocol uses them: a request's headers
//! (raw or string values), the subset hint and the served endpoint in its metadata; header
//! mutations, the `envoy.lb` dynamic metadata and immediate responses in the answers.

use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption, Metadata};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HeaderMutation, HttpHeaders, ImmediateResponse, ProcessingResponse, processing_response,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};

/// The header (and `envoy.lb` key) naming the picked endpoint, `ip:port`, and after a comma
/// the endpoints to retry on.
pub(crate) const DESTINATION: &str = "x-gateway-destination-endpoint";
/// The metadata namespace of the proxy's endpoint subset and the key of its list.
const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
/// The namespace of the picked endpoint, and where the proxy says which endpoint served.
const LB_NAMESPACE: &str = "envoy.lb";
const SERVED_KEY: &str = "x-gateway-destination-endpoint-served";

/// A message's headers, names lowercase, each value its raw bytes (as Envoy sends them) or its
/// string value; values that are not UTF-8 are dropped.
pub(crate) fn headers(h: &HttpHeaders) -> Vec<(String, String)> {
    h.headers
        .iter()
        .flat_map(|m| &m.headers)
        .filter_map(|v| {
            let value = if v.raw_value.is_empty() {
                v.value.clone()
            } else {
                String::from_utf8(v.raw_value.clone()).ok()?
            };
            Some((v.key.to_ascii_lowercase(), value))
        })
        .collect()
}

/// The value of header `name` (lowercase) in `headers`.
pub(crate) fn header<'h>(headers: &'h [(String, String)], name: &str) -> Option<&'h str> {
    headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}

fn lb_field<'m>(m: Option<&'m Metadata>, namespace: &str, key: &str) -> Option<&'m Kind> {
    m?.filter_metadata
        .get(namespace)?
        .fields
        .get(key)?
        .kind
        .as_ref()
}

/// The proxy's endpoint subset: `None` when it names none (every endpoint may be picked),
/// else the `ip:port` strings of its list (possibly empty: none may be).
pub(crate) fn subset(m: Option<&Metadata>) -> Option<Vec<String>> {
    match lb_field(m, SUBSET_NAMESPACE, SUBSET_KEY)? {
        Kind::ListValue(l) => Some(
            l.values
                .iter()
                .filter_map(|v| match &v.kind {
                    Some(Kind::StringValue(s)) => Some(s.clone()),
                    _ => None,
                })
                .collect(),
        ),
        Kind::StringValue(s) => Some(
            s.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .collect(),
        ),
        _ => Some(Vec::new()),
    }
}

/// The endpoint the proxy says served the request, when it says.
pub(crate) fn served(m: Option<&Metadata>) -> Option<String> {
    match lb_field(m, LB_NAMESPACE, SERVED_KEY)? {
        Kind::StringValue(s) => Some(s.clone()),
        _ => None,
    }
}

/// Sets (overwriting) each of `pairs`.
pub(crate) fn set_headers(pairs: Vec<(&str, String)>) -> HeaderMutation {
    mutate_headers(pairs, &[])
}

/// Sets `pairs` (replacing what the request had) and removes `remove`.
pub(crate) fn mutate_headers(pairs: Vec<(&str, String)>, remove: &[&str]) -> HeaderMutation {
    HeaderMutation {
        set_headers: pairs
            .into_iter()
            .map(|(k, v)| HeaderValueOption {
                header: Some(HeaderValue {
                    key: k.to_owned(),
                    raw_value: v.into_bytes(),
                    ..Default::default()
                }),
                append_action: HeaderAppendAction::OverwriteIfExistsOrAdd.into(),
                ..Default::default()
            })
            .collect(),
        remove_headers: remove.iter().map(|h| (*h).to_owned()).collect(),
    }
}

/// `{"envoy.lb": {"x-gateway-destination-endpoint": destination}}`.
pub(crate) fn lb_metadata(destination: &str) -> Struct {
    let inner = Struct {
        fields: [(
            DESTINATION.to_owned(),
            Value {
                kind: Some(Kind::StringValue(destination.to_owned())),
            },
        )]
        .into_iter()
        .collect(),
    };
    Struct {
        fields: [(
            LB_NAMESPACE.to_owned(),
            Value {
                kind: Some(Kind::StructValue(inner)),
            },
        )]
        .into_iter()
        .collect(),
    }
}

/// An answer the proxy sends to the client instead of forwarding the request.
pub(crate) fn immediate(
    status: u16,
    headers: Vec<(&str, String)>,
    body: Vec<u8>,
    details: &str,
) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(processing_response::Response::ImmediateResponse(
            ImmediateResponse {
                status: Some(HttpStatus {
                    code: i32::from(status),
                }),
                headers: Some(set_headers(headers)),
                body,
                grpc_status: None,
                details: details.to_owned(),
            },
        )),
        ..Default::default()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use envoy_types::pb::envoy::config::core::v3::HeaderMap;
    use envoy_types::pb::google::protobuf::ListValue;

    /// Metadata with `key: value` in `namespace`, as a proxy sends it.
    pub(crate) fn metadata(namespace: &str, key: &str, value: Kind) -> Metadata {
        Metadata {
            filter_metadata: [(
                namespace.to_owned(),
                Struct {
                    fields: [(key.to_owned(), Value { kind: Some(value) })]
                        .into_iter()
                        .collect(),
                },
            )]
            .into_iter()
            .collect(),
            ..Default::default()
        }
    }

    /// The subset hint listing `endpoints`.
    pub(crate) fn subset_hint(endpoints: &[&str]) -> Metadata {
        metadata(
            SUBSET_NAMESPACE,
            SUBSET_KEY,
            Kind::ListValue(ListValue {
                values: endpoints
                    .iter()
                    .map(|e| Value {
                        kind: Some(Kind::StringValue((*e).to_owned())),
                    })
                    .collect(),
            }),
        )
    }

    /// The proxy's word that `endpoint` served the request.
    pub(crate) fn served_by(endpoint: &str) -> Metadata {
        metadata(
            LB_NAMESPACE,
            SERVED_KEY,
            Kind::StringValue(endpoint.to_owned()),
        )
    }

    #[test]
    fn headers_are_read_from_raw_values_first_and_names_lowercased() {
        let h = HttpHeaders {
            headers: Some(HeaderMap {
                headers: vec![
                    HeaderValue {
                        key: "X-Tenant".into(),
                        value: String::new(),
                        raw_value: b"acme".to_vec(),
                    },
                    HeaderValue {
                        key: ":path".into(),
                        value: "/v1/completions".into(),
                        raw_value: Vec::new(),
                    },
                ],
            }),
            ..Default::default()
        };
        let got = headers(&h);
        assert_eq!(header(&got, "x-tenant"), Some("acme"));
        assert_eq!(header(&got, ":path"), Some("/v1/completions"));
    }

    #[test]
    fn the_subset_hint_is_a_list_absent_or_empty() {
        assert_eq!(subset(None), None);
        let m = subset_hint(&["10.0.0.1:8000", "10.0.0.2:8000"]);
        assert_eq!(
            subset(Some(&m)),
            Some(vec!["10.0.0.1:8000".to_owned(), "10.0.0.2:8000".to_owned()])
        );
        assert_eq!(subset(Some(&subset_hint(&[]))), Some(Vec::new()));
        assert_eq!(
            served(Some(&served_by("10.0.0.2:8000"))).as_deref(),
            Some("10.0.0.2:8000")
        );
    }
}
