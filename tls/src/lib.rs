//! TLS for kvplane's gRPC port (the API, the endpoint picker and members' Raft RPCs) and for
//! every process that calls it: members, gateways and the CLI.
//!
//! - [`TlsSection`]: a process's CA, certificate and key files.
//! - [`Tls`]: the rustls configurations they give, read again when the files change.
//! - [`incoming`]: a listener's connections, each carrying the caller's [`Peer`] (its
//!   certificate's [`Identity`]) into every request's extensions.
//! - [`serve_http`]: an HTTP/1.1 listener (the gateway, metrics and probes) with TLS and
//!   bounds on what a client sends before its request is read.
//! - [`Dialer`]: channels to a kvplane address, TLS when the process has a section.

#[cfg(feature = "dev-ca")]
pub mod dev_ca;
mod dial;
mod http;
mod identity;
mod incoming;
mod material;
mod reload;
mod section;

pub use dial::{Dialer, connection_refused};
pub use http::{HttpSection, OnLimit, serve_http};
pub use identity::{Identity, Peer};
pub use incoming::{Conn, incoming};
pub use material::{ServerCheck, TlsError};
pub use reload::{Tls, TlsMetrics};
pub use section::TlsSection;
