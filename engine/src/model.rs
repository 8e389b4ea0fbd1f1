//! The normalized rule model: every policy kind translated into one form.
//!
//! * [`Policy`]: who the policy applies to ([`Subject`]), whether it isolates per direction, and
//!   its rules per direction in order.
//! * [`Rule`]: order key, verdict, peers (`None` = every peer) and ports (`None` = every protocol
//!   and port), plus the [`Origin`] that names it for `trace` and `dump`.
//! * [`PeerSpec`]: one peer, which is also the key of the selector cache.
//! * [`PortSpec`]: one port item (protocol defaulted, named ports kept by name).
//!
//! All Kubernetes defaulting happens here (SEMANTICS.md §1, §3, §4, §5 and upstream
//! `NetworkPolicy` rules), so nothing downstream looks at API objects again.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use ipnet::IpNet;
use k8s_openapi::api::networking::v1::{
    IPBlock, NetworkPolicy, NetworkPolicyPeer, NetworkPolicyPort,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use ordnet_crds::Selector as LabelSel;
use ordnet_crds::validate::{CnpPeerKind, CnpPortMatch, cnp_peer, cnp_protocol};
use ordnet_crds::{
    Action as ApiAction, ClusterNetworkPolicy, ClusterOrderedNetworkPolicy, CnpAction, CnpTier,
    IpBlock, NamespacedPod, OrderedNetworkPolicy, OrderedSpec, Peer, Port,
};
use ordnet_mapstate::{Action, Direction, OrderKey, Origin, Protocol, Tier, Verdict};
use serde::Serialize;

/// Labels of a pod or namespace.
pub type Labels = BTreeMap<String, String>;

/// The kind of a policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum PolicyKind {
    /// `networking.k8s.io/v1` `NetworkPolicy`.
    NetworkPolicy,
    /// `OrderedNetworkPolicy` (namespaced).
    Ordered,
    /// `ClusterOrderedNetworkPolicy` (cluster-scoped).
    ClusterOrdered,
    /// Upstream `ClusterNetworkPolicy` (`policy.networking.k8s.io`, cluster-scoped, tiered).
    ClusterNetwork,
}

impl PolicyKind {
    /// The Kubernetes kind name.
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::NetworkPolicy => ordnet_crds::KIND_NETWORK_POLICY,
            PolicyKind::Ordered => ordnet_crds::KIND_ORDERED,
            PolicyKind::ClusterOrdered => ordnet_crds::KIND_CLUSTER_ORDERED,
            PolicyKind::ClusterNetwork => ordnet_crds::KIND_CLUSTER_NETWORK_POLICY,
        }
    }
}

/// Identifies one policy object.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct PolicyRef {
    /// The policy's kind.
    pub kind: PolicyKind,
    /// `None` for cluster-scoped policies.
    pub namespace: Option<String>,
    /// `metadata.name`.
    pub name: String,
}

impl fmt::Display for PolicyRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.namespace {
            Some(ns) => write!(f, "{} {}/{}", self.kind.as_str(), ns, self.name),
            None => write!(f, "{} {}", self.kind.as_str(), self.name),
        }
    }
}

/// An object the engine could not use, with the reason. The object is left out (or, for an
/// incremental change, not applied); everything else keeps working.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, thiserror::Error)]
#[error("{object}: {field}: {message}")]
pub struct EngineError {
    /// `KIND NAMESPACE/NAME` or `KIND NAME`.
    pub object: String,
    /// The field path, e.g. `spec.ingress[0].from[1].ipBlock.cidr`.
    pub field: String,
    /// What is wrong with the field.
    pub message: String,
}

/// Which namespaces a pod peer or subject covers.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum NsScope {
    /// Exactly the namespace with this name (a namespaced policy's own namespace).
    Named(String),
    /// Every namespace whose labels match (`{}` = all namespaces).
    #[serde(serialize_with = "ser_selector")]
    Matching(LabelSel),
}

impl NsScope {
    /// Whether a namespace with these labels is in scope. A namespace's name is read from its
    /// `kubernetes.io/metadata.name` label, which the engine always sets to the name.
    pub fn matches(&self, ns_labels: &Labels) -> bool {
        match self {
            NsScope::Named(n) => ns_labels.get(ordnet_crds::NAMESPACE_NAME_LABEL) == Some(n),
            NsScope::Matching(s) => s.matches(ns_labels),
        }
    }
}

fn ser_selector<S: serde::Serializer>(s: &LabelSel, ser: S) -> Result<S::Ok, S::Error> {
    ser.serialize_str(&selector_text(s))
}

/// A compact text form of a label selector (`{}` for everything).
pub fn selector_text(s: &LabelSel) -> String {
    use ordnet_crds::Requirement;
    if s.is_everything() {
        return "{}".into();
    }
    let parts: Vec<String> = s
        .requirements
        .iter()
        .map(|r| match r {
            Requirement::In(k, vs) if vs.len() == 1 => {
                format!("{k}={}", vs.iter().next().map(String::as_str).unwrap_or(""))
            }
            Requirement::In(k, vs) => format!("{k} in ({})", join(vs)),
            Requirement::NotIn(k, vs) => format!("{k} notin ({})", join(vs)),
            Requirement::Exists(k) => k.clone(),
            Requirement::DoesNotExist(k) => format!("!{k}"),
        })
        .collect();
    parts.join(",")
}

fn join<'a>(vs: impl IntoIterator<Item = &'a String>) -> String {
    vs.into_iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .join(",")
}

/// One peer of a rule. Also the key of the selector cache: equal peers share one identity set.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum PeerSpec {
    /// Pods (never external addresses) in the namespaces of `namespaces` with matching labels.
    Pods {
        /// `namespaceSelector`; without one, the policy's own namespace (every namespace for a
        /// cluster policy).
        namespaces: NsScope,
        /// The pod label selector (absent = `{}`).
        #[serde(serialize_with = "ser_selector")]
        pods: LabelSel,
    },
    /// Addresses in `cidr` and in no `except` entry (pod addresses included).
    Block {
        /// The ipBlock `cidr`.
        cidr: IpNet,
        /// Strict subsets of `cidr`, sorted; entries inside another entry are dropped.
        except: Vec<IpNet>,
    },
    /// The addresses of the Nodes whose labels match (a ClusterNetworkPolicy `nodes` peer),
    /// resolved when the policy is translated (again whenever a Node changes).
    Nodes {
        /// The Node label selector.
        #[serde(serialize_with = "ser_selector")]
        nodes: LabelSel,
        /// Their addresses (`status.addresses` of type InternalIP or ExternalIP) as host
        /// prefixes, sorted.
        addrs: Vec<IpNet>,
    },
}

impl PeerSpec {
    /// Every pod of every namespace (the peer `namespaceSelector: {}`).
    pub fn all_pods() -> PeerSpec {
        PeerSpec::Pods {
            namespaces: NsScope::Matching(LabelSel::everything()),
            pods: LabelSel::everything(),
        }
    }
}

impl fmt::Display for PeerSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PeerSpec::Pods { namespaces, pods } => {
                match namespaces {
                    NsScope::Named(n) => write!(f, "pods in {n}")?,
                    NsScope::Matching(s) => write!(f, "pods in ns[{}]", selector_text(s))?,
                }
                write!(f, " [{}]", selector_text(pods))
            }
            PeerSpec::Block { cidr, except } => {
                write!(f, "{cidr}")?;
                for e in except {
                    write!(f, " -{e}")?;
                }
                Ok(())
            }
            PeerSpec::Nodes { nodes, addrs } => {
                write!(f, "nodes [{}]", selector_text(nodes))?;
                if addrs.is_empty() {
                    f.write_str(" (none)")?;
                }
                Ok(())
            }
        }
    }
}

/// One port item of a rule.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum PortSpec {
    /// Every port of one protocol.
    Proto(Protocol),
    /// An inclusive port range of one protocol (`first == last` for one port).
    Range {
        /// The protocol (absent in the API = TCP).
        proto: Protocol,
        /// `port`; at least 1.
        first: u16,
        /// `endPort`, or `port` without one; `>= first`.
        last: u16,
    },
    /// A named container port, resolved on the destination pod.
    Named {
        /// The protocol (absent in the API = TCP); the container port must have it too.
        proto: Protocol,
        /// The container port name.
        name: String,
    },
}

/// One normalized rule.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Rule {
    /// Names the rule for `trace` and `dump` (a NetworkPolicy rule keeps its real list index).
    pub origin: Arc<Origin>,
    /// `(tier, priority, rule index)`; `(0, 0)` for every NetworkPolicy rule.
    pub order: OrderKey,
    /// Allow for a NetworkPolicy rule, else the rule's `action` (Accept = Allow).
    pub action: Action,
    /// `None` = every peer (pods, CIDRs and the world).
    pub peers: Option<Vec<Arc<PeerSpec>>>,
    /// `None` = every protocol and port (ICMP included).
    pub ports: Option<Vec<PortSpec>>,
}

/// Which pods a policy applies to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum Subject {
    /// Pods of one namespace matching `pods`.
    Namespace {
        /// The policy's own namespace.
        namespace: String,
        /// `spec.podSelector`.
        #[serde(serialize_with = "ser_selector")]
        pods: LabelSel,
    },
    /// Pods matching `pods` in namespaces matching `namespaces`.
    Cluster {
        /// `spec.namespaceSelector` (absent = `{}`).
        #[serde(serialize_with = "ser_selector")]
        namespaces: LabelSel,
        /// `spec.podSelector` (absent = `{}`).
        #[serde(serialize_with = "ser_selector")]
        pods: LabelSel,
    },
}

impl Subject {
    /// Whether the pod `namespace` (with `ns_labels`) with `labels` is selected.
    pub fn selects(&self, namespace: &str, ns_labels: &Labels, labels: &Labels) -> bool {
        match self {
            Subject::Namespace { namespace: n, pods } => n == namespace && pods.matches(labels),
            Subject::Cluster { namespaces, pods } => {
                namespaces.matches(ns_labels) && pods.matches(labels)
            }
        }
    }
}

/// A rule the engine cannot enforce as written (a meaningless field that the API server
/// stored anyway: an older CRD, or a check the CRD schema cannot express). It is enforced
/// **fail-closed** at its place in the order (SEMANTICS.md §7): an `Allow` rule matches
/// nothing; a `Deny` rule matches every peer, protocol and port, so it denies everything the
/// subject sends or receives in that direction that no stronger rule decides.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct FailedRule {
    /// The rule's direction.
    pub direction: Direction,
    /// The rule's index in `spec.ingress` / `spec.egress`.
    pub index: u32,
    /// The rule's action as written (Accept = Allow).
    pub action: Action,
    /// The first field that cannot be enforced, e.g. `spec.ingress[1].from[0].ipBlock.cidr`.
    pub field: String,
    /// Why it cannot be enforced.
    pub message: String,
}

impl FailedRule {
    /// What the rule does instead: `"matches nothing"` (Allow) or `"denies all <direction>"`.
    pub fn effect(&self) -> &'static str {
        match (self.action, self.direction) {
            (Action::Allow, _) => "matches nothing",
            (_, Direction::Ingress) => "denies all ingress",
            (_, Direction::Egress) => "denies all egress",
        }
    }
}

impl fmt::Display for FailedRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "spec.{}[{}] ({}) {}: {}: {}",
            match self.direction {
                Direction::Ingress => "ingress",
                Direction::Egress => "egress",
            },
            self.index,
            match self.action {
                Action::Allow => "Allow",
                Action::Deny => "Deny",
                Action::Pass => "Pass",
            },
            self.effect(),
            self.field,
            self.message
        )
    }
}

/// One normalized policy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Policy {
    /// The policy object.
    pub id: PolicyRef,
    /// `spec.priority`; 0 for a NetworkPolicy.
    pub priority: i32,
    /// The tier of its rules (SEMANTICS.md §8): the ordnet tier for every kind but
    /// ClusterNetworkPolicy.
    pub tier: Tier,
    /// The pods it applies to.
    pub subject: Subject,
    /// Whether the policy isolates its subject, per direction (index `Direction::index`).
    pub isolates: [bool; 2],
    /// The rules per direction, in order (rules of a direction that a NetworkPolicy's effective
    /// `policyTypes` leaves out are dropped here).
    pub rules: [Vec<Rule>; 2],
    /// The origin reported in `isolated_by` per direction: `rule_index` 0, action deny.
    pub isolation_origin: [Arc<Origin>; 2],
    /// The rules enforced fail-closed instead of as written ([`FailedRule`]), in order.
    pub failed_rules: Vec<FailedRule>,
}

impl Policy {
    /// Every peer used by a rule of the policy (each distinct peer once).
    pub fn peers(&self) -> Vec<Arc<PeerSpec>> {
        let mut out: Vec<Arc<PeerSpec>> = Vec::new();
        for rules in &self.rules {
            for r in rules {
                for p in r.peers.iter().flatten() {
                    if !out.contains(p) {
                        out.push(p.clone());
                    }
                }
            }
        }
        out
    }

    /// Every selector the policy needs in the selector cache: its peers, plus the all-pods
    /// selector when an egress named port has no `to`.
    pub fn selector_specs(&self) -> Vec<Arc<PeerSpec>> {
        let mut v = self.peers();
        if self.needs_all_pods() {
            let all = Arc::new(PeerSpec::all_pods());
            if !v.contains(&all) {
                v.push(all);
            }
        }
        v
    }

    /// Every CIDR prefix used (ipBlock `cidr` and `except` entries, Node addresses).
    pub fn cidrs(&self) -> Vec<IpNet> {
        let mut out = Vec::new();
        for p in self.peers() {
            match &*p {
                PeerSpec::Block { cidr, except } => {
                    out.push(*cidr);
                    out.extend(except.iter().copied());
                }
                PeerSpec::Nodes { addrs, .. } => out.extend(addrs.iter().copied()),
                PeerSpec::Pods { .. } => {}
            }
        }
        out.sort();
        out.dedup();
        out
    }

    /// Every (name, protocol) used as a named port in a rule of direction `d`.
    pub fn named_ports(&self, d: Direction) -> Vec<(String, Protocol)> {
        let mut out = Vec::new();
        for r in &self.rules[d.index()] {
            for p in r.ports.iter().flatten() {
                if let PortSpec::Named { proto, name } = p {
                    out.push((name.clone(), *proto));
                }
            }
        }
        out.sort();
        out.dedup();
        out
    }

    /// Whether the policy needs the all-pods selector (an egress named port with no `to`).
    pub fn needs_all_pods(&self) -> bool {
        self.rules[1].iter().any(|r| {
            r.peers.is_none()
                && r.ports
                    .iter()
                    .flatten()
                    .any(|p| matches!(p, PortSpec::Named { .. }))
        })
    }
}

struct Ctx<'a> {
    object: &'a PolicyRef,
}

impl Ctx<'_> {
    fn err(&self, field: impl Into<String>, message: impl Into<String>) -> EngineError {
        EngineError {
            object: self.object.to_string(),
            field: field.into(),
            message: message.into(),
        }
    }

    fn selector(&self, s: &LabelSelector, field: &str) -> Result<LabelSel, EngineError> {
        LabelSel::parse(s).map_err(|errs| {
            let first = errs.first();
            self.err(
                match first {
                    Some(e) if !e.field.is_empty() => format!("{field}.{}", e.field),
                    _ => field.to_string(),
                },
                first.map_or_else(|| "invalid selector".to_string(), |e| e.message.clone()),
            )
        })
    }

    fn cidr(&self, text: &str, field: &str) -> Result<IpNet, EngineError> {
        ordnet_crds::validate::parse_cidr(text)
            .map(|p| p.net)
            .map_err(|e| self.err(field, e))
    }

    fn ip_block(
        &self,
        cidr: &str,
        except: &[String],
        field: &str,
    ) -> Result<PeerSpec, EngineError> {
        let net = self.cidr(cidr, &format!("{field}.cidr"))?;
        let mut ex = Vec::new();
        for (i, e) in except.iter().enumerate() {
            let f = format!("{field}.except[{i}]");
            let e = self.cidr(e, &f)?;
            if e.addr().is_ipv4() != net.addr().is_ipv4() {
                return Err(self.err(f, format!("{e} is not of the same IP family as {net}")));
            }
            if !(net.contains(&e) && e.prefix_len() > net.prefix_len()) {
                return Err(self.err(f, format!("{e} must be a strict subset of {net}")));
            }
            ex.push(e);
        }
        ex.sort();
        ex.dedup();
        // An except entry inside another one adds nothing.
        let all = ex.clone();
        ex.retain(|e| !all.iter().any(|o| o != e && o.contains(e)));
        Ok(PeerSpec::Block {
            cidr: net,
            except: ex,
        })
    }

    /// A peer from its three parts; `cluster` = a cluster policy (a podSelector alone means
    /// every namespace), else `own` is the policy's namespace.
    fn peer(
        &self,
        pod_selector: Option<&LabelSelector>,
        namespace_selector: Option<&LabelSelector>,
        ip_block: Option<(&str, &[String])>,
        own: Option<&str>,
        field: &str,
    ) -> Result<PeerSpec, EngineError> {
        match (pod_selector, namespace_selector, ip_block) {
            (None, None, Some((cidr, except))) => {
                self.ip_block(cidr, except, &format!("{field}.ipBlock"))
            }
            (_, _, Some(_)) => Err(self.err(
                field,
                "ipBlock may not be combined with podSelector or namespaceSelector",
            )),
            (None, None, None) => Err(self.err(
                field,
                "an empty peer: set podSelector, namespaceSelector or ipBlock",
            )),
            (pods, nss, None) => {
                let pods = match pods {
                    Some(s) => self.selector(s, &format!("{field}.podSelector"))?,
                    None => LabelSel::everything(),
                };
                let namespaces = match (nss, own) {
                    (Some(s), _) => {
                        NsScope::Matching(self.selector(s, &format!("{field}.namespaceSelector"))?)
                    }
                    (None, Some(ns)) => NsScope::Named(ns.to_string()),
                    (None, None) => NsScope::Matching(LabelSel::everything()),
                };
                Ok(PeerSpec::Pods { namespaces, pods })
            }
        }
    }

    fn port(
        &self,
        protocol: Protocol,
        port: Option<&IntOrString>,
        end_port: Option<i32>,
        field: &str,
    ) -> Result<PortSpec, EngineError> {
        let number = |n: i32, f: &str| -> Result<u16, EngineError> {
            u16::try_from(n).ok().filter(|&n| n >= 1).ok_or_else(|| {
                self.err(
                    format!("{field}.{f}"),
                    format!("{n} is not a port number (1-65535)"),
                )
            })
        };
        match (port, end_port) {
            (None, None) => Ok(PortSpec::Proto(protocol)),
            (None, Some(_)) => Err(self.err(
                format!("{field}.endPort"),
                "not allowed without port: a range needs a numeric port",
            )),
            (Some(IntOrString::Int(n)), end) => {
                let first = number(*n, "port")?;
                let last = match end {
                    Some(e) => number(e, "endPort")?,
                    None => first,
                };
                if last < first {
                    return Err(self.err(
                        format!("{field}.endPort"),
                        format!("{last} must be greater than or equal to port ({first})"),
                    ));
                }
                Ok(PortSpec::Range {
                    proto: protocol,
                    first,
                    last,
                })
            }
            (Some(IntOrString::String(name)), None) => {
                if ordnet_crds::syntax::port_name(name).is_err() {
                    return Err(self.err(
                        format!("{field}.port"),
                        format!("{name:?} is not a valid port name"),
                    ));
                }
                Ok(PortSpec::Named {
                    proto: protocol,
                    name: name.clone(),
                })
            }
            (Some(IntOrString::String(name)), Some(_)) => Err(self.err(
                format!("{field}.endPort"),
                format!("not allowed with the named port {name:?}"),
            )),
        }
    }
}

/// Maps the API protocol to the MapState protocol.
pub fn protocol(p: ordnet_crds::Protocol) -> Protocol {
    match p {
        ordnet_crds::Protocol::Tcp => Protocol::Tcp,
        ordnet_crds::Protocol::Udp => Protocol::Udp,
        ordnet_crds::Protocol::Sctp => Protocol::Sctp,
    }
}

/// Parses a container or NetworkPolicy protocol string (absent = TCP).
pub fn parse_protocol(p: Option<&str>) -> Option<Protocol> {
    match p {
        None => Some(Protocol::Tcp),
        Some(s) => ordnet_crds::Protocol::from_api(s).map(protocol),
    }
}

fn make_origin(
    id: &PolicyRef,
    d: Direction,
    index: u32,
    priority: i32,
    action: Action,
    tier: Tier,
) -> Arc<Origin> {
    Arc::new(Origin {
        kind: id.kind.as_str().to_string(),
        namespace: id.namespace.clone(),
        name: id.name.clone(),
        direction: d,
        rule_index: index,
        rule_name: None,
        priority,
        action,
        tier,
        passed_by: None,
    })
}

fn isolation_origins(id: &PolicyRef, priority: i32) -> [Arc<Origin>; 2] {
    Direction::ALL.map(|d| make_origin(id, d, 0, priority, Action::Deny, Tier::Ordnet))
}

fn meta_name(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    kind: PolicyKind,
    namespaced: bool,
) -> Result<PolicyRef, EngineError> {
    let name = meta.name.clone().unwrap_or_default();
    let namespace = if namespaced {
        Some(
            meta.namespace
                .clone()
                .unwrap_or_else(|| ordnet_crds::DEFAULT_NAMESPACE.to_string()),
        )
    } else {
        None
    };
    let id = PolicyRef {
        kind,
        namespace,
        name,
    };
    if id.name.is_empty() {
        return Err(EngineError {
            object: id.to_string(),
            field: "metadata.name".into(),
            message: "required".into(),
        });
    }
    Ok(id)
}

/// Translates a standard NetworkPolicy with upstream defaulting:
/// * effective `policyTypes`: as listed; when absent or empty, Ingress, plus Egress if the
///   policy has at least one egress rule;
/// * rules of a direction outside the effective types are ignored;
/// * every rule is an Allow with order key `(0, 0)`;
/// * a peer's podSelector alone = the policy's namespace; `from`/`to`/`ports` empty or absent =
///   everything; protocol defaults to TCP.
pub fn translate_network_policy(np: &NetworkPolicy) -> Result<Policy, EngineError> {
    let id = meta_name(&np.metadata, PolicyKind::NetworkPolicy, true)?;
    let ctx = Ctx { object: &id };
    let own = id.namespace.clone().unwrap_or_default();
    let default_spec = Default::default();
    let spec = np.spec.as_ref().unwrap_or(&default_spec);
    let pods = match &spec.pod_selector {
        Some(s) => ctx.selector(s, "spec.podSelector")?,
        None => LabelSel::everything(),
    };
    let ingress = spec.ingress.as_deref().unwrap_or_default();
    let egress = spec.egress.as_deref().unwrap_or_default();
    let effective = effective_policy_types(spec, &ctx, !egress.is_empty())?;
    let mut rules: [Vec<Rule>; 2] = [Vec::new(), Vec::new()];
    let mut failed_rules = Vec::new();
    type Parts<'a> = (
        Option<&'a [NetworkPolicyPeer]>,
        Option<&'a [NetworkPolicyPort]>,
    );
    let lists: [Vec<Parts<'_>>; 2] = [
        ingress
            .iter()
            .map(|r| (r.from.as_deref(), r.ports.as_deref()))
            .collect(),
        egress
            .iter()
            .map(|r| (r.to.as_deref(), r.ports.as_deref()))
            .collect(),
    ];
    for d in Direction::ALL {
        let di = d.index();
        if !effective[di] {
            continue;
        }
        let (list_field, peer_field) = match d {
            Direction::Ingress => ("spec.ingress", "from"),
            Direction::Egress => ("spec.egress", "to"),
        };
        for (i, (peers, ports)) in lists[di].iter().enumerate() {
            let base = format!("{list_field}[{i}]");
            let index = u32::try_from(i).map_err(|_| ctx.err(base.clone(), "too many rules"))?;
            let translated = np_rule(&ctx, &own, &base, peer_field, *peers, *ports);
            let origin = make_origin(&id, d, index, 0, Action::Allow, Tier::Ordnet);
            match translated {
                Ok((peers, ports)) => rules[di].push(Rule {
                    origin,
                    order: OrderKey::new(0, 0),
                    action: Action::Allow,
                    peers: dedup_peers(peers),
                    ports: dedup_ports(ports),
                }),
                // Fail-closed: an Allow rule that cannot be enforced matches nothing.
                Err(e) => failed_rules.push(failed(d, index, Action::Allow, e)),
            }
        }
    }
    Ok(Policy {
        tier: Tier::Ordnet,
        isolation_origin: isolation_origins(&id, 0),
        subject: Subject::Namespace {
            namespace: own,
            pods,
        },
        id,
        priority: 0,
        isolates: effective,
        rules,
        failed_rules,
    })
}

/// The directions a NetworkPolicy isolates: its `policyTypes`, or upstream's defaulting
/// (Ingress always; Egress only with at least one egress rule, `has_egress_rules`).
fn effective_policy_types(
    spec: &k8s_openapi::api::networking::v1::NetworkPolicySpec,
    ctx: &Ctx<'_>,
    has_egress_rules: bool,
) -> Result<[bool; 2], EngineError> {
    let types: Vec<&str> = spec
        .policy_types
        .iter()
        .flatten()
        .map(String::as_str)
        .collect();
    for (i, t) in types.iter().enumerate() {
        if *t != "Ingress" && *t != "Egress" {
            return Err(ctx.err(
                format!("spec.policyTypes[{i}]"),
                format!("{t:?} is not supported: use Ingress or Egress"),
            ));
        }
    }
    Ok(if types.is_empty() {
        [true, has_egress_rules]
    } else {
        [types.contains(&"Ingress"), types.contains(&"Egress")]
    })
}

/// The peers and ports of one NetworkPolicy rule (`base` is its field path, e.g.
/// `spec.ingress[0]`); `None` for an absent or empty list (everything).
#[allow(clippy::type_complexity)]
fn np_rule(
    ctx: &Ctx<'_>,
    own: &str,
    base: &str,
    peer_field: &str,
    peers: Option<&[NetworkPolicyPeer]>,
    ports: Option<&[NetworkPolicyPort]>,
) -> Result<(Option<Vec<Arc<PeerSpec>>>, Option<Vec<PortSpec>>), EngineError> {
    let np_peer = |p: &NetworkPolicyPeer, field: &str| -> Result<PeerSpec, EngineError> {
        let block: Option<&IPBlock> = p.ip_block.as_ref();
        ctx.peer(
            p.pod_selector.as_ref(),
            p.namespace_selector.as_ref(),
            block.map(|b| (b.cidr.as_str(), b.except.as_deref().unwrap_or_default())),
            Some(own),
            field,
        )
    };
    let np_port = |p: &NetworkPolicyPort, field: &str| -> Result<PortSpec, EngineError> {
        let proto = parse_protocol(p.protocol.as_deref()).ok_or_else(|| {
            ctx.err(
                format!("{field}.protocol"),
                format!(
                    "{:?} is not supported: use TCP, UDP or SCTP",
                    p.protocol.as_deref().unwrap_or_default()
                ),
            )
        })?;
        ctx.port(proto, p.port.as_ref(), p.end_port, field)
    };
    let peers = match peers {
        Some(ps) if !ps.is_empty() => Some(
            ps.iter()
                .enumerate()
                .map(|(j, p)| np_peer(p, &format!("{base}.{peer_field}[{j}]")).map(Arc::new))
                .collect::<Result<Vec<_>, _>>()?,
        ),
        _ => None,
    };
    let ports = match ports {
        Some(ps) if !ps.is_empty() => Some(
            ps.iter()
                .enumerate()
                .map(|(j, p)| np_port(p, &format!("{base}.ports[{j}]")))
                .collect::<Result<Vec<_>, _>>()?,
        ),
        _ => None,
    };
    Ok((peers, ports))
}

/// The API's direction and the field of a rule's peers (`from` / `to`).
fn api_direction(d: Direction) -> (ordnet_crds::Direction, &'static str) {
    match d {
        Direction::Ingress => (ordnet_crds::Direction::Ingress, "from"),
        Direction::Egress => (ordnet_crds::Direction::Egress, "to"),
    }
}

fn failed(direction: Direction, index: u32, action: Action, e: EngineError) -> FailedRule {
    FailedRule {
        direction,
        index,
        action,
        field: e.field,
        message: e.message,
    }
}

/// A translated rule's peers and ports (`None` = every peer / protocol and port), or why it
/// cannot be enforced.
type Translated = Result<(Option<Vec<Arc<PeerSpec>>>, Option<Vec<PortSpec>>), EngineError>;

/// Adds one translated rule of an ordered or tiered policy, fail-closed (SEMANTICS.md §7) when
/// it cannot be enforced: an Allow matches nothing (it is only listed as failed); a Deny or Pass
/// matches everything as a Deny, at its place in the order.
fn push_rule(
    rules: &mut Vec<Rule>,
    failed_rules: &mut Vec<FailedRule>,
    (d, index): (Direction, u32),
    (origin, order, action): (Arc<Origin>, OrderKey, Action),
    translated: Translated,
) {
    match translated {
        Ok((peers, ports)) => rules.push(Rule {
            origin,
            order,
            action,
            peers: dedup_peers(peers),
            ports: dedup_ports(ports),
        }),
        Err(e) => {
            failed_rules.push(failed(d, index, action, e));
            if action != Action::Allow {
                rules.push(Rule {
                    origin,
                    order,
                    action: Action::Deny,
                    peers: None,
                    ports: None,
                });
            }
        }
    }
}

fn dedup_peers(p: Option<Vec<Arc<PeerSpec>>>) -> Option<Vec<Arc<PeerSpec>>> {
    p.map(|mut v| {
        let mut seen = crate::fast::HashSet::default();
        v.retain(|x| seen.insert(x.clone()));
        v
    })
}

fn dedup_ports(p: Option<Vec<PortSpec>>) -> Option<Vec<PortSpec>> {
    p.map(|mut v| {
        let mut seen = crate::fast::HashSet::default();
        v.retain(|x| seen.insert(x.clone()));
        v
    })
}

fn translate_ordered<S: OrderedSpec>(
    id: PolicyRef,
    spec: &S,
    subject: Subject,
) -> Result<Policy, EngineError> {
    let ctx = Ctx { object: &id };
    let own = id.namespace.clone();
    let ordered_peer = |p: &Peer, field: &str| -> Result<PeerSpec, EngineError> {
        ctx.peer(
            p.pod_selector.as_ref(),
            p.namespace_selector.as_ref(),
            p.ip_block
                .as_ref()
                .map(|b: &IpBlock| (b.cidr.as_str(), b.except.as_slice())),
            own.as_deref(),
            field,
        )
    };
    let ordered_port = |p: &Port, field: &str| -> Result<PortSpec, EngineError> {
        ctx.port(protocol(p.protocol), p.port.as_ref(), p.end_port, field)
    };
    let priority = spec.priority();
    if id.kind == PolicyKind::Ordered && priority < 0 {
        return Err(ctx.err(
            "spec.priority",
            format!("{priority} is negative: an OrderedNetworkPolicy needs priority >= 0"),
        ));
    }
    let mut rules: [Vec<Rule>; 2] = [Vec::new(), Vec::new()];
    let mut failed_rules = Vec::new();
    for d in Direction::ALL {
        let (cd, peer_field) = api_direction(d);
        for r in spec.rules(cd) {
            let base = format!("spec.{}[{}]", cd.field(), r.index);
            let index =
                u32::try_from(r.index).map_err(|_| ctx.err(base.clone(), "too many rules"))?;
            let verdict = match r.action {
                ApiAction::Allow => Verdict::Allow,
                ApiAction::Deny => Verdict::Deny,
            };
            let translated = (|| -> Result<_, EngineError> {
                let peers = if r.peers.is_empty() {
                    None
                } else {
                    Some(
                        r.peers
                            .iter()
                            .enumerate()
                            .map(|(j, p)| {
                                ordered_peer(p, &format!("{base}.{peer_field}[{j}]")).map(Arc::new)
                            })
                            .collect::<Result<Vec<_>, _>>()?,
                    )
                };
                let ports = if r.ports.is_empty() {
                    None
                } else {
                    Some(
                        r.ports
                            .iter()
                            .enumerate()
                            .map(|(j, p)| ordered_port(p, &format!("{base}.ports[{j}]")))
                            .collect::<Result<Vec<_>, _>>()?,
                    )
                };
                Ok((peers, ports))
            })();
            let origin = make_origin(&id, d, index, priority, verdict.into(), Tier::Ordnet);
            let order = OrderKey::new(priority, index);
            push_rule(
                &mut rules[d.index()],
                &mut failed_rules,
                (d, index),
                (origin, order, verdict.into()),
                translated,
            );
        }
    }
    let isolates = [
        spec.isolates(ordnet_crds::Direction::Ingress),
        spec.isolates(ordnet_crds::Direction::Egress),
    ];
    Ok(Policy {
        isolation_origin: isolation_origins(&id, priority),
        id,
        priority,
        tier: Tier::Ordnet,
        subject,
        isolates,
        rules,
        failed_rules,
    })
}

/// Translates an OrderedNetworkPolicy: order key `(priority, rule index)`; isolation per
/// `defaultDeny`, else "has an Allow rule in the direction"; a podSelector alone in a peer means
/// the policy's own namespace.
pub fn translate_ordered_policy(p: &OrderedNetworkPolicy) -> Result<Policy, EngineError> {
    let id = meta_name(&p.metadata, PolicyKind::Ordered, true)?;
    let ctx = Ctx { object: &id };
    let pods = ctx.selector(&p.spec.pod_selector, "spec.podSelector")?;
    let subject = Subject::Namespace {
        namespace: id.namespace.clone().unwrap_or_default(),
        pods,
    };
    translate_ordered(id, &p.spec, subject)
}

/// Translates a ClusterOrderedNetworkPolicy: the subject is namespaceSelector AND podSelector;
/// a podSelector alone in a peer means pods in any namespace.
pub fn translate_cluster_policy(p: &ClusterOrderedNetworkPolicy) -> Result<Policy, EngineError> {
    let id = meta_name(&p.metadata, PolicyKind::ClusterOrdered, false)?;
    let ctx = Ctx { object: &id };
    let namespaces = ctx.selector(&p.spec.namespace_selector, "spec.namespaceSelector")?;
    let pods = ctx.selector(&p.spec.pod_selector, "spec.podSelector")?;
    translate_ordered(id, &p.spec, Subject::Cluster { namespaces, pods })
}

/// Translates an upstream ClusterNetworkPolicy (SEMANTICS.md §8): its tier, order key
/// `(tier, priority, rule index)`, Accept = Allow, Deny, Pass; it never isolates. Peers:
/// `namespaces` and `pods` as pod peers (a `pods` peer without namespaceSelector: every
/// namespace), `networks` as ipBlocks (pod addresses included), `nodes` as the addresses of the
/// Nodes `nodes` resolves the selector to. A `destinationNamedPort` is the container port of that
/// name, whatever its protocol. A rule with a peer or protocol ordnet cannot enforce
/// (`domainNames`, fields of a newer API version) is enforced fail-closed: an Accept matches
/// nothing, a Deny or Pass denies everything in its direction at its place in the order.
pub fn translate_cluster_network_policy(
    p: &ClusterNetworkPolicy,
    nodes: &dyn Fn(&LabelSel) -> Vec<IpNet>,
) -> Result<Policy, EngineError> {
    let id = meta_name(&p.metadata, PolicyKind::ClusterNetwork, false)?;
    let ctx = Ctx { object: &id };
    let spec = &p.spec;
    let tier = match spec.tier {
        CnpTier::Admin => Tier::Admin,
        CnpTier::Baseline => Tier::Baseline,
    };
    let priority = spec.priority;
    let pods_peer = |np: &NamespacedPod, field: &str| -> Result<PeerSpec, EngineError> {
        Ok(PeerSpec::Pods {
            namespaces: NsScope::Matching(ctx.selector(
                &np.namespace_selector,
                &format!("{field}.namespaceSelector"),
            )?),
            pods: ctx.selector(&np.pod_selector, &format!("{field}.podSelector"))?,
        })
    };
    let subject = match (&spec.subject.namespaces, &spec.subject.pods) {
        (Some(ns), None) => Subject::Cluster {
            namespaces: ctx.selector(ns, "spec.subject.namespaces")?,
            pods: LabelSel::everything(),
        },
        (None, Some(np)) => match pods_peer(np, "spec.subject.pods")? {
            PeerSpec::Pods {
                namespaces: NsScope::Matching(namespaces),
                pods,
            } => Subject::Cluster { namespaces, pods },
            _ => unreachable!("pods_peer gives a pod peer of matching namespaces"),
        },
        _ => {
            return Err(ctx.err(
                "spec.subject",
                "exactly one of namespaces or pods must be set",
            ));
        }
    };
    let mut rules: [Vec<Rule>; 2] = [Vec::new(), Vec::new()];
    let mut failed_rules = Vec::new();
    for d in Direction::ALL {
        let (cd, peer_field) = api_direction(d);
        for r in spec.rules(cd) {
            let base = format!("spec.{}[{}]", cd.field(), r.index);
            let index =
                u32::try_from(r.index).map_err(|_| ctx.err(base.clone(), "too many rules"))?;
            let action = match r.action {
                CnpAction::Accept => Action::Allow,
                CnpAction::Deny => Action::Deny,
                CnpAction::Pass => Action::Pass,
            };
            let translated = (|| -> Result<_, EngineError> {
                let mut peers = Vec::new();
                for (j, peer) in r.peers.iter().enumerate() {
                    let field = format!("{base}.{peer_field}[{j}]");
                    match cnp_peer(peer).map_err(|e| ctx.err(field.clone(), e))? {
                        CnpPeerKind::Namespaces(sel) => peers.push(PeerSpec::Pods {
                            namespaces: NsScope::Matching(
                                ctx.selector(sel, &format!("{field}.namespaces"))?,
                            ),
                            pods: LabelSel::everything(),
                        }),
                        CnpPeerKind::Pods(np) => {
                            peers.push(pods_peer(np, &format!("{field}.pods"))?)
                        }
                        CnpPeerKind::Nodes(sel) => {
                            let sel = ctx.selector(sel, &format!("{field}.nodes"))?;
                            let mut addrs = nodes(&sel);
                            addrs.sort();
                            addrs.dedup();
                            peers.push(PeerSpec::Nodes { nodes: sel, addrs });
                        }
                        CnpPeerKind::Networks(nets) => {
                            for (k, n) in nets.iter().enumerate() {
                                let cidr = ctx.cidr(n, &format!("{field}.networks[{k}]"))?;
                                peers.push(PeerSpec::Block {
                                    cidr,
                                    except: Vec::new(),
                                });
                            }
                        }
                        CnpPeerKind::DomainNames => {
                            return Err(ctx.err(
                                format!("{field}.domainNames"),
                                "domainNames peers are not supported by ordnet",
                            ));
                        }
                        CnpPeerKind::Unknown(fields) => {
                            return Err(ctx.err(
                                field,
                                format!(
                                    "no peer field ordnet knows (found: {}); a newer API version?",
                                    if fields.is_empty() {
                                        "none".to_string()
                                    } else {
                                        fields.join(", ")
                                    }
                                ),
                            ));
                        }
                    }
                }
                let ports = match r.protocols {
                    None => None,
                    Some(list) => {
                        let mut out = Vec::new();
                        for (j, proto) in list.iter().enumerate() {
                            let field = format!("{base}.protocols[{j}]");
                            match cnp_protocol(proto).map_err(|e| ctx.err(field.clone(), e))? {
                                Some(CnpPortMatch::Ports(p, first, last)) => {
                                    out.push(PortSpec::Range {
                                        proto: protocol(p),
                                        first,
                                        last,
                                    })
                                }
                                // The container port of that name, whatever its protocol (a
                                // container port has exactly one).
                                Some(CnpPortMatch::Named(name)) => {
                                    out.extend(Protocol::ALL.map(|proto| PortSpec::Named {
                                        proto,
                                        name: name.clone(),
                                    }))
                                }
                                None => {
                                    return Err(ctx.err(
                                        field,
                                        "no protocol field ordnet knows; a newer API version?",
                                    ));
                                }
                            }
                        }
                        Some(out)
                    }
                };
                Ok((Some(peers.into_iter().map(Arc::new).collect()), ports))
            })();
            let origin = Arc::new(Origin {
                rule_name: r.name.map(str::to_string),
                ..(*make_origin(&id, d, index, priority, action, tier)).clone()
            });
            let order = OrderKey::tiered(tier, priority, index);
            push_rule(
                &mut rules[d.index()],
                &mut failed_rules,
                (d, index),
                (origin, order, action),
                translated,
            );
        }
    }
    Ok(Policy {
        isolation_origin: isolation_origins(&id, priority),
        id,
        priority,
        tier,
        subject,
        isolates: [false, false],
        rules,
        failed_rules,
    })
}

/// The host prefixes of a Node's addresses (`InternalIP` and `ExternalIP`; `Hostname` and
/// anything that is not an IP address is skipped).
pub fn node_addresses(node: &k8s_openapi::api::core::v1::Node) -> Vec<IpNet> {
    let mut out: Vec<IpNet> = node
        .status
        .iter()
        .flat_map(|s| s.addresses.iter().flatten())
        .filter(|a| a.type_ == "InternalIP" || a.type_ == "ExternalIP")
        .filter_map(|a| a.address.parse::<std::net::IpAddr>().ok())
        .map(IpNet::from)
        .collect();
    out.sort();
    out.dedup();
    out
}
