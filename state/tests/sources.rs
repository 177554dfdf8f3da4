//! Ingest sources keep positions of their own: a message is applied when its sequence is past
//! its own source's position, whatever other sources have applied, and a snapshot keeps every
//! position. Checked against a reference model (a plain map of positions and a set of applied
//! messages) on random interleavings of batches, replays included.

#![allow(clippy::unwrap_used)]

mod support;

use std::collections::{BTreeMap, BTreeSet};

use kvplane_state::{
    Command, Entry, IngestBatch, IngestItem, IngestPayload, KvBatch, KvEvent, Source, StateMachine,
    Tier,
};
use proptest::prelude::*;

const SOURCES: [&str; 3] = ["", "cluster-b", "dialect-c"];

/// Message `seq` of source `s`: one root block of its own on the source's worker.
fn item(s: usize, seq: u64) -> IngestItem {
    let first = u32::try_from(s * 1000).unwrap() + u32::try_from(seq).unwrap();
    IngestItem {
        seq,
        pool: "p".into(),
        worker: format!("w{s}"),
        payload: IngestPayload::Kv(KvBatch {
            dp_rank: 0,
            events: vec![KvEvent::Stored {
                block_hashes: vec![((s as u64 + 1) << 32) | seq],
                parent_hash: None,
                token_ids: vec![first, 1, 2, 3],
                block_size: 4,
                lora_name: None,
                cache_salt: None,
                tier: Tier::Gpu,
            }],
        }),
    }
}

fn entry(index: u64, command: Command) -> Entry {
    Entry {
        index,
        timestamp_ms: index,
        command,
    }
}

/// Batches as (source, first sequence, length).
fn entries(batches: &[(usize, u64, u64)]) -> Vec<Entry> {
    let mut out = vec![entry(1, support::pool("p", 4))];
    for (i, &(s, first, len)) in batches.iter().enumerate() {
        out.push(entry(
            i as u64 + 2,
            Command::Ingest(IngestBatch {
                source: Source::named(SOURCES[s]),
                first_seq: first,
                last_seq: first + len - 1,
                items: (first..first + len).map(|seq| item(s, seq)).collect(),
            }),
        ));
    }
    out
}

/// What the state should hold: each source's position, its applied messages, the duplicates.
#[derive(Default)]
struct Model {
    positions: BTreeMap<usize, u64>,
    applied: BTreeSet<(usize, u64)>,
    duplicates: u64,
}

impl Model {
    fn apply(&mut self, &(s, first, len): &(usize, u64, u64)) {
        let at = self.positions.get(&s).copied().unwrap_or(0);
        for seq in first..first + len {
            if seq <= at {
                self.duplicates += 1;
            } else {
                self.applied.insert((s, seq));
            }
        }
        self.positions.insert(s, at.max(first + len - 1));
    }
}

fn check(sm: &StateMachine, model: &Model) -> Result<(), TestCaseError> {
    let view = sm.handle().load();
    for (s, name) in SOURCES.iter().enumerate() {
        let want = model.positions.get(&s).copied().unwrap_or(0);
        prop_assert_eq!(
            sm.position(&Source::named(*name)),
            want,
            "source {:?}",
            name
        );
        let blocks = view
            .workers()
            .find(|w| *w.name == format!("w{s}"))
            .map_or(0, |w| w.indexed_blocks);
        let applied = model.applied.iter().filter(|(m, _)| *m == s).count() as u64;
        prop_assert_eq!(blocks, applied, "messages of {:?} applied", name);
    }
    prop_assert_eq!(
        view.last_stream_seq,
        model.positions.get(&0).copied().unwrap_or(0)
    );
    prop_assert_eq!(
        view.dropped.get("duplicate").copied().unwrap_or(0),
        model.duplicates
    );
    Ok(())
}

fn batch() -> impl Strategy<Value = (usize, u64, u64)> {
    (0..SOURCES.len(), 1u64..30, 1u64..5)
}

proptest! {
    #[test]
    fn each_source_applies_past_its_own_position_as_the_model_says(
        batches in prop::collection::vec(batch(), 1..60),
    ) {
        let mut sm = StateMachine::new();
        let mut model = Model::default();
        let es = entries(&batches);
        sm.apply(&es[0]).unwrap();
        for (e, b) in es[1..].iter().zip(&batches) {
            sm.apply(e).unwrap();
            model.apply(b);
            check(&sm, &model)?;
            prop_assert_eq!(sm.handle().load().digest, sm.digest());
        }
    }

    #[test]
    fn a_snapshot_keeps_every_sources_position(
        batches in prop::collection::vec(batch(), 1..60),
        at in 0.0..1.0f64,
    ) {
        let es = entries(&batches);
        let k = 1 + ((batches.len() as f64) * at) as usize;
        let mut original = StateMachine::new();
        let mut model = Model::default();
        for (i, e) in es[..k].iter().enumerate() {
            original.apply(e).unwrap();
            if i > 0 {
                model.apply(&batches[i - 1]);
            }
        }
        let mut restored = StateMachine::restore(&original.snapshot().unwrap()).unwrap();
        prop_assert_eq!(restored.digest(), original.digest());
        for (e, b) in es[k..].iter().zip(&batches[k - 1..]) {
            original.apply(e).unwrap();
            restored.apply(e).unwrap();
            model.apply(b);
        }
        check(&restored, &model)?;
        prop_assert_eq!(restored.digest(), original.digest());
    }
}
