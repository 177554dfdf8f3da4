//! A Kubernetes API server for the custom resources, behind kube's `Client` through
//! tower-test's mock service (no cluster runs here): list, watch (a streamed body of JSON
//! lines that stays open), and merge patches of the status subresource. Changes made through
//! it reach every open watch.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use futures::StreamExt;
use http::{Method, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;

pub type Body = UnsyncBoxBody<Bytes, Infallible>;

#[derive(Default)]
struct Inner {
    /// By plural, then name.
    objects: BTreeMap<String, BTreeMap<String, Value>>,
    resource_version: u64,
    watches: Vec<(String, mpsc::UnboundedSender<Bytes>)>,
    /// Status patches received: (plural, name, patch).
    status_patches: Vec<(String, String, Value)>,
    lists: usize,
}

#[derive(Clone, Default)]
pub struct FakeApi(Arc<Mutex<Inner>>);

#[allow(clippy::unwrap_used)]
impl FakeApi {
    /// A client whose requests this fake answers (on a task of the current runtime).
    pub fn client(&self, namespace: &str) -> kube::Client {
        let (service, mut handle) =
            tower_test::mock::pair::<Request<kube::client::Body>, Response<Body>>();
        let api = self.clone();
        tokio::spawn(async move {
            while let Some((req, send)) = handle.next_request().await {
                let resp = api.answer(req).await;
                send.send_response(resp);
            }
        });
        kube::Client::new(service, namespace)
    }

    /// Creates or replaces an object (`plural` as [`key`] names it); its generation goes up
    /// when the spec changes, as the API server does.
    pub fn apply(&self, plural: &str, mut object: Value) {
        let mut g = self.0.lock().unwrap();
        g.resource_version += 1;
        let rv = g.resource_version;
        let name = object["metadata"]["name"].as_str().unwrap().to_owned();
        let old = g.objects.get(plural).and_then(|m| m.get(&name)).cloned();
        let generation = match &old {
            Some(o) if o["spec"] == object["spec"] => o["metadata"]["generation"].as_i64().unwrap(),
            Some(o) => o["metadata"]["generation"].as_i64().unwrap() + 1,
            None => 1,
        };
        // The status is a subresource: kept unless the object brings its own (as the kubelet
        // writes a pod's).
        if let Some(o) = &old
            && object.get("status").is_none()
        {
            object["status"] = o["status"].clone();
        }
        object["metadata"]["generation"] = json!(generation);
        object["metadata"]["resourceVersion"] = json!(rv.to_string());
        object["metadata"]["uid"] = json!(format!("uid-{plural}-{name}"));
        let kind = if old.is_some() { "MODIFIED" } else { "ADDED" };
        g.objects
            .entry(plural.to_owned())
            .or_default()
            .insert(name, object.clone());
        Self::notify(&mut g, plural, kind, &object);
    }

    pub fn delete(&self, plural: &str, name: &str) {
        let mut g = self.0.lock().unwrap();
        let mut object = g.objects.get_mut(plural).unwrap().remove(name).unwrap();
        g.resource_version += 1;
        object["metadata"]["resourceVersion"] = json!(g.resource_version.to_string());
        Self::notify(&mut g, plural, "DELETED", &object);
    }

    fn notify(g: &mut Inner, plural: &str, kind: &str, object: &Value) {
        let mut line = serde_json::to_vec(&json!({"type": kind, "object": object})).unwrap();
        line.push(b'\n');
        let line = Bytes::from(line);
        g.watches
            .retain(|(p, tx)| p != plural || tx.send(line.clone()).is_ok());
    }

    /// The object's status as last written.
    pub fn status(&self, plural: &str, name: &str) -> Option<Value> {
        let g = self.0.lock().unwrap();
        let s = &g.objects.get(plural)?.get(name)?["status"];
        (!s.is_null()).then(|| s.clone())
    }

    pub fn status_patches(&self) -> usize {
        self.0.lock().unwrap().status_patches.len()
    }

    /// Open watches and lists served so far.
    pub fn served(&self) -> (usize, usize) {
        let g = self.0.lock().unwrap();
        (g.watches.len(), g.lists)
    }

    async fn answer(&self, req: Request<kube::client::Body>) -> Response<Body> {
        let (parts, body) = req.into_parts();
        let path = parts.uri.path().to_owned();
        let query = parts.uri.query().unwrap_or("").to_owned();
        // /apis/{group}/{version}/namespaces/{ns}/{plural}[/{name}[/status]], or
        // /api/v1/namespaces/{ns}/{plural} for the core group.
        let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
        let (group, rest) = match segments.as_slice() {
            ["apis", group, _, "namespaces", _, rest @ ..] => (*group, rest),
            ["api", _, "namespaces", _, rest @ ..] => ("", rest),
            _ => ("", &[][..]),
        };
        let (plural, name, sub) = match rest {
            [plural] => (*plural, None, None),
            [plural, name] => (*plural, Some(*name), None),
            [plural, name, sub] => (*plural, Some(*name), Some(*sub)),
            _ => {
                return respond(
                    StatusCode::NOT_FOUND,
                    json!({"kind": "Status", "code": 404}),
                );
            }
        };
        let plural = &*key(group, plural);
        match (&parts.method, name, sub) {
            (&Method::GET, None, None) if query.contains("watch=true") => {
                let (tx, rx) = mpsc::unbounded_channel();
                self.0.lock().unwrap().watches.push((plural.to_owned(), tx));
                let stream = UnboundedReceiverStream::new(rx).map(|b| Ok(Frame::data(b)));
                Response::new(StreamBody::new(stream).boxed_unsync())
            }
            (&Method::GET, None, None) => {
                let mut g = self.0.lock().unwrap();
                g.lists += 1;
                let items: Vec<Value> = g
                    .objects
                    .get(plural)
                    .map(|m| m.values().cloned().collect())
                    .unwrap_or_default();
                respond(
                    StatusCode::OK,
                    json!({
                        "apiVersion": "kvplane.io/v1alpha1",
                        "kind": "List",
                        "metadata": {"resourceVersion": g.resource_version.to_string()},
                        "items": items,
                    }),
                )
            }
            (&Method::PATCH, Some(name), Some("status")) => {
                let patch: Value =
                    serde_json::from_slice(&body.collect_bytes().await.unwrap()).unwrap();
                let mut g = self.0.lock().unwrap();
                g.resource_version += 1;
                let rv = g.resource_version;
                let Some(object) = g.objects.get_mut(plural).and_then(|m| m.get_mut(name)) else {
                    return respond(
                        StatusCode::NOT_FOUND,
                        json!({"kind": "Status", "code": 404}),
                    );
                };
                object["status"] = patch["status"].clone();
                object["metadata"]["resourceVersion"] = json!(rv.to_string());
                let object = object.clone();
                g.status_patches
                    .push((plural.to_owned(), name.to_owned(), patch));
                Self::notify(&mut g, plural, "MODIFIED", &object);
                respond(StatusCode::OK, object)
            }
            _ => respond(
                StatusCode::METHOD_NOT_ALLOWED,
                json!({"kind": "Status", "code": 405}),
            ),
        }
    }
}

/// Where the fake keeps a resource: by its plural for kvplane's own kinds and the core group,
/// `{group}/{plural}` for any other group (the Inference Extension's `InferencePool` shares
/// its plural with kvplane's).
pub fn key(group: &str, plural: &str) -> String {
    if group.is_empty() || group == "kvplane.io" {
        plural.to_owned()
    } else {
        format!("{group}/{plural}")
    }
}

fn respond(status: StatusCode, body: Value) -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::from(body.to_string())).boxed_unsync());
    *r.status_mut() = status;
    r
}
