//! The query API: endpoints and their MapStates, identities and the ipcache, flow verdicts and
//! traces ([`Engine::flow`], decided only through `MapState::lookup`), and the `ordnet matrix`
//! computation ([`matrix()`]).

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;
use ordnet_mapstate::{
    Decision, Direction, Identity, Key, MapState, Origin, Protocol, StateEntry, Verdict,
};
use serde::Serialize;
use serde::ser::SerializeStruct;

use crate::build::{Endpoint, EndpointPolicy, Engine, IpFamily};
use crate::identity::{IdentityInfo, Signature, longest_prefix};
use crate::model::{EngineError, PeerSpec, Policy, PolicyRef};
use crate::services::ServiceDestination;
use crate::store::{PodKey, pod_key_text};

/// One end of a flow.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FlowEnd {
    /// A pod, probed at its first address of the flow's family (else its first address).
    Pod {
        /// The pod's namespace.
        namespace: String,
        /// The pod's name.
        name: String,
    },
    /// An address; a pod's own address stands for that pod.
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
    /// Allow iff every side present allows (or the flow is exempt); deny when `error` is set.
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
    /// Egress on the source's side, ingress on the destination's.
    pub direction: Direction,
    /// The other end, `ns/name` or an IP address.
    pub peer: String,
    /// The other end's address used for the lookup.
    pub peer_address: IpAddr,
    /// The ipcache identity of `peer_address` ([`Engine::identity_of`]).
    pub peer_identity: Identity,
    /// This side's verdict.
    #[serde(serialize_with = "ser_verdict")]
    pub verdict: Verdict,
    /// What decided `verdict`.
    pub decision: SideDecision,
}

/// Why a flow end cannot be resolved (`ordnet trace --from/--to`, `dump --pod`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResolveError {
    /// The text (trimmed) is neither an IP address nor `namespace/pod`.
    #[error("{0:?} is neither an IP address nor namespace/pod")]
    Syntax(String),
    /// `ns/name` of a pod the engine does not know.
    #[error("no pod {0}")]
    NoPod(String),
    /// `ns/name` of a host-network pod.
    #[error("pod {0} uses the host network: it is not an endpoint")]
    HostNetwork(String),
    /// `ns/name` of a pod whose `status.phase` is `Succeeded` or `Failed`.
    #[error("pod {0} has terminated (Succeeded or Failed): it is not an endpoint")]
    Terminated(String),
    /// `ns/name` of a pod without an address.
    #[error("pod {0} has no address")]
    NoAddress(String),
    /// `ns/name` of a flow's pod end that is unknown, host-network, terminated or unaddressed.
    #[error("{0} is not a pod with an address")]
    NotAnEndpoint(String),
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
    Matched {
        /// The longest matching key (own identity first, then `*`).
        key: Key,
        /// The key's value.
        entry: StateEntry,
    },
    /// Nothing matched: the isolation default applied.
    Default {
        /// Whether the endpoint is isolated in this direction (the default is then deny).
        isolated: bool,
        /// The policies that isolate it ([`EndpointPolicy::isolated_by`]).
        isolated_by: Vec<Arc<Origin>>,
    },
}

impl Engine {
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
        self.shared.get(&keys[dir.index()]).map(|s| &s.policy)
    }

    /// ipcache: the identity of an address (pods' own addresses first, then the longest CIDR
    /// prefix in use, else world).
    pub fn identity_of(&self, ip: IpAddr) -> Identity {
        if let Some(k) = self.pod_addrs.get(&ip)
            && let Some(rec) = self.store.pods.get(k)
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
            if let Some(rec) = self.store.pods.get(k)
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
        self.store
            .policies
            .values()
            .flat_map(|p| p.failed_rules.iter().map(move |r| (&p.id, r)))
    }

    /// The normalized policies, by reference.
    pub fn policies(&self) -> impl Iterator<Item = &Policy> {
        self.store.policies.values().map(|p| &**p)
    }

    /// Number of distinct MapState computations (endpoints with equal inputs share one).
    pub fn shared_mapstates(&self) -> usize {
        self.shared.len()
    }

    /// The keys of every local endpoint's MapStates, summed per direction (ingress, egress):
    /// each endpoint counts its states' keys, shared or not. (The agent's metrics read it after
    /// every change: no name is copied.)
    pub fn endpoint_keys(&self) -> [usize; 2] {
        let mut out = [0; 2];
        for keys in self.ep_keys.values() {
            for (n, key) in out.iter_mut().zip(keys) {
                *n += self.shared.get(key).map_or(0, |s| s.policy.mapstate.len());
            }
        }
        out
    }

    /// Number of identities.
    pub fn identity_count(&self) -> usize {
        self.ids.recs.len()
    }

    /// Number of entries in the selector cache.
    pub fn selector_count(&self) -> usize {
        self.selectors.len()
    }

    /// The identities a peer currently selects (if some policy uses it).
    pub fn selector_identities(&self, spec: &PeerSpec) -> Option<&ordnet_mapstate::IdSet> {
        self.selectors.get(spec).map(|s| &s.ids)
    }

    /// `"namespace/pod"` or an IP address -> a flow end.
    pub fn resolve(&self, s: &str) -> Result<FlowEnd, ResolveError> {
        let s = s.trim();
        if let Ok(ip) = s.parse::<IpAddr>() {
            return Ok(FlowEnd::Ip(ip));
        }
        let Some((ns, name)) = s.split_once('/') else {
            return Err(ResolveError::Syntax(s.to_string()));
        };
        let pod = || format!("{ns}/{name}");
        match self.store.pods.get(&(ns.to_string(), name.to_string())) {
            None => Err(ResolveError::NoPod(pod())),
            Some(rec) if rec.host_network => Err(ResolveError::HostNetwork(pod())),
            Some(rec) if rec.terminal => Err(ResolveError::Terminated(pod())),
            Some(rec) if rec.ips.is_empty() => Err(ResolveError::NoAddress(pod())),
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
    ) -> Result<(IpAddr, Option<PodKey>), ResolveError> {
        match end {
            FlowEnd::Ip(ip) => Ok((*ip, self.pod_addrs.get(ip).cloned())),
            FlowEnd::Pod { namespace, name } => {
                let k = (namespace.clone(), name.clone());
                let rec = self
                    .store
                    .pods
                    .get(&k)
                    .filter(|r| r.addressed())
                    .ok_or_else(|| ResolveError::NotAnEndpoint(format!("{namespace}/{name}")))?;
                let ip = rec
                    .ips
                    .iter()
                    .copied()
                    .find(|ip| family.contains(*ip))
                    .or_else(|| rec.ips.first().copied())
                    .ok_or_else(|| ResolveError::NoAddress(format!("{namespace}/{name}")))?;
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
        Some(self.side_of(
            policy,
            pod_key_text(ep),
            dir,
            peer,
            peer_address,
            proto.number(),
            port,
        ))
    }

    /// One side of a flow: the lookup of the peer at `peer_address` (named `peer`), IP
    /// protocol `protocol` (any: only keys of every protocol apply to others), `port`, in
    /// `policy`, the MapState of endpoint `endpoint` (`ns/name`) in direction `dir`. What `trace`
    /// explains, and what `ordnet observe` names for an event the kernel judged.
    #[allow(clippy::too_many_arguments)]
    pub fn side_of(
        &self,
        policy: &EndpointPolicy,
        endpoint: String,
        dir: Direction,
        peer: String,
        peer_address: IpAddr,
        protocol: u8,
        port: u16,
    ) -> SideTrace {
        let peer_identity = self.identity_of(peer_address);
        let d = policy.mapstate.lookup(Some(peer_identity), protocol, port);
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
        SideTrace {
            endpoint,
            direction: dir,
            peer,
            peer_address,
            peer_identity,
            verdict,
            decision,
        }
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
        self.flow_judged(from, to, family, proto, port, true)
    }

    /// The verdict of a flow through a Service to one of its backends (`to`, at its target
    /// `port`): [`Engine::flow`], except that a pod reaching itself (a hairpin) is judged like
    /// any flow to that backend (SEMANTICS.md §2; upstream ClusterNetworkPolicy's hairpin rule).
    pub fn flow_to_backend(
        &self,
        from: &FlowEnd,
        to: &FlowEnd,
        family: IpFamily,
        proto: Protocol,
        port: u16,
    ) -> FlowTrace {
        self.flow_judged(from, to, family, proto, port, false)
    }

    fn flow_judged(
        &self,
        from: &FlowEnd,
        to: &FlowEnd,
        family: IpFamily,
        proto: Protocol,
        port: u16,
        self_exempt: bool,
    ) -> FlowTrace {
        let failed = |e: ResolveError| FlowTrace {
            verdict: Verdict::Deny,
            exemption: None,
            egress: None,
            ingress: None,
            error: Some(e.to_string()),
        };
        let (src_ip, src_pod) = match self.flow_point(from, family) {
            Ok(x) => x,
            Err(e) => return failed(e),
        };
        let (dst_ip, dst_pod) = match self.flow_point(to, family) {
            Ok(x) => x,
            Err(e) => return failed(e),
        };
        if self_exempt && src_pod.is_some() && src_pod == dst_pod {
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
        Direction::ALL.map(|d| EndpointPolicy {
            mapstate: MapState::new(d, Verdict::Allow),
            isolated: false,
            isolated_by: Vec::new(),
        })
    });
    &e[dir.index()]
}

/// The verdict of every ordered pair of endpoints, and of every endpoint towards every Service,
/// for one protocol and port.
///
/// Serializes as CLI.md's JSON: `{"protocol":"TCP","port":80,"results":[{"from":"x/a","to":"y/b",
/// "verdict":"allow"},...]}` (`endpoints` and `services` are not serialized).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Matrix {
    /// The protocol probed.
    pub protocol: Protocol,
    /// The destination port probed; a Service column probes it as the Service port and each
    /// backend at its target port.
    pub port: u16,
    /// Row/column order: pods (`ns/name`, sorted) then external addresses (as given).
    #[serde(skip)]
    pub endpoints: Vec<String>,
    /// More columns (destinations only): the Services probed (`svc:ns/name`, sorted).
    #[serde(skip)]
    pub services: Vec<String>,
    /// Row-major: for each source in `endpoints`, each destination in `endpoints` then in
    /// `services`; pairs of two external addresses are left out.
    pub results: Vec<MatrixResult>,
}

/// The verdict of one pair: a flow to a pod or an address is allowed or denied; a flow to a
/// Service can also be allowed to some of its backends only.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum MatrixVerdict {
    /// Allowed (towards a Service: to every backend).
    Allow,
    /// Denied (towards a Service: to every backend).
    Deny,
    /// Some backends allowed, some denied.
    Mixed,
}

impl MatrixVerdict {
    /// `allow`, `deny` or `mixed`.
    pub fn as_str(self) -> &'static str {
        match self {
            MatrixVerdict::Allow => "allow",
            MatrixVerdict::Deny => "deny",
            MatrixVerdict::Mixed => "mixed",
        }
    }

    /// The verdict towards a Service from the verdicts towards its backends (at least one).
    pub fn of(backends: impl IntoIterator<Item = Verdict>) -> MatrixVerdict {
        let (mut allow, mut deny) = (false, false);
        for v in backends {
            match v {
                Verdict::Allow => allow = true,
                Verdict::Deny => deny = true,
            }
        }
        match (allow, deny) {
            (true, true) => MatrixVerdict::Mixed,
            (true, false) => MatrixVerdict::Allow,
            _ => MatrixVerdict::Deny,
        }
    }
}

impl From<Verdict> for MatrixVerdict {
    fn from(v: Verdict) -> Self {
        match v {
            Verdict::Allow => MatrixVerdict::Allow,
            Verdict::Deny => MatrixVerdict::Deny,
        }
    }
}

impl PartialEq<Verdict> for MatrixVerdict {
    fn eq(&self, other: &Verdict) -> bool {
        *self == MatrixVerdict::from(*other)
    }
}

impl std::fmt::Display for MatrixVerdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The verdict towards one backend of a Service.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BackendVerdict {
    /// `ns/name` of the backend pod.
    pub to: String,
    /// The flow's verdict at the backend's target port.
    #[serde(serialize_with = "ser_verdict")]
    pub verdict: Verdict,
}

/// One pair of a [`Matrix`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MatrixResult {
    /// The source: `ns/name` or an external address.
    pub from: String,
    /// The destination: `ns/name`, an external address or `svc:ns/name`.
    pub to: String,
    /// The pair's verdict; `mixed` only towards a Service.
    pub verdict: MatrixVerdict,
    /// Towards a Service: the verdict of every backend (serialized only when `mixed`).
    pub backends: Vec<BackendVerdict>,
}

impl Serialize for MatrixResult {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mixed = self.verdict == MatrixVerdict::Mixed;
        let mut st = s.serialize_struct("MatrixResult", if mixed { 4 } else { 3 })?;
        st.serialize_field("from", &self.from)?;
        st.serialize_field("to", &self.to)?;
        st.serialize_field("verdict", &self.verdict)?;
        if mixed {
            st.serialize_field("backends", &self.backends)?;
        }
        st.end()
    }
}

impl Matrix {
    /// The verdict of one pair, if it is in the matrix.
    pub fn verdict(&self, from: &str, to: &str) -> Option<MatrixVerdict> {
        self.results
            .iter()
            .find(|r| r.from == from && r.to == to)
            .map(|r| r.verdict)
    }

    /// Every destination column: `endpoints`, then `services`.
    pub fn destinations(&self) -> impl Iterator<Item = &String> {
        self.endpoints.iter().chain(&self.services)
    }
}

/// Computes the matrix: every pod endpoint with an address of `family` (probed at its first
/// address of that family; the primary one when it is of that family) and every external address,
/// as sources and destinations, and every Service ([`Engine::service_destinations`]) as a
/// destination. A pod with itself is included (always allowed); pairs of two external addresses
/// are not. Each verdict is [`Engine::flow`], i.e. MapState lookups only; towards a Service, the
/// flow to each backend at its target port ([`Engine::flow_to_backend`]: a backend that is the
/// source itself is judged, a hairpin).
pub fn matrix(
    engine: &Engine,
    proto: Protocol,
    port: u16,
    externals: &[IpAddr],
    family: IpFamily,
) -> Matrix {
    let flow_end = |e: &MatrixEnd| match &e.pod {
        Some((namespace, name)) => FlowEnd::Pod {
            namespace: namespace.clone(),
            name: name.clone(),
        },
        None => FlowEnd::Ip(e.addr),
    };
    matrix_by(
        engine,
        proto,
        port,
        externals,
        family,
        |from, to| {
            engine
                .flow(&flow_end(from), &flow_end(to), family, proto, port)
                .verdict
        },
        |from, svc| {
            svc.backends
                .iter()
                .map(|(pod, _, bport)| {
                    let (ns, name) = pod.split_once('/').unwrap_or(("", pod));
                    let to = FlowEnd::Pod {
                        namespace: ns.to_string(),
                        name: name.to_string(),
                    };
                    engine
                        .flow_to_backend(&flow_end(from), &to, family, proto, *bport)
                        .verdict
                })
                .collect()
        },
    )
}

/// One end of a matrix: a pod (`(namespace, name)`) at its address of the family, or an
/// external address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MatrixEnd {
    /// `namespace/name`, or the address.
    pub name: String,
    /// The pod, `None` for an external address.
    pub pod: Option<(String, String)>,
    /// The address probed.
    pub addr: IpAddr,
}

/// The matrix of `engine`'s endpoints and the external addresses of `family` (and the Services
/// as destinations), with the verdict of a pair from `pair` and those of a Service's backends
/// (in the order of [`ServiceDestination::backends`]) from `service`: [`matrix`] decides by
/// MapState lookups, `ordnet::offline::matrix` by the datapath's decision function.
pub fn matrix_by(
    engine: &Engine,
    proto: Protocol,
    port: u16,
    externals: &[IpAddr],
    family: IpFamily,
    mut pair: impl FnMut(&MatrixEnd, &MatrixEnd) -> Verdict,
    mut service: impl FnMut(&MatrixEnd, &ServiceDestination) -> Vec<Verdict>,
) -> Matrix {
    let mut ends: Vec<MatrixEnd> = engine
        .endpoints()
        .iter()
        .filter_map(|ep| {
            ep.address(family).map(|addr| MatrixEnd {
                name: ep.id(),
                pod: Some((ep.namespace.clone(), ep.name.clone())),
                addr,
            })
        })
        .collect();
    ends.extend(
        externals
            .iter()
            .filter(|ip| family.contains(**ip))
            .map(|ip| MatrixEnd {
                name: ip.to_string(),
                pod: None,
                addr: *ip,
            }),
    );
    let services = engine.service_destinations(proto, port, family);
    let mut results = Vec::new();
    for from in &ends {
        for to in &ends {
            if from.pod.is_none() && to.pod.is_none() {
                continue;
            }
            results.push(MatrixResult {
                from: from.name.clone(),
                to: to.name.clone(),
                verdict: pair(from, to).into(),
                backends: Vec::new(),
            });
        }
        for svc in &services {
            let backends: Vec<BackendVerdict> = svc
                .backends
                .iter()
                .zip(service(from, svc))
                .map(|((pod, _, _), verdict)| BackendVerdict {
                    to: pod.clone(),
                    verdict,
                })
                .collect();
            results.push(MatrixResult {
                from: from.name.clone(),
                to: svc.name.clone(),
                verdict: MatrixVerdict::of(backends.iter().map(|b| b.verdict)),
                backends,
            });
        }
    }
    Matrix {
        protocol: proto,
        port,
        endpoints: ends.into_iter().map(|e| e.name).collect(),
        services: services.into_iter().map(|s| s.name).collect(),
        results,
    }
}
