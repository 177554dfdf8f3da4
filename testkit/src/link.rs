//! A network link a test can cut: a TCP relay on a free loopback port in front of a server.
//! Cut, it ends every connection through it and takes new ones only to drop them, as a lost
//! WAN link between clusters would look to both ends; healed, it relays again.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// A relay from its own port to `127.0.0.1:<upstream>`; stopped when dropped.
pub struct Link {
    pub port: u16,
    cut: Arc<AtomicBool>,
    relays: Arc<Mutex<Vec<JoinHandle<()>>>>,
    accept: JoinHandle<()>,
}

impl Link {
    pub async fn start(upstream: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap_or_else(|e| panic!("link: no port: {e}"));
        let port = listener
            .local_addr()
            .unwrap_or_else(|e| panic!("link: {e}"))
            .port();
        let cut = Arc::new(AtomicBool::new(false));
        let relays: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let (c, r) = (cut.clone(), relays.clone());
        let accept = tokio::spawn(async move {
            while let Ok((mut near, _)) = listener.accept().await {
                if c.load(Ordering::SeqCst) {
                    continue;
                }
                let relay = tokio::spawn(async move {
                    if let Ok(mut far) = TcpStream::connect(("127.0.0.1", upstream)).await {
                        let _ = tokio::io::copy_bidirectional(&mut near, &mut far).await;
                    }
                });
                if let Ok(mut list) = r.lock() {
                    list.retain(|h| !h.is_finished());
                    list.push(relay);
                }
            }
        });
        Self {
            port,
            cut,
            relays,
            accept,
        }
    }

    /// Ends every connection through the link and drops new ones until [`Self::heal`].
    pub fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
        if let Ok(mut list) = self.relays.lock() {
            for relay in list.drain(..) {
                relay.abort();
            }
        }
    }

    pub fn heal(&self) {
        self.cut.store(false, Ordering::SeqCst);
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.cut();
        self.accept.abort();
    }
}
