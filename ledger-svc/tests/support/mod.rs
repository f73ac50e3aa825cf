//! Test support: a fresh database per test on either backend, a ledger serving it, and a
//! TCP proxy that can cut a ledger off from PostgreSQL.
//!
//! PostgreSQL tests use `SANDBOXSCHED_TEST_POSTGRES_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`) and a schema of their own; MariaDB tests
//! `SANDBOXSCHED_TEST_MYSQL_URL` (default `mysql://root@127.0.0.1:3306/test`) and a database of
//! their own. When the server is not reachable they fail, saying how to start it; they never
//! skip.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use ledger_client::LedgerClient;
use ledger_svc::{LedgerConfig, RunningLedger};
use sqlx::Connection;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Mutex;
use tokio::task::JoinHandle;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
    Mysql,
}

pub fn postgres_base_url() -> String {
    stack::services::postgres_url()
}

/// The PostgreSQL server's address, for a proxy in front of it.
pub fn postgres_addr() -> SocketAddr {
    postgres_base_url()
        .split('@')
        .nth(1)
        .and_then(|rest| rest.split('/').next())
        .expect("host:port in the PostgreSQL url")
        .parse()
        .expect("PostgreSQL address must be HOST:PORT with an IP")
}

/// A database of one's own for one test.
pub struct TestDb {
    pub backend: Backend,
    pub url: String,
    dir: Option<PathBuf>,
    schema: Option<String>,
    /// A MariaDB database of the test's own.
    database: Option<String>,
}

impl TestDb {
    pub async fn new(backend: Backend) -> Self {
        let tag = uuid::Uuid::new_v4().simple().to_string();
        match backend {
            Backend::Sqlite => {
                let dir = std::env::temp_dir().join(format!("ledger-test-{tag}"));
                std::fs::create_dir_all(&dir).expect("create temp dir");
                let url = format!("sqlite://{}", dir.join("ledger.db").display());
                Self {
                    backend,
                    url,
                    dir: Some(dir),
                    schema: None,
                    database: None,
                }
            }
            Backend::Postgres => {
                let base = postgres_base_url();
                let schema = format!("t_{tag}");
                let mut conn = sqlx::PgConnection::connect(&base)
                    .await
                    .unwrap_or_else(|err| stack::services::postgres_missing(err));
                sqlx::query(&format!("CREATE SCHEMA {schema}"))
                    .execute(&mut conn)
                    .await
                    .expect("create test schema");
                let sep = if base.contains('?') { '&' } else { '?' };
                let url = format!("{base}{sep}options[search_path]={schema}");
                Self {
                    backend,
                    url,
                    dir: None,
                    schema: Some(schema),
                    database: None,
                }
            }
            Backend::Mysql => {
                let base = stack::services::mysql_url();
                let database = format!("t_{tag}");
                let mut conn = sqlx::MySqlConnection::connect(&base)
                    .await
                    .unwrap_or_else(|err| stack::services::mysql_missing(err));
                sqlx::query(&format!("CREATE DATABASE {database}"))
                    .execute(&mut conn)
                    .await
                    .expect("create test database");
                let server = base.rsplit_once('/').map_or(base.as_str(), |(server, _)| server);
                Self {
                    backend,
                    url: format!("{server}/{database}"),
                    dir: None,
                    schema: None,
                    database: Some(database),
                }
            }
        }
    }

    /// The same database reached through `proxy` (PostgreSQL only).
    pub fn url_via(&self, proxy: SocketAddr) -> String {
        let base = postgres_base_url();
        let target = base
            .split('@')
            .nth(1)
            .and_then(|rest| rest.split('/').next())
            .unwrap_or("");
        self.url.replacen(target, &proxy.to_string(), 1)
    }

    pub async fn start_ledger(&self) -> RunningLedger {
        self.start_ledger_with(|_| {}).await
    }

    pub async fn start_ledger_with(&self, tweak: impl FnOnce(&mut LedgerConfig)) -> RunningLedger {
        let mut config = LedgerConfig::new("127.0.0.1:0".parse().expect("addr"), &self.url);
        tweak(&mut config);
        ledger_svc::start(config).await.expect("ledger starts")
    }

    pub async fn cleanup(self) {
        if let Some(dir) = &self.dir {
            let _ = std::fs::remove_dir_all(dir);
        }
        if let Some(database) = &self.database {
            if let Ok(mut conn) = sqlx::MySqlConnection::connect(&stack::services::mysql_url()).await {
                let _ = sqlx::query(&format!("DROP DATABASE {database}"))
                    .execute(&mut conn)
                    .await;
            }
        }
        if let Some(schema) = &self.schema {
            if let Ok(mut conn) = sqlx::PgConnection::connect(&postgres_base_url()).await {
                let _ = sqlx::query(&format!("DROP SCHEMA {schema} CASCADE"))
                    .execute(&mut conn)
                    .await;
            }
        }
    }
}

pub fn client(ledger: &RunningLedger) -> LedgerClient {
    LedgerClient::connect_lazy(&ledger.endpoint(), &mtls::Security::Plaintext).expect("client")
}

/// A TCP proxy in front of a server, which a test can cut (closing every connection and
/// refusing new ones) and restore on the same port.
pub struct CuttableProxy {
    pub addr: SocketAddr,
    target: SocketAddr,
    accept: Arc<Mutex<Option<JoinHandle<()>>>>,
    conns: Arc<std::sync::Mutex<Vec<JoinHandle<()>>>>,
    /// While set, a connection that sends COMMIT has it delivered and never hears back.
    stall_commits: Arc<AtomicBool>,
}

impl CuttableProxy {
    pub async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy addr");
        let proxy = Self {
            addr,
            target,
            accept: Arc::new(Mutex::new(None)),
            conns: Arc::new(std::sync::Mutex::new(Vec::new())),
            stall_commits: Arc::new(AtomicBool::new(false)),
        };
        proxy.serve(listener).await;
        proxy
    }

    async fn serve(&self, listener: TcpListener) {
        let target = self.target;
        let conns = self.conns.clone();
        let stall = self.stall_commits.clone();
        let accept = tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                let stall = stall.clone();
                let conn = tokio::spawn(async move {
                    if let Ok(outbound) = TcpStream::connect(target).await {
                        relay(inbound, outbound, stall).await;
                    }
                });
                conns.lock().expect("conns").push(conn);
            }
        });
        *self.accept.lock().await = Some(accept);
    }

    /// Closes every proxied connection and stops accepting.
    pub async fn cut(&self) {
        if let Some(accept) = self.accept.lock().await.take() {
            accept.abort();
            let _ = accept.await;
        }
        for conn in self.conns.lock().expect("conns").drain(..) {
            conn.abort();
        }
    }

    /// From now on, a COMMIT reaches the database (which commits it) and its answer, and all
    /// that follows on that connection, is swallowed: the reply lost, the outcome unknown.
    pub fn stall_commits(&self, on: bool) {
        self.stall_commits.store(on, Ordering::SeqCst);
    }

    /// Accepts again on the same port.
    pub async fn restore(&self) {
        let listener = TcpListener::bind(self.addr).await.expect("rebind proxy");
        self.serve(listener).await;
    }
}

/// Copies both ways; once the client sends COMMIT while `stall` is set, the server's answers
/// on this connection are read and dropped.
async fn relay(inbound: TcpStream, outbound: TcpStream, stall: Arc<AtomicBool>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (mut client_rx, mut client_tx) = inbound.into_split();
    let (mut server_rx, mut server_tx) = outbound.into_split();
    let swallow = Arc::new(AtomicBool::new(false));
    let to_server = {
        let swallow = swallow.clone();
        async move {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let n = match client_rx.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                if stall.load(Ordering::SeqCst) && buf[..n].windows(6).any(|w| w == b"COMMIT") {
                    swallow.store(true, Ordering::SeqCst);
                }
                if server_tx.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
        }
    };
    let to_client = async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match server_rx.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if swallow.load(Ordering::SeqCst) {
                continue;
            }
            if client_tx.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    };
    tokio::join!(to_server, to_client);
}
