//! The `ordnet.io/v1alpha1` API types: `OrderedNetworkPolicy` (namespaced, `onp`) and
//! `ClusterOrderedNetworkPolicy` (cluster-scoped, `conp`).
//!
//! The semantics are those of `shared/spec/SEMANTICS.md`; the field reference is `docs/api.md`.
//! The JSON schema generated from these types (see [`crate::crd`]) rejects what a structural
//! schema can express; everything else is checked by [`crate::validate`].

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Deserializer, Serialize};

/// API group of the ordnet kinds.
pub const GROUP: &str = "ordnet.io";
/// API version of the ordnet kinds.
pub const VERSION: &str = "v1alpha1";
/// `apiVersion` of the ordnet kinds.
pub const API_VERSION: &str = "ordnet.io/v1alpha1";

// The list bounds keep every CEL rule of the CRD inside the API server's cost budget with room to
// spare: the API server multiplies a rule's estimated cost by the `maxItems` of every list around
// it and refuses the CRD above 10,000,000 for one rule or 100,000,000 in all; we keep every rule
// at or below a quarter of that (`crds/tests/api_server.rs`, docs/api.md "CEL cost budget").
// The costliest rule is the ipBlock `except` check (rules x peers x except entries). More rules
// than fit go into a second policy at the next priority, more peers or ports into consecutive
// rules with the same action: neither changes what an ordered policy means.

/// Most rules per direction of one ordered policy (schema `maxItems`).
pub const MAX_RULES: usize = 128;
/// Most peers (`from`/`to`) per rule (schema `maxItems`).
pub const MAX_PEERS: usize = 16;
/// Most ports per rule (schema `maxItems`).
pub const MAX_PORTS: usize = 16;
/// Most `except` entries per ipBlock (schema `maxItems`).
pub const MAX_EXCEPT: usize = 8;
/// Most `matchLabels` entries per label selector (schema `maxProperties`).
pub const MAX_MATCH_LABELS: usize = 16;
/// Most `matchExpressions` per label selector (schema `maxItems`).
pub const MAX_MATCH_EXPRESSIONS: usize = 8;
/// Most `values` per selector requirement (schema `maxItems`).
pub const MAX_SELECTOR_VALUES: usize = 64;
/// Longest CIDR text (schema `maxLength`): the longest valid spelling is an IPv6 address with an
/// embedded dotted quad (45 characters) and `/128`.
pub const MAX_CIDR_LENGTH: usize = 49;
/// The message of the `isCIDR` rules.
const CIDR_MESSAGE: &str = "must be a CIDR: address/prefix-length such as 10.0.0.0/8 or 2001:db8::/32 (a single address is 10.1.2.3/32); IPv4 octets with leading zeros, IPv4-mapped IPv6 addresses and zones are not allowed";
/// A named port (IANA_SVC_NAME) as a schema pattern: lowercase letters, digits and single `-`
/// between them, at least one letter (with `maxLength: 15`; `syntax::port_name`).
pub const PORT_NAME_PATTERN: &str = "^([0-9]+-)*[0-9]*[a-z][a-z0-9]*(-[a-z0-9]+)*$";

/// The type of the status condition that says whether the agent accepted the policy
/// (`True`) or rejected it as invalid (`False`, reason [`REASON_INVALID`]).
pub const CONDITION_ACCEPTED: &str = "Accepted";
/// Reason of an `Accepted=True` condition.
pub const REASON_VALID: &str = "Valid";
/// Reason of an `Accepted=False` condition: the object cannot be used at all (e.g. its subject
/// selector is invalid) and is not enforced; the message lists the problems (field path and
/// message each).
pub const REASON_INVALID: &str = "Invalid";
/// Reason of an `Accepted=True` condition of a valid staged policy (`spec.mode: Staged`): it
/// decides no packet.
pub const REASON_STAGED: &str = "Staged";
/// Reason of an `Accepted=False` condition: the policy is enforced, but some of its rules cannot
/// be enforced as written and are enforced fail-closed (listed in `status.failedClosedRules`:
/// an `Allow` rule matches nothing, a `Deny` rule denies everything in its direction).
pub const REASON_RULES_FAILED_CLOSED: &str = "RulesFailedClosed";
/// Reason of the Warning Event published for a policy with rules enforced fail-closed.
pub const EVENT_RULES_FAILED_CLOSED: &str = "RulesFailedClosed";
/// The type of the status condition that says whether some rules of the policy are shadowed:
/// `True` (reason [`REASON_SHADOWED`], listed in `status.shadowedRules`) or `False` (reason
/// [`REASON_NOT_SHADOWED`]). Only on valid policies.
pub const CONDITION_RULES_SHADOWED: &str = "RulesShadowed";
/// Reason of a `RulesShadowed=True` condition: stronger rules take all the traffic of some rules.
pub const REASON_SHADOWED: &str = "Shadowed";
/// Reason of a `RulesShadowed=False` condition.
pub const REASON_NOT_SHADOWED: &str = "NotShadowed";
/// Reason of the Warning Event the status writer publishes on a policy with shadowed rules.
pub const EVENT_RULE_SHADOWED: &str = "RuleShadowed";

/// Deserializes `null` as the type's default (Kubernetes treats an explicit `null` like an
/// absent field).
fn null_as_default<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(deserializer)?.unwrap_or_default())
}

/// What a matching rule does with the packet.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
pub enum Action {
    /// Allow the packet.
    Allow,
    /// Drop the packet.
    Deny,
}

impl Action {
    /// The name used in the API (`Allow` or `Deny`).
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Allow => "Allow",
            Action::Deny => "Deny",
        }
    }
}

impl std::fmt::Display for Action {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Whether an ordered policy decides packets or is only staged (`spec.mode`).
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    JsonSchema,
)]
pub enum PolicyMode {
    /// The policy decides packets.
    #[default]
    Enforce,
    /// The policy decides nothing; what it would change is reported.
    Staged,
}

impl PolicyMode {
    /// Whether this is `Enforce`.
    pub fn is_enforce(&self) -> bool {
        *self == PolicyMode::Enforce
    }
}

/// Traffic direction, seen from the selected pod.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
pub enum Direction {
    /// Into the selected pod.
    Ingress,
    /// Out of the selected pod.
    Egress,
}

impl Direction {
    /// The name used in the API (`Ingress` or `Egress`).
    pub fn as_str(self) -> &'static str {
        match self {
            Direction::Ingress => "Ingress",
            Direction::Egress => "Egress",
        }
    }

    /// The spec field that holds this direction's rules (`ingress` or `egress`).
    pub fn field(self) -> &'static str {
        match self {
            Direction::Ingress => "ingress",
            Direction::Egress => "egress",
        }
    }
}

impl std::fmt::Display for Direction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// IP protocol of a port match.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    JsonSchema,
)]
pub enum Protocol {
    /// TCP (the default).
    #[default]
    #[serde(rename = "TCP")]
    Tcp,
    /// UDP.
    #[serde(rename = "UDP")]
    Udp,
    /// SCTP (never treated as TCP).
    #[serde(rename = "SCTP")]
    Sctp,
}

impl Protocol {
    /// The name used in the API (`TCP`, `UDP`, `SCTP`).
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
            Protocol::Sctp => "SCTP",
        }
    }

    /// The IANA protocol number (6, 17, 132).
    pub fn number(self) -> u8 {
        match self {
            Protocol::Tcp => 6,
            Protocol::Udp => 17,
            Protocol::Sctp => 132,
        }
    }

    /// Parses the exact API spelling (`TCP`, `UDP`, `SCTP`; case-sensitive, as upstream).
    /// This is how a standard `NetworkPolicyPort.protocol` string is interpreted.
    pub fn from_api(s: &str) -> Option<Protocol> {
        match s {
            "TCP" => Some(Protocol::Tcp),
            "UDP" => Some(Protocol::Udp),
            "SCTP" => Some(Protocol::Sctp),
            _ => None,
        }
    }
}

impl std::fmt::Display for Protocol {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Optional explicit isolation per direction (SEMANTICS.md §3). When a direction is absent, the
/// policy isolates the selected pods in that direction iff it has at least one `Allow` rule there.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DefaultDeny {
    /// Isolate the selected pods for ingress (`true`), or never (`false`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ingress: Option<bool>,
    /// Isolate the selected pods for egress (`true`), or never (`false`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress: Option<bool>,
}

/// An IP block, as `NetworkPolicy`'s `IPBlock`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend(
    "x-kubernetes-validations" = [
        {
            "rule": "!has(self.except) || !isCIDR(self.cidr) || self.except.all(e, !isCIDR(e) || (cidr(e).prefixLength() > cidr(self.cidr).prefixLength() && cidr(self.cidr).containsIP(cidr(e).ip())))",
            "message": "each except entry must be a strict subset of cidr: the same IP family, a longer prefix, inside cidr",
            "fieldPath": ".except"
        }
    ]
))]
pub struct IpBlock {
    /// A CIDR such as `10.0.0.0/8` or `2001:db8::/32`. Matches by IP address, pod IPs included.
    #[schemars(extend(
        "maxLength" = MAX_CIDR_LENGTH,
        "x-kubernetes-validations" = [{"rule": "isCIDR(self)", "message": CIDR_MESSAGE}]
    ))]
    pub cidr: String,
    /// CIDRs excluded from `cidr`; each must be a strict subset of `cidr` of the same IP family.
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "null_as_default"
    )]
    #[schemars(extend(
        "maxItems" = MAX_EXCEPT,
        "items" = {
            "type": "string",
            "maxLength": MAX_CIDR_LENGTH,
            "x-kubernetes-validations": [{"rule": "isCIDR(self)", "message": CIDR_MESSAGE}]
        }
    ))]
    pub except: Vec<String>,
}

/// A traffic peer with `NetworkPolicyPeer`'s meaning: `podSelector` and `namespaceSelector` in
/// one peer are ANDed; `ipBlock` stands alone. At least one field must be set.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend(
    "x-kubernetes-validations" = [
        {
            "rule": "has(self.podSelector) || has(self.namespaceSelector) || has(self.ipBlock)",
            "message": "an empty peer matches nothing useful: set podSelector, namespaceSelector or ipBlock (to match every peer, leave out the whole from/to list)"
        },
        {
            "rule": "!has(self.ipBlock) || (!has(self.podSelector) && !has(self.namespaceSelector))",
            "message": "ipBlock may not be combined with podSelector or namespaceSelector in one peer (use two peers to match either)"
        }
    ]
))]
pub struct Peer {
    /// Pods with these labels. Without `namespaceSelector`: in the policy's own namespace
    /// (OrderedNetworkPolicy) or in any namespace (ClusterOrderedNetworkPolicy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_selector: Option<LabelSelector>,
    /// Pods in the namespaces with these labels (`{}` = every namespace, no external addresses).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace_selector: Option<LabelSelector>,
    /// Addresses in this block (pods included).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip_block: Option<IpBlock>,
}

/// A port match with `NetworkPolicyPort`'s meaning.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend(
    "x-kubernetes-validations" = [
        {
            "rule": "!has(self.port) || type(self.port) == string || (self.port >= 1 && self.port <= 65535)",
            "message": "a numeric port must be between 1 and 65535",
            "fieldPath": ".port"
        },
        {
            "rule": "!has(self.endPort) || (has(self.port) && type(self.port) == int)",
            "message": "endPort requires a numeric port (a range needs a numeric port; not allowed with a named port or without port)",
            "fieldPath": ".endPort"
        },
        {
            "rule": "!has(self.endPort) || !has(self.port) || type(self.port) != int || self.endPort >= self.port",
            "message": "endPort must be greater than or equal to port",
            "fieldPath": ".endPort"
        }
    ]
))]
pub struct Port {
    /// `TCP` (default), `UDP` or `SCTP`.
    #[serde(default, deserialize_with = "null_as_default")]
    pub protocol: Protocol,
    /// A port number (1-65535) or a named container port (IANA_SVC_NAME). Absent = every port of
    /// the protocol.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("maxLength" = 15, "pattern" = PORT_NAME_PATTERN))]
    pub port: Option<IntOrString>,
    /// With a numeric `port`: the last port of the inclusive range `port..=endPort`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub end_port: Option<i32>,
}

/// An ordered ingress rule.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct IngressRule {
    /// `Allow` or `Deny`.
    pub action: Action,
    /// Sources; omitted or empty = every source.
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "null_as_default"
    )]
    #[schemars(extend("maxItems" = MAX_PEERS))]
    pub from: Vec<Peer>,
    /// Destination ports on the selected pod; omitted or empty = every protocol and port.
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "null_as_default"
    )]
    #[schemars(extend("maxItems" = MAX_PORTS))]
    pub ports: Vec<Port>,
}

/// An ordered egress rule.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EgressRule {
    /// `Allow` or `Deny`.
    pub action: Action,
    /// Destinations; omitted or empty = every destination.
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "null_as_default"
    )]
    #[schemars(extend("maxItems" = MAX_PEERS))]
    pub to: Vec<Peer>,
    /// Destination ports; omitted or empty = every protocol and port.
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "null_as_default"
    )]
    #[schemars(extend("maxItems" = MAX_PORTS))]
    pub ports: Vec<Port>,
}

/// A direction-independent view of one ordered rule.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RuleView<'a> {
    /// The rule's direction.
    pub direction: Direction,
    /// The rule's position in its list (the `index` of the order key).
    pub index: usize,
    /// `Allow` or `Deny`.
    pub action: Action,
    /// `from` (ingress) or `to` (egress).
    pub peers: &'a [Peer],
    /// The rule's ports.
    pub ports: &'a [Port],
}

/// The desired state of an OrderedNetworkPolicy (namespaced; priority >= 0).
// The printer columns repeat `type_ = "string"`, which clippy mistakes for duplicated attributes.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "ordnet.io",
    version = "v1alpha1",
    kind = "OrderedNetworkPolicy",
    doc = "An ordered network policy for the pods of one namespace: Allow and Deny rules evaluated by (priority, rule index), lowest first.",
    plural = "orderednetworkpolicies",
    shortname = "onp",
    category = "ordnet",
    namespaced,
    status = "PolicyStatus",
    derive = "PartialEq",
    printcolumn(
        name = "Priority",
        type_ = "integer",
        json_path = ".spec.priority",
        description = "Lower is evaluated earlier"
    ),
    printcolumn(
        name = "Mode",
        type_ = "string",
        json_path = ".spec.mode",
        description = "Enforce, or Staged (decides no packet)"
    ),
    printcolumn(
        name = "Subject",
        type_ = "string",
        json_path = ".status.subject",
        description = "How many pods the policy applies to now"
    ),
    printcolumn(
        name = "Rules",
        type_ = "string",
        json_path = ".status.rules",
        description = "Rule counts per direction and action"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    ),
    printcolumn(
        name = "Status",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Accepted\")].status",
        description = "Whether the agent accepted the policy"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct OrderedNetworkPolicySpec {
    /// Lower = evaluated earlier = stronger. Must be >= 0 for a namespaced policy.
    #[schemars(range(min = 0, max = 2147483647))]
    pub priority: i32,
    /// `Enforce` (the default): the policy decides packets. `Staged`: it never changes what a
    /// packet does; the agent reports what it would change (docs/api.md "Staged policies").
    /// Changing it to `Enforce` applies the same rules like any other change of a policy.
    #[serde(default)]
    pub mode: PolicyMode,
    /// The pods of the policy's namespace it applies to (`{}` = all of them).
    pub pod_selector: LabelSelector,
    /// Explicit isolation per direction.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_deny: Option<DefaultDeny>,
    /// Ordered ingress rules; an earlier rule wins at the same priority.
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "null_as_default"
    )]
    #[schemars(extend("maxItems" = MAX_RULES))]
    pub ingress: Vec<IngressRule>,
    /// Ordered egress rules; an earlier rule wins at the same priority.
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "null_as_default"
    )]
    #[schemars(extend("maxItems" = MAX_RULES))]
    pub egress: Vec<EgressRule>,
}

/// The desired state of a ClusterOrderedNetworkPolicy (cluster-scoped; priority may be negative).
// The printer columns repeat `type_ = "string"`, which clippy mistakes for duplicated attributes.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "ordnet.io",
    version = "v1alpha1",
    kind = "ClusterOrderedNetworkPolicy",
    doc = "A cluster-wide ordered network policy: Allow and Deny rules evaluated by (priority, rule index), lowest first; a negative priority beats every namespaced policy.",
    plural = "clusterorderednetworkpolicies",
    shortname = "conp",
    category = "ordnet",
    status = "PolicyStatus",
    derive = "PartialEq",
    printcolumn(
        name = "Priority",
        type_ = "integer",
        json_path = ".spec.priority",
        description = "Lower is evaluated earlier"
    ),
    printcolumn(
        name = "Mode",
        type_ = "string",
        json_path = ".spec.mode",
        description = "Enforce, or Staged (decides no packet)"
    ),
    printcolumn(
        name = "Subject",
        type_ = "string",
        json_path = ".status.subject",
        description = "How many pods the policy applies to now"
    ),
    printcolumn(
        name = "Rules",
        type_ = "string",
        json_path = ".status.rules",
        description = "Rule counts per direction and action"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    ),
    printcolumn(
        name = "Status",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Accepted\")].status",
        description = "Whether the agent accepted the policy"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct ClusterOrderedNetworkPolicySpec {
    /// Lower = evaluated earlier = stronger. May be negative (below every namespaced policy).
    #[schemars(range(min = -2147483648, max = 2147483647))]
    pub priority: i32,
    /// `Enforce` (the default): the policy decides packets. `Staged`: it never changes what a
    /// packet does; the agent reports what it would change (docs/api.md "Staged policies").
    /// Changing it to `Enforce` applies the same rules like any other change of a policy.
    #[serde(default)]
    pub mode: PolicyMode,
    /// The namespaces whose pods the policy applies to (default `{}` = all namespaces).
    #[serde(default, deserialize_with = "null_as_default")]
    pub namespace_selector: LabelSelector,
    /// The pods (in the selected namespaces) the policy applies to (default `{}` = all pods).
    #[serde(default, deserialize_with = "null_as_default")]
    pub pod_selector: LabelSelector,
    /// Explicit isolation per direction.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_deny: Option<DefaultDeny>,
    /// Ordered ingress rules; an earlier rule wins at the same priority.
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "null_as_default"
    )]
    #[schemars(extend("maxItems" = MAX_RULES))]
    pub ingress: Vec<IngressRule>,
    /// Ordered egress rules; an earlier rule wins at the same priority.
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "null_as_default"
    )]
    #[schemars(extend("maxItems" = MAX_RULES))]
    pub egress: Vec<EgressRule>,
}

/// Rule accessors shared by both ordered kinds.
pub trait OrderedSpec {
    /// The policy's priority.
    fn priority(&self) -> i32;
    /// The explicit isolation settings, if any.
    fn default_deny(&self) -> Option<&DefaultDeny>;
    /// The ingress rules in order.
    fn ingress(&self) -> &[IngressRule];
    /// The egress rules in order.
    fn egress(&self) -> &[EgressRule];
    /// `spec.mode`.
    fn mode(&self) -> PolicyMode;

    /// The rules of one direction, in order, as direction-independent views.
    fn rules(&self, direction: Direction) -> Vec<RuleView<'_>> {
        match direction {
            Direction::Ingress => self
                .ingress()
                .iter()
                .enumerate()
                .map(|(index, r)| RuleView {
                    direction,
                    index,
                    action: r.action,
                    peers: &r.from,
                    ports: &r.ports,
                })
                .collect(),
            Direction::Egress => self
                .egress()
                .iter()
                .enumerate()
                .map(|(index, r)| RuleView {
                    direction,
                    index,
                    action: r.action,
                    peers: &r.to,
                    ports: &r.ports,
                })
                .collect(),
        }
    }

    /// Whether the policy isolates its subject pods in `direction` (SEMANTICS.md §3):
    /// `defaultDeny.<direction>` when set, else whether the direction has an `Allow` rule.
    fn isolates(&self, direction: Direction) -> bool {
        let explicit = self.default_deny().and_then(|d| match direction {
            Direction::Ingress => d.ingress,
            Direction::Egress => d.egress,
        });
        explicit.unwrap_or_else(|| {
            self.rules(direction)
                .iter()
                .any(|r| r.action == Action::Allow)
        })
    }
}

impl OrderedSpec for OrderedNetworkPolicySpec {
    fn priority(&self) -> i32 {
        self.priority
    }
    fn default_deny(&self) -> Option<&DefaultDeny> {
        self.default_deny.as_ref()
    }
    fn ingress(&self) -> &[IngressRule] {
        &self.ingress
    }
    fn egress(&self) -> &[EgressRule] {
        &self.egress
    }
    fn mode(&self) -> PolicyMode {
        self.mode
    }
}

impl OrderedSpec for ClusterOrderedNetworkPolicySpec {
    fn priority(&self) -> i32 {
        self.priority
    }
    fn default_deny(&self) -> Option<&DefaultDeny> {
        self.default_deny.as_ref()
    }
    fn ingress(&self) -> &[IngressRule] {
        &self.ingress
    }
    fn egress(&self) -> &[EgressRule] {
        &self.egress
    }
    fn mode(&self) -> PolicyMode {
        self.mode
    }
}

/// Status of both ordered kinds, written by the agent.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PolicyStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Standard conditions; `Accepted` says whether the policy is valid and enforced.
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "null_as_default"
    )]
    #[schemars(extend(
        "x-kubernetes-list-type" = "map",
        "x-kubernetes-list-map-keys" = ["type"]
    ))]
    pub conditions: Vec<Condition>,
    /// How many pods the policy applies to across the cluster now, e.g. `12 pods`, `40 pods in
    /// 3 namespaces`; `not enforced` when invalid (printer column `Subject`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subject: Option<String>,
    /// Rule counts, e.g. `in 2A/1D, out 0A/1D` (printer column `Rules`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rules: Option<String>,
    /// Rules that can never decide a packet because stronger rules take every packet they
    /// match, for every pod the policy selects.
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "null_as_default"
    )]
    pub shadowed_rules: Vec<ShadowedRule>,
    /// Rules that cannot be enforced as written (a field the agent cannot use, stored because
    /// the CRD in the cluster did not refuse it) and are enforced fail-closed instead.
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "null_as_default"
    )]
    pub failed_closed_rules: Vec<FailedClosedRule>,
    /// What the nodes' datapaths decided by this policy's rules: new flows allowed, flows and
    /// packets denied, in each node's last window, summed over the nodes that report (the
    /// kernel's per-rule counters). `nodes: 0` while no node reports (none counts per rule);
    /// absent when the agents do not report (`ordnet agent --traffic-window 0`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traffic: Option<PolicyTraffic>,
    /// A staged policy: the flows it would have changed (new flows and denials the nodes saw,
    /// judged again with the staged policies enforced), in each node's last window, summed over
    /// the nodes that report, and the last few of them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub staged: Option<StagedTraffic>,
}

/// What a staged policy would have changed (`status.staged`, docs/observe.md §10).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StagedTraffic {
    /// How many nodes' reports are summed.
    #[schemars(extend("format" = "int32", "maximum" = 2147483647))]
    pub nodes: u32,
    /// The length of each node's window, in seconds.
    #[schemars(extend("format" = "int32", "maximum" = 2147483647))]
    pub window_seconds: u32,
    /// Per rule (or the isolation the policy adds) that would have decided a flow differently
    /// in the last window on some node: how many flows it would have denied and allowed.
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "null_as_default"
    )]
    #[schemars(extend("maxItems" = 2 * MAX_RULES + 2))]
    pub rules: Vec<StagedRuleTraffic>,
    /// The last flows it would have changed (a few per node), e.g.
    /// `allowed qa/web -> prod/db TCP/5432: would be denied`.
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "null_as_default"
    )]
    #[schemars(extend("maxItems" = MAX_STAGED_EXAMPLES))]
    pub examples: Vec<String>,
}

/// Most examples in `status.staged.examples`.
pub const MAX_STAGED_EXAMPLES: usize = 10;

/// The flows one rule of a staged policy would have changed in the last window.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StagedRuleTraffic {
    /// The direction.
    pub direction: Direction,
    /// The rule's index in `spec.ingress` or `spec.egress`; absent: the isolation the policy
    /// adds (the default would deny).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("format" = "int32", "maximum" = 2147483647))]
    pub index: Option<u32>,
    /// Flows it would have denied (allowed now).
    #[schemars(extend("format" = "int64", "minimum" = 0))]
    pub flows_would_deny: i64,
    /// Flows it would have allowed (denied now).
    #[schemars(extend("format" = "int64", "minimum" = 0))]
    pub flows_would_allow: i64,
}

/// What the datapath decided by one policy's rules, summed over the nodes (`status.traffic`,
/// docs/observe.md §9).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PolicyTraffic {
    /// How many nodes' reports are summed.
    #[schemars(extend("format" = "int32", "maximum" = 2147483647))]
    pub nodes: u32,
    /// The length of each node's window, in seconds (the nodes' windows are not aligned).
    #[schemars(extend("format" = "int32", "maximum" = 2147483647))]
    pub window_seconds: u32,
    /// The rules that decided a flow or a denied packet in the last window on some node, with
    /// what they decided then (summed over the nodes).
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "null_as_default"
    )]
    #[schemars(extend("maxItems" = 2 * MAX_RULES))]
    pub rules: Vec<RuleTraffic>,
    /// The rules that decided nothing on any reporting node since that node began counting
    /// (the agent's start), as `ingress[2]`, `egress[0]`. They complement `shadowedRules` (never
    /// able to decide) with what traffic did.
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "null_as_default"
    )]
    #[schemars(extend("maxItems" = 2 * MAX_RULES))]
    pub unmatched_rules: Vec<String>,
}

/// What one rule decided in the last window, summed over the nodes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RuleTraffic {
    /// The rule's direction.
    pub direction: Direction,
    /// The rule's index in `spec.ingress` or `spec.egress`.
    #[schemars(extend("format" = "int32", "maximum" = 2147483647))]
    pub index: u32,
    /// New flows the rule allowed.
    #[schemars(extend("format" = "int64", "minimum" = 0))]
    pub flows_allowed: i64,
    /// Flows the rule denied (their first denied packets).
    #[schemars(extend("format" = "int64", "minimum" = 0))]
    pub flows_denied: i64,
    /// Packets the rule denied.
    #[schemars(extend("format" = "int64", "minimum" = 0))]
    pub packets_denied: i64,
}

/// A rule of this policy that is enforced fail-closed instead of as written.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FailedClosedRule {
    /// The rule's direction.
    pub direction: Direction,
    /// The rule's index in `spec.ingress` or `spec.egress`.
    #[schemars(extend("format" = "int32", "maximum" = 2147483647))]
    pub index: u32,
    /// The rule's action as written.
    pub action: Action,
    /// What the rule does instead: `MatchesNothing` (an `Allow` rule) or `DeniesAll` (a `Deny`
    /// rule: everything the subject sends or receives in this direction that no stronger rule
    /// decides).
    pub effect: FailClosedEffect,
    /// The field that cannot be enforced and why.
    pub message: String,
}

/// What a rule enforced fail-closed does.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
pub enum FailClosedEffect {
    /// An `Allow` rule that cannot be enforced matches no packet.
    MatchesNothing,
    /// A `Deny` rule that cannot be enforced matches every packet of its direction.
    DeniesAll,
}

/// A rule of this policy that can never decide a packet (it is shadowed).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ShadowedRule {
    /// The rule's direction.
    pub direction: Direction,
    /// The rule's index in `spec.ingress` or `spec.egress`.
    #[schemars(extend("format" = "int32", "maximum" = 2147483647))]
    pub index: u32,
    /// The stronger rules (of any policy) that decide the packets this rule matches.
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "null_as_default"
    )]
    pub shadowed_by: Vec<RuleReference>,
    /// Human-readable explanation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// A reference to one rule of one policy (same direction as the referring entry).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RuleReference {
    /// `NetworkPolicy`, `OrderedNetworkPolicy` or `ClusterOrderedNetworkPolicy`.
    pub kind: String,
    /// The policy's namespace (absent for cluster-scoped policies).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// The policy's name.
    pub name: String,
    /// The rule's index in its list.
    #[schemars(extend("format" = "int32", "maximum" = 2147483647))]
    pub index: u32,
    /// The policy's priority.
    #[schemars(range(min = -2147483648, max = 2147483647))]
    pub priority: i32,
    /// The rule's action.
    pub action: Action,
}
