//! The client side: channels to kvplane's gRPC port, over TLS with this process's certificate
//! when it has a `[tls]` section.

use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use rustls::ClientConfig;
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::{Tls, TlsError};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How this process reaches kvplane's gRPC port: plaintext, or TLS presenting its certificate
/// and checking that the server's names the host dialed.
#[derive(Clone, Debug, Default)]
pub struct Dialer {
    tls: Option<Client>,
}

#[derive(Clone, Debug)]
enum Client {
    /// This process's files, reloaded when they change.
    Files(Tls),
    /// Trusting a CA, presenting no certificate.
    Anonymous(Arc<ClientConfig>),
}

impl Dialer {
    /// Plaintext (no `[tls]` section).
    pub fn plain() -> Self {
        Self::default()
    }

    pub fn new(tls: Option<Tls>) -> Self {
        Self {
            tls: tls.map(Client::Files),
        }
    }

    /// TLS trusting the CA in `ca`, without a client certificate (callers named by nothing:
    /// health checks, or to see what such a caller is refused).
    pub fn anonymous(ca: &Path) -> Result<Self, TlsError> {
        Ok(Self {
            tls: Some(Client::Anonymous(crate::material::anonymous_client(ca)?)),
        })
    }

    /// The URL of `addr` (`host:port`, or a URL whose scheme is replaced): `https` with TLS,
    /// `http` without, whatever scheme it was given with.
    pub fn url(&self, addr: &str) -> String {
        let rest = addr.split_once("://").map_or(addr, |(_, r)| r);
        if self.tls.is_some() {
            format!("https://{rest}")
        } else {
            format!("http://{rest}")
        }
    }

    /// The endpoint of `addr`, for a caller that sets more (timeouts) before [`Dialer::lazy`].
    pub fn endpoint(&self, addr: &str) -> Result<Endpoint, tonic::transport::Error> {
        Ok(Endpoint::from_shared(self.url(addr))?
            .connect_timeout(Duration::from_millis(500))
            .tcp_nodelay(true))
    }

    /// A channel to `addr`, connected on first use (and again after a failure).
    pub fn channel(&self, addr: &str) -> Result<Channel, tonic::transport::Error> {
        Ok(self.lazy(&self.endpoint(addr)?))
    }

    /// A channel to an endpoint of [`Dialer::endpoint`], connected on first use.
    pub fn lazy(&self, e: &Endpoint) -> Channel {
        match self.connector() {
            Some(c) => e.connect_with_connector_lazy(c),
            None => e.connect_lazy(),
        }
    }

    /// A channel to `addr`, connected now.
    pub async fn connect(&self, addr: &str) -> Result<Channel, tonic::transport::Error> {
        let e = self.endpoint(addr)?.connect_timeout(Duration::from_secs(5));
        match self.connector() {
            Some(c) => e.connect_with_connector(c).await,
            None => e.connect().await,
        }
    }

    fn connector(&self) -> Option<Connector> {
        self.tls.clone().map(|tls| Connector { tls })
    }
}

/// Whether a call that ended with `status` never reached its server: its connection was
/// refused (an `io::Error` of that kind among its sources), so nothing was sent. Any other
/// failure may have come after the server received the request.
pub fn connection_refused(status: &tonic::Status) -> bool {
    let mut cur = std::error::Error::source(status);
    while let Some(e) = cur {
        if e.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionRefused)
        {
            return true;
        }
        cur = e.source();
    }
    false
}

impl Client {
    fn config(&self) -> Arc<ClientConfig> {
        match self {
            Client::Files(t) => t.client_config(),
            Client::Anonymous(c) => c.clone(),
        }
    }
}

/// TCP, then a TLS handshake naming the URI's host.
#[derive(Clone, Debug)]
struct Connector {
    tls: Client,
}

impl tower::Service<Uri> for Connector {
    type Response = TokioIo<TlsStream<TcpStream>>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let config = self.tls.config();
        Box::pin(async move {
            let host = uri.host().ok_or("the address has no host")?;
            let host = host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_owned();
            let port = uri.port_u16().unwrap_or(443);
            let tcp = TcpStream::connect((host.as_str(), port)).await?;
            tcp.set_nodelay(true)?;
            let name = ServerName::try_from(host)?;
            let tls = TlsConnector::from(config).connect(name, tcp).await?;
            Ok(TokioIo::new(tls))
        })
    }
}
