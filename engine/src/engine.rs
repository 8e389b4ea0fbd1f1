//! The engine state: objects, identities, selector cache, per-endpoint MapStates, and the
//! query API used by the CLI (`docs/contracts/engine-api.md`).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use ordnet_crds::ClusterObjects;
use ordnet_mapstate::{
    Decision, Direction, EntryId, Identity, Key, L4Match, MapState, OrderKey, Origin, PolicyEntry,
    Protocol, Selector, StateEntry, Verdict,
};
use serde::Serialize;

use crate::identity::{
    Identities, IdentityInfo, NamedPort, Signature, longest_prefix, pod_signature, resolve_named,
};
use crate::model::{
    DIRECTIONS, EngineError, Labels, NAMESPACE_NAME_LABEL, NsScope, PeerSpec, Policy, PolicyRef,
    PortSpec, dir_index, parse_protocol, translate_cluster_policy, translate_network_policy,
    translate_ordered_policy,
};

/// `namespace/name` of a pod.
pub type PodKey = (String, String);

/// A local endpoint: a pod with at least one address (host-network pods are not endpoints).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Endpoint {
    pub namespace: String,
    pub name: String,
    /// Primary address first.
    pub ips: Vec<IpAddr>,
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
    V4,
    V6,
}

impl IpFamily {
    pub fn contains(self, ip: IpAddr) -> bool {
        match self {
            IpFamily::V4 => ip.is_ipv4(),
            IpFamily::V6 => ip.is_ipv6(),
        }
    }

    pub fn of(ip: IpAddr) -> IpFamily {
        if ip.is_ipv4() {
            IpFamily::V4
        } else {
            IpFamily::V6
        }
    }
}

/// One end of a flow.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FlowEnd {
    Pod { namespace: String, name: String },
    Ip(IpAddr),
}

impl std::fmt::Display for FlowEnd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FlowEnd::Pod { namespace, name } => write!(f, "{namespace}/{name}"),
            FlowEnd::Ip(ip) => write!(f, "{ip}"),
        }
    }
}

pub(crate) fn ser_verdict<S: serde::Serializer>(v: &Verdict, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(v.as_str())
}

/// The verdict of one flow and why (`trace -o json`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FlowTrace {
    #[serde(serialize_with = "ser_verdict")]
    pub verdict: Verdict,
    /// Set when the flow is allowed without looking at policy (same pod).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exemption: Option<String>,
    /// `None` when the source is not a pod (or not a local endpoint of a node-scoped engine).
    pub egress: Option<SideTrace>,
    /// `None` when the destination is not a pod (or not a local endpoint of a node-scoped
    /// engine).
    pub ingress: Option<SideTrace>,
    /// Set when an end could not be resolved (unknown pod, pod without address); the verdict is
    /// then deny.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// One side of a flow: the lookup in one endpoint's MapState.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SideTrace {
    /// `ns/name` of the endpoint whose MapState was consulted.
    pub endpoint: String,
    pub direction: Direction,
    /// The other end, `ns/name` or an IP address.
    pub peer: String,
    pub peer_address: IpAddr,
    pub peer_identity: Identity,
    #[serde(serialize_with = "ser_verdict")]
    pub verdict: Verdict,
    pub decision: SideDecision,
}

/// What decided one side.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(
    tag = "kind",
    rename_all = "lowercase",
    rename_all_fields = "camelCase"
)]
pub enum SideDecision {
    /// A MapState key matched; `entry.origins` names the deciding rule(s).
    Matched { key: Key, entry: StateEntry },
    /// Nothing matched: the isolation default applied.
    Default {
        isolated: bool,
        isolated_by: Vec<Arc<Origin>>,
    },
}

/// Per-pod state.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PodRec {
    pub labels: Arc<Labels>,
    pub ips: Vec<IpAddr>,
    pub node: Option<String>,
    pub host_network: bool,
    /// `status.phase` is `Succeeded` or `Failed`: not an endpoint, no identity, no address.
    pub terminal: bool,
    /// Not reported unready (`status.conditions` Ready=False): a Service backend. A pod without
    /// a Ready condition counts as ready (manifests rarely carry conditions).
    pub ready: bool,
    pub ports: Vec<NamedPort>,
    /// Identity per address of `signed_ips` (empty for pods without identities: no address,
    /// host network or terminated).
    pub ids: Vec<Identity>,
    /// The addresses `ids` were allocated for (equal to `ips` except during an update).
    pub signed_ips: Vec<IpAddr>,
}

impl PodRec {
    /// Whether the pod's addresses get identities (it has one, is not host-network and has not
    /// terminated).
    pub fn addressed(&self) -> bool {
        !self.ips.is_empty() && !self.host_network && !self.terminal
    }
}

/// The inputs that determine an endpoint's MapState in one direction; endpoints with equal keys
/// share one computation.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct ShareKey {
    pub dir: Direction,
    /// The policies that select the endpoint, sorted.
    pub policies: Vec<PolicyRef>,
    /// Ingress only: what each named port used by these policies' ingress rules resolves to on
    /// the endpoint.
    pub own_ports: Vec<((String, Protocol), Vec<u16>)>,
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
    pub verdict: Verdict,
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

/// The number of a selector in the selector cache (never reused).
pub(crate) type SelId = u32;

/// One entry of the selector cache.
#[derive(Debug, Clone, Default)]
pub(crate) struct SelState {
    pub id: SelId,
    pub ids: BTreeSet<Identity>,
    /// The policies that use this peer.
    pub users: BTreeSet<PolicyRef>,
}

/// Options of a build.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BuildOptions {
    /// Compile MapStates only for the pods of this node (identities and the ipcache still cover
    /// the whole cluster). `None` = every pod.
    pub node: Option<String>,
}

/// Everything computed from one set of objects.
#[derive(Debug, Clone)]
pub struct Engine {
    pub(crate) options: BuildOptions,
    pub(crate) namespaces: BTreeMap<String, Arc<Labels>>,
    pub(crate) pods: BTreeMap<PodKey, PodRec>,
    pub(crate) policies: BTreeMap<PolicyRef, Arc<Policy>>,
    pub(crate) services: BTreeMap<crate::services::ServiceKey, Arc<crate::services::ServiceRec>>,
    /// Namespaced policies by namespace.
    pub(crate) ns_policies: HashMap<String, BTreeSet<PolicyRef>>,
    pub(crate) cluster_policies: BTreeSet<PolicyRef>,
    /// CIDR prefixes in use (ipBlock cidr and except), with reference counts.
    pub(crate) cidr_use: BTreeMap<IpNet, u32>,
    /// (name, protocol) of named ports used by egress rules, with reference counts.
    pub(crate) named_use: BTreeMap<(String, Protocol), u32>,
    pub(crate) ids: Identities,
    pub(crate) world: Identity,
    pub(crate) cidr_ids: BTreeMap<IpNet, Identity>,
    /// Address -> the pod that owns it (pods with identities only).
    pub(crate) pod_addrs: HashMap<IpAddr, PodKey>,
    pub(crate) selectors: HashMap<Arc<PeerSpec>, SelState>,
    pub(crate) endpoints: Vec<Endpoint>,
    pub(crate) ep_index: HashMap<PodKey, usize>,
    pub(crate) ep_keys: HashMap<PodKey, [Arc<ShareKey>; 2]>,
    pub(crate) shared: HashMap<Arc<ShareKey>, Shared>,
    /// Policy -> shared computations that include it.
    pub(crate) policy_shared: HashMap<PolicyRef, HashSet<Arc<ShareKey>>>,
    pub(crate) entry_ids: HashMap<EntryKey, EntryId>,
    pub(crate) next_entry: u64,
    pub(crate) next_sel: SelId,
    pub(crate) errors: Vec<EngineError>,
}

pub(crate) fn pod_key_text(k: &PodKey) -> String {
    format!("{}/{}", k.0, k.1)
}

/// Reads what the engine needs from a Pod. Errors name the pod and the field.
pub(crate) fn read_pod(pod: &Pod) -> Result<(PodKey, PodRec), EngineError> {
    let name = pod.metadata.name.clone().unwrap_or_default();
    let namespace = pod
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| ordnet_crds::manifest::DEFAULT_NAMESPACE.to_string());
    let object = format!("Pod {namespace}/{name}");
    if name.is_empty() {
        return Err(EngineError {
            object,
            field: "metadata.name".into(),
            message: "required".into(),
        });
    }
    let mut ports = Vec::new();
    if let Some(spec) = &pod.spec {
        for (i, c) in spec.containers.iter().enumerate() {
            for (j, p) in c.ports.iter().flatten().enumerate() {
                let field = format!("spec.containers[{i}].ports[{j}]");
                let proto = parse_protocol(p.protocol.as_deref()).ok_or_else(|| EngineError {
                    object: object.clone(),
                    field: format!("{field}.protocol"),
                    message: format!(
                        "{:?} is not supported: use TCP, UDP or SCTP",
                        p.protocol.as_deref().unwrap_or_default()
                    ),
                })?;
                let number = u16::try_from(p.container_port)
                    .ok()
                    .filter(|&n| n >= 1)
                    .ok_or_else(|| EngineError {
                        object: object.clone(),
                        field: format!("{field}.containerPort"),
                        message: format!("{} is not a port number (1-65535)", p.container_port),
                    })?;
                if let Some(n) = p.name.as_deref().filter(|n| !n.is_empty()) {
                    ports.push((n.to_string(), proto, number));
                }
            }
        }
    }
    ports.sort();
    ports.dedup();
    if let Some(status) = &pod.status {
        for (i, text) in status
            .pod_ip
            .iter()
            .map(|s| ("status.podIP".to_string(), s))
            .chain(
                status
                    .pod_ips
                    .iter()
                    .flatten()
                    .enumerate()
                    .map(|(i, p)| (format!("status.podIPs[{i}].ip"), &p.ip)),
            )
        {
            if !text.is_empty() && text.parse::<IpAddr>().is_err() {
                return Err(EngineError {
                    object,
                    field: i,
                    message: format!("{text:?} is not an IP address"),
                });
            }
        }
    }
    let ips = ordnet_crds::validate::pod_ips(pod);
    let spec = pod.spec.as_ref();
    Ok((
        (namespace, name),
        PodRec {
            labels: Arc::new(pod.metadata.labels.clone().unwrap_or_default()),
            ips,
            node: spec.and_then(|s| s.node_name.clone()),
            host_network: spec.and_then(|s| s.host_network).unwrap_or(false),
            terminal: ordnet_crds::validate::pod_is_terminal(pod),
            ready: !pod
                .status
                .iter()
                .flat_map(|s| s.conditions.iter().flatten())
                .any(|c| c.type_ == "Ready" && c.status == "False"),
            ports,
            ids: Vec::new(),
            signed_ips: Vec::new(),
        },
    ))
}

/// Reads a Namespace: its name and labels (with `kubernetes.io/metadata.name` forced to the
/// name, as the API server does).
pub(crate) fn read_namespace(ns: &Namespace) -> Result<(String, Arc<Labels>), EngineError> {
    let name = ns.metadata.name.clone().unwrap_or_default();
    if name.is_empty() {
        return Err(EngineError {
            object: "Namespace".into(),
            field: "metadata.name".into(),
            message: "required".into(),
        });
    }
    let mut labels = ns.metadata.labels.clone().unwrap_or_default();
    labels.insert(NAMESPACE_NAME_LABEL.to_string(), name.clone());
    Ok((name, Arc::new(labels)))
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
    }
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
            namespaces: BTreeMap::new(),
            pods: BTreeMap::new(),
            policies: BTreeMap::new(),
            services: BTreeMap::new(),
            ns_policies: HashMap::new(),
            cluster_policies: BTreeSet::new(),
            cidr_use: BTreeMap::new(),
            named_use: BTreeMap::new(),
            ids: Identities::default(),
            world: 0,
            cidr_ids: BTreeMap::new(),
            pod_addrs: HashMap::new(),
            selectors: HashMap::new(),
            endpoints: Vec::new(),
            ep_index: HashMap::new(),
            ep_keys: HashMap::new(),
            shared: HashMap::new(),
            policy_shared: HashMap::new(),
            entry_ids: HashMap::new(),
            next_entry: 0,
            next_sel: 0,
            errors: Vec::new(),
        };
        e.world = e.ids.acquire(Signature::World, "").0;
        e
    }

    /// From-scratch build with options.
    pub fn build_with(objects: &ClusterObjects, options: &BuildOptions) -> Engine {
        let mut e = Engine::empty(options.clone());
        for ns in &objects.namespaces {
            match read_namespace(&ns.object) {
                Ok((name, labels)) => {
                    e.namespaces.insert(name, labels);
                }
                Err(err) => e.errors.push(err),
            }
        }
        for pod in &objects.pods {
            match read_pod(&pod.object) {
                Ok((k, rec)) => {
                    e.pods.insert(k, rec);
                }
                Err(err) => e.errors.push(err),
            }
        }
        for svc in &objects.services {
            match crate::services::read_service(&svc.object) {
                Ok((k, rec)) => {
                    e.services.insert(k, Arc::new(rec));
                }
                Err(err) => e.errors.push(err),
            }
        }
        let translated = objects
            .network_policies
            .iter()
            .map(|p| translate_network_policy(&p.object))
            .chain(
                objects
                    .ordered_policies
                    .iter()
                    .map(|p| translate_ordered_policy(&p.object)),
            )
            .chain(
                objects
                    .cluster_ordered_policies
                    .iter()
                    .map(|p| translate_cluster_policy(&p.object)),
            );
        for p in translated {
            match p {
                Ok(p) => e.insert_policy_record(Arc::new(p)),
                Err(err) => e.errors.push(err),
            }
        }
        // Identities: CIDRs first, then pod addresses.
        let cidrs: Vec<IpNet> = e.cidr_use.keys().copied().collect();
        for c in cidrs {
            let id = e.ids.acquire(Signature::Cidr(c), &c.to_string()).0;
            e.cidr_ids.insert(c, id);
        }
        let keys: Vec<PodKey> = e.pods.keys().cloned().collect();
        for k in &keys {
            let ids = e.pod_identities(k);
            for (ip, (id, _)) in e.pods[k].ips.clone().into_iter().zip(ids.iter()) {
                e.pod_addrs.entry(ip).or_insert_with(|| k.clone());
                let _ = id;
            }
            if let Some(rec) = e.pods.get_mut(k) {
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
            .policies
            .values()
            .flat_map(|p| p.selector_specs().into_iter().map(|s| (s, p.id.clone())))
            .collect();
        for (spec, user) in specs {
            e.add_selector_user(spec, user);
        }
        // Endpoints and MapStates.
        for k in &keys {
            if e.is_local_endpoint(k) {
                e.add_endpoint(k);
            }
        }
        e.sort_endpoints();
        e
    }

    /// Adds a translated policy to the object store and the use counts (no identities, no
    /// selectors).
    pub(crate) fn insert_policy_record(&mut self, p: Arc<Policy>) {
        for c in p.cidrs() {
            *self.cidr_use.entry(c).or_default() += 1;
        }
        for n in p.named_ports(Direction::Egress) {
            *self.named_use.entry(n).or_default() += 1;
        }
        match &p.id.namespace {
            Some(ns) => {
                self.ns_policies
                    .entry(ns.clone())
                    .or_default()
                    .insert(p.id.clone());
            }
            None => {
                self.cluster_policies.insert(p.id.clone());
            }
        }
        self.policies.insert(p.id.clone(), p);
    }

    /// Removes a policy from the object store and the use counts.
    pub(crate) fn remove_policy_record(&mut self, id: &PolicyRef) -> Option<Arc<Policy>> {
        let p = self.policies.remove(id)?;
        for c in p.cidrs() {
            if let Some(n) = self.cidr_use.get_mut(&c) {
                *n -= 1;
                if *n == 0 {
                    self.cidr_use.remove(&c);
                }
            }
        }
        for np in p.named_ports(Direction::Egress) {
            if let Some(n) = self.named_use.get_mut(&np) {
                *n -= 1;
                if *n == 0 {
                    self.named_use.remove(&np);
                }
            }
        }
        match &p.id.namespace {
            Some(ns) => {
                if let Some(s) = self.ns_policies.get_mut(ns) {
                    s.remove(id);
                    if s.is_empty() {
                        self.ns_policies.remove(ns);
                    }
                }
            }
            None => {
                self.cluster_policies.remove(id);
            }
        }
        Some(p)
    }

    /// The labels of namespace `name` (only the name label if it is not known).
    pub(crate) fn ns_labels(&self, name: &str) -> Arc<Labels> {
        match self.namespaces.get(name) {
            Some(l) => l.clone(),
            None => Arc::new(Labels::from([(
                NAMESPACE_NAME_LABEL.to_string(),
                name.to_string(),
            )])),
        }
    }

    /// The signatures of a pod's addresses under the current CIDRs and named ports in use.
    pub(crate) fn pod_signatures(&self, k: &PodKey) -> Vec<Signature> {
        let Some(rec) = self.pods.get(k) else {
            return Vec::new();
        };
        if !rec.addressed() {
            return Vec::new();
        }
        let ns = self.ns_labels(&k.0);
        rec.ips
            .iter()
            .map(|ip| {
                Signature::Pod(Arc::new(pod_signature(
                    &ns,
                    &rec.labels,
                    &rec.ports,
                    *ip,
                    &self.cidr_use,
                    &self.named_use,
                )))
            })
            .collect()
    }

    /// Acquires the identities of a pod's addresses (one reference per address).
    pub(crate) fn pod_identities(&mut self, k: &PodKey) -> Vec<(Identity, bool)> {
        let sigs = self.pod_signatures(k);
        let member = pod_key_text(k);
        sigs.into_iter()
            .map(|s| self.ids.acquire(s, &member))
            .collect()
    }

    /// All identities `spec` selects now.
    pub(crate) fn evaluate_selector(&self, spec: &PeerSpec) -> BTreeSet<Identity> {
        let mut out = BTreeSet::new();
        let mut test = |id: &Identity| {
            if let Some(sig) = self.ids.sig(*id)
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
                for id in self.ids.by_namespace.get(n).into_iter().flatten() {
                    test(id);
                }
            }
            PeerSpec::Pods { namespaces, .. } => {
                for (ns, ids) in &self.ids.by_namespace {
                    // Every pod identity of one namespace carries that namespace's labels.
                    let labels = ids
                        .iter()
                        .next()
                        .and_then(|id| match self.ids.sig(*id) {
                            Some(Signature::Pod(p)) => Some(p.namespace_labels.clone()),
                            _ => None,
                        })
                        .unwrap_or_else(|| self.ns_labels(ns));
                    if namespaces.matches(&labels) {
                        for id in ids {
                            test(id);
                        }
                    }
                }
            }
            PeerSpec::Block { .. } => {
                for id in self.ids.non_pod.iter().chain(self.ids.pods_in_cidrs.iter()) {
                    test(id);
                }
            }
        }
        out
    }

    /// Registers `user` as a user of `spec`, evaluating the selector if it is new. Returns
    /// whether it was new.
    pub(crate) fn add_selector_user(&mut self, spec: Arc<PeerSpec>, user: PolicyRef) -> bool {
        if let Some(s) = self.selectors.get_mut(&spec) {
            s.users.insert(user);
            return false;
        }
        let ids = self.evaluate_selector(&spec);
        self.next_sel += 1;
        self.selectors.insert(
            spec,
            SelState {
                id: self.next_sel,
                ids,
                users: BTreeSet::from([user]),
            },
        );
        true
    }

    /// Drops `user` from `spec`; the selector goes when it has no users left.
    pub(crate) fn remove_selector_user(&mut self, spec: &Arc<PeerSpec>, user: &PolicyRef) {
        if let Some(s) = self.selectors.get_mut(spec) {
            s.users.remove(user);
            if s.users.is_empty() {
                self.selectors.remove(spec);
            }
        }
    }

    /// Whether pod `k` is an endpoint of this engine (has identities, and is on the node).
    pub(crate) fn is_local_endpoint(&self, k: &PodKey) -> bool {
        let Some(rec) = self.pods.get(k) else {
            return false;
        };
        rec.addressed()
            && !rec.ids.is_empty()
            && match &self.options.node {
                None => true,
                Some(n) => rec.node.as_deref() == Some(n.as_str()),
            }
    }

    /// The policies whose subject selects pod `k`, sorted.
    pub(crate) fn selecting_policies(&self, k: &PodKey) -> Vec<PolicyRef> {
        let Some(rec) = self.pods.get(k) else {
            return Vec::new();
        };
        let ns_labels = self.ns_labels(&k.0);
        let mut out: Vec<PolicyRef> = self
            .ns_policies
            .get(&k.0)
            .into_iter()
            .flatten()
            .chain(self.cluster_policies.iter())
            .filter(|id| {
                self.policies
                    .get(*id)
                    .is_some_and(|p| p.subject.selects(&k.0, &ns_labels, &rec.labels))
            })
            .cloned()
            .collect();
        out.sort();
        out
    }

    /// The share keys of endpoint `k` for both directions.
    pub(crate) fn share_keys(&self, k: &PodKey) -> [Arc<ShareKey>; 2] {
        let policies = self.selecting_policies(k);
        let ports: &[NamedPort] = self.pods.get(k).map_or(&[], |r| r.ports.as_slice());
        let mut names: Vec<(String, Protocol)> = policies
            .iter()
            .filter_map(|id| self.policies.get(id))
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
            Arc::new(ShareKey {
                dir: Direction::Ingress,
                policies: policies.clone(),
                own_ports,
            }),
            Arc::new(ShareKey {
                dir: Direction::Egress,
                policies,
                own_ports: Vec::new(),
            }),
        ]
    }

    pub(crate) fn entry_id(&mut self, key: &EntryKey) -> EntryId {
        if let Some(id) = self.entry_ids.get(key) {
            return *id;
        }
        self.next_entry += 1;
        let id = EntryId(self.next_entry);
        self.entry_ids.insert(key.clone(), id);
        id
    }

    /// The identities of `spec` (empty if it is not cached, which does not happen for the
    /// peers of stored policies).
    pub(crate) fn selected(&self, spec: &PeerSpec) -> BTreeSet<Identity> {
        self.selectors
            .get(spec)
            .map(|s| s.ids.clone())
            .unwrap_or_default()
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
        let di = dir_index(key.dir);
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
                        Some(p) => Selector::Ids(e.selected(p)),
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
                                    .map(|s| (s.id, s.ids.iter().copied().collect::<Vec<_>>()))
                                    .unwrap_or_default();
                                index.named.push(NamedGroup {
                                    origin: rule.origin.clone(),
                                    order: rule.order,
                                    verdict: rule.verdict,
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
                                        Selector::Ids(group),
                                    ));
                                }
                            }
                        },
                    }
                    for (ek, selector) in made {
                        let id = self.entry_id(&ek);
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
                            verdict: rule.verdict,
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
        let di = dir_index(key.dir);
        let by: Vec<Arc<Origin>> = key
            .policies
            .iter()
            .filter_map(|id| self.policies.get(id))
            .filter(|p| p.isolates[di])
            .map(|p| p.isolation_origin[di].clone())
            .collect();
        (!by.is_empty(), by)
    }

    /// Computes a shared MapState from scratch.
    pub(crate) fn compile(&mut self, key: &ShareKey) -> Shared {
        let mut entries = BTreeMap::new();
        let mut notify = BTreeMap::new();
        for id in &key.policies {
            if let Some(p) = self.policies.get(id).cloned() {
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
        let mut keys = HashMap::with_capacity(entries.len());
        let mut list = Vec::with_capacity(entries.len());
        for (id, (ek, e)) in entries {
            keys.insert(id, ek);
            list.push(e);
        }
        // Entry ids are unique by construction, so build cannot fail.
        let mapstate = MapState::build(key.dir, default, list)
            .unwrap_or_else(|_| MapState::new(key.dir, default));
        Shared {
            policy: EndpointPolicy {
                mapstate,
                isolated,
                isolated_by,
            },
            users: BTreeSet::new(),
            entries: keys,
            notify,
        }
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
        self.insert_shared(key.clone(), s);
        true
    }

    /// Stores a shared computation and indexes it by policy.
    pub(crate) fn insert_shared(&mut self, key: Arc<ShareKey>, s: Shared) {
        for p in &key.policies {
            self.policy_shared
                .entry(p.clone())
                .or_default()
                .insert(key.clone());
        }
        self.shared.insert(key, s);
    }

    /// Removes a shared computation (whatever its users) and its index entries.
    pub(crate) fn remove_shared(&mut self, key: &Arc<ShareKey>) -> Option<Shared> {
        let s = self.shared.remove(key)?;
        for p in &key.policies {
            if let Some(set) = self.policy_shared.get_mut(p) {
                set.remove(key);
                if set.is_empty() {
                    self.policy_shared.remove(p);
                }
            }
        }
        Some(s)
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
        if let Some(s) = self.remove_shared(key) {
            drop_later(s);
        }
    }

    /// Adds the endpoint record of pod `k` and compiles its MapStates.
    pub(crate) fn add_endpoint(&mut self, k: &PodKey) {
        let Some(rec) = self.pods.get(k) else {
            return;
        };
        let ep = Endpoint {
            namespace: k.0.clone(),
            name: k.1.clone(),
            ips: rec.ips.clone(),
            node: rec.node.clone(),
            identities: rec.ids.clone(),
        };
        self.endpoints.push(ep);
        let keys = self.share_keys(k);
        self.attach(k, keys);
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

    // ----- Query API -----

    /// Local endpoints sorted by (namespace, name).
    pub fn endpoints(&self) -> &[Endpoint] {
        &self.endpoints
    }

    /// One endpoint.
    pub fn endpoint(&self, namespace: &str, name: &str) -> Option<&Endpoint> {
        self.ep_index
            .get(&(namespace.to_string(), name.to_string()))
            .map(|&i| &self.endpoints[i])
    }

    /// The MapState and isolation of one endpoint and direction. An endpoint that is not of
    /// this engine gets an empty, non-isolated policy.
    pub fn policy(&self, ep: &Endpoint, dir: Direction) -> &EndpointPolicy {
        self.policy_of(&ep.namespace, &ep.name, dir)
            .unwrap_or_else(|| empty_policy(dir))
    }

    /// The MapState and isolation of endpoint `namespace/name`, if it is one.
    pub fn policy_of(
        &self,
        namespace: &str,
        name: &str,
        dir: Direction,
    ) -> Option<&EndpointPolicy> {
        let keys = self
            .ep_keys
            .get(&(namespace.to_string(), name.to_string()))?;
        self.shared.get(&keys[dir_index(dir)]).map(|s| &s.policy)
    }

    /// ipcache: the identity of an address (pods' own addresses first, then the longest CIDR
    /// prefix in use, else world).
    pub fn identity_of(&self, ip: IpAddr) -> Identity {
        if let Some(k) = self.pod_addrs.get(&ip)
            && let Some(rec) = self.pods.get(k)
            && let Some(pos) = rec.signed_ips.iter().position(|a| *a == ip)
            && let Some(id) = rec.ids.get(pos)
        {
            return *id;
        }
        longest_prefix(ip, &self.cidr_ids).map_or(self.world, |(_, id)| id)
    }

    /// What an identity stands for.
    pub fn identity_info(&self, id: Identity) -> Option<&IdentityInfo> {
        self.ids.info(id)
    }

    /// The signature of an identity.
    pub fn identity_signature(&self, id: Identity) -> Option<&Signature> {
        self.ids.sig(id)
    }

    /// Every identity, sorted.
    pub fn identities(&self) -> impl Iterator<Item = &IdentityInfo> {
        self.ids.recs.values().map(|r| &r.info)
    }

    /// The `world` identity (addresses that no CIDR in use covers).
    pub fn world_identity(&self) -> Identity {
        self.world
    }

    /// The ipcache as a list: every pod address (as a /32 or /128) and every CIDR prefix in use,
    /// with its identity, sorted. Addresses outside all of them are `world`.
    pub fn ipcache(&self) -> Vec<(IpNet, Identity)> {
        let mut out: BTreeMap<IpNet, Identity> =
            self.cidr_ids.iter().map(|(n, id)| (*n, *id)).collect();
        // A pod's own address wins over an equal CIDR prefix.
        for (ip, k) in &self.pod_addrs {
            if let Some(rec) = self.pods.get(k)
                && let Some(pos) = rec.signed_ips.iter().position(|a| a == ip)
                && let Some(id) = rec.ids.get(pos)
            {
                out.insert(IpNet::from(*ip), *id);
            }
        }
        out.into_iter().collect()
    }

    /// The objects left out because they are invalid.
    pub fn errors(&self) -> &[EngineError] {
        &self.errors
    }

    /// The rules enforced fail-closed instead of as written, per policy (policies in key
    /// order, rules in order).
    pub fn failed_rules(&self) -> impl Iterator<Item = (&PolicyRef, &crate::model::FailedRule)> {
        self.policies
            .values()
            .flat_map(|p| p.failed_rules.iter().map(move |r| (&p.id, r)))
    }

    /// The normalized policies, by reference.
    pub fn policies(&self) -> impl Iterator<Item = &Policy> {
        self.policies.values().map(|p| &**p)
    }

    /// Number of distinct MapState computations (endpoints with equal inputs share one).
    pub fn shared_mapstates(&self) -> usize {
        self.shared.len()
    }

    /// Number of entries in the selector cache.
    pub fn selector_count(&self) -> usize {
        self.selectors.len()
    }

    /// The identities a peer currently selects (if some policy uses it).
    pub fn selector_identities(&self, spec: &PeerSpec) -> Option<&BTreeSet<Identity>> {
        self.selectors.get(spec).map(|s| &s.ids)
    }

    /// `"namespace/pod"` or an IP address -> a flow end.
    pub fn resolve(&self, s: &str) -> Result<FlowEnd, String> {
        let s = s.trim();
        if let Ok(ip) = s.parse::<IpAddr>() {
            return Ok(FlowEnd::Ip(ip));
        }
        let Some((ns, name)) = s.split_once('/') else {
            return Err(format!("{s:?} is neither an IP address nor namespace/pod"));
        };
        let k = (ns.to_string(), name.to_string());
        match self.pods.get(&k) {
            None => Err(format!("no pod {ns}/{name}")),
            Some(rec) if rec.host_network => Err(format!(
                "pod {ns}/{name} uses the host network: it is not an endpoint"
            )),
            Some(rec) if rec.terminal => Err(format!(
                "pod {ns}/{name} has terminated (Succeeded or Failed): it is not an endpoint"
            )),
            Some(rec) if rec.ips.is_empty() => Err(format!("pod {ns}/{name} has no address")),
            Some(_) => Ok(FlowEnd::Pod {
                namespace: ns.to_string(),
                name: name.to_string(),
            }),
        }
    }

    /// (address, owning pod) of a flow end; an address owned by a pod is that pod.
    fn flow_point(
        &self,
        end: &FlowEnd,
        family: IpFamily,
    ) -> Result<(IpAddr, Option<PodKey>), String> {
        match end {
            FlowEnd::Ip(ip) => Ok((*ip, self.pod_addrs.get(ip).cloned())),
            FlowEnd::Pod { namespace, name } => {
                let k = (namespace.clone(), name.clone());
                let rec =
                    self.pods.get(&k).filter(|r| r.addressed()).ok_or_else(|| {
                        format!("{namespace}/{name} is not a pod with an address")
                    })?;
                let ip = rec
                    .ips
                    .iter()
                    .copied()
                    .find(|ip| family.contains(*ip))
                    .or_else(|| rec.ips.first().copied())
                    .ok_or_else(|| format!("{namespace}/{name} has no address"))?;
                Ok((ip, Some(k)))
            }
        }
    }

    fn side(
        &self,
        ep: &PodKey,
        dir: Direction,
        peer: String,
        peer_address: IpAddr,
        proto: Protocol,
        port: u16,
    ) -> Option<SideTrace> {
        let policy = self.policy_of(&ep.0, &ep.1, dir)?;
        let peer_identity = self.identity_of(peer_address);
        let d = policy
            .mapstate
            .lookup(Some(peer_identity), proto.number(), port);
        let (verdict, decision) = match d {
            Decision::Matched { key, entry } => (
                entry.verdict,
                SideDecision::Matched {
                    key,
                    entry: entry.clone(),
                },
            ),
            Decision::Default(v) => (
                v,
                SideDecision::Default {
                    isolated: policy.isolated,
                    isolated_by: policy.isolated_by.clone(),
                },
            ),
        };
        Some(SideTrace {
            endpoint: pod_key_text(ep),
            direction: dir,
            peer,
            peer_address,
            peer_identity,
            verdict,
            decision,
        })
    }

    /// The verdict of one flow, computed only through `MapState::lookup` on both sides: the
    /// egress MapState of the source (when it is a pod) and the ingress MapState of the
    /// destination (when it is a pod). A pod to itself is always allowed.
    pub fn flow(
        &self,
        from: &FlowEnd,
        to: &FlowEnd,
        family: IpFamily,
        proto: Protocol,
        port: u16,
    ) -> FlowTrace {
        let failed = |e: String| FlowTrace {
            verdict: Verdict::Deny,
            exemption: None,
            egress: None,
            ingress: None,
            error: Some(e),
        };
        let (src_ip, src_pod) = match self.flow_point(from, family) {
            Ok(x) => x,
            Err(e) => return failed(e),
        };
        let (dst_ip, dst_pod) = match self.flow_point(to, family) {
            Ok(x) => x,
            Err(e) => return failed(e),
        };
        if src_pod.is_some() && src_pod == dst_pod {
            return FlowTrace {
                verdict: Verdict::Allow,
                exemption: Some("a pod talking to itself is always allowed".into()),
                egress: None,
                ingress: None,
                error: None,
            };
        }
        let name = |ip: IpAddr, pod: &Option<PodKey>| match pod {
            Some(k) => pod_key_text(k),
            None => ip.to_string(),
        };
        let egress = src_pod.as_ref().and_then(|k| {
            self.side(
                k,
                Direction::Egress,
                name(dst_ip, &dst_pod),
                dst_ip,
                proto,
                port,
            )
        });
        let ingress = dst_pod.as_ref().and_then(|k| {
            self.side(
                k,
                Direction::Ingress,
                name(src_ip, &src_pod),
                src_ip,
                proto,
                port,
            )
        });
        let allowed = egress.as_ref().is_none_or(|s| s.verdict == Verdict::Allow)
            && ingress.as_ref().is_none_or(|s| s.verdict == Verdict::Allow);
        FlowTrace {
            verdict: if allowed {
                Verdict::Allow
            } else {
                Verdict::Deny
            },
            exemption: None,
            egress,
            ingress,
            error: None,
        }
    }
}

fn empty_policy(dir: Direction) -> &'static EndpointPolicy {
    use std::sync::OnceLock;
    static EMPTY: OnceLock<[EndpointPolicy; 2]> = OnceLock::new();
    let e = EMPTY.get_or_init(|| {
        DIRECTIONS.map(|d| EndpointPolicy {
            mapstate: MapState::new(d, Verdict::Allow),
            isolated: false,
            isolated_by: Vec::new(),
        })
    });
    &e[dir_index(dir)]
}
