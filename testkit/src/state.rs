//! A fleet in a state, for in-process tests: a real `StateMachine` fed the entries ingest
//! would commit (policies, worker announcements, metrics, KV events), and the real
//! `RouterService` over it. No hand-written fleet: a decision reads the same state and
//! predictor a node does, in microseconds.

#![allow(clippy::unwrap_used, clippy::panic)]

use std::sync::Arc;

use kvplane_api::{CostModel, RouterService};
use kvplane_policy::Documents;
use kvplane_state::{
    Command, ConfigObject, Entry, IngestBatch, IngestItem, IngestPayload, KvBatch, KvEvent,
    StateMachine, Tier, WorkerMetrics,
};

/// A state built entry by entry, the way a node's log would build it.
pub struct TestFleet {
    pub sm: StateMachine,
    seq: u64,
    now_ms: u64,
    next_hash: u64,
}

impl TestFleet {
    pub fn new() -> Self {
        Self {
            sm: StateMachine::new(),
            seq: 0,
            now_ms: 1_000,
            next_hash: 1,
        }
    }

    /// A fleet under the policies of `dir` (as `kvplane validate` reads them).
    pub fn with_policies(dir: &str) -> Self {
        Self::with_documents(Documents::read(&[dir.into()]).unwrap())
    }

    /// The policies in `dir`, with `workers` up in every worker set.
    pub fn with_policies_up(dir: &str, workers: &[&str]) -> Self {
        let mut f = Self::with_policies(dir);
        let sets: Vec<String> =
            f.sm.handle()
                .load()
                .catalog
                .worker_sets
                .keys()
                .cloned()
                .collect();
        for s in &sets {
            f.up(s, workers);
        }
        f
    }

    /// A fleet under these policy documents (YAML).
    pub fn with_yaml(yaml: &str) -> Self {
        let mut docs = Documents::default();
        docs.add_file("test.yaml", yaml);
        Self::with_documents(docs)
    }

    /// A fleet whose state holds `docs`, checked as `kvplane validate` checks them.
    fn with_documents(docs: Documents) -> Self {
        let (catalog, problems) = docs.check();
        assert!(problems.is_empty(), "{problems:#?}");
        let mut f = Self::new();
        f.command(Command::ConfigApply {
            owner: Some(kvplane_state::Owner::Admin),
            puts: catalog.objects().iter().map(ConfigObject::policy).collect(),
            deletes: Vec::new(),
        });
        f
    }

    /// Stamps the next entries with this proposer time (the clock the state reads).
    pub fn at(&mut self, ms: u64) -> &mut Self {
        self.now_ms = ms;
        self
    }

    /// Applies `command`; panics when the state refuses it.
    pub fn command(&mut self, command: Command) -> &mut Self {
        let index = self.sm.applied_index() + 1;
        let applied = self
            .sm
            .apply(&Entry {
                index,
                timestamp_ms: self.now_ms,
                command,
            })
            .unwrap();
        assert!(applied.rejected.is_none(), "{:?}", applied.rejected);
        self
    }

    /// Applies one entry of stream messages, as ingest commits them.
    fn ingest(&mut self, items: Vec<(String, String, IngestPayload)>) -> &mut Self {
        let items: Vec<IngestItem> = items
            .into_iter()
            .map(|(pool, worker, payload)| {
                self.seq += 1;
                IngestItem {
                    seq: self.seq,
                    pool,
                    worker,
                    payload,
                }
            })
            .collect();
        let batch = IngestBatch {
            source: Default::default(),
            first_seq: items[0].seq,
            last_seq: items[items.len() - 1].seq,
            items,
        };
        self.command(Command::Ingest(batch))
    }

    /// Announces workers of `set` up, at `http://<worker>:8000`.
    pub fn up(&mut self, set: &str, workers: &[&str]) -> &mut Self {
        let items = workers
            .iter()
            .map(|w| {
                (
                    set.to_owned(),
                    (*w).to_owned(),
                    IngestPayload::Worker {
                        up: true,
                        address: Some(format!("http://{w}:8000")),
                    },
                )
            })
            .collect();
        self.ingest(items)
    }

    pub fn down(&mut self, set: &str, worker: &str) -> &mut Self {
        self.ingest(vec![(
            set.into(),
            worker.into(),
            IngestPayload::Worker {
                up: false,
                address: None,
            },
        )])
    }

    /// An engine metrics sample of `worker`.
    pub fn load(
        &mut self,
        set: &str,
        worker: &str,
        waiting: u32,
        kv_cache_usage: f64,
    ) -> &mut Self {
        self.ingest(vec![(
            set.into(),
            worker.into(),
            IngestPayload::Metrics(WorkerMetrics {
                waiting,
                kv_cache_usage,
                ..WorkerMetrics::default()
            }),
        )])
    }

    /// An engine metrics sample of `worker`, whole (its TTFT histogram, say).
    pub fn sample(&mut self, set: &str, worker: &str, metrics: WorkerMetrics) -> &mut Self {
        self.ingest(vec![(
            set.into(),
            worker.into(),
            IngestPayload::Metrics(metrics),
        )])
    }

    /// `worker` caches `tokens` (whole blocks of `block_size`), under `lora` and `salt`, as the
    /// leader proposes an engine's store.
    pub fn caches(
        &mut self,
        set: &str,
        worker: &str,
        tokens: &[u32],
        block_size: u32,
        lora: Option<&str>,
        salt: Option<&str>,
    ) -> &mut Self {
        let blocks = tokens.len() / block_size as usize;
        let hashes: Vec<u64> = (0..blocks)
            .map(|_| {
                self.next_hash += 1;
                self.next_hash
            })
            .collect();
        let ev = KvEvent::Stored {
            block_hashes: hashes,
            parent_hash: None,
            token_ids: tokens[..blocks * block_size as usize].to_vec(),
            block_size,
            lora_name: lora.map(str::to_owned),
            cache_salt: salt.map(str::to_owned),
            tier: Tier::Gpu,
        }
        // As the leader proposes it.
        .compact();
        self.ingest(vec![(
            set.into(),
            worker.into(),
            IngestPayload::Kv(KvBatch {
                dp_rank: 0,
                events: vec![ev],
            }),
        )])
    }

    /// The real routing service over this state (wall-clock predictor).
    pub fn service(&self) -> RouterService {
        RouterService::new(self.sm.handle(), CostModel::default(), Arc::default())
    }

    /// The same service with its predictor's clock stopped at the current time, for tests that
    /// compare two answers: a queue's remaining time shrinks as the wall clock runs.
    pub fn service_with_stopped_clock(&self) -> RouterService {
        let now = kvplane_api::predict::wall_clock()();
        let clock: kvplane_api::predict::Clock = Arc::new(move || now);
        self.service()
            .with_predictor(Arc::new(kvplane_api::predict::Predictor::new(clock)))
    }
}

/// `n` distinct prompt tokens starting at `seed * 10_000`.
pub fn tokens(seed: u32, n: u32) -> Vec<u32> {
    (0..n).map(|i| seed * 10_000 + i + 1).collect()
}

impl Default for TestFleet {
    fn default() -> Self {
        Self::new()
    }
}
