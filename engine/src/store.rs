//! The object store: what the engine keeps of each object (pods, namespaces, Services,
//! translated policies), indexed the way the later stages read it, and the use counts of the
//! CIDR prefixes and egress named ports the policies mention (they shape the identities).

use std::collections::{BTreeMap, BTreeSet};

use crate::fast::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use ordnet_mapstate::{Direction, Identity, Protocol};

use crate::identity::NamedPort;
use crate::model::{EngineError, Labels, Policy, PolicyRef, parse_protocol};
use crate::services::{ServiceKey, ServiceRec};
use ordnet_crds::NAMESPACE_NAME_LABEL;

/// `namespace/name` of a pod.
pub type PodKey = (String, String);

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

/// The objects, as the engine reads them.
#[derive(Debug, Clone, Default)]
pub(crate) struct Store {
    pub namespaces: BTreeMap<String, Arc<Labels>>,
    pub pods: BTreeMap<PodKey, PodRec>,
    pub policies: BTreeMap<PolicyRef, Arc<Policy>>,
    pub services: BTreeMap<ServiceKey, Arc<ServiceRec>>,
    /// Namespaced policies by namespace.
    pub ns_policies: HashMap<String, BTreeSet<PolicyRef>>,
    pub cluster_policies: BTreeSet<PolicyRef>,
    /// CIDR prefixes in use (ipBlock cidr and except), with reference counts.
    pub cidr_use: BTreeMap<IpNet, u32>,
    /// (name, protocol) of named ports used by egress rules, with reference counts.
    pub named_use: BTreeMap<(String, Protocol), u32>,
    /// Nodes: labels and addresses (host prefixes), for the `nodes` peers.
    pub nodes: BTreeMap<String, (Labels, Vec<IpNet>)>,
    /// The ClusterNetworkPolicy objects, translated again when a Node changes (their `nodes`
    /// peers are resolved at translation).
    pub cnp_objects: BTreeMap<String, Arc<ordnet_crds::ClusterNetworkPolicy>>,
    /// The distinct label sets of the pods, each kept once: the replicas of a workload carry
    /// equal labels (and their identity's signature shares them too). Sets no pod uses any more
    /// are dropped when the table has doubled since the last sweep.
    label_sets: HashSet<Arc<Labels>>,
    label_sets_swept_at: usize,
}

impl Store {
    /// The addresses of the Nodes `sel` selects.
    pub(crate) fn node_addrs(&self, sel: &ordnet_crds::Selector) -> Vec<IpNet> {
        self.nodes
            .values()
            .filter(|(labels, _)| sel.matches(labels))
            .flat_map(|(_, addrs)| addrs.iter().copied())
            .collect()
    }

    /// A ClusterNetworkPolicy translated against the Nodes held.
    pub(crate) fn translate_cnp(
        &self,
        cnp: &ordnet_crds::ClusterNetworkPolicy,
    ) -> Result<Policy, crate::model::EngineError> {
        crate::model::translate_cluster_network_policy(cnp, &|sel| self.node_addrs(sel))
    }

    /// Stores a pod, its labels shared with the pods that have equal ones.
    pub(crate) fn insert_pod(&mut self, key: PodKey, mut rec: PodRec) {
        match self.label_sets.get(&*rec.labels) {
            Some(shared) => rec.labels = Arc::clone(shared),
            None => {
                if self.label_sets.len() >= 2 * self.label_sets_swept_at.max(64) {
                    self.label_sets.retain(|l| Arc::strong_count(l) > 1);
                    self.label_sets_swept_at = self.label_sets.len();
                }
                self.label_sets.insert(Arc::clone(&rec.labels));
            }
        }
        self.pods.insert(key, rec);
    }

    /// Adds a translated policy to the object store and the use counts (no identities, no
    /// selectors).
    pub(crate) fn insert_policy(&mut self, p: Arc<Policy>) {
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
    pub(crate) fn remove_policy(&mut self, id: &PolicyRef) -> Option<Arc<Policy>> {
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

    /// The policies whose subject selects pod `k`, sorted.
    pub(crate) fn selecting_policies(&self, k: &PodKey) -> Vec<PolicyRef> {
        let Some(rec) = self.pods.get(k) else {
            return Vec::new();
        };
        let mut out: Vec<PolicyRef> = self
            .selecting(&k.0, &rec.labels)
            .map(|(id, _)| id.clone())
            .collect();
        out.sort();
        out
    }

    /// The policies whose subject selects a pod of namespace `ns` with labels `labels`, in no
    /// particular order.
    pub(crate) fn selecting<'a>(
        &'a self,
        ns: &'a str,
        labels: &'a Labels,
    ) -> impl Iterator<Item = (&'a PolicyRef, &'a Arc<Policy>)> + 'a {
        let ns_labels = self.ns_labels(ns);
        self.ns_policies
            .get(ns)
            .into_iter()
            .flatten()
            .chain(self.cluster_policies.iter())
            .filter_map(move |id| {
                let p = self.policies.get(id)?;
                p.subject.selects(ns, &ns_labels, labels).then_some((id, p))
            })
    }
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
        .unwrap_or_else(|| ordnet_crds::DEFAULT_NAMESPACE.to_string());
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
