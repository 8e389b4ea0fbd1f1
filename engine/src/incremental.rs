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

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::{Namespace, Pod, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use ordnet_crds::{ClusterOrderedNetworkPolicy, OrderedNetworkPolicy};
use ordnet_mapstate::{
    ChangeSet, Direction, EntryId, Identity, Key, L4Match, PolicyEntry, Protocol, Selector,
    StateEntry, Update, Verdict,
};
use serde::Serialize;

use crate::engine::{
    Endpoint, Engine, EntryKey, NamedGroup, PodKey, PodRec, PolicyIndex, SelId, ShareKey,
    pod_key_text, read_namespace, read_pod, selects,
};
use crate::identity::Signature;
use crate::model::{
    DIRECTIONS, EngineError, PeerSpec, Policy, PolicyKind, PolicyRef, dir_index,
    translate_cluster_policy, translate_network_policy, translate_ordered_policy,
};

/// A Kubernetes object the engine consumes.
// Objects are moved once per change; boxing them would only make the API clumsier.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum Object {
    Namespace(Namespace),
    Pod(Pod),
    Service(Service),
    NetworkPolicy(NetworkPolicy),
    OrderedNetworkPolicy(OrderedNetworkPolicy),
    ClusterOrderedNetworkPolicy(ClusterOrderedNetworkPolicy),
}

impl Object {
    /// The object's kind.
    pub fn kind(&self) -> ObjectKind {
        match self {
            Object::Namespace(_) => ObjectKind::Namespace,
            Object::Pod(_) => ObjectKind::Pod,
            Object::Service(_) => ObjectKind::Service,
            Object::NetworkPolicy(_) => ObjectKind::NetworkPolicy,
            Object::OrderedNetworkPolicy(_) => ObjectKind::OrderedNetworkPolicy,
            Object::ClusterOrderedNetworkPolicy(_) => ObjectKind::ClusterOrderedNetworkPolicy,
        }
    }

    /// The object's metadata.
    pub fn meta(&self) -> &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
        match self {
            Object::Namespace(x) => &x.metadata,
            Object::Pod(x) => &x.metadata,
            Object::Service(x) => &x.metadata,
            Object::NetworkPolicy(x) => &x.metadata,
            Object::OrderedNetworkPolicy(x) => &x.metadata,
            Object::ClusterOrderedNetworkPolicy(x) => &x.metadata,
        }
    }

    /// `(namespace, name)`: the namespace is empty for cluster-scoped kinds and `default` when
    /// a namespaced object has none.
    pub fn key(&self) -> (String, String) {
        let meta = self.meta();
        let ns = if self.kind().namespaced() {
            meta.namespace
                .clone()
                .unwrap_or_else(|| ordnet_crds::manifest::DEFAULT_NAMESPACE.to_string())
        } else {
            String::new()
        };
        (ns, meta.name.clone().unwrap_or_default())
    }

    /// The normalized policy of a policy object (`None` for pods and namespaces): `Err` when
    /// the engine cannot use the object at all (it is left out); otherwise the policy, whose
    /// [`Policy::failed_rules`] lists the rules enforced fail-closed instead of as written.
    pub fn translate(&self) -> Option<Result<Policy, EngineError>> {
        Some(match self {
            Object::NetworkPolicy(np) => translate_network_policy(np),
            Object::OrderedNetworkPolicy(onp) => translate_ordered_policy(onp),
            Object::ClusterOrderedNetworkPolicy(conp) => translate_cluster_policy(conp),
            Object::Namespace(_) | Object::Pod(_) | Object::Service(_) => return None,
        })
    }
}

/// The kind of an object, for deletions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum ObjectKind {
    Namespace,
    Pod,
    Service,
    NetworkPolicy,
    OrderedNetworkPolicy,
    ClusterOrderedNetworkPolicy,
}

impl ObjectKind {
    /// Every kind the engine consumes, in the order it prefers to see them (namespaces and pods
    /// before the policies that select them).
    pub const ALL: [ObjectKind; 6] = [
        ObjectKind::Namespace,
        ObjectKind::Pod,
        ObjectKind::Service,
        ObjectKind::NetworkPolicy,
        ObjectKind::OrderedNetworkPolicy,
        ObjectKind::ClusterOrderedNetworkPolicy,
    ];

    /// The position in [`ObjectKind::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// The name as Kubernetes spells it.
    pub fn name(self) -> &'static str {
        use ordnet_crds::manifest as m;
        match self {
            ObjectKind::Namespace => m::KIND_NAMESPACE,
            ObjectKind::Pod => m::KIND_POD,
            ObjectKind::Service => m::KIND_SERVICE,
            ObjectKind::NetworkPolicy => m::KIND_NETWORK_POLICY,
            ObjectKind::OrderedNetworkPolicy => m::KIND_ORDERED,
            ObjectKind::ClusterOrderedNetworkPolicy => m::KIND_CLUSTER_ORDERED,
        }
    }

    /// Whether objects of the kind live in a namespace.
    pub fn namespaced(self) -> bool {
        !matches!(
            self,
            ObjectKind::Namespace | ObjectKind::ClusterOrderedNetworkPolicy
        )
    }
}

/// One change of the cluster.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum ObjectChange {
    /// Added or updated.
    Upsert(Object),
    /// Deleted (`namespace` is ignored for cluster-scoped kinds; absent = `default` for
    /// namespaced ones).
    Delete {
        kind: ObjectKind,
        namespace: Option<String>,
        name: String,
    },
}

/// The change of one endpoint's MapState in one direction.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct EndpointUpdate {
    /// `ns/name`.
    pub endpoint: String,
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
    pub prefix: IpNet,
    pub old: Option<Identity>,
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
    pub ipcache: Vec<IpcacheChange>,
    pub identities_added: Vec<Identity>,
    pub identities_removed: Vec<Identity>,
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
            && !self.services_changed
            && self.errors.is_empty()
    }
}

/// At most this many policies may differ between an endpoint's old and new share keys for the
/// endpoint to take its old MapState over instead of compiling a new one.
const MAX_DERIVE_DIFF: usize = 3;

/// A changed policy: (old, new); `None` = absent.
type PolicyVersions = (Option<Arc<Policy>>, Option<Arc<Policy>>);

/// A MapState's keys and isolation as they were before an update.
type StateSnapshot = (Vec<(Key, StateEntry)>, bool);

/// What the object-store step found.
#[derive(Default)]
struct Pending {
    /// Pods whose labels, addresses, ports, node or namespace labels changed (or that were
    /// added/removed).
    pods: BTreeSet<PodKey>,
    /// Old records of removed pods.
    removed_pods: BTreeMap<PodKey, PodRec>,
    /// Changed policies: (old, new).
    policies: BTreeMap<PolicyRef, PolicyVersions>,
    /// A Service changed.
    services: bool,
}

/// The diff between two key lists (both sorted by key).
pub(crate) fn diff_states(old: &[(Key, &StateEntry)], new: &[(Key, &StateEntry)]) -> ChangeSet {
    let mut cs = ChangeSet::default();
    let (mut i, mut j) = (0, 0);
    while i < old.len() || j < new.len() {
        match (old.get(i), new.get(j)) {
            (Some((ko, eo)), Some((kn, en))) if ko == kn => {
                if eo != en {
                    cs.changed.push((*ko, (*eo).clone(), (*en).clone()));
                }
                i += 1;
                j += 1;
            }
            (Some((ko, eo)), Some((kn, _))) if ko < kn => {
                cs.removed.push((*ko, (*eo).clone()));
                i += 1;
            }
            (Some((ko, eo)), None) => {
                cs.removed.push((*ko, (*eo).clone()));
                i += 1;
            }
            (_, Some((kn, en))) => {
                cs.added.push((*kn, (*en).clone()));
                j += 1;
            }
            (None, None) => break,
        }
    }
    cs
}

fn owned(list: Vec<(Key, &StateEntry)>) -> Vec<(Key, StateEntry)> {
    list.into_iter().map(|(k, e)| (k, e.clone())).collect()
}

fn same_policy(origin: &ordnet_mapstate::Origin, id: &PolicyRef) -> bool {
    origin.kind == id.kind.as_str() && origin.namespace == id.namespace && origin.name == id.name
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
    fn store(&mut self, change: ObjectChange, p: &mut Pending) -> Result<(), EngineError> {
        let default_ns = || ordnet_crds::manifest::DEFAULT_NAMESPACE.to_string();
        match change {
            ObjectChange::Upsert(Object::Namespace(ns)) => {
                let (name, labels) = read_namespace(&ns)?;
                if self.namespaces.get(&name) != Some(&labels) {
                    self.namespaces.insert(name.clone(), labels);
                    self.mark_namespace(&name, p);
                }
            }
            ObjectChange::Delete {
                kind: ObjectKind::Namespace,
                name,
                ..
            } => {
                let before = self.ns_labels(&name);
                self.namespaces.remove(&name);
                if self.ns_labels(&name) != before {
                    self.mark_namespace(&name, p);
                }
            }
            ObjectChange::Upsert(Object::Pod(pod)) => {
                let (k, mut rec) = read_pod(&pod)?;
                match self.pods.get(&k) {
                    Some(old) => {
                        rec.ids = old.ids.clone();
                        rec.signed_ips = old.signed_ips.clone();
                        if *old != rec {
                            self.pods.insert(k.clone(), rec);
                            p.pods.insert(k);
                        }
                    }
                    None => {
                        self.pods.insert(k.clone(), rec);
                        p.pods.insert(k);
                    }
                }
            }
            ObjectChange::Upsert(Object::Service(svc)) => {
                let (k, rec) = crate::services::read_service(&svc)?;
                if self.services.get(&k).map(|r| &**r) != Some(&rec) {
                    self.services.insert(k, Arc::new(rec));
                    p.services = true;
                }
            }
            ObjectChange::Delete {
                kind: ObjectKind::Service,
                namespace,
                name,
            } => {
                let k = (namespace.unwrap_or_else(default_ns), name);
                p.services |= self.services.remove(&k).is_some();
            }
            ObjectChange::Delete {
                kind: ObjectKind::Pod,
                namespace,
                name,
            } => {
                let k = (namespace.unwrap_or_else(default_ns), name);
                if let Some(old) = self.pods.remove(&k) {
                    p.removed_pods.insert(k.clone(), old);
                    p.pods.insert(k);
                }
            }
            ObjectChange::Upsert(
                o @ (Object::NetworkPolicy(_)
                | Object::OrderedNetworkPolicy(_)
                | Object::ClusterOrderedNetworkPolicy(_)),
            ) => {
                if let Some(new) = o.translate() {
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
            .pods
            .range((ns.to_string(), String::new())..)
            .take_while(|(k, _)| k.0 == ns)
            .map(|(k, _)| k)
        {
            p.pods.insert(k.clone());
        }
    }

    fn store_policy(&mut self, id: Option<PolicyRef>, new: Option<Policy>, p: &mut Pending) {
        let Some(id) = id else { return };
        if let (Some(old), Some(new)) = (self.policies.get(&id), new.as_ref())
            && **old == *new
        {
            return;
        }
        let old = self.remove_policy_record(&id);
        let new = new.map(Arc::new);
        if let Some(n) = &new {
            self.insert_policy_record(n.clone());
        }
        if old.is_none() && new.is_none() {
            return;
        }
        let first_old = p.policies.remove(&id).map(|(o, _)| o).unwrap_or(old);
        p.policies.insert(id, (first_old, new));
    }

    /// The ipcache entry of exactly `net` (a pod address or a CIDR prefix in use); records of
    /// pods removed by the current change are looked up in `removed`.
    fn ipcache_exact(&self, net: &IpNet, removed: &BTreeMap<PodKey, PodRec>) -> Option<Identity> {
        let host = net.prefix_len() == net.max_prefix_len();
        if host
            && let Some(k) = self.pod_addrs.get(&net.addr())
            && let Some(rec) = removed.get(k).or_else(|| self.pods.get(k))
            && let Some(pos) = rec.signed_ips.iter().position(|a| *a == net.addr())
            && let Some(id) = rec.ids.get(pos)
        {
            return Some(*id);
        }
        self.cidr_ids.get(net).copied()
    }

    /// Steps 2-5.
    fn sync(&mut self, p: Pending) -> EngineDelta {
        let mut delta = EngineDelta {
            services_changed: p.services,
            ..EngineDelta::default()
        };

        // ---- 2. universe ----
        let old_cidrs: BTreeSet<IpNet> = self.cidr_ids.keys().copied().collect();
        let new_cidrs: BTreeSet<IpNet> = self.cidr_use.keys().copied().collect();
        let added_cidrs: Vec<IpNet> = new_cidrs.difference(&old_cidrs).copied().collect();
        let removed_cidrs: Vec<IpNet> = old_cidrs.difference(&new_cidrs).copied().collect();
        let mut named_changed: BTreeSet<(String, Protocol)> = BTreeSet::new();
        for (old, new) in p.policies.values() {
            for pol in [old, new].into_iter().flatten() {
                for n in pol.named_ports(Direction::Egress) {
                    named_changed.insert(n);
                }
            }
        }
        // A name whose use count went from 0 or to 0 changes signatures; the others did not
        // change membership of the set. Since only membership matters, compare with the set as
        // it was: a name is "changed" when it is in use now xor it was in use before. Before =
        // now, minus the new versions' contribution, plus the old versions'.
        named_changed.retain(|n| {
            let now = self.named_use.get(n).copied().unwrap_or(0);
            let mut before = i64::from(now);
            for (old, new) in p.policies.values() {
                if old
                    .as_ref()
                    .is_some_and(|o| o.named_ports(Direction::Egress).contains(n))
                {
                    before += 1;
                }
                if new
                    .as_ref()
                    .is_some_and(|o| o.named_ports(Direction::Egress).contains(n))
                {
                    before -= 1;
                }
            }
            (now > 0) != (before > 0)
        });
        let changed_prefixes: Vec<IpNet> =
            added_cidrs.iter().chain(&removed_cidrs).copied().collect();
        let mut resign: BTreeSet<PodKey> = p.pods.clone();
        if !changed_prefixes.is_empty() || !named_changed.is_empty() {
            for (k, rec) in &self.pods {
                if !rec.addressed() {
                    continue;
                }
                let by_cidr = rec
                    .ips
                    .iter()
                    .any(|ip| changed_prefixes.iter().any(|c| c.contains(ip)));
                let by_name = rec
                    .ports
                    .iter()
                    .any(|(n, pr, _)| named_changed.iter().any(|(cn, cp)| cn == n && cp == pr));
                if by_cidr || by_name {
                    resign.insert(k.clone());
                }
            }
        }

        // ipcache "before" for every net that can change.
        let mut nets: BTreeSet<IpNet> = changed_prefixes.iter().copied().collect();
        for k in &resign {
            let old = p.removed_pods.get(k).or_else(|| self.pods.get(k));
            let new = self.pods.get(k);
            for rec in [old, new].into_iter().flatten() {
                for ip in rec.signed_ips.iter().chain(&rec.ips) {
                    nets.insert(IpNet::from(*ip));
                }
            }
        }
        let before: Vec<(IpNet, Option<Identity>)> = nets
            .iter()
            .map(|n| (*n, self.ipcache_exact(n, &p.removed_pods)))
            .collect();
        // ---- 3. identities ----
        let mut added_ids: BTreeSet<Identity> = BTreeSet::new();
        let mut removed_ids: BTreeMap<Identity, Signature> = BTreeMap::new();
        for c in &added_cidrs {
            let (id, new) = self.ids.acquire(Signature::Cidr(*c), &c.to_string());
            if new {
                added_ids.insert(id);
            }
            self.cidr_ids.insert(*c, id);
        }
        let mut new_ids: BTreeMap<PodKey, Vec<Identity>> = BTreeMap::new();
        for k in &resign {
            if !self.pods.contains_key(k) {
                continue;
            }
            let got = self.pod_identities(k);
            for (id, new) in &got {
                if *new {
                    added_ids.insert(*id);
                }
            }
            new_ids.insert(k.clone(), got.into_iter().map(|(id, _)| id).collect());
        }
        for k in &resign {
            let (old, member) = match p.removed_pods.get(k) {
                Some(r) => (r.ids.clone(), pod_key_text(k)),
                None => match self.pods.get(k) {
                    Some(r) => (r.ids.clone(), pod_key_text(k)),
                    None => continue,
                },
            };
            for id in old {
                if let Some(rec) = self.ids.release(id, &member) {
                    removed_ids.insert(id, rec.sig);
                }
            }
        }
        for c in &removed_cidrs {
            if let Some(id) = self.cidr_ids.remove(c)
                && let Some(rec) = self.ids.release(id, &c.to_string())
            {
                removed_ids.insert(id, rec.sig);
            }
        }
        // Records and address owners.
        let mut freed: Vec<IpAddr> = Vec::new();
        for k in &resign {
            let old = p.removed_pods.get(k).or_else(|| self.pods.get(k));
            let old_ips = old.map(|r| r.signed_ips.clone()).unwrap_or_default();
            for ip in old_ips {
                if self.pod_addrs.get(&ip) == Some(k) {
                    self.pod_addrs.remove(&ip);
                    freed.push(ip);
                }
            }
        }
        for k in &resign {
            let ids = new_ids.remove(k).unwrap_or_default();
            if let Some(rec) = self.pods.get_mut(k) {
                rec.ids = ids;
                rec.signed_ips = if rec.addressed() {
                    rec.ips.clone()
                } else {
                    Vec::new()
                };
                for ip in &rec.signed_ips {
                    self.pod_addrs.entry(*ip).or_insert_with(|| k.clone());
                }
            }
        }
        // A freed address that another (unchanged) pod also holds goes to the first such pod in
        // key order, as `Engine::build` would give it (e.g. a terminated pod's IP reused by a
        // live pod whose event came first).
        freed.retain(|ip| !self.pod_addrs.contains_key(ip));
        if !freed.is_empty() {
            for (k, rec) in &self.pods {
                for ip in &rec.signed_ips {
                    if freed.contains(ip) {
                        self.pod_addrs.entry(*ip).or_insert_with(|| k.clone());
                    }
                }
            }
        }
        let none = BTreeMap::new();
        for (net, old) in before {
            let new = self.ipcache_exact(&net, &none);
            if old != new {
                delta.ipcache.push(IpcacheChange {
                    prefix: net,
                    old,
                    new,
                });
            }
        }
        delta.identities_added = added_ids.iter().copied().collect();
        delta.identities_removed = removed_ids.keys().copied().collect();

        // ---- 4. selector cache ----
        for (id, (old, new)) in &p.policies {
            if let Some(new) = new {
                for spec in new.selector_specs() {
                    self.add_selector_user(spec, id.clone());
                }
            }
            if let Some(old) = old {
                let keep: HashSet<Arc<PeerSpec>> = new
                    .as_ref()
                    .map(|n| n.selector_specs().into_iter().collect())
                    .unwrap_or_default();
                for spec in old.selector_specs() {
                    if !keep.contains(&spec) {
                        self.remove_selector_user(&spec, id);
                    }
                }
            }
        }
        // Notifications: per selector id, the identities gained and lost; and the policies
        // that use a notified selector.
        let mut gained: HashMap<SelId, BTreeSet<Identity>> = HashMap::new();
        let mut lost: HashMap<SelId, BTreeSet<Identity>> = HashMap::new();
        let mut notified_policies: BTreeSet<PolicyRef> = BTreeSet::new();
        if !added_ids.is_empty() || !removed_ids.is_empty() {
            let added_sigs: Vec<(Identity, Signature)> = added_ids
                .iter()
                .filter_map(|id| self.ids.sig(*id).map(|s| (*id, s.clone())))
                .collect();
            for (spec, st) in self.selectors.iter_mut() {
                let mut changed = false;
                for (id, sig) in &added_sigs {
                    if selects(spec, sig) && st.ids.insert(*id) {
                        gained.entry(st.id).or_default().insert(*id);
                        changed = true;
                    }
                }
                for id in removed_ids.keys() {
                    if st.ids.remove(id) {
                        lost.entry(st.id).or_default().insert(*id);
                        changed = true;
                    }
                }
                if changed {
                    notified_policies.extend(st.users.iter().cloned());
                }
            }
        }

        // ---- 5. endpoints ----
        let mut cand: BTreeSet<PodKey> = resign.clone();
        for (id, (old, new)) in &p.policies {
            let _ = old;
            if let Some(keys) = self.policy_shared.get(id) {
                for key in keys {
                    if let Some(s) = self.shared.get(key) {
                        cand.extend(s.users.iter().cloned());
                    }
                }
            }
            if let Some(new) = new {
                for k in self.subject_candidates(new) {
                    cand.insert(k);
                }
            }
        }
        let mut removing: Vec<PodKey> = Vec::new();
        let mut adding: Vec<PodKey> = Vec::new();
        // (endpoint, direction, old key, new key)
        let mut moving: Vec<(PodKey, usize, Arc<ShareKey>, Arc<ShareKey>)> = Vec::new();
        for k in &cand {
            let should = self.is_local_endpoint(k);
            let was = self.ep_keys.contains_key(k);
            match (was, should) {
                (true, false) => removing.push(k.clone()),
                (false, true) => adding.push(k.clone()),
                (true, true) => {
                    let new_keys = self.share_keys(k);
                    let old_keys = self.ep_keys[k].clone();
                    for (d, new_key) in new_keys.into_iter().enumerate() {
                        if new_key != old_keys[d] {
                            moving.push((k.clone(), d, old_keys[d].clone(), new_key));
                        }
                    }
                }
                (false, false) => {}
            }
        }
        // A moving endpoint that is the only user of its old MapState, when its new key has no
        // MapState yet and few policies differ between the keys, takes the old MapState over
        // and updates it in place (below, like any affected state, with the differing policies
        // diffed in full); the ChangeSet of that update is exactly the endpoint's change.
        // Otherwise the new MapState is compiled (or joined, if another endpoint has it) and
        // the endpoint gets the diff between a snapshot of its old state, taken before any
        // update, and the new one. (Copying a MapState costs about as much as compiling it, so
        // a shared old state is never copied.)
        let arriving: HashSet<Arc<ShareKey>> =
            moving.iter().map(|(_, _, _, new)| new.clone()).collect();
        let mut derived: HashMap<Arc<ShareKey>, (PodKey, BTreeSet<PolicyRef>)> = HashMap::new();
        let mut snapshots: HashMap<Arc<ShareKey>, StateSnapshot> = HashMap::new();
        let changed: BTreeSet<PolicyRef> = p.policies.keys().cloned().collect();
        let leaving: HashSet<(PodKey, usize)> = moving
            .iter()
            .map(|(k, d, _, _)| (k.clone(), *d))
            .chain(
                removing
                    .iter()
                    .flat_map(|k| [(k.clone(), 0), (k.clone(), 1)]),
            )
            .collect();
        for (k, _, old, new) in &moving {
            if !self.shared.contains_key(new) && !derived.contains_key(new) {
                let sole = !arriving.contains(old)
                    && self
                        .shared
                        .get(old)
                        .is_some_and(|o| o.users.len() == 1 && o.users.contains(k));
                let full = self.key_diff(old, new, &changed);
                if sole
                    && full.len() <= MAX_DERIVE_DIFF
                    && let Some(mut s) = self.remove_shared(old)
                {
                    s.users.clear();
                    self.insert_shared(new.clone(), s);
                    derived.insert(new.clone(), (k.clone(), full));
                    continue;
                }
            }
            // A state that every user leaves (and nobody joins) is not updated below: the
            // endpoint's ChangeSet is diffed against it directly, without a copy.
            if !snapshots.contains_key(old)
                && let Some(s) = self.shared.get(old)
                && (arriving.contains(old)
                    || !s
                        .users
                        .iter()
                        .all(|u| leaving.contains(&(u.clone(), dir_index(old.dir)))))
            {
                snapshots.insert(
                    old.clone(),
                    (owned(s.policy.mapstate.iter()), s.policy.isolated),
                );
            }
        }

        // Shared states to update (each once; keys compared by address).
        let mut affected: Vec<Arc<ShareKey>> = Vec::new();
        let mut seen: HashSet<*const ShareKey> = HashSet::new();
        let updated = p
            .policies
            .iter()
            .filter(|(_, (old, new))| old.is_some() && new.is_some())
            .map(|(id, _)| id);
        for pol in updated.chain(notified_policies.iter()) {
            for key in self.policy_shared.get(pol).into_iter().flatten() {
                if !derived.contains_key(key) && seen.insert(Arc::as_ptr(key)) {
                    affected.push(key.clone());
                }
            }
        }
        let mut state_changes: Vec<(Arc<ShareKey>, ChangeSet, Option<bool>)> = Vec::new();
        for key in affected {
            let Some(s) = self.shared.get(&key) else {
                continue;
            };
            let d = dir_index(key.dir);
            if !arriving.contains(&key) && s.users.iter().all(|u| leaving.contains(&(u.clone(), d)))
            {
                continue;
            }
            let full: BTreeSet<PolicyRef> = key
                .policies
                .iter()
                .filter(|p| changed.contains(*p))
                .cloned()
                .collect();
            let (cs, iso) =
                self.update_state(&key, &full, &added_ids, &removed_ids, &gained, &lost);
            state_changes.push((key, cs, iso));
        }
        let mut derived_changes: HashMap<PodKey, Vec<(usize, ChangeSet, Option<bool>)>> =
            HashMap::new();
        for (key, (mover, full)) in &derived {
            let before = self.shared.get(key).map(|s| s.policy.isolated);
            let (cs, _) = self.update_state(key, full, &added_ids, &removed_ids, &gained, &lost);
            let after = self.shared.get(key).map(|s| s.policy.isolated);
            let iso = if before != after { after } else { None };
            derived_changes
                .entry(mover.clone())
                .or_default()
                .push((dir_index(key.dir), cs, iso));
        }
        for (key, cs, iso) in state_changes {
            if cs.is_empty() && iso.is_none() {
                continue;
            }
            let cs = Arc::new(cs);
            let d = dir_index(key.dir);
            let users: Vec<PodKey> = self.shared[&key]
                .users
                .iter()
                .filter(|u| !leaving.contains(&((*u).clone(), d)))
                .cloned()
                .collect();
            for u in users {
                delta.updates.push(EndpointUpdate {
                    endpoint: pod_key_text(&u),
                    direction: key.dir,
                    changes: Arc::clone(&cs),
                    isolated: iso,
                    rebuilt: false,
                });
            }
        }
        // Moves: take the new states first, then drop the old ones.
        for (k, _, _, new) in &moving {
            self.use_shared(new, k);
        }
        for (k, d, old, new) in &moving {
            if let Some(keys) = self.ep_keys.get_mut(k) {
                keys[*d] = new.clone();
            }
            let derived_cs = derived
                .get(new)
                .filter(|(mover, _)| mover == k)
                .and_then(|_| derived_changes.get_mut(k))
                .and_then(|v| {
                    let pos = v.iter().position(|(dd, _, _)| dd == d)?;
                    Some(v.remove(pos))
                });
            let (cs, iso) = match derived_cs {
                Some((_, cs, iso)) => (cs, iso),
                None => {
                    let Some(s) = self.shared.get(new) else {
                        self.unuse_shared(old, k);
                        continue;
                    };
                    let (cs, old_isolated) = match (snapshots.get(old), self.shared.get(old)) {
                        (Some((v, i)), _) => {
                            let v: Vec<(Key, &StateEntry)> =
                                v.iter().map(|(k, e)| (*k, e)).collect();
                            (diff_states(&v, &s.policy.mapstate.iter()), Some(*i))
                        }
                        (None, Some(o)) => (
                            diff_states(&o.policy.mapstate.iter(), &s.policy.mapstate.iter()),
                            Some(o.policy.isolated),
                        ),
                        (None, None) => (diff_states(&[], &s.policy.mapstate.iter()), None),
                    };
                    let iso =
                        (old_isolated != Some(s.policy.isolated)).then_some(s.policy.isolated);
                    (cs, iso)
                }
            };
            self.unuse_shared(old, k);
            delta.updates.push(EndpointUpdate {
                endpoint: pod_key_text(k),
                direction: DIRECTIONS[*d],
                changes: Arc::new(cs),
                isolated: iso,
                rebuilt: true,
            });
        }
        for k in &removing {
            if let Some(keys) = self.ep_keys.remove(k) {
                for key in &keys {
                    self.unuse_shared(key, k);
                }
            }
            self.endpoints
                .retain(|e| !(e.namespace == k.0 && e.name == k.1));
            delta.endpoints_removed.push(pod_key_text(k));
        }
        for k in &adding {
            let Some(rec) = self.pods.get(k) else {
                continue;
            };
            self.endpoints.push(Endpoint {
                namespace: k.0.clone(),
                name: k.1.clone(),
                ips: rec.ips.clone(),
                node: rec.node.clone(),
                identities: rec.ids.clone(),
            });
            let keys = self.share_keys(k);
            self.attach(k, keys.clone());
            for key in &keys {
                if let Some(s) = self.shared.get(key) {
                    delta.updates.push(EndpointUpdate {
                        endpoint: pod_key_text(k),
                        direction: key.dir,
                        changes: Arc::new(ChangeSet {
                            added: owned(s.policy.mapstate.iter()),
                            ..ChangeSet::default()
                        }),
                        isolated: Some(s.policy.isolated),
                        rebuilt: true,
                    });
                }
            }
            delta.endpoints_added.push(pod_key_text(k));
        }
        // Endpoint records of changed pods.
        for k in &resign {
            if let (Some(&i), Some(rec)) = (self.ep_index.get(k), self.pods.get(k))
                && let Some(ep) = self.endpoints.get_mut(i)
                && ep.namespace == k.0
                && ep.name == k.1
            {
                ep.ips = rec.ips.clone();
                ep.node = rec.node.clone();
                ep.identities = rec.ids.clone();
            }
        }
        if !adding.is_empty() || !removing.is_empty() {
            self.sort_endpoints();
        }
        delta
            .updates
            .sort_by(|a, b| (&a.endpoint, a.direction).cmp(&(&b.endpoint, b.direction)));
        delta.endpoints_added.sort();
        delta.endpoints_removed.sort();
        delta
    }

    /// The policies whose entries must be diffed in full when a state of key `old` becomes one
    /// of key `new`: those in only one of the keys, the changed ones, and (when the endpoint's
    /// own named ports differ) those with ingress named ports.
    fn key_diff(
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
                    .policies
                    .get(*p)
                    .is_some_and(|pol| !pol.named_ports(Direction::Ingress).is_empty());
            if changed.contains(*p) || named {
                out.insert((*p).clone());
            }
        }
        out
    }

    /// Local endpoints that a policy's subject may select (all pods of its namespace, or all).
    fn subject_candidates(&self, p: &Policy) -> Vec<PodKey> {
        match &p.id.namespace {
            Some(ns) => self
                .pods
                .range((ns.clone(), String::new())..)
                .take_while(|(k, _)| &k.0 == ns)
                .map(|(k, _)| k.clone())
                .collect(),
            None => self.pods.keys().cloned().collect(),
        }
    }

    /// Updates one shared state in place: the entries of changed policies are diffed against
    /// their new version; the other entries follow the identity notifications.
    fn update_state(
        &mut self,
        key: &Arc<ShareKey>,
        full: &BTreeSet<PolicyRef>,
        added_ids: &BTreeSet<Identity>,
        removed_ids: &BTreeMap<Identity, Signature>,
        gained: &HashMap<SelId, BTreeSet<Identity>>,
        lost: &HashMap<SelId, BTreeSet<Identity>>,
    ) -> (ChangeSet, Option<bool>) {
        let mut updates: Vec<Update> = Vec::new();
        let mut add_keys: Vec<(EntryId, EntryKey)> = Vec::new();
        let mut remove_keys: Vec<EntryId> = Vec::new();
        let mut new_indexes: Vec<(PolicyRef, Option<PolicyIndex>)> = Vec::new();
        // AddIdentity selections: id -> entries.
        let mut selections: BTreeMap<Identity, Vec<EntryId>> = BTreeMap::new();
        let mut removes: BTreeSet<Identity> = BTreeSet::new();
        let mut policy_changed = false;
        let Some(shared) = self.shared.get(key) else {
            return (ChangeSet::default(), None);
        };
        // The indexes of unchanged policies (cloned: the named groups need &mut self below).
        let mut named: Vec<NamedGroup> = Vec::new();
        for (pref, index) in &shared.notify {
            if full.contains(pref) {
                continue;
            }
            for (sel, id) in &index.plain {
                if let Some(g) = gained.get(sel) {
                    for i in g {
                        let v = selections.entry(*i).or_default();
                        if !v.contains(id) {
                            v.push(*id);
                        }
                    }
                }
                if let Some(l) = lost.get(sel) {
                    removes.extend(l.iter().copied());
                }
            }
            for g in &index.named {
                if gained.contains_key(&g.sel) || lost.contains_key(&g.sel) {
                    named.push(g.clone());
                }
            }
        }
        for g in &named {
            if let Some(l) = lost.get(&g.sel) {
                removes.extend(l.iter().copied());
            }
            self.named_notifications(
                key,
                g,
                gained.get(&g.sel),
                lost.get(&g.sel),
                removed_ids,
                &mut updates,
                &mut add_keys,
                &mut remove_keys,
                &mut selections,
            );
        }
        // Changed policies: full diff of their entries (no entries if the policy is gone or
        // not in the key).
        for pref in full {
            let policy = self
                .policies
                .get(pref)
                .filter(|_| key.policies.binary_search(pref).is_ok())
                .cloned();
            policy_changed = true;
            let mut desired = BTreeMap::new();
            match policy {
                Some(policy) => {
                    let mut index = PolicyIndex::default();
                    self.policy_entries(&policy, key, &mut desired, &mut index);
                    new_indexes.push((pref.clone(), Some(index)));
                }
                None => new_indexes.push((pref.clone(), None)),
            }
            let s = &self.shared[key];
            let current: Vec<EntryId> = s
                .entries
                .iter()
                .filter(|(_, ek)| same_policy(&ek.origin, pref))
                .map(|(id, _)| *id)
                .collect();
            for id in current {
                match desired.remove(&id) {
                    None => {
                        updates.push(Update::RemoveEntry(id));
                        remove_keys.push(id);
                    }
                    Some((_, want)) => {
                        let have = s.policy.mapstate.policy_entry(id);
                        match (have.map(|e| &e.selector), &want.selector) {
                            (Some(Selector::Ids(h)), Selector::Ids(w)) => {
                                let add: Vec<Identity> = w.difference(h).copied().collect();
                                let del: Vec<Identity> = h.difference(w).copied().collect();
                                if !add.is_empty() {
                                    updates.push(Update::Select {
                                        entry: id,
                                        ids: add,
                                    });
                                }
                                if !del.is_empty() {
                                    updates.push(Update::Deselect {
                                        entry: id,
                                        ids: del,
                                    });
                                }
                            }
                            (Some(Selector::Any), Selector::Any) => {}
                            _ => {
                                updates.push(Update::RemoveEntry(id));
                                updates.push(Update::AddEntry(want));
                            }
                        }
                    }
                }
            }
            for (id, (ek, e)) in desired {
                updates.push(Update::AddEntry(e));
                add_keys.push((id, ek));
            }
        }
        for (id, selected_by) in selections {
            if added_ids.contains(&id) {
                updates.push(Update::AddIdentity { id, selected_by });
            } else {
                for entry in selected_by {
                    updates.push(Update::Select {
                        entry,
                        ids: vec![id],
                    });
                }
            }
        }
        // Removals go first so that emptied named entries can be removed after them.
        let mut batch: Vec<Update> = removes.into_iter().map(Update::RemoveIdentity).collect();
        batch.extend(updates);
        let isolation = policy_changed.then(|| self.isolation(key));
        let s = self.shared.get_mut(key).expect("affected state exists");
        let cs = match s.policy.mapstate.apply(batch) {
            Ok(cs) => cs,
            Err(e) => {
                // Cannot happen (entry ids are tracked exactly); fall back to a rebuild.
                debug_assert!(false, "incremental MapState update rejected: {e}");
                let users = s.users.clone();
                let mut fresh = self.compile(key);
                fresh.users = users;
                let cs = diff_states(
                    &self.shared[key].policy.mapstate.iter(),
                    &fresh.policy.mapstate.iter(),
                );
                self.shared.insert(key.clone(), fresh);
                let s = &self.shared[key];
                return (cs, Some(s.policy.isolated));
            }
        };
        for id in remove_keys {
            s.entries.remove(&id);
        }
        for (id, ek) in add_keys {
            s.entries.insert(id, ek);
        }
        for (pref, index) in new_indexes {
            match index {
                Some(index) => s.notify.insert(pref, index),
                None => s.notify.remove(&pref),
            };
        }
        let mut iso = None;
        if let Some((isolated, isolated_by)) = isolation {
            if s.policy.isolated != isolated {
                iso = Some(isolated);
            }
            s.policy.isolated = isolated;
            s.policy.isolated_by = isolated_by;
            s.policy.mapstate.set_default(if isolated {
                Verdict::Deny
            } else {
                Verdict::Allow
            });
        }
        (cs, iso)
    }

    /// Updates for one egress named-port group (rule, peer, name) after identity
    /// notifications: new identities join the entry of their port number (created if it does
    /// not exist); entries whose last identity went are removed.
    #[allow(clippy::too_many_arguments)]
    fn named_notifications(
        &mut self,
        key: &Arc<ShareKey>,
        group: &NamedGroup,
        gained: Option<&BTreeSet<Identity>>,
        lost: Option<&BTreeSet<Identity>>,
        removed_ids: &BTreeMap<Identity, Signature>,
        updates: &mut Vec<Update>,
        add_keys: &mut Vec<(EntryId, EntryKey)>,
        remove_keys: &mut Vec<EntryId>,
        selections: &mut BTreeMap<Identity, Vec<EntryId>>,
    ) {
        let NamedGroup {
            origin,
            order,
            verdict,
            spec,
            name,
            proto,
            ..
        } = group;
        let (order, verdict, proto, name) = (*order, *verdict, *proto, name.as_str());
        let ek = |n: u16| EntryKey {
            origin: origin.clone(),
            peer: Some(spec.clone()),
            l4: L4Match::port(proto, n),
            named: Some(name.to_string()),
        };
        // Losses per number.
        let mut lost_by: BTreeMap<u16, BTreeSet<Identity>> = BTreeMap::new();
        for id in lost.into_iter().flatten() {
            if let Some(Signature::Pod(sig)) = removed_ids.get(id) {
                for n in sig.resolve(name, proto) {
                    lost_by.entry(*n).or_default().insert(*id);
                }
            }
        }
        let gained_by = self.group_by_port(gained.into_iter().flatten().copied(), name, proto);
        let numbers: BTreeSet<u16> = lost_by.keys().chain(gained_by.keys()).copied().collect();
        for n in numbers {
            let k = ek(n);
            let existing = self
                .entry_ids
                .get(&k)
                .copied()
                .filter(|id| self.shared[key].policy.mapstate.policy_entry(*id).is_some());
            let g = gained_by.get(&n);
            let l = lost_by.get(&n);
            match existing {
                Some(id) => {
                    // The entry's identities are borrowed, not copied: it selects up to every
                    // pod identity, and this runs for each group of every notified state.
                    let empty = BTreeSet::new();
                    let have: &BTreeSet<Identity> = match self.shared[key]
                        .policy
                        .mapstate
                        .policy_entry(id)
                        .map(|e| &e.selector)
                    {
                        Some(Selector::Ids(s)) => s,
                        _ => &empty,
                    };
                    // Empty after the update iff nothing is gained and every identity is lost.
                    let emptied = g.is_none_or(|g| g.is_empty())
                        && have.iter().all(|i| l.is_some_and(|l| l.contains(i)));
                    if emptied {
                        // Removed after the RemoveIdentity updates of the batch.
                        updates.push(Update::RemoveEntry(id));
                        remove_keys.push(id);
                    } else {
                        for i in g.into_iter().flatten() {
                            if !have.contains(i) {
                                let v = selections.entry(*i).or_default();
                                if !v.contains(&id) {
                                    v.push(id);
                                }
                            }
                        }
                    }
                }
                None => {
                    let Some(g) = g.filter(|g| !g.is_empty()) else {
                        continue;
                    };
                    let id = self.entry_id(&k);
                    updates.push(Update::AddEntry(PolicyEntry {
                        id,
                        order,
                        verdict,
                        selector: Selector::Ids(g.clone()),
                        l4: k.l4,
                        origin: origin.clone(),
                    }));
                    add_keys.push((id, k));
                }
            }
        }
    }
}
