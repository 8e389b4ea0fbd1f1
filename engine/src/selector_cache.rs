//! The selector cache: every peer selector of the stored policies, the identities it selects
//! now, and the policies that use it. A selector is evaluated once, when its first user
//! arrives; afterwards only identities come and go, and [`SelectorCache::notify`] turns that
//! into per-selector gains and losses (the notifications the shared MapStates follow).

use std::collections::{BTreeMap, BTreeSet};

use crate::fast::{HashMap, HashSet};
use std::sync::Arc;

use ordnet_mapstate::{IdSet, Identity};

use crate::identity::{Identities, Signature};
use crate::model::{NsScope, PeerSpec, PolicyRef};
use crate::store::Store;

/// The number of a selector in the selector cache (never reused).
pub(crate) type SelId = u32;

/// One entry of the selector cache.
#[derive(Debug, Clone, Default)]
pub(crate) struct SelState {
    pub id: SelId,
    /// The identities selected now, as the bitmap a MapState entry holds
    /// ([`SelectorCache::selected`] clones it: building one from a tree at every compilation
    /// was ~7 % of a local relabel at 10k pods / 5k policies).
    pub ids: IdSet,
    /// The policies that use this peer.
    pub users: BTreeSet<PolicyRef>,
}

/// Identities gained and lost per selector, and the selectors that changed (their users, the
/// policies to follow them, are read from the cache: [`SelectorCache::users_of`]; copying
/// them out was most of a relabel's notification cost at 10k pods / 5k policies).
#[derive(Debug, Default)]
pub(crate) struct Notifications {
    pub gained: HashMap<SelId, BTreeSet<Identity>>,
    /// Identities that are gone (every selector loses them: `RemoveIdentity`).
    pub lost: HashMap<SelId, BTreeSet<Identity>>,
    /// Relabelled identities the selector no longer selects (they stay: `Deselect`).
    pub deselected: HashMap<SelId, BTreeSet<Identity>>,
    pub changed: Vec<Arc<PeerSpec>>,
    /// The selectors in `gained`, `lost` or `deselected`, one bit per selector number: every
    /// entry of every notified state is tested against it ([`Notifications::touches`]), and
    /// most entries' selectors did not change (hashing each entry's selector into both maps
    /// was ~5 % of a local relabel at 10k pods / 5k policies).
    touched: Vec<u64>,
}

impl Notifications {
    /// Whether selector `sel` gained or lost identities.
    #[inline]
    pub(crate) fn touches(&self, sel: SelId) -> bool {
        self.touched
            .get(sel as usize / 64)
            .is_some_and(|w| (w >> (sel % 64)) & 1 == 1)
    }

    fn mark(&mut self, sel: SelId) {
        let word = sel as usize / 64;
        if self.touched.len() <= word {
            self.touched.resize(word + 1, 0);
        }
        self.touched[word] |= 1 << (sel % 64);
    }
}

/// The selector cache.
#[derive(Debug, Clone, Default)]
pub(crate) struct SelectorCache {
    entries: HashMap<Arc<PeerSpec>, SelState>,
    /// The last number given to a selector.
    last: SelId,
}

impl SelectorCache {
    /// Registers `user` as a user of `spec`, evaluating the selector over `ids` if it is new.
    /// Returns whether it was new.
    pub(crate) fn add_user(
        &mut self,
        spec: Arc<PeerSpec>,
        user: PolicyRef,
        ids: &Identities,
        store: &Store,
    ) -> bool {
        if let Some(s) = self.entries.get_mut(&spec) {
            s.users.insert(user);
            return false;
        }
        let selected = evaluate(&spec, ids, store);
        self.last += 1;
        self.entries.insert(
            spec,
            SelState {
                id: self.last,
                ids: selected.into_iter().collect(),
                users: BTreeSet::from([user]),
            },
        );
        true
    }

    /// Drops `user` from `spec`; the selector goes when it has no users left.
    pub(crate) fn remove_user(&mut self, spec: &Arc<PeerSpec>, user: &PolicyRef) {
        if let Some(s) = self.entries.get_mut(spec) {
            s.users.remove(user);
            if s.users.is_empty() {
                self.entries.remove(spec);
            }
        }
    }

    /// The cached state of `spec`.
    pub(crate) fn get(&self, spec: &PeerSpec) -> Option<&SelState> {
        self.entries.get(spec)
    }

    /// The identities of `spec` (empty if it is not cached, which does not happen for the
    /// peers of stored policies).
    pub(crate) fn selected(&self, spec: &PeerSpec) -> IdSet {
        self.entries
            .get(spec)
            .map(|s| s.ids.copy_with_room())
            .unwrap_or_default()
    }

    /// Number of cached selectors.
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Tests every selector against the identities `added` and `relabelled` (with their
    /// signatures, the new ones) and drops the `removed` ones. An identity's membership never
    /// changes otherwise (selectors are immutable, and a signature changes only by a relabel),
    /// so these gains and losses are all the notifications.
    pub(crate) fn notify(
        &mut self,
        added: &[(Identity, Signature)],
        removed: &BTreeMap<Identity, Signature>,
        relabelled: &[(Identity, Signature)],
    ) -> Notifications {
        let mut n = Notifications::default();
        if added.is_empty() && removed.is_empty() && relabelled.is_empty() {
            return n;
        }
        // The namespaces of the pod identities that come and go: a selector of one namespace's
        // own pods (most selectors: a namespaced policy's peers without a namespaceSelector)
        // holds only pod identities of that namespace, so the others skip it. (Sorted, searched
        // by comparison: usually one namespace, and every selector is tested against it.)
        let mut touched: Vec<&str> = added
            .iter()
            .chain(relabelled)
            .map(|(_, sig)| sig)
            .chain(removed.values())
            .filter_map(|sig| match sig {
                Signature::Pod(p) => Some(p.namespace()),
                _ => None,
            })
            .collect();
        touched.sort_unstable();
        touched.dedup();
        for (spec, st) in self.entries.iter_mut() {
            if let PeerSpec::Pods {
                namespaces: NsScope::Named(ns),
                ..
            } = &**spec
                && touched.binary_search(&ns.as_str()).is_err()
            {
                continue;
            }
            let mut changed = false;
            for (id, sig) in added {
                if selects(spec, sig) && st.ids.insert(*id) {
                    n.gained.entry(st.id).or_default().insert(*id);
                    changed = true;
                }
            }
            for id in removed.keys() {
                if st.ids.remove(*id) {
                    n.lost.entry(st.id).or_default().insert(*id);
                    changed = true;
                }
            }
            for (id, sig) in relabelled {
                if selects(spec, sig) {
                    if st.ids.insert(*id) {
                        n.gained.entry(st.id).or_default().insert(*id);
                        changed = true;
                    }
                } else if st.ids.remove(*id) {
                    n.deselected.entry(st.id).or_default().insert(*id);
                    changed = true;
                }
            }
            if changed {
                n.changed.push(spec.clone());
                n.mark(st.id);
            }
        }
        n
    }

    /// The policies that use one of `specs`, each once, in no particular order.
    pub(crate) fn users_of<'a>(&'a self, specs: &'a [Arc<PeerSpec>]) -> Vec<&'a PolicyRef> {
        let mut seen: HashSet<&PolicyRef> = HashSet::default();
        specs
            .iter()
            .filter_map(|spec| self.entries.get(spec))
            .flat_map(|st| &st.users)
            .filter(|u| seen.insert(*u))
            .collect()
    }
}

/// All identities `spec` selects now.
pub(crate) fn evaluate(spec: &PeerSpec, ids: &Identities, store: &Store) -> BTreeSet<Identity> {
    let mut out = BTreeSet::new();
    let mut test = |id: &Identity| {
        if let Some(sig) = ids.sig(*id)
            && selects(spec, sig)
        {
            out.insert(*id);
        }
    };
    match spec {
        PeerSpec::Pods {
            namespaces: NsScope::Named(n),
            ..
        } => {
            for id in ids.by_namespace.get(n).into_iter().flatten() {
                test(id);
            }
        }
        PeerSpec::Pods { namespaces, .. } => {
            for (ns, members) in &ids.by_namespace {
                // Every pod identity of one namespace carries that namespace's labels.
                let labels = members
                    .iter()
                    .next()
                    .and_then(|id| match ids.sig(*id) {
                        Some(Signature::Pod(p)) => Some(p.namespace_labels.clone()),
                        _ => None,
                    })
                    .unwrap_or_else(|| store.ns_labels(ns));
                if namespaces.matches(&labels) {
                    for id in members {
                        test(id);
                    }
                }
            }
        }
        PeerSpec::Block { .. } => {
            for id in ids.non_pod.iter().chain(ids.pods_in_cidrs.iter()) {
                test(id);
            }
        }
        PeerSpec::Nodes { .. } => {
            for id in &ids.non_pod {
                test(id);
            }
        }
    }
    out
}

/// Whether `spec` selects an identity with signature `sig`.
pub(crate) fn selects(spec: &PeerSpec, sig: &Signature) -> bool {
    match (spec, sig) {
        (PeerSpec::Pods { namespaces, pods }, Signature::Pod(p)) => {
            namespaces.matches(&p.namespace_labels) && pods.matches(&p.labels)
        }
        (PeerSpec::Pods { .. }, _) => false,
        (PeerSpec::Block { cidr, except }, Signature::Pod(p)) => {
            p.cidrs.binary_search(cidr).is_ok()
                && !except.iter().any(|e| p.cidrs.binary_search(e).is_ok())
        }
        (PeerSpec::Block { cidr, except }, Signature::Cidr(net)) => {
            cidr.contains(net) && !except.iter().any(|e| e.contains(net))
        }
        (PeerSpec::Block { .. }, Signature::World) => false,
        // A Node address is a host prefix in use: its identity is that prefix's.
        (PeerSpec::Nodes { addrs, .. }, Signature::Cidr(net)) => addrs.binary_search(net).is_ok(),
        (PeerSpec::Nodes { .. }, _) => false,
    }
}
