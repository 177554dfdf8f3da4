//! A network link a test can cut: a TCP relay on a free loopback port in front of a server.
//! Cut, it ends every connection through it and takes new ones only to drop them, as a lost
//! WAN link between clusters would look to both ends; healed, it relays again. It may also
//! delay every byte by a fixed time each way, as a WAN link between clusters does, or swallow
//! every byte while keeping its connections open, as a link that fails without a word does.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio::time::{Duration, Instant};

/// A relay from its own port to `127.0.0.1:<upstream>`; stopped when dropped.
pub struct Link {
    pub port: u16,
    cut: Arc<AtomicBool>,
    /// Bytes read are dropped, not passed on; `swallowed` counts them.
    swallow: Arc<AtomicBool>,
    swallowed: Arc<AtomicU64>,
    relays: Arc<Mutex<Vec<JoinHandle<()>>>>,
    accept: JoinHandle<()>,
}

impl Link {
    pub async fn start(upstream: u16) -> Self {
        Self::start_delayed(upstream, Duration::ZERO).await
    }

    /// A link that holds every byte `one_way` before passing it on, in each direction (so a
    /// round trip through it takes twice that), in order.
    pub async fn start_delayed(upstream: u16, one_way: Duration) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap_or_else(|e| panic!("link: no port: {e}"));
        let port = listener
            .local_addr()
            .unwrap_or_else(|e| panic!("link: {e}"))
            .port();
        let cut = Arc::new(AtomicBool::new(false));
        let swallow = Arc::new(AtomicBool::new(false));
        let swallowed = Arc::new(AtomicU64::new(0));
        let relays: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let (c, r) = (cut.clone(), relays.clone());
        let sw = Swallow {
            on: swallow.clone(),
            count: swallowed.clone(),
        };
        let accept = tokio::spawn(async move {
            while let Ok((near, _)) = listener.accept().await {
                if c.load(Ordering::SeqCst) {
                    continue;
                }
                let sw = sw.clone();
                let relay = tokio::spawn(async move {
                    if let Ok(far) = TcpStream::connect(("127.0.0.1", upstream)).await {
                        let _ = near.set_nodelay(true);
                        let _ = far.set_nodelay(true);
                        let (nr, nw) = near.into_split();
                        let (fr, fw) = far.into_split();
                        tokio::join!(
                            delayed(nr, fw, one_way, sw.clone()),
                            delayed(fr, nw, one_way, sw)
                        );
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
            swallow,
            swallowed,
            relays,
            accept,
        }
    }

    /// Ends every connection through the link and drops new ones until [`Self::heal`].
    pub fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
        self.swallow.store(false, Ordering::SeqCst);
        if let Ok(mut list) = self.relays.lock() {
            for relay in list.drain(..) {
                relay.abort();
            }
        }
    }

    /// Keeps every connection open but drops every byte, either way, until [`Self::cut`] or
    /// [`Self::heal`]: neither end learns that what it sent is lost.
    pub fn swallow(&self) {
        self.swallow.store(true, Ordering::SeqCst);
    }

    /// Bytes dropped by [`Self::swallow`] so far.
    pub fn swallowed(&self) -> u64 {
        self.swallowed.load(Ordering::SeqCst)
    }

    pub fn heal(&self) {
        self.cut.store(false, Ordering::SeqCst);
        self.swallow.store(false, Ordering::SeqCst);
    }
}

/// Whether a link drops what it reads, and how much it dropped.
#[derive(Clone)]
struct Swallow {
    on: Arc<AtomicBool>,
    count: Arc<AtomicU64>,
}

/// Copies `from` to `to`, each chunk `delay` after it was read (dropped while `swallow` holds);
/// ends when either side does.
async fn delayed(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    delay: Duration,
    swallow: Swallow,
) {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let read = async move {
        let mut buf = vec![0u8; 64 * 1024];
        while let Ok(n) = from.read(&mut buf).await {
            if n == 0 {
                break;
            }
            if swallow.on.load(Ordering::SeqCst) {
                swallow.count.fetch_add(n as u64, Ordering::SeqCst);
                continue;
            }
            if tx
                .send((Instant::now() + delay, buf[..n].to_vec()))
                .is_err()
            {
                break;
            }
        }
    };
    let write = async move {
        while let Some((due, chunk)) = rx.recv().await {
            tokio::time::sleep_until(due).await;
            if to.write_all(&chunk).await.is_err() {
                break;
            }
        }
        let _ = to.shutdown().await;
    };
    tokio::join!(read, write);
}

impl Drop for Link {
    fn drop(&mut self) {
        self.cut();
        self.accept.abort();
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// A server that sends back what it reads, on one connection; its port.
    async fn echo_server() -> u16 {
        let server = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = server.local_addr().unwrap().port();
        tokio::spawn(async move {
            let (mut s, _) = server.accept().await.unwrap();
            let (mut r, mut w) = s.split();
            let _ = tokio::io::copy(&mut r, &mut w).await;
        });
        port
    }

    /// An echo server behind a delayed link: what is sent comes back whole and in order, no
    /// sooner than the link's round trip.
    #[tokio::test]
    async fn a_delayed_link_holds_each_direction_and_keeps_the_order() {
        let port = echo_server().await;
        let link = Link::start_delayed(port, Duration::from_millis(30)).await;
        let mut c = TcpStream::connect(("127.0.0.1", link.port)).await.unwrap();
        let sent: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let started = Instant::now();
        let (mut r, mut w) = c.split();
        let write = async {
            w.write_all(&sent).await.unwrap();
        };
        let mut got = vec![0u8; sent.len()];
        let read = async {
            r.read_exact(&mut got).await.unwrap();
        };
        tokio::join!(write, read);
        assert!(started.elapsed() >= Duration::from_millis(60));
        assert_eq!(got, sent);
    }

    /// A swallowing link keeps the connection and drops what crosses it; healed, it passes
    /// what comes after.
    #[tokio::test]
    async fn a_swallowing_link_drops_bytes_and_keeps_the_connection() {
        let port = echo_server().await;
        let link = Link::start(port).await;
        let mut c = TcpStream::connect(("127.0.0.1", link.port)).await.unwrap();
        c.write_all(b"first").await.unwrap();
        let mut got = [0u8; 5];
        c.read_exact(&mut got).await.unwrap();
        link.swallow();
        c.write_all(b"lost").await.unwrap();
        crate::eventually::eventually(
            "the link to swallow 4 bytes",
            Duration::from_secs(10),
            || async { (link.swallowed() == 4).then_some(()) },
        )
        .await;
        link.heal();
        c.write_all(b"kept").await.unwrap();
        let mut got = [0u8; 4];
        c.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"kept");
    }
}
