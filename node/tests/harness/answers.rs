//! What the tests read of answers and use as third-party clients: OpenAI server-sent events,
//! the test venv's python.

use std::path::PathBuf;

/// A streamed answer's text and its events (`data: [DONE]` checked last, not among them),
/// once its content type says it is one.
pub async fn sse_events(r: reqwest::Response) -> (String, Vec<serde_json::Value>) {
    let content_type = r.headers()["content-type"].to_str().unwrap().to_owned();
    assert!(
        content_type.starts_with("text/event-stream"),
        "{content_type}"
    );
    let text = r.text().await.unwrap();
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    let events = sse_json(&text);
    (text, events)
}

/// The JSON events of an SSE text (`[DONE]` left out).
pub fn sse_json(text: &str) -> Vec<serde_json::Value> {
    text.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

/// The test venv's python (`scripts/install-test-python`: the OpenAI SDK, grpcio, botocore).
pub fn test_python() -> PathBuf {
    let py = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../target/test-venv/bin/python"
    ));
    assert!(
        py.exists(),
        "no {}: run scripts/install-test-python",
        py.display()
    );
    py
}
