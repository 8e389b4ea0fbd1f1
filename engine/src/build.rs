//! The engine state: objects, identities, selector cache, per-endpoint MapStates, and the
//! query API used by the CLI (`docs/contracts/engine-api.md`).

use std::collections::BTreeMap;

use crate::fast::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;
use ordnet_crds::ClusterObjects;
use ordnet_mapstate::{Identity, MapState, Origin};
use serde::Serialize;

use crate::identity::{Identities, Signature, pod_signature};
use crate::incremental::DERIVE_COST_RATIO;
use crate::model::{
    EngineError, PeerSpec, PolicyRef, translate_cluster_policy, translate_network_policy,
    translate_ordered_policy,
};
use crate::objects::ReadPod;
use crate::parallel::Job;
use crate::selector_cache::SelectorCache;
use crate::shared::{ShareKey, Shared, SharedStates};
use crate::store::{PodKey, Store, pod_key_text, read_namespace, read_pod};

/// Entries listed for the build of new MapStates ([`Engine::attach_endpoints`]) before they
/// are built.
const BUILD_CHUNK: usize = 200_000;

/// A local endpoint: a pod with at least one address (host-network pods are not endpoints).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Endpoint {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub name: String,
    /// Primary address first.
    pub ips: Vec<IpAddr>,
    /// The pod's `spec.nodeName`; `None` when not scheduled.
    pub node: Option<String>,
    /// The identity of each address (same order as `ips`).
    pub identities: Vec<Identity>,
}

impl Endpoint {
    /// `namespace/name`.
    pub fn id(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// The first address of `family`.
    pub fn address(&self, family: IpFamily) -> Option<IpAddr> {
        self.ips.iter().copied().find(|ip| family.contains(*ip))
    }
}

/// The MapState and isolation of one endpoint and direction.
#[derive(Debug, Clone)]
pub struct EndpointPolicy {
    /// The compiled rules of every policy selecting the endpoint in this direction.
    pub mapstate: MapState,
    /// Whether the endpoint is isolated in this direction (the MapState's default is deny).
    pub isolated: bool,
    /// The policies that isolate it (origin with `rule_index` 0 and action deny; kind, namespace,
    /// name, direction and priority name the policy).
    pub isolated_by: Vec<Arc<Origin>>,
}

/// An IP family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum IpFamily {
    /// IPv4.
    V4,
    /// IPv6.
    V6,
}

impl IpFamily {
    /// Whether `ip` is of this family.
    pub fn contains(self, ip: IpAddr) -> bool {
        match self {
            IpFamily::V4 => ip.is_ipv4(),
            IpFamily::V6 => ip.is_ipv6(),
        }
    }

    /// The family of `ip`.
    pub fn of(ip: IpAddr) -> IpFamily {
        if ip.is_ipv4() {
            IpFamily::V4
        } else {
            IpFamily::V6
        }
    }
}

/// Options of a build.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BuildOptions {
    /// Compile MapStates only for the pods of this node (identities and the ipcache still cover
    /// the whole cluster). `None` = every pod.
    pub node: Option<String>,
    /// Enforce the staged policies too (`spec.mode: Staged`), as if their mode were `Enforce`:
    /// what they would do (`ordnet matrix --staged`, `ordnet whatif`). Otherwise a staged policy
    /// is left out as if absent.
    pub staged: bool,
}

/// Everything computed from one set of objects.
#[derive(Debug, Clone)]
pub struct Engine {
    pub(crate) options: BuildOptions,
    /// The objects as the engine reads them, and what their policies use.
    pub(crate) store: Store,
    pub(crate) ids: Identities,
    pub(crate) world: Identity,
    pub(crate) cidr_ids: BTreeMap<IpNet, Identity>,
    /// Address -> the pod that owns it (pods with identities only).
    pub(crate) pod_addrs: HashMap<IpAddr, PodKey>,
    pub(crate) selectors: SelectorCache,
    pub(crate) endpoints: Vec<Endpoint>,
    pub(crate) ep_index: HashMap<PodKey, usize>,
    pub(crate) ep_keys: HashMap<PodKey, [Arc<ShareKey>; 2]>,
    /// The MapStates, one per share key, with their users.
    pub(crate) shared: SharedStates,
    pub(crate) errors: Vec<EngineError>,
    /// When a moving endpoint takes its old MapState over ([`crate::incremental`]).
    pub(crate) derive_cost_ratio: usize,
}

impl Engine {
    /// From-scratch build from already validated objects; every pod with an address is an
    /// endpoint. Objects the engine cannot use are left out and listed in [`Engine::errors`].
    pub fn build(objects: &ClusterObjects) -> Engine {
        Engine::build_with(objects, &BuildOptions::default())
    }

    /// [`Engine::build`], but MapStates only for the endpoints of `node`.
    pub fn build_for_node(objects: &ClusterObjects, node: &str) -> Engine {
        Engine::build_with(
            objects,
            &BuildOptions {
                node: Some(node.to_string()),
                ..BuildOptions::default()
            },
        )
    }

    /// [`Engine::build`], failing with every error instead of leaving objects out.
    pub fn try_build(objects: &ClusterObjects) -> Result<Engine, Vec<EngineError>> {
        let e = Engine::build(objects);
        if e.errors.is_empty() {
            Ok(e)
        } else {
            Err(e.errors)
        }
    }

    /// An engine without objects.
    pub fn empty(options: BuildOptions) -> Engine {
        let mut e = Engine {
            options,
            store: Store::default(),
            ids: Identities::default(),
            world: 0,
            cidr_ids: BTreeMap::new(),
            pod_addrs: HashMap::default(),
            selectors: SelectorCache::default(),
            endpoints: Vec::new(),
            ep_index: HashMap::default(),
            ep_keys: HashMap::default(),
            shared: SharedStates::default(),
            derive_cost_ratio: DERIVE_COST_RATIO,
            errors: Vec::new(),
        };
        e.world = e.ids.acquire(Signature::World, "").0;
        e
    }

    /// Drops the engine one part at a time, calling `dropped(part)` after each, for memory
    /// accounting: with a counting allocator, the bytes freed between two calls are what that
    /// part held (the scale benchmark's breakdown). Parts, in order: the parts of the MapStates
    /// ([`MapState::PARTS`]), `shared rule sets` (who shares them, entry keys and ids, notification
    /// indexes), `endpoints`, `selector cache`, `addresses` (address → pod), `identities`,
    /// `objects` (pods, namespaces, Services, translated policies as kept), `rest`. Shared
    /// values (`Arc`s) are counted where their last reference goes.
    pub fn dismantle(self, mut dropped: impl FnMut(&'static str)) {
        let Engine {
            options,
            store,
            ids,
            world: _,
            derive_cost_ratio: _,
            cidr_ids,
            pod_addrs,
            selectors,
            endpoints,
            ep_index,
            ep_keys,
            mut shared,
            errors,
        } = self;
        for (i, part) in MapState::PARTS.iter().enumerate() {
            shared.release_mapstates(i);
            dropped(part);
        }
        drop(shared);
        drop(ep_keys);
        dropped("shared rule sets");
        drop((endpoints, ep_index));
        dropped("endpoints");
        drop(selectors);
        dropped("selector cache");
        drop(pod_addrs);
        dropped("addresses");
        drop((ids, cidr_ids));
        dropped("identities");
        drop(store);
        dropped("objects");
        drop((options, errors));
        dropped("rest");
    }

    /// From-scratch build with options.
    pub fn build_with(objects: &ClusterObjects, options: &BuildOptions) -> Engine {
        Engine::build_with_read_pods(objects, Vec::new(), options)
    }

    /// [`Engine::build_with`] from objects and pods already read ([`Object::slimmed`]); the
    /// read pods are consumed one by one (the agent's initial build).
    pub fn build_with_read_pods(
        objects: &ClusterObjects,
        read_pods: Vec<ReadPod>,
        options: &BuildOptions,
    ) -> Engine {
        let mut e = Engine::empty(options.clone());
        for r in read_pods {
            match r.into_read() {
                Ok((k, rec)) => e.store.insert_pod(k, rec),
                Err(err) => e.errors.push(err),
            }
        }
        for ns in &objects.namespaces {
            match read_namespace(&ns.object) {
                Ok((name, labels)) => {
                    e.store.namespaces.insert(name, labels);
                }
                Err(err) => e.errors.push(err),
            }
        }
        for pod in &objects.pods {
            match read_pod(&pod.object) {
                Ok((k, rec)) => e.store.insert_pod(k, rec),
                Err(err) => e.errors.push(err),
            }
        }
        for svc in &objects.services {
            match crate::services::read_service(&svc.object) {
                Ok((k, rec)) => {
                    e.store.services.insert(k, Arc::new(rec));
                }
                Err(err) => e.errors.push(err),
            }
        }
        for node in &objects.nodes {
            let name = node.object.metadata.name.clone().unwrap_or_default();
            let labels = node.object.metadata.labels.clone().unwrap_or_default();
            e.store
                .nodes
                .insert(name, (labels, crate::model::node_addresses(&node.object)));
        }
        for cnp in &objects.cluster_network_policies {
            let name = cnp.object.metadata.name.clone().unwrap_or_default();
            e.store
                .cnp_objects
                .insert(name, Arc::new(cnp.object.clone()));
        }
        let cnps: Vec<_> = objects
            .cluster_network_policies
            .iter()
            .map(|p| e.store.translate_cnp(&p.object))
            .collect();
        let translated = objects
            .network_policies
            .iter()
            .map(|p| translate_network_policy(&p.object))
            .chain(
                objects
                    .ordered_policies
                    .iter()
                    .filter(|p| options.staged || p.object.spec.mode.is_enforce())
                    .map(|p| translate_ordered_policy(&p.object)),
            )
            .chain(
                objects
                    .cluster_ordered_policies
                    .iter()
                    .filter(|p| options.staged || p.object.spec.mode.is_enforce())
                    .map(|p| translate_cluster_policy(&p.object)),
            )
            .chain(cnps);
        for p in translated {
            match p {
                Ok(p) => e.store.insert_policy(Arc::new(p)),
                Err(err) => e.errors.push(err),
            }
        }
        // Identities: CIDRs first, then pod addresses.
        let cidrs: Vec<IpNet> = e.store.cidr_use.keys().copied().collect();
        for c in cidrs {
            let id = e.ids.acquire(Signature::Cidr(c), &c.to_string()).0;
            e.cidr_ids.insert(c, id);
        }
        let keys: Vec<PodKey> = e.store.pods.keys().cloned().collect();
        for k in &keys {
            let ids = e.pod_identities(k);
            for (ip, (id, _)) in e.store.pods[k].ips.clone().into_iter().zip(ids.iter()) {
                e.pod_addrs.entry(ip).or_insert_with(|| k.clone());
                let _ = id;
            }
            if let Some(rec) = e.store.pods.get_mut(k) {
                rec.signed_ips = if rec.addressed() {
                    rec.ips.clone()
                } else {
                    Vec::new()
                };
                rec.ids = ids.into_iter().map(|(id, _)| id).collect();
            }
        }
        // Selector cache.
        let specs: Vec<(Arc<PeerSpec>, PolicyRef)> = e
            .store
            .policies
            .values()
            .flat_map(|p| p.selector_specs().into_iter().map(|s| (s, p.id.clone())))
            .collect();
        for (spec, user) in specs {
            e.selectors.add_user(spec, user, &e.ids, &e.store);
        }
        // Endpoints and MapStates.
        let local: Vec<PodKey> = keys
            .iter()
            .filter(|k| e.is_local_endpoint(k))
            .cloned()
            .collect();
        e.attach_endpoints(&local);
        e.sort_endpoints();
        e
    }

    /// The signatures of a pod's addresses under the current CIDRs and named ports in use.
    pub(crate) fn pod_signatures(&self, k: &PodKey) -> Vec<Signature> {
        let Some(rec) = self.store.pods.get(k) else {
            return Vec::new();
        };
        if !rec.addressed() {
            return Vec::new();
        }
        let ns = self.store.ns_labels(&k.0);
        rec.ips
            .iter()
            .map(|ip| {
                Signature::Pod(Arc::new(pod_signature(
                    &ns,
                    &rec.labels,
                    &rec.ports,
                    *ip,
                    &self.store.cidr_use,
                    &self.store.named_use,
                )))
            })
            .collect()
    }

    /// Acquires the identities of a pod's addresses (one reference per address).
    pub(crate) fn pod_identities(&mut self, k: &PodKey) -> Vec<(Identity, bool)> {
        let sigs = self.pod_signatures(k);
        self.acquire_signatures(k, sigs)
    }

    /// Acquires the identities of `sigs`, pod `k`'s signatures (one reference per address);
    /// whether each is new.
    pub(crate) fn acquire_signatures(
        &mut self,
        k: &PodKey,
        sigs: Vec<Signature>,
    ) -> Vec<(Identity, bool)> {
        let member = pod_key_text(k);
        sigs.into_iter()
            .map(|s| self.ids.acquire(s, &member))
            .collect()
    }

    /// Whether pod `k` is an endpoint of this engine (has identities, and is on the node).
    pub(crate) fn is_local_endpoint(&self, k: &PodKey) -> bool {
        let Some(rec) = self.store.pods.get(k) else {
            return false;
        };
        rec.addressed()
            && !rec.ids.is_empty()
            && match &self.options.node {
                None => true,
                Some(n) => rec.node.as_deref() == Some(n.as_str()),
            }
    }

    /// Adds the endpoint records of pods `ks` and their MapStates, the new ones built as
    /// [`Job`]s (on several threads, `parallel`): each distinct state's entries are listed in
    /// the order of the pods, so entry ids are given out as by one compile after another; a
    /// chunk of [`BUILD_CHUNK`] entries at a time is built, so that the entries waiting for
    /// their build stay few; then the chunk's endpoints attach to the states.
    pub(crate) fn attach_endpoints(&mut self, ks: &[PodKey]) {
        let mut pending: HashSet<Arc<ShareKey>> = HashSet::default();
        let mut chunk: Vec<(Arc<ShareKey>, Shared)> = Vec::new();
        let mut jobs: Vec<Job> = Vec::new();
        let mut attach: Vec<(&PodKey, [Arc<ShareKey>; 2])> = Vec::new();
        let mut entries = 0;
        for k in ks {
            let Some(rec) = self.store.pods.get(k) else {
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
            for key in &keys {
                if self.shared.contains_key(key) || !pending.insert(key.clone()) {
                    continue;
                }
                let (s, job) = self.build_job(key);
                if let Job::Build { entries: list, .. } = &job {
                    entries += list.len();
                }
                jobs.push(job);
                chunk.push((key.clone(), s));
            }
            attach.push((k, keys));
            if entries >= BUILD_CHUNK {
                let done = crate::parallel::run(std::mem::take(&mut jobs));
                self.store_built(done.into_iter(), std::mem::take(&mut chunk));
                for (k, keys) in attach.drain(..) {
                    self.attach(k, keys);
                }
                pending.clear();
                entries = 0;
            }
        }
        self.store_built(crate::parallel::run(jobs).into_iter(), chunk);
        for (k, keys) in attach {
            self.attach(k, keys);
        }
    }

    pub(crate) fn sort_endpoints(&mut self) {
        self.endpoints
            .sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
        self.ep_index = self
            .endpoints
            .iter()
            .enumerate()
            .map(|(i, e)| ((e.namespace.clone(), e.name.clone()), i))
            .collect();
    }
}
