//! The seeded fault schedule: which fault, when, for how long. Pure, so one seed always gives
//! the same schedule (the interleaving with the clients' requests still varies run to run;
//! the schedule is what a seed pins down).

use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// What the suite does to the cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fault {
    /// SIGKILL a service (by its name in the cluster), start it again after `down`. Redis
    /// restarts empty: it keeps nothing on disk, as placement's state is rebuilt from
    /// heartbeats.
    Kill { service: String, down: Duration },
    /// Cut node `node` off from placement (its heartbeats' only path) for `down`: every open
    /// connection is dropped and new ones are refused, while the node keeps serving.
    Cut { node: usize, down: Duration },
}

/// A fault and when it starts, counted from the schedule's start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Planned {
    pub at: Duration,
    pub fault: Fault,
}

/// The services a schedule may kill, by the cluster's names.
pub fn services(nodes: usize, placements: usize, gateways: usize) -> Vec<String> {
    let mut names = vec!["redis".to_string(), "ledger".to_string(), "balance".to_string()];
    names.extend((0..placements).map(|i| format!("placement-{i}")));
    names.extend((0..gateways).map(|i| format!("gateway-{i}")));
    names.extend((0..nodes).map(|i| format!("node-{i}")));
    names
}

/// Faults one after another for `length`: each lasts 0.3–3 s, then 0.5–2.5 s of calm. About
/// one fault in five is a cut node; the rest are kills spread over every service.
pub fn plan(seed: u64, length: Duration, services: &[String], nodes: usize) -> Vec<Planned> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut at = Duration::from_millis(rng.random_range(500..1_500));
    let mut planned = Vec::new();
    while at < length {
        let down = Duration::from_millis(rng.random_range(300..3_000));
        let fault = if nodes > 0 && rng.random_bool(0.2) {
            Fault::Cut {
                node: rng.random_range(0..nodes),
                down,
            }
        } else {
            Fault::Kill {
                service: services[rng.random_range(0..services.len())].clone(),
                down,
            }
        };
        planned.push(Planned { at, fault });
        at += down + Duration::from_millis(rng.random_range(500..2_500));
    }
    planned
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_gives_one_schedule_that_reaches_every_kind_of_fault() {
        let names = services(3, 2, 2);
        let length = Duration::from_secs(600);
        let a = plan(7, length, &names, 3);
        assert_eq!(a, plan(7, length, &names, 3));
        assert_ne!(a, plan(8, length, &names, 3));
        assert!(a.iter().all(|p| p.at < length));
        assert!(a.windows(2).all(|w| w[0].at < w[1].at), "faults come one after another");
        for name in &names {
            assert!(
                a.iter()
                    .any(|p| matches!(&p.fault, Fault::Kill { service, .. } if service == name)),
                "{name} is never killed"
            );
        }
        assert!(a.iter().any(|p| matches!(p.fault, Fault::Cut { .. })));
    }
}
