//! Who a request acts as. E2B's SDK names the user in `Authorization: Basic base64("name:")`
//! (RPCs) or the `username` query parameter (`/files`); without one, the sandbox's default
//! user (`user`, uid 1000, home `/home/user`) applies. The user decides a command's uid, gid
//! and `HOME`, where relative paths start, and who owns the files and directories envd makes.
//!
//! Users come from the sandbox's own `/etc/passwd`, read on every lookup (a sandbox may add
//! users), parsed here rather than through the C library's NSS so that a statically linked envd
//! works in any image.

use std::path::{Path, PathBuf};

use axum::http::HeaderMap;
use base64::Engine;

use crate::connect::{Code, RpcError};

/// The default user of an E2B sandbox.
pub const DEFAULT_USER: &str = "user";

/// One account.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct User {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: PathBuf,
}

/// Where accounts come from.
#[derive(Clone, Debug)]
pub struct Users {
    passwd: PathBuf,
    /// For envd run outside a container (the node's explicitly unisolated mode, tests): when
    /// the default user is not in the passwd file, requests act as envd's own uid with this home.
    fallback_home: Option<PathBuf>,
    /// Who a request naming no user acts as (a template's `USER`; [`DEFAULT_USER`] unless set).
    default_user: String,
    /// Where a command given no working directory starts (a template's `WORKDIR`; the user's
    /// home unless set).
    default_workdir: Option<PathBuf>,
}

impl Users {
    pub fn new(passwd: impl Into<PathBuf>, fallback_home: Option<PathBuf>) -> Self {
        Self {
            passwd: passwd.into(),
            fallback_home,
            default_user: DEFAULT_USER.to_string(),
            default_workdir: None,
        }
    }

    /// Sets the default user and working directory (a template's `USER` and `WORKDIR`); empty
    /// values keep E2B's defaults.
    pub fn with_defaults(mut self, user: &str, workdir: &str) -> Self {
        if !user.is_empty() {
            self.default_user = user.to_string();
        }
        if !workdir.is_empty() {
            self.default_workdir = Some(PathBuf::from(workdir));
        }
        self
    }

    /// Who a request naming no user acts as.
    pub fn default_user(&self) -> &str {
        &self.default_user
    }

    /// Where a command given no working directory starts, when a template says.
    pub fn default_workdir(&self) -> Option<&Path> {
        self.default_workdir.as_deref()
    }

    /// The user a request names, or the default one.
    pub fn of_request(&self, headers: &HeaderMap, query_user: Option<&str>) -> Result<User, RpcError> {
        let named = query_user
            .filter(|u| !u.is_empty())
            .map(str::to_string)
            .or_else(|| basic_user(headers));
        self.lookup(named.as_deref().unwrap_or(&self.default_user))
    }

    /// The user a `/files` request acts as. A `signed` URL was signed for the `username` in
    /// its query, or for none: whoever holds it acts as that user or the default one, never
    /// as one an `Authorization` header they add names (the signature does not cover it).
    pub fn of_file_request(
        &self,
        headers: &HeaderMap,
        query_user: Option<&str>,
        signed: bool,
    ) -> Result<User, RpcError> {
        if signed {
            return self.lookup(query_user.filter(|u| !u.is_empty()).unwrap_or(&self.default_user));
        }
        self.of_request(headers, query_user)
    }

    /// The account called `name`: by name in the passwd file; as Docker runs an image's
    /// `USER`, a number (`UID` or `UID:GID`) is that passwd entry's account when one has the
    /// uid, else those ids with `/` as home; and `root` is uid 0 even in an image with no
    /// passwd file at all (built `FROM scratch`).
    pub fn lookup(&self, name: &str) -> Result<User, RpcError> {
        let text = std::fs::read_to_string(&self.passwd).unwrap_or_default();
        let accounts = parse(&text);
        if let Some(user) = accounts.iter().find(|u| u.name == name) {
            return Ok(user.clone());
        }
        // Outside a container (unisolated) ids are the host's: nothing is made up there.
        if self.fallback_home.is_none() {
            if let Some(user) = numeric(name, &accounts) {
                return Ok(user);
            }
        }
        match &self.fallback_home {
            Some(home) if name == DEFAULT_USER => Ok(User {
                name: name.to_string(),
                uid: rustix::process::getuid().as_raw(),
                gid: rustix::process::getgid().as_raw(),
                home: home.clone(),
            }),
            _ => Err(RpcError::new(
                Code::InvalidArgument,
                format!("user {name:?} does not exist in this sandbox"),
            )),
        }
    }

    /// The name of `uid` (for file listings), or the number.
    pub fn name_of(&self, uid: u32) -> String {
        let text = std::fs::read_to_string(&self.passwd).unwrap_or_default();
        parse(&text).into_iter().find(|u| u.uid == uid).map_or_else(
            || if uid == 0 { "root".to_string() } else { uid.to_string() },
            |u| u.name,
        )
    }
}

/// The account a numeric user (`UID`, `UID:GID`, or `root`) stands for when no passwd entry is
/// called that: the entry with that uid (its gid unless one is given), else the bare ids with
/// `/root` (uid 0, when it exists) or `/` as home.
fn numeric(name: &str, accounts: &[User]) -> Option<User> {
    let (uid, gid) = match name {
        "root" => (0, None),
        _ => match name.split_once(':') {
            Some((uid, gid)) => (uid.parse().ok()?, Some(gid.parse().ok()?)),
            None => (name.parse().ok()?, None),
        },
    };
    if let Some(known) = accounts.iter().find(|u| u.uid == uid) {
        return Some(User {
            gid: gid.unwrap_or(known.gid),
            ..known.clone()
        });
    }
    let home = if uid == 0 && Path::new("/root").is_dir() {
        "/root"
    } else {
        "/"
    };
    Some(User {
        name: name.to_string(),
        uid,
        gid: gid.unwrap_or(0),
        home: PathBuf::from(home),
    })
}

/// The user of `Authorization: Basic base64("name:")`, if the header is there and well formed.
fn basic_user(headers: &HeaderMap) -> Option<String> {
    let value = headers.get(axum::http::header::AUTHORIZATION)?.to_str().ok()?;
    let encoded = value.strip_prefix("Basic ")?;
    let decoded = base64::engine::general_purpose::STANDARD.decode(encoded.trim()).ok()?;
    let text = String::from_utf8(decoded).ok()?;
    let name = text.split(':').next()?;
    (!name.is_empty()).then(|| name.to_string())
}

/// Accounts of a passwd file (`name:x:uid:gid:gecos:home:shell`); malformed lines are skipped.
fn parse(text: &str) -> Vec<User> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|line| {
            let fields: Vec<&str> = line.split(':').collect();
            if fields.len() < 7 {
                return None;
            }
            Some(User {
                name: fields[0].to_string(),
                uid: fields[2].parse().ok()?,
                gid: fields[3].parse().ok()?,
                home: Path::new(fields[5]).to_path_buf(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accounts_come_from_passwd_and_requests_name_them() {
        let dir = std::env::temp_dir().join(format!("envd-users-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let passwd = dir.join("passwd");
        std::fs::write(
            &passwd,
            "root:x:0:0:root:/root:/bin/bash\n# comment\nbroken line\nuser:x:1000:1000::/home/user:/bin/bash\n",
        )
        .unwrap();
        let users = Users::new(&passwd, None);
        let user = users.lookup("user").unwrap();
        assert_eq!(
            (user.uid, user.gid, user.home.as_path()),
            (1000, 1000, Path::new("/home/user"))
        );
        assert_eq!(users.name_of(0), "root");
        assert_eq!(users.name_of(4242), "4242");

        let mut headers = HeaderMap::new();
        assert_eq!(users.of_request(&headers, None).unwrap().name, "user");
        let root = base64::engine::general_purpose::STANDARD.encode("root:");
        headers.insert(
            axum::http::header::AUTHORIZATION,
            format!("Basic {root}").parse().unwrap(),
        );
        assert_eq!(users.of_request(&headers, None).unwrap().uid, 0);
        assert_eq!(
            users.of_request(&headers, Some("user")).unwrap().uid,
            1000,
            "the query wins"
        );
        // A signed URL is for its own user: an added Basic header names no other.
        assert_eq!(users.of_file_request(&headers, None, true).unwrap().uid, 1000);
        assert_eq!(users.of_file_request(&headers, Some(""), true).unwrap().uid, 1000);
        assert_eq!(users.of_file_request(&headers, Some("root"), true).unwrap().uid, 0);
        assert_eq!(
            users.of_file_request(&headers, None, false).unwrap().uid,
            0,
            "with the token"
        );
        let err = users.lookup("mallory").unwrap_err();
        assert_eq!(err.code, Code::InvalidArgument);

        // As Docker runs an image's USER: a uid in the passwd file is its account, any other
        // number those ids, with `/` as home.
        let by_uid = users.lookup("1000").unwrap();
        assert_eq!((by_uid.name.as_str(), by_uid.gid), ("user", 1000));
        assert_eq!(users.lookup("1000:5").unwrap().gid, 5);
        let bare = users.lookup("4242").unwrap();
        assert_eq!((bare.uid, bare.gid, bare.home.as_path()), (4242, 0, Path::new("/")));
        assert!(users.lookup("12ab").is_err());

        // An image with no passwd file (FROM scratch): root is uid 0 all the same.
        let scratch = Users::new(dir.join("missing"), None);
        assert_eq!(scratch.lookup("root").unwrap().uid, 0);
        assert!(scratch.lookup("user").is_err(), "a name must exist");

        let unisolated = Users::new(dir.join("missing"), Some(dir.clone()));
        assert_eq!(unisolated.lookup("user").unwrap().home, dir);
        assert!(unisolated.lookup("root").is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
