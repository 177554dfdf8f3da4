//! The tower layer in front of every service on the gRPC port.

use std::task::{Context, Poll};

use futures::future::{Either, Ready};
use kvplane_tls::Peer;

use super::{Access, needs};

/// The tower layer that checks every call on the gRPC port.
#[derive(Debug, Clone)]
pub struct AccessLayer(pub Access);

impl<S> tower::Layer<S> for AccessLayer {
    type Service = Checked<S>;
    fn layer(&self, inner: S) -> Checked<S> {
        Checked {
            inner,
            access: self.0.clone(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Checked<S> {
    inner: S,
    access: Access,
}

impl<S, B> tower::Service<http::Request<B>> for Checked<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Either<S::Future, Ready<Result<S::Response, S::Error>>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        let caller = self.access.caller(req.extensions().get::<Peer>());
        let needs = needs(req.uri().path());
        if !caller.satisfies(needs) {
            self.access.metrics().denied(&caller, needs.label());
            tracing::debug!(caller = caller.name(), path = req.uri().path(), "refused");
            return Either::Right(futures::future::ready(Ok(caller
                .refusal(needs)
                .into_http())));
        }
        req.extensions_mut().insert(caller);
        Either::Left(self.inner.call(req))
    }
}
