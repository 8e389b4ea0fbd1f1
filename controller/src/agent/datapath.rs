//! What the agent programs: the [`Datapath`] trait and its `none` implementation, which keeps
//! exactly what it was told (per local endpoint and direction: the MapState's keys and values,
//! and the isolation; the ipcache) so tests and the debug API see the programmed state.

use std::collections::BTreeMap;

use ipnet::IpNet;
use ordnet_engine::{Engine, EngineDelta};
use ordnet_mapstate::{Direction, Identity, Key, StateEntry};

/// One endpoint and direction as programmed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProgrammedPolicy {
    pub entries: BTreeMap<Key, StateEntry>,
    pub isolated: bool,
}

/// One local endpoint as programmed: `[ingress, egress]`.
pub type ProgrammedEndpoint = [ProgrammedPolicy; 2];

/// The index of a direction in a [`ProgrammedEndpoint`].
pub fn dir_index(d: Direction) -> usize {
    match d {
        Direction::Ingress => 0,
        Direction::Egress => 1,
    }
}

/// A node's datapath, as the agent drives it.
pub trait Datapath: Send {
    /// Programs everything from scratch (the first programming after the initial sync).
    fn program_full(&mut self, engine: &Engine) -> Result<(), String>;
    /// Applies the deltas of one batch of changes (in order).
    fn apply(&mut self, engine: &Engine, deltas: &[EngineDelta]) -> Result<(), String>;
    /// The programmed MapStates, per local endpoint (`ns/name`).
    fn programmed(&self) -> &BTreeMap<String, ProgrammedEndpoint>;
    /// The programmed ipcache.
    fn ipcache(&self) -> &BTreeMap<IpNet, Identity>;
    /// Periodic upkeep after the initial sync (every [`super::MAINTAIN_EVERY`]): retries what
    /// failed (a full programming, attachments), follows this node's addresses.
    fn maintain(&mut self, _engine: &Engine) -> Result<(), String> {
        Ok(())
    }
    /// The datapath's own metrics (Prometheus text lines, HELP and TYPE included).
    fn write_metrics(&self, _out: &mut String) {}
}

/// `--datapath none`: computes everything, touches no kernel state, remembers what it was told.
#[derive(Debug, Default)]
pub struct NoneDatapath {
    endpoints: BTreeMap<String, ProgrammedEndpoint>,
    ipcache: BTreeMap<IpNet, Identity>,
}

impl Datapath for NoneDatapath {
    fn program_full(&mut self, engine: &Engine) -> Result<(), String> {
        self.endpoints.clear();
        for ep in engine.endpoints() {
            let mut programmed = ProgrammedEndpoint::default();
            for dir in [Direction::Ingress, Direction::Egress] {
                let policy = engine.policy(ep, dir);
                programmed[dir_index(dir)] = ProgrammedPolicy {
                    entries: policy
                        .mapstate
                        .iter()
                        .into_iter()
                        .map(|(k, e)| (k, e.clone()))
                        .collect(),
                    isolated: policy.isolated,
                };
            }
            self.endpoints.insert(ep.id(), programmed);
        }
        self.ipcache = engine.ipcache().into_iter().collect();
        Ok(())
    }

    fn apply(&mut self, _engine: &Engine, deltas: &[EngineDelta]) -> Result<(), String> {
        for delta in deltas {
            for gone in &delta.endpoints_removed {
                self.endpoints.remove(gone);
            }
            for new in &delta.endpoints_added {
                self.endpoints
                    .insert(new.clone(), ProgrammedEndpoint::default());
            }
            for u in &delta.updates {
                let ep = self.endpoints.get_mut(&u.endpoint).ok_or_else(|| {
                    format!(
                        "update for {}, which is not a programmed endpoint",
                        u.endpoint
                    )
                })?;
                let p = &mut ep[dir_index(u.direction)];
                for (k, _) in &u.changes.removed {
                    if p.entries.remove(k).is_none() {
                        return Err(format!(
                            "{} {}: removal of a key that is not programmed",
                            u.endpoint,
                            u.direction.as_str()
                        ));
                    }
                }
                for (k, _, new) in &u.changes.changed {
                    if p.entries.insert(*k, new.clone()).is_none() {
                        return Err(format!(
                            "{} {}: change of a key that is not programmed",
                            u.endpoint,
                            u.direction.as_str()
                        ));
                    }
                }
                for (k, e) in &u.changes.added {
                    p.entries.insert(*k, e.clone());
                }
                if let Some(isolated) = u.isolated {
                    p.isolated = isolated;
                }
            }
            for c in &delta.ipcache {
                match c.new {
                    Some(id) => {
                        self.ipcache.insert(c.prefix, id);
                    }
                    None => {
                        self.ipcache.remove(&c.prefix);
                    }
                }
            }
        }
        Ok(())
    }

    fn programmed(&self) -> &BTreeMap<String, ProgrammedEndpoint> {
        &self.endpoints
    }

    fn ipcache(&self) -> &BTreeMap<IpNet, Identity> {
        &self.ipcache
    }
}

#[cfg(test)]
mod tests {
    use ordnet_engine::{BuildOptions, EndpointUpdate};
    use ordnet_mapstate::{ChangeSet, L4Prefix, OrderKey, Peer, Verdict};

    use super::*;

    fn entry(verdict: Verdict, priority: i32) -> StateEntry {
        StateEntry {
            verdict,
            order: OrderKey::new(priority, 0),
            entries: Vec::new().into(),
            origins: Vec::new().into(),
            synthesized: false,
        }
    }

    fn update(changes: ChangeSet, isolated: Option<bool>) -> EngineDelta {
        EngineDelta {
            updates: vec![EndpointUpdate {
                endpoint: "x/a".into(),
                direction: Direction::Egress,
                changes,
                isolated,
                rebuilt: false,
            }],
            ..EngineDelta::default()
        }
    }

    #[test]
    fn deltas_add_change_and_remove_keys() {
        let engine = Engine::empty(BuildOptions::default());
        let mut dp = NoneDatapath::default();
        let k1 = Key {
            peer: Peer::Id(7),
            prefix: L4Prefix::packet(6, 80),
        };
        let k2 = Key {
            peer: Peer::Any,
            prefix: L4Prefix::ANY,
        };
        let added = EngineDelta {
            endpoints_added: vec!["x/a".into()],
            ..update(
                ChangeSet {
                    added: vec![
                        (k1, entry(Verdict::Allow, 1)),
                        (k2, entry(Verdict::Deny, 2)),
                    ],
                    ..ChangeSet::default()
                },
                Some(true),
            )
        };
        dp.apply(&engine, &[added]).unwrap();
        let changed = update(
            ChangeSet {
                changed: vec![(k1, entry(Verdict::Allow, 1), entry(Verdict::Deny, 0))],
                removed: vec![(k2, entry(Verdict::Deny, 2))],
                ..ChangeSet::default()
            },
            Some(false),
        );
        dp.apply(&engine, &[changed]).unwrap();
        let ep = &dp.programmed()["x/a"];
        assert_eq!(ep[1].entries.len(), 1);
        assert_eq!(ep[1].entries[&k1], entry(Verdict::Deny, 0));
        assert!(!ep[1].isolated);
        assert!(ep[0].entries.is_empty());
        // A removal of a key that is not programmed is an error (the agent then reprograms).
        let bad = update(
            ChangeSet {
                removed: vec![(k2, entry(Verdict::Deny, 2))],
                ..ChangeSet::default()
            },
            None,
        );
        assert!(dp.apply(&engine, &[bad]).is_err());
        let gone = EngineDelta {
            endpoints_removed: vec!["x/a".into()],
            ..EngineDelta::default()
        };
        dp.apply(&engine, &[gone]).unwrap();
        assert!(dp.programmed().is_empty());
    }
}
