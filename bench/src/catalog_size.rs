//! Catalog size and apply cost, for `kvplane bench cluster`: the same KV-event stream applied
//! by bare state machines that hold one policy object and that hold many (worker sets and
//! policies with rules and limits), alternately, in one run.

use std::time::Instant;

use anyhow::bail;
use kvplane_state::{Command, ConfigObject, Entry, StateMachine};
use serde::Serialize;

/// Rounds per catalog size (the median is reported).
const ROUNDS: usize = 3;

#[derive(Debug, Serialize)]
pub struct CatalogReport {
    /// Policy objects in the catalog of each measurement.
    pub objects: [usize; 2],
    /// Bare apply rate of the stream with each catalog (median of the rounds).
    pub kv_events_per_s: [f64; 2],
    /// The large catalog's rate as a share of the small one's.
    pub ratio: f64,
}

/// `n` policy objects: worker sets and policies (a rule and a tenant limit each), alternately.
fn catalog(n: usize) -> anyhow::Result<Command> {
    let mut yaml = String::new();
    for i in 0..n {
        if i % 2 == 0 {
            yaml.push_str(&format!(
                "---\napiVersion: kvplane.io/v1alpha1\nkind: InferenceWorkerSet\nmetadata: {{name: ws-{i}}}\nspec: {{model: m-{i}, blockSize: 16}}\n"
            ));
        } else {
            yaml.push_str(&format!(
                "---\napiVersion: kvplane.io/v1alpha1\nkind: InferencePolicy\nmetadata: {{name: p-{i}}}\nspec:\n  appliesToModels: [m-{prev}]\n  rules:\n    - {{name: r, match: {{tags: [t{i}]}}, filter: {{maxQueued: 4}}}}\n  limits:\n    - {{tenant: t{i}, requestsPerMinute: 1000}}\n",
                prev = i - 1
            ));
        }
    }
    let mut docs = kvplane_policy::Documents::default();
    docs.add_file("catalog.yaml", &yaml);
    let (catalog, problems) = docs.check();
    if !problems.is_empty() {
        bail!(
            "the benchmark's catalog has {} problems, the first: {:?}",
            problems.len(),
            problems[0]
        );
    }
    Ok(Command::ConfigApply {
        owner: Some(kvplane_state::Owner::Admin),
        puts: catalog.objects().iter().map(ConfigObject::policy).collect(),
        deletes: Vec::new(),
    })
}

/// Applies the catalog, then times `commands`; returns the seconds and the blocks indexed.
fn timed_apply(catalog: &Command, commands: &[Command]) -> anyhow::Result<(f64, u64)> {
    let mut sm = StateMachine::new();
    let first = sm.apply(&Entry {
        index: 1,
        timestamp_ms: 0,
        command: catalog.clone(),
    })?;
    if let Some(r) = first.rejected {
        bail!("the catalog was refused: {r:?}");
    }
    let t = Instant::now();
    for (i, c) in commands.iter().enumerate() {
        sm.apply(&Entry {
            index: i as u64 + 2,
            timestamp_ms: 0,
            command: c.clone(),
        })?;
    }
    Ok((t.elapsed().as_secs_f64(), sm.indexed_blocks()))
}

/// The stream's bare apply rate with a catalog of one object and one of `large`.
pub fn measure(commands: &[Command], events: u64, large: usize) -> anyhow::Result<CatalogReport> {
    let sizes = [1, large.max(1)];
    let catalogs = [catalog(sizes[0])?, catalog(sizes[1])?];
    let mut seconds = [Vec::new(), Vec::new()];
    let mut blocks = [0, 0];
    for _ in 0..ROUNDS {
        for k in 0..2 {
            let (s, b) = timed_apply(&catalogs[k], commands)?;
            seconds[k].push(s);
            blocks[k] = b;
        }
    }
    if blocks[0] != blocks[1] {
        bail!(
            "the stream indexed {} blocks with one policy object and {} with {large}",
            blocks[0],
            blocks[1]
        );
    }
    let rate = |s: &mut Vec<f64>| {
        s.sort_by(f64::total_cmp);
        events as f64 / s[s.len() / 2].max(1e-9)
    };
    let kv_events_per_s = [rate(&mut seconds[0]), rate(&mut seconds[1])];
    Ok(CatalogReport {
        objects: sizes,
        kv_events_per_s,
        ratio: kv_events_per_s[1] / kv_events_per_s[0].max(1e-9),
    })
}
