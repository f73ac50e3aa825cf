//! The SQL adapter: documents, change log and revision counter on SQLite, PostgreSQL or
//! MariaDB (MySQL).
//!
//! The backends run the same statements where their SQL agrees (sqlx's `QueryBuilder` writes
//! each one's placeholder style), so one body of code serves all: [`with_pool!`] expands it once
//! per backend with concrete types, which keeps sqlx's generic bounds out of sight. Where
//! MariaDB's dialect differs ([`Dialect`]: no `UPDATE … RETURNING`, `ON DUPLICATE KEY` for
//! upserts, row lists for `IN`, `?` placeholders), the statement text is chosen by backend.
//!
//! # Why writes are batched
//! A global revision means writes must commit in revision order, or a watcher could read
//! revision 11 before revision 10 becomes visible and then never see 10. So every write
//! transaction first locks the one-row revision counter and holds it to commit. That serialises
//! commits; to still commit thousands of compares a second, [`Store::apply`] takes a whole batch
//! of compares (see `committer`) and commits them in one transaction, one fsync, like a group
//! commit. Several ledger-svc replicas on one PostgreSQL stay correct: the counter lock orders
//! their batches too.

use std::collections::HashMap;
use std::path::Path;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sqlx::migrate::{Migration, MigrationType, Migrator};
use sqlx::mysql::{MySqlConnectOptions, MySqlPool, MySqlPoolOptions};
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{QueryBuilder, Row};

use crate::model::{plan_batch, Change, Current, DocKey, Document, Entry, FinalState, Outcome};

/// Rows per multi-row statement: keeps every statement far below both backends' limits on
/// bound parameters (SQLite 32,766; PostgreSQL 65,535).
const ROWS_PER_STATEMENT: usize = 500;

/// PostgreSQL ends any statement that runs longer (milliseconds).
const STATEMENT_TIMEOUT_MS: &str = "5000";
/// PostgreSQL aborts a transaction left idle this long (milliseconds): a ledger that lost its
/// connection mid-transaction does not keep the counter's row locked.
const IDLE_IN_TRANSACTION_MS: &str = "10000";

/// Why a store operation failed.
#[derive(Clone, Debug, thiserror::Error)]
pub enum StoreError {
    /// The database cannot be reached or is shutting down; retrying later may succeed.
    #[error("database unavailable: {0}")]
    Unavailable(String),
    /// A write's COMMIT was sent but its answer never came (connection lost, deadline
    /// passed): it may or may not have landed. Callers must find out by reading, never assume.
    #[error("outcome unknown: {0}")]
    OutcomeUnknown(String),
    /// The database answered with an error that retrying will not fix.
    #[error("database error: {0}")]
    Internal(String),
    /// The database URL cannot be used.
    #[error("cannot use database url {url:?}: {reason}")]
    BadUrl { url: String, reason: String },
}

impl From<sqlx::Error> for StoreError {
    fn from(err: sqlx::Error) -> Self {
        use sqlx::Error as E;
        match &err {
            E::Io(_) | E::Tls(_) | E::Protocol(_) | E::PoolTimedOut | E::PoolClosed | E::WorkerCrashed => {
                StoreError::Unavailable(err.to_string())
            }
            E::Database(db) => {
                // PostgreSQL SQLSTATE classes 08 (connection), 53 (resources) and 57 (operator
                // intervention, e.g. admin shutdown), and SQLite's BUSY and LOCKED codes, are
                // worth a retry; anything else is a bug or bad data.
                let code = db.code().unwrap_or_default();
                let transient = if code.len() == 5 {
                    ["08", "53", "57"].iter().any(|class| code.starts_with(class))
                } else {
                    matches!(code.as_ref(), "5" | "6" | "261" | "262" | "517")
                };
                if transient {
                    StoreError::Unavailable(err.to_string())
                } else {
                    StoreError::Internal(err.to_string())
                }
            }
            _ => StoreError::Internal(err.to_string()),
        }
    }
}

/// A failed COMMIT: an answer from the database (an error it reports) means it did not
/// commit; anything else (I/O, protocol, a closed pool) leaves the outcome unknown.
fn commit_error(err: sqlx::Error) -> StoreError {
    match err {
        sqlx::Error::Database(_) => err.into(),
        other => StoreError::OutcomeUnknown(format!("COMMIT sent, no answer: {other}")),
    }
}

impl From<sqlx::migrate::MigrateError> for StoreError {
    fn from(err: sqlx::migrate::MigrateError) -> Self {
        match err {
            sqlx::migrate::MigrateError::Execute(inner) => inner.into(),
            other => StoreError::Internal(other.to_string()),
        }
    }
}

/// The counter row: the latest committed revision, and the newest revision whose change-log
/// rows were deleted by compaction (a watch must start after it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Head {
    pub revision: u64,
    pub compacted: u64,
}

/// Which changes a watcher wants.
#[derive(Clone, Debug, Default)]
pub struct Filter {
    /// Empty: every kind.
    pub kind: String,
    /// Empty: every id (only meaningful with a kind).
    pub id_prefix: String,
}

/// Which database a store runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
    /// MariaDB, or MySQL.
    Mysql,
}

#[derive(Clone)]
enum DbPool {
    Sqlite(SqlitePool),
    Postgres(PgPool),
    Mysql(MySqlPool),
}

/// Runs `$body` with `$pool` bound to the concrete pool of whichever backend is in use.
macro_rules! with_pool {
    ($self:expr, $pool:ident => $body:expr) => {
        match &$self.pool {
            DbPool::Sqlite($pool) => $body,
            DbPool::Postgres($pool) => $body,
            DbPool::Mysql($pool) => $body,
        }
    };
}

/// Reads text column `$i` of `$row`. MariaDB reports a `utf8mb4_bin` column (kinds and ids,
/// which must compare byte-wise) as binary, so there it arrives as bytes.
macro_rules! text {
    ($row:expr, $i:expr) => {
        match $row.try_get::<Option<String>, _>($i) {
            Ok(text) => text,
            Err(_) => $row
                .try_get::<Option<Vec<u8>>, _>($i)?
                .map(|bytes| String::from_utf8(bytes).map_err(|e| sqlx::Error::Decode(Box::new(e))))
                .transpose()?,
        }
    };
}

/// [`text!`] of a column that is never NULL.
macro_rules! text_req {
    ($row:expr, $i:expr) => {
        text!($row, $i).ok_or_else(|| sqlx::Error::ColumnDecode {
            index: $i.to_string(),
            source: "unexpected NULL".into(),
        })?
    };
}

/// The statements whose text differs on MariaDB.
struct Dialect {
    /// Locks the revision counter's row for the transaction and reads it.
    lock_head: &'static str,
    /// Opens `(kind, id) IN (…)` over a list of pairs, and how each pair after the first starts.
    pairs_in: &'static str,
    /// Appended to a multi-row `INSERT INTO documents …`: replace a document that exists.
    upsert: &'static str,
    get: &'static str,
    set_head: &'static str,
    compact_changes: &'static str,
    compact_meta: &'static str,
}

const STANDARD: Dialect = Dialect {
    lock_head: "UPDATE ledger_meta SET revision = revision WHERE singleton = 1 RETURNING revision",
    pairs_in: "(kind, id) IN (VALUES ",
    upsert: " ON CONFLICT (kind, id) DO UPDATE SET version = excluded.version, \
             create_revision = excluded.create_revision, \
             mod_revision = excluded.mod_revision, payload = excluded.payload",
    get: "SELECT m.revision, d.version, d.create_revision, d.mod_revision, d.payload \
          FROM ledger_meta m LEFT JOIN documents d ON d.kind = $1 AND d.id = $2 \
          WHERE m.singleton = 1",
    set_head: "UPDATE ledger_meta SET revision = $1 WHERE singleton = 1",
    compact_changes: "DELETE FROM changes WHERE revision <= $1",
    compact_meta: "UPDATE ledger_meta SET compacted = $1 WHERE singleton = 1 AND compacted < $1",
};

const MARIADB: Dialect = Dialect {
    lock_head: "SELECT revision FROM ledger_meta WHERE singleton = 1 FOR UPDATE",
    pairs_in: "(kind, id) IN (",
    upsert: " ON DUPLICATE KEY UPDATE version = VALUES(version), \
             create_revision = VALUES(create_revision), \
             mod_revision = VALUES(mod_revision), payload = VALUES(payload)",
    get: "SELECT m.revision, d.version, d.create_revision, d.mod_revision, d.payload \
          FROM ledger_meta m LEFT JOIN documents d ON d.kind = ? AND d.id = ? \
          WHERE m.singleton = 1",
    set_head: "UPDATE ledger_meta SET revision = ? WHERE singleton = 1",
    compact_changes: "DELETE FROM changes WHERE revision <= ?",
    compact_meta: "UPDATE ledger_meta SET compacted = ? WHERE singleton = 1 AND compacted < ?",
};

/// The ledger's tables on one database.
#[derive(Clone)]
pub struct Store {
    pool: DbPool,
}

fn migrator(backend: Backend) -> Migrator {
    let sql = match backend {
        Backend::Sqlite => include_str!("../migrations/sqlite/0001_documents.sql"),
        Backend::Postgres => include_str!("../migrations/postgres/0001_documents.sql"),
        Backend::Mysql => include_str!("../migrations/mysql/0001_documents.sql"),
    };
    Migrator {
        migrations: vec![Migration::new(
            1,
            "documents".into(),
            MigrationType::Simple,
            sql.into(),
            false,
        )]
        .into(),
        ..Migrator::DEFAULT
    }
}

fn to_u64(value: i64) -> u64 {
    u64::try_from(value).unwrap_or(0)
}

fn to_i64(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

impl Store {
    /// Opens (and for SQLite creates) the database at `url` without touching it yet:
    /// `sqlite://PATH` or `postgres://…`. Call [`Store::migrate`] before use.
    pub fn open(url: &str) -> Result<Self, StoreError> {
        let bad = |reason: String| StoreError::BadUrl {
            url: common::config::redacted(url),
            reason,
        };
        let pool = if url.starts_with("sqlite:") {
            let options = SqliteConnectOptions::from_str(url)
                .map_err(|e| bad(e.to_string()))?
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Wal)
                .synchronous(SqliteSynchronous::Full)
                .busy_timeout(Duration::from_secs(5));
            let file = Path::new(options.get_filename());
            if let Some(parent) = file.parent() {
                if !parent.as_os_str().is_empty() {
                    std::fs::create_dir_all(parent)
                        .map_err(|e| bad(format!("cannot create {}: {e}", parent.display())))?;
                }
            }
            // Every document (manifests, templates, plans) is the ledger's alone: the file is
            // made 0600 before SQLite opens it (its -wal and -shm files take the same mode),
            // and an older file is closed too.
            if file.as_os_str() != ":memory:" && !file.as_os_str().is_empty() {
                use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
                std::fs::OpenOptions::new()
                    .write(true)
                    .create(true)
                    .truncate(false)
                    .mode(0o600)
                    .open(file)
                    .and_then(|f| f.set_permissions(std::fs::Permissions::from_mode(0o600)))
                    .map_err(|e| bad(format!("cannot create {}: {e}", file.display())))?;
            }
            DbPool::Sqlite(
                SqlitePoolOptions::new()
                    .max_connections(8)
                    .acquire_timeout(Duration::from_secs(3))
                    .connect_lazy_with(options),
            )
        } else if url.starts_with("postgres:") || url.starts_with("postgresql:") {
            // Server-side bounds, so a stuck statement or a vanished client cannot hold the
            // revision counter's row lock for ever: statements end after the timeout, an idle
            // transaction is aborted, and the server probes idle connections.
            let options = PgConnectOptions::from_str(url)
                .map_err(|e| bad(e.to_string()))?
                .options([
                    ("statement_timeout", STATEMENT_TIMEOUT_MS),
                    ("idle_in_transaction_session_timeout", IDLE_IN_TRANSACTION_MS),
                    ("tcp_keepalives_idle", "10"),
                    ("tcp_keepalives_interval", "5"),
                    ("tcp_keepalives_count", "3"),
                ]);
            DbPool::Postgres(
                PgPoolOptions::new()
                    .max_connections(16)
                    .acquire_timeout(Duration::from_secs(3))
                    .connect_lazy_with(options),
            )
        } else if url.starts_with("mysql:") || url.starts_with("mariadb:") {
            let url = url.replacen("mariadb:", "mysql:", 1);
            // A lock waited on longer than this fails the statement instead of holding a writer.
            let options = MySqlConnectOptions::from_str(&url).map_err(|e| bad(e.to_string()))?;
            DbPool::Mysql(
                MySqlPoolOptions::new()
                    .max_connections(16)
                    .acquire_timeout(Duration::from_secs(3))
                    .after_connect(|conn, _| {
                        Box::pin(async move {
                            sqlx::query("SET SESSION innodb_lock_wait_timeout = 5")
                                .execute(conn)
                                .await
                                .map(drop)
                        })
                    })
                    .connect_lazy_with(options),
            )
        } else {
            return Err(bad(
                "expected sqlite://PATH, postgres://… or mysql://… (MariaDB)".to_string()
            ));
        };
        Ok(Self { pool })
    }

    pub fn backend(&self) -> Backend {
        match self.pool {
            DbPool::Sqlite(_) => Backend::Sqlite,
            DbPool::Postgres(_) => Backend::Postgres,
            DbPool::Mysql(_) => Backend::Mysql,
        }
    }

    fn dialect(&self) -> &'static Dialect {
        match self.pool {
            DbPool::Mysql(_) => &MARIADB,
            DbPool::Sqlite(_) | DbPool::Postgres(_) => &STANDARD,
        }
    }

    /// Applies the embedded migrations (idempotent; safe to run from several replicas).
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let migrator = migrator(self.backend());
        with_pool!(self, pool => migrator.run(pool).await?);
        Ok(())
    }

    /// Closes every connection.
    pub async fn close(&self) {
        with_pool!(self, pool => pool.close().await);
    }

    /// The latest committed revision and the compaction point.
    pub async fn head(&self) -> Result<Head, StoreError> {
        let sql = "SELECT revision, compacted FROM ledger_meta WHERE singleton = 1";
        let row = with_pool!(self, pool => {
            let row = sqlx::query(sql).fetch_one(pool).await?;
            (row.try_get::<i64, _>(0)?, row.try_get::<i64, _>(1)?)
        });
        Ok(Head {
            revision: to_u64(row.0),
            compacted: to_u64(row.1),
        })
    }

    /// One document (if it exists) and the revision the read saw, from one snapshot.
    pub async fn get(&self, key: &DocKey) -> Result<(Option<Document>, u64), StoreError> {
        let sql = self.dialect().get;
        with_pool!(self, pool => {
            let row = sqlx::query(sql).bind(&key.kind).bind(&key.id).fetch_one(pool).await?;
            let revision = to_u64(row.try_get::<i64, _>(0)?);
            let doc = match row.try_get::<Option<i64>, _>(1)? {
                None => None,
                Some(version) => Some(Document {
                    key: key.clone(),
                    version: to_u64(version),
                    create_revision: to_u64(row.try_get::<i64, _>(2)?),
                    mod_revision: to_u64(row.try_get::<i64, _>(3)?),
                    payload: row.try_get::<String, _>(4)?,
                }),
            };
            Ok((doc, revision))
        })
    }

    /// Up to `limit` documents of `kind` with ids after `after` (exclusive) and under
    /// `prefix`, ordered by id, with the revision they were read at.
    pub async fn list(
        &self,
        kind: &str,
        prefix: &str,
        after: &str,
        limit: u32,
    ) -> Result<(Vec<Document>, u64), StoreError> {
        let upper = crate::model::prefix_upper_bound(prefix);
        with_pool!(self, pool => {
            let mut qb = QueryBuilder::new(
                "SELECT m.revision, d.id, d.version, d.create_revision, d.mod_revision, d.payload \
                 FROM ledger_meta m LEFT JOIN documents d ON d.kind = ",
            );
            qb.push_bind(kind).push(" AND d.id > ").push_bind(after);
            if !prefix.is_empty() {
                qb.push(" AND d.id >= ").push_bind(prefix);
            }
            if let Some(upper) = &upper {
                qb.push(" AND d.id < ").push_bind(upper.as_str());
            }
            qb.push(" WHERE m.singleton = 1 ORDER BY d.id LIMIT ").push_bind(i64::from(limit));
            let rows = qb.build().fetch_all(pool).await?;
            let mut revision = 0;
            let mut docs = Vec::with_capacity(rows.len());
            for row in rows {
                revision = to_u64(row.try_get::<i64, _>(0)?);
                let Some(id) = text!(row, 1) else { continue };
                docs.push(Document {
                    key: DocKey::new(kind, id),
                    version: to_u64(row.try_get::<i64, _>(2)?),
                    create_revision: to_u64(row.try_get::<i64, _>(3)?),
                    mod_revision: to_u64(row.try_get::<i64, _>(4)?),
                    payload: row.try_get::<String, _>(5)?,
                });
            }
            Ok((docs, revision))
        })
    }

    /// Applies a batch of compares in one transaction: lock the revision counter, read the
    /// current versions of every document named, decide with [`plan_batch`], write the final
    /// documents and the change log, bump the counter, commit.
    ///
    /// `commit_sent` turns true just before COMMIT is sent: a caller that gives up waiting can
    /// tell "not applied" from "outcome unknown" by it.
    pub async fn apply(&self, compares: &[Vec<Entry>], commit_sent: &AtomicBool) -> Result<Vec<Outcome>, StoreError> {
        let mut keys: Vec<&DocKey> = compares.iter().flatten().map(|e| &e.key).collect();
        keys.sort();
        keys.dedup();
        let dialect = self.dialect();
        with_pool!(self, pool => {
            let mut tx = pool.begin().await?;
            // Taking the counter's row lock first orders this batch against every other writer,
            // and (on SQLite) makes this a write transaction from its first statement.
            let head: i64 = sqlx::query_scalar(dialect.lock_head).fetch_one(&mut *tx).await?;
            let mut current = HashMap::with_capacity(keys.len());
            for chunk in keys.chunks(ROWS_PER_STATEMENT) {
                let mut qb = QueryBuilder::new("SELECT kind, id, version, create_revision FROM documents WHERE ");
                qb.push(dialect.pairs_in);
                for (i, key) in chunk.iter().enumerate() {
                    qb.push(if i == 0 { "(" } else { ", (" });
                    qb.push_bind(key.kind.as_str()).push(", ").push_bind(key.id.as_str()).push(")");
                }
                qb.push(")");
                for row in qb.build().fetch_all(&mut *tx).await? {
                    current.insert(
                        DocKey::new(text_req!(row, 0), text_req!(row, 1)),
                        Current {
                            version: to_u64(row.try_get::<i64, _>(2)?),
                            create_revision: to_u64(row.try_get::<i64, _>(3)?),
                        },
                    );
                }
            }
            let plan = plan_batch(&current, compares, to_u64(head));
            // Nothing to write: done, unless this is an empty batch, the committer's probe of
            // whether COMMIT answers at all (it rewrites the counter unchanged and commits).
            if plan.changes.is_empty() && !compares.is_empty() {
                tx.rollback().await?;
                return Ok(plan.outcomes);
            }
            let puts: Vec<_> = plan
                .finals
                .iter()
                .filter_map(|(key, state)| match state {
                    FinalState::Put { version, create_revision, mod_revision, payload } => {
                        Some((key, *version, *create_revision, *mod_revision, payload))
                    }
                    FinalState::Deleted => None,
                })
                .collect();
            for chunk in puts.chunks(ROWS_PER_STATEMENT) {
                let mut qb = QueryBuilder::new(
                    "INSERT INTO documents (kind, id, version, create_revision, mod_revision, payload) ",
                );
                qb.push_values(chunk, |mut row, (key, version, create, modified, payload)| {
                    row.push_bind(key.kind.as_str())
                        .push_bind(key.id.as_str())
                        .push_bind(to_i64(*version))
                        .push_bind(to_i64(*create))
                        .push_bind(to_i64(*modified))
                        .push_bind(payload.as_ref());
                });
                qb.push(dialect.upsert);
                qb.build().execute(&mut *tx).await?;
            }
            let deletes: Vec<&DocKey> = plan
                .finals
                .iter()
                .filter(|(_, state)| matches!(state, FinalState::Deleted))
                .map(|(key, _)| key)
                .collect();
            for chunk in deletes.chunks(ROWS_PER_STATEMENT) {
                let mut qb = QueryBuilder::new("DELETE FROM documents WHERE ");
                qb.push(dialect.pairs_in);
                for (i, key) in chunk.iter().enumerate() {
                    qb.push(if i == 0 { "(" } else { ", (" });
                    qb.push_bind(key.kind.as_str()).push(", ").push_bind(key.id.as_str()).push(")");
                }
                qb.push(")");
                qb.build().execute(&mut *tx).await?;
            }
            for chunk in plan.changes.chunks(ROWS_PER_STATEMENT) {
                let mut qb = QueryBuilder::new(
                    "INSERT INTO changes (revision, seq, kind, id, version, create_revision, payload) ",
                );
                qb.push_values(chunk, |mut row, change| {
                    row.push_bind(to_i64(change.revision))
                        .push_bind(i32::try_from(change.seq).unwrap_or(i32::MAX))
                        .push_bind(change.key.kind.as_str())
                        .push_bind(change.key.id.as_str())
                        .push_bind(to_i64(change.version))
                        .push_bind(to_i64(change.create_revision))
                        .push_bind(change.payload.as_deref());
                });
                qb.build().execute(&mut *tx).await?;
            }
            sqlx::query(dialect.set_head)
                .bind(to_i64(plan.head))
                .execute(&mut *tx)
                .await?;
            // Up to here a failure means the transaction never committed. From here on, only an
            // answer from the database tells: a lost connection or a dropped future after this
            // point leaves the outcome unknown.
            commit_sent.store(true, Ordering::Release);
            tx.commit().await.map_err(commit_error)?;
            Ok(plan.outcomes)
        })
    }

    /// The change-log rows with `after < revision <= upto` that match `filter`, in order.
    pub async fn changes(&self, after: u64, upto: u64, filter: &Filter) -> Result<Vec<Change>, StoreError> {
        let upper = crate::model::prefix_upper_bound(&filter.id_prefix);
        with_pool!(self, pool => {
            let mut qb = QueryBuilder::new(
                "SELECT revision, seq, kind, id, version, create_revision, payload FROM changes WHERE revision > ",
            );
            qb.push_bind(to_i64(after)).push(" AND revision <= ").push_bind(to_i64(upto));
            if !filter.kind.is_empty() {
                qb.push(" AND kind = ").push_bind(filter.kind.as_str());
                if !filter.id_prefix.is_empty() {
                    qb.push(" AND id >= ").push_bind(filter.id_prefix.as_str());
                }
                if let Some(upper) = &upper {
                    qb.push(" AND id < ").push_bind(upper.as_str());
                }
            }
            qb.push(" ORDER BY revision, seq");
            let rows = qb.build().fetch_all(pool).await?;
            let mut changes = Vec::with_capacity(rows.len());
            for row in rows {
                changes.push(Change {
                    revision: to_u64(row.try_get::<i64, _>(0)?),
                    seq: u32::try_from(row.try_get::<i32, _>(1)?).unwrap_or(0),
                    key: DocKey::new(text_req!(row, 2), text_req!(row, 3)),
                    version: to_u64(row.try_get::<i64, _>(4)?),
                    create_revision: to_u64(row.try_get::<i64, _>(5)?),
                    payload: row.try_get::<Option<String>, _>(6)?.map(Arc::from),
                });
            }
            Ok(changes)
        })
    }

    /// Deletes change-log rows up to and including `upto` and records the compaction point.
    /// Watches that start at or before it get OUT_OF_RANGE and must re-list.
    pub async fn compact(&self, upto: u64) -> Result<(), StoreError> {
        let dialect = self.dialect();
        let mysql = self.backend() == Backend::Mysql;
        with_pool!(self, pool => {
            let mut tx = pool.begin().await?;
            sqlx::query(dialect.compact_changes)
                .bind(to_i64(upto))
                .execute(&mut *tx)
                .await?;
            // `$1` is bound once and used twice; MariaDB's `?` takes one value each.
            let mut meta = sqlx::query(dialect.compact_meta).bind(to_i64(upto));
            if mysql {
                meta = meta.bind(to_i64(upto));
            }
            meta.execute(&mut *tx).await?;
            tx.commit().await?;
        });
        Ok(())
    }
}
