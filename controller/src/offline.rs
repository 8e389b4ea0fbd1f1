//! The verdicts of `ordnet matrix` and `ordnet trace`, computed the way the node computes them:
//! each flow is a crafted frame (source address → destination address, protocol, port) decided
//! by `ordnet_datapath_common::decide`, the function the XDP program runs, over the flattened
//! maps of a programmed datapath ([`ControlPlane::decide`]). No separate evaluator is involved;
//! `Engine::flow` only explains (`trace`), and a disagreement between the two is reported as an
//! internal error.
//!
//! Offline, every pod of the engine is programmed as a local endpoint of one in-memory datapath
//! ([`OfflineDatapath`]: a [`MemDatapath`], through [`NodeProgram`], the agent's code path). The
//! agent's debug API calls the same functions ([`matrix`], [`trace`]) over the datapath it
//! programmed for its node (`crate::agent::Enforcer::plane`: the kernel datapath's mirror of
//! its maps, or the `none` datapath's in-memory tables).

use std::net::IpAddr;

use ordnet_datapath::common::craft::{L4, frame_between};
use ordnet_datapath::common::{Decision, Reason, Verdict as XdpVerdict};
use ordnet_datapath::{
    ControlError, ControlPlane, DatapathConfig, DatapathError, MemDatapath, StoreError,
};
use ordnet_engine::{Engine, FlowEnd, FlowTrace, IpFamily, Matrix};
use ordnet_mapstate::{Protocol, Verdict};

use crate::program::{NodeProgram, ProgramError};

/// The source port of crafted frames (policies never look at it).
const SOURCE_PORT: u16 = 40000;

/// Every pod of an engine as a local endpoint of one in-memory datapath.
#[derive(Debug)]
pub struct OfflineDatapath {
    /// The engine → datapath mapping (endpoint ids by `ns/name`).
    pub program: NodeProgram,
    /// The programmed in-memory tables that decide the crafted frames.
    pub datapath: MemDatapath,
}

/// Whether an error says the rule set slots (`.0`) or the cell blocks (`.1`) ran out.
fn store_full(e: &ProgramError) -> (bool, bool) {
    let source = match e {
        ProgramError::Endpoint { source, .. } | ProgramError::Datapath { source, .. } => source,
        _ => return (false, false),
    };
    match source.as_ref() {
        DatapathError::Control(ControlError::Store(StoreError::NoSlot(_))) => (true, false),
        DatapathError::Control(ControlError::Store(StoreError::NoBlock(_))) => (false, true),
        _ => (false, false),
    }
}

impl OfflineDatapath {
    /// Programs every endpoint of `engine`, its ipcache and no host address. The tables are
    /// sized from the engine (distinct MapStates) and grown when they turn out too small.
    pub fn build(engine: &Engine) -> Result<OfflineDatapath, ProgramError> {
        let mut config = DatapathConfig {
            max_rulesets: (engine.shared_mapstates() as u32 + 1).max(16),
            max_blocks: 64,
            grace: std::time::Duration::ZERO,
            ..DatapathConfig::default()
        };
        config.max_blocks = config.max_blocks.max(config.max_rulesets * 4);
        loop {
            let mut datapath = MemDatapath::new(&config).keep_keys_in_store();
            let mut program = NodeProgram::new();
            match program.program_full(engine, &mut datapath) {
                Ok(()) => return Ok(OfflineDatapath { program, datapath }),
                Err(e) => match store_full(&e) {
                    (true, _) if config.max_rulesets < 1 << 20 => config.max_rulesets *= 2,
                    (_, true) if config.max_blocks < 1 << 24 => config.max_blocks *= 2,
                    _ => return Err(e),
                },
            }
        }
    }

    /// The programmed datapath, for [`matrix`] and [`trace`].
    pub fn plane(&self) -> &dyn ControlPlane {
        &self.datapath
    }
}

/// The interface a crafted frame is said to have come in on at the TC hook: not an interface
/// of any endpoint (the crafted frames keep their source address, so no attribution is needed)
/// and not 0 (the node's own packets, which the hook passes).
pub const CRAFTED_IFINDEX: u32 = u32::MAX;

/// `plane`'s decision for a new flow (a TCP SYN, a UDP datagram, an SCTP INIT) from `src` to
/// `dst`; `None` if the two addresses are not of one family.
pub fn decide(
    plane: &dyn ControlPlane,
    src: IpAddr,
    dst: IpAddr,
    proto: Protocol,
    port: u16,
) -> Option<Decision> {
    Some(plane.decide(&new_flow_frame(src, dst, proto, port)?))
}

/// A flow to a Service frontend as the node handles it: the untranslated first packet at the
/// XDP hook (which must defer it, or it is judged there), then, as kube-proxy translates it, the
/// packet to each backend (address, port) at the TC hook. The verdict towards each backend.
pub fn decide_service(
    plane: &dyn ControlPlane,
    src: IpAddr,
    frontend: IpAddr,
    backends: &[(IpAddr, u16)],
    proto: Protocol,
    port: u16,
) -> Option<Vec<Verdict>> {
    let first = plane.decide(&new_flow_frame(src, frontend, proto, port)?);
    if first.verdict == XdpVerdict::Drop {
        return Some(vec![Verdict::Deny; backends.len()]);
    }
    backends
        .iter()
        .map(|(addr, bport)| decide_translated(plane, src, *addr, proto, *bport))
        .collect()
}

/// The verdict of the TC hook for a new flow as it leaves netfilter (translated, possibly with
/// a rewritten source such as a node address), forwarded from an interface of no endpoint.
pub fn decide_translated(
    plane: &dyn ControlPlane,
    src: IpAddr,
    dst: IpAddr,
    proto: Protocol,
    port: u16,
) -> Option<Verdict> {
    let frame = new_flow_frame(src, dst, proto, port)?;
    Some(verdict_of(&plane.decide_tc(&frame, CRAFTED_IFINDEX)))
}

/// The first packet of a new flow: a TCP SYN, a UDP datagram, an SCTP INIT.
fn new_flow_frame(src: IpAddr, dst: IpAddr, proto: Protocol, port: u16) -> Option<Vec<u8>> {
    let l4 = match proto {
        Protocol::Tcp => L4::Tcp {
            sport: SOURCE_PORT,
            dport: port,
        },
        Protocol::Udp => L4::Udp {
            sport: SOURCE_PORT,
            dport: port,
        },
        Protocol::Sctp => L4::Sctp {
            sport: SOURCE_PORT,
            dport: port,
        },
    };
    frame_between(src, dst, l4)
}

fn verdict_of(d: &Decision) -> Verdict {
    match d.verdict {
        XdpVerdict::Pass => Verdict::Allow,
        XdpVerdict::Drop => Verdict::Deny,
    }
}

/// The verdict of [`decide`].
pub fn verdict(
    plane: &dyn ControlPlane,
    src: IpAddr,
    dst: IpAddr,
    proto: Protocol,
    port: u16,
) -> Option<Verdict> {
    decide(plane, src, dst, proto, port).map(|d| verdict_of(&d))
}

/// The address a flow end is probed at, as `Engine::flow` chooses it: an address is itself; a
/// pod is probed at its first address of `family`, else at its first address.
pub fn probe_address(engine: &Engine, end: &FlowEnd, family: IpFamily) -> Option<IpAddr> {
    match end {
        FlowEnd::Ip(ip) => Some(*ip),
        FlowEnd::Pod { namespace, name } => {
            let ep = engine.endpoint(namespace, name)?;
            ep.address(family).or_else(|| ep.ips.first().copied())
        }
    }
}

/// The IP family of a traced flow: the family of an address end, else `default`; the two
/// addresses if both ends are addresses of different families.
pub fn trace_family(
    from: &FlowEnd,
    to: &FlowEnd,
    default: IpFamily,
) -> Result<IpFamily, (IpAddr, IpAddr)> {
    match (from, to) {
        (FlowEnd::Ip(a), FlowEnd::Ip(b)) if a.is_ipv4() != b.is_ipv4() => Err((*a, *b)),
        (FlowEnd::Ip(ip), _) | (_, FlowEnd::Ip(ip)) => Ok(IpFamily::of(*ip)),
        _ => Ok(default),
    }
}

/// Why [`trace`] has no answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TraceError {
    /// The flow cannot be built (an end without an address, ends of two families).
    Input(String),
    /// The datapath and the engine's explanation disagree: a bug.
    Disagreement(String),
}

/// `ordnet trace`: `Engine::flow` explains the flow, and its verdict is replaced by the
/// datapath's, checked against the explanation: the overall verdict and the verdict of each
/// side the datapath looked up must be the explanation's. A flow from or to one of the node's
/// own addresses to a pod (which the datapath never filters, `Reason::Host`; only an agent's
/// datapath knows any) is an input error: no policy explains it. A flow from a pod to a node
/// address is judged like any other (the pod's egress).
pub fn trace(
    engine: &Engine,
    plane: &dyn ControlPlane,
    from: &FlowEnd,
    to: &FlowEnd,
    family: IpFamily,
    proto: Protocol,
    port: u16,
) -> Result<FlowTrace, TraceError> {
    let mut explained = engine.flow(from, to, family, proto, port);
    if let Some(e) = &explained.error {
        return Err(TraceError::Input(e.clone()));
    }
    let addr = |end: &FlowEnd| {
        probe_address(engine, end, family)
            .ok_or_else(|| TraceError::Input(format!("{end} has no address")))
    };
    let (src, dst) = (addr(from)?, addr(to)?);
    let d = decide(plane, src, dst, proto, port).ok_or_else(|| {
        TraceError::Input(format!(
            "{from} is probed at {src} and {to} at {dst}: a flow needs two addresses of one \
             IP family"
        ))
    })?;
    if d.reason == Reason::Host {
        return Err(TraceError::Input(format!(
            "{from} ({src}) -> {to} ({dst}): the source is an address of this node, whose \
             traffic to its pods is never filtered"
        )));
    }
    let verdict = verdict_of(&d);
    let side = |name: &str, dp_side: Option<bool>, engine_side: Option<Verdict>| match (
        dp_side,
        engine_side,
    ) {
        (Some(allow), Some(v)) if (v == Verdict::Allow) != allow => Some(format!(
            "{name}: datapath {}, engine {v}",
            if allow { "allow" } else { "deny" }
        )),
        (Some(_), None) => Some(format!(
            "{name}: the datapath looked it up, the engine has no {name} side"
        )),
        _ => None,
    };
    let mut wrong: Vec<String> = [
        side(
            "egress",
            d.egress.map(|p| p.allow),
            explained.egress.as_ref().map(|s| s.verdict),
        ),
        side(
            "ingress",
            d.ingress.map(|p| p.allow),
            explained.ingress.as_ref().map(|s| s.verdict),
        ),
    ]
    .into_iter()
    .flatten()
    .collect();
    if verdict != explained.verdict {
        wrong.insert(
            0,
            format!(
                "verdict: datapath {verdict} ({:?}), engine {}",
                d.reason, explained.verdict
            ),
        );
    }
    if wrong.is_empty() {
        explained.verdict = verdict;
        Ok(explained)
    } else {
        Err(TraceError::Disagreement(format!(
            "{from} ({src}) -> {to} ({dst}) {proto}/{port}: {}",
            wrong.join("; ")
        )))
    }
}

/// `ordnet matrix`: every endpoint of `engine` with an address of `family` (sorted by
/// `ns/name`, probed at that address), then every external address, as sources and
/// destinations, and every Service (`Engine::service_destinations`, probed at its ClusterIP,
/// [`decide_service`]) as a destination; pairs of two external addresses are left out; a pod
/// with itself is included (the datapath's same-endpoint exemption allows it). Every verdict is a frame decided by
/// `plane`, which judges the sides of its local endpoints only (offline: every pod; an agent:
/// the pods of its node, so an external address that is a pod of another node is judged only
/// on the local side).
pub fn matrix(
    engine: &Engine,
    plane: &dyn ControlPlane,
    proto: Protocol,
    port: u16,
    externals: &[IpAddr],
    family: IpFamily,
) -> Matrix {
    ordnet_engine::matrix_by(
        engine,
        proto,
        port,
        externals,
        family,
        |from, to| {
            verdict(plane, from.addr, to.addr, proto, port).expect("both ends are of one family")
        },
        |from, svc| {
            let targets: Vec<(IpAddr, u16)> =
                svc.backends.iter().map(|(_, a, p)| (*a, *p)).collect();
            decide_service(plane, from.addr, svc.frontend, &targets, proto, port)
                .expect("all addresses are of one family")
        },
    )
}
