//! What every front of kvplane (an HTTP gateway, the Envoy endpoint picker) reads the same way
//! from the HTTP requests it routes and the answers it relays: which of a request's headers
//! Route may see, and the usage an OpenAI answer ends with; and how it answers a refusal, in
//! OpenAI's error shape. Parsing and shaping only, no I/O.

use crate::v1::{RejectCode, UsageReport};

/// The HTTP status and OpenAI-style error code a front answers a Route refusal with.
pub fn refusal_answer(code: RejectCode) -> (u16, &'static str) {
    match code {
        RejectCode::RateLimited => (429, "rate_limit_exceeded"),
        RejectCode::UnknownModel => (404, "model_not_found"),
        RejectCode::InvalidRequest => (400, "invalid_request"),
        RejectCode::Policy => (403, "policy_rejected"),
        RejectCode::NoCapacity | RejectCode::Unspecified => (503, "no_capacity"),
    }
}

/// OpenAI's error type for HTTP status `status` (what its SDKs raise an exception class by).
pub fn openai_error_type(status: u16) -> &'static str {
    match status {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        429 => "rate_limit_error",
        s if s >= 500 => "server_error",
        _ => "invalid_request_error",
    }
}

/// An error answer's body in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
pub fn openai_error(status: u16, code: &str, message: &str) -> serde_json::Value {
    serde_json::json!({"error": {
        "message": message, "type": openai_error_type(status), "param": null, "code": code,
    }})
}

/// Headers never passed to kvplane: credentials and connection-level ones.
pub const NOT_ROUTED_HEADERS: &[&str] = &[
    "authorization",
    "proxy-authorization",
    "cookie",
    "x-api-key",
    "api-key",
    "x-goog-api-key",
    "connection",
    "content-length",
    "transfer-encoding",
    "upgrade",
    "keep-alive",
    "te",
    "trailer",
];

/// At most this many headers of a request go to Route.
pub const MAX_ROUTED_HEADERS: usize = 64;

/// Whether a header (by its lowercase name) may go to Route: not a credential, not
/// connection-level, not an HTTP/2 pseudo-header.
pub fn routed_header(name: &str) -> bool {
    !name.starts_with(':') && !NOT_ROUTED_HEADERS.contains(&name)
}

/// The last few KiB of an answer: where `usage` is, in both JSON and SSE answers.
#[derive(Debug, Default, Clone)]
pub struct AnswerTail(Vec<u8>);

impl AnswerTail {
    const KEEP: usize = 8 * 1024;

    pub fn keep(&mut self, bytes: &[u8]) {
        self.0.extend_from_slice(bytes);
        if self.0.len() > Self::KEEP {
            let cut = self.0.len() - Self::KEEP;
            self.0.drain(..cut);
        }
    }

    /// The `usage` of a JSON answer or of the last SSE event that has one, as a final
    /// report's token counts (zeros for counts it leaves out); `None` when there is none.
    pub fn usage(&self) -> Option<Usage> {
        let text = String::from_utf8_lossy(&self.0);
        let usage = match serde_json::from_str::<serde_json::Value>(&text) {
            Ok(v) => v.get("usage").cloned(),
            Err(_) => text
                .lines()
                .rev()
                .filter_map(|l| l.strip_prefix("data:"))
                .filter_map(|d| serde_json::from_str::<serde_json::Value>(d.trim()).ok())
                .find_map(|v| v.get("usage").filter(|u| !u.is_null()).cloned())
                // A JSON answer longer than the tail: its `usage` is near its end.
                .or_else(|| last_usage_object(&text)),
        };
        let usage = usage.filter(serde_json::Value::is_object)?;
        let n = |k: &str| {
            usage
                .pointer(k)
                .and_then(serde_json::Value::as_u64)
                .map_or(0, |v| u32::try_from(v).unwrap_or(u32::MAX))
        };
        Some(Usage {
            prompt_tokens: n("/prompt_tokens"),
            completion_tokens: n("/completion_tokens"),
            cached_tokens: n("/prompt_tokens_details/cached_tokens"),
        })
    }

    /// The final report of `request_id`: the answer's usage, or, for an answer that did not
    /// fail and whose usage was not seen (cut off, or without `usage`), `usage_unknown`: tenant
    /// limits keep what they reserved.
    pub fn report(
        &self,
        request_id: String,
        observed_ttft_ms: f64,
        outcome: crate::v1::Outcome,
    ) -> UsageReport {
        let usage = self.usage();
        let u = usage.unwrap_or_default();
        UsageReport {
            request_id,
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            cached_tokens: u.cached_tokens,
            observed_ttft_ms,
            outcome: outcome.into(),
            first_token: false,
            usage_unknown: usage.is_none() && outcome != crate::v1::Outcome::Error,
            ..Default::default()
        }
    }
}

/// The object after the last `"usage":` of `text`, when one parses there.
fn last_usage_object(text: &str) -> Option<serde_json::Value> {
    let at = text.rfind("\"usage\"")?;
    let rest = text[at + "\"usage\"".len()..]
        .trim_start()
        .strip_prefix(':')?;
    serde_json::Deserializer::from_str(rest)
        .into_iter::<serde_json::Value>()
        .next()?
        .ok()
}

/// Token counts of an answer's `usage`.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub cached_tokens: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage(bytes: &[u8]) -> Option<Usage> {
        let mut t = AnswerTail::default();
        t.keep(bytes);
        t.usage()
    }

    #[test]
    fn usage_is_found_in_json_and_sse_answers() {
        let json = br#"{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":4}}}"#;
        assert_eq!(
            usage(json),
            Some(Usage {
                prompt_tokens: 5,
                completion_tokens: 2,
                cached_tokens: 4
            })
        );
        let sse = b"data: {\"choices\":[{}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":7}}\n\ndata: [DONE]\n\n";
        assert_eq!(usage(sse).unwrap().prompt_tokens, 7);
        assert_eq!(usage(b"data: {\"choices\":[]}\n\n"), None);
    }

    #[test]
    fn a_json_answer_longer_than_the_tail_still_gives_its_usage() {
        let text = "x".repeat(20_000);
        let answer = format!(
            r#"{{"id":"c","choices":[{{"text":"{text}"}}],"usage":{{"prompt_tokens":9,"completion_tokens":4000}}}}"#
        );
        let mut t = AnswerTail::default();
        for chunk in answer.as_bytes().chunks(1000) {
            t.keep(chunk);
        }
        assert_eq!(
            t.usage(),
            Some(Usage {
                prompt_tokens: 9,
                completion_tokens: 4000,
                cached_tokens: 0
            })
        );
    }

    #[test]
    fn the_tail_keeps_the_end_of_a_long_answer() {
        let mut t = AnswerTail::default();
        t.keep(&vec![b'x'; 100_000]);
        t.keep(b"\n\n");
        t.keep(b"data: {\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1}}\n\n");
        assert_eq!(t.usage().unwrap().completion_tokens, 1);
        assert_eq!(t.0.len(), AnswerTail::KEEP);
    }

    #[test]
    fn an_answer_without_usage_is_reported_unknown_unless_it_failed() {
        use crate::v1::Outcome;
        let t = AnswerTail::default();
        assert!(t.report("r".into(), 0.0, Outcome::Success).usage_unknown);
        assert!(t.report("r".into(), 0.0, Outcome::Cancelled).usage_unknown);
        assert!(!t.report("r".into(), 0.0, Outcome::Error).usage_unknown);
        let mut t = AnswerTail::default();
        t.keep(br#"{"usage":{"prompt_tokens":5,"completion_tokens":2}}"#);
        let r = t.report("r".into(), 1.0, Outcome::Success);
        assert!(!r.usage_unknown);
        assert_eq!((r.prompt_tokens, r.completion_tokens), (5, 2));
    }

    #[test]
    fn credentials_and_pseudo_headers_are_not_routed() {
        assert!(routed_header("x-data-class"));
        assert!(!routed_header("authorization"));
        assert!(!routed_header(":path"));
    }
}
