//! A policy file as `kvplane validate`, the policy directory and Kubernetes read it: parsed to
//! objects, then checked as a catalog (references, alias cycles, every problem).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let mut docs = kvplane_policy::Documents::default();
        docs.add_file("fuzz.yaml", text);
        let _ = docs.check();
    }
});
