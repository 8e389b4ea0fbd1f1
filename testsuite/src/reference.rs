//! A reference evaluator written directly from `shared/spec/SEMANTICS.md`: policies are
//! evaluated against the pods and addresses themselves, rule by rule. No identities, no
//! selector cache, no tries, and no code of the engine: it exists to catch engine bugs, so it
//! shares nothing with it but the API types (and the crds label-selector matcher).
//!
//! * §2: the candidate rules of (endpoint, direction) are the rules of that direction of every
//!   policy whose subject selects the endpoint; among the matching ones the smallest order key
//!   `(priority, index)` decides, deny winning ties; no match = the isolation default.
//! * §3: a NetworkPolicy isolates in the directions of its effective `policyTypes` (absent or
//!   empty: Ingress, plus Egress when it has egress rules) and its rules of other directions are
//!   ignored; an ordered policy isolates in D if `defaultDeny.D`, else if it has an Allow in D.
//! * §4: peers as NetworkPolicyPeer (pod selectors only ever match pods; a podSelector alone
//!   means the policy's namespace, or any namespace for a cluster policy); ipBlock matches any
//!   address in `cidr` and in no `except`, pod addresses included.
//! * §5: protocol defaults to TCP; no ports = everything; a named port is resolved on the
//!   destination pod (the endpoint for ingress, the peer for egress, never a non-pod).
//! * A flow needs the source pod's egress and the destination pod's ingress; a pod to itself is
//!   allowed. Host-network pods are not pods here (their addresses are plain addresses).
//! * §8: upstream ClusterNetworkPolicies are walked tier by tier: the Admin rules (by
//!   `(priority, index)`, Deny before Pass before Accept at an equal key; the first match
//!   decides, a Pass goes on), then the ordnet rules as above, then the isolation default, then
//!   the Baseline rules (a Pass allows), then allow. Their peers: `namespaces`, `pods`,
//!   `networks` (any address, pods included), `nodes` (the Nodes' InternalIP/ExternalIP
//!   addresses); `destinationNamedPort` is the destination pod's port of that name, any
//!   protocol. A rule with `domainNames` (or a peer of no known field) fails closed: an Accept
//!   matches nothing, a Deny or Pass denies everything.

use std::collections::BTreeMap;
use std::net::IpAddr;

use ipnet::IpNet;
use k8s_openapi::api::networking::v1::{NetworkPolicyPeer, NetworkPolicyPort};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use ordnet_crds::ClusterObjects;
use ordnet_crds::Selector;

type Labels = BTreeMap<String, String>;

const NAME_LABEL: &str = "kubernetes.io/metadata.name";

/// Direction seen from the endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Dir {
    /// Traffic the endpoint receives.
    Ingress,
    /// Traffic the endpoint sends.
    Egress,
}

/// One end of a flow.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum End {
    /// A pod, probed at its first address of the family, else its first address.
    Pod {
        /// The pod's namespace.
        namespace: String,
        /// The pod's name.
        name: String,
    },
    /// An address; a pod's address stands for that pod.
    Ip(IpAddr),
}

#[derive(Debug, Clone)]
struct RefPod {
    namespace: String,
    name: String,
    labels: Labels,
    ips: Vec<IpAddr>,
    /// (name, protocol number, port)
    ports: Vec<(String, u8, u16)>,
}

/// A peer, kept close to the API.
#[derive(Debug, Clone)]
enum RefPeer {
    Pods {
        /// `None` = the policy's own namespace (`own`), or every namespace when `own` is None.
        namespaces: Option<Selector>,
        own: Option<String>,
        pods: Option<Selector>,
    },
    Block {
        cidr: IpNet,
        except: Vec<IpNet>,
    },
    /// Exactly these addresses (a ClusterNetworkPolicy `nodes` peer).
    Addrs(Vec<IpAddr>),
}

#[derive(Debug, Clone)]
struct RefPort {
    protocol: u8,
    port: Option<IntOrString>,
    end_port: Option<i32>,
}

/// Names one rule of one policy: kind, namespace (none for cluster policies), name, direction
/// and the rule's position in its list.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RuleName {
    /// `NetworkPolicy`, `OrderedNetworkPolicy`, `ClusterOrderedNetworkPolicy` or
    /// `ClusterNetworkPolicy`.
    pub kind: &'static str,
    /// `None` for cluster policies.
    pub namespace: Option<String>,
    /// The policy's name.
    pub name: String,
    /// The rule's list: `ingress` or `egress`.
    pub direction: Dir,
    /// The rule's position in that list.
    pub index: usize,
}

/// The rules of one side of a packet (see [`Reference::side_rules`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SideRules {
    /// Every candidate rule that matches the packet.
    pub matching: Vec<RuleName>,
    /// The rules that decide it: tier by tier (§8), the matching rules of the smallest order
    /// key, and of those only the Deny rules if there is one (then the Pass rules); a Pass of
    /// the Admin or ordnet tier decides nothing (the next tier does), nor does anything after
    /// the isolation default of an isolated endpoint.
    pub deciding: Vec<RuleName>,
}

#[derive(Debug, Clone)]
struct RefRule {
    name: RuleName,
    /// 0 Admin, 1 the ordnet kinds, 2 Baseline.
    tier: u8,
    key: (i64, u64),
    deny: bool,
    /// A ClusterNetworkPolicy `Pass` (never with `deny`).
    pass: bool,
    /// Empty = every peer.
    peers: Vec<RefPeer>,
    /// Empty = everything.
    ports: Vec<RefPort>,
}

#[derive(Debug, Clone)]
struct RefPolicy {
    /// `Some(ns)`: pods of that namespace matching `pods`; `None`: pods matching `pods` in
    /// namespaces matching `namespaces`.
    namespace: Option<String>,
    namespaces: Selector,
    pods: Selector,
    isolates: [bool; 2],
    rules: [Vec<RefRule>; 2],
}

/// The reference evaluator over one set of objects.
#[derive(Debug, Clone)]
pub struct Reference {
    ns_labels: BTreeMap<String, Labels>,
    pods: Vec<RefPod>,
    policies: Vec<RefPolicy>,
}

fn proto_number(p: Option<&str>) -> Option<u8> {
    match p.unwrap_or("TCP") {
        "TCP" => Some(6),
        "UDP" => Some(17),
        "SCTP" => Some(132),
        _ => None,
    }
}

fn sel(s: Option<&LabelSelector>) -> Result<Option<Selector>, String> {
    s.map(|s| Selector::parse(s).map_err(|e| format!("bad selector: {e:?}")))
        .transpose()
}

fn net(text: &str) -> Result<IpNet, String> {
    text.parse::<IpNet>()
        .map(|n| n.trunc())
        .map_err(|e| format!("bad CIDR {text}: {e}"))
}

fn idx(d: Dir) -> usize {
    match d {
        Dir::Ingress => 0,
        Dir::Egress => 1,
    }
}

impl Reference {
    /// Reads the objects. Errors for objects the reference cannot read (the engine would
    /// reject them too). A staged policy (`spec.mode: Staged`) decides nothing: left out.
    pub fn new(objects: &ClusterObjects) -> Result<Reference, String> {
        Reference::new_with(objects, false)
    }

    /// [`Reference::new`]; with `staged`, the staged policies are read as if enforced (what
    /// they would do).
    pub fn new_with(objects: &ClusterObjects, staged: bool) -> Result<Reference, String> {
        let mut policies = Vec::new();
        for np in &objects.network_policies {
            policies.push(read_network_policy(&np.object)?);
        }
        policies.extend(read_ordered_policies(objects, staged)?);
        policies.extend(read_cluster_network_policies(objects)?);
        Ok(Reference {
            ns_labels: read_namespaces(objects),
            pods: read_pods(objects),
            policies,
        })
    }

    fn labels_of_ns(&self, ns: &str) -> Labels {
        self.ns_labels
            .get(ns)
            .cloned()
            .unwrap_or_else(|| Labels::from([(NAME_LABEL.to_string(), ns.to_string())]))
    }

    fn pod_by_name(&self, ns: &str, name: &str) -> Option<usize> {
        self.pods
            .iter()
            .position(|p| p.namespace == ns && p.name == name && !p.ips.is_empty())
    }

    fn pod_by_ip(&self, ip: IpAddr) -> Option<usize> {
        self.pods.iter().position(|p| p.ips.contains(&ip))
    }

    /// Whether the flow is allowed. A pod end is probed at its first address of the family
    /// (`v6`), else its first address.
    pub fn allowed(&self, from: &End, to: &End, v6: bool, proto: u8, port: u16) -> Option<bool> {
        let point = |e: &End| -> Option<(IpAddr, Option<usize>)> {
            match e {
                End::Ip(ip) => Some((*ip, self.pod_by_ip(*ip))),
                End::Pod { namespace, name } => {
                    let i = self.pod_by_name(namespace, name)?;
                    let ips = &self.pods[i].ips;
                    let ip = ips
                        .iter()
                        .find(|ip| ip.is_ipv6() == v6)
                        .or(ips.first())
                        .copied()?;
                    Some((ip, Some(i)))
                }
            }
        };
        let (src_ip, src) = point(from)?;
        let (dst_ip, dst) = point(to)?;
        if src.is_some() && src == dst {
            return Some(true);
        }
        let egress_ok = src.is_none_or(|s| self.side(s, Dir::Egress, dst_ip, dst, proto, port));
        let ingress_ok = dst.is_none_or(|d| self.side(d, Dir::Ingress, src_ip, src, proto, port));
        Some(egress_ok && ingress_ok)
    }

    /// The verdict of one side: endpoint `ep`, direction `d`, the other end `peer_ip`
    /// (`peer_pod` if it is a pod).
    pub fn side_allows(&self, ep: usize, d: Dir, peer_ip: IpAddr, proto: u8, port: u16) -> bool {
        self.side(ep, d, peer_ip, self.pod_by_ip(peer_ip), proto, port)
    }

    fn side(
        &self,
        ep: usize,
        d: Dir,
        peer_ip: IpAddr,
        peer_pod: Option<usize>,
        proto: u8,
        port: u16,
    ) -> bool {
        let selecting: Vec<&RefPolicy> = self
            .policies
            .iter()
            .filter(|p| self.selects(p, ep))
            .collect();
        let isolated = selecting.iter().any(|p| p.isolates[idx(d)]);
        // The best matching rule of a tier: smallest key; at an equal key Deny, then Pass,
        // then Allow. (deny, pass) of it.
        let best = |tier: u8| -> Option<(bool, bool)> {
            let mut best: Option<((i64, u64), u8)> = None;
            for p in &selecting {
                for r in p.rules[idx(d)].iter().filter(|r| r.tier == tier) {
                    if !self.rule_matches(r, ep, d, peer_ip, peer_pod, proto, port) {
                        continue;
                    }
                    let rank = (
                        r.key,
                        if r.deny {
                            0
                        } else if r.pass {
                            1
                        } else {
                            2
                        },
                    );
                    if best.is_none_or(|b| rank < b) {
                        best = Some(rank);
                    }
                }
            }
            best.map(|(_, a)| (a == 0, a == 1))
        };
        for tier in [0, 1] {
            match best(tier) {
                Some((true, _)) => return false,
                Some((false, false)) => return true,
                // A Pass, or no match: the next tier.
                _ => {}
            }
        }
        if isolated {
            return false;
        }
        !matches!(best(2), Some((true, _)))
    }

    /// Whether policy `p` selects endpoint `ep`.
    fn selects(&self, p: &RefPolicy, ep: usize) -> bool {
        let e = &self.pods[ep];
        match &p.namespace {
            Some(ns) => *ns == e.namespace && p.pods.matches(&e.labels),
            None => {
                p.namespaces.matches(&self.labels_of_ns(&e.namespace)) && p.pods.matches(&e.labels)
            }
        }
    }

    /// The endpoints: `(namespace, name)` of every pod with an address.
    pub fn endpoints(&self) -> Vec<(String, String)> {
        self.pods
            .iter()
            .filter(|p| !p.ips.is_empty())
            .map(|p| (p.namespace.clone(), p.name.clone()))
            .collect()
    }

    /// Which rules match and which decide one side of a packet: endpoint `namespace/name`,
    /// direction `d`, the other end `peer_ip`. `None` if the endpoint is not a pod with an
    /// address.
    pub fn side_rules(
        &self,
        namespace: &str,
        name: &str,
        d: Dir,
        peer_ip: IpAddr,
        proto: u8,
        port: u16,
    ) -> Option<SideRules> {
        let ep = self.pod_by_name(namespace, name)?;
        let peer_pod = self.pod_by_ip(peer_ip);
        let selecting: Vec<&RefPolicy> = self
            .policies
            .iter()
            .filter(|p| self.selects(p, ep))
            .collect();
        let mut matching: Vec<&RefRule> = Vec::new();
        for p in &selecting {
            for r in &p.rules[idx(d)] {
                if self.rule_matches(r, ep, d, peer_ip, peer_pod, proto, port) {
                    matching.push(r);
                }
            }
        }
        let mut out = SideRules {
            matching: matching.iter().map(|r| r.name.clone()).collect(),
            deciding: Vec::new(),
        };
        // Tier by tier (§8): the best matching rules of the tier; a Pass hands the packet to
        // the next tier; after the ordnet tier an isolated endpoint is decided by its default.
        let isolated = selecting.iter().any(|p| p.isolates[idx(d)]);
        for tier in [0u8, 1, 2] {
            if tier == 2 && isolated {
                break;
            }
            let rank = |r: &RefRule| {
                (
                    r.key,
                    if r.deny {
                        0
                    } else if r.pass {
                        1
                    } else {
                        2
                    },
                )
            };
            let in_tier: Vec<&&RefRule> = matching.iter().filter(|r| r.tier == tier).collect();
            let Some(best) = in_tier.iter().map(|r| rank(r)).min() else {
                continue;
            };
            if best.1 == 1 && tier < 2 {
                continue;
            }
            out.deciding = in_tier
                .iter()
                .filter(|r| rank(r) == best)
                .map(|r| r.name.clone())
                .collect();
            break;
        }
        Some(out)
    }

    #[allow(clippy::too_many_arguments)]
    fn rule_matches(
        &self,
        r: &RefRule,
        ep: usize,
        d: Dir,
        peer_ip: IpAddr,
        peer_pod: Option<usize>,
        proto: u8,
        port: u16,
    ) -> bool {
        let peer_ok = r.peers.is_empty()
            || r.peers.iter().any(|p| match p {
                RefPeer::Block { cidr, except } => {
                    cidr.contains(&peer_ip) && !except.iter().any(|e| e.contains(&peer_ip))
                }
                RefPeer::Addrs(addrs) => addrs.contains(&peer_ip),
                RefPeer::Pods {
                    namespaces,
                    own,
                    pods,
                } => {
                    let Some(pp) = peer_pod else { return false };
                    let pod = &self.pods[pp];
                    let ns_ok = match (namespaces, own) {
                        (Some(s), _) => s.matches(&self.labels_of_ns(&pod.namespace)),
                        (None, Some(own)) => pod.namespace == *own,
                        (None, None) => true,
                    };
                    ns_ok && pods.as_ref().is_none_or(|s| s.matches(&pod.labels))
                }
            });
        if !peer_ok {
            return false;
        }
        r.ports.is_empty()
            || r.ports.iter().any(|p| {
                if p.protocol != proto {
                    return false;
                }
                match &p.port {
                    None => true,
                    Some(IntOrString::Int(n)) => {
                        let first = i64::from(*n);
                        let last = i64::from(p.end_port.unwrap_or(*n));
                        first <= i64::from(port) && i64::from(port) <= last
                    }
                    Some(IntOrString::String(name)) => {
                        let dest = match d {
                            Dir::Ingress => Some(ep),
                            Dir::Egress => peer_pod,
                        };
                        dest.is_some_and(|i| {
                            self.pods[i]
                                .ports
                                .iter()
                                .any(|(n, pr, num)| n == name && *pr == proto && *num == port)
                        })
                    }
                }
            })
    }
}

/// Namespace labels, with `kubernetes.io/metadata.name` set as the API server does.
fn read_namespaces(objects: &ClusterObjects) -> BTreeMap<String, Labels> {
    let mut ns_labels = BTreeMap::new();
    for ns in &objects.namespaces {
        let name = ns.object.metadata.name.clone().unwrap_or_default();
        let mut labels = ns.object.metadata.labels.clone().unwrap_or_default();
        labels.insert(NAME_LABEL.to_string(), name.clone());
        ns_labels.insert(name, labels);
    }
    ns_labels
}

/// The pods that are endpoints (not host-network, not terminated): addresses and named ports.
fn read_pods(objects: &ClusterObjects) -> Vec<RefPod> {
    let mut pods = Vec::new();
    for p in &objects.pods {
        let pod = &p.object;
        let spec = pod.spec.as_ref();
        // Host-network pods use the node's address; terminated pods (phase Succeeded or
        // Failed) are not endpoints and hold no address.
        let terminated = matches!(
            pod.status.as_ref().and_then(|s| s.phase.as_deref()),
            Some("Succeeded" | "Failed")
        );
        if spec.and_then(|s| s.host_network).unwrap_or(false) || terminated {
            continue;
        }
        let mut ips: Vec<IpAddr> = Vec::new();
        if let Some(st) = &pod.status {
            for t in st
                .pod_ip
                .iter()
                .chain(st.pod_ips.iter().flatten().map(|p| &p.ip))
            {
                if let Ok(ip) = t.parse::<IpAddr>()
                    && !ips.contains(&ip)
                {
                    ips.push(ip);
                }
            }
        }
        let mut ports = Vec::new();
        for c in spec.map(|s| s.containers.as_slice()).unwrap_or_default() {
            for cp in c.ports.iter().flatten() {
                if let (Some(n), Some(pr)) = (&cp.name, proto_number(cp.protocol.as_deref())) {
                    ports.push((n.clone(), pr, cp.container_port as u16));
                }
            }
        }
        pods.push(RefPod {
            namespace: pod
                .metadata
                .namespace
                .clone()
                .unwrap_or_else(|| "default".into()),
            name: pod.metadata.name.clone().unwrap_or_default(),
            labels: pod.metadata.labels.clone().unwrap_or_default(),
            ips,
            ports,
        });
    }
    pods
}

/// A NetworkPolicy with upstream's defaulting: every rule an allow at key (0, 0).
fn read_network_policy(
    np: &k8s_openapi::api::networking::v1::NetworkPolicy,
) -> Result<RefPolicy, String> {
    let ns = np
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "default".into());
    let spec = np.spec.clone().unwrap_or_default();
    let ingress = spec.ingress.unwrap_or_default();
    let egress = spec.egress.unwrap_or_default();
    let types = spec.policy_types.unwrap_or_default();
    let isolates = if types.is_empty() {
        [true, !egress.is_empty()]
    } else {
        [
            types.iter().any(|t| t == "Ingress"),
            types.iter().any(|t| t == "Egress"),
        ]
    };
    let np_peer = |p: &NetworkPolicyPeer| -> Result<RefPeer, String> {
        match &p.ip_block {
            Some(b) => Ok(RefPeer::Block {
                cidr: net(&b.cidr)?,
                except: b
                    .except
                    .iter()
                    .flatten()
                    .map(|e| net(e))
                    .collect::<Result<_, _>>()?,
            }),
            None => Ok(RefPeer::Pods {
                namespaces: sel(p.namespace_selector.as_ref())?,
                own: Some(ns.clone()),
                pods: sel(p.pod_selector.as_ref())?,
            }),
        }
    };
    let np_port = |p: &NetworkPolicyPort| -> Result<RefPort, String> {
        Ok(RefPort {
            protocol: proto_number(p.protocol.as_deref()).ok_or("bad protocol")?,
            port: p.port.clone(),
            end_port: p.end_port,
        })
    };
    let np_name = np.metadata.name.clone().unwrap_or_default();
    // A NetworkPolicy rule: key (0, 0), allow; `peers` are its `from` or `to`.
    let np_rule = |direction: Dir,
                   index: usize,
                   peers: Option<&Vec<NetworkPolicyPeer>>,
                   ports: Option<&Vec<NetworkPolicyPort>>|
     -> Result<RefRule, String> {
        Ok(RefRule {
            name: RuleName {
                kind: "NetworkPolicy",
                namespace: Some(ns.clone()),
                name: np_name.clone(),
                direction,
                index,
            },
            tier: 1,
            key: (0, 0),
            deny: false,
            pass: false,
            peers: peers
                .into_iter()
                .flatten()
                .map(np_peer)
                .collect::<Result<_, _>>()?,
            ports: ports
                .into_iter()
                .flatten()
                .map(np_port)
                .collect::<Result<_, _>>()?,
        })
    };
    let mut rules: [Vec<RefRule>; 2] = [Vec::new(), Vec::new()];
    if isolates[0] {
        for (i, r) in ingress.iter().enumerate() {
            rules[0].push(np_rule(Dir::Ingress, i, r.from.as_ref(), r.ports.as_ref())?);
        }
    }
    if isolates[1] {
        for (i, r) in egress.iter().enumerate() {
            rules[1].push(np_rule(Dir::Egress, i, r.to.as_ref(), r.ports.as_ref())?);
        }
    }
    Ok(RefPolicy {
        namespace: Some(ns.clone()),
        namespaces: Selector::everything(),
        pods: sel(spec.pod_selector.as_ref())?.unwrap_or_default(),
        isolates,
        rules,
    })
}

/// One ordered policy as the reference reads it: (kind, name), namespace, namespace selector,
/// pod selector, priority, `defaultDeny`, ingress and egress rules.
type Ordered<'a> = (
    (&'static str, String),
    Option<String>,
    Selector,
    Selector,
    i32,
    Option<&'a ordnet_crds::DefaultDeny>,
    &'a [ordnet_crds::IngressRule],
    &'a [ordnet_crds::EgressRule],
);

/// The ordered policies the reference reads (staged ones only with `staged`).
fn ordered_inputs(objects: &ClusterObjects, staged: bool) -> Result<Vec<Ordered<'_>>, String> {
    let mut ordered: Vec<Ordered<'_>> = Vec::new();
    let read = |mode: ordnet_crds::PolicyMode| staged || mode.is_enforce();
    for p in objects
        .ordered_policies
        .iter()
        .filter(|p| read(p.object.spec.mode))
    {
        let s = &p.object.spec;
        ordered.push((
            (
                "OrderedNetworkPolicy",
                p.object.metadata.name.clone().unwrap_or_default(),
            ),
            Some(
                p.object
                    .metadata
                    .namespace
                    .clone()
                    .unwrap_or_else(|| "default".into()),
            ),
            Selector::everything(),
            sel(Some(&s.pod_selector))?.unwrap_or_default(),
            s.priority,
            s.default_deny.as_ref(),
            &s.ingress,
            &s.egress,
        ));
    }
    for p in objects
        .cluster_ordered_policies
        .iter()
        .filter(|p| read(p.object.spec.mode))
    {
        let s = &p.object.spec;
        ordered.push((
            (
                "ClusterOrderedNetworkPolicy",
                p.object.metadata.name.clone().unwrap_or_default(),
            ),
            None,
            sel(Some(&s.namespace_selector))?.unwrap_or_default(),
            sel(Some(&s.pod_selector))?.unwrap_or_default(),
            s.priority,
            s.default_deny.as_ref(),
            &s.ingress,
            &s.egress,
        ));
    }
    Ok(ordered)
}

/// Every OrderedNetworkPolicy and ClusterOrderedNetworkPolicy: rules keyed (priority, index),
/// isolation from `defaultDeny` or the presence of an allow rule.
fn read_ordered_policies(objects: &ClusterObjects, staged: bool) -> Result<Vec<RefPolicy>, String> {
    let mut policies = Vec::new();
    let ordered = ordered_inputs(objects, staged)?;
    for ((kind, name), namespace, namespaces, pods, priority, dd, ingress, egress) in ordered {
        let rule_name = |direction: Dir, index: usize| RuleName {
            kind,
            namespace: namespace.clone(),
            name: name.clone(),
            direction,
            index,
        };
        let peer = |p: &ordnet_crds::Peer| -> Result<RefPeer, String> {
            match &p.ip_block {
                Some(b) => Ok(RefPeer::Block {
                    cidr: net(&b.cidr)?,
                    except: b.except.iter().map(|e| net(e)).collect::<Result<_, _>>()?,
                }),
                None => Ok(RefPeer::Pods {
                    namespaces: sel(p.namespace_selector.as_ref())?,
                    own: namespace.clone(),
                    pods: sel(p.pod_selector.as_ref())?,
                }),
            }
        };
        let port = |p: &ordnet_crds::Port| RefPort {
            protocol: p.protocol.number(),
            port: p.port.clone(),
            end_port: p.end_port,
        };
        let deny = |a: ordnet_crds::Action| a == ordnet_crds::Action::Deny;
        let mut rules: [Vec<RefRule>; 2] = [Vec::new(), Vec::new()];
        for (i, r) in ingress.iter().enumerate() {
            rules[0].push(RefRule {
                name: rule_name(Dir::Ingress, i),
                tier: 1,
                key: (i64::from(priority), i as u64),
                deny: deny(r.action),
                pass: false,
                peers: r.from.iter().map(peer).collect::<Result<_, _>>()?,
                ports: r.ports.iter().map(port).collect(),
            });
        }
        for (i, r) in egress.iter().enumerate() {
            rules[1].push(RefRule {
                name: rule_name(Dir::Egress, i),
                tier: 1,
                key: (i64::from(priority), i as u64),
                deny: deny(r.action),
                pass: false,
                peers: r.to.iter().map(peer).collect::<Result<_, _>>()?,
                ports: r.ports.iter().map(port).collect(),
            });
        }
        let has_allow = |d: usize| rules[d].iter().any(|r| !r.deny);
        let isolates = [
            dd.and_then(|d| d.ingress).unwrap_or_else(|| has_allow(0)),
            dd.and_then(|d| d.egress).unwrap_or_else(|| has_allow(1)),
        ];
        policies.push(RefPolicy {
            namespace,
            namespaces,
            pods,
            isolates,
            rules,
        });
    }
    Ok(policies)
}

/// Every upstream ClusterNetworkPolicy: rules of their tier keyed (priority, index); they never
/// isolate. `nodes` peers are the addresses of the Nodes they select.
fn read_cluster_network_policies(objects: &ClusterObjects) -> Result<Vec<RefPolicy>, String> {
    let nodes: Vec<(Labels, Vec<IpAddr>)> = objects
        .nodes
        .iter()
        .map(|n| {
            let addrs = n
                .object
                .status
                .iter()
                .flat_map(|s| s.addresses.iter().flatten())
                .filter(|a| a.type_ == "InternalIP" || a.type_ == "ExternalIP")
                .filter_map(|a| a.address.parse().ok())
                .collect();
            (n.object.metadata.labels.clone().unwrap_or_default(), addrs)
        })
        .collect();
    let mut out = Vec::new();
    for c in &objects.cluster_network_policies {
        let name = c.object.metadata.name.clone().unwrap_or_default();
        let s = &c.object.spec;
        let tier = match s.tier {
            ordnet_crds::CnpTier::Admin => 0,
            ordnet_crds::CnpTier::Baseline => 2,
        };
        let pods_peer = |np: &ordnet_crds::NamespacedPod| -> Result<RefPeer, String> {
            Ok(RefPeer::Pods {
                namespaces: sel(Some(&np.namespace_selector))?,
                own: None,
                pods: sel(Some(&np.pod_selector))?,
            })
        };
        let (namespaces, pods) = match (&s.subject.namespaces, &s.subject.pods) {
            (Some(ns), None) => (sel(Some(ns))?.unwrap_or_default(), Selector::everything()),
            (None, Some(p)) => (
                sel(Some(&p.namespace_selector))?.unwrap_or_default(),
                sel(Some(&p.pod_selector))?.unwrap_or_default(),
            ),
            _ => return Err(format!("ClusterNetworkPolicy {name}: bad subject")),
        };
        let mut rules: [Vec<RefRule>; 2] = [Vec::new(), Vec::new()];
        for (d, direction) in [(0, Dir::Ingress), (1, Dir::Egress)] {
            let list = match direction {
                Dir::Ingress => s.rules(ordnet_crds::Direction::Ingress),
                Dir::Egress => s.rules(ordnet_crds::Direction::Egress),
            };
            for r in list {
                let accept = r.action == ordnet_crds::CnpAction::Accept;
                let mut peers = Vec::new();
                let mut unenforceable = false;
                for p in &r.peers {
                    if let Some(ns) = &p.namespaces {
                        peers.push(RefPeer::Pods {
                            namespaces: sel(Some(ns))?,
                            own: None,
                            pods: None,
                        });
                    } else if let Some(np) = &p.pods {
                        peers.push(pods_peer(np)?);
                    } else if let Some(sel_nodes) = &p.nodes {
                        let sel_nodes = sel(Some(sel_nodes))?.unwrap_or_default();
                        peers.push(RefPeer::Addrs(
                            nodes
                                .iter()
                                .filter(|(l, _)| sel_nodes.matches(l))
                                .flat_map(|(_, a)| a.iter().copied())
                                .collect(),
                        ));
                    } else if let Some(nets) = &p.networks {
                        for n in nets {
                            peers.push(RefPeer::Block {
                                cidr: net(n)?,
                                except: Vec::new(),
                            });
                        }
                    } else {
                        unenforceable = true;
                    }
                }
                let mut ports = Vec::new();
                for p in r.protocols.into_iter().flatten() {
                    let numbered = [(6, &p.tcp), (17, &p.udp), (132, &p.sctp)];
                    if let Some((protocol, x)) = numbered.iter().find(|(_, x)| x.is_some()) {
                        let dp = x.as_ref().and_then(|x| x.destination_port.clone());
                        let (first, last) = match dp {
                            Some(ordnet_crds::CnpPort {
                                number: Some(n), ..
                            }) => (n, n),
                            Some(ordnet_crds::CnpPort {
                                range: Some(rg), ..
                            }) => (rg.start, rg.end),
                            _ => return Err(format!("ClusterNetworkPolicy {name}: bad port")),
                        };
                        ports.push(RefPort {
                            protocol: *protocol,
                            port: Some(IntOrString::Int(first)),
                            end_port: Some(last),
                        });
                    } else if let Some(n) = &p.destination_named_port {
                        for protocol in [6, 17, 132] {
                            ports.push(RefPort {
                                protocol,
                                port: Some(IntOrString::String(n.clone())),
                                end_port: None,
                            });
                        }
                    } else {
                        unenforceable = true;
                    }
                }
                if unenforceable && accept {
                    continue;
                }
                rules[d].push(RefRule {
                    name: RuleName {
                        kind: "ClusterNetworkPolicy",
                        namespace: None,
                        name: name.clone(),
                        direction,
                        index: r.index,
                    },
                    tier,
                    key: (i64::from(s.priority), r.index as u64),
                    deny: unenforceable || r.action == ordnet_crds::CnpAction::Deny,
                    pass: !unenforceable && r.action == ordnet_crds::CnpAction::Pass,
                    peers: if unenforceable { Vec::new() } else { peers },
                    ports: if unenforceable { Vec::new() } else { ports },
                });
            }
        }
        out.push(RefPolicy {
            namespace: None,
            namespaces,
            pods,
            isolates: [false, false],
            rules,
        });
    }
    Ok(out)
}
