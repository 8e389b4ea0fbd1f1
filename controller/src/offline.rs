//! The verdicts of the offline CLI (`ordnet matrix`, `ordnet trace`), computed the way the
//! node computes them: every pod of the engine is programmed as a local endpoint of one
//! in-memory datapath ([`MemDatapath`], through [`NodeProgram`], the agent's code path), and
//! each flow is a crafted frame (source address → destination address, protocol, port) decided
//! by `ordnet_datapath_common::decide`, the function the XDP program runs, over the flattened
//! maps. No separate evaluator is involved; `Engine::flow` only explains (`trace`), and a
//! disagreement between the two is reported as an internal error.

use std::net::IpAddr;

use ordnet_datapath::common::craft::{L4, frame_between};
use ordnet_datapath::common::{Decision, Verdict as XdpVerdict};
use ordnet_datapath::{
    ControlError, ControlPlane as _, DatapathConfig, DatapathError, MemDatapath, StoreError,
};
use ordnet_engine::{Engine, FlowEnd, IpFamily, Matrix, MatrixResult};
use ordnet_mapstate::{Protocol, Verdict};

use crate::program::{NodeProgram, ProgramError};

/// The source port of crafted frames (policies never look at it).
const SOURCE_PORT: u16 = 40000;

/// Every pod of an engine as a local endpoint of one in-memory datapath.
#[derive(Debug)]
pub struct OfflineDatapath {
    pub program: NodeProgram,
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
            let mut datapath = MemDatapath::new(&config);
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

    /// The datapath's decision for a new flow (a TCP SYN, a UDP datagram, an SCTP INIT) from
    /// `src` to `dst`; `None` if the two addresses are not of one family.
    pub fn decide(&self, src: IpAddr, dst: IpAddr, proto: Protocol, port: u16) -> Option<Decision> {
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
        let frame = frame_between(src, dst, l4)?;
        Some(self.datapath.decide(&frame))
    }

    /// The verdict of [`OfflineDatapath::decide`].
    pub fn verdict(&self, src: IpAddr, dst: IpAddr, proto: Protocol, port: u16) -> Option<Verdict> {
        self.decide(src, dst, proto, port).map(|d| match d.verdict {
            XdpVerdict::Pass => Verdict::Allow,
            XdpVerdict::Drop => Verdict::Deny,
        })
    }
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

/// Why [`trace_verdict`] has no verdict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TraceError {
    /// The flow cannot be built (an end without an address, ends of two families).
    Input(String),
    /// The datapath and the engine's explanation disagree: a bug.
    Disagreement(String),
}

/// The datapath's verdict of the flow that `explained` (`Engine::flow` of the same ends,
/// family, protocol and port) explains, checked against it: the overall verdict and the verdict
/// of each side the datapath looked up must be the explanation's.
#[allow(clippy::too_many_arguments)]
pub fn trace_verdict(
    engine: &Engine,
    dp: &OfflineDatapath,
    from: &FlowEnd,
    to: &FlowEnd,
    family: IpFamily,
    proto: Protocol,
    port: u16,
    explained: &ordnet_engine::FlowTrace,
) -> Result<Verdict, TraceError> {
    let addr = |end: &FlowEnd| {
        probe_address(engine, end, family)
            .ok_or_else(|| TraceError::Input(format!("{end} has no address")))
    };
    let (src, dst) = (addr(from)?, addr(to)?);
    let d = dp.decide(src, dst, proto, port).ok_or_else(|| {
        TraceError::Input(format!(
            "{from} is probed at {src} and {to} at {dst}: a flow needs two addresses of one \
             IP family"
        ))
    })?;
    let verdict = match d.verdict {
        XdpVerdict::Pass => Verdict::Allow,
        XdpVerdict::Drop => Verdict::Deny,
    };
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
        Ok(verdict)
    } else {
        Err(TraceError::Disagreement(format!(
            "{from} ({src}) -> {to} ({dst}) {proto}/{port}: {}",
            wrong.join("; ")
        )))
    }
}

/// `ordnet matrix`: every pod with an address of `family` (sorted by `ns/name`, probed at that
/// address), then every external address, as sources and destinations; pairs of two external
/// addresses are left out; a pod with itself is included (the datapath's same-endpoint
/// exemption allows it). Every verdict is a frame decided by the datapath.
pub fn matrix(
    engine: &Engine,
    dp: &OfflineDatapath,
    proto: Protocol,
    port: u16,
    externals: &[IpAddr],
    family: IpFamily,
) -> Matrix {
    let mut ends: Vec<(String, IpAddr, bool)> = engine
        .endpoints()
        .iter()
        .filter_map(|ep| ep.address(family).map(|ip| (ep.id(), ip, true)))
        .collect();
    ends.extend(
        externals
            .iter()
            .filter(|ip| family.contains(**ip))
            .map(|ip| (ip.to_string(), *ip, false)),
    );
    let mut results = Vec::new();
    for (from, src, from_pod) in &ends {
        for (to, dst, to_pod) in &ends {
            if !from_pod && !to_pod {
                continue;
            }
            let verdict = dp
                .verdict(*src, *dst, proto, port)
                .expect("both ends are of one family");
            results.push(MatrixResult {
                from: from.clone(),
                to: to.clone(),
                verdict,
            });
        }
    }
    Matrix {
        protocol: proto,
        port,
        endpoints: ends.into_iter().map(|(n, _, _)| n).collect(),
        results,
    }
}
