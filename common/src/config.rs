//! One configuration scheme for every binary: a TOML file, then environment variables, then
//! flags, each overriding the one before.
//!
//! A file (`--config FILE`, or `SANDBOXSCHED_CONFIG`) holds one table per binary, named as the
//! binary; its keys are that binary's long flag names (`-` or `_`):
//!
//! ```toml
//! [placement-svc]
//! listen = "0.0.0.0:7002"
//! redis-url = "redis://10.0.0.5:6379"
//! k = 3
//!
//! [balance-svc]
//! interval-ms = 5000
//! threshold = 0.1
//! ```
//!
//! A file value becomes the flag's default, so the flag's environment twin and the flag itself
//! still override it, and `--help` lists every setting. An unknown key, or a value of the wrong
//! shape, stops the binary with a message naming the file, the table and the key. Values are
//! then validated by each service as before.

use std::path::{Path, PathBuf};

use clap::CommandFactory;

/// Why a configuration file was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read configuration file {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("configuration file {path} is not valid TOML: {reason}")]
    Syntax { path: PathBuf, reason: String },
    #[error("[{table}] {key} in {path}: {reason}")]
    Key {
        path: PathBuf,
        table: String,
        key: String,
        reason: String,
    },
}

/// The file named by `--config FILE` / `--config=FILE` among `args`, else by `SANDBOXSCHED_CONFIG`.
fn config_path(args: &[String]) -> Option<PathBuf> {
    let mut iter = args.iter();
    while let Some(arg) = iter.next() {
        if arg == "--config" {
            return iter.next().map(PathBuf::from);
        }
        if let Some(path) = arg.strip_prefix("--config=") {
            return Some(PathBuf::from(path));
        }
    }
    std::env::var_os("SANDBOXSCHED_CONFIG")
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
}

/// The command with the file's values (table `binary`) as its flags' defaults.
pub fn command_with_file<C: CommandFactory>(
    binary: &str,
    path: &Path,
    text: &str,
) -> Result<clap::Command, ConfigError> {
    let mut command = C::command();
    let document: toml::Table = text.parse().map_err(|e: toml::de::Error| ConfigError::Syntax {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    let Some(section) = document.get(binary) else {
        return Ok(command);
    };
    let refuse = |key: &str, reason: String| ConfigError::Key {
        path: path.to_path_buf(),
        table: binary.to_string(),
        key: key.to_string(),
        reason,
    };
    let toml::Value::Table(section) = section else {
        return Err(refuse("", "must be a table of settings".into()));
    };
    for (key, value) in section {
        let long = key.replace('_', "-");
        let has = |c: &clap::Command| {
            c.get_arguments()
                .find(|a| a.get_long() == Some(long.as_str()) && long != "config")
                .map(|a| a.get_id().clone())
        };
        // A flag of the binary itself, or of one of its subcommands (the launcher's `up`).
        let found = has(&command).map(|id| (None, id)).or_else(|| {
            command
                .get_subcommands()
                .find_map(|sc| has(sc).map(|id| (Some(sc.get_name().to_string()), id)))
        });
        let Some((subcommand, id)) = found else {
            let known: Vec<String> = std::iter::once(&command)
                .chain(command.get_subcommands())
                .flat_map(|c| c.get_arguments().filter_map(|a| a.get_long().map(str::to_string)))
                .filter(|l| l != "config" && l != "help" && l != "version")
                .collect();
            return Err(refuse(key, format!("no such setting (known: {})", known.join(", "))));
        };
        let text = match value {
            toml::Value::String(s) => s.clone(),
            toml::Value::Integer(i) => i.to_string(),
            toml::Value::Float(f) => f.to_string(),
            toml::Value::Boolean(b) => b.to_string(),
            other => {
                return Err(refuse(
                    key,
                    format!("must be a string, number or boolean, not {}", other.type_str()),
                ))
            }
        };
        // Defaults live as long as the command, which lives as long as the process.
        let text: &'static str = Box::leak(text.into_boxed_str());
        command = match subcommand {
            None => command.mut_arg(id, |arg| arg.default_value(text)),
            Some(name) => command.mut_subcommand(name, |sc| sc.mut_arg(id, |arg| arg.default_value(text))),
        };
    }
    Ok(command)
}

/// Parses the binary's flags over its configuration file and environment. Exits with a clear
/// message (status 2) on a bad file, as clap does on a bad flag.
pub fn parse<C: clap::Parser>(binary: &str) -> C {
    let args: Vec<String> = std::env::args().collect();
    let command = match config_path(&args) {
        None => C::command(),
        Some(path) => {
            let loaded = std::fs::read_to_string(&path)
                .map_err(|source| ConfigError::Read {
                    path: path.clone(),
                    source,
                })
                .and_then(|text| command_with_file::<C>(binary, &path, &text));
            match loaded {
                Ok(command) => command,
                Err(err) => {
                    eprintln!("error: {err}");
                    std::process::exit(2);
                }
            }
        }
    };
    let matches = command.get_matches_from(args);
    match C::from_arg_matches(&matches) {
        Ok(parsed) => parsed,
        Err(err) => err.exit(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{FromArgMatches, Parser};

    #[derive(Parser, Debug)]
    struct Demo {
        #[arg(long)]
        config: Option<PathBuf>,
        #[arg(long, env = "DEMO_CONFIG_TEST_LISTEN", default_value = "127.0.0.1:1")]
        listen: String,
        #[arg(long, default_value_t = 3)]
        k: usize,
        #[arg(long)]
        verbose: bool,
    }

    fn parse_with(file: &str, args: &[&str]) -> Result<Demo, String> {
        let command = command_with_file::<Demo>("demo", Path::new("demo.toml"), file).map_err(|e| e.to_string())?;
        let matches = command
            .try_get_matches_from(std::iter::once("demo").chain(args.iter().copied()))
            .map_err(|e| e.to_string())?;
        Demo::from_arg_matches(&matches).map_err(|e| e.to_string())
    }

    #[test]
    fn a_password_in_a_url_is_not_repeated() {
        assert_eq!(
            redacted("postgres://app:s3cret@db:5432/x?sslmode=require"),
            "postgres://app:***@db:5432/x?sslmode=require"
        );
        assert_eq!(redacted("redis://:s3cret@redis:6379"), "redis://:***@redis:6379");
        assert_eq!(redacted("redis://127.0.0.1:6379"), "redis://127.0.0.1:6379");
        assert_eq!(redacted("postgres://postgres@db/x"), "postgres://postgres@db/x");
        assert_eq!(redacted("sqlite://data/ledger.db"), "sqlite://data/ledger.db");
        assert_eq!(redacted("nonsense"), "nonsense");
        assert_eq!(redacted("redis://:a/b?c#d@redis:6379/0"), "redis://:***@redis:6379/0");
        assert_eq!(redacted("postgres://u:p#1@db/x"), "postgres://u:***@db/x");
    }

    #[test]
    fn the_file_sets_defaults_and_flags_override_it() {
        let file = "[demo]\nlisten = \"0.0.0.0:9\"\nk = 5\n[other]\nk = 1\n";
        let demo = parse_with(file, &[]).unwrap();
        assert_eq!((demo.listen.as_str(), demo.k), ("0.0.0.0:9", 5));
        let demo = parse_with(file, &["--k", "7"]).unwrap();
        assert_eq!(demo.k, 7);
        let demo = parse_with("", &[]).unwrap();
        assert_eq!((demo.listen.as_str(), demo.k), ("127.0.0.1:1", 3));
        let demo = parse_with("[demo]\nverbose = true\n", &[]).unwrap();
        assert!(demo.verbose);
    }

    #[test]
    fn bad_files_are_refused_with_what_is_wrong() {
        let unknown = parse_with("[demo]\nlisen = \"x\"\n", &[]).unwrap_err();
        assert!(
            unknown.contains("[demo] lisen in demo.toml") && unknown.contains("listen"),
            "{unknown}"
        );
        let shape = parse_with("[demo]\nk = [1, 2]\n", &[]).unwrap_err();
        assert!(shape.contains("must be a string, number or boolean"), "{shape}");
        let syntax = parse_with("[demo\n", &[]).unwrap_err();
        assert!(syntax.contains("not valid TOML"), "{syntax}");
        let value = parse_with("[demo]\nk = \"many\"\n", &[]).unwrap_err();
        assert!(value.contains("many"), "{value}");
        assert_eq!(
            config_path(&["x".into(), "--config=a.toml".into()]),
            Some(PathBuf::from("a.toml"))
        );
    }
}

/// The secret a `--…-file` flag names (the operators' admin token), trimmed: refused when
/// other users could read the file, or when it holds nothing.
pub fn secret_file(path: &Path) -> Result<String, String> {
    let secret = mtls::read_secret(path).map_err(|e| format!("reading the secret in {}: {e}", path.display()))?;
    let secret = secret.trim();
    if secret.is_empty() {
        return Err(format!("{} is empty", path.display()));
    }
    Ok(secret.to_string())
}

/// `url` with the password of its user part (`scheme://user:PASSWORD@host/…`) replaced by
/// `***`: for error messages and logs, which other people read. A password holding an
/// unencoded `/`, `?` or `#` (a malformed URL, the very case that ends up in an error) is
/// still hidden: without an `@` before the first of those, the user part runs to the last `@`.
pub fn redacted(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let user_end = match rest[..authority_end].rfind('@') {
        Some(at) => Some(at),
        None => rest.rfind('@'),
    };
    let Some(user_end) = user_end else {
        return url.to_string();
    };
    let (user, host) = (&rest[..user_end], &rest[user_end..]);
    match user.split_once(':') {
        Some((name, _password)) => format!("{scheme}://{name}:***{host}"),
        None => url.to_string(),
    }
}

/// How a binary's gRPC traffic is protected: the flags every service binary takes.
///
/// Mutual TLS is the only way a service serves a cluster; `--insecure-plaintext` exists for a
/// developer's single-user machine and says so loudly. Neither given is refused, so a
/// deployment that forgot its certificates does not start open.
#[derive(clap::Args, Debug, Clone)]
pub struct SecurityArgs {
    /// Directory of the cluster's certificates (`sandboxsched-ctl certs DIR` makes one):
    /// `ca.pem` and this service's `<role>.pem` / `<role>.key` (0600).
    #[arg(long, env = "SANDBOXSCHED_TLS_DIR")]
    pub tls_dir: Option<PathBuf>,
    /// Serve and call gRPC without TLS or authorisation: anyone who reaches the port is
    /// trusted. Only for a machine with no other users and no network peers.
    #[arg(long, env = "SANDBOXSCHED_INSECURE_PLAINTEXT", conflicts_with = "tls_dir")]
    pub insecure_plaintext: bool,
}

impl SecurityArgs {
    /// The security these flags ask for, as `role`.
    pub fn security(&self, role: mtls::Role) -> Result<mtls::Security, String> {
        self.load(role.name(), |dir| mtls::Security::load(dir, role))
    }

    /// The security these flags ask for, as node `node_id` (its own pair, `node-ID.pem`).
    pub fn node_security(&self, node_id: &str) -> Result<mtls::Security, String> {
        self.load(&format!("node {node_id}"), |dir| {
            mtls::Security::load_node(dir, node_id)
        })
    }

    fn load(
        &self,
        role: &str,
        load: impl FnOnce(&std::path::Path) -> Result<mtls::Security, mtls::TlsError>,
    ) -> Result<mtls::Security, String> {
        match (&self.tls_dir, self.insecure_plaintext) {
            (Some(dir), _) => {
                load(dir).map_err(|e| format!("loading the {role} certificate from {}: {e}", dir.display()))
            }
            (None, true) => {
                tracing::warn!("gRPC in plaintext: every local user and network peer that reaches the port is trusted");
                Ok(mtls::Security::Plaintext)
            }
            (None, false) => Err(format!(
                "no certificates: give --tls-dir DIR (make one with `sandboxsched-ctl certs DIR`) \
                 or, on a single-user development machine only, --insecure-plaintext ({role})"
            )),
        }
    }
}
