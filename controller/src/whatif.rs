//! What a change of policy would do to traffic already seen (`ordnet whatif`, docs/cli.md):
//! a history of flows with the verdicts they got, replayed against an engine built from other
//! objects (the current ones plus the proposed ones, staged policies enforced), and the flows
//! whose verdict would change, with what would decide them.
//!
//! The history is the agent's flow log (`ordnet agent --flow-log`: one attributed verdict event
//! per line, `{"event": {"src", "dst", "protocol", "dport", "allowed", ...}, ...}`) or lines of
//! the plain form `{"src", "dst", "protocol", "port", "allowed"}`. A flow is its addresses,
//! protocol and destination port (the source port is not policy's business); when a history
//! holds a flow more than once, its last verdict counts (policy may have changed meanwhile).
//! Flows of other protocols than TCP, UDP and SCTP (ICMP: its errors and replies are judged
//! by the flow they belong to) are counted and skipped.

use std::collections::BTreeMap;
use std::net::IpAddr;

use ordnet_engine::{Engine, FlowEnd, FlowTrace, IpFamily};
use ordnet_mapstate::{Protocol, Verdict};
use serde::Serialize;
use serde_json::Value;

/// One flow of a history, with the verdict it got.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct SeenFlow {
    /// Source address.
    pub src: IpAddr,
    /// Destination address.
    pub dst: IpAddr,
    /// IP protocol.
    #[serde(serialize_with = "ser_protocol")]
    pub protocol: Protocol,
    /// Destination port.
    pub port: u16,
    /// Whether it was allowed.
    pub allowed: bool,
}

fn ser_protocol<S: serde::Serializer>(p: &Protocol, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&p.to_string())
}

/// A history read: its distinct flows, in first-seen order, and what was left out.
#[derive(Debug, Default)]
pub struct History {
    /// The distinct flows (the last verdict of each).
    pub flows: Vec<SeenFlow>,
    /// Lines of flows of other protocols (ICMP, ...), skipped.
    pub skipped: usize,
    /// Lines read.
    pub lines: usize,
}

/// Reads a history (JSON lines; blank lines ignored). `Err` names the first line that is not
/// a flow: nothing is replayed from a history that cannot be read whole.
pub fn read_history(text: &str) -> Result<History, String> {
    let mut history = History::default();
    let mut index: BTreeMap<(IpAddr, IpAddr, Protocol, u16), usize> = BTreeMap::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        history.lines += 1;
        let v: Value =
            serde_json::from_str(line).map_err(|e| format!("line {}: not JSON: {e}", n + 1))?;
        let Some((src, dst, protocol, port, allowed)) = flow_fields(&v) else {
            return Err(format!(
                "line {}: not a flow (a flow log record, or {{\"src\", \"dst\", \"protocol\", \"port\", \"allowed\"}})",
                n + 1
            ));
        };
        let Some(protocol) = protocol else {
            history.skipped += 1;
            continue;
        };
        let flow = SeenFlow {
            src,
            dst,
            protocol,
            port,
            allowed,
        };
        match index.get(&(src, dst, protocol, port)) {
            Some(&i) => history.flows[i] = flow,
            None => {
                index.insert((src, dst, protocol, port), history.flows.len());
                history.flows.push(flow);
            }
        }
    }
    Ok(history)
}

/// The fields of a flow record: `(src, dst, protocol (None: not TCP/UDP/SCTP), port, allowed)`.
#[allow(clippy::type_complexity)]
fn flow_fields(v: &Value) -> Option<(IpAddr, IpAddr, Option<Protocol>, u16, bool)> {
    let (e, port_field) = match v.get("event") {
        Some(e) => (e, "dport"),
        None => (v, "port"),
    };
    let addr = |f: &str| e.get(f)?.as_str()?.parse::<IpAddr>().ok();
    let (src, dst) = (addr("src")?, addr("dst")?);
    let protocol = match e.get("protocol")? {
        Value::Number(n) => u8::try_from(n.as_u64()?).ok().map(Protocol::from_number)?,
        Value::String(s) => Protocol::ALL
            .into_iter()
            .find(|p| p.to_string().eq_ignore_ascii_case(s)),
        _ => return None,
    };
    let port = u16::try_from(e.get(port_field)?.as_u64()?).ok()?;
    let allowed = e.get("allowed")?.as_bool()?;
    (src.is_ipv4() == dst.is_ipv4()).then_some((src, dst, protocol, port, allowed))
}

/// A flow whose verdict would change, and the trace of its new verdict.
#[derive(Debug, Clone, Serialize)]
pub struct Changed {
    /// The flow as seen (with the verdict it got).
    pub flow: SeenFlow,
    /// What would decide it now.
    pub trace: FlowTrace,
}

/// The flows of `flows` whose verdict under `engine` differs from the one they got, in order.
pub fn replay(engine: &Engine, flows: &[SeenFlow]) -> Vec<Changed> {
    flows
        .iter()
        .filter_map(|f| {
            let trace = engine.flow(
                &FlowEnd::Ip(f.src),
                &FlowEnd::Ip(f.dst),
                IpFamily::of(f.src),
                f.protocol,
                f.port,
            );
            ((trace.verdict == Verdict::Allow) != f.allowed).then_some(Changed { flow: *f, trace })
        })
        .collect()
}

/// `ordnet whatif`'s text: a summary line, then each changed flow with what would decide each
/// side (the rows of `ordnet trace`).
pub fn text(history: &History, changed: &[Changed]) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} distinct flow{} replayed ({} line{} read, {} of other protocols skipped): {} would change",
        history.flows.len(),
        if history.flows.len() == 1 { "" } else { "s" },
        history.lines,
        if history.lines == 1 { "" } else { "s" },
        history.skipped,
        changed.len()
    );
    for c in changed {
        let f = &c.flow;
        let end = |ip: IpAddr, side: &Option<ordnet_engine::SideTrace>| match side {
            Some(s) => format!("{ip} ({})", s.endpoint),
            None => ip.to_string(),
        };
        let (was, now) = if f.allowed {
            ("allowed", "would be DENIED")
        } else {
            ("denied", "would be ALLOWED")
        };
        let _ = writeln!(
            out,
            "\n{} -> {} {}/{}: {was}, {now}",
            end(f.src, &c.trace.egress),
            end(f.dst, &c.trace.ingress),
            f.protocol,
            f.port
        );
        if let Some(why) = &c.trace.error {
            let _ = writeln!(out, "  {why}");
        }
        for side in [&c.trace.egress, &c.trace.ingress].into_iter().flatten() {
            let _ = writeln!(
                out,
                "  {} of {}: {}",
                side.direction,
                side.endpoint,
                side.verdict.as_str()
            );
            let mut rows: Vec<Vec<crate::render::Cell>> = Vec::new();
            crate::render::trace::decision_rows(side, &mut |k: &str, v: String| {
                rows.push(vec![
                    crate::render::Cell::plain(format!("    {k}")),
                    crate::render::Cell::plain(v),
                ]);
            });
            out.push_str(&crate::render::table(&rows, &[], 2));
        }
    }
    out
}

/// `ordnet whatif -o json`: the counts and every changed flow with its trace.
pub fn json(history: &History, changed: &[Changed]) -> String {
    let v = serde_json::json!({
        "flows": history.flows.len(),
        "lines": history.lines,
        "skipped": history.skipped,
        "changed": changed,
    });
    serde_json::to_string_pretty(&v).expect("the answer serializes") + "\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_history_is_read_from_flow_log_records_and_plain_lines() {
        let text = r#"
{"seq": 1, "event": {"src": "10.0.0.1", "dst": "10.0.0.2", "protocol": 6, "sport": 40000, "dport": 80, "allowed": true}}
{"src": "10.0.0.1", "dst": "10.0.0.3", "protocol": "UDP", "port": 53, "allowed": false}
{"seq": 2, "event": {"src": "10.0.0.1", "dst": "10.0.0.2", "protocol": 6, "sport": 40001, "dport": 80, "allowed": false}}
{"seq": 3, "event": {"src": "10.0.0.1", "dst": "10.0.0.2", "protocol": 1, "sport": 0, "dport": 0, "allowed": true}}
"#;
        let h = read_history(text).unwrap();
        assert_eq!((h.lines, h.skipped), (4, 1));
        // The same flow from another source port: one flow, its last verdict.
        assert_eq!(h.flows.len(), 2);
        assert_eq!(
            (h.flows[0].port, h.flows[0].protocol, h.flows[0].allowed),
            (80, Protocol::Tcp, false)
        );
        assert_eq!(
            (h.flows[1].port, h.flows[1].protocol, h.flows[1].allowed),
            (53, Protocol::Udp, false)
        );
        let err = read_history("{\"src\": \"10.0.0.1\"}\n").unwrap_err();
        assert!(err.starts_with("line 1: not a flow"), "{err}");
        assert!(
            read_history("nope")
                .unwrap_err()
                .starts_with("line 1: not JSON")
        );
        let mixed =
            r#"{"src": "10.0.0.1", "dst": "fd00::1", "protocol": 6, "port": 1, "allowed": true}"#;
        assert!(read_history(mixed).is_err(), "families differ");
    }
}
