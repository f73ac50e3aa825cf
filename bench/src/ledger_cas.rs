//! `bench ledger-cas`: compare-and-swap throughput of a real ledger-svc over gRPC, and the
//! plan-commit scenario under node-document churn.
//!
//! - distinct: 32 writers, each updating its own document at the version it last wrote;
//! - hot: 32 writers on one document, each reading it and writing back at that version (most
//!   attempts conflict; successful swaps per second is the figure);
//! - churn: a reporter rewrites two node documents every 10 ms while a planner reads a
//!   snapshot, plans for 20 ms and commits a plan: once guarding only the plan document (the
//!   rule), once also guarding the node documents it read (the shape that never lands).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use ledger_client::{LedgerClient, LedgerError, Txn};
use ledger_svc::LedgerConfig;
use serde_json::json;
use sqlx::Connection;

use crate::report::Report;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Which database the ledger runs on.
    #[arg(long, value_enum, default_value = "sqlite")]
    backend: BackendArg,
    /// PostgreSQL to use with `--backend postgres` (a scratch schema is created and dropped).
    #[arg(
        long,
        env = "SANDBOXSCHED_TEST_POSTGRES_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/test"
    )]
    postgres_url: String,
    /// MariaDB to use with `--backend mysql` (a scratch database is created and dropped).
    #[arg(
        long,
        env = "SANDBOXSCHED_TEST_MYSQL_URL",
        default_value = "mysql://root@127.0.0.1:3306/test"
    )]
    mysql_url: String,
    /// Concurrent writers.
    #[arg(long, default_value_t = 32)]
    writers: usize,
    /// Seconds each throughput phase runs.
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Plan commits attempted in each shape of the churn scenario.
    #[arg(long, default_value_t = 40)]
    plans: u32,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum BackendArg {
    Sqlite,
    Postgres,
    /// MariaDB (or MySQL).
    Mysql,
}

/// Where the benchmark's ledger keeps its data, and how to clean it up.
enum Scratch {
    Dir(std::path::PathBuf),
    Schema { base: String, schema: String },
    Database { base: String, database: String },
}

impl Scratch {
    async fn create(args: &Args) -> anyhow::Result<(Self, String)> {
        let tag = uuid::Uuid::new_v4().simple().to_string();
        match args.backend {
            BackendArg::Sqlite => {
                let dir = std::env::temp_dir().join(format!("bench-ledger-{tag}"));
                std::fs::create_dir_all(&dir)?;
                let url = format!("sqlite://{}", dir.join("ledger.db").display());
                Ok((Scratch::Dir(dir), url))
            }
            BackendArg::Postgres => {
                let schema = format!("bench_{tag}");
                let mut conn = sqlx::PgConnection::connect(&args.postgres_url)
                    .await
                    .with_context(|| format!("PostgreSQL is not reachable at {}", args.postgres_url))?;
                sqlx::query(&format!("CREATE SCHEMA {schema}"))
                    .execute(&mut conn)
                    .await?;
                let sep = if args.postgres_url.contains('?') { '&' } else { '?' };
                let url = format!("{}{sep}options[search_path]={schema}", args.postgres_url);
                Ok((
                    Scratch::Schema {
                        base: args.postgres_url.clone(),
                        schema,
                    },
                    url,
                ))
            }
            BackendArg::Mysql => {
                let database = format!("bench_{tag}");
                let mut conn = sqlx::MySqlConnection::connect(&args.mysql_url)
                    .await
                    .with_context(|| format!("MariaDB is not reachable at {}", args.mysql_url))?;
                sqlx::query(&format!("CREATE DATABASE {database}"))
                    .execute(&mut conn)
                    .await?;
                let server = args
                    .mysql_url
                    .rsplit_once('/')
                    .map_or(args.mysql_url.as_str(), |(s, _)| s);
                let url = format!("{server}/{database}");
                Ok((
                    Scratch::Database {
                        base: args.mysql_url.clone(),
                        database,
                    },
                    url,
                ))
            }
        }
    }

    async fn remove(self) {
        match self {
            Scratch::Dir(dir) => {
                let _ = std::fs::remove_dir_all(dir);
            }
            Scratch::Schema { base, schema } => {
                if let Ok(mut conn) = sqlx::PgConnection::connect(&base).await {
                    let _ = sqlx::query(&format!("DROP SCHEMA {schema} CASCADE"))
                        .execute(&mut conn)
                        .await;
                }
            }
            Scratch::Database { base, database } => {
                if let Ok(mut conn) = sqlx::MySqlConnection::connect(&base).await {
                    let _ = sqlx::query(&format!("DROP DATABASE {database}"))
                        .execute(&mut conn)
                        .await;
                }
            }
        }
    }
}

pub async fn run(args: Args) -> anyhow::Result<Report> {
    let (scratch, url) = Scratch::create(&args).await?;
    let ledger = ledger_svc::start(LedgerConfig::new("127.0.0.1:0".parse()?, url)).await?;
    // A few connections, as several service replicas would have.
    let clients: Vec<LedgerClient> = (0..4)
        .map(|_| LedgerClient::connect_lazy(&ledger.endpoint(), &mtls::Security::Plaintext))
        .collect::<Result<_, _>>()?;
    let duration = Duration::from_secs_f64(args.seconds);

    let distinct = distinct_writers(&clients, args.writers, duration).await?;
    let (hot_ok, hot_attempts) = hot_writers(&clients, args.writers, duration).await?;
    let plan_only = plan_commits_under_churn(&clients[0], args.plans, false).await?;
    let seed_shape = plan_commits_under_churn(&clients[0], args.plans, true).await?;

    ledger.stop().await;
    scratch.remove().await;

    let backend = match args.backend {
        BackendArg::Sqlite => "sqlite",
        BackendArg::Postgres => "postgres",
        BackendArg::Mysql => "mariadb",
    };
    let mut report = Report::new(format!(
        "ledger-cas on {backend}, {} writers, {:.1} s a phase",
        args.writers, args.seconds
    ));
    report
        .figure("backend", backend, "")
        .figure("cas_per_sec_distinct", distinct.round() as u64, "CAS/s")
        .figure("cas_per_sec_hot", hot_ok.round() as u64, "successful CAS/s")
        .figure("cas_attempts_per_sec_hot", hot_attempts.round() as u64, "attempts/s")
        .figure(
            "plan_commit_success_under_churn",
            plan_only,
            "of plan commits (plan document only)",
        )
        .figure(
            "seed_shape_commit_success",
            seed_shape,
            "of plan commits (plan + node documents read)",
        );
    Ok(report)
}

/// Each writer updates its own document; returns successful CAS per second.
async fn distinct_writers(clients: &[LedgerClient], writers: usize, duration: Duration) -> anyhow::Result<f64> {
    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for w in 0..writers {
        let c = clients[w % clients.len()].clone();
        let (done, stop) = (done.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let id = format!("w{w}");
            let mut version = c.compare(Txn::new().create("bench", &id, &0u64)?).await?.versions[0];
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                version = c.compare(Txn::new().update("bench", &id, version, &n)?).await?.versions[0];
                done.fetch_add(1, Ordering::Relaxed);
            }
            Ok::<_, LedgerError>(())
        }));
    }
    let started = Instant::now();
    tokio::time::sleep(duration).await;
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await??;
    }
    Ok(done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64())
}

/// Every writer reads one document and writes it back at the version read; returns
/// (successful CAS per second, attempts per second).
async fn hot_writers(clients: &[LedgerClient], writers: usize, duration: Duration) -> anyhow::Result<(f64, f64)> {
    clients[0].compare(Txn::new().create("bench", "hot", &0u64)?).await?;
    let ok = Arc::new(AtomicU64::new(0));
    let attempts = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for w in 0..writers {
        let c = clients[w % clients.len()].clone();
        let (ok, attempts, stop) = (ok.clone(), attempts.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let Some(doc) = c.get::<u64>("bench", "hot").await? else {
                    continue;
                };
                attempts.fetch_add(1, Ordering::Relaxed);
                match c
                    .compare(Txn::new().update("bench", "hot", doc.version, &(doc.value + 1))?)
                    .await
                {
                    Ok(_) => {
                        ok.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(LedgerError::Conflict { .. }) => {}
                    Err(err) => return Err(err),
                }
            }
            Ok(())
        }));
    }
    let started = Instant::now();
    tokio::time::sleep(duration).await;
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await??;
    }
    let secs = started.elapsed().as_secs_f64();
    Ok((
        ok.load(Ordering::Relaxed) as f64 / secs,
        attempts.load(Ordering::Relaxed) as f64 / secs,
    ))
}

/// Plan commits while node documents churn; returns the fraction of plan commits that succeeded.
async fn plan_commits_under_churn(c: &LedgerClient, plans: u32, seed_shape: bool) -> anyhow::Result<f64> {
    let tag = if seed_shape { "seed" } else { "fixed" };
    let nodes = [format!("{tag}-n1"), format!("{tag}-n2")];
    let plan_id = format!("{tag}-plan");
    for id in &nodes {
        c.compare(Txn::new().create("node", id, &json!({"available_ratio": 0.5}))?)
            .await?;
    }
    c.compare(Txn::new().create("plan", &plan_id, &json!({"seq": 0}))?)
        .await?;

    let stop = Arc::new(AtomicBool::new(false));
    let reporter = {
        let (c, stop, nodes) = (c.clone(), stop.clone(), nodes.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(10));
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                for id in &nodes {
                    let Some(doc) = c.get::<serde_json::Value>("node", id).await? else {
                        continue;
                    };
                    n += 1;
                    let txn = Txn::new().update("node", id, doc.version, &json!({"available_ratio": 0.5, "n": n}))?;
                    c.compare(txn).await?;
                }
            }
            Ok::<_, LedgerError>(())
        })
    };

    let mut succeeded = 0u32;
    for seq in 1..=plans {
        let (snapshot, _) = c.list::<serde_json::Value>("node", tag).await?;
        let plan = c
            .get::<serde_json::Value>("plan", &plan_id)
            .await?
            .context("plan document")?;
        // Planning time, during which node agents keep reporting.
        tokio::time::sleep(Duration::from_millis(20)).await;
        let mut txn = Txn::new().update("plan", &plan_id, plan.version, &json!({"seq": seq}))?;
        if seed_shape {
            for node in &snapshot {
                txn = txn.check("node", &node.key.id, node.version);
            }
        }
        match c.compare(txn).await {
            Ok(_) => succeeded += 1,
            Err(LedgerError::Conflict { .. }) => {}
            Err(err) => return Err(err.into()),
        }
    }
    stop.store(true, Ordering::Relaxed);
    reporter.await??;
    Ok(f64::from(succeeded) / f64::from(plans))
}
