//! Steps 2-5 of an incremental update ([`Engine::apply`], `docs/engine.md`): after the object
//! store took a change (step 1, `incremental.rs`), [`Engine::sync`] brings identities, the
//! selector cache and the shared MapStates in line with it, one function per step, and
//! collects what changed into an [`EngineDelta`].

use std::collections::{BTreeMap, BTreeSet};

use crate::fast::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;
use ordnet_mapstate::{ChangeSet, Direction, Identity, MapState, Protocol};

use crate::build::Engine;
use crate::identity::{PodSig, Signature};
use crate::incremental::{
    EndpointUpdate, EngineDelta, IpcacheChange, MAX_DERIVE_DIFF, Pending, StateSnapshot,
    diff_states, owned,
};
use crate::model::{PeerSpec, PolicyRef};
use crate::parallel::{Done, Job};
use crate::selector_cache::Notifications;
use crate::shared::{ShareKey, Shared};
use crate::store::{PodKey, pod_key_text};
use crate::update::PreparedUpdate;

/// Step 2: what the policies' CIDRs and named ports change, and which pods get new signatures.
struct Universe {
    added_cidrs: Vec<IpNet>,
    removed_cidrs: Vec<IpNet>,
    /// Pods whose signatures may change (changed pods, and pods in a changed prefix or serving
    /// a changed named port).
    resign: BTreeSet<PodKey>,
    /// The ipcache entry of every net that can change, before the change.
    before: Vec<(IpNet, Option<Identity>)>,
}

/// Step 3: identities that appeared, disappeared, or kept their number under new labels.
pub(crate) struct IdentityChanges {
    pub added: BTreeSet<Identity>,
    pub removed: BTreeMap<Identity, Signature>,
    /// Relabelled in place ([`Identities::relabel`](crate::identity::Identities::relabel)):
    /// the signature each had before.
    pub relabelled: BTreeMap<Identity, Signature>,
}

/// An endpoint moving to another share key in one direction: (endpoint, direction index, old
/// key, new key).
type Move = (PodKey, usize, Arc<ShareKey>, Arc<ShareKey>);

/// Step 5's plan: endpoints that go, come, or move to another shared MapState.
struct EndpointPlan {
    removing: Vec<PodKey>,
    adding: Vec<PodKey>,
    moving: Vec<Move>,
}

/// How the moves are made (see [`Engine::prepare_moves`]).
struct MovePrep {
    /// Keys some endpoint moves to.
    arriving: HashSet<Arc<ShareKey>>,
    /// New keys whose MapState is its sole user's old one, taken over: the mover and the
    /// policies to diff in full.
    derived: HashMap<Arc<ShareKey>, (PodKey, BTreeSet<PolicyRef>)>,
    /// Copies of old states that are updated below while an endpoint still leaves them.
    snapshots: HashMap<Arc<ShareKey>, StateSnapshot>,
    /// The changed policies.
    changed: BTreeSet<PolicyRef>,
    /// (endpoint, direction index) leaving their current state.
    leaving: HashSet<(PodKey, usize)>,
    /// The new keys of moving endpoints that have no MapState yet (each once, in the order of
    /// the moves): compiled with the updates of step 5c.
    compile: Vec<Arc<ShareKey>>,
}

/// Per endpoint: the ChangeSets of the states it took over, by direction index.
type DerivedChanges = HashMap<PodKey, Vec<(usize, ChangeSet, Option<bool>)>>;

/// A state's update ready to run: the state, its batch and what follows it, and the endpoint
/// that took the state over (`None`: a state updated for its users).
type Prepared<'a> = (Arc<ShareKey>, PreparedUpdate, Option<&'a PodKey>);

/// Per affected state: its ChangeSet and its isolation if that changed.
type StateChanges = Vec<(Arc<ShareKey>, ChangeSet, Option<bool>)>;

impl Engine {
    /// Steps 2-5.
    pub(crate) fn sync(&mut self, p: Pending) -> EngineDelta {
        let mut delta = EngineDelta {
            services_changed: p.services,
            ..EngineDelta::default()
        };
        // 2. The universe.
        let universe = self.universe(&p);
        // 3. Identities: acquire before release; address owners; the ipcache changes.
        let (ids, new_ids) = self.acquire_and_release(&p, &universe);
        self.assign_addresses(&p, &universe.resign, new_ids);
        self.ipcache_changes(&universe.before, &mut delta);
        delta.identities_added = ids.added.iter().copied().collect();
        delta.identities_removed = ids.removed.keys().copied().collect();
        delta.identities_relabelled = ids.relabelled.keys().copied().collect();
        // 4. Selector cache: the changed policies' selectors, then the notifications.
        self.update_selector_users(&p);
        let added_sigs: Vec<(Identity, Signature)> = ids
            .added
            .iter()
            .filter_map(|id| self.ids.sig(*id).map(|s| (*id, s.clone())))
            .collect();
        let relabelled: Vec<(Identity, Signature)> = ids
            .relabelled
            .keys()
            .filter_map(|id| self.ids.sig(*id).map(|s| (*id, s.clone())))
            .collect();
        let notes = self
            .selectors
            .notify(&added_sigs, &ids.removed, &relabelled);
        // 5. Endpoints and their shared MapStates.
        let plan = self.plan_endpoints(&p, &universe.resign);
        let prep = self.prepare_moves(&p, &plan);
        let derived = self.update_shared_states(&p, &prep, &ids, &notes, &mut delta);
        self.apply_moves(&plan, &prep, derived, &mut delta);
        self.remove_endpoints(&plan.removing, &mut delta);
        self.add_endpoints(&plan.adding, &mut delta);
        self.refresh_endpoint_records(&universe.resign);
        if !plan.adding.is_empty() || !plan.removing.is_empty() {
            self.sort_endpoints();
        }
        delta
            .updates
            .sort_by(|a, b| (&a.endpoint, a.direction).cmp(&(&b.endpoint, b.direction)));
        delta.endpoints_added.sort();
        delta.endpoints_removed.sort();
        delta
    }

    /// Step 2: CIDR prefixes and egress named ports in use; when they change, the pods whose
    /// addresses lie in a changed prefix or that serve a changed named port are re-signed too.
    /// Records the ipcache entries that can change, as they are before.
    fn universe(&self, p: &Pending) -> Universe {
        let old_cidrs: BTreeSet<IpNet> = self.cidr_ids.keys().copied().collect();
        let new_cidrs: BTreeSet<IpNet> = self.store.cidr_use.keys().copied().collect();
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
            let now = self.store.named_use.get(n).copied().unwrap_or(0);
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
            for (k, rec) in &self.store.pods {
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
            let old = p.removed_pods.get(k).or_else(|| self.store.pods.get(k));
            let new = self.store.pods.get(k);
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
        Universe {
            added_cidrs,
            removed_cidrs,
            resign,
            before,
        }
    }

    /// Step 3a: the new signatures of every re-signed pod are acquired before the old ones are
    /// released (an identity that stays in use never flaps), after the identities all of whose
    /// addresses move to one new signature took it over ([`Engine::relabel_in_place`]); CIDR
    /// identities for added and removed prefixes. Returns the changes and each re-signed pod's
    /// new identities.
    fn acquire_and_release(
        &mut self,
        p: &Pending,
        u: &Universe,
    ) -> (IdentityChanges, BTreeMap<PodKey, Vec<Identity>>) {
        let (added_cidrs, removed_cidrs, resign) = (&u.added_cidrs, &u.removed_cidrs, &u.resign);
        let mut added_ids: BTreeSet<Identity> = BTreeSet::new();
        let mut removed_ids: BTreeMap<Identity, Signature> = BTreeMap::new();
        for c in added_cidrs {
            let (id, new) = self.ids.acquire(Signature::Cidr(*c), &c.to_string());
            if new {
                added_ids.insert(id);
            }
            self.cidr_ids.insert(*c, id);
        }
        let sigs: BTreeMap<&PodKey, Vec<Signature>> = resign
            .iter()
            .filter(|k| self.store.pods.contains_key(*k))
            .map(|k| (k, self.pod_signatures(k)))
            .collect();
        let relabelled = self.relabel_in_place(&sigs);
        let mut new_ids: BTreeMap<PodKey, Vec<Identity>> = BTreeMap::new();
        for (k, sigs) in sigs {
            let got = self.acquire_signatures(k, sigs);
            added_ids.extend(got.iter().filter(|(_, new)| *new).map(|(id, _)| *id));
            new_ids.insert(k.clone(), got.into_iter().map(|(id, _)| id).collect());
        }
        for k in resign {
            let (old, member) = match p.removed_pods.get(k) {
                Some(r) => (r.ids.clone(), pod_key_text(k)),
                None => match self.store.pods.get(k) {
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
        for c in removed_cidrs {
            if let Some(id) = self.cidr_ids.remove(c)
                && let Some(rec) = self.ids.release(id, &c.to_string())
            {
                removed_ids.insert(id, rec.sig);
            }
        }
        (
            IdentityChanges {
                added: added_ids,
                removed: removed_ids,
                relabelled,
            },
            new_ids,
        )
    }

    /// Step 3a, first: an identity **every** address of which is re-signed to one and the same
    /// signature that no identity has yet, differing only in labels (a namespace relabel moves
    /// each of its pod identities so; a pod relabel its identity when it is the pod's alone),
    /// keeps its number under that signature (`sigs`: each re-signed pod's new signatures, in
    /// the order of its addresses). Then no address changes identity: instead of a new
    /// identity's keys written in every rule set that selects it and the old one's removed,
    /// only the selectors that tell the old labels from the new gain or lose it. Returns the
    /// relabelled identities with their old signatures.
    fn relabel_in_place(
        &mut self,
        sigs: &BTreeMap<&PodKey, Vec<Signature>>,
    ) -> BTreeMap<Identity, Signature> {
        // Per old identity: how many of its addresses move, and where (None: not all to one
        // pod signature).
        let mut moves: BTreeMap<Identity, (u32, Option<&Arc<PodSig>>)> = BTreeMap::new();
        for (k, new) in sigs {
            let Some(rec) = self.store.pods.get(*k) else {
                continue;
            };
            // The identities pair with the signatures address by address only when the
            // addresses did not change.
            if rec.signed_ips != rec.ips || rec.ids.len() != new.len() {
                for id in &rec.ids {
                    moves.insert(*id, (0, None));
                }
                continue;
            }
            for (id, sig) in rec.ids.iter().zip(new) {
                let sig = match sig {
                    Signature::Pod(p) => Some(p),
                    _ => None,
                };
                let m = moves.entry(*id).or_insert((0, sig));
                m.0 += 1;
                if m.1 != sig {
                    m.1 = None;
                }
            }
        }
        let mut out = BTreeMap::new();
        for (id, (n, to)) in moves {
            let Some(to) = to else { continue };
            let Some(rec) = self.ids.recs.get(&id) else {
                continue;
            };
            if rec.refs != n || matches!(&rec.sig, Signature::Pod(p) if p == to) {
                continue;
            }
            if let Some(old) = self.ids.relabel(id, to.clone()) {
                out.insert(id, old);
            }
        }
        out
    }

    /// Step 3b: the records and address owners of the re-signed pods.
    fn assign_addresses(
        &mut self,
        p: &Pending,
        resign: &BTreeSet<PodKey>,
        mut new_ids: BTreeMap<PodKey, Vec<Identity>>,
    ) {
        // Records and address owners.
        let mut freed: Vec<IpAddr> = Vec::new();
        for k in resign {
            let old = p.removed_pods.get(k).or_else(|| self.store.pods.get(k));
            let old_ips = old.map(|r| r.signed_ips.clone()).unwrap_or_default();
            for ip in old_ips {
                if self.pod_addrs.get(&ip) == Some(k) {
                    self.pod_addrs.remove(&ip);
                    freed.push(ip);
                }
            }
        }
        for k in resign {
            let ids = new_ids.remove(k).unwrap_or_default();
            if let Some(rec) = self.store.pods.get_mut(k) {
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
            for (k, rec) in &self.store.pods {
                for ip in &rec.signed_ips {
                    if freed.contains(ip) {
                        self.pod_addrs.entry(*ip).or_insert_with(|| k.clone());
                    }
                }
            }
        }
    }

    /// Step 3c: the ipcache entries that differ from `before`.
    fn ipcache_changes(&self, before: &[(IpNet, Option<Identity>)], delta: &mut EngineDelta) {
        let none = BTreeMap::new();
        for &(net, old) in before {
            let new = self.ipcache_exact(&net, &none);
            if old != new {
                delta.ipcache.push(IpcacheChange {
                    prefix: net,
                    old,
                    new,
                });
            }
        }
    }

    /// Step 4a: the changed policies' selectors are added (a new selector is evaluated over all
    /// identities) and released.
    fn update_selector_users(&mut self, p: &Pending) {
        for (id, (old, new)) in &p.policies {
            if let Some(new) = new {
                for spec in new.selector_specs() {
                    self.selectors
                        .add_user(spec, id.clone(), &self.ids, &self.store);
                }
            }
            if let Some(old) = old {
                let keep: HashSet<Arc<PeerSpec>> = new
                    .as_ref()
                    .map(|n| n.selector_specs().into_iter().collect())
                    .unwrap_or_default();
                for spec in old.selector_specs() {
                    if !keep.contains(&spec) {
                        self.selectors.remove_user(&spec, id);
                    }
                }
            }
        }
    }

    /// Step 5a: the endpoints whose selecting policies or own named ports may have changed get
    /// their share keys recomputed: they go, come, or move to another shared MapState.
    fn plan_endpoints(&self, p: &Pending, resign: &BTreeSet<PodKey>) -> EndpointPlan {
        let mut cand: BTreeSet<PodKey> = resign.clone();
        for (id, (old, new)) in &p.policies {
            let _ = old;
            for key in self.shared.of_policy(id) {
                if let Some(s) = self.shared.get(key) {
                    cand.extend(s.users.iter().cloned());
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
        EndpointPlan {
            removing,
            adding,
            moving,
        }
    }

    /// Step 5b: how each move is made.
    fn prepare_moves(&mut self, p: &Pending, plan: &EndpointPlan) -> MovePrep {
        let (moving, removing) = (&plan.moving, &plan.removing);
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
        let mut derived: HashMap<Arc<ShareKey>, (PodKey, BTreeSet<PolicyRef>)> = HashMap::default();
        let mut snapshots: HashMap<Arc<ShareKey>, StateSnapshot> = HashMap::default();
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
        for (k, _, old, new) in moving {
            if !self.shared.contains_key(new) && !derived.contains_key(new) {
                let sole = !arriving.contains(old)
                    && self
                        .shared
                        .get(old)
                        .is_some_and(|o| o.users.len() == 1 && o.users.contains(k));
                let full = self.key_diff(old, new, &changed);
                if sole
                    && full.len() <= MAX_DERIVE_DIFF
                    && self.derive_is_cheaper(new, &full)
                    && let Some(mut s) = self.shared.remove(old)
                {
                    s.users.clear();
                    self.shared.insert(new.clone(), s);
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
                        .all(|u| leaving.contains(&(u.clone(), old.dir.index()))))
            {
                snapshots.insert(old.clone(), (owned(&s.policy.mapstate), s.policy.isolated));
            }
        }
        let mut compile: Vec<Arc<ShareKey>> = Vec::new();
        let mut to_compile: HashSet<*const ShareKey> = HashSet::default();
        for (_, _, _, new) in moving {
            if !self.shared.contains_key(new) && to_compile.insert(Arc::as_ptr(new)) {
                compile.push(new.clone());
            }
        }
        MovePrep {
            arriving,
            derived,
            snapshots,
            changed,
            leaving,
            compile,
        }
    }

    /// Step 5c: shared MapStates still in use receive their `Update`s (a changed policy: its
    /// entries diffed; a notification: `AddIdentity`/`RemoveIdentity`, plus the egress
    /// named-port groups); their users get the ChangeSets. Returns the ChangeSets of the states
    /// taken over by a moving endpoint.
    fn update_shared_states(
        &mut self,
        p: &Pending,
        prep: &MovePrep,
        ids: &IdentityChanges,
        notes: &Notifications,
        delta: &mut EngineDelta,
    ) -> DerivedChanges {
        let MovePrep {
            arriving,
            derived,
            changed,
            leaving,
            ..
        } = prep;
        // Shared states to update (each once; keys compared by address; in the order of the
        // policies, so that the states are updated in the same order whatever the hasher).
        let mut affected: Vec<Arc<ShareKey>> = Vec::new();
        let mut seen: HashSet<*const ShareKey> = HashSet::default();
        let updated = p
            .policies
            .iter()
            .filter(|(_, (old, new))| old.is_some() && new.is_some())
            .map(|(id, _)| id);
        let mut notified = self.selectors.users_of(&notes.changed);
        notified.sort_unstable();
        for pol in updated.chain(notified) {
            for key in self.shared.of_policy(pol) {
                if !derived.contains_key(key) && seen.insert(Arc::as_ptr(key)) {
                    affected.push(key.clone());
                }
            }
        }
        // Prepared on this thread (entry ids, indexes), applied in parallel (`parallel`), then
        // recorded; `None`: an affected state, `Some(mover)`: a state taken over.
        let mut prepared: Vec<Prepared<'_>> = Vec::new();
        let mut untouched_derived: Vec<(&PodKey, usize)> = Vec::new();
        let ids = (&ids.added, &ids.removed);
        for key in affected {
            let Some(s) = self.shared.get(&key) else {
                continue;
            };
            let d = key.dir.index();
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
            if let Some(u) = self.prepare_update(&key, &full, ids, notes) {
                prepared.push((key, u, None));
            }
        }
        for (key, (mover, full)) in derived {
            match self.prepare_update(key, full, ids, notes) {
                Some(u) => prepared.push((key.clone(), u, Some(mover))),
                None => untouched_derived.push((mover, key.dir.index())),
            }
        }
        let (state_changes, derived_changes) =
            self.run_prepared(prepared, untouched_derived, &prep.compile);
        for (key, cs, iso) in state_changes {
            if cs.is_empty() && iso.is_none() {
                continue;
            }
            let cs = Arc::new(cs);
            let d = key.dir.index();
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
        derived_changes
    }

    /// Step 5c, second half: the prepared batches and the new states' builds run as
    /// [`Job`]s (on several threads, `parallel`), then each is recorded on this thread. Returns
    /// the affected states' ChangeSets and those of the states taken over.
    fn run_prepared(
        &mut self,
        mut prepared: Vec<Prepared<'_>>,
        untouched_derived: Vec<(&PodKey, usize)>,
        compile: &[Arc<ShareKey>],
    ) -> (StateChanges, DerivedChanges) {
        let mut jobs: Vec<Job> = Vec::with_capacity(prepared.len() + compile.len());
        let mut before: Vec<bool> = Vec::with_capacity(prepared.len());
        for (key, u, _) in &mut prepared {
            let s = self.shared.get_mut(key).expect("prepared state exists");
            before.push(s.policy.isolated);
            let empty = MapState::new(key.dir, s.policy.mapstate.default_verdict());
            jobs.push(Job::Apply {
                state: Box::new(std::mem::replace(&mut s.policy.mapstate, empty)),
                batch: std::mem::take(&mut u.batch),
            });
        }
        // The states moving endpoints need anew, built with the updates.
        let mut compiled: Vec<(Arc<ShareKey>, Shared)> = Vec::new();
        for key in compile {
            if self.shared.contains_key(key) {
                continue;
            }
            let (s, job) = self.build_job(key);
            jobs.push(job);
            compiled.push((key.clone(), s));
        }
        let mut done = crate::parallel::run(jobs).into_iter();
        let mut state_changes: StateChanges = Vec::new();
        let mut derived_changes: DerivedChanges = HashMap::default();
        for ((key, u, mover), was) in prepared.into_iter().zip(before) {
            let Some(Done::Applied { state, result }) = done.next() else {
                unreachable!("one result per job, in order")
            };
            if let Some(s) = self.shared.get_mut(&key) {
                s.policy.mapstate = *state;
            }
            let (cs, iso) = self.finish_update(&key, u, result);
            match mover {
                None => state_changes.push((key, cs, iso)),
                Some(mover) => {
                    let after = self.shared.get(&key).map(|s| s.policy.isolated);
                    let iso = if Some(was) != after { after } else { None };
                    derived_changes.entry(mover.clone()).or_default().push((
                        key.dir.index(),
                        cs,
                        iso,
                    ));
                }
            }
        }
        for (mover, d) in untouched_derived {
            derived_changes
                .entry(mover.clone())
                .or_default()
                .push((d, ChangeSet::default(), None));
        }
        // The rest of the results are the builds'.
        self.store_built(done, compiled);
        (state_changes, derived_changes)
    }

    /// Step 5d: moving endpoints take their new states first, then drop the old ones; each
    /// gets the diff between its old and new state (or the ChangeSet of the state it took
    /// over).
    fn apply_moves(
        &mut self,
        plan: &EndpointPlan,
        prep: &MovePrep,
        mut derived_changes: DerivedChanges,
        delta: &mut EngineDelta,
    ) {
        let (moving, derived, snapshots) = (&plan.moving, &prep.derived, &prep.snapshots);
        // Moves: take the new states first, then drop the old ones.
        for (k, _, _, new) in moving {
            self.use_shared(new, k);
        }
        for (k, d, old, new) in moving {
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
                        (Some((v, i)), _) => (
                            diff_states(
                                v.iter().map(|(k, e)| (*k, e)),
                                s.policy.mapstate.keys_sorted(),
                            ),
                            Some(*i),
                        ),
                        (None, Some(o)) => (
                            diff_states(
                                o.policy.mapstate.keys_sorted(),
                                s.policy.mapstate.keys_sorted(),
                            ),
                            Some(o.policy.isolated),
                        ),
                        (None, None) => (diff_states([], s.policy.mapstate.keys_sorted()), None),
                    };
                    let iso =
                        (old_isolated != Some(s.policy.isolated)).then_some(s.policy.isolated);
                    (cs, iso)
                }
            };
            self.unuse_shared(old, k);
            delta.updates.push(EndpointUpdate {
                endpoint: pod_key_text(k),
                direction: Direction::ALL[*d],
                changes: Arc::new(cs),
                isolated: iso,
                rebuilt: true,
            });
        }
    }

    /// Step 5e: endpoints that are no longer local endpoints.
    fn remove_endpoints(&mut self, removing: &[PodKey], delta: &mut EngineDelta) {
        for k in removing {
            if let Some(keys) = self.ep_keys.remove(k) {
                for key in &keys {
                    self.unuse_shared(key, k);
                }
            }
            self.endpoints
                .retain(|e| !(e.namespace == k.0 && e.name == k.1));
            delta.endpoints_removed.push(pod_key_text(k));
        }
    }

    /// Step 5f: new endpoints, with their whole MapStates as ChangeSets.
    fn add_endpoints(&mut self, adding: &[PodKey], delta: &mut EngineDelta) {
        self.attach_endpoints(adding);
        for k in adding {
            // Not attached: the pod is gone.
            let Some(keys) = self.ep_keys.get(k) else {
                continue;
            };
            for key in keys {
                if let Some(s) = self.shared.get(key) {
                    delta.updates.push(EndpointUpdate {
                        endpoint: pod_key_text(k),
                        direction: key.dir,
                        changes: Arc::new(ChangeSet {
                            added: owned(&s.policy.mapstate),
                            ..ChangeSet::default()
                        }),
                        isolated: Some(s.policy.isolated),
                        rebuilt: true,
                    });
                }
            }
            delta.endpoints_added.push(pod_key_text(k));
        }
    }

    /// Step 5g: the endpoint records of changed pods.
    fn refresh_endpoint_records(&mut self, resign: &BTreeSet<PodKey>) {
        // Endpoint records of changed pods.
        for k in resign {
            if let (Some(&i), Some(rec)) = (self.ep_index.get(k), self.store.pods.get(k))
                && let Some(ep) = self.endpoints.get_mut(i)
                && ep.namespace == k.0
                && ep.name == k.1
            {
                ep.ips = rec.ips.clone();
                ep.node = rec.node.clone();
                ep.identities = rec.ids.clone();
            }
        }
    }
}
