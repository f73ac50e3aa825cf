//! Who may use the console: operators, and nobody else.
//!
//! An operator proves it once, at the login form, with the cluster's admin token (the one
//! E2B's admin routes take as `X-Admin-Token`); a team's API key is not an operator's and is
//! refused like any other wrong token. A login gets a session: a random 244-bit ID in an
//! `HttpOnly`, `SameSite=Strict` cookie scoped to `/console`, so no script reads it and no
//! other site's page makes a browser send it. Scripts and the benchmark may instead send
//! `X-Admin-Token` with each request.
//!
//! Sessions live in memory (a restart logs everyone out) and end after [`SESSION_TTL`]; at
//! most [`MAX_SESSIONS`] are kept, the oldest forgotten first.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use axum::http::HeaderMap;
use subtle::ConstantTimeEq;

/// The cookie holding a session's ID.
pub const COOKIE: &str = "sandboxsched_console";
/// How long a session lasts.
pub const SESSION_TTL: Duration = Duration::from_secs(12 * 60 * 60);
/// Sessions kept at once.
pub const MAX_SESSIONS: usize = 1024;

/// The admin token and the sessions it opened.
pub struct Sessions {
    /// None: the console is closed to everyone (no admin token configured).
    token: Option<String>,
    live: Mutex<HashMap<String, Instant>>,
    /// Every comparison of a presented token takes its turn here (see `common::guesses`).
    guesses: common::guesses::GuessGate,
}

/// Who a request comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Caller {
    /// A signed-in browser, by its session's ID.
    Session(String),
    /// A script sending the admin token itself (`X-Admin-Token`).
    Token,
}

/// How long a wrong token holds its turn: at most `GUESSES_AT_ONCE / GUESS_DELAY` guesses a
/// second are compared, from everyone together, whatever the number of connections.
pub use common::guesses::{GUESSES_AT_ONCE, GUESS_DELAY};

/// Why a login or a request was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("the console is closed: no admin token is configured")]
    Closed,
    #[error("not signed in")]
    NoSession,
    #[error("that is not the operators' admin token (a team's API key does not open the console)")]
    WrongToken,
    #[error("too many admin tokens are being tried at once; try again")]
    Busy,
}

/// The shortest admin token the console accepts to be configured with.
pub const MIN_TOKEN_LEN: usize = 16;

impl Sessions {
    pub fn new(token: Option<String>) -> Self {
        Self {
            token: token.filter(|t| !t.is_empty()),
            live: Mutex::default(),
            guesses: common::guesses::GuessGate::new("console admin token"),
        }
    }

    /// [`Sessions::check`], a presented token compared in its turn (a wrong one holding it:
    /// see `common::guesses`); a session's cookie needs no turn (its ID is not guessable).
    pub async fn check_in_turn(&self, headers: &HeaderMap) -> Result<Caller, Refusal> {
        if !headers.contains_key("x-admin-token") {
            return self.check(headers);
        }
        self.in_turn(|| self.check(headers)).await
    }

    /// [`Sessions::login`], the token compared in its turn.
    pub async fn login_in_turn(&self, given: &str) -> Result<String, Refusal> {
        self.in_turn(|| self.login(given)).await
    }

    async fn in_turn<T>(&self, compare: impl FnOnce() -> Result<T, Refusal>) -> Result<T, Refusal> {
        use common::guesses::Gated;
        match self.guesses.compare(compare, |r| *r == Refusal::WrongToken).await {
            Ok(answer) => Ok(answer),
            Err(Gated::Busy) => Err(Refusal::Busy),
            Err(Gated::Refused(refusal)) => Err(refusal),
        }
    }

    fn token_matches(&self, given: &str) -> Result<(), Refusal> {
        let token = self.token.as_deref().ok_or(Refusal::Closed)?;
        if bool::from(given.trim().as_bytes().ct_eq(token.as_bytes())) {
            Ok(())
        } else {
            Err(Refusal::WrongToken)
        }
    }

    /// Opens a session for the holder of the admin token; returns its ID.
    pub fn login(&self, given: &str) -> Result<String, Refusal> {
        self.token_matches(given)?;
        let id = format!("{}{}", uuid::Uuid::new_v4().simple(), uuid::Uuid::new_v4().simple());
        let mut live = self.live.lock().unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        live.retain(|_, started| now.duration_since(*started) < SESSION_TTL);
        if live.len() >= MAX_SESSIONS {
            if let Some(oldest) = live
                .iter()
                .min_by_key(|(_, started)| **started)
                .map(|(id, _)| id.clone())
            {
                live.remove(&oldest);
            }
        }
        live.insert(id.clone(), now);
        Ok(id)
    }

    /// Who a request comes from, if an operator: a live session's cookie, or the admin token
    /// itself in `X-Admin-Token`.
    pub fn check(&self, headers: &HeaderMap) -> Result<Caller, Refusal> {
        if self.token.is_none() {
            return Err(Refusal::Closed);
        }
        if let Some(given) = headers.get("x-admin-token") {
            return self
                .token_matches(given.to_str().unwrap_or_default())
                .map(|()| Caller::Token);
        }
        // Any of the cookies of that name may be the session: another site sharing a parent
        // domain can set one of the same name first, but not take the real one's place.
        session_cookies(headers)
            .find(|id| self.alive(id))
            .map(|id| Caller::Session(id.to_string()))
            .ok_or(Refusal::NoSession)
    }

    /// Whether session `id` is still open.
    pub fn alive(&self, id: &str) -> bool {
        let live = self.live.lock().unwrap_or_else(PoisonError::into_inner);
        live.get(id).is_some_and(|started| started.elapsed() < SESSION_TTL)
    }

    pub fn logout(&self, headers: &HeaderMap) {
        let mut live = self.live.lock().unwrap_or_else(PoisonError::into_inner);
        for id in session_cookies(headers) {
            live.remove(id);
        }
    }
}

/// The session IDs in a request's cookies.
fn session_cookies(headers: &HeaderMap) -> impl Iterator<Item = &str> {
    headers
        .get_all(axum::http::header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .filter(|(name, _)| *name == COOKIE)
        .map(|(_, value)| value)
}

/// The `Set-Cookie` value of a new session (`None`: the cookie that ends one); `secure`
/// when browsers reach the console over TLS (a proxy in front of it).
pub fn set_cookie(id: Option<&str>, secure: bool) -> String {
    let secure = if secure { "; Secure" } else { "" };
    match id {
        Some(id) => format!(
            "{COOKIE}={id}; Path=/console; HttpOnly; SameSite=Strict; Max-Age={}{secure}",
            SESSION_TTL.as_secs()
        ),
        None => format!("{COOKIE}=; Path=/console; HttpOnly; SameSite=Strict; Max-Age=0{secure}"),
    }
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;

    use super::*;

    fn cookie(id: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(
            "cookie",
            HeaderValue::from_str(&format!("other=1; {COOKIE}={id}")).unwrap(),
        );
        headers
    }

    #[test]
    fn only_the_admin_token_opens_a_session_and_only_a_live_session_passes() {
        let sessions = Sessions::new(Some("admin_secret".into()));
        assert_eq!(sessions.login("e2b_teamkey"), Err(Refusal::WrongToken));
        assert_eq!(sessions.login(""), Err(Refusal::WrongToken));
        assert_eq!(sessions.check(&HeaderMap::new()), Err(Refusal::NoSession));
        assert_eq!(sessions.check(&cookie("forged")), Err(Refusal::NoSession));
        let id = sessions.login("admin_secret").unwrap();
        assert_eq!(id.len(), 64);
        assert_eq!(sessions.check(&cookie(&id)), Ok(Caller::Session(id.clone())));
        // A planted cookie of the same name ahead of the real one changes nothing.
        let mut planted = HeaderMap::new();
        planted.insert(
            "cookie",
            HeaderValue::from_str(&format!("{COOKIE}=planted; {COOKIE}={id}")).unwrap(),
        );
        assert_eq!(sessions.check(&planted), Ok(Caller::Session(id.clone())));
        sessions.logout(&cookie(&id));
        assert_eq!(sessions.check(&cookie(&id)), Err(Refusal::NoSession));
    }

    #[test]
    fn the_header_takes_the_token_itself_and_a_console_without_one_is_closed() {
        let sessions = Sessions::new(Some("admin_secret".into()));
        let mut headers = HeaderMap::new();
        headers.insert("x-admin-token", HeaderValue::from_static("admin_secret"));
        assert_eq!(sessions.check(&headers), Ok(Caller::Token));
        headers.insert("x-admin-token", HeaderValue::from_static("e2b_teamkey"));
        assert_eq!(sessions.check(&headers), Err(Refusal::WrongToken));
        let closed = Sessions::new(None);
        assert_eq!(closed.login(""), Err(Refusal::Closed));
        assert_eq!(closed.check(&headers), Err(Refusal::Closed));
    }

    #[test]
    fn sessions_are_bounded() {
        let sessions = Sessions::new(Some("t".into()));
        let first = sessions.login("t").unwrap();
        for _ in 0..MAX_SESSIONS {
            sessions.login("t").unwrap();
        }
        assert_eq!(
            sessions.check(&cookie(&first)),
            Err(Refusal::NoSession),
            "the oldest went first"
        );
        assert!(sessions.live.lock().unwrap().len() <= MAX_SESSIONS);
    }
}
