//! The Kubernetes objects the engine consumes, their kinds, and a change of one of them. Adding
//! a kind touches this file (and the engine stage that reads it) only: the agent watches
//! [`ObjectKind::ALL`] and names objects through these methods.

use k8s_openapi::api::core::v1::{Namespace, Node, Pod, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use ordnet_crds::{ClusterNetworkPolicy, ClusterOrderedNetworkPolicy, OrderedNetworkPolicy};
use serde::Serialize;
use std::net::IpAddr;

use crate::model::{
    EngineError, Policy, translate_cluster_network_policy, translate_cluster_policy,
    translate_network_policy, translate_ordered_policy,
};
use crate::store::{PodKey, PodRec, read_pod};

/// A Kubernetes object the engine consumes.
///
/// A `Pod` and a `Service` are boxed: a `Pod` is 2.4 KiB inline (a `Container` 2.3 KiB more),
/// and every object waiting in a queue or a map would take that much.
#[derive(Debug, Clone)]
pub enum Object {
    /// `v1` `Namespace`: its labels.
    Namespace(Namespace),
    /// `v1` `Pod`: labels, addresses, container ports, node, host network, phase.
    Pod(Box<Pod>),
    /// A `v1` `Pod` already read ([`Object::slimmed`]): what the engine and the validation
    /// take from it, without the object.
    ReadPod(Box<ReadPod>),
    /// `v1` `Service`: frontends, NodePorts, and the selector that picks its backends.
    Service(Box<Service>),
    /// `networking.k8s.io/v1` `NetworkPolicy`.
    NetworkPolicy(NetworkPolicy),
    /// `ordnet.io/v1alpha1` `OrderedNetworkPolicy`.
    OrderedNetworkPolicy(OrderedNetworkPolicy),
    /// `ordnet.io/v1alpha1` `ClusterOrderedNetworkPolicy`.
    ClusterOrderedNetworkPolicy(ClusterOrderedNetworkPolicy),
    /// `policy.networking.k8s.io/v1beta1` `ClusterNetworkPolicy` (upstream).
    ClusterNetworkPolicy(Box<ClusterNetworkPolicy>),
    /// `v1` `Node`: its labels and addresses (the `nodes` peers of ClusterNetworkPolicies).
    Node(Box<Node>),
}

/// The metadata the engine, the validation and the status writer read: name, namespace,
/// labels, uid, resourceVersion, generation. (Not annotations: `kubectl apply` keeps a whole
/// copy of the object in one; not managedFields: often larger than the object.)
fn slim_meta(m: ObjectMeta) -> ObjectMeta {
    ObjectMeta {
        name: m.name,
        namespace: m.namespace,
        labels: m.labels,
        uid: m.uid,
        resource_version: m.resource_version,
        generation: m.generation,
        ..ObjectMeta::default()
    }
}

/// A pod as read once: its metadata (as [`Object::slimmed`] keeps it), its validation errors,
/// and what the engine reads of it. About 1 KiB where a slimmed `Pod` object is 5 KiB and more
/// (its `Container`s are 2.3 KiB each inline): what an agent holds per pod between the watch
/// event and the engine (at 50,000 pods, the whole initial list).
#[derive(Debug, Clone)]
pub struct ReadPod {
    meta: ObjectMeta,
    errors: Vec<String>,
    read: Result<(PodKey, PodRec), EngineError>,
}

impl ReadPod {
    /// Reads `pod`: validation ([`ordnet_crds::validate::validate_pod`], errors only) and the
    /// engine's reading.
    pub fn of(pod: Pod) -> ReadPod {
        let errors = ordnet_crds::validate::validate_pod(&pod)
            .iter()
            .filter(|e| e.severity == ordnet_crds::Severity::Error)
            .map(|e| e.to_string())
            .collect();
        let read = read_pod(&pod);
        ReadPod {
            meta: slim_meta(pod.metadata),
            errors,
            read,
        }
    }

    /// The pod's validation errors (as `FieldError` texts).
    pub fn errors(&self) -> &[String] {
        &self.errors
    }

    /// What the engine reads of the pod, or why it cannot.
    pub(crate) fn into_read(self) -> Result<(PodKey, PodRec), EngineError> {
        self.read
    }

    /// `namespace/name`, the node the pod is scheduled to, its addresses and whether it has
    /// terminated; `None` when the engine cannot read the pod.
    pub fn placement(&self) -> Option<(&PodKey, Option<&str>, &[IpAddr], bool)> {
        let (key, rec) = self.read.as_ref().ok()?;
        Some((key, rec.node.as_deref(), &rec.ips, rec.terminal))
    }

    /// The same pod with `ips` as its addresses: for the time between the container runtime
    /// giving them (the CNI plugin's ADD on the pod's node) and the API server reporting them,
    /// so the pod is an endpoint with its own policy from its first packet. A pod the engine
    /// cannot read stays as it is.
    pub fn with_runtime_ips(&self, ips: &[IpAddr]) -> ReadPod {
        let mut out = self.clone();
        if let Ok((_, rec)) = out.read.as_mut() {
            rec.ips = ips.to_vec();
        }
        out
    }
}

impl Object {
    /// The object reduced to what the engine, the validation and the status writer read, so
    /// that what a watcher keeps until the engine has it is small: a pod read once
    /// ([`ReadPod`]: a real pod object is 4-10 KiB of JSON, mostly managedFields, volumes and
    /// container details); for every kind, no annotations and no managedFields. Verdicts are
    /// unchanged: nothing dropped is read.
    pub fn slimmed(self) -> Object {
        match self {
            Object::Pod(p) => Object::ReadPod(Box::new(ReadPod::of(*p))),
            Object::ReadPod(r) => Object::ReadPod(r),
            Object::Namespace(mut x) => {
                x.metadata = slim_meta(x.metadata);
                x.spec = None;
                x.status = None;
                Object::Namespace(x)
            }
            Object::Service(mut x) => {
                x.metadata = slim_meta(std::mem::take(&mut x.metadata));
                x.status = None;
                Object::Service(x)
            }
            Object::NetworkPolicy(mut x) => {
                x.metadata = slim_meta(x.metadata);
                Object::NetworkPolicy(x)
            }
            // The status stays: the status writer compares with it.
            Object::OrderedNetworkPolicy(mut x) => {
                x.metadata = slim_meta(x.metadata);
                Object::OrderedNetworkPolicy(x)
            }
            // The status stays: the status writer compares with it.
            Object::ClusterOrderedNetworkPolicy(mut x) => {
                x.metadata = slim_meta(x.metadata);
                Object::ClusterOrderedNetworkPolicy(x)
            }
            // The status stays: the status writer compares with it.
            Object::ClusterNetworkPolicy(mut x) => {
                x.metadata = slim_meta(std::mem::take(&mut x.metadata));
                Object::ClusterNetworkPolicy(x)
            }
            // Labels and addresses only.
            Object::Node(x) => {
                let addresses = x.status.and_then(|s| s.addresses);
                Object::Node(Box::new(Node {
                    metadata: slim_meta(x.metadata),
                    spec: None,
                    status: Some(k8s_openapi::api::core::v1::NodeStatus {
                        addresses,
                        ..Default::default()
                    }),
                }))
            }
        }
    }

    /// The object's kind.
    pub fn kind(&self) -> ObjectKind {
        match self {
            Object::Namespace(_) => ObjectKind::Namespace,
            Object::Pod(_) | Object::ReadPod(_) => ObjectKind::Pod,
            Object::Service(_) => ObjectKind::Service,
            Object::NetworkPolicy(_) => ObjectKind::NetworkPolicy,
            Object::OrderedNetworkPolicy(_) => ObjectKind::OrderedNetworkPolicy,
            Object::ClusterOrderedNetworkPolicy(_) => ObjectKind::ClusterOrderedNetworkPolicy,
            Object::ClusterNetworkPolicy(_) => ObjectKind::ClusterNetworkPolicy,
            Object::Node(_) => ObjectKind::Node,
        }
    }

    /// The object's metadata.
    pub fn meta(&self) -> &ObjectMeta {
        match self {
            Object::Namespace(x) => &x.metadata,
            Object::Pod(x) => &x.metadata,
            Object::ReadPod(x) => &x.meta,
            Object::Service(x) => &x.metadata,
            Object::NetworkPolicy(x) => &x.metadata,
            Object::OrderedNetworkPolicy(x) => &x.metadata,
            Object::ClusterOrderedNetworkPolicy(x) => &x.metadata,
            Object::ClusterNetworkPolicy(x) => &x.metadata,
            Object::Node(x) => &x.metadata,
        }
    }

    /// Whether the object is an ordered policy with `spec.mode: Staged` (it decides nothing).
    pub fn staged(&self) -> bool {
        match self {
            Object::OrderedNetworkPolicy(p) => !p.spec.mode.is_enforce(),
            Object::ClusterOrderedNetworkPolicy(p) => !p.spec.mode.is_enforce(),
            _ => false,
        }
    }

    /// `(namespace, name)`: the namespace is empty for cluster-scoped kinds and `default` when
    /// a namespaced object has none.
    pub fn key(&self) -> (String, String) {
        let meta = self.meta();
        let ns = if self.kind().namespaced() {
            meta.namespace
                .clone()
                .unwrap_or_else(|| ordnet_crds::DEFAULT_NAMESPACE.to_string())
        } else {
            String::new()
        };
        (ns, meta.name.clone().unwrap_or_default())
    }

    /// The normalized policy of a policy object (`None` for pods, namespaces, Services and
    /// Nodes): `Err` when the engine cannot use the object at all (it is left out); otherwise
    /// the policy, whose [`Policy::failed_rules`] lists the rules enforced fail-closed instead
    /// of as written. A ClusterNetworkPolicy's `nodes` peers are resolved to no address here
    /// (what the status reports does not depend on them); the engine resolves them against
    /// the Nodes it holds ([`Object::translate_with`]).
    pub fn translate(&self) -> Option<Result<Policy, EngineError>> {
        self.translate_with(&|_| Vec::new())
    }

    /// [`Object::translate`] with `nodes` giving the addresses of the Nodes a selector selects.
    pub fn translate_with(
        &self,
        nodes: &dyn Fn(&ordnet_crds::Selector) -> Vec<ipnet::IpNet>,
    ) -> Option<Result<Policy, EngineError>> {
        Some(match self {
            Object::NetworkPolicy(np) => translate_network_policy(np),
            Object::OrderedNetworkPolicy(onp) => translate_ordered_policy(onp),
            Object::ClusterOrderedNetworkPolicy(conp) => translate_cluster_policy(conp),
            Object::ClusterNetworkPolicy(cnp) => translate_cluster_network_policy(cnp, nodes),
            Object::Namespace(_)
            | Object::Pod(_)
            | Object::ReadPod(_)
            | Object::Service(_)
            | Object::Node(_) => {
                return None;
            }
        })
    }
}

/// The kind of an object, for deletions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum ObjectKind {
    /// [`Object::Namespace`].
    Namespace,
    /// [`Object::Pod`].
    Pod,
    /// [`Object::Service`].
    Service,
    /// [`Object::NetworkPolicy`].
    NetworkPolicy,
    /// [`Object::OrderedNetworkPolicy`].
    OrderedNetworkPolicy,
    /// [`Object::ClusterOrderedNetworkPolicy`].
    ClusterOrderedNetworkPolicy,
    /// [`Object::ClusterNetworkPolicy`].
    ClusterNetworkPolicy,
    /// [`Object::Node`].
    Node,
}

impl ObjectKind {
    /// Every kind the engine consumes, in the order it prefers to see them (namespaces and pods
    /// before the policies that select them).
    pub const ALL: [ObjectKind; 8] = [
        ObjectKind::Namespace,
        ObjectKind::Pod,
        ObjectKind::Service,
        ObjectKind::NetworkPolicy,
        ObjectKind::OrderedNetworkPolicy,
        ObjectKind::ClusterOrderedNetworkPolicy,
        ObjectKind::ClusterNetworkPolicy,
        ObjectKind::Node,
    ];

    /// The position in [`ObjectKind::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// The kind called `name` ([`ObjectKind::name`]), if there is one.
    pub fn named(name: &str) -> Option<ObjectKind> {
        ObjectKind::ALL.into_iter().find(|k| k.name() == name)
    }

    /// The name as Kubernetes spells it.
    pub fn name(self) -> &'static str {
        use ordnet_crds as m;
        match self {
            ObjectKind::Namespace => m::KIND_NAMESPACE,
            ObjectKind::Pod => m::KIND_POD,
            ObjectKind::Service => m::KIND_SERVICE,
            ObjectKind::NetworkPolicy => m::KIND_NETWORK_POLICY,
            ObjectKind::OrderedNetworkPolicy => m::KIND_ORDERED,
            ObjectKind::ClusterOrderedNetworkPolicy => m::KIND_CLUSTER_ORDERED,
            ObjectKind::ClusterNetworkPolicy => m::KIND_CLUSTER_NETWORK_POLICY,
            ObjectKind::Node => m::KIND_NODE,
        }
    }

    /// Whether the kind may be missing from a cluster (its CRD is not ordnet's and may not be
    /// installed): the upstream ClusterNetworkPolicy.
    pub fn optional(self) -> bool {
        self == ObjectKind::ClusterNetworkPolicy
    }

    /// Whether objects of the kind live in a namespace.
    pub fn namespaced(self) -> bool {
        !matches!(
            self,
            ObjectKind::Namespace
                | ObjectKind::ClusterOrderedNetworkPolicy
                | ObjectKind::ClusterNetworkPolicy
                | ObjectKind::Node
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
        /// The deleted object's kind.
        kind: ObjectKind,
        /// Its namespace.
        namespace: Option<String>,
        /// Its name.
        name: String,
    },
}
