//! `sandboxsched-envd`: envd on its own (the node's binary also carries it, as `node-svc envd`).

fn main() -> std::process::ExitCode {
    envd::main(std::env::args_os().skip(1))
}
