//! The `kvplane` binary: everything lives in the library; this only hands it the arguments.

fn main() -> std::process::ExitCode {
    kvplane_node::cli::main()
}
