//! The node's components as tasks: each runs until the one stop signal, and stopping waits
//! for all of them.

use std::future::Future;

use tokio::sync::watch;
use tokio::task::JoinSet;

/// The running components of a node, by name.
pub(super) struct Tasks {
    stop: watch::Sender<bool>,
    set: JoinSet<&'static str>,
}

impl Tasks {
    pub(super) fn new() -> Self {
        Self {
            stop: watch::channel(false).0,
            set: JoinSet::new(),
        }
    }

    /// Runs the component `start` makes of the stop signal (it must end soon after the
    /// signal) as `name`.
    pub(super) fn spawn<F>(
        &mut self,
        name: &'static str,
        start: impl FnOnce(watch::Receiver<bool>) -> F,
    ) where
        F: Future<Output = ()> + Send + 'static,
    {
        let component = start(self.stop.subscribe());
        self.set.spawn(async move {
            component.await;
            name
        });
    }

    /// Signals every component to stop and waits until all have.
    pub(super) async fn stop(mut self) {
        let _ = self.stop.send(true);
        while let Some(done) = self.set.join_next().await {
            match done {
                Ok(name) => tracing::debug!(component = name, "stopped"),
                Err(e) => tracing::error!(error = %e, "a component failed"),
            }
        }
    }
}
