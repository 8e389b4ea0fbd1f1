//! The upstream `ClusterNetworkPolicy` of SIG-Network's network-policy-api
//! (`policy.networking.k8s.io`), with exactly upstream's fields: `v1beta1` (the storage version)
//! and `v1alpha2`, which differ only in their version name, so one Rust type reads both.
//!
//! The meaning (SEMANTICS.md §8, `docs/api.md` "ClusterNetworkPolicy"): Admin-tier rules come
//! before every ordnet rule, Baseline-tier rules after the isolation default; `Accept`, `Deny`,
//! `Pass`; rules never isolate. The engine translates it (`ordnet_engine`), validation checks
//! what the upstream CRD checks ([`crate::validate`]).

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// API group of `ClusterNetworkPolicy`.
pub const CNP_GROUP: &str = "policy.networking.k8s.io";
/// The version ordnet reads and writes (upstream's storage version).
pub const CNP_VERSION: &str = "v1beta1";
/// Every `apiVersion` a `ClusterNetworkPolicy` may have (same schema).
pub const CNP_API_VERSIONS: [&str; 2] = [
    "policy.networking.k8s.io/v1beta1",
    "policy.networking.k8s.io/v1alpha2",
];
/// The kind name.
pub const KIND_CLUSTER_NETWORK_POLICY: &str = "ClusterNetworkPolicy";
/// `api-approved.kubernetes.io` of the upstream CRD: a CRD of a `*.k8s.io` group needs the
/// approval of its API review; the printed CRD cites upstream's, since it is upstream's API.
pub const CNP_API_APPROVED: &str = "https://github.com/kubernetes-sigs/network-policy-api/pull/347";
/// Upstream's bundle version the printed CRD is equivalent to.
pub const CNP_BUNDLE_VERSION: &str = "v0.2.0";
/// Most rules per direction (upstream `maxItems`).
pub const CNP_MAX_RULES: usize = 25;
/// Most peers, protocols, networks or domain names per list (upstream `maxItems`).
pub const CNP_MAX_ITEMS: usize = 25;

/// The status condition ordnet writes on a ClusterNetworkPolicy (besides the `Accepted` and
/// `RulesShadowed` conditions of every policy kind): whether every rule is enforced as written.
/// `False` with reason [`REASON_UNSUPPORTED_PEER`] names the `domainNames` rules enforced
/// fail-closed.
pub const CONDITION_FULLY_ENFORCED: &str = "FullyEnforced";
/// Reason of `FullyEnforced=True`.
pub const REASON_ENFORCED: &str = "Enforced";
/// Reason of `FullyEnforced=False`: a peer ordnet cannot enforce (`domainNames`, or a peer with
/// no field it knows); the rule is enforced fail-closed.
pub const REASON_UNSUPPORTED_PEER: &str = "UnsupportedPeer";

/// The tier of a ClusterNetworkPolicy.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
pub enum CnpTier {
    /// Before every NetworkPolicy and ordnet rule.
    Admin,
    /// After the NetworkPolicy tier's isolation default.
    Baseline,
}

impl CnpTier {
    /// The API name.
    pub fn as_str(self) -> &'static str {
        match self {
            CnpTier::Admin => "Admin",
            CnpTier::Baseline => "Baseline",
        }
    }
}

/// What a ClusterNetworkPolicy rule does with the traffic it matches.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
pub enum CnpAction {
    /// Allow (final for this direction).
    Accept,
    /// Drop (final).
    Deny,
    /// Skip the weaker rules of this tier; the next tier decides.
    Pass,
}

impl CnpAction {
    /// The API name.
    pub fn as_str(self) -> &'static str {
        match self {
            CnpAction::Accept => "Accept",
            CnpAction::Deny => "Deny",
            CnpAction::Pass => "Pass",
        }
    }
}

/// `ClusterNetworkPolicy` spec (`policy.networking.k8s.io/v1beta1`).
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "policy.networking.k8s.io",
    version = "v1beta1",
    kind = "ClusterNetworkPolicy",
    plural = "clusternetworkpolicies",
    shortname = "cnp",
    status = "ClusterNetworkPolicyStatus",
    derive = "PartialEq",
    printcolumn = r#"{"name":"Tier","type":"string","jsonPath":".spec.tier"}"#,
    printcolumn = r#"{"name":"Priority","type":"string","jsonPath":".spec.priority"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct ClusterNetworkPolicySpec {
    /// `Admin` or `Baseline`.
    pub tier: CnpTier,
    /// 0-1000; lower is evaluated first within the tier.
    #[schemars(range(min = 0, max = 1000))]
    pub priority: i32,
    /// The pods the policy applies to.
    pub subject: CnpSubject,
    /// Ingress rules, in order (the first decides).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("maxItems" = CNP_MAX_RULES))]
    pub ingress: Vec<CnpIngressRule>,
    /// Egress rules, in order (the first decides).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("maxItems" = CNP_MAX_RULES))]
    pub egress: Vec<CnpEgressRule>,
}

/// Status: conditions (`Accepted`, `FullyEnforced`, `RulesShadowed`), written by the ordnet agent
/// holding the status Lease.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClusterNetworkPolicyStatus {
    /// The conditions, one per type.
    #[serde(default)]
    pub conditions: Vec<Condition>,
}

/// Exactly one of `namespaces` (every pod of the selected namespaces) or `pods`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("minProperties" = 1, "maxProperties" = 1))]
pub struct CnpSubject {
    /// Every pod in the namespaces with these labels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespaces: Option<LabelSelector>,
    /// The pods with these labels in the namespaces with those.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pods: Option<NamespacedPod>,
}

/// Pods by their labels and their namespace's labels.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NamespacedPod {
    /// Namespaces (`{}` or absent = every namespace).
    #[serde(default)]
    pub namespace_selector: LabelSelector,
    /// Pods (`{}` = every pod).
    pub pod_selector: LabelSelector,
}

/// One ingress rule.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CnpIngressRule {
    /// An optional name (for people and for `ordnet trace`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 100))]
    pub name: Option<String>,
    /// `Accept`, `Deny` or `Pass`.
    pub action: CnpAction,
    /// The sources (any of them).
    #[schemars(length(min = 1, max = 25))]
    pub from: Vec<CnpIngressPeer>,
    /// The protocols and ports (absent = all traffic).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 25))]
    pub protocols: Option<Vec<CnpProtocol>>,
}

/// One egress rule.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend(
    "x-kubernetes-validations" = [{
        "rule": "!(self.to.exists(peer, has(peer.networks) || has(peer.nodes) || has(peer.domainNames)) && has(self.protocols) && self.protocols.exists(protocol, has(protocol.destinationNamedPort)))",
        "message": "networks/nodes/domainNames peer cannot be set with namedPorts since there are no namedPorts for networks/nodes/domainNames"
    }]
))]
pub struct CnpEgressRule {
    /// An optional name (for people and for `ordnet trace`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 100))]
    pub name: Option<String>,
    /// `Accept`, `Deny` or `Pass`.
    pub action: CnpAction,
    /// The destinations (any of them).
    #[schemars(length(min = 1, max = 25))]
    pub to: Vec<CnpEgressPeer>,
    /// The protocols and ports (absent = all traffic).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 25))]
    pub protocols: Option<Vec<CnpProtocol>>,
}

/// An ingress peer: exactly one field. Fields ordnet does not know are kept in `other` so that
/// a peer of a newer API version is enforced fail-closed instead of as "everything".
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("minProperties" = 1, "maxProperties" = 1))]
pub struct CnpIngressPeer {
    /// Every pod in the namespaces with these labels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespaces: Option<LabelSelector>,
    /// The pods with these labels in the namespaces with those.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pods: Option<NamespacedPod>,
    /// Fields of a newer API version.
    #[serde(flatten, default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(skip)]
    pub other: BTreeMap<String, serde_json::Value>,
}

/// An egress peer: exactly one field.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("minProperties" = 1, "maxProperties" = 1))]
pub struct CnpEgressPeer {
    /// Every pod in the namespaces with these labels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespaces: Option<LabelSelector>,
    /// The pods with these labels in the namespaces with those.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pods: Option<NamespacedPod>,
    /// The addresses (`status.addresses`) of the Nodes with these labels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nodes: Option<LabelSelector>,
    /// CIDRs; they match pod addresses too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend(
        "minItems" = 1,
        "maxItems" = CNP_MAX_ITEMS,
        "x-kubernetes-list-type" = "set",
        "items" = {
            "type": "string",
            "maxLength": 43,
            "x-kubernetes-validations": [{
                "rule": "isCIDR(self) && cidr(self) == cidr(self).masked()",
                "message": "Invalid CIDR format provided"
            }]
        }
    ))]
    pub networks: Option<Vec<String>>,
    /// Domain names: not supported by ordnet; a rule with them is enforced fail-closed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend(
        "minItems" = 1,
        "maxItems" = CNP_MAX_ITEMS,
        "x-kubernetes-list-type" = "set",
        "items" = {
            "type": "string",
            "pattern": "^(\\*\\.)?([a-zA-Z0-9]([-a-zA-Z0-9_]*[a-zA-Z0-9])?\\.)+[a-zA-Z0-9]([-a-zA-Z0-9_]*[a-zA-Z0-9])?\\.?$"
        }
    ))]
    pub domain_names: Option<Vec<String>>,
    /// Fields of a newer API version.
    #[serde(flatten, default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(skip)]
    pub other: BTreeMap<String, serde_json::Value>,
}

/// A protocol and port match: exactly one field.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("minProperties" = 1, "maxProperties" = 1))]
pub struct CnpProtocol {
    /// TCP to a destination port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp: Option<CnpPorts>,
    /// UDP to a destination port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub udp: Option<CnpPorts>,
    /// SCTP to a destination port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sctp: Option<CnpPorts>,
    /// The destination pod's container port with this name (and its protocol).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub destination_named_port: Option<String>,
    /// Fields of a newer API version.
    #[serde(flatten, default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(skip)]
    pub other: BTreeMap<String, serde_json::Value>,
}

/// The destination port of one protocol.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("minProperties" = 1))]
pub struct CnpPorts {
    /// A port number or range.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub destination_port: Option<CnpPort>,
}

/// A port number or an inclusive range: exactly one field.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("minProperties" = 1, "maxProperties" = 1))]
pub struct CnpPort {
    /// One port (1-65535).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub number: Option<i32>,
    /// An inclusive range, `start < end`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub range: Option<CnpPortRange>,
}

/// An inclusive port range.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend(
    "x-kubernetes-validations" = [{"rule": "self.start < self.end", "message": "Start port must be less than End port"}]
))]
pub struct CnpPortRange {
    /// First port (1-65535).
    #[schemars(range(min = 1, max = 65535))]
    pub start: i32,
    /// Last port (1-65535), greater than `start`.
    #[schemars(range(min = 1, max = 65535))]
    pub end: i32,
}

/// One rule of either direction, as the engine and validation read them.
#[derive(Clone, Debug)]
pub struct CnpRule<'a> {
    /// Position in `spec.ingress` / `spec.egress`.
    pub index: usize,
    /// `name`.
    pub name: Option<&'a str>,
    /// `action`.
    pub action: CnpAction,
    /// `from` / `to`, as egress peers (an ingress peer has a subset of the fields).
    pub peers: Vec<CnpEgressPeer>,
    /// `protocols` (`None` = all traffic).
    pub protocols: Option<&'a [CnpProtocol]>,
}

impl ClusterNetworkPolicySpec {
    /// The rules of one direction, in order.
    pub fn rules(&self, d: crate::Direction) -> Vec<CnpRule<'_>> {
        match d {
            crate::Direction::Ingress => self
                .ingress
                .iter()
                .enumerate()
                .map(|(index, r)| CnpRule {
                    index,
                    name: r.name.as_deref(),
                    action: r.action,
                    peers: r
                        .from
                        .iter()
                        .map(|p| CnpEgressPeer {
                            namespaces: p.namespaces.clone(),
                            pods: p.pods.clone(),
                            other: p.other.clone(),
                            ..Default::default()
                        })
                        .collect(),
                    protocols: r.protocols.as_deref(),
                })
                .collect(),
            crate::Direction::Egress => self
                .egress
                .iter()
                .enumerate()
                .map(|(index, r)| CnpRule {
                    index,
                    name: r.name.as_deref(),
                    action: r.action,
                    peers: r.to.clone(),
                    protocols: r.protocols.as_deref(),
                })
                .collect(),
        }
    }
}
