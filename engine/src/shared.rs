//! Shared MapStates: endpoints whose MapState inputs are equal (the same selecting policies,
//! and for ingress the same resolution of the named ports those policies use) share one
//! computation, keyed by a [`ShareKey`]. This module holds the keys, the states with their
//! users and their per-policy notification index, and how a state is compiled from scratch
//! (the policies' rules as ordered `PolicyEntry`s).

use std::collections::{BTreeMap, BTreeSet};

use crate::fast::{HashMap, HashSet};
use std::sync::Arc;

use ordnet_mapstate::{
    Action, Direction, EntryId, Identity, L4Match, MapState, OrderKey, Origin, PolicyEntry,
    Protocol, Selector, Verdict,
};

use crate::build::{EndpointPolicy, Engine};
use crate::identity::{NamedPort, Signature, resolve_named};
use crate::model::{PeerSpec, Policy, PolicyRef, PortSpec};
use crate::parallel::{Done, Job};
use crate::selector_cache::SelId;
use crate::store::PodKey;

/// The inputs that determine an endpoint's MapState in one direction; endpoints with equal keys
/// share one computation.
///
/// Its hash is computed once, at construction ([`ShareKey::new`]; the fields are never changed
/// afterwards): every change looks states up by key, and hashing the policy names (a key lists
/// up to dozens) each time was ~9 % of a relabel at 10k pods / 5k policies.
#[derive(Debug, Clone, Eq, PartialOrd, Ord)]
pub(crate) struct ShareKey {
    pub dir: Direction,
    /// The policies that select the endpoint, sorted.
    pub policies: Vec<PolicyRef>,
    /// Ingress only: what each named port used by these policies' ingress rules resolves to on
    /// the endpoint.
    pub own_ports: Vec<((String, Protocol), Vec<u16>)>,
    /// The hash of the fields above (equal keys have equal hashes, so the derived comparisons
    /// stay consistent).
    hash: u64,
}

impl ShareKey {
    pub(crate) fn new(
        dir: Direction,
        policies: Vec<PolicyRef>,
        own_ports: Vec<((String, Protocol), Vec<u16>)>,
    ) -> ShareKey {
        // One random hasher state per process: equal keys built at different times must hash
        // alike (SipHash: once per key, not per lookup).
        static STATE: std::sync::OnceLock<std::collections::hash_map::RandomState> =
            std::sync::OnceLock::new();
        let hash = std::hash::BuildHasher::hash_one(
            STATE.get_or_init(std::collections::hash_map::RandomState::new),
            (dir, &policies, &own_ports),
        );
        ShareKey {
            dir,
            policies,
            own_ports,
            hash,
        }
    }
}

/// Field by field, as derived, after two short cuts: a key is mostly looked up with the very
/// `Arc` the table holds (the states of a notified policy, every change), and keys of different
/// hashes differ (comparing the policy names of an equal key was ~4 % of a local relabel at 10k
/// pods / 5k policies).
impl PartialEq for ShareKey {
    fn eq(&self, other: &ShareKey) -> bool {
        std::ptr::eq(self, other)
            || (self.hash == other.hash
                && self.dir == other.dir
                && self.policies == other.policies
                && self.own_ports == other.own_ports)
    }
}

impl std::hash::Hash for ShareKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        state.write_u64(self.hash);
    }
}

/// The selector part of an entry key.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct EntryKey {
    pub origin: Arc<Origin>,
    /// `None` = every identity.
    pub peer: Option<Arc<PeerSpec>>,
    pub l4: L4Match,
    /// For an egress named port: the name (the selector is the identities of `peer` whose
    /// resolution of the name is the port of `l4`).
    pub named: Option<String>,
}

/// An egress named-port group of one rule: the entries `(origin, spec, name, n)` for every
/// number `n` the selected pods resolve the name to.
#[derive(Debug, Clone)]
pub(crate) struct NamedGroup {
    pub origin: Arc<Origin>,
    pub order: OrderKey,
    pub action: Action,
    pub sel: SelId,
    pub spec: Arc<PeerSpec>,
    pub name: String,
    pub proto: Protocol,
}

/// What identity notifications touch in one policy's entries of one shared state.
#[derive(Debug, Clone, Default)]
pub(crate) struct PolicyIndex {
    /// Entries whose selector is exactly one cached selector.
    pub plain: Vec<(SelId, EntryId)>,
    pub named: Vec<NamedGroup>,
}

/// One shared MapState computation.
#[derive(Debug, Clone)]
pub(crate) struct Shared {
    pub policy: EndpointPolicy,
    /// The endpoints that use it.
    pub users: BTreeSet<PodKey>,
    pub entries: HashMap<EntryId, EntryKey>,
    /// Per policy of the key: the entries that follow selector notifications.
    pub notify: BTreeMap<PolicyRef, PolicyIndex>,
}

/// A shared state's MapState from its entries ([`Engine::compile_parts`]). Entry ids are unique
/// by construction, so the build cannot fail; if it did, the state would be empty.
pub(crate) fn build_state(dir: Direction, default: Verdict, entries: Vec<PolicyEntry>) -> MapState {
    MapState::build(dir, default, entries).unwrap_or_else(|_| MapState::new(dir, default))
}

/// Frees a MapState that is no longer used on a background thread. A MapState of a few thousand
/// keys is thousands of small allocations (per-identity tries, entry lists): freeing them took
/// about as long as compiling it, on the critical path of [`Engine::apply`]. Falls back to
/// freeing in place if the thread cannot be started.
fn drop_later(s: Shared) {
    use std::sync::OnceLock;
    use std::sync::mpsc::{Sender, channel};
    static DROPPER: OnceLock<Option<Sender<Shared>>> = OnceLock::new();
    let tx = DROPPER.get_or_init(|| {
        let (tx, rx) = channel::<Shared>();
        std::thread::Builder::new()
            .name("ordnet-free".into())
            .spawn(move || rx.into_iter().for_each(drop))
            .ok()
            .map(|_| tx)
    });
    if let Some(tx) = tx {
        // On a send error the value comes back and is dropped here.
        let _ = tx.send(s);
    }
}

/// Every shared MapState, indexed by the policies in its key; and the entry ids (one per
/// distinct entry key, never reused, so a MapState update can name entries across states).
#[derive(Debug, Clone, Default)]
pub(crate) struct SharedStates {
    states: HashMap<Arc<ShareKey>, Shared>,
    /// Policy -> the states whose key includes it.
    by_policy: HashMap<PolicyRef, HashSet<Arc<ShareKey>>>,
    entry_ids: HashMap<EntryKey, EntryId>,
    last_entry: u64,
}

impl SharedStates {
    pub(crate) fn get(&self, key: &ShareKey) -> Option<&Shared> {
        self.states.get(key)
    }

    pub(crate) fn get_mut(&mut self, key: &ShareKey) -> Option<&mut Shared> {
        self.states.get_mut(key)
    }

    pub(crate) fn contains_key(&self, key: &ShareKey) -> bool {
        self.states.contains_key(key)
    }

    /// Frees part `i` of every MapState ([`MapState::release`]; memory accounting, see
    /// `Engine::dismantle`).
    pub(crate) fn release_mapstates(&mut self, i: usize) {
        for s in self.states.values_mut() {
            s.policy.mapstate.release(i);
        }
    }

    /// Number of states.
    pub(crate) fn len(&self) -> usize {
        self.states.len()
    }

    /// The keys of the states that include policy `id`.
    pub(crate) fn of_policy(&self, id: &PolicyRef) -> impl Iterator<Item = &Arc<ShareKey>> {
        self.by_policy.get(id).into_iter().flatten()
    }

    /// The id of an entry key, if it has one.
    pub(crate) fn existing_entry_id(&self, key: &EntryKey) -> Option<EntryId> {
        self.entry_ids.get(key).copied()
    }

    /// Stores a shared computation and indexes it by policy.
    pub(crate) fn insert(&mut self, key: Arc<ShareKey>, s: Shared) {
        for p in &key.policies {
            self.by_policy
                .entry(p.clone())
                .or_default()
                .insert(key.clone());
        }
        self.states.insert(key, s);
    }

    /// Removes a shared computation (whatever its users) and its index entries.
    pub(crate) fn remove(&mut self, key: &Arc<ShareKey>) -> Option<Shared> {
        let s = self.states.remove(key)?;
        for p in &key.policies {
            if let Some(set) = self.by_policy.get_mut(p) {
                set.remove(key);
                if set.is_empty() {
                    self.by_policy.remove(p);
                }
            }
        }
        Some(s)
    }

    pub(crate) fn entry_id(&mut self, key: &EntryKey) -> EntryId {
        if let Some(id) = self.entry_ids.get(key) {
            return *id;
        }
        self.last_entry += 1;
        let id = EntryId(self.last_entry);
        self.entry_ids.insert(key.clone(), id);
        id
    }
}

impl std::ops::Index<&Arc<ShareKey>> for SharedStates {
    type Output = Shared;
    fn index(&self, key: &Arc<ShareKey>) -> &Shared {
        &self.states[key]
    }
}

impl Engine {
    /// The share keys of endpoint `k` for both directions.
    pub(crate) fn share_keys(&self, k: &PodKey) -> [Arc<ShareKey>; 2] {
        let policies = self.store.selecting_policies(k);
        let ports: &[NamedPort] = self.store.pods.get(k).map_or(&[], |r| r.ports.as_slice());
        let mut names: Vec<(String, Protocol)> = policies
            .iter()
            .filter_map(|id| self.store.policies.get(id))
            .flat_map(|p| p.named_ports(Direction::Ingress))
            .collect();
        names.sort();
        names.dedup();
        let own_ports = names
            .into_iter()
            .map(|(n, p)| {
                let r = resolve_named(ports, &n, p);
                ((n, p), r)
            })
            .collect();
        [
            Arc::new(ShareKey::new(
                Direction::Ingress,
                policies.clone(),
                own_ports,
            )),
            Arc::new(ShareKey::new(Direction::Egress, policies, Vec::new())),
        ]
    }

    /// Groups the pod identities of `ids` by what `(name, proto)` resolves to on them.
    pub(crate) fn group_by_port(
        &self,
        ids: impl IntoIterator<Item = Identity>,
        name: &str,
        proto: Protocol,
    ) -> BTreeMap<u16, BTreeSet<Identity>> {
        let mut out: BTreeMap<u16, BTreeSet<Identity>> = BTreeMap::new();
        for id in ids {
            if let Some(Signature::Pod(p)) = self.ids.sig(id) {
                for n in p.resolve(name, proto) {
                    out.entry(*n).or_default().insert(id);
                }
            }
        }
        out
    }

    /// The policy entries of the rules of `policy` for a share key (with their keys).
    pub(crate) fn policy_entries(
        &mut self,
        policy: &Policy,
        key: &ShareKey,
        out: &mut BTreeMap<EntryId, (EntryKey, PolicyEntry)>,
        index: &mut PolicyIndex,
    ) {
        let di = key.dir.index();
        for rule in &policy.rules[di] {
            let peers: Vec<Option<Arc<PeerSpec>>> = match &rule.peers {
                None => vec![None],
                Some(v) => v.iter().cloned().map(Some).collect(),
            };
            let ports: Vec<Option<&PortSpec>> = match &rule.ports {
                None => vec![None],
                Some(v) => v.iter().map(Some).collect(),
            };
            for peer in &peers {
                for port in &ports {
                    let plain = |l4: L4Match| EntryKey {
                        origin: rule.origin.clone(),
                        peer: peer.clone(),
                        l4,
                        named: None,
                    };
                    let mut made: Vec<(EntryKey, Selector)> = Vec::new();
                    let sel = |e: &Engine| match peer {
                        None => Selector::Any,
                        Some(p) => Selector::Ids(e.selectors.selected(p)),
                    };
                    match port {
                        None => made.push((plain(L4Match::Any), sel(self))),
                        Some(PortSpec::Proto(p)) => {
                            made.push((plain(L4Match::Proto(*p)), sel(self)))
                        }
                        Some(PortSpec::Range { proto, first, last }) => made.push((
                            plain(L4Match::Ports {
                                proto: *proto,
                                first: *first,
                                last: *last,
                            }),
                            sel(self),
                        )),
                        Some(PortSpec::Named { proto, name }) => match key.dir {
                            Direction::Ingress => {
                                let nums = key
                                    .own_ports
                                    .iter()
                                    .find(|((n, p), _)| n == name && p == proto)
                                    .map(|(_, v)| v.clone())
                                    .unwrap_or_default();
                                for n in nums {
                                    made.push((plain(L4Match::port(*proto, n)), sel(self)));
                                }
                            }
                            Direction::Egress => {
                                let spec = peer
                                    .clone()
                                    .unwrap_or_else(|| Arc::new(PeerSpec::all_pods()));
                                let (sel, ids) = self
                                    .selectors
                                    .get(&spec)
                                    .map(|s| (s.id, s.ids.iter().collect::<Vec<_>>()))
                                    .unwrap_or_default();
                                index.named.push(NamedGroup {
                                    origin: rule.origin.clone(),
                                    order: rule.order,
                                    action: rule.action,
                                    sel,
                                    spec: spec.clone(),
                                    name: name.clone(),
                                    proto: *proto,
                                });
                                for (n, group) in self.group_by_port(ids, name, *proto) {
                                    made.push((
                                        EntryKey {
                                            origin: rule.origin.clone(),
                                            peer: Some(spec.clone()),
                                            l4: L4Match::port(*proto, n),
                                            named: Some(name.clone()),
                                        },
                                        Selector::Ids(group.into_iter().collect()),
                                    ));
                                }
                            }
                        },
                    }
                    for (ek, selector) in made {
                        let id = self.shared.entry_id(&ek);
                        if out.contains_key(&id) {
                            continue;
                        }
                        if ek.named.is_none()
                            && let Some(p) = &ek.peer
                            && let Some(st) = self.selectors.get(p)
                        {
                            index.plain.push((st.id, id));
                        }
                        let entry = PolicyEntry {
                            id,
                            order: rule.order,
                            action: rule.action,
                            selector,
                            l4: ek.l4,
                            origin: rule.origin.clone(),
                        };
                        out.insert(id, (ek, entry));
                    }
                }
            }
        }
    }

    /// Isolation of a share key: whether isolated, and by which policies.
    pub(crate) fn isolation(&self, key: &ShareKey) -> (bool, Vec<Arc<Origin>>) {
        let di = key.dir.index();
        let by: Vec<Arc<Origin>> = key
            .policies
            .iter()
            .filter_map(|id| self.store.policies.get(id))
            .filter(|p| p.isolates[di])
            .map(|p| p.isolation_origin[di].clone())
            .collect();
        (!by.is_empty(), by)
    }

    /// Computes a shared MapState from scratch.
    pub(crate) fn compile(&mut self, key: &ShareKey) -> Shared {
        let (mut s, entries) = self.compile_parts(key);
        s.policy.mapstate = build_state(key.dir, s.policy.mapstate.default_verdict(), entries);
        s
    }

    /// [`Engine::compile_parts`] as a [`Job::Build`] of the state's MapState, with the rest of
    /// the state (stored by [`Engine::store_built`] once the job ran).
    pub(crate) fn build_job(&mut self, key: &ShareKey) -> (Shared, Job) {
        let (s, entries) = self.compile_parts(key);
        let job = Job::Build {
            dir: key.dir,
            default: s.policy.mapstate.default_verdict(),
            entries,
        };
        (s, job)
    }

    /// Stores the states of [`Engine::build_job`]s, each with its job's result (`done`: the
    /// results of those jobs, in the same order).
    pub(crate) fn store_built(
        &mut self,
        mut done: impl Iterator<Item = Done>,
        states: Vec<(Arc<ShareKey>, Shared)>,
    ) {
        for (key, mut s) in states {
            let Some(Done::Built(state)) = done.next() else {
                unreachable!("one build result per state, in order")
            };
            s.policy.mapstate = *state;
            self.shared.insert(key, s);
        }
    }

    /// A shared MapState's entries, with everything else about it (its MapState empty, with the
    /// isolation default): what [`Engine::compile`] builds, or a [`crate::parallel::Job`].
    pub(crate) fn compile_parts(&mut self, key: &ShareKey) -> (Shared, Vec<PolicyEntry>) {
        let mut entries = BTreeMap::new();
        let mut notify = BTreeMap::new();
        for id in &key.policies {
            if let Some(p) = self.store.policies.get(id).cloned() {
                let mut index = PolicyIndex::default();
                self.policy_entries(&p, key, &mut entries, &mut index);
                notify.insert(id.clone(), index);
            }
        }
        let (isolated, isolated_by) = self.isolation(key);
        let default = if isolated {
            Verdict::Deny
        } else {
            Verdict::Allow
        };
        let mut keys = HashMap::with_capacity_and_hasher(entries.len(), Default::default());
        let mut list = Vec::with_capacity(entries.len());
        for (id, (ek, e)) in entries {
            keys.insert(id, ek);
            list.push(e);
        }
        let shared = Shared {
            policy: EndpointPolicy {
                mapstate: MapState::new(key.dir, default),
                isolated,
                isolated_by,
            },
            users: BTreeSet::new(),
            entries: keys,
            notify,
        };
        (shared, list)
    }

    /// Attaches endpoint `k` to the shared MapStates of its keys (compiling them if new).
    pub(crate) fn attach(&mut self, k: &PodKey, keys: [Arc<ShareKey>; 2]) {
        for key in &keys {
            self.use_shared(key, k);
        }
        self.ep_keys.insert(k.clone(), keys);
    }

    /// Takes a use of a shared computation, compiling it when new. Returns whether it was new.
    pub(crate) fn use_shared(&mut self, key: &Arc<ShareKey>, user: &PodKey) -> bool {
        if let Some(s) = self.shared.get_mut(key) {
            s.users.insert(user.clone());
            return false;
        }
        let mut s = self.compile(key);
        s.users.insert(user.clone());
        self.shared.insert(key.clone(), s);
        true
    }

    /// Drops a use of a shared computation; it goes when unused.
    pub(crate) fn unuse_shared(&mut self, key: &Arc<ShareKey>, user: &PodKey) {
        let Some(s) = self.shared.get_mut(key) else {
            return;
        };
        s.users.remove(user);
        if !s.users.is_empty() {
            return;
        }
        if let Some(s) = self.shared.remove(key) {
            drop_later(s);
        }
    }
}
