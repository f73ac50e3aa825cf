-- Documents, the change log that Watch reads, and the one-row revision counter.
-- SQLite compares text byte-wise (BINARY) by default, as the PostgreSQL schema asks for.
CREATE TABLE IF NOT EXISTS documents (
    kind            TEXT NOT NULL,
    id              TEXT NOT NULL,
    version         BIGINT NOT NULL,
    create_revision BIGINT NOT NULL,
    mod_revision    BIGINT NOT NULL,
    payload         TEXT NOT NULL,
    PRIMARY KEY (kind, id)
);

CREATE TABLE IF NOT EXISTS changes (
    revision        BIGINT NOT NULL,
    seq             INTEGER NOT NULL,
    kind            TEXT NOT NULL,
    id              TEXT NOT NULL,
    version         BIGINT NOT NULL,
    create_revision BIGINT NOT NULL,
    payload         TEXT,
    PRIMARY KEY (revision, seq)
);

CREATE INDEX IF NOT EXISTS changes_by_kind ON changes (kind, revision);

CREATE TABLE IF NOT EXISTS ledger_meta (
    singleton  INTEGER PRIMARY KEY CHECK (singleton = 1),
    revision   BIGINT NOT NULL,
    compacted  BIGINT NOT NULL
);

INSERT INTO ledger_meta (singleton, revision, compacted) VALUES (1, 0, 0)
ON CONFLICT (singleton) DO NOTHING;
