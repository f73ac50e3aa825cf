//! Compiles every .proto under `proto/` with `protox` (a protobuf compiler written in Rust), so a
//! fresh machine needs no system `protoc` to build the workspace.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from("proto");
    // The directory too, so a new .proto is picked up.
    println!("cargo:rerun-if-changed=proto/sandboxsched");
    let mut files = Vec::new();
    for entry in std::fs::read_dir(root.join("sandboxsched"))? {
        let path = entry?.path();
        if path.extension().is_some_and(|ext| ext == "proto") {
            println!("cargo:rerun-if-changed={}", path.display());
            files.push(path);
        }
    }
    files.sort();
    let fds = protox::compile(&files, [&root])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
