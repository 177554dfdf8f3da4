//! Where a request goes: an engine (its address and the request's path) or a provider (its
//! base URL joined with the path as OpenAI's SDKs join it, with its credentials), in the order
//! a Route answer gives them - the pick, then the alternatives a request is retried on when
//! the one before did not answer.

use std::sync::Arc;

use bytes::Bytes;
use kvplane_proto::v1::{Endpoint, RouteResponse};

use crate::bedrock::{Asked, Aws, BedrockError};
use crate::secrets::{SecretError, Secrets};

/// One place to send a request.
#[derive(Debug, Clone)]
pub(crate) struct Target {
    pub(crate) url: String,
    /// `pool/worker`, `provider:name`, or an engine URL (round-robin).
    pub(crate) label: String,
    pub(crate) body: Bytes,
    pub(crate) matched_blocks: u32,
    /// The provider's name: the request carries its credentials, not the client's headers.
    pub(crate) provider: Option<String>,
    /// `Authorization` for a provider (`Bearer <key>`).
    pub(crate) authorization: Option<String>,
    /// A Bedrock provider's call: signed when sent, its answer translated to OpenAI's.
    pub(crate) bedrock: Option<Arc<BedrockCall>>,
    /// The Route answer's alternative this is (`None`: its pick, or no Route): usage reports
    /// of a request it served say so (`UsageReport.served`).
    pub(crate) served: Option<Endpoint>,
}

/// The SigV4 headers of Bedrock call `t` (signed now, for service `bedrock`).
pub(crate) fn bedrock_signature(
    t: &Target,
    b: &BedrockCall,
) -> Result<Vec<(String, String)>, BedrockError> {
    // The URL as reqwest sends it (its host lowercased, a default port left out): the host the
    // signer derives from it is the one that goes out.
    let url = reqwest::Url::parse(&t.url).map_err(|e| BedrockError::Sign(e.to_string()))?;
    crate::bedrock::signature(
        "POST",
        url.as_str(),
        &[("content-type", "application/json")],
        &t.body,
        &b.aws,
        "bedrock",
        std::time::SystemTime::now(),
    )
}

/// What a call to a Bedrock provider needs besides its URL and body.
#[derive(Debug)]
pub(crate) struct BedrockCall {
    pub(crate) aws: Aws,
    pub(crate) asked: Asked,
    /// The provider's model, which its answer names.
    pub(crate) model: String,
}

/// Why a decision's endpoint cannot be called (logged; [`TargetError::public`] is what a
/// client is told).
#[derive(Debug, thiserror::Error)]
pub(crate) enum TargetError {
    #[error("worker {pool}/{worker} has not announced an address")]
    NoAddress { pool: String, worker: String },
    #[error(
        "provider {provider} speaks {api}, which this gateway cannot call (OpenAI-compatible and Bedrock providers only)"
    )]
    Api { provider: String, api: String },
    #[error("provider {provider}: {source}")]
    Bedrock {
        provider: String,
        source: BedrockError,
    },
    #[error("provider {provider}: {source}")]
    Credentials {
        provider: String,
        source: SecretError,
    },
}

impl TargetError {
    /// The answer's status and error code when no target can be called for this.
    pub(crate) fn status(&self) -> (http::StatusCode, &'static str) {
        match self {
            Self::Bedrock {
                source: BedrockError::Request(_),
                ..
            } => (http::StatusCode::BAD_REQUEST, "invalid_request"),
            _ => (http::StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
        }
    }

    /// What a client may be told: no secret's path, no variable name.
    pub(crate) fn public(&self) -> String {
        match self {
            Self::Credentials { provider, .. } => {
                format!("provider {provider} has no credentials the gateway can read")
            }
            other => other.to_string(),
        }
    }
}

/// `path` (an OpenAI API path, `/v1/...`) under a provider's `base`. A base with a path is an API's base URL
/// as OpenAI's SDKs take it (`https://api.openai.com/v1`, `.../v1beta/openai`, an Azure
/// deployment's with its `?api-version=`): the path's own `/v1` is not added, the base's query
/// is kept. A bare origin (`https://api.example`) gets the whole path.
pub(crate) fn join(base: &str, path: &str) -> String {
    let Ok(mut url) = reqwest::Url::parse(base) else {
        return format!("{}{path}", base.trim_end_matches('/'));
    };
    let own = url.path().trim_end_matches('/').to_owned();
    let joined = if own.is_empty() {
        path.to_owned()
    } else {
        format!("{own}{}", path.strip_prefix("/v1").unwrap_or(path))
    };
    url.set_path(&joined);
    url.to_string()
}

/// Where `e` is reached for `path` with `body`.
pub(crate) async fn target(
    e: &Endpoint,
    path: &str,
    body: Bytes,
    matched_blocks: u32,
    secrets: &Secrets,
) -> Result<Target, TargetError> {
    if e.address.is_empty() {
        return Err(TargetError::NoAddress {
            pool: e.pool.clone(),
            worker: e.worker_id.clone(),
        });
    }
    if e.provider.is_empty() {
        // An engine's address is where its API's paths start.
        return Ok(Target {
            url: format!("{}{path}", e.address.trim_end_matches('/')),
            label: format!("{}/{}", e.pool, e.worker_id),
            body,
            matched_blocks,
            provider: None,
            authorization: None,
            bedrock: None,
            served: None,
        });
    }
    if e.provider_api.eq_ignore_ascii_case("bedrock") {
        return bedrock_target(e, path, &body, secrets).await;
    }
    if !(e.provider_api.is_empty() || e.provider_api.eq_ignore_ascii_case("openai")) {
        return Err(TargetError::Api {
            provider: e.provider.clone(),
            api: e.provider_api.clone(),
        });
    }
    let authorization = if e.credentials_name.is_empty() {
        None
    } else {
        let key = secrets
            .get(&e.credentials_name, &e.credentials_key)
            .await
            .map_err(|source| TargetError::Credentials {
                provider: e.provider.clone(),
                source,
            })?;
        Some(format!("Bearer {key}"))
    };
    Ok(Target {
        url: join(&e.address, path),
        label: format!("provider:{}", e.provider),
        body,
        matched_blocks: 0,
        provider: Some(e.provider.clone()),
        authorization,
        bedrock: None,
        served: None,
    })
}

/// A Bedrock provider's Converse call for `body`, with the AWS keys of its Secret.
async fn bedrock_target(
    e: &Endpoint,
    path: &str,
    body: &[u8],
    secrets: &Secrets,
) -> Result<Target, TargetError> {
    let credentials = |source| TargetError::Credentials {
        provider: e.provider.clone(),
        source,
    };
    let name = &e.credentials_name;
    let aws = Aws {
        access_key_id: secrets
            .get(name, "aws_access_key_id")
            .await
            .map_err(credentials)?,
        secret_access_key: secrets
            .get(name, "aws_secret_access_key")
            .await
            .map_err(credentials)?,
        session_token: match secrets.get(name, "aws_session_token").await {
            Ok(t) if !t.is_empty() => Some(t),
            Ok(_) | Err(SecretError::Missing { .. }) => None,
            Err(e) => return Err(credentials(e)),
        },
        region: e.provider_region.clone(),
    };
    let (converse, asked) =
        crate::bedrock::converse_request(body, path).map_err(|source| TargetError::Bedrock {
            provider: e.provider.clone(),
            source,
        })?;
    Ok(Target {
        url: crate::bedrock::converse_url(&e.address, &e.model, asked.stream),
        label: format!("provider:{}", e.provider),
        body: Bytes::from(converse),
        matched_blocks: 0,
        provider: Some(e.provider.clone()),
        authorization: None,
        bedrock: Some(Arc::new(BedrockCall {
            aws,
            asked,
            model: e.model.clone(),
        })),
        served: None,
    })
}

/// The pick and its alternatives for `resp`, the ones that can be called (each with the body
/// naming the model it serves); the pick's error when none can.
pub(crate) async fn targets(
    resp: RouteResponse,
    pick: Endpoint,
    path: &str,
    body: &Bytes,
    secrets: &Secrets,
) -> Result<Vec<Target>, TargetError> {
    let picked_body = resp
        .rewritten_body
        .map_or_else(|| body.clone(), Bytes::from);
    let mut out = Vec::new();
    let first = match target(
        &pick,
        path,
        picked_body.clone(),
        resp.matched_blocks,
        secrets,
    )
    .await
    {
        Ok(t) => {
            out.push(t);
            None
        }
        Err(e) => {
            tracing::warn!(error = %e, "the pick cannot be called; trying its alternatives");
            Some(e)
        }
    };
    for a in &resp.alternatives {
        let alt_body = if a.model.is_empty() || a.model == resp.model {
            picked_body.clone()
        } else {
            rewrite_model(body, &a.model).unwrap_or_else(|| body.clone())
        };
        match target(a, path, alt_body, 0, secrets).await {
            Ok(t) => out.push(Target {
                served: Some(a.clone()),
                ..t
            }),
            Err(e) => tracing::debug!(error = %e, "an alternative cannot be called"),
        }
    }
    match first {
        Some(e) if out.is_empty() => Err(e),
        _ => Ok(out),
    }
}

/// Headers never passed on to an engine: connection-level ones, and what the gateway sets.
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
    "content-type",
    // The answer is relayed as the engine sends it: no encoding the gateway did not ask for.
    "accept-encoding",
];

/// The headers of the request sent to `t`: an engine gets the client's (its credentials for
/// an engine that checks them, the request id, trace context, tenant), less connection-level
/// ones; a provider only the request id, what it may answer in, and its own credentials.
pub(crate) fn upstream_headers(
    t: &Target,
    client: &http::HeaderMap,
    request_id: &str,
) -> http::HeaderMap {
    let mut out = http::HeaderMap::new();
    if t.provider.is_none() {
        for (k, v) in client {
            if !HOP_BY_HOP.contains(&k.as_str()) {
                out.append(k.clone(), v.clone());
            }
        }
    } else if let Some(b) = &t.bedrock {
        // Converse answers JSON, ConverseStream its event stream, whatever the client reads
        // (Accept is not signed).
        let accept = if b.asked.stream {
            crate::bedrock::stream::CONTENT_TYPE
        } else {
            "application/json"
        };
        out.insert(http::header::ACCEPT, http::HeaderValue::from_static(accept));
    } else if let Some(a) = client.get(http::header::ACCEPT) {
        out.insert(http::header::ACCEPT, a.clone());
    }
    out.insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    if let Ok(v) = http::HeaderValue::from_str(request_id) {
        out.insert("x-request-id", v);
    }
    if let Some(a) = &t.authorization
        && let Ok(mut v) = http::HeaderValue::from_str(a)
    {
        v.set_sensitive(true);
        out.insert(http::header::AUTHORIZATION, v);
    }
    out
}

/// `body` naming `model`, when it is a JSON object.
fn rewrite_model(body: &[u8], model: &str) -> Option<Bytes> {
    let mut v: serde_json::Value = serde_json::from_slice(body).ok()?;
    v.as_object_mut()?
        .insert("model".into(), serde_json::Value::String(model.to_owned()));
    serde_json::to_vec(&v).ok().map(Bytes::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_base_url_with_the_api_version_is_joined_as_openais_sdks_join_it() {
        for (base, want) in [
            (
                "https://api.provider.example/v1",
                "https://api.provider.example/v1/chat/completions",
            ),
            (
                "https://api.provider.example/v1/",
                "https://api.provider.example/v1/chat/completions",
            ),
            (
                "https://api.provider.example",
                "https://api.provider.example/v1/chat/completions",
            ),
            (
                "http://10.0.0.7:8000",
                "http://10.0.0.7:8000/v1/chat/completions",
            ),
            (
                "https://gw.example/openai/v1",
                "https://gw.example/openai/v1/chat/completions",
            ),
            (
                "https://generativelanguage.googleapis.com/v1beta/openai",
                "https://generativelanguage.googleapis.com/v1beta/openai/chat/completions",
            ),
            (
                "https://x.openai.azure.com/openai/deployments/d?api-version=2024-10-21",
                "https://x.openai.azure.com/openai/deployments/d/chat/completions?api-version=2024-10-21",
            ),
        ] {
            assert_eq!(join(base, "/v1/chat/completions"), want, "{base}");
        }
    }

    #[test]
    fn an_engine_gets_the_clients_headers_and_a_provider_only_its_own_credentials() {
        let mut client = http::HeaderMap::new();
        client.insert("authorization", "Bearer client-key".parse().unwrap());
        client.insert("x-tenant", "acme".parse().unwrap());
        client.insert("connection", "keep-alive".parse().unwrap());
        client.insert("traceparent", "00-abc-def-01".parse().unwrap());
        let engine = Target {
            url: String::new(),
            label: "gpu/w0".into(),
            body: Bytes::new(),
            matched_blocks: 0,
            provider: None,
            authorization: None,
            bedrock: None,
            served: None,
        };
        let h = upstream_headers(&engine, &client, "gw-1");
        assert_eq!(h["authorization"], "Bearer client-key");
        assert_eq!(h["x-tenant"], "acme");
        assert_eq!(h["traceparent"], "00-abc-def-01");
        assert_eq!(h["x-request-id"], "gw-1");
        assert!(h.get("connection").is_none());
        let provider = Target {
            provider: Some("cloud".into()),
            authorization: Some("Bearer sk-provider".into()),
            ..engine
        };
        let h = upstream_headers(&provider, &client, "gw-1");
        assert_eq!(h["authorization"], "Bearer sk-provider");
        assert!(h.get("x-tenant").is_none() && h.get("traceparent").is_none());
    }

    #[tokio::test]
    async fn a_provider_gets_its_credentials_and_an_unknown_api_is_refused_by_name() {
        let provider = |api: &str| Endpoint {
            address: "https://api.provider.example/v1".into(),
            provider: "cloud".into(),
            provider_api: api.into(),
            credentials_name: "cloud".into(),
            credentials_key: "token".into(),
            ..Default::default()
        };
        let dir = std::env::temp_dir().join(format!("kvplane-target-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("cloud")).unwrap();
        std::fs::write(dir.join("cloud").join("token"), "sk-file").unwrap();
        let secrets = Secrets {
            dir: Some(dir.clone()),
        };
        let (openai, other) = (provider("OpenAI"), provider("Gemini"));
        let at = |e| target(e, "/v1/completions", Bytes::new(), 0, &secrets);
        let t = at(&openai).await.unwrap();
        assert_eq!(t.url, "https://api.provider.example/v1/completions");
        assert_eq!(t.authorization.as_deref(), Some("Bearer sk-file"));
        assert_eq!(t.label, "provider:cloud");
        let e = at(&other).await.unwrap_err();
        assert!(e.to_string().contains("Gemini"), "{e}");
        // Bedrock: the Secret's AWS keys, the Converse URL, the body translated.
        for (key, value) in [
            ("aws_access_key_id", "AKID"),
            ("aws_secret_access_key", "SECRET"),
        ] {
            std::fs::write(dir.join("cloud").join(key), value).unwrap();
        }
        let bedrock = Endpoint {
            address: "https://bedrock-runtime.eu-west-1.amazonaws.com".into(),
            provider_api: "Bedrock".into(),
            provider_region: "eu-west-1".into(),
            model: "amazon.nova-lite-v1:0".into(),
            ..provider("Bedrock")
        };
        let body = Bytes::from_static(br#"{"model":"x","prompt":"hi","max_tokens":3}"#);
        let t = target(&bedrock, "/v1/completions", body, 0, &secrets)
            .await
            .unwrap();
        assert_eq!(
            t.url,
            "https://bedrock-runtime.eu-west-1.amazonaws.com/model/amazon.nova-lite-v1%3A0/converse"
        );
        let call = t.bedrock.as_ref().unwrap();
        assert_eq!(
            (call.aws.access_key_id.as_str(), call.aws.region.as_str()),
            ("AKID", "eu-west-1")
        );
        assert!(call.aws.session_token.is_none());
        let sent: serde_json::Value = serde_json::from_slice(&t.body).unwrap();
        assert_eq!(sent["messages"][0]["content"][0]["text"], "hi");
        assert_eq!(sent["inferenceConfig"]["maxTokens"], 3);
        let client = http::HeaderMap::new();
        assert_eq!(
            upstream_headers(&t, &client, "gw-1")["accept"],
            "application/json"
        );
        // Streamed: ConverseStream, asked for its event stream.
        let body = Bytes::from_static(br#"{"model":"x","prompt":"hi","stream":true}"#);
        let t = target(&bedrock, "/v1/completions", body, 0, &secrets)
            .await
            .unwrap();
        assert!(
            t.url
                .ends_with("/model/amazon.nova-lite-v1%3A0/converse-stream")
        );
        assert_eq!(
            upstream_headers(&t, &client, "gw-1")["accept"],
            "application/vnd.amazon.eventstream"
        );
        std::fs::remove_dir_all(dir).unwrap();
    }
}
