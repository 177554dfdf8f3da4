//! The index writer: a thread of its own that applies an entry's index writes while apply goes
//! on with the rest of the entry (the engines' blocks, the digest), the way dynamo-kv-router's
//! `ThreadPoolIndexer` applies events off its caller's thread. Writes reach it in the order
//! apply made them (one channel, one thread), so each index ends an entry exactly as if apply
//! had written it itself; apply waits for the writer at the entry's end, then writes the
//! entry's last writes itself (nothing would overlap them), before it publishes the entry's
//! View. Nothing of it is state: it is never hashed or snapshotted.

use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, channel};

use crate::PoolIndex;
use crate::index::Writes;

type Batch = (Arc<PoolIndex>, Writes);

/// The sending side of the writer thread, started on the first batch.
#[derive(Debug, Default)]
pub(crate) struct IndexWriter {
    thread: Option<(Sender<Batch>, Receiver<Writes>)>,
    /// Batches sent and not yet written back.
    in_flight: usize,
    /// Emptied buffers the thread gave back, for the next batches.
    spare: Vec<Writes>,
}

impl IndexWriter {
    /// An empty buffer (a returned one when there is one: its capacity is kept).
    pub(crate) fn buffer(&mut self) -> Writes {
        self.spare.pop().unwrap_or_default()
    }

    /// Keeps an unused buffer for later.
    pub(crate) fn give_back(&mut self, writes: Writes) {
        self.spare.push(writes);
    }

    /// Has `writes` applied to `index` on the writer thread (here, when no thread runs).
    pub(crate) fn send(&mut self, index: Arc<PoolIndex>, mut writes: Writes) {
        if self.thread.is_none() {
            self.thread = start();
        }
        let Some((to, _)) = &self.thread else {
            index.write(&mut writes);
            self.spare.push(writes);
            return;
        };
        match to.send((index, writes)) {
            Ok(()) => self.in_flight += 1,
            Err(std::sync::mpsc::SendError((index, mut writes))) => {
                // The thread is gone: write here, and start another next time.
                self.thread = None;
                index.write(&mut writes);
                self.spare.push(writes);
            }
        }
    }

    /// Waits until every batch sent is in its index.
    pub(crate) fn wait(&mut self) {
        while self.in_flight > 0 {
            let Some(Ok(w)) = self.thread.as_ref().map(|(_, back)| back.recv()) else {
                // No thread, or it ended (only a panic there ends it with batches in flight).
                self.thread = None;
                self.in_flight = 0;
                return;
            };
            self.in_flight -= 1;
            self.spare.push(w);
        }
    }
}

/// Starts the thread; `None` when the system has no thread to give (apply then writes itself).
fn start() -> Option<(Sender<Batch>, Receiver<Writes>)> {
    let (to, from) = channel::<Batch>();
    let (give_back, back) = channel::<Writes>();
    std::thread::Builder::new()
        .name("kvplane-index-writer".into())
        .spawn(move || {
            // Ends when the state machine drops its sender.
            for (index, mut writes) in from {
                index.write(&mut writes);
                if give_back.send(writes).is_err() {
                    return;
                }
            }
        })
        .ok()?;
    Some((to, back))
}
