//! A canonical, comparable view of everything the engine computed, with identity numbers
//! replaced by the signatures they stand for and entry ids by the rules and selectors they come
//! from (numbers legitimately differ with allocation order). Two engines over the same objects,
//! however they got there, must have equal snapshots.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use ipnet::IpNet;
use ordnet_mapstate::{
    Action, Direction, EntryId, Identity, L4Prefix, OrderKey, Origin, Peer, Selector, Verdict,
};
use serde::Serialize;

use crate::build::Engine;
use crate::identity::Signature;
use crate::shared::Shared;

/// The peer of a key: `None` = `*`.
pub type SnapPeer = Option<Signature>;

/// Everything, canonical.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Snapshot {
    /// Every endpoint, by `ns/name`.
    pub endpoints: BTreeMap<String, EndpointSnapshot>,
    /// Every ipcache prefix (pod addresses as /32 or /128, CIDR prefixes in use).
    pub ipcache: BTreeMap<IpNet, Signature>,
    /// Every identity with its members.
    pub identities: BTreeMap<Signature, Vec<String>>,
}

/// One endpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct EndpointSnapshot {
    /// [`Endpoint::ips`](crate::Endpoint::ips).
    pub ips: Vec<IpAddr>,
    /// [`Endpoint::node`](crate::Endpoint::node).
    pub node: Option<String>,
    /// The signature of each address's identity (same order as `ips`).
    pub identities: Vec<Signature>,
    /// The ingress MapState.
    pub ingress: PolicySnapshot,
    /// The egress MapState.
    pub egress: PolicySnapshot,
}

/// One endpoint and direction.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PolicySnapshot {
    /// The MapState's default verdict.
    pub default: Verdict,
    /// [`EndpointPolicy::isolated`](crate::EndpointPolicy::isolated).
    pub isolated: bool,
    /// [`EndpointPolicy::isolated_by`](crate::EndpointPolicy::isolated_by).
    pub isolated_by: Vec<Origin>,
    /// The MapState's keys and values.
    pub keys: Vec<(SnapPeer, L4Prefix, SnapEntry)>,
    /// The covered contributions: (entry, its key's peer and prefix, the covering key's peer
    /// and prefix).
    pub covered: Vec<(String, SnapPeer, L4Prefix, SnapPeer, L4Prefix)>,
    /// The policy entries fed to the MapState: (entry, order, action, selected identities or
    /// `None` for every identity).
    pub entries: Vec<(String, OrderKey, Action, Option<BTreeSet<Signature>>)>,
}

/// A MapState value.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct SnapEntry {
    /// `StateEntry::verdict`.
    pub verdict: Verdict,
    /// `StateEntry::order`.
    pub order: OrderKey,
    /// The merged policy entries as `origin | peer | l4 | named port` text, sorted.
    pub entries: Vec<String>,
    /// `StateEntry::origins`.
    pub origins: Vec<Origin>,
    /// `StateEntry::synthesized`: a wildcard entry copied under an identity.
    pub synthesized: bool,
}

impl Engine {
    fn sig_of(&self, id: Identity) -> Signature {
        self.ids.sig(id).cloned().unwrap_or(Signature::World)
    }

    fn snap_peer(&self, p: Peer) -> SnapPeer {
        match p {
            Peer::Any => None,
            Peer::Id(id) => Some(self.sig_of(id)),
        }
    }

    fn entry_text(s: &Shared, id: EntryId) -> String {
        if let Some((pass, source)) = s.policy.mapstate.copy_of(id) {
            return format!(
                "{} under the pass of {}",
                Self::entry_text(s, source),
                Self::entry_text(s, pass)
            );
        }
        match s.entries.get(&id) {
            Some(k) => format!(
                "{} | {} | {} | {}",
                k.origin,
                k.peer
                    .as_ref()
                    .map_or_else(|| "*".to_string(), |p| p.to_string()),
                k.l4,
                k.named.as_deref().unwrap_or("-")
            ),
            None => format!("unknown entry {id}"),
        }
    }

    fn policy_snapshot(&self, s: &Shared) -> PolicySnapshot {
        let ms = &s.policy.mapstate;
        let mut keys: Vec<(SnapPeer, L4Prefix, SnapEntry)> = ms
            .iter()
            .into_iter()
            .map(|(k, e)| {
                let mut entries: Vec<String> = e
                    .entries
                    .iter()
                    .map(|id| Self::entry_text(s, *id))
                    .collect();
                entries.sort();
                (
                    self.snap_peer(k.peer),
                    k.prefix,
                    SnapEntry {
                        verdict: e.verdict,
                        order: e.order,
                        entries,
                        origins: e.origins.iter().map(|o| (**o).clone()).collect(),
                        synthesized: e.synthesized,
                    },
                )
            })
            .collect();
        keys.sort();
        let mut covered: Vec<_> = ms
            .covered()
            .into_iter()
            .map(|c| {
                (
                    Self::entry_text(s, c.entry),
                    self.snap_peer(c.key.peer),
                    c.key.prefix,
                    self.snap_peer(c.covered_by.peer),
                    c.covered_by.prefix,
                )
            })
            .collect();
        covered.sort();
        let mut entries: Vec<_> = ms
            .policy_entries()
            .into_iter()
            .map(|e| {
                (
                    Self::entry_text(s, e.id),
                    e.order,
                    e.action,
                    match &e.selector {
                        Selector::Any => None,
                        Selector::Ids(ids) => Some(ids.iter().map(|i| self.sig_of(i)).collect()),
                    },
                )
            })
            .collect();
        entries.sort();
        PolicySnapshot {
            default: ms.default_verdict(),
            isolated: s.policy.isolated,
            isolated_by: s.policy.isolated_by.iter().map(|o| (**o).clone()).collect(),
            keys,
            covered,
            entries,
        }
    }

    /// The canonical view of the engine (see the module documentation).
    pub fn snapshot(&self) -> Snapshot {
        let mut endpoints = BTreeMap::new();
        for ep in &self.endpoints {
            let k = (ep.namespace.clone(), ep.name.clone());
            let Some(keys) = self.ep_keys.get(&k) else {
                continue;
            };
            let [ingress, egress] = Direction::ALL.map(|d: Direction| {
                let key = &keys[d.index()];
                match self.shared.get(key) {
                    Some(s) => self.policy_snapshot(s),
                    None => PolicySnapshot {
                        default: Verdict::Allow,
                        isolated: false,
                        isolated_by: Vec::new(),
                        keys: vec![(None, L4Prefix::ANY, missing())],
                        covered: Vec::new(),
                        entries: Vec::new(),
                    },
                }
            });
            endpoints.insert(
                ep.id(),
                EndpointSnapshot {
                    ips: ep.ips.clone(),
                    node: ep.node.clone(),
                    identities: ep.identities.iter().map(|i| self.sig_of(*i)).collect(),
                    ingress,
                    egress,
                },
            );
        }
        let ipcache = self
            .ipcache()
            .into_iter()
            .map(|(n, id)| (n, self.sig_of(id)))
            .collect();
        let identities = self
            .ids
            .recs
            .values()
            .map(|r| (r.sig.clone(), r.info.members.clone()))
            .collect();
        Snapshot {
            endpoints,
            ipcache,
            identities,
        }
    }
}

/// Marks a missing shared state (never expected) so that a comparison fails.
fn missing() -> SnapEntry {
    SnapEntry {
        verdict: Verdict::Deny,
        order: OrderKey::new(i32::MIN, u32::MAX),
        entries: vec!["missing shared state".into()],
        origins: Vec::new(),
        synthesized: false,
    }
}
