//! A network link a test can cut: a TCP relay on a free loopback port in front of a server.
//! Cut, it ends every connection through it and takes new ones only to drop them, as a lost
//! WAN link between clusters would look to both ends; healed, it relays again. It may also
//! delay every byte by a fixed time each way, as a WAN link between clusters does.

use std::sync::atomic::{AtomicBool, Ordering};
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
        let relays: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let (c, r) = (cut.clone(), relays.clone());
        let accept = tokio::spawn(async move {
            while let Ok((mut near, _)) = listener.accept().await {
                if c.load(Ordering::SeqCst) {
                    continue;
                }
                let relay = tokio::spawn(async move {
                    if let Ok(mut far) = TcpStream::connect(("127.0.0.1", upstream)).await {
                        if one_way.is_zero() {
                            let _ = tokio::io::copy_bidirectional(&mut near, &mut far).await;
                        } else {
                            let _ = near.set_nodelay(true);
                            let _ = far.set_nodelay(true);
                            let (nr, nw) = near.into_split();
                            let (fr, fw) = far.into_split();
                            tokio::join!(delayed(nr, fw, one_way), delayed(fr, nw, one_way));
                        }
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

/// Copies `from` to `to`, each chunk `delay` after it was read; ends when either side does.
async fn delayed(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, delay: Duration) {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let read = async move {
        let mut buf = vec![0u8; 64 * 1024];
        while let Ok(n) = from.read(&mut buf).await {
            if n == 0
                || tx
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

    /// An echo server behind a delayed link: what is sent comes back whole and in order, no
    /// sooner than the link's round trip.
    #[tokio::test]
    async fn a_delayed_link_holds_each_direction_and_keeps_the_order() {
        let server = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = server.local_addr().unwrap().port();
        tokio::spawn(async move {
            let (mut s, _) = server.accept().await.unwrap();
            let (mut r, mut w) = s.split();
            let _ = tokio::io::copy(&mut r, &mut w).await;
        });
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
}
