//! Incremental updates: one object change -> only the necessary MapState changes.
//!
//! [`Engine::apply`] runs these steps (see `docs/engine.md`, "Incremental algorithm"):
//! 1. update the object store; note the pods whose signature inputs changed, and the policies
//!    that changed (old and new version);
//! 2. the universe: CIDR prefixes and egress named ports in use; when they change, the pods whose
//!    addresses lie in a changed prefix or that serve a changed named port are re-signed too;
//! 3. identities: acquire the new signatures of every re-signed pod first, then release the old
//!    ones (so an identity that stays in use never flaps); CIDR identities for added/removed
//!    prefixes; the ipcache changes fall out of it;
//! 4. selector cache: the changed policies' selectors are released/added (a new selector is
//!    evaluated over all identities); every existing selector is tested against the new
//!    identities and loses the removed ones. An identity's membership never changes otherwise
//!    (signatures and selectors are both immutable), so these gains and losses are the
//!    notifications;
//! 5. endpoints: the endpoints whose selecting policies or own named ports may have changed get
//!    their share keys recomputed; shared MapStates still in use receive `Update`s (a changed
//!    policy: its entries diffed; a notification: `AddIdentity`/`RemoveIdentity`, plus
//!    `AddEntry`/`Select`/`RemoveEntry` for egress named-port groups); an endpoint whose key
//!    changed moves to the MapState of its new key (compiled if no endpoint has it yet) and gets
//!    the diff between its old and new state as its ChangeSet.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use ipnet::IpNet;
use ordnet_mapstate::{ChangeSet, Direction, Identity, Key, MapState, StateEntry};
use serde::Serialize;

use crate::build::Engine;
use crate::model::{EngineError, Policy, PolicyKind, PolicyRef};
use crate::objects::{Object, ObjectChange, ObjectKind};
use crate::shared::ShareKey;
use crate::store::{PodKey, PodRec, read_namespace, read_pod};

/// The change of one endpoint's MapState in one direction.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct EndpointUpdate {
    /// `ns/name`.
    pub endpoint: String,
    /// The MapState's direction.
    pub direction: Direction,
    /// The keys added, changed and removed (for a new endpoint: all of its keys, added).
    /// Shared: every endpoint of a shared MapState gets the same ChangeSet (a namespace relabel
    /// changes thousands of keys in each of the node's states).
    pub changes: Arc<ChangeSet>,
    /// The new isolation (and so default verdict), when it changed or the endpoint is new.
    pub isolated: Option<bool>,
    /// Whether the endpoint moved to another MapState (its selecting policies or own named
    /// ports changed, or it is new) instead of receiving incremental updates.
    pub rebuilt: bool,
}

/// One ipcache change: the identity of a prefix (a pod address is a /32 or /128).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct IpcacheChange {
    /// The ipcache key.
    pub prefix: IpNet,
    /// Its identity before the change; `None` = the entry is new.
    pub old: Option<Identity>,
    /// Its identity after the change; `None` = the entry is removed.
    pub new: Option<Identity>,
}

/// Everything one [`ObjectChange`] changed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct EngineDelta {
    /// `ns/name` of endpoints that appeared (their full state is in `updates`).
    pub endpoints_added: Vec<String>,
    /// `ns/name` of endpoints that are gone.
    pub endpoints_removed: Vec<String>,
    /// Per endpoint and direction, sorted.
    pub updates: Vec<EndpointUpdate>,
    /// The ipcache entries that changed (exact: only prefixes whose identity differs).
    pub ipcache: Vec<IpcacheChange>,
    /// Identities allocated by this change, ascending.
    pub identities_added: Vec<Identity>,
    /// Identities released by this change (no address has them any more), ascending.
    pub identities_removed: Vec<Identity>,
    /// Identities that kept their number under new labels (every address of one moved to one
    /// new signature), ascending: their addresses keep them; the selectors that tell the old
    /// labels from the new changed their keys in `updates`.
    pub identities_relabelled: Vec<Identity>,
    /// A Service was added, changed or removed: the frontends may have changed
    /// (`Engine::service_frontends`, `Engine::node_ports`).
    pub services_changed: bool,
    /// The change was invalid and not applied.
    pub errors: Vec<EngineError>,
}

impl EngineDelta {
    /// Whether nothing changed.
    pub fn is_empty(&self) -> bool {
        self.endpoints_added.is_empty()
            && self.endpoints_removed.is_empty()
            && self.updates.is_empty()
            && self.ipcache.is_empty()
            && self.identities_added.is_empty()
            && self.identities_removed.is_empty()
            && self.identities_relabelled.is_empty()
            && !self.services_changed
            && self.errors.is_empty()
    }
}

/// At most this many policies may differ between an endpoint's old and new share keys for the
/// endpoint to take its old MapState over instead of compiling a new one.
pub(crate) const MAX_DERIVE_DIFF: usize = 3;

/// How many times cheaper per (identity, entry) pair compiling a MapState is than updating one
/// in place. Measured at 10,000 pods / 5,000 policies: a compilation costs about 90 ns per pair
/// (it computes each distinct candidate list once), an update in place 10-20 µs per pair of
/// the differing policies (every identity they select is recomputed on its own). Taking a
/// state over whose differing policies weighed 2,000-10,000 pairs of 40,000 took 40-100 ms,
/// compiling 5-9 ms.
pub(crate) const DERIVE_COST_RATIO: usize = 128;

/// A changed policy: (old, new); `None` = absent.
pub(crate) type PolicyVersions = (Option<Arc<Policy>>, Option<Arc<Policy>>);

/// A MapState's keys and isolation as they were before an update.
pub(crate) type StateSnapshot = (Vec<(Key, StateEntry)>, bool);

/// What the object-store step found.
#[derive(Default)]
pub(crate) struct Pending {
    /// Pods whose labels, addresses, ports, node or namespace labels changed (or that were
    /// added/removed).
    pub pods: BTreeSet<PodKey>,
    /// Old records of removed pods.
    pub removed_pods: BTreeMap<PodKey, PodRec>,
    /// Changed policies: (old, new).
    pub policies: BTreeMap<PolicyRef, PolicyVersions>,
    /// A Service changed.
    pub services: bool,
}

/// The diff between two states' keys, each read in key order (`MapState::keys_sorted`, or a
/// snapshot's list). Read as they go: listing both first took two buffers of every key (at 10k
/// pods / 5k policies ~0.8 MiB each for a moving endpoint's 35,000 keys, new pages each time).
pub(crate) fn diff_states<'a>(
    old: impl IntoIterator<Item = (Key, &'a StateEntry)>,
    new: impl IntoIterator<Item = (Key, &'a StateEntry)>,
) -> ChangeSet {
    let mut cs = ChangeSet::default();
    let (mut old, mut new) = (old.into_iter().peekable(), new.into_iter().peekable());
    loop {
        match (old.peek(), new.peek()) {
            (Some((ko, eo)), Some((kn, en))) if ko == kn => {
                if eo != en {
                    cs.changed.push((*ko, (*eo).clone(), (*en).clone()));
                }
                old.next();
                new.next();
            }
            (Some((ko, eo)), Some((kn, _))) if ko < kn => {
                cs.removed.push((*ko, (*eo).clone()));
                old.next();
            }
            (Some((ko, eo)), None) => {
                cs.removed.push((*ko, (*eo).clone()));
                old.next();
            }
            (_, Some((kn, en))) => {
                cs.added.push((*kn, (*en).clone()));
                new.next();
            }
            (None, None) => break,
        }
    }
    cs
}

/// Every key of `state` with a copy of its entry, in key order.
pub(crate) fn owned(state: &MapState) -> Vec<(Key, StateEntry)> {
    let mut out = Vec::with_capacity(state.len());
    out.extend(state.keys_sorted().map(|(k, e)| (k, e.clone())));
    out
}

impl Engine {
    /// Applies one object change incrementally and returns what changed. Invalid objects are not
    /// applied (the delta carries the error and nothing else).
    pub fn apply(&mut self, change: ObjectChange) -> EngineDelta {
        let mut pending = Pending::default();
        if let Err(e) = self.store(change, &mut pending) {
            return EngineDelta {
                errors: vec![e],
                ..EngineDelta::default()
            };
        }
        self.sync(pending)
    }

    /// Applies several changes, one after the other, returning every delta.
    pub fn apply_all(
        &mut self,
        changes: impl IntoIterator<Item = ObjectChange>,
    ) -> Vec<EngineDelta> {
        changes.into_iter().map(|c| self.apply(c)).collect()
    }

    /// Step 1: the object store.
    /// A pod read: stored (keeping its identities until they are recomputed) and marked, if it
    /// changed.
    fn store_pod(&mut self, k: PodKey, mut rec: PodRec, p: &mut Pending) {
        match self.store.pods.get(&k) {
            Some(old) => {
                rec.ids = old.ids.clone();
                rec.signed_ips = old.signed_ips.clone();
                if *old != rec {
                    self.store.insert_pod(k.clone(), rec);
                    p.pods.insert(k);
                }
            }
            None => {
                self.store.insert_pod(k.clone(), rec);
                p.pods.insert(k);
            }
        }
    }

    fn store(&mut self, change: ObjectChange, p: &mut Pending) -> Result<(), EngineError> {
        let default_ns = || ordnet_crds::DEFAULT_NAMESPACE.to_string();
        match change {
            ObjectChange::Upsert(Object::Namespace(ns)) => {
                let (name, labels) = read_namespace(&ns)?;
                if self.store.namespaces.get(&name) != Some(&labels) {
                    self.store.namespaces.insert(name.clone(), labels);
                    self.mark_namespace(&name, p);
                }
            }
            ObjectChange::Delete {
                kind: ObjectKind::Namespace,
                name,
                ..
            } => {
                let before = self.store.ns_labels(&name);
                self.store.namespaces.remove(&name);
                if self.store.ns_labels(&name) != before {
                    self.mark_namespace(&name, p);
                }
            }
            ObjectChange::Upsert(Object::Pod(pod)) => {
                let (k, rec) = read_pod(&pod)?;
                self.store_pod(k, rec, p);
            }
            ObjectChange::Upsert(Object::ReadPod(r)) => {
                let (k, rec) = r.into_read()?;
                self.store_pod(k, rec, p);
            }
            ObjectChange::Upsert(Object::Service(svc)) => {
                let (k, rec) = crate::services::read_service(&svc)?;
                if self.store.services.get(&k).map(|r| &**r) != Some(&rec) {
                    self.store.services.insert(k, Arc::new(rec));
                    p.services = true;
                }
            }
            ObjectChange::Delete {
                kind: ObjectKind::Service,
                namespace,
                name,
            } => {
                let k = (namespace.unwrap_or_else(default_ns), name);
                p.services |= self.store.services.remove(&k).is_some();
            }
            ObjectChange::Delete {
                kind: ObjectKind::Pod,
                namespace,
                name,
            } => {
                let k = (namespace.unwrap_or_else(default_ns), name);
                if let Some(old) = self.store.pods.remove(&k) {
                    p.removed_pods.insert(k.clone(), old);
                    p.pods.insert(k);
                }
            }
            ObjectChange::Upsert(Object::ClusterNetworkPolicy(cnp)) => {
                let new = self.store.translate_cnp(&cnp)?;
                self.store
                    .cnp_objects
                    .insert(new.id.name.clone(), Arc::new(*cnp));
                self.store_policy(Some(new.id.clone()), Some(new), p);
            }
            ObjectChange::Upsert(Object::Node(node)) => {
                let name = node.metadata.name.clone().unwrap_or_default();
                if name.is_empty() {
                    return Err(EngineError {
                        object: format!("Node {name}"),
                        field: "metadata.name".into(),
                        message: "required".into(),
                    });
                }
                let rec = (
                    node.metadata.labels.clone().unwrap_or_default(),
                    crate::model::node_addresses(&node),
                );
                if self.store.nodes.get(&name) != Some(&rec) {
                    self.store.nodes.insert(name, rec);
                    self.retranslate_node_peers(p);
                }
            }
            ObjectChange::Delete {
                kind: ObjectKind::Node,
                name,
                ..
            } => {
                if self.store.nodes.remove(&name).is_some() {
                    self.retranslate_node_peers(p);
                }
            }
            ObjectChange::Upsert(
                o @ (Object::NetworkPolicy(_)
                | Object::OrderedNetworkPolicy(_)
                | Object::ClusterOrderedNetworkPolicy(_)),
            ) => {
                if o.staged() && !self.options.staged {
                    // A staged policy decides nothing: as if it were absent (its previous,
                    // enforced version, if any, goes).
                    let (namespace, name) = o.key();
                    let delete = ObjectChange::Delete {
                        kind: o.kind(),
                        namespace: (!namespace.is_empty()).then_some(namespace),
                        name,
                    };
                    return self.store(delete, p);
                } else if let Some(new) = o.translate() {
                    let new = new?;
                    self.store_policy(Some(new.id.clone()), Some(new), p);
                }
            }
            ObjectChange::Delete {
                kind,
                namespace,
                name,
            } => {
                let (kind, namespace) = match kind {
                    ObjectKind::NetworkPolicy => (
                        PolicyKind::NetworkPolicy,
                        Some(namespace.unwrap_or_else(default_ns)),
                    ),
                    ObjectKind::OrderedNetworkPolicy => (
                        PolicyKind::Ordered,
                        Some(namespace.unwrap_or_else(default_ns)),
                    ),
                    ObjectKind::ClusterNetworkPolicy => {
                        self.store.cnp_objects.remove(&name);
                        (PolicyKind::ClusterNetwork, None)
                    }
                    _ => (PolicyKind::ClusterOrdered, None),
                };
                let id = PolicyRef {
                    kind,
                    namespace,
                    name,
                };
                self.store_policy(Some(id), None, p);
            }
        }
        Ok(())
    }

    fn mark_namespace(&self, ns: &str, p: &mut Pending) {
        for k in self
            .store
            .pods
            .range((ns.to_string(), String::new())..)
            .take_while(|(k, _)| k.0 == ns)
            .map(|(k, _)| k)
        {
            p.pods.insert(k.clone());
        }
    }

    /// A Node changed: every ClusterNetworkPolicy with a `nodes` peer is translated again (its
    /// peers hold the addresses); those whose translation changed are changed policies.
    fn retranslate_node_peers(&mut self, p: &mut Pending) {
        let with_nodes: Vec<Arc<ordnet_crds::ClusterNetworkPolicy>> = self
            .store
            .cnp_objects
            .values()
            .filter(|c| {
                c.spec
                    .egress
                    .iter()
                    .any(|r| r.to.iter().any(|t| t.nodes.is_some()))
            })
            .cloned()
            .collect();
        for cnp in with_nodes {
            if let Ok(new) = self.store.translate_cnp(&cnp) {
                self.store_policy(Some(new.id.clone()), Some(new), p);
            }
        }
    }

    fn store_policy(&mut self, id: Option<PolicyRef>, new: Option<Policy>, p: &mut Pending) {
        let Some(id) = id else { return };
        if let (Some(old), Some(new)) = (self.store.policies.get(&id), new.as_ref())
            && **old == *new
        {
            return;
        }
        let old = self.store.remove_policy(&id);
        let new = new.map(Arc::new);
        if let Some(n) = &new {
            self.store.insert_policy(n.clone());
        }
        if old.is_none() && new.is_none() {
            return;
        }
        let first_old = p.policies.remove(&id).map(|(o, _)| o).unwrap_or(old);
        p.policies.insert(id, (first_old, new));
    }

    /// The ipcache entry of exactly `net` (a pod address or a CIDR prefix in use); records of
    /// pods removed by the current change are looked up in `removed`.
    pub(crate) fn ipcache_exact(
        &self,
        net: &IpNet,
        removed: &BTreeMap<PodKey, PodRec>,
    ) -> Option<Identity> {
        let host = net.prefix_len() == net.max_prefix_len();
        if host
            && let Some(k) = self.pod_addrs.get(&net.addr())
            && let Some(rec) = removed.get(k).or_else(|| self.store.pods.get(k))
            && let Some(pos) = rec.signed_ips.iter().position(|a| *a == net.addr())
            && let Some(id) = rec.ids.get(pos)
        {
            return Some(*id);
        }
        self.cidr_ids.get(net).copied()
    }

    pub(crate) fn key_diff(
        &self,
        old: &ShareKey,
        new: &ShareKey,
        changed: &BTreeSet<PolicyRef>,
    ) -> BTreeSet<PolicyRef> {
        let a: BTreeSet<&PolicyRef> = old.policies.iter().collect();
        let b: BTreeSet<&PolicyRef> = new.policies.iter().collect();
        let mut out: BTreeSet<PolicyRef> =
            a.symmetric_difference(&b).map(|p| (*p).clone()).collect();
        for p in a.intersection(&b) {
            let named = old.own_ports != new.own_ports
                && self
                    .store
                    .policies
                    .get(*p)
                    .is_some_and(|pol| !pol.named_ports(Direction::Ingress).is_empty());
            if changed.contains(*p) || named {
                out.insert((*p).clone());
            }
        }
        out
    }

    /// Whether updating the old state in place with the entries of the policies `differing`
    /// (the endpoint's sole state, taking it over) is cheaper than compiling the state of
    /// `new` ([`DERIVE_COST_RATIO`], or the ratio a test set).
    pub(crate) fn derive_is_cheaper(
        &self,
        new: &ShareKey,
        differing: &BTreeSet<PolicyRef>,
    ) -> bool {
        let identities = self.ids.recs.len();
        let derive: usize = differing
            .iter()
            .map(|p| self.policy_weight(p, new.dir, identities))
            .sum();
        let compile: usize = new
            .policies
            .iter()
            .map(|p| self.policy_weight(p, new.dir, 1))
            .sum();
        derive.saturating_mul(self.derive_cost_ratio) <= compile
    }

    /// A copy of this engine that enforces staged policies too ([`BuildOptions::staged`]):
    /// upserting the staged policies into it gives what the cluster would be with them
    /// enforced (the agent's staged view: the same changes applied to both).
    ///
    /// [`BuildOptions::staged`]: crate::BuildOptions::staged
    pub fn staged_view(&self) -> Engine {
        let mut e = self.clone();
        e.options.staged = true;
        e
    }

    /// Replaces [`DERIVE_COST_RATIO`]; 0 takes the old state over whenever at most
    /// [`MAX_DERIVE_DIFF`] policies differ. For tests: both ways to a new state must give the
    /// same result, and small test clusters would otherwise almost always compile.
    #[doc(hidden)]
    pub fn set_derive_cost_ratio(&mut self, ratio: usize) {
        self.derive_cost_ratio = ratio;
    }

    /// A rough cost of adding or removing policy `p`'s entries in a state of direction `dir`:
    /// the (identity, entry) pairs its selectors give, each rule without peers (a wildcard)
    /// counting `wildcard` pairs per port. (For an update in place a wildcard can make every
    /// identity of the state dirty; for a compilation it is one entry.)
    fn policy_weight(&self, p: &PolicyRef, dir: Direction, wildcard: usize) -> usize {
        let Some(policy) = self.store.policies.get(p) else {
            return 0;
        };
        policy.rules[dir.index()]
            .iter()
            .map(|rule| {
                let ports = rule.ports.as_ref().map_or(1, |v| v.len().max(1));
                let peers = match &rule.peers {
                    None => wildcard,
                    Some(v) => v
                        .iter()
                        .map(|spec| self.selectors.get(spec).map_or(0, |s| s.ids.len()))
                        .sum(),
                };
                ports * peers
            })
            .sum()
    }

    /// Local endpoints that a policy's subject may select (all pods of its namespace, or all).
    pub(crate) fn subject_candidates(&self, p: &Policy) -> Vec<PodKey> {
        match &p.id.namespace {
            Some(ns) => self
                .store
                .pods
                .range((ns.clone(), String::new())..)
                .take_while(|(k, _)| &k.0 == ns)
                .map(|(k, _)| k.clone())
                .collect(),
            None => self.store.pods.keys().cloned().collect(),
        }
    }
}
