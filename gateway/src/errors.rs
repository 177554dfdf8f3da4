//! Errors as OpenAI's API answers them, so OpenAI's SDKs raise the exception a client
//! expects: `{"error": {"message", "type", "param", "code"}}`, the type from the status, the
//! code a short string naming the cause, `Retry-After` in whole seconds when a retry helps.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

/// An error answer: `status`, `code`, `message`; `Retry-After` when `retry_after_ms` is set.
pub(crate) fn error_response(
    status: StatusCode,
    code: &str,
    message: &str,
    retry_after_ms: u64,
) -> Response {
    let body = kvplane_proto::front::openai_error(status.as_u16(), code, message);
    let mut r = (status, axum::Json(body)).into_response();
    if retry_after_ms > 0 {
        let secs = retry_after_ms.div_ceil(1000).to_string();
        if let Ok(v) = HeaderValue::from_str(&secs) {
            r.headers_mut().insert(header::RETRY_AFTER, v);
        }
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_error_has_openais_shape_with_a_string_code() {
        let r = error_response(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_exceeded",
            "slow down",
            1_500,
        );
        assert_eq!(r.headers()[header::RETRY_AFTER], "2");
        let body = axum::body::to_bytes(r.into_body(), 1 << 16).await.unwrap();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"error": {"message": "slow down", "type": "rate_limit_error", "param": null, "code": "rate_limit_exceeded"}})
        );
    }
}
