//! `sandboxsched-jail`: the stand-alone binary of the `jail` OCI runtime.

fn main() -> std::process::ExitCode {
    jail::main(std::env::args_os().skip(1))
}
