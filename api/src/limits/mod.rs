//! Stated bounds on what a caller may send the routing service: the `[limits]` section of a
//! node's config. Each bound has a safe default; a request over one is refused with the bound's
//! name and counted in `kvplane_limit_hits_total{limit}`; nothing else it carried is kept.

mod grpc;
mod request;

use serde::Deserialize;

pub use grpc::LimitsLayer;
pub(crate) use grpc::is_too_large;
pub use request::OverLimit;

/// `[limits]`: what one call may carry, and how long a Router call may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// The largest gRPC message a Router, Admin or endpoint-picker call may send (bytes);
    /// larger: OUT_OF_RANGE before the message is read.
    pub grpc_message_bytes: usize,
    /// Calls one HTTP/2 connection may have open at once on the gRPC port (the connection's
    /// `SETTINGS_MAX_CONCURRENT_STREAMS`: a client waits for a slot).
    pub grpc_streams_per_connection: u32,
    /// Header bytes of one gRPC call (HTTP/2 `SETTINGS_MAX_HEADER_LIST_SIZE`).
    pub grpc_header_bytes: u32,
    /// A Router call (Route, Explain, ReportUsage, Models) still unanswered after this long
    /// ends with DEADLINE_EXCEEDED (milliseconds).
    pub route_call_ms: u64,
    /// Tags a Route request may name.
    pub tags: usize,
    /// Bytes of one tag.
    pub tag_bytes: usize,
    /// Bytes of a request id, tenant, model or cache salt.
    pub name_bytes: usize,
    /// Headers a Route request may pass on.
    pub headers: usize,
    /// Bytes of one header (name and value).
    pub header_bytes: usize,
    /// Bytes of a request body (Route and the endpoint picker).
    pub body_bytes: usize,
    /// Prompt token ids a Route request may carry.
    pub token_ids: usize,
    /// Endpoints a Route request's subset may list.
    pub endpoint_subset: usize,
    /// Charges a usage report's ticket may name (a routed request's ticket names one per
    /// limit that held it).
    pub ticket_charges: usize,
    /// Bytes of one config object written through `Admin.PutConfig`.
    pub config_object_bytes: usize,
    /// A file of the policy directory larger than this is a problem (none of its documents is
    /// read; the last valid policies stay).
    pub policy_file_bytes: usize,
    /// A policy file whose documents expand to more YAML nodes than this, their aliases
    /// followed, is a problem, refused before it is built.
    pub policy_file_nodes: usize,
    /// Requests this replica remembers as routed and not yet reported; past it the oldest is
    /// forgotten, as one unreported for ten minutes is (its reservation stays charged).
    pub in_flight_requests: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            grpc_message_bytes: 20 << 20,
            grpc_streams_per_connection: 1024,
            grpc_header_bytes: 16 << 10,
            route_call_ms: 10_000,
            tags: 32,
            tag_bytes: 128,
            name_bytes: 256,
            headers: 64,
            header_bytes: 8 << 10,
            body_bytes: 16 << 20,
            token_ids: 1 << 18,
            endpoint_subset: 1024,
            ticket_charges: 16,
            config_object_bytes: 1 << 20,
            policy_file_bytes: 4 << 20,
            policy_file_nodes: 1_000_000,
            in_flight_requests: 100_000,
        }
    }
}

/// The names of the bounds, as `kvplane_limit_hits_total{limit}` labels them.
pub const LIMIT_NAMES: &[&str] = &[
    "grpc_message_bytes",
    "route_call_ms",
    "tags",
    "tag_bytes",
    "name_bytes",
    "headers",
    "header_bytes",
    "body_bytes",
    "token_ids",
    "endpoint_subset",
    "ticket_charges",
    "config_object_bytes",
    "in_flight_requests",
    "http_headers",
    "http_header_read_ms",
];

impl Limits {
    /// Every problem with these limits (each must allow something).
    pub fn problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        let sizes = [
            ("grpc_message_bytes", self.grpc_message_bytes, 64 << 10),
            ("tag_bytes", self.tag_bytes, 1),
            ("name_bytes", self.name_bytes, 64),
            ("header_bytes", self.header_bytes, 64),
            ("body_bytes", self.body_bytes, 1024),
            ("config_object_bytes", self.config_object_bytes, 1024),
            ("in_flight_requests", self.in_flight_requests, 1),
            ("tags", self.tags, 1),
            ("headers", self.headers, 1),
            ("token_ids", self.token_ids, 1),
            ("endpoint_subset", self.endpoint_subset, 1),
            ("ticket_charges", self.ticket_charges, 1),
            ("policy_file_bytes", self.policy_file_bytes, 1024),
            ("policy_file_nodes", self.policy_file_nodes, 100),
        ];
        for (name, v, least) in sizes {
            if v < least {
                p.push(format!("limits.{name} must be at least {least}"));
            }
        }
        if self.grpc_streams_per_connection == 0 {
            p.push("limits.grpc_streams_per_connection must be at least 1".into());
        }
        if self.grpc_header_bytes < 1024 {
            p.push("limits.grpc_header_bytes must be at least 1024".into());
        }
        if self.route_call_ms == 0 {
            p.push("limits.route_call_ms must be at least 1".into());
        }
        let largest = self.largest_route();
        if largest > self.grpc_message_bytes {
            p.push(format!(
                "limits.grpc_message_bytes ({}) is below the largest Route request the other limits allow ({largest} bytes: the body, token ids, headers, tags, names and subset at their bounds)",
                self.grpc_message_bytes
            ));
        }
        p
    }

    /// The encoded size of the largest Route request within the field bounds (protobuf's
    /// tags and lengths counted at their widest).
    pub fn largest_route(&self) -> usize {
        let field = |n: usize, bytes: usize| n.saturating_mul(bytes.saturating_add(6));
        [
            field(1, self.body_bytes),
            // A token id is a varint of at most 5 bytes, packed.
            field(1, self.token_ids.saturating_mul(5)),
            // A map entry: its own tag and length, then key and value each with theirs.
            field(self.headers, self.header_bytes.saturating_add(6)),
            field(self.tags, self.tag_bytes),
            field(self.endpoint_subset, self.name_bytes),
            // request id, tenant, model, cache salt
            field(4, self.name_bytes),
            // the numbers and flags
            64,
        ]
        .into_iter()
        .fold(0usize, usize::saturating_add)
    }
}
