//! Grant entries for `kvplane bench cluster`: the escrow ledger's traffic, as replicas' refillers
//! send it (each entry one replica's batch of asks for several tenants).

use kvplane_policy::kinds::{InferencePolicySpec, TenantLimit};
use kvplane_policy::{LimitKey, Object, Spec};
use kvplane_state::{Command, ConfigObject, QuotaAsk, QuotaBatch};
use serde::Serialize;

#[derive(Debug, Clone, clap::Args)]
pub struct GrantArgs {
    /// Grant entries to commit after the KV-event stream.
    #[arg(long, default_value_t = 2_000)]
    pub grant_entries: u64,
    /// Tenants with a limit; each entry asks for `asks_per_entry` of them.
    #[arg(long, default_value_t = 64)]
    pub tenants: u64,
    #[arg(long, default_value_t = 8)]
    pub asks_per_entry: u64,
}

#[derive(Debug, Serialize)]
pub struct GrantReport {
    pub entries: u64,
    pub asks_per_entry: u64,
    pub tenants: u64,
    pub single_node_entries_per_s: f64,
    pub cluster_entries_per_s: f64,
    pub cluster_asks_per_s: f64,
}

/// The limits entry, then `grant_entries` batches from three replicas in turn.
pub fn workload(a: &GrantArgs) -> Vec<Command> {
    let limits = (0..a.tenants)
        .map(|t| TenantLimit {
            tenant: format!("tenant-{t}"),
            model: None,
            tokens_per_minute: Some(1_000_000_000),
            requests_per_minute: None,
            burst: Some(10_000),
            window_seconds: 60,
            fail_open_tokens_per_minute: None,
        })
        .collect();
    let policy = ConfigObject::policy(&Object {
        name: "bench-tenants".into(),
        spec: Spec::Policy(InferencePolicySpec {
            applies_to_models: vec![],
            rules: Vec::new(),
            limits,
        }),
    });
    let mut out = vec![Command::ConfigApply {
        owner: Some(kvplane_state::Owner::Admin),
        puts: vec![policy],
        deletes: Vec::new(),
    }];
    for i in 0..a.grant_entries {
        out.push(Command::Quota(QuotaBatch {
            replica: i % 3 + 1,
            incarnation: 1,
            seq: i / 3 + 1,
            asks: (0..a.asks_per_entry)
                .map(|k| QuotaAsk {
                    key: LimitKey {
                        tenant: format!("tenant-{}", (i * a.asks_per_entry + k) % a.tenants.max(1)),
                        model: String::new(),
                        provider: String::new(),
                    },
                    tokens: 10_000,
                    requests: 0,
                })
                .collect(),
            releases: Vec::new(),
            settles: Vec::new(),
        }));
    }
    out
}
