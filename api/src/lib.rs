//! kvplane's routing service over the local state: Route, Explain, ReportUsage and Status.
//!
//! The decision itself ([`decide`]) is a pure function of a [`kvplane_state::View`], the
//! prompt and the [`CostModel`]; the gRPC services wrap it with tokenization, metrics and
//! the bookkeeping of requests in flight.

mod admin;
mod consistency;
mod cost;
mod decide;
mod metrics;
mod policy_route;
pub mod predict;
mod quota;
mod quota_metrics;
mod quota_refill;
mod router;
mod tokenizers;
mod trace;
mod usage;

pub use admin::{AdminService, ClusterControl, ClusterError, IngestStatus, NodeInfo};
pub use consistency::{Consistency, propose_status};
pub use cost::CostModel;
pub use decide::{Candidate, Decision, RejectKind, RouteInput, decide};
pub use metrics::ApiMetrics;
pub use quota::{Escrow, QuotaConfig, Refusal, Reservation};
pub use quota_metrics::QuotaMetrics;
pub use quota_refill::run_refiller;
pub use router::{Prompted, RouterService};
pub use tokenizers::{Tokenizers, run_loader as run_tokenizer_loader};
