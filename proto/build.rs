//! Generates the gRPC types and the reflection descriptor set from `proto/`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    tonic_prost_build::configure()
        .file_descriptor_set_path(out.join("kvplane_descriptor.bin"))
        .compile_protos(
            &[
                "proto/kvplane/v1/kvplane.proto",
                "proto/kvplane/v1/raft.proto",
            ],
            &["proto"],
        )?;
    println!("cargo:rerun-if-changed=proto");
    Ok(())
}
