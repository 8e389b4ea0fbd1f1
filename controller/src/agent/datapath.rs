//! What the agent programs: the [`Enforcer`] trait, the programming both datapaths share
//! ([`Programmer`]: [`NodeProgram`] onto a [`ControlPlane`], and a [`Record`] of what was
//! written) and the `none` datapath, which programs an in-memory [`MemDatapath`] exactly as
//! `bpf` programs the kernel (the same code, the same writes; only the table writer differs).
//!
//! The debug API answers from what was programmed: the MapStates and the ipcache as written
//! ([`Enforcer::programmed`], [`Enforcer::ipcache`]; tests compare them with the offline
//! engine), and the verdicts of `matrix` and `trace` decided over the programmed tables
//! ([`Enforcer::plane`]).

use super::AgentError;
use super::metrics::Sample;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ipnet::IpNet;
use ordnet_datapath::{ControlPlane, MemDatapath};
use ordnet_engine::{Engine, EngineDelta};
use ordnet_mapstate::{ChangeSet, Direction, Identity, Key, MapState, StateEntry};

use crate::program::NodeProgram;

/// One endpoint and direction as programmed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProgrammedPolicy {
    /// The MapState's keys and values as written. Shared between the endpoints whose keys are
    /// equal (the engine shares MapStates the same way), so the record costs one copy per
    /// distinct MapState, not one per endpoint.
    pub entries: Arc<BTreeMap<Key, StateEntry>>,
    /// Whether the default verdict written is deny.
    pub isolated: bool,
}

/// One local endpoint as programmed: `[ingress, egress]`.
pub type ProgrammedEndpoint = [ProgrammedPolicy; 2];

/// A node's datapath, as the agent drives it.
pub trait Enforcer: Send {
    /// Programs everything from scratch (the first programming after the initial sync).
    fn program_full(&mut self, engine: &Engine) -> Result<(), AgentError>;
    /// Applies the deltas of one batch of changes (in order).
    fn apply(&mut self, engine: &Engine, deltas: &[EngineDelta]) -> Result<(), AgentError>;
    /// The programmed MapStates, per local endpoint (`ns/name`).
    fn programmed(&self) -> &BTreeMap<String, ProgrammedEndpoint>;
    /// The programmed ipcache.
    fn ipcache(&self) -> &BTreeMap<IpNet, Identity>;
    /// Its number of entries (what the metrics read after every change: a datapath that reads
    /// its ipcache back only when asked can count it without).
    fn ipcache_len(&self) -> usize {
        self.ipcache().len()
    }
    /// Whether the local endpoint `ns/name` is programmed and, where the datapath attaches to
    /// interfaces, attached; why not otherwise.
    fn endpoint_ready(&self, endpoint: &str) -> Result<(), String> {
        if self.programmed().contains_key(endpoint) {
            Ok(())
        } else {
            Err(format!("{endpoint} is not programmed"))
        }
    }
    /// The programmed tables (what the maps hold), for the verdicts of the debug API:
    /// `ControlPlane::decide` runs the XDP program's decision function over them.
    fn plane(&self) -> &dyn ControlPlane;
    /// Upkeep after the initial sync (on every netlink event, and every
    /// [`super::MAINTAIN_EVERY`]): retries what
    /// failed (a full programming, attachments), follows this node's addresses.
    fn maintain(&mut self, _engine: &Engine) -> Result<(), AgentError> {
        Ok(())
    }
    /// When released rule sets (or retired identity classes) are next due to be cleared
    /// ([`ControlPlane::reclaim_due`]); `None` when nothing waits or a full programming is
    /// pending (it rewrites everything). The agent clears them if no change has shortly after
    /// ([`super::reclaim`]).
    fn reclaim_due(&self) -> Option<Instant>;
    /// Clears what is due ([`NodeProgram::reclaim`]). On an error the datapath is programmed
    /// in full at its next upkeep or change, as after a failed change.
    fn reclaim(&mut self) -> Result<(), AgentError>;
    /// The datapath's own metrics.
    fn metrics(&self) -> Vec<super::metrics::Sample> {
        Vec::new()
    }
    /// What the kernel's per-rule counters counted, per rule, since the agent started
    /// (`docs/observe.md` §8); `None` for a datapath without them. Brought up to date by
    /// [`Enforcer::maintain`] and [`Enforcer::collect_rule_counts`].
    fn rule_totals(&self) -> Option<&ordnet_datapath::RuleTotals> {
        None
    }
    /// Reads the per-rule counters into [`Enforcer::rule_totals`] now (`/v1/counters`).
    fn collect_rule_counts(&mut self) {}
    /// Conditions an operator should know about while the agent is ready (`/readyz` lists
    /// them), e.g. a connection-tracking table near its capacity.
    fn health(&self) -> Vec<String> {
        Vec::new()
    }
    /// The reader of the datapath's verdict events (`ordnet_datapath::EventReader`) of its
    /// current programs, once per load of them (`None` when there is no new one: the same
    /// programs, or a datapath without events).
    fn take_events(&mut self) -> Option<ordnet_datapath::EventReader> {
        None
    }
    /// The host-side interfaces the chained CNI plugin's `prevResult` names for the local
    /// endpoint `ns/name` (`None`: forget them, the pod's sandbox is gone). A datapath that
    /// attaches to interfaces takes them before looking for the pod's interface itself.
    fn cni_interfaces(&mut self, _endpoint: &str, _interfaces: Option<&[String]>) {}
    /// Local endpoints (`ns/name`) whose rule sets do not fit the datapath's maps, with why:
    /// each holds a deny-all policy in both directions ([`NodeProgram::denied`]).
    fn denied(&self) -> &BTreeMap<String, String>;
    /// Keeps a copy of every programmed key from the next full programming on
    /// ([`Record::with_keys`]; the agent tests compare them with the engine), so that
    /// [`Enforcer::programmed`] lists them.
    fn record_keys(&mut self);
}

/// What was written, as the engine's MapStates (per local endpoint and direction: the keys and
/// values, and the isolation) and ipcache: the `programmed()` and `ipcache()` answers.
///
/// The keys are recorded only when asked for ([`Record::with_keys`]): they are a second copy of
/// the MapStates' keys (48 MiB at 10,000 pods / 1,000 policies), which the tests use to check
/// that the deltas the agent programs add up to the engine's state, and nothing else reads.
/// Without them `entries` stays empty; the endpoints, their isolation and the ipcache are
/// always recorded.
#[derive(Debug, Default)]
pub struct Record {
    endpoints: BTreeMap<String, ProgrammedEndpoint>,
    ipcache: BTreeMap<IpNet, Identity>,
    keys: bool,
}

impl Record {
    /// A record that keeps every programmed key.
    pub fn with_keys() -> Record {
        Record {
            keys: true,
            ..Record::default()
        }
    }

    /// Keeps the keys from the next full programming on.
    pub fn keep_keys(&mut self) {
        self.keys = true;
    }

    /// Whether the keys are kept.
    pub fn keeps_keys(&self) -> bool {
        self.keys
    }

    /// Records everything `engine` holds.
    pub fn program_full(&mut self, engine: &Engine) {
        self.endpoints.clear();
        // One copy per MapState of the engine (endpoints with equal inputs share one).
        let mut copies: HashMap<*const MapState, Arc<BTreeMap<Key, StateEntry>>> = HashMap::new();
        for ep in engine.endpoints() {
            let mut programmed = ProgrammedEndpoint::default();
            for dir in [Direction::Ingress, Direction::Egress] {
                let policy = engine.policy(ep, dir);
                if !self.keys {
                    programmed[dir.index()].isolated = policy.isolated;
                    continue;
                }
                let entries = copies
                    .entry(&policy.mapstate as *const MapState)
                    .or_insert_with(|| {
                        Arc::new(
                            policy
                                .mapstate
                                .iter()
                                .into_iter()
                                .map(|(k, e)| (k, e.clone()))
                                .collect(),
                        )
                    });
                programmed[dir.index()] = ProgrammedPolicy {
                    entries: Arc::clone(entries),
                    isolated: policy.isolated,
                };
            }
            self.endpoints.insert(ep.id(), programmed);
        }
        self.ipcache = engine.ipcache().into_iter().collect();
    }

    /// Records the deltas of one batch; an error if they do not fit what is recorded.
    ///
    /// Sharing is kept: endpoints that shared their keys and get the same change set (the
    /// engine hands every user of a shared MapState the same `Arc<ChangeSet>`) share the
    /// result, computed once; an endpoint that moved to another MapState (its own change set)
    /// shares the keys of an endpoint whose keys are now equal.
    pub fn apply(&mut self, deltas: &[EngineDelta]) -> Result<(), AgentError> {
        // (shared keys before, change set) -> keys after. Every Arc of a key is held in its
        // value, so no address is reused while the batch is recorded.
        type Keys = Arc<BTreeMap<Key, StateEntry>>;
        type Memo = HashMap<(usize, usize), (Keys, Arc<ChangeSet>, Keys)>;
        let mut memo: Memo = HashMap::new();
        let mut moved: Vec<(String, usize)> = Vec::new();
        for delta in deltas {
            for gone in &delta.endpoints_removed {
                self.endpoints.remove(gone);
            }
            for new in &delta.endpoints_added {
                self.endpoints
                    .insert(new.clone(), ProgrammedEndpoint::default());
            }
            for u in &delta.updates {
                let ep = self
                    .endpoints
                    .get_mut(&u.endpoint)
                    .ok_or_else(|| AgentError::Record {
                        endpoint: u.endpoint.clone(),
                        direction: u.direction.as_str(),
                        what: "update of an endpoint that is not programmed",
                    })?;
                let p = &mut ep[u.direction.index()];
                if !self.keys {
                    if let Some(isolated) = u.isolated {
                        p.isolated = isolated;
                    }
                    continue;
                }
                let memo_key = (
                    Arc::as_ptr(&p.entries) as usize,
                    Arc::as_ptr(&u.changes) as usize,
                );
                if let Some((_, _, after)) = memo.get(&memo_key) {
                    p.entries = Arc::clone(after);
                    if let Some(isolated) = u.isolated {
                        p.isolated = isolated;
                    }
                    continue;
                }
                // Shared keys are copied before they change (and the result is memoized);
                // keys of this endpoint alone change in place.
                let before = (Arc::strong_count(&p.entries) > 1).then(|| Arc::clone(&p.entries));
                let entries = Arc::make_mut(&mut p.entries);
                for (k, _) in &u.changes.removed {
                    if entries.remove(k).is_none() {
                        return Err(AgentError::Record {
                            endpoint: u.endpoint.clone(),
                            direction: u.direction.as_str(),
                            what: "removal of a key that is not programmed",
                        });
                    }
                }
                for (k, _, new) in &u.changes.changed {
                    if entries.insert(*k, new.clone()).is_none() {
                        return Err(AgentError::Record {
                            endpoint: u.endpoint.clone(),
                            direction: u.direction.as_str(),
                            what: "change of a key that is not programmed",
                        });
                    }
                }
                for (k, e) in &u.changes.added {
                    entries.insert(*k, e.clone());
                }
                if let Some(isolated) = u.isolated {
                    p.isolated = isolated;
                }
                if let Some(before) = before {
                    memo.insert(
                        memo_key,
                        (before, Arc::clone(&u.changes), Arc::clone(&p.entries)),
                    );
                }
                if u.rebuilt {
                    moved.push((u.endpoint.clone(), u.direction.index()));
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
        drop(memo);
        self.share_moved(&moved);
        Ok(())
    }

    /// Endpoints that moved to another MapState got keys of their own: each shares the keys of
    /// another endpoint whose keys are equal, if there is one (compared only when the sizes
    /// are equal; about as costly as the move itself).
    fn share_moved(&mut self, moved: &[(String, usize)]) {
        for (name, dir) in moved {
            let Some(mine) = self
                .endpoints
                .get(name)
                .map(|ep| Arc::clone(&ep[*dir].entries))
            else {
                continue;
            };
            let same = self
                .endpoints
                .values()
                .map(|ep| &ep[*dir].entries)
                .find(|other| {
                    !Arc::ptr_eq(other, &mine) && other.len() == mine.len() && ***other == *mine
                })
                .cloned();
            if let (Some(same), Some(ep)) = (same, self.endpoints.get_mut(name)) {
                ep[*dir].entries = same;
            }
        }
    }

    /// The recorded MapStates, per local endpoint (`ns/name`).
    pub fn programmed(&self) -> &BTreeMap<String, ProgrammedEndpoint> {
        &self.endpoints
    }

    /// The recorded ipcache.
    pub fn ipcache(&self) -> &BTreeMap<IpNet, Identity> {
        &self.ipcache
    }
}

/// The programming both datapaths share: [`NodeProgram`] writes the engine's state to a
/// [`ControlPlane`], and what was written successfully is recorded.
#[derive(Debug, Default)]
pub struct Programmer {
    /// Writes the engine's state to the datapath.
    pub program: NodeProgram,
    /// What was written successfully.
    pub record: Record,
    /// The last retry of the denied endpoints: when, and the policy keys the maps held then.
    last_retry: Option<(Instant, usize)>,
}

/// How often at most the endpoints denied for lack of room are retried while the policy map
/// holds no fewer keys than at the last try (any change of their policies, and any freed
/// keys, retry them at once).
pub const DENIED_RETRY_EVERY: Duration = Duration::from_secs(30);

/// A map this full is reported (`/readyz`, log): the next policies may not fit.
pub const MAP_PRESSURE_PERCENT: u64 = 90;

impl Programmer {
    /// Programs `dp` from scratch (converging what it holds to `engine`).
    pub fn program_full<D: ControlPlane + ?Sized>(
        &mut self,
        engine: &Engine,
        dp: &mut D,
    ) -> Result<(), AgentError> {
        self.program.program_full(engine, dp)?;
        self.record.program_full(engine);
        Ok(())
    }

    /// Programs the endpoints denied for lack of room ([`NodeProgram::denied`]) with their own
    /// policies again, when the policy map holds fewer keys than at the last try or
    /// [`DENIED_RETRY_EVERY`] has passed; those that still do not fit stay denied.
    pub fn retry_denied<D: ControlPlane + ?Sized>(
        &mut self,
        engine: &Engine,
        dp: &mut D,
    ) -> Result<(), AgentError> {
        if self.program.denied().is_empty() {
            self.last_retry = None;
            return Ok(());
        }
        let held = dp.policy_map_keys();
        if self
            .last_retry
            .is_some_and(|(at, before)| held >= before && at.elapsed() < DENIED_RETRY_EVERY)
        {
            return Ok(());
        }
        let result = self.program.retry_denied(engine, dp);
        self.last_retry = Some((Instant::now(), dp.policy_map_keys()));
        Ok(result?)
    }

    /// Clears the rule sets `dp` released whose grace period is over, unless a full
    /// programming is pending (`needs_full`, which an error sets: the maps may then hold what
    /// the control state no longer describes).
    pub fn reclaim<D: ControlPlane + ?Sized>(
        &mut self,
        dp: &mut D,
        needs_full: &mut bool,
    ) -> Result<(), AgentError> {
        if *needs_full {
            return Ok(());
        }
        Ok(self
            .program
            .reclaim(dp)
            .inspect_err(|_| *needs_full = true)?)
    }

    /// Writes the deltas of one batch to `dp`. On an error `dp` needs a full programming.
    pub fn apply<D: ControlPlane + ?Sized>(
        &mut self,
        engine: &Engine,
        deltas: &[EngineDelta],
        dp: &mut D,
    ) -> Result<(), AgentError> {
        self.program.apply(engine, deltas, dp)?;
        if self.record.apply(deltas).is_err() {
            self.record.program_full(engine);
        }
        Ok(())
    }
}

/// `--datapath none`: programs an in-memory datapath (the kernel's tables without a kernel, and
/// no host addresses: it does not know the node's) and touches no kernel state. Its tables keep
/// no second copy of the policy keys (the rule set store has them), and its policy map is not
/// bounded: every key the node's endpoints need is held and counted (`ordnet_datapath_map_*`).
#[derive(Debug)]
pub struct NoneDatapath {
    programmer: Programmer,
    dp: MemDatapath,
    /// A full programming is owed (an incremental one failed).
    needs_full: bool,
}

impl Default for NoneDatapath {
    fn default() -> Self {
        NoneDatapath::build(false)
    }
}

impl NoneDatapath {
    /// [`NoneDatapath::default`] that also keeps the node-local identity classes of its
    /// writes (`ordnet_datapath::classes`, as the bpf datapath writes them; for the scale
    /// benchmark).
    pub fn with_classes() -> Self {
        NoneDatapath::build(true)
    }

    fn build(classes: bool) -> Self {
        // No kernel map bounds it: every key the node needs is held (and counted).
        let config = ordnet_datapath::DatapathConfig {
            policy_entries: u32::MAX,
            ..ordnet_datapath::DatapathConfig::default()
        };
        let dp = if classes {
            MemDatapath::with_classes(&config)
        } else {
            MemDatapath::new(&config)
        };
        NoneDatapath {
            programmer: Programmer::default(),
            dp: dp.keep_keys_in_store(),
            needs_full: false,
        }
    }

    /// The class-level state, when kept ([`NoneDatapath::with_classes`]).
    pub fn classes(&self) -> Option<&ordnet_datapath::classes::Classed> {
        self.dp.classes()
    }
}

impl NoneDatapath {
    /// The engine → datapath mapping (endpoint ids, write statistics).
    pub fn node_program(&self) -> &NodeProgram {
        &self.programmer.program
    }

    /// The in-memory datapath, writable (tests corrupt it to see who answers).
    #[cfg(test)]
    pub(crate) fn tables_mut(&mut self) -> &mut MemDatapath {
        &mut self.dp
    }
}

impl Enforcer for NoneDatapath {
    fn program_full(&mut self, engine: &Engine) -> Result<(), AgentError> {
        self.needs_full = true;
        self.programmer.program_full(engine, &mut self.dp)?;
        self.needs_full = false;
        Ok(())
    }

    fn apply(&mut self, engine: &Engine, deltas: &[EngineDelta]) -> Result<(), AgentError> {
        if self.needs_full {
            return self.program_full(engine);
        }
        self.programmer
            .apply(engine, deltas, &mut self.dp)
            .inspect_err(|_| self.needs_full = true)
    }

    fn programmed(&self) -> &BTreeMap<String, ProgrammedEndpoint> {
        self.programmer.record.programmed()
    }

    fn ipcache(&self) -> &BTreeMap<IpNet, Identity> {
        self.programmer.record.ipcache()
    }

    fn record_keys(&mut self) {
        self.programmer.record.keep_keys();
    }

    fn plane(&self) -> &dyn ControlPlane {
        &self.dp
    }

    fn maintain(&mut self, engine: &Engine) -> Result<(), AgentError> {
        if self.needs_full {
            return self.program_full(engine);
        }
        self.programmer.retry_denied(engine, &mut self.dp)
    }

    fn reclaim_due(&self) -> Option<Instant> {
        (!self.needs_full).then(|| self.dp.reclaim_due()).flatten()
    }

    fn reclaim(&mut self) -> Result<(), AgentError> {
        self.programmer.reclaim(&mut self.dp, &mut self.needs_full)
    }

    fn denied(&self) -> &BTreeMap<String, String> {
        self.programmer.program.denied()
    }

    fn metrics(&self) -> Vec<Sample> {
        capacity_samples(&self.programmer.program, &self.dp)
    }

    fn health(&self) -> Vec<String> {
        capacity_notes(&self.programmer.program, &self.dp)
    }
}

/// The metrics both datapaths report about room in their maps: each map's entries and
/// capacity, and the endpoints denied because their rule sets did not fit.
pub fn capacity_samples(program: &NodeProgram, plane: &dyn ControlPlane) -> Vec<Sample> {
    let mut out = vec![
        Sample {
            name: "ordnet_datapath_denied_endpoints",
            help: "Local endpoints whose rule sets do not fit the maps: they hold a deny-all \
                   policy in both directions (fail closed).",
            counter: false,
            labels: Vec::new(),
            value: program.denied().len() as u64,
        },
        Sample {
            name: "ordnet_datapath_endpoint_denials",
            help: "Times an endpoint got a deny-all policy because its own did not fit the maps.",
            counter: true,
            labels: Vec::new(),
            value: program.stats().denied,
        },
    ];
    for f in plane.fill() {
        out.push(Sample {
            name: "ordnet_datapath_map_entries",
            help: "Entries a datapath map holds (policy keys, rule sets, cell blocks, ipcache).",
            counter: false,
            labels: vec![("map", f.map.to_string())],
            value: f.entries,
        });
        out.push(Sample {
            name: "ordnet_datapath_map_capacity",
            help: "Entries a datapath map can hold.",
            counter: false,
            labels: vec![("map", f.map.to_string())],
            value: f.capacity,
        });
    }
    out
}

/// The `/readyz` lines both datapaths report about room in their maps: every endpoint denied
/// for lack of room (and why), and every map at [`MAP_PRESSURE_PERCENT`] or more.
pub fn capacity_notes(program: &NodeProgram, plane: &dyn ControlPlane) -> Vec<String> {
    let mut out: Vec<String> = program
        .denied()
        .iter()
        .map(|(who, why)| {
            format!("denied in both directions (its policy does not fit the maps): {who}: {why}")
        })
        .collect();
    for f in plane.fill() {
        if f.percent() >= MAP_PRESSURE_PERCENT {
            out.push(format!(
                "{}: {} of {} entries ({} %): policies that need more fail closed",
                f.map,
                f.entries,
                f.capacity,
                f.percent()
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use ordnet_engine::EndpointUpdate;
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
                changes: changes.into(),
                isolated,
                rebuilt: false,
            }],
            ..EngineDelta::default()
        }
    }

    /// Endpoints with equal keys share one copy in the record, and keep sharing it through a
    /// change set they share (as the engine hands it to every user of a shared MapState).
    #[test]
    fn equal_keys_are_recorded_once() {
        let mut dp = Record::with_keys();
        let k = |port| Key {
            peer: Peer::Id(7),
            prefix: L4Prefix::packet(6, port),
        };
        let ep = |name: &str, changes: Arc<ChangeSet>, rebuilt| EndpointUpdate {
            endpoint: name.into(),
            direction: Direction::Ingress,
            changes,
            isolated: Some(true),
            rebuilt,
        };
        let full = || {
            Arc::new(ChangeSet {
                added: vec![(k(80), entry(Verdict::Allow, 1))],
                ..ChangeSet::default()
            })
        };
        // Two new endpoints, each with a change set of its own.
        dp.apply(&[EngineDelta {
            endpoints_added: vec!["x/a".into(), "x/b".into()],
            updates: vec![ep("x/a", full(), true), ep("x/b", full(), true)],
            ..EngineDelta::default()
        }])
        .unwrap();
        let shared = |dp: &Record| {
            Arc::ptr_eq(
                &dp.programmed()["x/a"][0].entries,
                &dp.programmed()["x/b"][0].entries,
            )
        };
        assert!(shared(&dp));
        let one = Arc::new(ChangeSet {
            added: vec![(k(443), entry(Verdict::Deny, 0))],
            ..ChangeSet::default()
        });
        dp.apply(&[EngineDelta {
            updates: vec![
                ep("x/a", Arc::clone(&one), false),
                ep("x/b", Arc::clone(&one), false),
            ],
            ..EngineDelta::default()
        }])
        .unwrap();
        assert!(shared(&dp));
        assert_eq!(dp.programmed()["x/b"][0].entries.len(), 2);
        // One endpoint alone changes: the other keeps the keys it had.
        dp.apply(&[EngineDelta {
            updates: vec![ep(
                "x/a",
                Arc::new(ChangeSet {
                    removed: vec![(k(80), entry(Verdict::Allow, 1))],
                    ..ChangeSet::default()
                }),
                false,
            )],
            ..EngineDelta::default()
        }])
        .unwrap();
        assert!(!shared(&dp));
        assert_eq!(dp.programmed()["x/a"][0].entries.len(), 1);
        assert_eq!(dp.programmed()["x/b"][0].entries.len(), 2);
    }

    #[test]
    fn deltas_add_change_and_remove_keys() {
        let mut dp = Record::with_keys();
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
        dp.apply(&[added]).unwrap();
        let changed = update(
            ChangeSet {
                changed: vec![(k1, entry(Verdict::Allow, 1), entry(Verdict::Deny, 0))],
                removed: vec![(k2, entry(Verdict::Deny, 2))],
                ..ChangeSet::default()
            },
            Some(false),
        );
        dp.apply(&[changed]).unwrap();
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
        assert!(dp.apply(&[bad]).is_err());
        let gone = EngineDelta {
            endpoints_removed: vec!["x/a".into()],
            ..EngineDelta::default()
        };
        dp.apply(&[gone]).unwrap();
        assert!(dp.programmed().is_empty());
    }
}
