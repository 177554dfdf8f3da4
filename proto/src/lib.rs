//! kvplane's gRPC API (`kvplane.v1`): generated types, clients and server traits.
//!
//! This crate holds no I/O: it is what a gateway links to talk to kvplane ([`front`]: what
//! every front reads the same way from the requests it routes and the answers it relays).

pub mod front;

#[allow(clippy::all, missing_docs)]
pub mod v1 {
    tonic::include_proto!("kvplane.v1");
}

/// The encoded file descriptor set, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("kvplane_descriptor");
