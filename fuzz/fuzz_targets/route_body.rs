//! A request body (OpenAI completions or chat JSON, or anything) routed by the real pipeline
//! over the example policies' fleet, and explained: tokenizing, tags, rules, filters, scores.
#![no_main]

use kvplane_api::RouterService;
use kvplane_proto::v1::RouteRequest;
use kvplane_proto::v1::router_server::Router;
use kvplane_testkit::state::TestFleet;
use libfuzzer_sys::fuzz_target;

thread_local! {
    /// The example policies' fleet, every worker set with two workers up (libFuzzer runs the
    /// target on one thread).
    static FLEET: (TestFleet, RouterService) = {
        let f = TestFleet::with_policies_up(
            concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/policies"),
            &["w1", "w2"],
        );
        let svc = f.service();
        (f, svc)
    };
}

fuzz_target!(|data: &[u8]| {
    let req = RouteRequest {
        request_id: "fuzz".into(),
        body: data.to_vec(),
        ..Default::default()
    };
    FLEET.with(|(_, svc)| {
        let _ = futures::executor::block_on(svc.route(tonic::Request::new(req.clone())));
        let _ = futures::executor::block_on(svc.explain(tonic::Request::new(req)));
    });
});
