//! The PostgreSQL, MariaDB and Redis that tests and benchmarks use, from one place: where they
//! are (`SANDBOXSCHED_TEST_POSTGRES_URL`, `SANDBOXSCHED_TEST_MYSQL_URL`,
//! `SANDBOXSCHED_TEST_REDIS_URL`, else the loopback
//! defaults `scripts/services` starts), and the message a test fails with when one is missing.
//! No test skips itself: a missing service is a failure that says what to start.

/// PostgreSQL: `postgres://postgres@127.0.0.1:5432/test` unless told otherwise.
pub fn postgres_url() -> String {
    std::env::var("SANDBOXSCHED_TEST_POSTGRES_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// MariaDB: `mysql://root@127.0.0.1:3306/test` unless told otherwise.
pub fn mysql_url() -> String {
    std::env::var("SANDBOXSCHED_TEST_MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
}

/// Fails the calling test: MariaDB is not reachable.
pub fn mysql_missing(err: impl std::fmt::Display) -> ! {
    panic!(
        "MariaDB is not reachable at {}: {err}\nStart it with `start-stop-daemon --start --oknodo --background \
         --exec /usr/sbin/mariadbd` (scripts/services does, and makes the database `test`), or point \
         SANDBOXSCHED_TEST_MYSQL_URL at one.",
        mysql_url()
    )
}

/// Redis: `redis://127.0.0.1:6379` unless told otherwise.
pub fn redis_url() -> String {
    std::env::var("SANDBOXSCHED_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// Fails the calling test: PostgreSQL is not reachable.
pub fn postgres_missing(err: impl std::fmt::Display) -> ! {
    panic!(
        "PostgreSQL is not reachable at {}: {err}\nStart it with `pg_ctlcluster --skip-systemctl-redirect \
         $(ls /etc/postgresql) main start` (scripts/services does, and makes the database `test` with trust \
         auth), or point SANDBOXSCHED_TEST_POSTGRES_URL at one.",
        postgres_url()
    )
}

/// Fails the calling test: Redis is not reachable.
pub fn redis_missing(err: impl std::fmt::Display) -> ! {
    panic!(
        "Redis is not reachable at {}: {err}\nStart it with `redis-server --daemonize yes --bind 127.0.0.1 \
         --port 6379 --save '' --appendonly no` (or run scripts/services, which does), or point \
         SANDBOXSCHED_TEST_REDIS_URL at one.",
        redis_url()
    )
}
