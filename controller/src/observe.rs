//! Verdict events named (`ordnet observe`, `docs/observe.md`): a datapath event
//! ([`Observed`]: the 5-tuple, the verdict, and what decided each direction in the kernel:
//! the peer identity's key with its prefix, the wildcard, the default) attributed to the rules
//! behind it through the engine's MapStates, the same lookups `ordnet trace` explains, and
//! checked against what the kernel says decided; then filtered and rendered.
//!
//! The kernel names the MapState key that decided (or the default); the MapState says which
//! rules that key comes from. The attribution is made with the engine that the datapath was
//! programmed from (the agent resolves a batch of events under the lock that programming holds),
//! and says how it relates to the revision the kernel judged with ([`Attribution`]).

use std::collections::{BTreeMap, VecDeque};
use std::fmt::Write as _;
use std::net::IpAddr;

use ordnet_datapath::{DecidedBy, Observed};
use ordnet_engine::{Endpoint, Engine, FlowEnd, IpFamily, SideDecision, SideTrace};
use ordnet_mapstate::{Direction, Peer, Protocol, Verdict};
use serde::Serialize;

use crate::render::{self, Cell, Style};

/// How an event's attribution relates to the state the kernel judged it with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Attribution {
    /// Judged with the revision the attribution was made with, and the MapState lookups
    /// decide as the kernel said (the same key, or the default, with the same verdict).
    Exact,
    /// Judged with an older revision; the current MapStates decide the same way (the same
    /// key or default and verdict), so the rules named are the current ones of that key.
    Current,
    /// The current MapStates decide differently from what the kernel said (the policy or the
    /// endpoints changed since the packet was judged): the rules named are today's lookup,
    /// not the judgement's.
    Changed,
}

/// One verdict event with the rules that decided it.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct FlowRecord {
    /// Sequence number in the agent's record (increasing by one per event).
    pub seq: u64,
    /// Wall-clock time of the event, milliseconds since the Unix epoch.
    pub time_ms: u64,
    /// The event as the kernel wrote it.
    pub event: Observed,
    /// Protocol name (`TCP`, `UDP`, `SCTP`, `ICMP`, `ICMPv6`, or the number).
    pub protocol: String,
    /// The source's local endpoint (`ns/name`), if it is one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub src_pod: Option<String>,
    /// The destination's local endpoint, if it is one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dst_pod: Option<String>,
    /// The sender's egress lookup, when the kernel judged it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub egress: Option<SideTrace>,
    /// The receiver's ingress lookup, when the kernel judged it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ingress: Option<SideTrace>,
    /// How the attribution relates to the judgement.
    pub attribution: Attribution,
    /// The policy revision the attribution was made with.
    pub attributed_revision: u64,
    /// When staged policies exist and would give this new flow (or denial) another verdict:
    /// that verdict and what would decide it ([`staged_verdict`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub staged: Option<StagedVerdict>,
}

/// The verdict a flow would get with the staged policies enforced, where it differs.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StagedVerdict {
    /// Whether it would be allowed.
    pub allowed: bool,
    /// The sender's egress as it would decide (when the kernel judged it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub egress: Option<SideTrace>,
    /// The receiver's ingress as it would decide (when the kernel judged it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ingress: Option<SideTrace>,
}

/// The verdict of the flow of `r` with the staged policies enforced (`staged`: the agent's
/// staged view), when it differs from the kernel's: judged on the sides the kernel judged (this
/// node's), for a new flow or a denial of TCP, UDP or SCTP (a reply re-checked after a change,
/// and ICMP, are judged by the flow they belong to: not here).
pub fn staged_verdict(staged: &Engine, r: &FlowRecord) -> Option<StagedVerdict> {
    let e = &r.event;
    if e.rechecked() {
        return None;
    }
    let proto = Protocol::from_number(e.protocol)?;
    let end =
        |pod: &Option<String>, ip: IpAddr| match pod.as_deref().and_then(|p| p.split_once('/')) {
            Some((ns, name)) => FlowEnd::Pod {
                namespace: ns.to_string(),
                name: name.to_string(),
            },
            None => FlowEnd::Ip(ip),
        };
    let family = if e.dst.is_ipv4() {
        IpFamily::V4
    } else {
        IpFamily::V6
    };
    let t = staged.flow(
        &end(&r.src_pod, e.src),
        &end(&r.dst_pod, e.dst),
        family,
        proto,
        e.dport,
    );
    let egress = t.egress.filter(|_| e.egress.0 != DecidedBy::None);
    let ingress = t.ingress.filter(|_| e.ingress.0 != DecidedBy::None);
    let allowed = [&egress, &ingress]
        .into_iter()
        .flatten()
        .all(|s| s.verdict == Verdict::Allow);
    (allowed != e.allowed).then_some(StagedVerdict {
        allowed,
        egress,
        ingress,
    })
}

/// The protocol's name.
pub fn protocol_name(p: u8) -> String {
    match p {
        1 => "ICMP".into(),
        6 => "TCP".into(),
        17 => "UDP".into(),
        58 => "ICMPv6".into(),
        132 => "SCTP".into(),
        n => n.to_string(),
    }
}

/// The local endpoints by address, and by the host-side interface the datapath knows them by
/// (built once per batch of events).
pub struct Endpoints<'e> {
    by_ip: BTreeMap<IpAddr, &'e Endpoint>,
    by_ifindex: BTreeMap<u32, &'e Endpoint>,
}

impl<'e> Endpoints<'e> {
    /// The engine's local endpoints by each of their addresses.
    pub fn of(engine: &'e Engine) -> Endpoints<'e> {
        Endpoints {
            by_ip: engine
                .endpoints()
                .iter()
                .flat_map(|ep| ep.ips.iter().map(move |ip| (*ip, ep)))
                .collect(),
            by_ifindex: BTreeMap::new(),
        }
    }

    /// Also by interface: the datapath's interfaces of local endpoints (ifindex and an address
    /// of the endpoint, `ControlPlane::control().interfaces()`). A packet the TC hook
    /// attributed to the endpoint of the interface it came in on (its source address rewritten:
    /// kube-proxy's masquerade) is attributed to it here too.
    pub fn with_interfaces(mut self, interfaces: impl IntoIterator<Item = (u32, IpAddr)>) -> Self {
        for (ifindex, ip) in interfaces {
            if let Some(ep) = self.by_ip.get(&ip).copied() {
                self.by_ifindex.insert(ifindex, ep);
            }
        }
        self
    }

    fn get(&self, ip: IpAddr) -> Option<&'e Endpoint> {
        self.by_ip.get(&ip).copied()
    }

    /// The source endpoint of event `e`: its address's, else (at TC) its interface's.
    fn source(&self, e: &Observed) -> Option<&'e Endpoint> {
        self.get(e.src).or_else(|| {
            (e.hook == "tc" && e.ifindex != 0)
                .then(|| self.by_ifindex.get(&e.ifindex).copied())
                .flatten()
        })
    }
}

/// The datapath's interfaces of local endpoints as (ifindex, an address of the endpoint), for
/// [`Endpoints::with_interfaces`].
pub fn interfaces(plane: &dyn ordnet_datapath::ControlPlane) -> Vec<(u32, IpAddr)> {
    use ordnet_datapath::common::layout::{IFACE_HAS_V4, IFACE_HAS_V6};
    let v4 = |w: u32| IpAddr::from(w.to_ne_bytes());
    let v6 = |w: [u32; 4]| IpAddr::from(ordnet_datapath::common::addr_bytes(w));
    plane
        .control()
        .interfaces()
        .iter()
        .filter_map(|(ifindex, i)| {
            if i.flags & IFACE_HAS_V4 != 0 {
                Some((*ifindex, v4(i.addr4)))
            } else if i.flags & IFACE_HAS_V6 != 0 {
                Some((*ifindex, v6(i.addr6)))
            } else {
                None
            }
        })
        .collect()
}

/// One side's lookup in the engine's MapState of `ep` (the lookup `trace` explains).
fn side(
    engine: &Engine,
    ep: &Endpoint,
    dir: Direction,
    peer: IpAddr,
    peer_pod: Option<&Endpoint>,
    protocol: u8,
    port: u16,
) -> SideTrace {
    engine.side_of(
        engine.policy(ep, dir),
        ep.id(),
        dir,
        peer_pod.map_or_else(|| peer.to_string(), |p| p.id()),
        peer,
        protocol,
        port,
    )
}

/// Whether the engine's lookup `s` decided as the kernel said (`by`, `allowed`).
fn agrees(s: &SideTrace, by: DecidedBy, allowed: bool) -> bool {
    let same_prefix = |key: &ordnet_mapstate::Key, protocol, port, length: u8| {
        key.prefix.raw() | u32::from(key.prefix.len())
            == ordnet_datapath::common::layout::prefix_bits(protocol, port, u32::from(length))
    };
    let kind = match (&s.decision, by) {
        (
            SideDecision::Matched { key, .. },
            DecidedBy::Key {
                protocol,
                port,
                length,
            },
        ) => matches!(key.peer, Peer::Id(_)) && same_prefix(key, protocol, port, length),
        (
            SideDecision::Matched { key, .. },
            DecidedBy::Wildcard {
                protocol,
                port,
                length,
            },
        ) => key.peer == Peer::Any && same_prefix(key, protocol, port, length),
        (SideDecision::Default { .. }, DecidedBy::Default) => true,
        _ => false,
    };
    kind && (s.verdict == Verdict::Allow) == allowed
}

/// Attributes event `e` (sequence number `seq`, wall-clock `time_ms`) with `engine`, whose
/// state is the datapath's at policy revision `revision`.
pub fn attribute(
    engine: &Engine,
    endpoints: &Endpoints<'_>,
    revision: u64,
    seq: u64,
    time_ms: u64,
    e: &Observed,
) -> FlowRecord {
    let (src_ep, dst_ep) = (endpoints.source(e), endpoints.get(e.dst));
    // A source attributed by its interface is judged with the endpoint's own address (the
    // kernel takes that endpoint's record, identity included).
    let src = match src_ep {
        Some(ep) if endpoints.get(e.src).is_none() => ep
            .ips
            .iter()
            .copied()
            .find(|ip| ip.is_ipv4() == e.src.is_ipv4())
            .unwrap_or(e.src),
        _ => e.src,
    };
    // The flow judged: the packet's direction, or for a reply re-checked after a change, its
    // flow's original one (the reply's source is the flow's destination).
    let judge = |reversed: bool| {
        let (from, from_ep, to, to_ep, port) = if reversed {
            (e.dst, dst_ep, src, src_ep, e.sport)
        } else {
            (src, src_ep, e.dst, dst_ep, e.dport)
        };
        let egress = (e.egress.0 != DecidedBy::None)
            .then_some(from_ep)
            .flatten()
            .map(|ep| side(engine, ep, Direction::Egress, to, to_ep, e.protocol, port));
        let ingress = (e.ingress.0 != DecidedBy::None)
            .then_some(to_ep)
            .flatten()
            .map(|ep| {
                side(
                    engine,
                    ep,
                    Direction::Ingress,
                    from,
                    from_ep,
                    e.protocol,
                    port,
                )
            });
        let ok = |s: &Option<SideTrace>, (by, allowed): (DecidedBy, bool)| match s {
            Some(s) => agrees(s, by, allowed),
            None => by == DecidedBy::None,
        };
        let agree = ok(&egress, e.egress) && ok(&ingress, e.ingress);
        (egress, ingress, agree)
    };
    let (mut egress, mut ingress, mut agree) = judge(false);
    if !agree && e.rechecked() {
        let reversed = judge(true);
        if reversed.2 {
            (egress, ingress, agree) = reversed;
        }
    }
    let attribution = match (agree, e.revision == revision) {
        (true, true) => Attribution::Exact,
        (true, false) => Attribution::Current,
        (false, _) => Attribution::Changed,
    };
    FlowRecord {
        seq,
        time_ms,
        event: e.clone(),
        protocol: protocol_name(e.protocol),
        src_pod: src_ep.map(|p| p.id()),
        dst_pod: dst_ep.map(|p| p.id()),
        egress,
        ingress,
        attribution,
        attributed_revision: revision,
        staged: None,
    }
}

/// Attributes a batch of raw events (numbered from `first_seq`) with `engine`, the state the
/// datapath `plane` was programmed from (its revision and interfaces); their times converted
/// from the programs' monotonic clock to the wall clock.
pub fn attribute_batch(
    engine: &Engine,
    plane: &dyn ordnet_datapath::ControlPlane,
    raw: &[ordnet_datapath::common::event::FlowEvent],
    first_seq: u64,
) -> Vec<FlowRecord> {
    let endpoints = Endpoints::of(engine).with_interfaces(interfaces(plane));
    let revision = plane.revision();
    let now = ordnet_datapath::monotonic_ns();
    let wall = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    raw.iter()
        .zip(first_seq..)
        .map(|(e, seq)| {
            let o = Observed::of(e);
            let t = wall.saturating_sub(now.saturating_sub(o.time_ns) / 1_000_000);
            attribute(engine, &endpoints, revision, seq, t, &o)
        })
        .collect()
}

/// What `ordnet observe` shows (every field unset = everything).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Filter {
    /// A pod (`ns/name`) at either end.
    pub pod: Option<String>,
    /// A namespace of either end's pod.
    pub namespace: Option<String>,
    /// Only allowed (`Some(true)`) or denied (`Some(false)`) events.
    pub allowed: Option<bool>,
    /// Only events whose lookup of this direction was made.
    pub direction: Option<Direction>,
    /// A policy (`name` or `ns/name`) among the rules named or the isolating policies.
    pub policy: Option<String>,
    /// IP protocol number.
    pub protocol: Option<u8>,
    /// Destination port.
    pub port: Option<u16>,
}

impl Filter {
    /// Whether record `r` passes the filter.
    pub fn matches(&self, r: &FlowRecord) -> bool {
        let pods = [r.src_pod.as_deref(), r.dst_pod.as_deref()];
        if let Some(p) = &self.pod
            && !pods.contains(&Some(p.as_str()))
        {
            return false;
        }
        if let Some(ns) = &self.namespace
            && !pods
                .iter()
                .flatten()
                .any(|p| p.split_once('/').is_some_and(|(n, _)| n == ns))
        {
            return false;
        }
        if self.allowed.is_some_and(|a| a != r.event.allowed) {
            return false;
        }
        match self.direction {
            Some(Direction::Egress) if r.egress.is_none() => return false,
            Some(Direction::Ingress) if r.ingress.is_none() => return false,
            _ => {}
        }
        if self.protocol.is_some_and(|p| p != r.event.protocol)
            || self.port.is_some_and(|p| p != r.event.dport)
        {
            return false;
        }
        if let Some(policy) = &self.policy {
            let named = |o: &ordnet_mapstate::Origin| {
                o.name == *policy
                    || o.namespace
                        .as_ref()
                        .is_some_and(|ns| format!("{ns}/{}", o.name) == *policy)
            };
            let hit = [&r.egress, &r.ingress]
                .into_iter()
                .flatten()
                .any(|s| match &s.decision {
                    SideDecision::Matched { entry, .. } => entry.origins.iter().any(|o| named(o)),
                    SideDecision::Default { isolated_by, .. } => {
                        isolated_by.iter().any(|o| named(o))
                    }
                });
            if !hit {
                return false;
            }
        }
        true
    }
}

/// The agent's bounded record of the last events, numbered.
#[derive(Debug)]
pub struct Journal {
    records: VecDeque<FlowRecord>,
    capacity: usize,
    next: u64,
    /// Events dropped from the front to keep the record bounded.
    pub evicted: u64,
}

impl Journal {
    /// A record of at most `capacity` events.
    pub fn new(capacity: usize) -> Journal {
        Journal {
            records: VecDeque::with_capacity(capacity.min(4096)),
            capacity: capacity.max(1),
            next: 1,
            evicted: 0,
        }
    }

    /// The sequence number the next event gets.
    pub fn next_seq(&self) -> u64 {
        self.next
    }

    /// Appends a record (its `seq` must be [`Journal::next_seq`]).
    pub fn push(&mut self, r: FlowRecord) {
        debug_assert_eq!(r.seq, self.next);
        self.next = r.seq + 1;
        if self.records.len() == self.capacity {
            self.records.pop_front();
            self.evicted += 1;
        }
        self.records.push_back(r);
    }

    /// The records after sequence number `since` that pass `filter`, the last `last` of them.
    pub fn select(&self, since: u64, filter: &Filter, last: usize) -> Vec<FlowRecord> {
        let mut out: Vec<FlowRecord> = self
            .records
            .iter()
            .filter(|r| r.seq > since && filter.matches(r))
            .cloned()
            .collect();
        if out.len() > last {
            out.drain(..out.len() - last);
        }
        out
    }

    /// Events held.
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }
}

/// The answer of the agent's `/v1/observe` (JSON): the records and the sequence number to ask
/// `since` next.
#[derive(Debug, Clone, Serialize)]
pub struct Page<R> {
    /// The records, oldest first.
    pub records: Vec<R>,
    /// The highest sequence number handed out so far (ask `since=` it for what follows).
    pub last: u64,
}

/// A time of day in UTC, `HH:MM:SS.mmm`.
fn clock(time_ms: u64) -> String {
    let s = time_ms / 1000;
    format!(
        "{:02}:{:02}:{:02}.{:03}",
        (s / 3600) % 24,
        (s / 60) % 60,
        s % 60,
        time_ms % 1000
    )
}

/// One record as text: a line for the flow and the verdict, then for each side judged the
/// rows `ordnet trace` prints for what decided it (the key and its rules, or the default and
/// what isolates the endpoint).
pub fn text(r: &FlowRecord, style: Style) -> String {
    let e = &r.event;
    let end = |ip: IpAddr, port: u16, pod: &Option<String>| {
        let at = if matches!(e.protocol, 6 | 17 | 132) {
            match ip {
                IpAddr::V6(_) => format!("[{ip}]:{port}"),
                IpAddr::V4(_) => format!("{ip}:{port}"),
            }
        } else {
            ip.to_string()
        };
        match pod {
            Some(p) => format!("{p} ({at})"),
            None => at,
        }
    };
    let verdict = if e.allowed {
        Verdict::Allow
    } else {
        Verdict::Deny
    };
    let mut out = String::new();
    let _ = write!(
        out,
        "{} {} {} {} -> {} {} at {}, revision {}",
        clock(r.time_ms),
        style.verdict(verdict, &verdict.as_str().to_uppercase()),
        r.protocol,
        end(e.src, e.sport, &r.src_pod),
        end(e.dst, e.dport, &r.dst_pod),
        e.reason,
        e.hook,
        e.revision
    );
    if e.packets > 1 {
        let _ = write!(
            out,
            ", {} packets over {:.1} s",
            e.packets,
            e.time_ns.saturating_sub(e.first_ns) as f64 / 1e9
        );
    }
    match r.attribution {
        Attribution::Exact => {}
        Attribution::Current => {
            let _ = write!(
                out,
                " (attributed with revision {}: decided the same way)",
                r.attributed_revision
            );
        }
        Attribution::Changed => {
            let _ = write!(
                out,
                " (the state changed since: revision {} decides differently; the rules shown are its)",
                r.attributed_revision
            );
        }
    }
    out.push('\n');
    sides(&mut out, [&r.egress, &r.ingress], "  ", style);
    if let Some(st) = &r.staged {
        let would = if st.allowed {
            Verdict::Allow
        } else {
            Verdict::Deny
        };
        let _ = writeln!(
            out,
            "  staged policies would {} it:",
            style.verdict(would, &would.as_str().to_uppercase())
        );
        sides(&mut out, [&st.egress, &st.ingress], "    ", style);
    }
    out
}

/// Each side's verdict and what decided it, indented by `indent`.
fn sides(out: &mut String, sides: [&Option<SideTrace>; 2], indent: &str, style: Style) {
    for s in sides.into_iter().flatten() {
        let _ = writeln!(
            out,
            "{indent}{} of {}: {}",
            s.direction.as_str(),
            s.endpoint,
            style.verdict(s.verdict, s.verdict.as_str())
        );
        let mut rows: Vec<Vec<Cell>> = Vec::new();
        render::trace::decision_rows(s, &mut |k: &str, v: String| {
            rows.push(vec![Cell::plain(format!("{indent}  {k}")), Cell::plain(v)]);
        });
        out.push_str(&render::table(&rows, &[], 2));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ordnet_datapath::common::event::{
        BY_ALLOWED, BY_DEFAULT, BY_KEY, BY_NONE, BY_WILDCARD, FlowEvent,
    };
    use ordnet_datapath::common::layout::prefix_bits;

    const CLUSTER: &str = "
apiVersion: v1
kind: Namespace
metadata: {name: x, labels: {name: x}}
---
apiVersion: v1
kind: Pod
metadata: {name: a, namespace: x, labels: {app: a}}
spec: {nodeName: n1, containers: [{name: c, image: i}]}
status: {podIP: 10.0.0.1}
---
apiVersion: v1
kind: Pod
metadata: {name: b, namespace: x, labels: {app: b}}
spec: {nodeName: n1, containers: [{name: c, image: i}]}
status: {podIP: 10.0.0.2}
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: b-from-a, namespace: x}
spec:
  podSelector: {matchLabels: {app: b}}
  policyTypes: [Ingress]
  ingress: [{from: [{podSelector: {matchLabels: {app: a}}}], ports: [{protocol: TCP, port: 80}]}]
";

    fn engine() -> Engine {
        let out = ordnet_crds::load_str(std::path::Path::new("t.yaml"), CLUSTER);
        assert!(
            out.problems.iter().all(|p| !p.is_error()),
            "{:?}",
            out.problems
        );
        Engine::build(&out.objects)
    }

    /// An event a -> b on TCP `port`, judged with `revision`, the ingress decided as `ingress`.
    fn event(port: u16, revision: u64, allowed: bool, ingress: (u8, u32)) -> Observed {
        let w = |last: u8| {
            let mut b = [0u8; 16];
            b[..4].copy_from_slice(&[10, 0, 0, last]);
            ordnet_datapath::common::addr_words(b)
        };
        Observed::of(&FlowEvent {
            revision,
            packets: 1,
            hook: 1,
            verdict: if allowed { 1 } else { 2 },
            reason: if allowed { 1 } else { 4 },
            family: 4,
            protocol: 6,
            egress: BY_DEFAULT | BY_ALLOWED,
            ingress: ingress.0,
            sport: 40000,
            dport: port,
            ingress_prefix: ingress.1,
            src: w(1),
            dst: w(2),
            ..FlowEvent::default()
        })
    }

    #[test]
    fn attribution_names_the_rule_and_says_how_it_relates_to_the_judgement() {
        let engine = engine();
        let eps = Endpoints::of(&engine);
        let key80 = (BY_KEY | BY_ALLOWED, prefix_bits(6, 80, 24));
        // Allowed by b's ingress key for TCP/80: the NetworkPolicy's rule, exact.
        let r = attribute(&engine, &eps, 3, 1, 0, &event(80, 3, true, key80));
        assert_eq!(r.attribution, Attribution::Exact);
        assert_eq!(
            (r.src_pod.as_deref(), r.dst_pod.as_deref()),
            (Some("x/a"), Some("x/b"))
        );
        let ingress = r.ingress.as_ref().expect("the ingress side");
        match &ingress.decision {
            SideDecision::Matched { entry, .. } => {
                assert_eq!(entry.origins[0].name, "b-from-a");
                assert_eq!(entry.origins[0].rule_index, 0);
            }
            d => panic!("{d:?}"),
        }
        assert!(matches!(
            r.egress.as_ref().unwrap().decision,
            SideDecision::Default {
                isolated: false,
                ..
            }
        ));
        // Judged with an older revision that decides the same way: current.
        let r = attribute(&engine, &eps, 4, 2, 0, &event(80, 3, true, key80));
        assert_eq!(r.attribution, Attribution::Current);
        // Denied by b's default on TCP/81, isolated by the policy.
        let r = attribute(
            &engine,
            &eps,
            3,
            3,
            0,
            &event(81, 3, false, (BY_DEFAULT, 0)),
        );
        assert_eq!(r.attribution, Attribution::Exact);
        match &r.ingress.as_ref().unwrap().decision {
            SideDecision::Default {
                isolated,
                isolated_by,
            } => {
                assert!(isolated);
                assert_eq!(isolated_by[0].name, "b-from-a");
            }
            d => panic!("{d:?}"),
        }
        // The kernel says a wildcard decided where the engine has the default: changed.
        let r = attribute(
            &engine,
            &eps,
            3,
            4,
            0,
            &event(81, 3, false, (BY_WILDCARD, 0)),
        );
        assert_eq!(r.attribution, Attribution::Changed);
        // A side the kernel did not judge is not attributed.
        let r = attribute(&engine, &eps, 3, 5, 0, &event(80, 3, true, (BY_NONE, 0)));
        assert!(r.ingress.is_none());
        assert_eq!(r.attribution, Attribution::Exact);
    }

    /// A staged ClusterOrderedNetworkPolicy that would deny a -> b on TCP/80 (which the
    /// NetworkPolicy allows) and allow a -> b on TCP/81 (which b's isolation denies): the
    /// staged view judges both events differently, naming the staged rule; a flow the staged
    /// policy does not touch, a side the kernel did not judge, and a re-checked reply get none.
    #[test]
    fn the_staged_view_names_what_would_decide_differently() {
        let staged_policy = "
---
apiVersion: ordnet.io/v1alpha1
kind: ClusterOrderedNetworkPolicy
metadata: {name: lock}
spec:
  mode: Staged
  priority: -5
  podSelector: {matchLabels: {app: b}}
  ingress:
  - {action: Deny, ports: [{protocol: TCP, port: 80}]}
  - {action: Allow, ports: [{protocol: TCP, port: 81}]}
";
        let text = format!("{CLUSTER}{staged_policy}");
        let out = ordnet_crds::load_str(std::path::Path::new("t.yaml"), &text);
        let enforced = Engine::build(&out.objects);
        let view = Engine::build_with(
            &out.objects,
            &ordnet_engine::BuildOptions {
                staged: true,
                ..Default::default()
            },
        );
        let eps = Endpoints::of(&enforced);
        let key80 = (BY_KEY | BY_ALLOWED, prefix_bits(6, 80, 24));
        let allowed = attribute(&enforced, &eps, 3, 1, 0, &event(80, 3, true, key80));
        let st = staged_verdict(&view, &allowed).expect("would be denied");
        assert!(!st.allowed);
        match &st.ingress.as_ref().unwrap().decision {
            SideDecision::Matched { entry, .. } => {
                assert_eq!(
                    (entry.origins[0].name.as_str(), entry.origins[0].rule_index),
                    ("lock", 0)
                );
            }
            d => panic!("{d:?}"),
        }
        let denied = attribute(
            &enforced,
            &eps,
            3,
            2,
            0,
            &event(81, 3, false, (BY_DEFAULT, 0)),
        );
        let st = staged_verdict(&view, &denied).expect("would be allowed");
        assert!(st.allowed);
        let out = text_of(&denied, st);
        assert!(out.contains("staged policies would ALLOW it"), "{out}");
        assert!(
            out.contains("ClusterOrderedNetworkPolicy lock, ingress rule 1"),
            "{out}"
        );
        // Unchanged: b's isolation denies TCP/82 either way.
        let other = attribute(
            &enforced,
            &eps,
            3,
            3,
            0,
            &event(82, 3, false, (BY_DEFAULT, 0)),
        );
        assert!(staged_verdict(&view, &other).is_none());
        // The kernel judged no ingress here: nothing of the staged ingress rule applies.
        let egress_only = attribute(&enforced, &eps, 3, 4, 0, &event(80, 3, true, (BY_NONE, 0)));
        assert!(staged_verdict(&view, &egress_only).is_none());
    }

    fn text_of(r: &FlowRecord, st: StagedVerdict) -> String {
        let mut r = r.clone();
        r.staged = Some(st);
        text(&r, Style::new(false))
    }

    #[test]
    fn filters_and_the_bounded_journal() {
        let engine = engine();
        let eps = Endpoints::of(&engine);
        let mut j = Journal::new(3);
        for (i, port) in [80u16, 81, 80, 81, 81].into_iter().enumerate() {
            let allowed = port == 80;
            let ingress = if allowed {
                (BY_KEY | BY_ALLOWED, prefix_bits(6, 80, 24))
            } else {
                (BY_DEFAULT, 0)
            };
            let r = attribute(
                &engine,
                &eps,
                1,
                j.next_seq(),
                i as u64,
                &event(port, 1, allowed, ingress),
            );
            j.push(r);
        }
        assert_eq!((j.len(), j.evicted, j.next_seq()), (3, 2, 6));
        let all = Filter::default();
        let seqs = |v: Vec<FlowRecord>| v.iter().map(|r| r.seq).collect::<Vec<_>>();
        assert_eq!(seqs(j.select(0, &all, 10)), vec![3, 4, 5]);
        assert_eq!(seqs(j.select(0, &all, 2)), vec![4, 5]);
        assert_eq!(seqs(j.select(4, &all, 10)), vec![5]);
        let denied = Filter {
            allowed: Some(false),
            ..Filter::default()
        };
        assert_eq!(seqs(j.select(0, &denied, 10)), vec![4, 5]);
        let by_policy = |p: &str| Filter {
            policy: Some(p.into()),
            ..Filter::default()
        };
        // The rule's policy and the isolating policy both match, by name or ns/name.
        assert_eq!(seqs(j.select(0, &by_policy("b-from-a"), 10)), vec![3, 4, 5]);
        assert_eq!(
            seqs(j.select(0, &by_policy("x/b-from-a"), 10)),
            vec![3, 4, 5]
        );
        assert!(j.select(0, &by_policy("other"), 10).is_empty());
        let pod = |p: &str| Filter {
            pod: Some(p.into()),
            ..Filter::default()
        };
        assert_eq!(j.select(0, &pod("x/a"), 10).len(), 3);
        assert!(j.select(0, &pod("x/c"), 10).is_empty());
        let egress_only = Filter {
            direction: Some(Direction::Egress),
            port: Some(81),
            ..Filter::default()
        };
        assert_eq!(seqs(j.select(0, &egress_only, 10)), vec![4, 5]);
        // The text names the rule as trace does.
        let text = text(&j.select(0, &all, 1)[0], Style::new(false));
        assert!(
            text.contains("DENY TCP x/a (10.0.0.1:40000) -> x/b (10.0.0.2:81)"),
            "{text}"
        );
        assert!(
            text.contains("isolated for ingress by NetworkPolicy x/b-from-a"),
            "{text}"
        );
    }
}
