//! `ordnet trace` output: the verdict of one flow and why, as text or as the engine's
//! `FlowTrace` JSON. Text: the verdict and which side denied, then for each side the identities
//! used, the key and entry that matched and the deciding rule(s), or the default and what
//! isolates the endpoint, then the lookup path through that endpoint's MapState.

use std::fmt::Write as _;

use super::trie::{Dump, Focus, TreeOptions, key_text};
use ordnet_engine::{Engine, FlowEnd, FlowTrace, IpFamily, SideDecision, SideTrace};
use ordnet_mapstate::{Direction, Protocol, Verdict};

use super::{Cell, Style};

/// Output formats of `trace`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// The verdict, each side's decision and lookup path, for people.
    Text,
    /// The serialized [`FlowTrace`].
    Json,
}

impl Format {
    /// `text` or `json`.
    pub fn parse(s: &str) -> Option<Format> {
        match s {
            "text" => Some(Format::Text),
            "json" => Some(Format::Json),
            _ => None,
        }
    }

    /// The name [`Format::parse`] reads.
    pub fn as_str(self) -> &'static str {
        match self {
            Format::Text => "text",
            Format::Json => "json",
        }
    }
}

/// The output of `ordnet trace` for the flow `t` explains (`Engine::flow` of the same ends,
/// family, protocol and port, with the verdict the caller determined).
#[allow(clippy::too_many_arguments)]
pub fn render(
    engine: &Engine,
    from: &FlowEnd,
    to: &FlowEnd,
    family: IpFamily,
    proto: Protocol,
    port: u16,
    t: &FlowTrace,
    format: Format,
    style: Style,
) -> String {
    match format {
        Format::Json => serde_json::to_string_pretty(t).expect("the trace serializes") + "\n",
        Format::Text => text(engine, from, to, family, proto, port, t, style),
    }
}

/// `qa/grafana (10.244.1.10)`, `203.0.113.7`, or `10.244.1.10 (qa/grafana)` for a pod's address.
fn end_text(engine: &Engine, end: &FlowEnd, family: IpFamily) -> String {
    match end {
        FlowEnd::Ip(ip) => match engine.endpoints().iter().find(|ep| ep.ips.contains(ip)) {
            Some(ep) => format!("{ip} ({})", ep.id()),
            None => ip.to_string(),
        },
        FlowEnd::Pod { namespace, name } => {
            let ip = engine
                .endpoint(namespace, name)
                .and_then(|ep| ep.address(family).or_else(|| ep.ips.first().copied()));
            match ip {
                Some(ip) => format!("{namespace}/{name} ({ip})"),
                None => format!("{namespace}/{name}"),
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn text(
    engine: &Engine,
    from: &FlowEnd,
    to: &FlowEnd,
    family: IpFamily,
    proto: Protocol,
    port: u16,
    t: &FlowTrace,
    style: Style,
) -> String {
    let mut out = String::new();
    let verdict = style.verdict(t.verdict, &t.verdict.as_str().to_uppercase());
    let _ = writeln!(
        out,
        "{} {proto}/{port} from {} to {}: {verdict}",
        style.bold("trace"),
        end_text(engine, from, family),
        end_text(engine, to, family),
    );
    if let Some(why) = &t.exemption {
        let _ = writeln!(out, "  {why}; no policy is consulted");
        return out;
    }
    let deciding: Vec<&str> = [&t.egress, &t.ingress]
        .into_iter()
        .flatten()
        .filter(|s| s.verdict == Verdict::Deny)
        .map(|s| s.direction.as_str())
        .collect();
    let _ = writeln!(
        out,
        "  {}",
        style.dim(&match deciding.as_slice() {
            [] => "both sides allow (a flow needs the egress side of its source and the ingress side of its destination)".to_string(),
            [one] => format!("denied on the {one} side (a flow needs both sides to allow)"),
            _ => "denied on both sides".to_string(),
        })
    );
    for (dir, side, end) in [
        (Direction::Egress, &t.egress, from),
        (Direction::Ingress, &t.ingress, to),
    ] {
        out.push('\n');
        match side {
            Some(s) => side_text(engine, s, proto, port, style, &mut out),
            None => {
                let _ = writeln!(
                    out,
                    "{} of {end}: {}",
                    style.bold(dir.as_str()),
                    style.dim("not a pod, no policy of its own applies")
                );
            }
        }
    }
    out
}

fn side_text(
    engine: &Engine,
    s: &SideTrace,
    proto: Protocol,
    port: u16,
    style: Style,
    out: &mut String,
) {
    let _ = writeln!(
        out,
        "{} of {}: {}",
        style.bold(s.direction.as_str()),
        s.endpoint,
        style.verdict(s.verdict, s.verdict.as_str())
    );
    let mut rows: Vec<Vec<Cell>> = Vec::new();
    let mut row = |k: &str, v: String| {
        rows.push(vec![Cell::plain(format!("  {k}")), Cell::plain(v)]);
    };
    let towards = match s.direction {
        Direction::Egress => "to",
        Direction::Ingress => "from",
    };
    let peer_id = match super::identity_label(engine, s.peer_identity) {
        Some(l) => format!("identity {} ({l})", s.peer_identity),
        None => format!("identity {}", s.peer_identity),
    };
    let peer = if s.peer == s.peer_address.to_string() {
        s.peer.clone()
    } else {
        format!("{} at {}", s.peer, s.peer_address)
    };
    row(towards, format!("{peer}, {peer_id}"));
    let (ns, name) = s.endpoint.split_once('/').unwrap_or(("", &s.endpoint));
    if let Some(ep) = engine.endpoint(ns, name) {
        let own: Vec<String> = ep
            .ips
            .iter()
            .zip(&ep.identities)
            .map(|(ip, id)| format!("{ip} identity {id}"))
            .collect();
        row("endpoint", format!("{} ({})", s.endpoint, own.join(", ")));
    }
    let policy = engine
        .endpoint(ns, name)
        .map(|ep| engine.policy(ep, s.direction));
    decision_rows(s, &mut row);
    out.push_str(&super::table(&rows, &[], 2));
    if let Some(policy) = policy.filter(|p| !p.mapstate.is_empty()) {
        lookup_path(engine, s, policy, proto, port, style, out);
    }
}

/// The rows that say what decided a side: the key and its rules, or the default and why.
pub(crate) fn decision_rows(s: &SideTrace, row: &mut impl FnMut(&str, String)) {
    match &s.decision {
        SideDecision::Matched { key, entry } => {
            let mut k = format!(
                "{} -> {} {}",
                key_text(key),
                entry.verdict,
                render_order(&entry.order)
            );
            if entry.synthesized {
                k.push_str(
                    " [covering copy of a * entry: stronger than a broader key of the identity]",
                );
            }
            row("key", k);
            let label = if entry.origins.len() > 1 {
                "rules"
            } else {
                "rule"
            };
            for (i, o) in entry.origins.iter().enumerate() {
                row(if i == 0 { label } else { "" }, super::rule_text(o));
            }
            if entry.origins.len() > 1 {
                row(
                    "",
                    "(equal order key and verdict: the rules are merged into one key)".into(),
                );
            }
        }
        SideDecision::Default {
            isolated,
            isolated_by,
        } => {
            row("key", "none matches: the default applies".into());
            let why = if *isolated {
                let by: Vec<String> = isolated_by.iter().map(|o| super::policy_name(o)).collect();
                format!(
                    "deny: {} is isolated for {} by {}",
                    s.endpoint,
                    s.direction,
                    by.join(", ")
                )
            } else {
                format!(
                    "allow: {} is not isolated for {} (no policy that selects it isolates it)",
                    s.endpoint, s.direction
                )
            };
            row("default", why);
        }
    }
}

/// The lookup path in the side's MapState (the trie lines the packet's lookup visits).
fn lookup_path(
    engine: &Engine,
    s: &SideTrace,
    policy: &ordnet_engine::EndpointPolicy,
    proto: Protocol,
    port: u16,
    style: Style,
    out: &mut String,
) {
    let _ = writeln!(
        out,
        "  lookup in the {} MapState of {} ({} keys; identity first, then *, then the default):",
        s.direction,
        s.endpoint,
        policy.mapstate.len()
    );
    let dump = Dump::new(s.endpoint.clone())
        .side(&policy.mapstate, None)
        .labels(|id| super::identity_label(engine, id))
        .focus(Focus {
            identity: Some(s.peer_identity),
            protocol: proto,
            port,
        });
    let tree = dump.tree(TreeOptions {
        color: style.color,
        path_only: true,
        omit_header: true,
        ..TreeOptions::default()
    });
    for line in tree.lines() {
        let _ = writeln!(out, "  {line}");
    }
}

/// `(priority 10, rule index 1)`, with the tier outside the ordnet tier (`(admin tier, priority
/// 10, rule index 1)`) and, for an entry copied under a Pass, the rule it copies.
fn render_order(o: &ordnet_mapstate::OrderKey) -> String {
    let tier = if o.tier() == ordnet_mapstate::Tier::Ordnet {
        String::new()
    } else {
        format!("{} tier, ", o.tier())
    };
    let mut out = format!("({tier}priority {}, rule index {}", o.priority, o.index);
    match o.step() {
        ordnet_mapstate::Step::PassEnd => out.push_str(", the Pass itself"),
        ordnet_mapstate::Step::Passed(v) => {
            out.push_str(", under its Pass: ");
            if v.tier != ordnet_mapstate::Tier::Ordnet {
                out.push_str(&format!("{} tier, ", v.tier));
            }
            out.push_str(&format!("priority {}, rule index {}", v.priority, v.index));
        }
        _ => {}
    }
    out.push(')');
    out
}
