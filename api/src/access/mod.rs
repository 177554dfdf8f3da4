//! Who may do what on the gRPC port: each call's caller ([`Caller`], from the identity of its
//! client certificate) checked against the right its method needs, before the method runs;
//! `route`'s tenants checked once the pipeline knows the request's tenant.
//!
//! Without TLS the port has no identities: every caller may do everything ([`Caller::Unchecked`]).
//! With TLS: members (by identity, default the node's own) and the node's configured
//! administrators hold every right; anyone else holds what the `AccessPolicy` objects of the
//! replicated state grant its identity; a caller without a certificate holds nothing.

mod caller;
mod check;
mod layer;
mod needs;

pub use caller::{Caller, explain};
pub use check::{Access, AccessMetrics, ON_BEHALF_OF, check_access_write};
pub use layer::{AccessLayer, Checked};
pub use needs::{Needs, needs};
