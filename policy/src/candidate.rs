//! What a decision considers: workers of worker sets and providers, the signals read for each,
//! and what the filters and the objective made of them.
//!
//! A candidate borrows its names from the state it was built from (`'v`: the view and its
//! catalog): a decision over 64 workers copies no string and counts no reference.

/// One worker of a worker set as the replicated state shows it, with this prompt's overlap.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerState<'v> {
    /// The view's worker record's.
    pub worker: &'v str,
    pub address: Option<&'v str>,
    pub up: bool,
    pub dp_rank: u32,
    pub waiting: u32,
    pub running: u32,
    pub kv_cache_usage: f64,
    /// The prompt's blocks this worker caches, consecutively from the first (0 when the
    /// decision did not look the prompt up: no filter or objective asked for it).
    pub overlap_blocks: u32,
    pub prompt_blocks: u32,
    /// Requests this replica sent here that have not had their first token yet (counted in
    /// `waiting` too), and how long until the last of them is predicted to have it.
    pub pending: u32,
    pub pending_ms: f64,
    /// The engine model this replica learned for the worker from its first tokens (its terms:
    /// per step, per thousand uncached prompt tokens, per running and per other waiting
    /// request, in ms), when it has one; else the configured cost model is calibrated.
    pub learned: Option<[f64; 4]>,
    /// When a request was last routed here, by this replica or (as they told it) another,
    /// in ms since the epoch; 0 if never.
    pub last_routed_ms: u64,
}

/// Which per-candidate inputs a filter or objective reads; the others are not computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Signals {
    /// The prompt's cached prefix on each worker (a prefix-index lookup per worker set).
    pub overlap: bool,
    /// The predicted time to first token (needs `overlap`).
    pub prediction: bool,
}

impl Signals {
    pub const NONE: Signals = Signals {
        overlap: false,
        prediction: false,
    };
    pub const ALL: Signals = Signals {
        overlap: true,
        prediction: true,
    };

    pub fn union(self, o: Signals) -> Signals {
        Signals {
            overlap: self.overlap || o.overlap || self.prediction || o.prediction,
            prediction: self.prediction || o.prediction,
        }
    }
}

/// A prediction and its parts, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Prediction {
    /// Predicted time to first token.
    pub ttft_ms: f64,
    /// Of it: the prompt's uncached prefill there, calibrated.
    pub prefill_ms: f64,
    /// Of it: the queue ahead and the running batch, calibrated.
    pub load_ms: f64,
    /// What the request's prefill would delay the requests after it there.
    pub displaced_ms: f64,
    /// Not of it: the round trip from the asking gateway's cluster to the target's (see
    /// [`crate::locality`]), which the client waits for besides the engine's time.
    pub network_ms: f64,
    /// What the worker's own time was predicted from: 1 (a step), uncached prompt tokens in
    /// thousands, requests running there, requests waiting there that this replica did not
    /// route (what a first token's report teaches the engine model).
    pub inputs: [f64; 4],
}

#[derive(Debug, Clone, PartialEq)]
pub enum Target<'v> {
    Worker {
        /// The catalog's name of the set.
        worker_set: &'v str,
        state: WorkerState<'v>,
    },
    Provider {
        name: &'v str,
        endpoint: &'v str,
    },
}

/// `worker_set/worker` or `provider:name`.
pub fn target_name(t: &Target) -> String {
    match t {
        Target::Worker { worker_set, state } => format!("{worker_set}/{}", state.worker),
        Target::Provider { name, .. } => format!("provider:{name}"),
    }
}

/// The filter that removed a candidate: its metric label (see [`crate::filters`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FilterId(pub &'static str);

impl std::fmt::Display for FilterId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

/// Why a candidate was filtered out: the filter, and its words (written only when the
/// decision keeps words: Explain; empty otherwise).
#[derive(Debug, Clone, PartialEq)]
pub struct Filtered {
    pub by: FilterId,
    pub text: String,
}

/// One candidate and what the decision made of it. The model it serves the request as is the
/// decision's to look up for the one it picks ([`crate::Catalog::model_of`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate<'v> {
    pub target: Target<'v>,
    pub external: bool,
    /// The prediction (zero parts when no filter or objective asked for it).
    pub prediction: Prediction,
    /// Token price of this request on it.
    pub price: f64,
    pub load: u32,
    /// The backend weight the objective is divided by.
    pub weight: f64,
    pub objective: f64,
    /// Why it was filtered out; `None` when it survived.
    pub filtered: Option<Filtered>,
    pub fallback: bool,
    pub chosen: bool,
}

impl<'v> Candidate<'v> {
    pub fn predicted_ttft_ms(&self) -> f64 {
        self.prediction.ttft_ms
    }

    /// The time to first token the asking client is predicted to see: the engine's, and the
    /// network between them.
    pub fn client_ttft_ms(&self) -> f64 {
        self.prediction.ttft_ms + self.prediction.network_ms
    }

    pub fn worker(&self) -> Option<(&'v str, &WorkerState<'v>)> {
        match &self.target {
            Target::Worker { worker_set, state } => Some((*worker_set, state)),
            Target::Provider { .. } => None,
        }
    }
}

/// Why no candidate was picked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RejectKind {
    /// No backend publishes and no worker set serves the model.
    UnknownModel,
    /// The model is known but has no worker that is up.
    NoCapacity,
    /// A rule's filter (and its fallback) left nothing, and the rule rejects.
    Policy,
}

impl RejectKind {
    /// Its metric label.
    pub fn label(self) -> &'static str {
        match self {
            Self::UnknownModel => "unknown_model",
            Self::NoCapacity => "no_capacity",
            Self::Policy => "policy",
        }
    }
}

/// The live fleet, as the caller (the routing service) sees it: `'v` is the state its
/// workers' names are borrowed from.
pub trait Fleet<'v> {
    /// Appends every worker of `worker_set` to `out`, in a stable order; the prompt's cached
    /// prefix on each only when `signals.overlap`.
    fn workers(&self, worker_set: &str, signals: Signals, out: &mut Vec<WorkerState<'v>>);
    /// The predicted time to first token on `w` of worker set `name`, and its parts.
    fn predict(
        &self,
        name: &str,
        set: &crate::kinds::InferenceWorkerSetSpec,
        w: &WorkerState<'v>,
    ) -> Prediction;
}

/// An up worker of set `ws` named `w` with nothing known of it, for tests.
#[cfg(test)]
pub(crate) fn test_worker(state: impl FnOnce(&mut WorkerState<'static>)) -> Candidate<'static> {
    let mut s = WorkerState {
        worker: "w",
        address: None,
        up: true,
        dp_rank: 0,
        waiting: 0,
        running: 0,
        kv_cache_usage: 0.0,
        overlap_blocks: 0,
        prompt_blocks: 0,
        pending: 0,
        pending_ms: 0.0,
        learned: None,
        last_routed_ms: 0,
    };
    state(&mut s);
    Candidate {
        target: Target::Worker {
            worker_set: "ws",
            state: s,
        },
        external: false,
        prediction: Prediction::default(),
        price: 0.0,
        load: 0,
        weight: 1.0,
        objective: 0.0,
        filtered: None,
        fallback: false,
        chosen: false,
    }
}
