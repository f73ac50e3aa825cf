//! How the node hands a sandbox's settings to the envd that runs inside it: environment
//! variables of envd's process, read once at its start. The runtime that starts envd writes
//! them; envd reads them and removes them from its own environment, so commands do not
//! inherit them.

/// The sandbox's ID.
pub const SANDBOX_ID_VAR: &str = "ENVD_SANDBOX_ID";
/// The sandbox's env vars, as a JSON object.
pub const VARS_VAR: &str = "ENVD_VARS";
/// The sandbox's start command (its template's or its create request's), which envd starts
/// once it serves.
pub const START_COMMAND_VAR: &str = "ENVD_START_COMMAND";
/// The sandbox's default user (its template's `USER`), when its template sets one.
pub const DEFAULT_USER_VAR: &str = "ENVD_DEFAULT_USER";
/// The sandbox's default working directory (its template's `WORKDIR`), when set.
pub const DEFAULT_WORKDIR_VAR: &str = "ENVD_DEFAULT_WORKDIR";
