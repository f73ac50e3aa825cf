//! Holding back guesses at a secret: an admin token compared on a port anyone reaches.
//!
//! Waiting after a wrong answer is not enough on its own: a guesser sends thousands of
//! guesses at once and watches for the one answered at once. So every comparison takes a
//! turn first, a few at a time; a wrong one holds its turn for the delay before it is given
//! back. Whatever the number of connections, at most `at_once / delay` guesses a second are
//! compared, from everyone together; the right secret waits only for turns already taken.
//! Guesses beyond a bounded queue are refused at once, uncompared, so a flood holds no memory.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// How long a wrong guess holds its turn.
pub const GUESS_DELAY: Duration = Duration::from_millis(250);
/// Comparisons made at once.
pub const GUESSES_AT_ONCE: usize = 2;
/// Comparisons waiting for a turn before more are refused uncompared.
pub const MAX_WAITING: usize = 64;

/// Why a gated comparison gave no answer of its own.
#[derive(Debug, PartialEq, Eq)]
pub enum Gated<E> {
    /// Too many guesses wait already: this one was not compared.
    Busy,
    /// The comparison's own error.
    Refused(E),
}

/// The turns every comparison of one secret takes (see the module's documentation).
pub struct GuessGate {
    what: &'static str,
    turns: std::sync::Arc<tokio::sync::Semaphore>,
    waiting: AtomicUsize,
    /// Wrong guesses since the last warning, and when that was (warnings are rate-limited,
    /// so a guesser cannot flood the log).
    warned: Mutex<(u64, Option<Instant>)>,
}

impl GuessGate {
    /// A gate for `what` (named in the log's warnings).
    pub fn new(what: &'static str) -> Self {
        Self {
            what,
            turns: std::sync::Arc::new(tokio::sync::Semaphore::new(GUESSES_AT_ONCE)),
            waiting: AtomicUsize::new(0),
            warned: Mutex::default(),
        }
    }

    /// Runs `compare` in turn; an error `wrong` calls a wrong guess holds the turn for
    /// [`GUESS_DELAY`].
    pub async fn compare<T, E>(
        &self,
        compare: impl FnOnce() -> Result<T, E>,
        wrong: impl FnOnce(&E) -> bool,
    ) -> Result<T, Gated<E>> {
        let queued = Queued(&self.waiting);
        if self.waiting.fetch_add(1, Ordering::AcqRel) >= MAX_WAITING {
            return Err(Gated::Busy);
        }
        let turn = self.turns.clone().acquire_owned().await;
        // Counted out here, or wherever this future is dropped while it waits (its client
        // went away): a count left behind would refuse everyone once it reached the bound.
        drop(queued);
        let answer = compare();
        if let Err(e) = &answer {
            if wrong(e) {
                self.warn();
                // The turn is held for the delay by a task of its own: a guesser closing its
                // connection at once (a wrong answer is the slow one) must not free it early.
                if let Ok(turn) = turn {
                    tokio::spawn(async move {
                        tokio::time::sleep(GUESS_DELAY).await;
                        drop(turn);
                    });
                }
                tokio::time::sleep(GUESS_DELAY).await;
            }
        }
        answer.map_err(Gated::Refused)
    }

    fn warn(&self) {
        let mut warned = self.warned.lock().unwrap_or_else(PoisonError::into_inner);
        warned.0 += 1;
        if warned.1.is_none_or(|at| at.elapsed() >= Duration::from_secs(10)) {
            tracing::warn!(wrong = warned.0, what = self.what, "wrong secrets refused");
            *warned = (0, Some(Instant::now()));
        }
    }
}

/// One comparison counted among those waiting, until dropped.
struct Queued<'a>(&'a AtomicUsize);

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Many guesses at once are compared a few at a time, each wrong one holding its turn:
    /// the right one, sent behind them, is not answered before them (it would be at once if
    /// only wrong answers waited, and a guesser would watch for the fast answer).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_right_secret_behind_guesses_waits_its_turn() {
        let gate = std::sync::Arc::new(GuessGate::new("test token"));
        let mut guesses = Vec::new();
        for _ in 0..7 {
            let gate = gate.clone();
            guesses.push(tokio::spawn(async move {
                gate.compare(|| Err::<(), _>("wrong"), |_| true).await
            }));
        }
        // Two compared, five waiting: then the right one.
        while gate.waiting.load(Ordering::SeqCst) < 5 {
            tokio::task::yield_now().await;
        }
        let started = Instant::now();
        assert_eq!(gate.compare(|| Ok::<_, &str>(()), |_| true).await, Ok(()));
        let waited = started.elapsed();
        assert!(
            waited >= GUESS_DELAY * 2,
            "the right secret was answered after {waited:?}"
        );
        for guess in guesses {
            assert_eq!(guess.await.unwrap(), Err(Gated::Refused("wrong")));
        }
    }

    #[tokio::test]
    async fn a_wrong_guess_holds_its_turn_even_when_its_client_goes() {
        let gate = GuessGate::new("test token");
        for _ in 0..GUESSES_AT_ONCE {
            let wrong = gate.compare(|| Err::<(), _>(()), |_| true);
            // Compared at once; the client goes before the answer.
            assert!(tokio::time::timeout(Duration::from_millis(20), wrong).await.is_err());
        }
        assert_eq!(
            gate.turns.available_permits(),
            0,
            "a dropped guess gave its turn back early"
        );
        let started = Instant::now();
        assert_eq!(gate.compare(|| Ok::<_, ()>(()), |_| true).await, Ok(()));
        assert!(started.elapsed() >= GUESS_DELAY / 2, "{:?}", started.elapsed());
    }

    #[tokio::test]
    async fn a_guess_whose_client_went_away_leaves_no_count() {
        let gate = GuessGate::new("test token");
        let held = gate.turns.acquire_many(GUESSES_AT_ONCE as u32).await.unwrap();
        for _ in 0..MAX_WAITING + 1 {
            let waiting = gate.compare(|| Ok::<_, ()>(()), |_| true);
            assert!(tokio::time::timeout(Duration::from_millis(1), waiting).await.is_err());
        }
        assert_eq!(gate.waiting.load(Ordering::SeqCst), 0);
        drop(held);
        assert_eq!(gate.compare(|| Ok::<_, ()>(()), |_| true).await, Ok(()));
    }

    #[tokio::test]
    async fn a_flood_past_the_queue_is_refused_uncompared() {
        let gate = std::sync::Arc::new(GuessGate::new("test token"));
        // Hold both turns, then fill the queue.
        let held = gate.turns.acquire_many(GUESSES_AT_ONCE as u32).await.unwrap();
        let mut waiting = Vec::new();
        for _ in 0..MAX_WAITING {
            let gate = gate.clone();
            waiting.push(tokio::spawn(
                async move { gate.compare(|| Ok::<_, ()>(()), |_| true).await },
            ));
        }
        while gate.waiting.load(Ordering::SeqCst) < MAX_WAITING {
            tokio::task::yield_now().await;
        }
        let refused = gate
            .compare(|| -> Result<(), ()> { panic!("compared") }, |_| true)
            .await;
        assert_eq!(refused, Err(Gated::Busy));
        assert_eq!(
            gate.waiting.load(Ordering::SeqCst),
            MAX_WAITING,
            "a refusal left its count"
        );
        drop(held);
        for w in waiting {
            assert_eq!(w.await.unwrap(), Ok(()));
        }
    }
}
