//! The endpoint picker's conversation with a proxy: the input is a sequence of ext_proc
//! `ProcessingRequest` messages (each a 2-byte big-endian length, then that many bytes of
//! protobuf), played one by one against the real picker over the example policies' fleet, then
//! the stream closed.
#![no_main]

use std::sync::OnceLock;

use envoy_types::pb::envoy::service::ext_proc::v3::ProcessingRequest;
use kvplane_api::{EndpointPicker, PickerConfig};
use kvplane_testkit::state::TestFleet;
use libfuzzer_sys::fuzz_target;
use prost::Message;

thread_local! {
    /// The example policies' fleet, every worker set with two workers up (libFuzzer runs the
    /// target on one thread).
    static PICKER: (TestFleet, EndpointPicker) = {
        let f = TestFleet::with_policies_up(
            concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/policies"),
            &["w1", "w2"],
        );
        let picker = EndpointPicker::new(f.service(), PickerConfig::default());
        (f, picker)
    };
}

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("a runtime")
    })
}

fuzz_target!(|data: &[u8]| {
    let mut messages = Vec::new();
    let mut rest = data;
    while rest.len() >= 2 {
        let n = usize::from(u16::from_be_bytes([rest[0], rest[1]]));
        let end = (2 + n).min(rest.len());
        if let Ok(m) = ProcessingRequest::decode(&rest[2..end]) {
            messages.push(m);
        }
        rest = &rest[end..];
    }
    let mut c = PICKER.with(|(_, p)| p.conversation(None, None));
    runtime().block_on(async {
        for m in messages {
            if c.on(m).await.is_err() {
                break;
            }
        }
        c.closed().await;
    });
});
