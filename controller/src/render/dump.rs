//! `ordnet dump` output: one endpoint's MapState trie (both directions, or one), rendered by
//! `render::trie` as a tree, JSON or Graphviz dot, with identity labels from the engine
//! and, per direction, what the default is and which policies isolate the endpoint.

use super::trie::{Dump, TreeOptions};
use ordnet_engine::{Endpoint, EndpointPolicy, Engine};
use ordnet_mapstate::Direction;

use super::Style;

/// Output formats of `dump`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// The trie as an indented tree, with the endpoint's addresses and identities and a legend.
    Tree,
    /// The trie as JSON.
    Json,
    /// The trie as a Graphviz dot graph.
    Dot,
}

impl Format {
    /// `tree`, `json` or `dot`.
    pub fn parse(s: &str) -> Option<Format> {
        match s {
            "tree" => Some(Format::Tree),
            "json" => Some(Format::Json),
            "dot" => Some(Format::Dot),
            _ => None,
        }
    }

    /// The name [`Format::parse`] reads.
    pub fn as_str(self) -> &'static str {
        match self {
            Format::Tree => "tree",
            Format::Json => "json",
            Format::Dot => "dot",
        }
    }
}

/// What the default is and why: `isolated by NetworkPolicy x/deny-all` / `not isolated`.
pub fn default_note(endpoint: &str, p: &EndpointPolicy) -> String {
    let dir = p.mapstate.direction();
    if p.isolated {
        let by: Vec<String> = p
            .isolated_by
            .iter()
            .map(|o| super::policy_name(o))
            .collect();
        format!("{endpoint} is isolated for {dir} by {}", by.join(", "))
    } else {
        format!("{endpoint} is not isolated for {dir}")
    }
}

/// The output of `ordnet dump` for endpoint `ep` of `engine` and the directions `dirs`.
pub fn render(
    engine: &Engine,
    ep: &Endpoint,
    dirs: &[Direction],
    format: Format,
    style: Style,
) -> String {
    let policies: Vec<&EndpointPolicy> = dirs.iter().map(|d| engine.policy(ep, *d)).collect();
    let mut dump = Dump::new(ep.id()).labels(|id| super::identity_label(engine, id));
    for p in &policies {
        dump = dump.side(&p.mapstate, Some(default_note(&ep.id(), p)));
    }
    match format {
        Format::Json => dump.json_string(),
        Format::Dot => dump.dot(),
        Format::Tree => {
            let addrs: Vec<String> = ep
                .ips
                .iter()
                .zip(&ep.identities)
                .map(|(ip, id)| match super::identity_label(engine, *id) {
                    Some(l) => format!("{ip} = identity {id} ({l})"),
                    None => format!("{ip} = identity {id}"),
                })
                .collect();
            format!(
                "{} {}\n\n{}",
                style.bold(&format!("endpoint {}:", ep.id())),
                addrs.join(", "),
                dump.tree(TreeOptions {
                    color: style.color,
                    legend: true,
                    ..TreeOptions::default()
                })
            )
        }
    }
}
