//! Requests routed by this node and not yet reported, for ReportUsage.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// What this node remembers about a routed request.
#[derive(Debug, Clone)]
pub(crate) struct Routed {
    /// `pool/worker`, or `provider:name`.
    pub(crate) target: String,
    pub(crate) predicted_ttft_ms: f64,
    pub(crate) at: Instant,
    /// What tenant limits hold for it until its usage is reported. An unreported request
    /// stays charged at its reservation (the entry expires after `ttl`).
    pub(crate) reservations: Vec<crate::Reservation>,
    /// (worker set, worker) when it went to a worker through the policies.
    pub(crate) worker: Option<(String, String)>,
}

/// A bounded table of requests in flight. Entries older than `ttl` are dropped when the table
/// is full, so an unreported request cannot pin memory.
#[derive(Debug)]
pub(crate) struct UsageBook {
    inner: Mutex<HashMap<String, Routed>>,
    capacity: usize,
    ttl: Duration,
}

impl UsageBook {
    pub(crate) fn new(capacity: usize, ttl: Duration) -> Self {
        Self {
            inner: Mutex::new(HashMap::new()),
            capacity,
            ttl,
        }
    }

    pub(crate) fn insert(&self, request_id: &str, routed: Routed) {
        if request_id.is_empty() {
            return;
        }
        let mut map = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if map.len() >= self.capacity {
            let ttl = self.ttl;
            map.retain(|_, r| r.at.elapsed() < ttl);
            if map.len() >= self.capacity {
                // Still full of fresh entries: forget the oldest.
                if let Some(oldest) = map.iter().min_by_key(|(_, r)| r.at).map(|(k, _)| k.clone()) {
                    map.remove(&oldest);
                }
            }
        }
        map.insert(request_id.to_owned(), routed);
    }

    pub(crate) fn take(&self, request_id: &str) -> Option<Routed> {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(request_id)
    }
}
