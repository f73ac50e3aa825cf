-- Documents, the change log that Watch reads, and the one-row revision counter, on MariaDB or
-- MySQL. Ids and kinds compare byte-wise (utf8mb4_bin) so prefix ranges and page cursors
-- behave exactly as they do on SQLite and PostgreSQL. Lengths are the ledger's own limits
-- (kinds 128 bytes, ids 512), which keeps the primary key within InnoDB's 3072 bytes.
CREATE TABLE IF NOT EXISTS documents (
    kind            VARCHAR(128) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    id              VARCHAR(512) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    version         BIGINT NOT NULL,
    create_revision BIGINT NOT NULL,
    mod_revision    BIGINT NOT NULL,
    payload         LONGTEXT CHARACTER SET utf8mb4 NOT NULL,
    PRIMARY KEY (kind, id)
) ENGINE = InnoDB;

CREATE TABLE IF NOT EXISTS changes (
    revision        BIGINT NOT NULL,
    seq             INTEGER NOT NULL,
    kind            VARCHAR(128) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    id              VARCHAR(512) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    version         BIGINT NOT NULL,
    create_revision BIGINT NOT NULL,
    payload         LONGTEXT CHARACTER SET utf8mb4,
    PRIMARY KEY (revision, seq),
    INDEX changes_by_kind (kind, revision)
) ENGINE = InnoDB;

CREATE TABLE IF NOT EXISTS ledger_meta (
    singleton  INTEGER PRIMARY KEY CHECK (singleton = 1),
    revision   BIGINT NOT NULL,
    compacted  BIGINT NOT NULL
) ENGINE = InnoDB;

INSERT IGNORE INTO ledger_meta (singleton, revision, compacted) VALUES (1, 0, 0);
