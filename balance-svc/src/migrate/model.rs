//! A model of the move protocol, checked exhaustively: every interleaving of one move, one
//! user kill, lost and duplicated replies, executor deaths and a late call from a dead
//! executor, within small budgets.
//!
//! The executor's decisions are the real ones ([`decide::pick_up`], [`decide::on_failure`],
//! [`decide::switched`], [`decide::released`], [`NodeAction::when_missing`]); what the model
//! writes itself is the I/O around them, as the executor's steps do it: each node call and
//! ledger write either lands with its answer, lands with its answer lost, or never lands. A
//! node is modelled by the rules node-svc keeps (fencing by epoch, idempotent moves, a
//! restore that keeps only a same-epoch copy). User kills claim the manifest first, as the
//! gateway does.
//!
//! Invariants, checked in every reachable state:
//! - never two running copies;
//! - when no operation owns the sandbox, the manifest names its running copy;
//! - once the user's kill is done, no copy runs (a late call included);
//! - no state where the move is unfinished and nothing can happen (a stuck move).
//!
//! Sizes: [`explore`] prints how many states it visited; a trace that breaks an invariant is
//! printed as the steps that led to it, and belongs in a test against the real services.

#![cfg(test)]

use std::collections::{HashMap, VecDeque};

use common::docs::SandboxDoc;

use super::decide::{self, NodeAction, NodeCall, OnFailure, PickUp, WhenMissing};
use super::MoveError;
use crate::record::{MoveRecord, Step};

const SOURCE: usize = 0;
const TARGET: usize = 1;
const MOVE_ID: &str = "p.0";
/// Lost or undelivered answers and writes of unknown outcome, per run.
const FAULTS: u8 = 5;
/// Executor deaths per run.
const DEATHS: u8 = 3;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Copy {
    Absent,
    Paused { epoch: u8 },
    Running { epoch: u8 },
}

impl Copy {
    fn epoch(self) -> Option<u8> {
        match self {
            Copy::Absent => None,
            Copy::Paused { epoch } | Copy::Running { epoch } => Some(epoch),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Owner {
    None,
    Move,
    User,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Manifest {
    node: usize,
    owner: Owner,
    epoch: u8,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum User {
    Idle,
    Claimed,
    Done,
}

/// A node call in flight, which the network may deliver again later.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Call {
    node: usize,
    what: NodeCall,
    epoch: u8,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct State {
    manifest: Option<Manifest>,
    copies: [Copy; 2],
    step: Step,
    epoch: u8,
    failed_at: Option<Step>,
    /// The executor starts (again): it picks the move up before acting.
    fresh: bool,
    user: User,
    /// A call a dead executor sent, still in the network.
    late: Option<Call>,
    /// Lost or refused answers, executor deaths, user attempts left.
    faults: u8,
    deaths: u8,
    user_tries: u8,
}

/// What a node answers a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Answer {
    Done,
    Missing,
    Stale,
}

/// Node-svc's rules for pause, resume and kill.
fn node_call(copy: &mut Copy, what: NodeCall, epoch: u8) -> Answer {
    let Some(seen) = copy.epoch() else {
        return Answer::Missing;
    };
    if epoch < seen {
        return Answer::Stale;
    }
    *copy = match (what, *copy) {
        (NodeCall::Kill, _) => Copy::Absent,
        (NodeCall::Pause, _) => Copy::Paused { epoch },
        (NodeCall::Resume, _) => Copy::Running { epoch },
    };
    Answer::Done
}

/// Node-svc's rule for a restore under `epoch`: keep a same-epoch copy, replace an older one,
/// refuse for a newer one.
fn restore(copy: &mut Copy, epoch: u8) -> Answer {
    match copy.epoch() {
        Some(seen) if seen > epoch => Answer::Stale,
        Some(seen) if seen == epoch => Answer::Done,
        _ => {
            *copy = Copy::Paused { epoch };
            Answer::Done
        }
    }
}

fn doc(m: &Manifest) -> SandboxDoc {
    SandboxDoc {
        sandbox_id: "s".into(),
        node_id: ["a", "b"][m.node].into(),
        lifecycle_owner: match m.owner {
            Owner::None => None,
            Owner::Move => Some(MOVE_ID.into()),
            Owner::User => Some("user:kill:1".into()),
        },
        epoch: u64::from(m.epoch),
        ..SandboxDoc::default()
    }
}

fn record(s: &State) -> MoveRecord {
    let mut r = MoveRecord::planned(MOVE_ID.into(), "s", ("a", "a"), ("b", "b"), 1);
    r.step = s.step;
    r.epoch = u64::from(s.epoch);
    r.failed_at = s.failed_at;
    r
}

/// How a call or write went, as the executor sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Wire {
    /// Landed and answered.
    Answered,
    /// Landed, answer lost.
    Lost,
    /// Never landed (unreachable).
    Dropped,
}

const WIRES: [Wire; 3] = [Wire::Answered, Wire::Lost, Wire::Dropped];

type Next = Vec<(String, State)>;

impl State {
    fn initial() -> Self {
        State {
            manifest: Some(Manifest {
                node: SOURCE,
                owner: Owner::None,
                epoch: 1,
            }),
            copies: [Copy::Running { epoch: 1 }, Copy::Absent],
            step: Step::Planned,
            epoch: 0,
            failed_at: None,
            fresh: true,
            user: User::Idle,
            late: None,
            faults: FAULTS,
            deaths: DEATHS,
            user_tries: 2,
        }
    }

    /// The wire outcomes affordable with the fault budget left.
    fn wires(&self) -> impl Iterator<Item = (Wire, State)> + '_ {
        WIRES.into_iter().filter_map(move |w| {
            let mut s = *self;
            if w != Wire::Answered {
                s.faults = s.faults.checked_sub(1)?;
            }
            Some((w, s))
        })
    }

    /// Sends a node call over `wire`; `None` when no answer came back.
    fn send(&mut self, wire: Wire, call: Call) -> Option<Answer> {
        if wire == Wire::Dropped {
            return None;
        }
        let answer = node_call(&mut self.copies[call.node], call.what, call.epoch);
        self.late.get_or_insert(call);
        (wire == Wire::Answered).then_some(answer)
    }

    fn advance(mut self, to: Step) -> State {
        self.step = to;
        self
    }

    /// A failed action, routed as the executor routes it.
    fn fail(mut self, err: MoveError) -> State {
        match decide::on_failure(self.step, &err) {
            OnFailure::Stop | OnFailure::RetryNextCycle => self.fresh = true,
            OnFailure::Abandon => return self.abandoned(),
            OnFailure::RollBack => {
                self.failed_at = Some(self.step);
                self.step = Step::RollingBack;
            }
        }
        self
    }

    /// A node action's answer mapped as `steps::lifecycle` maps it.
    fn node_result(action: NodeAction, answer: Option<Answer>) -> Result<(), MoveError> {
        match answer {
            Some(Answer::Done) => Ok(()),
            Some(Answer::Missing) => match action.when_missing() {
                WhenMissing::Done => Ok(()),
                WhenMissing::Gone => Err(MoveError::Gone("s".into())),
                WhenMissing::Failed => Err(MoveError::Failed("missing".into())),
            },
            Some(Answer::Stale) => Err(MoveError::Fenced("stale".into())),
            None => Err(MoveError::Transient("no answer".into())),
        }
    }

    fn executor(&self) -> Next {
        let mut next = Vec::new();
        if self.step.is_final() {
            return next;
        }
        if self.fresh {
            self.pick_up(&mut next);
            return next;
        }
        let call = |node, what| Call {
            node,
            what,
            epoch: self.epoch,
        };
        match self.step {
            Step::Planned => self.own(&mut next),
            Step::Owned => self.node_step(
                &mut next,
                NodeAction::Pause,
                call(SOURCE, NodeCall::Pause),
                Step::SourcePaused,
            ),
            Step::SourcePaused => {
                for (wire, mut s) in self.wires() {
                    let source_ok = s.copies[SOURCE].epoch().is_some_and(|e| e <= s.epoch);
                    let answer = match wire {
                        Wire::Dropped => None,
                        _ if !source_ok => Some(Answer::Stale),
                        _ => {
                            let a = restore(&mut s.copies[TARGET], s.epoch);
                            (wire == Wire::Answered).then_some(a)
                        }
                    };
                    match answer {
                        Some(Answer::Done) => next.push(("restore".into(), s.advance(Step::Restored))),
                        Some(_) => next.push(("restore refused".into(), s.fail(MoveError::Fenced("x".into())))),
                        None => {
                            next.push(("restore retried".into(), s));
                            next.push(("restore gave up".into(), s.fail(MoveError::Transient("x".into()))));
                        }
                    }
                }
            }
            Step::Restored => self.node_step(
                &mut next,
                NodeAction::Resume,
                call(TARGET, NodeCall::Resume),
                Step::TargetResumed,
            ),
            Step::TargetResumed => self.switch(&mut next),
            Step::Switched => self.node_step(&mut next, NodeAction::Kill, call(SOURCE, NodeCall::Kill), Step::Done),
            Step::RollingBack => self.roll_back(&mut next),
            Step::Done | Step::RolledBack | Step::Abandoned => {}
        }
        next
    }

    fn node_step(&self, next: &mut Next, action: NodeAction, call: Call, to: Step) {
        for (wire, mut s) in self.wires() {
            let answer = s.send(wire, call);
            match Self::node_result(action, answer) {
                Ok(()) => next.push((format!("{} ok", action.name()), s.advance(to))),
                Err(err @ MoveError::Transient(_)) => {
                    next.push((format!("{} retried", action.name()), s));
                    next.push((format!("{} gave up", action.name()), s.fail(err)));
                }
                Err(err) => next.push((format!("{} failed", action.name()), s.fail(err))),
            }
        }
    }

    /// A manifest write by compare-and-swap: lands or not; its answer may be lost, and then
    /// the executor reads back (resolving it) or, if the ledger stays unreadable, leaves the
    /// move for the next cycle.
    fn write(&self, next: &mut Next, what: &str, change: impl Fn(&mut State), then: impl Fn(State) -> State) {
        let mut landed = *self;
        change(&mut landed);
        next.push((format!("{what} ok"), then(landed)));
        if self.faults > 0 {
            let mut unknown_landed = landed;
            unknown_landed.faults -= 1;
            unknown_landed.fresh = true;
            next.push((format!("{what} landed, outcome unknown"), unknown_landed));
            let mut unknown = *self;
            unknown.faults -= 1;
            unknown.fresh = true;
            next.push((format!("{what} not landed, outcome unknown"), unknown));
        }
    }

    fn own(&self, next: &mut Next) {
        let Some(m) = self.manifest else {
            next.push(("own: gone".into(), self.fail(MoveError::Gone("s".into()))));
            return;
        };
        match m.owner {
            Owner::User => next.push(("own: user owns it".into(), self.fail(MoveError::Failed("owned".into())))),
            Owner::None if m.node != SOURCE => next.push((
                "own: not on source".into(),
                self.fail(MoveError::Failed("moved".into())),
            )),
            Owner::None | Owner::Move => self.write(
                next,
                "own",
                |s| {
                    let m = s.manifest.as_mut().expect("checked");
                    m.owner = Owner::Move;
                    m.epoch += 1;
                },
                |mut s| {
                    s.epoch = s.manifest.map_or(0, |m| m.epoch);
                    s.advance(Step::Owned)
                },
            ),
        }
    }

    fn switch(&self, next: &mut Next) {
        let Some(m) = self.manifest else {
            next.push(("switch: gone".into(), self.fail(MoveError::Gone("s".into()))));
            return;
        };
        if decide::switched(&record(self), &doc(&m)) {
            next.push(("switch: landed before".into(), self.advance(Step::Switched)));
            return;
        }
        if m.owner != Owner::Move {
            next.push(("switch: not owned".into(), self.fail(MoveError::Failed("lost".into()))));
            return;
        }
        self.write(
            next,
            "switch",
            |s| {
                let m = s.manifest.as_mut().expect("checked");
                m.node = TARGET;
                m.owner = Owner::None;
            },
            |s| s.advance(Step::Switched),
        );
    }

    fn release(&self, next: &mut Next, label: &str) {
        let Some(m) = self.manifest else {
            next.push((format!("{label}: gone"), self.fail(MoveError::Gone("s".into()))));
            return;
        };
        if m.owner != Owner::Move {
            next.push((format!("{label}: not ours"), self.advance(Step::RolledBack)));
            return;
        }
        self.write(
            next,
            label,
            |s| s.manifest.as_mut().expect("checked").owner = Owner::None,
            |s| s.advance(Step::RolledBack),
        );
    }

    fn roll_back(&self, next: &mut Next) {
        if self.epoch == 0 {
            self.release(next, "release (never recorded)");
            return;
        }
        let Some(m) = self.manifest else {
            next.push(("roll back: gone".into(), self.fail(MoveError::Gone("s".into()))));
            return;
        };
        if m.owner != Owner::Move {
            next.push(("roll back: released before".into(), self.advance(Step::RolledBack)));
            return;
        }
        // A new epoch first, so calls of the failed attempt still in flight are refused.
        let mut retaken = Vec::new();
        self.write(
            &mut retaken,
            "roll back: retake",
            |t| t.manifest.as_mut().expect("owned").epoch += 1,
            |mut t| {
                t.epoch = t.manifest.map_or(0, |m| m.epoch);
                t
            },
        );
        for (label, s) in retaken {
            if s.fresh {
                next.push((label, s));
            } else {
                s.undo(next);
            }
        }
    }

    /// Rolling back under the new epoch: target copy removed (confirmed if it may run), then
    /// the source resumed, then ownership released.
    fn undo(&self, next: &mut Next) {
        let target_may_run = record(self).target_may_run();
        for (wire, mut s) in self.wires() {
            let answer = s.send(
                wire,
                Call {
                    node: TARGET,
                    what: NodeCall::Kill,
                    epoch: s.epoch,
                },
            );
            match Self::node_result(NodeAction::UndoKill, answer) {
                Ok(()) => {}
                Err(err @ (MoveError::Fenced(_) | MoveError::Halted(_))) => {
                    next.push(("undo-kill fenced".into(), s.fail(err)));
                    continue;
                }
                Err(_) if target_may_run => {
                    s.fresh = true;
                    next.push(("undo-kill unconfirmed: source stays paused".into(), s));
                    continue;
                }
                Err(_) => {}
            }
            for (wire, mut t) in s.wires() {
                let call = Call {
                    node: SOURCE,
                    what: NodeCall::Resume,
                    epoch: t.epoch,
                };
                let answer = t.send(wire, call);
                match Self::node_result(NodeAction::UndoResume, answer) {
                    Ok(()) => t.release(next, "release"),
                    Err(MoveError::Transient(_)) => {
                        t.fresh = true;
                        next.push(("undo-resume retried next cycle".into(), t));
                    }
                    Err(err) => next.push(("undo-resume failed".into(), t.fail(err))),
                }
            }
        }
    }

    fn pick_up(&self, next: &mut Next) {
        let mut s = *self;
        s.fresh = false;
        let manifest = self.manifest.as_ref().map(doc);
        match decide::pick_up(&record(self), manifest.as_ref()) {
            PickUp::AsRecorded => next.push(("pick up as recorded".into(), s)),
            PickUp::Abandon => next.push(("pick up: abandon".into(), s.abandoned())),
            PickUp::Switched => next.push(("pick up: switched".into(), s.advance(Step::Switched))),
            PickUp::RolledBack => next.push(("pick up: rolled back".into(), s.advance(Step::RolledBack))),
            PickUp::Retake => s.write(
                next,
                "retake",
                |t| t.manifest.as_mut().expect("owned").epoch += 1,
                |mut t| {
                    t.epoch = t.manifest.map_or(0, |m| m.epoch);
                    t
                },
            ),
            // The executor reports it and picks it up again next cycle: nothing changes.
            PickUp::LostOwnership { .. } => {}
        }
    }

    /// The user killed it mid-move: the executor removes the copies this move may have made
    /// (kills under its epoch) and ends the move.
    fn abandoned(mut self) -> State {
        if self.epoch > 0 {
            for node in [TARGET, SOURCE] {
                let _ = node_call(&mut self.copies[node], NodeCall::Kill, self.epoch);
            }
        }
        self.step = Step::Abandoned;
        self
    }

    fn user(&self) -> Next {
        let mut next = Vec::new();
        match self.user {
            User::Idle if self.user_tries > 0 => {
                let Some(m) = self.manifest else { return next };
                if m.owner != Owner::None {
                    return next; // waits for the owner to finish
                }
                let mut s = *self;
                s.user_tries -= 1;
                s.user = User::Claimed;
                let m = s.manifest.as_mut().expect("checked");
                m.owner = Owner::User;
                m.epoch += 1;
                next.push(("user claims".into(), s));
            }
            User::Claimed => {
                let m = self.manifest.expect("a claimed sandbox has its manifest");
                for (wire, mut s) in self.wires() {
                    let answer = if wire == Wire::Dropped {
                        None
                    } else {
                        Some(node_call(&mut s.copies[m.node], NodeCall::Kill, m.epoch))
                    };
                    match answer {
                        Some(Answer::Done | Answer::Missing) => {
                            s.manifest = None;
                            s.user = User::Done;
                            next.push(("user kill done".into(), s));
                        }
                        // Refused by the node: nothing was killed; the claim is given back.
                        Some(Answer::Stale) => {
                            s.user = User::Idle;
                            s.manifest.as_mut().expect("claimed").owner = Owner::None;
                            next.push(("user kill refused; unclaimed".into(), s));
                        }
                        // No answer: it may have landed. The claim stays (the sandbox is being
                        // killed) and the kill is tried again.
                        None => next.push(("user kill unanswered; claim kept".into(), s)),
                    }
                }
            }
            _ => {}
        }
        next
    }

    fn successors(&self) -> Next {
        let mut next = self.executor();
        next.extend(self.user());
        if !self.step.is_final() && self.deaths > 0 && !self.fresh {
            let mut s = *self;
            s.deaths -= 1;
            s.fresh = true;
            next.push(("executor dies".into(), s));
        }
        if let Some(call) = self.late {
            let mut s = *self;
            s.late = None;
            let _ = node_call(&mut s.copies[call.node], call.what, call.epoch);
            next.push((format!("late {:?} delivered", call), s));
            let mut dropped = *self;
            dropped.late = None;
            next.push(("late call dropped".into(), dropped));
        }
        next
    }

    fn violation(&self) -> Option<&'static str> {
        let running = self.copies.iter().filter(|c| matches!(c, Copy::Running { .. })).count();
        if running > 1 {
            return Some("two running copies");
        }
        if let Some(m) = self.manifest {
            if m.owner == Owner::None && !matches!(self.copies[m.node], Copy::Running { .. }) {
                return Some("no owner, and the manifest's node does not run the sandbox");
            }
        }
        if self.user == User::Done && running > 0 && self.late.is_none() && self.step.is_final() {
            return Some("killed by its user, still running");
        }
        None
    }
}

/// Breadth-first over every reachable state; the first violation comes back with its trace.
fn explore() -> Result<usize, String> {
    let start = State::initial();
    let mut parent: HashMap<State, Option<(State, String)>> = HashMap::from([(start, None)]);
    let mut queue = VecDeque::from([start]);
    let trace = |parent: &HashMap<State, Option<(State, String)>>, mut at: State| {
        let mut steps = Vec::new();
        while let Some(Some((from, label))) = parent.get(&at) {
            steps.push(format!("{label} -> {at:?}"));
            at = *from;
        }
        steps.reverse();
        steps.join("\n")
    };
    while let Some(state) = queue.pop_front() {
        if let Some(broken) = state.violation() {
            return Err(format!("{broken}:\n{}", trace(&parent, state)));
        }
        let next = state.successors();
        if next.is_empty() && !state.step.is_final() {
            return Err(format!("the move is stuck:\n{}", trace(&parent, state)));
        }
        for (label, s) in next {
            if let std::collections::hash_map::Entry::Vacant(e) = parent.entry(s) {
                e.insert(Some((state, label)));
                queue.push_back(s);
            }
        }
    }
    Ok(parent.len())
}

#[test]
fn the_move_protocol_keeps_its_invariants_under_lost_replies_deaths_and_user_kills() {
    match explore() {
        Ok(states) => {
            eprintln!("move protocol model: {states} states, every invariant holds");
            assert!(states > 1_000, "the model explores too little: {states} states");
        }
        Err(trace) => panic!("{trace}"),
    }
}
