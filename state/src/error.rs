//! Errors at the state machine's boundary.

/// A command the state machine refused. The entry still counts as applied (the log moved on);
/// the state is unchanged by the refused part, identically on every replica.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, serde::Serialize, serde::Deserialize)]
pub enum ApplyError {
    #[error("invalid {kind} {name:?}: {reason}")]
    InvalidConfig {
        kind: String,
        name: String,
        reason: String,
    },
    #[error(
        "{kind} {name:?} is owned by {owner}; {by} may not change it (change it through {owner}, \
         or delete it with owner {owner})"
    )]
    Owned {
        kind: String,
        name: String,
        owner: crate::Owner,
        by: crate::Owner,
    },
    #[error("entry index {got} does not follow applied index {applied}")]
    OutOfOrder { applied: u64, got: u64 },
}

impl ApplyError {
    /// Its metric label.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::InvalidConfig { .. } => "invalid_config",
            Self::Owned { .. } => "owned",
            Self::OutOfOrder { .. } => "out_of_order",
        }
    }
}

/// A snapshot that cannot be taken or read back.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("the snapshot's task failed: {0}")]
    Task(String),
    #[error("snapshot payload cannot be encoded: {0}")]
    Encode(#[from] rmp_serde::encode::Error),
    #[error("snapshot is not a kvplane snapshot (bad magic)")]
    BadMagic,
    #[error("snapshot format version {0} is not supported")]
    UnsupportedVersion(u32),
    #[error("snapshot checksum mismatch: the file is damaged")]
    Checksum,
    #[error("snapshot payload cannot be decoded: {0}")]
    Decode(String),
    #[error("snapshot restored to digest {got}, but it recorded {want}")]
    DigestMismatch { want: String, got: String },
    #[error(
        "snapshot holds block {hash:#x} of worker {worker} rank {dp_rank} in no tier, or off the gpu with a sequence hash"
    )]
    BadBlock {
        worker: u64,
        dp_rank: u32,
        hash: u64,
    },
    #[error("snapshot holds blocks of worker {worker} rank {dp_rank}, which is in no pool")]
    OrphanBlocks { worker: u64, dp_rank: u32 },
}
