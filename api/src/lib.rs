//! kvplane's routing service over the local state: Route, Explain, ReportUsage and Status.
//!
//! Every decision runs the one pipeline in [`pipeline`] (prompt, resolve, classify, rule,
//! signals, filter, score, pick, admit, answer) over a [`kvplane_state::View`]; the gRPC
//! services wrap it with metrics and the bookkeeping of requests in flight.

pub mod access;
mod admin;
mod consistency;
mod cost;
pub mod learn;
pub mod limits;
mod metrics;
pub mod picker;
pub mod pipeline;
pub mod placed;
pub mod predict;
mod quota;
mod quota_metrics;
mod quota_refill;
mod router;
pub mod rtt;
mod tokenizers;
mod trace;
mod usage;
mod usage_forward;

pub use access::{Access, AccessLayer, AccessMetrics, Caller};
pub use admin::{AdminService, ClusterControl, ClusterError, IngestStatus, NodeInfo};
pub use consistency::{Consistency, propose_status};
pub use cost::CostModel;
pub use limits::{Limits, LimitsLayer};
pub use metrics::ApiMetrics;
pub use picker::{EndpointPicker, PickerConfig};
pub use pipeline::{Decision, Outcome, Prompted, Reject};
pub use quota::{Escrow, QuotaConfig, Refusal, Reservation, wall_ms};
pub use quota_metrics::QuotaMetrics;
pub use quota_refill::run_refiller;
pub use router::RouterService;
pub use tokenizers::{Tokenizers, run_loader as run_tokenizer_loader};
