//! `sandboxsched-envd`: envd on its own (the node's binary also carries it, as `node-svc envd`).
//! Built statically (`scripts/build-static-envd`), it runs in any template's root filesystem,
//! whatever C library it has or lacks; a node given it with `--envd-binary` injects it into
//! every sandbox instead of its own binary.

fn main() -> std::process::ExitCode {
    // The node starts envd as `ENVD envd ARGS` whichever binary ENVD is: the multicall one
    // needs the word, this one skips it.
    let mut args = std::env::args_os().skip(1).peekable();
    if args.peek().is_some_and(|a| a == "envd") {
        args.next();
    }
    envd::main(args)
}
