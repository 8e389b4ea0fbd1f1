//! Rendering of a MapState for people: indented tree, JSON, Graphviz dot. (It lives with the
//! other renderers; `ordnet_mapstate` keeps only what it reads.)
//!
//! A [`Dump`] renders the MapState of one endpoint, for one or both directions, as
//! - [`Dump::tree`]: an indented tree for a terminal (optionally coloured);
//! - [`Dump::json`]: a stable, machine-readable document (shape below);
//! - [`Dump::dot`]: a Graphviz `digraph`.
//!
//! The tree follows the trie: under each peer (`*` first, then identities in ascending order)
//! come the keys nested by prefix containment: "any protocol", then each protocol, then port
//! blocks, a narrower block under the block that contains it. A protocol that has port keys but
//! no protocol-wide key gets a grouping line without an entry. Each key shows its verdict, its
//! order key `(priority, rule index)` and the rule(s) it comes from, and flags:
//! - `[covering copy of *]`: a synthesized covering entry (a `*` entry copied under an identity
//!   because it is stronger than a broader key of that identity);
//! - `covered by [PEER KEY]`: a policy entry that has no key of its own here, because an equal or
//!   broader, stronger key makes it unreachable for that peer (listed at the block where it would
//!   have been).
//!
//! The renderer does not need Kubernetes: the caller supplies the endpoint's name, a label for each
//! identity (e.g. `x/pod=a`) and, per direction, a note on the default (e.g. which policies
//! isolate the endpoint).
//!
//! ## Focus
//! With a [`Focus`] (identity, protocol, port), every rendering shows the lookup of that packet
//! exactly as [`MapState::lookup`] does it: the key that decides, the other keys that match but
//! lose (shorter prefix, or `*` keys never consulted because the identity has a matching key of
//! its own), and the covered entries that would have matched. [`TreeOptions::path_only`] keeps
//! only the lines on that path.
//!
//! ## JSON shape
//! ```text
//! {"endpoint": "x/a",
//!  "directions": [                        // in the order the sides were added
//!   {"direction": "ingress",
//!    "default": "deny", "defaultNote": "isolated by ..." | null,
//!    "keyCount": 5, "coveredCount": 1,
//!    "focus": null | {"identity": 42 | null, "protocol": "TCP", "port": 8080, "verdict": "deny",
//!                     "decidedBy": {"identity": 42 | null, "key": "TCP/8080"} | null},
//!    "peers": [                           // "*" (identity null) first, then by identity
//!     {"identity": null | 42, "label": "any identity" | "x/pod=a" | null,
//!      "keys": [                          // sorted by prefix, parents before children
//!       {"key": "TCP/8000-8191", "parent": "TCP" | null,
//!        "protocol": "TCP" | null, "ports": [8000, 8191] | null, "prefixLen": 11,
//!        "verdict": "allow", "order": {"priority": 100, "index": 0},
//!        "entries": [3], "origins": [ORIGIN...], "synthesized": false,
//!        "focus": "decides" | "matches" | "not-consulted"}],   // "focus" only when it applies
//!      "covered": [                       // sorted by prefix, then entry id
//!       {"key": "TCP/8080", "entry": 4, "verdict": "deny", "order": {...}, "origin": ORIGIN,
//!        "coveredBy": {"identity": null | 42, "key": "TCP/8000-8191"},
//!        "focus": "covered"}]}]}]}       // "focus" only when it applies
//! ORIGIN = {"kind", "namespace" (string or null), "name", "direction", "ruleIndex",
//!           "priority", "action"}
//! ```
//! Key texts: `any` (every protocol and port), `TCP` (every TCP port), `TCP/80` (one port),
//! `TCP/8000-8191` (an aligned port block; `prefixLen` is the trie prefix length, 0..=24).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde_json::{Value, json};

use ordnet_mapstate::{
    Covered, Decision, Identity, Key, L4Prefix, MapState, OrderKey, Origin, Peer, Protocol,
    StateEntry, Step, Tier, Verdict,
};

use super::{ansi, pad, width};

/// One packet whose lookup the rendering highlights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Focus {
    /// The peer's identity (`None`: an address without identity, only `*` keys apply).
    pub identity: Option<Identity>,
    /// The packet's protocol.
    pub protocol: Protocol,
    /// The packet's destination port.
    pub port: u16,
}

/// Options of the tree rendering.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TreeOptions {
    /// ANSI colours (the caller decides: TTY, `NO_COLOR`).
    pub color: bool,
    /// A legend of the markers and flags at the end.
    pub legend: bool,
    /// With a focus: only the peers and keys on the focused packet's lookup path.
    pub path_only: bool,
    /// Leave out each direction's header lines (title, default, focus summary), for callers
    /// that print their own (e.g. `ordnet trace`).
    pub omit_header: bool,
}

/// One direction to render.
struct Side<'a> {
    state: &'a MapState,
    default_note: Option<String>,
}

type LabelFn<'a> = Box<dyn Fn(Identity) -> Option<String> + 'a>;

/// The rendering of one endpoint's MapState (one or both directions). See the module docs.
pub struct Dump<'a> {
    endpoint: String,
    sides: Vec<Side<'a>>,
    labels: LabelFn<'a>,
    focus: Option<Focus>,
}

/// The text of a prefix as used in every rendering: `any`, `TCP`, `TCP/80`, `TCP/80-87`.
pub fn prefix_text(p: &L4Prefix) -> String {
    let Some(proto) = p.protocol() else {
        return "any".to_string();
    };
    let name = proto_name(proto);
    match (p.port_bits(), p.port_range()) {
        (0, _) | (_, None) => name,
        (16, Some((first, _))) => format!("{name}/{first}"),
        (_, Some((first, last))) => format!("{name}/{first}-{last}"),
    }
}

/// The text of a key: `[* TCP/80]`, `[42 any]`.
pub fn key_text(k: &Key) -> String {
    format!("[{} {}]", k.peer, prefix_text(&k.prefix))
}

/// The short text of an origin: `OrderedNetworkPolicy x/deny-8080 ingress[0]` (the priority and
/// action are in the order key and verdict printed next to it).
pub fn origin_text(o: &Origin) -> String {
    match &o.namespace {
        Some(ns) => format!(
            "{} {}/{} {}[{}]",
            o.kind, ns, o.name, o.direction, o.rule_index
        ),
        None => format!("{} {} {}[{}]", o.kind, o.name, o.direction, o.rule_index),
    }
}

fn proto_name(n: u8) -> String {
    Protocol::from_number(n)
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| format!("proto{n}"))
}

/// The label of a node in the tree (the protocol is on the parent line for port blocks).
fn node_text(p: &L4Prefix) -> String {
    let Some(proto) = p.protocol() else {
        return "any protocol".to_string();
    };
    match (p.port_bits(), p.port_range()) {
        (0, _) | (_, None) => proto_name(proto),
        (16, Some((first, _))) => first.to_string(),
        (_, Some((first, last))) => format!("{first}-{last}"),
    }
}

/// `(priority, index)`, with the tier when it is not the ordnet tier and the Pass a copied
/// entry ranks under (`admin (10, 1) pass → (0, 0)`).
fn order_text(o: &OrderKey) -> String {
    o.to_string()
}

fn origin_json(o: &Origin) -> Value {
    let mut v = json!({
        "kind": o.kind,
        "namespace": o.namespace,
        "name": o.name,
        "direction": o.direction.as_str(),
        "ruleIndex": o.rule_index,
        "priority": o.priority,
        "action": o.action.as_str(),
    });
    // Only what other kinds than the ordnet ones have (ClusterNetworkPolicy).
    if o.tier != Tier::Ordnet {
        v["tier"] = json!(o.tier.as_str());
    }
    if let Some(n) = &o.rule_name {
        v["ruleName"] = json!(n);
    }
    if let Some(p) = &o.passed_by {
        v["passedBy"] = origin_json(p);
    }
    v
}

fn order_json(o: &OrderKey) -> Value {
    let mut v = json!({"priority": o.priority, "index": o.index});
    if o.tier() != Tier::Ordnet {
        v["tier"] = json!(o.tier().as_str());
    }
    match o.step() {
        Step::Rule | Step::Accept => {}
        Step::PassEnd => v["pass"] = json!("end"),
        Step::Passed(via) => {
            v["pass"] = json!({
                "tier": via.tier.as_str(),
                "priority": via.priority,
                "index": via.index,
            })
        }
    }
    v
}

fn peer_identity(p: Peer) -> Option<Identity> {
    match p {
        Peer::Any => None,
        Peer::Id(id) => Some(id),
    }
}

/// What the focused packet's lookup makes of one line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mark {
    /// This key decides.
    Decides,
    /// Matches, but a longer key of the same peer decides.
    Matches,
    /// A `*` key that matches but is not consulted: the identity has a matching key.
    NotConsulted,
    /// A covered entry that matches the packet.
    Covered,
}

impl Mark {
    fn json(self) -> &'static str {
        match self {
            Mark::Decides => "decides",
            Mark::Matches => "matches",
            Mark::NotConsulted => "not-consulted",
            Mark::Covered => "covered",
        }
    }

    fn tree(self) -> &'static str {
        match self {
            Mark::Decides => "◀ decides",
            Mark::Matches => "◀ matches, a longer key decides",
            Mark::NotConsulted => "◀ matches, not consulted: the identity has its own key",
            Mark::Covered => "◀ would match, covered",
        }
    }

    fn gutter(self) -> &'static str {
        match self {
            Mark::Decides => "=>",
            Mark::Matches | Mark::NotConsulted => " >",
            Mark::Covered => " ~",
        }
    }
}

/// One node of the per-peer tree: a key, covered entries at the same block, or only a grouping
/// line for a protocol without a protocol-wide key.
struct Node<'s> {
    prefix: L4Prefix,
    entry: Option<&'s StateEntry>,
    covered: Vec<Covered>,
    children: Vec<usize>,
}

struct PeerTree<'s> {
    peer: Peer,
    nodes: Vec<Node<'s>>,
    roots: Vec<usize>,
}

/// The state of one side, grouped by peer and nested by prefix.
fn peer_trees(state: &MapState) -> Vec<PeerTree<'_>> {
    type Blocks<'s> = BTreeMap<L4Prefix, (Option<&'s StateEntry>, Vec<Covered>)>;
    let mut by_peer: BTreeMap<Peer, Blocks<'_>> = BTreeMap::new();
    for (key, entry) in state.iter() {
        by_peer
            .entry(key.peer)
            .or_default()
            .entry(key.prefix)
            .or_default()
            .0 = Some(entry);
    }
    for c in state.covered() {
        by_peer
            .entry(c.key.peer)
            .or_default()
            .entry(c.key.prefix)
            .or_default()
            .1
            .push(c);
    }
    let mut out = Vec::new();
    for (peer, mut blocks) in by_peer {
        // Grouping lines for protocols with port keys only.
        let protos: Vec<L4Prefix> = blocks
            .keys()
            .filter(|p| p.port_bits() > 0)
            .filter_map(|p| p.protocol().map(L4Prefix::proto))
            .collect();
        for p in protos {
            blocks.entry(p).or_default();
        }
        // `L4Prefix`'s order puts a parent just before its subtree (pre-order).
        let mut nodes: Vec<Node<'_>> = Vec::new();
        let mut roots = Vec::new();
        let mut stack: Vec<usize> = Vec::new();
        for (prefix, (entry, covered)) in blocks {
            while let Some(&top) = stack.last() {
                if nodes[top].prefix.covers(&prefix) {
                    break;
                }
                stack.pop();
            }
            let idx = nodes.len();
            match stack.last() {
                Some(&parent) => nodes[parent].children.push(idx),
                None => roots.push(idx),
            }
            nodes.push(Node {
                prefix,
                entry,
                covered,
                children: Vec::new(),
            });
            stack.push(idx);
        }
        out.push(PeerTree { peer, nodes, roots });
    }
    out
}

/// The focused packet's lookup on one side.
struct FocusEval<'s> {
    focus: Focus,
    decision: Decision<'s>,
}

impl FocusEval<'_> {
    fn new(state: &MapState, focus: Focus) -> FocusEval<'_> {
        FocusEval {
            focus,
            decision: state.lookup(focus.identity, focus.protocol.number(), focus.port),
        }
    }

    fn matches(&self, p: &L4Prefix) -> bool {
        p.matches(self.focus.protocol.number(), self.focus.port)
    }

    /// Whether the packet's lookup reads this peer's keys at all.
    fn relevant(&self, peer: Peer) -> bool {
        match peer {
            Peer::Any => true,
            Peer::Id(id) => self.focus.identity == Some(id),
        }
    }

    fn key_mark(&self, peer: Peer, prefix: &L4Prefix) -> Option<Mark> {
        if !self.relevant(peer) || !self.matches(prefix) {
            return None;
        }
        match self.decision {
            Decision::Matched { key, .. } if key.peer == peer && key.prefix == *prefix => {
                Some(Mark::Decides)
            }
            Decision::Matched { key, .. } if key.peer != peer => Some(Mark::NotConsulted),
            _ => Some(Mark::Matches),
        }
    }

    fn covered_mark(&self, c: &Covered) -> Option<Mark> {
        (self.relevant(c.key.peer) && self.matches(&c.key.prefix)).then_some(Mark::Covered)
    }

    fn decided_by(&self) -> Option<Key> {
        match self.decision {
            Decision::Matched { key, .. } => Some(key),
            Decision::Default(_) => None,
        }
    }
}

// --- ANSI styling -----------------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq, Eq)]
enum Paint {
    Plain,
    Bold,
    Dim,
    Green,
    Red,
    Yellow,
    Cyan,
}

fn paint(color: bool, p: Paint, s: &str) -> String {
    let code = match p {
        Paint::Plain => return s.to_string(),
        Paint::Bold => "1",
        Paint::Dim => "2",
        Paint::Green => "32",
        Paint::Red => "31",
        Paint::Yellow => "33",
        Paint::Cyan => "1;36",
    };
    ansi(color, code, s)
}

fn verdict_paint(v: Verdict) -> Paint {
    match v {
        Verdict::Allow => Paint::Green,
        Verdict::Deny => Paint::Red,
    }
}

/// One line of the tree before alignment.
#[derive(Default)]
struct Row {
    /// Tree drawing and node text.
    label: String,
    /// The label is a header (peer line): no columns.
    header: bool,
    /// A header that is a note (dim, not bold).
    note: bool,
    verdict: Option<Verdict>,
    order: String,
    origin: String,
    flags: String,
    /// A covered entry (rendered dim: it never decides).
    covered: bool,
    mark: Option<Mark>,
}

impl<'a> Dump<'a> {
    /// A dump of the endpoint named `endpoint` (opaque text, e.g. `x/a`), with no side yet and
    /// identities shown by number only.
    pub fn new(endpoint: impl Into<String>) -> Dump<'a> {
        Dump {
            endpoint: endpoint.into(),
            sides: Vec::new(),
            labels: Box::new(|_| None),
            focus: None,
        }
    }

    /// Adds one direction (the state's own) with an optional note on its default, e.g.
    /// `isolated by NetworkPolicy x/deny-all`.
    pub fn side(mut self, state: &'a MapState, default_note: Option<String>) -> Dump<'a> {
        self.sides.push(Side {
            state,
            default_note,
        });
        self
    }

    /// Display labels of identities (`None`: the number alone).
    pub fn labels(mut self, f: impl Fn(Identity) -> Option<String> + 'a) -> Dump<'a> {
        self.labels = Box::new(f);
        self
    }

    /// Highlights the lookup of one packet.
    pub fn focus(mut self, focus: Focus) -> Dump<'a> {
        self.focus = Some(focus);
        self
    }

    fn peer_label(&self, peer: Peer) -> String {
        match peer {
            Peer::Any => "* any identity".to_string(),
            Peer::Id(id) => match (self.labels)(id) {
                Some(l) => format!("identity {id} ({l})"),
                None => format!("identity {id}"),
            },
        }
    }

    fn identity_text(&self, id: Option<Identity>) -> String {
        match id {
            None => "an address without identity".to_string(),
            Some(id) => match (self.labels)(id) {
                Some(l) => format!("identity {id} ({l})"),
                None => format!("identity {id}"),
            },
        }
    }

    /// The indented tree (see the module docs). Ends with a newline.
    pub fn tree(&self, opts: TreeOptions) -> String {
        let c = opts.color;
        let mut out = String::new();
        for (i, side) in self.sides.iter().enumerate() {
            if i > 0 {
                out.push('\n');
            }
            self.tree_side(side, opts, &mut out);
        }
        if opts.legend {
            out.push('\n');
            let _ = writeln!(out, "{}", paint(c, Paint::Bold, "legend:"));
            let lines = [
                "KEY  VERDICT  (PRIORITY, RULE INDEX)  RULE: one key of the trie and the rule it comes from",
                "lookup: the identity's own keys first (longest prefix wins); if none matches, the * keys; then the default",
                "[covering copy of *]  a * entry copied under the identity, because it is stronger than a broader key there",
                "covered by [PEER KEY] this rule never decides for that peer: an equal or broader, stronger key wins",
                "port ranges are stored as aligned blocks: 8000-8999 = 8000-8063, 8064-8191, 8192-8703, ...",
            ];
            for l in lines {
                let _ = writeln!(out, "  {}", paint(c, Paint::Dim, l));
            }
            let tiered = self.sides.iter().any(|s| {
                s.state
                    .iter()
                    .iter()
                    .any(|(_, e)| e.order.tier() != Tier::Ordnet)
            });
            if tiered {
                for l in [
                    "admin / baseline (P, I): a ClusterNetworkPolicy rule of that tier (admin before every other rule, baseline after the isolation default)",
                    "(P, I) pass: a Pass rule's own key: what no weaker tier decides under it gets the default",
                    "(P, I) pass → (P', I'): rule (P', I') of a weaker tier, decided right under the Pass (P, I), before the weaker rules of the Pass's tier",
                ] {
                    let _ = writeln!(out, "  {}", paint(c, Paint::Dim, l));
                }
            }
            if self.focus.is_some() {
                let _ = writeln!(
                    out,
                    "  {}",
                    paint(
                        c,
                        Paint::Dim,
                        "=> the key that decides the focused packet;  > matches but loses;  ~ covered entry that would match"
                    )
                );
            }
        }
        out
    }

    fn tree_side(&self, side: &Side<'_>, opts: TreeOptions, out: &mut String) {
        let c = opts.color;
        let state = side.state;
        let eval = self.focus.map(|f| FocusEval::new(state, f));
        if !opts.omit_header {
            self.tree_header(side, eval.as_ref(), c, out);
        }
        self.tree_body(state, eval.as_ref(), opts, out);
    }

    fn tree_header(
        &self,
        side: &Side<'_>,
        eval: Option<&FocusEval<'_>>,
        c: bool,
        out: &mut String,
    ) {
        let state = side.state;
        let dir = state.direction();
        let covered_count = state.covered().len();
        let _ = writeln!(
            out,
            "{}",
            paint(
                c,
                Paint::Bold,
                &format!(
                    "{} {dir}: {} key{}, {covered_count} covered entr{}",
                    self.endpoint,
                    state.len(),
                    if state.len() == 1 { "" } else { "s" },
                    if covered_count == 1 { "y" } else { "ies" },
                )
            )
        );
        let default = state.default_verdict();
        let _ = writeln!(
            out,
            "  default when no key matches: {}{}",
            paint(c, verdict_paint(default), default.as_str()),
            side.default_note
                .as_deref()
                .map(|n| format!(" ({n})"))
                .unwrap_or_default()
        );
        if let Some(ev) = eval {
            let f = ev.focus;
            let who = self.identity_text(f.identity);
            let towards = match dir {
                ordnet_mapstate::Direction::Ingress => "from",
                ordnet_mapstate::Direction::Egress => "to",
            };
            let verdict = ev.decision.verdict();
            let why = match ev.decision {
                Decision::Matched { key, entry } => {
                    let mut s = format!(
                        ", decided by key {} {} {}",
                        key_text(&key),
                        order_text(&entry.order),
                        entry
                            .origins
                            .iter()
                            .map(|o| origin_text(o))
                            .collect::<Vec<_>>()
                            .join(" + ")
                    );
                    if entry.synthesized {
                        s.push_str(" [covering copy of *]");
                    }
                    s
                }
                Decision::Default(_) => format!(
                    ": no key matches, the default applies{}",
                    side.default_note
                        .as_deref()
                        .map(|n| format!(" ({n})"))
                        .unwrap_or_default()
                ),
            };
            let _ = writeln!(
                out,
                "  {} {}/{} {towards} {who}: {}{why}",
                paint(c, Paint::Cyan, "focus:"),
                f.protocol,
                f.port,
                paint(c, verdict_paint(verdict), verdict.as_str()),
            );
        }
    }

    fn tree_body(
        &self,
        state: &MapState,
        eval: Option<&FocusEval<'_>>,
        opts: TreeOptions,
        out: &mut String,
    ) {
        let c = opts.color;
        let mut trees = self.shown_trees(state);
        if trees.is_empty() {
            let _ = writeln!(out, "  (no keys)");
            return;
        }
        if opts.path_only && self.focus.is_some() {
            // In lookup order: the identity's own keys, then `*`.
            trees.sort_by_key(|t| t.peer == Peer::Any);
        }
        let rows = self.tree_rows(state, &trees, eval, opts);
        write_rows(rows, eval.is_some(), c, out);
    }

    /// The peer trees of `state`, plus an empty one for a focused identity without keys and
    /// for `*` (the lookup always ends there) when focused.
    fn shown_trees<'s>(&self, state: &'s MapState) -> Vec<PeerTree<'s>> {
        let mut trees = peer_trees(state);
        if let Some(Focus {
            identity: Some(id), ..
        }) = self.focus
            && !trees.iter().any(|t| t.peer == Peer::Id(id))
        {
            // The focused identity has no keys: say so where its keys would be.
            let at = trees.iter().take_while(|t| t.peer < Peer::Id(id)).count();
            trees.insert(
                at,
                PeerTree {
                    peer: Peer::Id(id),
                    nodes: Vec::new(),
                    roots: Vec::new(),
                },
            );
        }
        if self.focus.is_some() && trees.first().is_none_or(|t| t.peer != Peer::Any) {
            // The lookup always ends with `*`: show it even without keys.
            trees.insert(
                0,
                PeerTree {
                    peer: Peer::Any,
                    nodes: Vec::new(),
                    roots: Vec::new(),
                },
            );
        }
        trees
    }

    /// The rows of the tree (peer headers, nodes), on the focused path only with
    /// [`TreeOptions::path_only`].
    fn tree_rows(
        &self,
        state: &MapState,
        trees: &[PeerTree<'_>],
        eval: Option<&FocusEval<'_>>,
        opts: TreeOptions,
    ) -> Vec<Row> {
        let mut rows: Vec<Row> = Vec::new();
        for t in trees {
            if opts.path_only
                && let Some(ev) = eval
                && !ev.relevant(t.peer)
            {
                continue;
            }
            rows.push(Row {
                label: self.peer_label(t.peer),
                header: true,
                ..Row::default()
            });
            // On the focused path: nodes that match the packet and are keys, covered entries
            // or lead to some (a protocol grouping line with no matching port is left out).
            let mut kept = vec![true; t.nodes.len()];
            if let (Some(ev), true) = (eval, opts.path_only) {
                for i in (0..t.nodes.len()).rev() {
                    let n = &t.nodes[i];
                    kept[i] = ev.matches(&n.prefix)
                        && (n.entry.is_some()
                            || !n.covered.is_empty()
                            || n.children.iter().any(|&ch| kept[ch]));
                }
            }
            let keep = |i: usize| kept[i];
            let roots: Vec<usize> = t.roots.iter().copied().filter(|&r| keep(r)).collect();
            if roots.is_empty() {
                let next = match t.peer {
                    Peer::Any => "the default applies",
                    Peer::Id(_) => "the lookup goes on with the * keys",
                };
                let what = if t.nodes.is_empty() {
                    "no keys of its own"
                } else {
                    "no matching key"
                };
                rows.push(Row {
                    label: format!("└─ ({what}: {next})"),
                    header: true,
                    note: true,
                    ..Row::default()
                });
            }
            for (i, &r) in roots.iter().enumerate() {
                self.node_rows(
                    state,
                    t,
                    r,
                    "",
                    i + 1 == roots.len(),
                    eval,
                    &keep,
                    &mut rows,
                );
            }
        }
        rows
    }

    #[allow(clippy::too_many_arguments)]
    fn node_rows(
        &self,
        state: &MapState,
        t: &PeerTree<'_>,
        idx: usize,
        prefix: &str,
        last: bool,
        eval: Option<&FocusEval<'_>>,
        keep: &dyn Fn(usize) -> bool,
        rows: &mut Vec<Row>,
    ) {
        let n = &t.nodes[idx];
        let children: Vec<usize> = n.children.iter().copied().filter(|&ch| keep(ch)).collect();
        let connector = if last { "└─ " } else { "├─ " };
        let child_prefix = format!("{prefix}{}", if last { "   " } else { "│  " });
        let cont_label = format!(
            "{child_prefix}{}",
            if children.is_empty() { "   " } else { "│  " }
        );
        let head = format!("{prefix}{connector}{}", node_text(&n.prefix));
        let mut first = true;
        let label = |first: &mut bool| {
            if std::mem::take(first) {
                head.clone()
            } else {
                cont_label.clone()
            }
        };
        if let Some(e) = n.entry {
            let mut origins = e.origins.iter();
            rows.push(Row {
                label: label(&mut first),
                verdict: Some(e.verdict),
                order: order_text(&e.order),
                origin: origins.next().map(|o| origin_text(o)).unwrap_or_default(),
                flags: if e.synthesized {
                    "[covering copy of *]".to_string()
                } else {
                    String::new()
                },
                mark: eval.and_then(|ev| ev.key_mark(t.peer, &n.prefix)),
                ..Row::default()
            });
            for o in origins {
                rows.push(Row {
                    label: label(&mut first),
                    origin: format!("+ {}", origin_text(o)),
                    ..Row::default()
                });
            }
        }
        for cov in &n.covered {
            let pe = state.policy_entry(cov.entry);
            rows.push(Row {
                label: label(&mut first),
                verdict: pe.map(|e| e.verdict()),
                order: pe.map(|e| order_text(&e.order)).unwrap_or_default(),
                origin: pe
                    .map(|e| origin_text(&e.origin))
                    .unwrap_or_else(|| format!("entry {}", cov.entry)),
                flags: format!("covered by {}", key_text(&cov.covered_by)),
                covered: true,
                mark: eval.and_then(|ev| ev.covered_mark(cov)),
                ..Row::default()
            });
        }
        if first {
            // A grouping line: a protocol without a protocol-wide key.
            rows.push(Row {
                label: head.clone(),
                ..Row::default()
            });
        }
        for (i, &ch) in children.iter().enumerate() {
            self.node_rows(
                state,
                t,
                ch,
                &child_prefix,
                i + 1 == children.len(),
                eval,
                keep,
                rows,
            );
        }
    }

    /// The JSON document (see the module docs for its shape).
    pub fn json(&self) -> Value {
        let directions: Vec<Value> = self.sides.iter().map(|s| self.json_side(s)).collect();
        json!({"endpoint": self.endpoint, "directions": directions})
    }

    /// The JSON document, pretty-printed, with a final newline.
    pub fn json_string(&self) -> String {
        let mut s = serde_json::to_string_pretty(&self.json()).expect("JSON values serialize");
        s.push('\n');
        s
    }

    fn json_side(&self, side: &Side<'_>) -> Value {
        let state = side.state;
        let eval = self.focus.map(|f| FocusEval::new(state, f));
        let mut peers = Vec::new();
        for t in peer_trees(state) {
            let mut keys = Vec::new();
            let mut covered = Vec::new();
            let mut parents: Vec<Option<String>> = vec![None; t.nodes.len()];
            for (i, n) in t.nodes.iter().enumerate() {
                let text = prefix_text(&n.prefix);
                for &ch in &n.children {
                    // Grouping lines are not keys: their children's parent is their own parent.
                    parents[ch] = if n.entry.is_some() {
                        Some(text.clone())
                    } else {
                        parents[i].clone()
                    };
                }
                if let Some(e) = n.entry {
                    let mut k = json!({
                        "key": text,
                        "parent": parents[i],
                        "protocol": n.prefix.protocol().map(proto_name),
                        "ports": if n.prefix.port_bits() > 0 { n.prefix.port_range().map(|(a, b)| vec![a, b]) } else { None },
                        "prefixLen": n.prefix.len(),
                        "verdict": e.verdict.as_str(),
                        "order": order_json(&e.order),
                        "entries": e.entries.iter().map(|id| id.0).collect::<Vec<_>>(),
                        "origins": e.origins.iter().map(|o| origin_json(o)).collect::<Vec<_>>(),
                        "synthesized": e.synthesized,
                    });
                    if let Some(m) = eval.as_ref().and_then(|ev| ev.key_mark(t.peer, &n.prefix)) {
                        k["focus"] = json!(m.json());
                    }
                    keys.push(k);
                }
                for cov in &n.covered {
                    let pe = state.policy_entry(cov.entry);
                    let mut cv = json!({
                        "key": text,
                        "entry": cov.entry.0,
                        "verdict": pe.map(|e| e.verdict().as_str()),
                        "order": pe.map(|e| order_json(&e.order)),
                        "origin": pe.map(|e| origin_json(&e.origin)),
                        "coveredBy": {
                            "identity": peer_identity(cov.covered_by.peer),
                            "key": prefix_text(&cov.covered_by.prefix),
                        },
                    });
                    if let Some(m) = eval.as_ref().and_then(|ev| ev.covered_mark(cov)) {
                        cv["focus"] = json!(m.json());
                    }
                    covered.push(cv);
                }
            }
            let label = match t.peer {
                Peer::Any => Some("any identity".to_string()),
                Peer::Id(id) => (self.labels)(id),
            };
            peers.push(json!({
                "identity": peer_identity(t.peer),
                "label": label,
                "keys": keys,
                "covered": covered,
            }));
        }
        let focus = eval.as_ref().map(|ev| {
            json!({
                "identity": ev.focus.identity,
                "protocol": ev.focus.protocol.as_str(),
                "port": ev.focus.port,
                "verdict": ev.decision.verdict().as_str(),
                "decidedBy": ev.decided_by().map(|k| json!({
                    "identity": peer_identity(k.peer),
                    "key": prefix_text(&k.prefix),
                })),
            })
        });
        json!({
            "direction": state.direction().as_str(),
            "default": state.default_verdict().as_str(),
            "defaultNote": side.default_note,
            "keyCount": state.len(),
            "coveredCount": state.covered().len(),
            "focus": focus,
            "peers": peers,
        })
    }

    /// A Graphviz `digraph`: one cluster per direction, one node per peer, key, grouping line
    /// and covered entry; edges follow the trie, dashed edges go from a covered entry to the key
    /// that covers it.
    pub fn dot(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "digraph {} {{",
            dot_str(&format!("mapstate {}", self.endpoint))
        );
        let _ = writeln!(
            out,
            "  graph [rankdir=LR, fontname=\"monospace\", labelloc=t, label={}];",
            dot_str(&format!("MapState of {}", self.endpoint))
        );
        let _ = writeln!(
            out,
            "  node [shape=box, style=rounded, fontname=\"monospace\", fontsize=10];"
        );
        let _ = writeln!(out, "  edge [arrowhead=none];");
        for side in &self.sides {
            let state = side.state;
            let dir = state.direction().as_str();
            let eval = self.focus.map(|f| FocusEval::new(state, f));
            let node_id = |peer: Peer, p: Option<&L4Prefix>| match p {
                Some(p) => dot_str(&format!("{dir}|{peer}|{}", prefix_text(p))),
                None => dot_str(&format!("{dir}|{peer}")),
            };
            let _ = writeln!(out, "  subgraph {} {{", dot_str(&format!("cluster_{dir}")));
            let title = self.dot_title(side, eval.as_ref());
            let _ = writeln!(out, "    label={};", dot_str(&title));
            let trees = peer_trees(state);
            let known: std::collections::BTreeSet<Key> = trees
                .iter()
                .flat_map(|t| {
                    t.nodes.iter().map(|n| Key {
                        peer: t.peer,
                        prefix: n.prefix,
                    })
                })
                .collect();
            let mut edges = Vec::new();
            let covered_edge = |from: &str, cov: &Covered| -> String {
                if !known.contains(&cov.covered_by) {
                    return String::new();
                }
                format!(
                    "{from} -> {} [style=dashed, color=gray50, arrowhead=normal, constraint=false, label=\"covered by\"]",
                    node_id(cov.covered_by.peer, Some(&cov.covered_by.prefix))
                )
            };
            for t in trees {
                let pid = node_id(t.peer, None);
                let _ = writeln!(
                    out,
                    "    {pid} [shape=ellipse, style=solid, label={}];",
                    dot_str(&self.peer_label(t.peer))
                );
                for &r in &t.roots {
                    edges.push(format!(
                        "{pid} -> {}",
                        node_id(t.peer, Some(&t.nodes[r].prefix))
                    ));
                }
                for n in &t.nodes {
                    let id = node_id(t.peer, Some(&n.prefix));
                    let (label, mut attrs) = dot_node(state, t.peer, n, eval.as_ref());
                    if n.entry.is_none() {
                        // No key here: the node is the covered entries themselves.
                        for cov in &n.covered {
                            edges.push(covered_edge(&id, cov));
                        }
                    }
                    attrs.insert(0, format!("label={}", dot_str(&label)));
                    let _ = writeln!(out, "    {id} [{}];", attrs.join(", "));
                    for &ch in &n.children {
                        edges.push(format!(
                            "{id} -> {}",
                            node_id(t.peer, Some(&t.nodes[ch].prefix))
                        ));
                    }
                    if n.entry.is_none() {
                        continue;
                    }
                    for cov in &n.covered {
                        let cid = dot_str(&format!(
                            "{dir}|{}|{}|covered {}",
                            t.peer,
                            prefix_text(&n.prefix),
                            cov.entry
                        ));
                        let mut attrs = vec![
                            format!(
                                "label={}",
                                dot_str(&format!("covered: {}", cov_text(state, cov)))
                            ),
                            "style=\"rounded,dashed\"".to_string(),
                            "color=gray50, fontcolor=gray40".to_string(),
                        ];
                        if eval.as_ref().and_then(|ev| ev.covered_mark(cov)).is_some() {
                            attrs.push("penwidth=2".to_string());
                        }
                        let _ = writeln!(out, "    {cid} [{}];", attrs.join(", "));
                        edges.push(format!("{id} -> {cid} [style=dotted]"));
                        edges.push(covered_edge(&cid, cov));
                    }
                }
            }
            for e in edges.iter().filter(|e| !e.is_empty()) {
                let _ = writeln!(out, "    {e};");
            }
            let _ = writeln!(out, "  }}");
        }
        let _ = writeln!(out, "}}");
        out
    }

    /// The title of one direction's cluster: default, and the focus with what decided it.
    fn dot_title(&self, side: &Side<'_>, eval: Option<&FocusEval<'_>>) -> String {
        let state = side.state;
        let dir = state.direction().as_str();
        let mut title = format!(
            "{} {dir}: default {}",
            self.endpoint,
            state.default_verdict()
        );
        if let Some(n) = &side.default_note {
            let _ = write!(title, " ({n})");
        }
        if let Some(ev) = eval {
            let _ = write!(
                title,
                "\nfocus {}/{} {}: {}",
                ev.focus.protocol,
                ev.focus.port,
                self.identity_text(ev.focus.identity),
                ev.decision.verdict()
            );
            match ev.decided_by() {
                Some(k) => {
                    let _ = write!(title, " by {}", key_text(&k));
                }
                None => title.push_str(" by the default"),
            }
        }
        title
    }
}

/// The Graphviz label and attributes of one trie node (a key, a grouping line, or the entries
/// covered at a block without a key of its own).
fn dot_node(
    state: &MapState,
    peer: Peer,
    n: &Node<'_>,
    eval: Option<&FocusEval<'_>>,
) -> (String, Vec<String>) {
    let mut attrs = Vec::new();
    let mut label = prefix_text(&n.prefix);
    match n.entry {
        Some(e) => {
            let _ = write!(label, "\n{} {}", e.verdict, order_text(&e.order));
            for o in e.origins.iter() {
                let _ = write!(label, "\n{}", origin_text(o));
            }
            let colour = match e.verdict {
                Verdict::Allow => "darkgreen",
                Verdict::Deny => "red3",
            };
            attrs.push(format!("color={colour}"));
            if e.synthesized {
                label.push_str("\n[covering copy of *]");
                attrs.push("style=\"rounded,dashed\"".to_string());
            }
            match eval.and_then(|ev| ev.key_mark(peer, &n.prefix)) {
                Some(Mark::Decides) => {
                    label.push_str("\n<< decides >>");
                    attrs.push("penwidth=3, peripheries=2".to_string());
                }
                Some(m) => {
                    let _ = write!(label, "\n({})", m.json());
                    attrs.push("penwidth=2".to_string());
                }
                None => {}
            }
        }
        None if n.covered.is_empty() => {
            attrs.push("shape=plaintext".to_string());
        }
        None => {
            // No key here: the node is the covered entries themselves.
            for cov in &n.covered {
                let _ = write!(label, "\ncovered: {}", cov_text(state, cov));
            }
            attrs.push("style=\"rounded,dashed\"".to_string());
            attrs.push("color=gray50, fontcolor=gray40".to_string());
            if n.covered
                .iter()
                .any(|cov| eval.and_then(|ev| ev.covered_mark(cov)).is_some())
            {
                attrs.push("penwidth=2".to_string());
            }
        }
    }
    (label, attrs)
}

/// Writes the rows with aligned columns (and the focus gutter).
fn write_rows(rows: Vec<Row>, gutter: bool, c: bool, out: &mut String) {
    // Align the columns.
    let w_label = rows
        .iter()
        .filter(|r| !r.header)
        .map(|r| width(&r.label))
        .max()
        .unwrap_or(0);
    let w_order = rows.iter().map(|r| width(&r.order)).max().unwrap_or(0);
    let w_origin = rows.iter().map(|r| width(&r.origin)).max().unwrap_or(0);
    for r in rows {
        let mut line = String::new();
        if gutter {
            match r.mark {
                Some(m) => line.push_str(&paint(c, Paint::Cyan, m.gutter())),
                None => line.push_str("  "),
            }
            line.push(' ');
        } else {
            line.push_str("  ");
        }
        if r.header {
            let p = if r.note { Paint::Dim } else { Paint::Bold };
            line.push_str(&paint(c, p, &r.label));
            let _ = writeln!(out, "{}", line.trim_end());
            continue;
        }
        let decides = r.mark == Some(Mark::Decides);
        let base = if r.covered { Paint::Dim } else { Paint::Plain };
        let label_paint = if decides { Paint::Bold } else { base };
        line.push_str(&paint(c, label_paint, &pad(&r.label, w_label)));
        line.push_str("  ");
        let v = r.verdict.map(|v| v.as_str()).unwrap_or("");
        let vp = match r.verdict {
            Some(v) if !r.covered => verdict_paint(v),
            _ => base,
        };
        line.push_str(&paint(c, vp, &pad(v, 5)));
        line.push_str("  ");
        line.push_str(&paint(c, base, &pad(&r.order, w_order)));
        line.push_str("  ");
        line.push_str(&paint(c, base, &pad(&r.origin, w_origin)));
        if !r.flags.is_empty() {
            line.push_str("  ");
            let fp = if r.covered { Paint::Dim } else { Paint::Yellow };
            line.push_str(&paint(c, fp, &r.flags));
        }
        if let Some(m) = r.mark {
            line.push_str("  ");
            let mp = if decides { Paint::Cyan } else { Paint::Dim };
            line.push_str(&paint(c, mp, m.tree()));
        }
        let _ = writeln!(out, "{}", line.trim_end());
    }
}

/// `deny (300, 1) OrderedNetworkPolicy x/late ingress[1]` for a covered entry.
fn cov_text(state: &MapState, cov: &Covered) -> String {
    match state.policy_entry(cov.entry) {
        Some(e) => format!(
            "{} {} {}",
            e.verdict(),
            order_text(&e.order),
            origin_text(&e.origin)
        ),
        None => format!("entry {}", cov.entry),
    }
}

/// A Graphviz double-quoted string.
fn dot_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for ch in s.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use ordnet_mapstate::{Direction, EntryId, L4Match, PolicyEntry, Selector};

    fn entry(
        id: u64,
        name: &str,
        order: (i32, u32),
        verdict: Verdict,
        selector: Selector,
        l4: L4Match,
    ) -> PolicyEntry {
        PolicyEntry {
            id: EntryId(id),
            order: OrderKey::new(order.0, order.1),
            action: verdict.into(),
            selector,
            l4,
            origin: Arc::new(Origin {
                kind: "OrderedNetworkPolicy".into(),
                namespace: Some("x".into()),
                name: name.into(),
                direction: Direction::Ingress,
                rule_index: order.1,
                rule_name: None,
                priority: order.0,
                action: verdict.into(),
                tier: ordnet_mapstate::Tier::Ordnet,
                passed_by: None,
            }),
        }
    }

    /// Allow TCP 80-90 from everyone at 100, deny TCP 85 from everyone at 50, identity 7 gets
    /// all of TCP at 200 (weaker: the wildcard keys inside it are copied under 7) and a deny
    /// on 86 at 300 (covered); a deny on 88 at 150 is covered by the 88-89 allow.
    fn sample() -> MapState {
        let tcp = Protocol::Tcp;
        MapState::build(
            Direction::Ingress,
            Verdict::Deny,
            [
                entry(
                    1,
                    "range",
                    (100, 0),
                    Verdict::Allow,
                    Selector::Any,
                    L4Match::Ports {
                        proto: tcp,
                        first: 80,
                        last: 90,
                    },
                ),
                entry(
                    2,
                    "hole",
                    (50, 0),
                    Verdict::Deny,
                    Selector::Any,
                    L4Match::port(tcp, 85),
                ),
                entry(
                    3,
                    "tcp-for-7",
                    (200, 0),
                    Verdict::Allow,
                    Selector::ids([7]),
                    L4Match::Proto(tcp),
                ),
                entry(
                    4,
                    "late",
                    (300, 1),
                    Verdict::Deny,
                    Selector::ids([7]),
                    L4Match::port(tcp, 86),
                ),
                entry(
                    5,
                    "weak",
                    (150, 0),
                    Verdict::Deny,
                    Selector::Any,
                    L4Match::port(tcp, 88),
                ),
            ],
        )
        .unwrap()
    }

    fn labels(id: Identity) -> Option<String> {
        (id == 7).then(|| "y/pod=b".to_string())
    }

    /// A smaller state for the JSON and dot tests: allow TCP 80-81 from everyone (NetworkPolicy,
    /// (0, 0)), a cluster deny of TCP 81 from identity 3 at -5, a covered deny of TCP 80 at 10.
    fn small() -> MapState {
        let tcp = Protocol::Tcp;
        let mut np = entry(
            1,
            "web",
            (0, 0),
            Verdict::Allow,
            Selector::Any,
            L4Match::Ports {
                proto: tcp,
                first: 80,
                last: 81,
            },
        );
        np.origin = Arc::new(Origin {
            kind: "NetworkPolicy".into(),
            ..(*np.origin).clone()
        });
        let mut guard = entry(
            2,
            "guard",
            (-5, 0),
            Verdict::Deny,
            Selector::ids([3]),
            L4Match::port(tcp, 81),
        );
        guard.origin = Arc::new(Origin {
            kind: "ClusterOrderedNetworkPolicy".into(),
            namespace: None,
            ..(*guard.origin).clone()
        });
        let late = entry(
            3,
            "late",
            (10, 0),
            Verdict::Deny,
            Selector::Any,
            L4Match::port(tcp, 80),
        );
        MapState::build(Direction::Ingress, Verdict::Allow, [np, guard, late]).unwrap()
    }

    #[test]
    fn tree_shows_the_trie_with_flags() {
        let ms = sample();
        let d = Dump::new("x/a")
            .side(&ms, Some("isolated by OrderedNetworkPolicy x/range".into()))
            .labels(labels);
        let want = "\
x/a ingress: 9 keys, 2 covered entries
  default when no key matches: deny (isolated by OrderedNetworkPolicy x/range)
  * any identity
  └─ TCP
     ├─ 80-87  allow  (100, 0)  OrderedNetworkPolicy x/range ingress[0]
     │  └─ 85  deny   (50, 0)   OrderedNetworkPolicy x/hole ingress[0]
     ├─ 88-89  allow  (100, 0)  OrderedNetworkPolicy x/range ingress[0]
     │  └─ 88  deny   (150, 0)  OrderedNetworkPolicy x/weak ingress[0]       covered by [* TCP/88-89]
     └─ 90     allow  (100, 0)  OrderedNetworkPolicy x/range ingress[0]
  identity 7 (y/pod=b)
  └─ TCP       allow  (200, 0)  OrderedNetworkPolicy x/tcp-for-7 ingress[0]
     ├─ 80-87  allow  (100, 0)  OrderedNetworkPolicy x/range ingress[0]      [covering copy of *]
     │  ├─ 85  deny   (50, 0)   OrderedNetworkPolicy x/hole ingress[0]       [covering copy of *]
     │  └─ 86  deny   (300, 1)  OrderedNetworkPolicy x/late ingress[1]       covered by [7 TCP]
     ├─ 88-89  allow  (100, 0)  OrderedNetworkPolicy x/range ingress[0]      [covering copy of *]
     └─ 90     allow  (100, 0)  OrderedNetworkPolicy x/range ingress[0]      [covering copy of *]
";
        assert_eq!(d.tree(TreeOptions::default()), want);
    }

    #[test]
    fn focus_path_only_shows_the_lookup_in_order() {
        let ms = sample();
        let d = Dump::new("x/a")
            .side(&ms, Some("isolated by OrderedNetworkPolicy x/range".into()))
            .labels(labels)
            .focus(Focus {
                identity: Some(7),
                protocol: Protocol::Tcp,
                port: 86,
            });
        let opts = TreeOptions {
            path_only: true,
            legend: true,
            ..TreeOptions::default()
        };
        let want = "\
x/a ingress: 9 keys, 2 covered entries
  default when no key matches: deny (isolated by OrderedNetworkPolicy x/range)
  focus: TCP/86 from identity 7 (y/pod=b): allow, decided by key [7 TCP/80-87] (100, 0) OrderedNetworkPolicy x/range ingress[0] [covering copy of *]
   identity 7 (y/pod=b)
 > └─ TCP       allow  (200, 0)  OrderedNetworkPolicy x/tcp-for-7 ingress[0]  ◀ matches, a longer key decides
=>    └─ 80-87  allow  (100, 0)  OrderedNetworkPolicy x/range ingress[0]      [covering copy of *]  ◀ decides
 ~       └─ 86  deny   (300, 1)  OrderedNetworkPolicy x/late ingress[1]       covered by [7 TCP]  ◀ would match, covered
   * any identity
   └─ TCP
 >    └─ 80-87  allow  (100, 0)  OrderedNetworkPolicy x/range ingress[0]      ◀ matches, not consulted: the identity has its own key

legend:
  KEY  VERDICT  (PRIORITY, RULE INDEX)  RULE: one key of the trie and the rule it comes from
  lookup: the identity's own keys first (longest prefix wins); if none matches, the * keys; then the default
  [covering copy of *]  a * entry copied under the identity, because it is stronger than a broader key there
  covered by [PEER KEY] this rule never decides for that peer: an equal or broader, stronger key wins
  port ranges are stored as aligned blocks: 8000-8999 = 8000-8063, 8064-8191, 8192-8703, ...
  => the key that decides the focused packet;  > matches but loses;  ~ covered entry that would match
";
        assert_eq!(d.tree(opts), want);

        // An identity without keys of its own falls through to `*`; a packet nothing matches
        // gets the default.
        let d = Dump::new("x/a").side(&ms, None).focus(Focus {
            identity: Some(9),
            protocol: Protocol::Tcp,
            port: 85,
        });
        let want = "\
x/a ingress: 9 keys, 2 covered entries
  default when no key matches: deny
  focus: TCP/85 from identity 9: deny, decided by key [* TCP/85] (50, 0) OrderedNetworkPolicy x/hole ingress[0]
   identity 9
   └─ (no keys of its own: the lookup goes on with the * keys)
   * any identity
   └─ TCP
 >    └─ 80-87  allow  (100, 0)  OrderedNetworkPolicy x/range ingress[0]  ◀ matches, a longer key decides
=>       └─ 85  deny   (50, 0)   OrderedNetworkPolicy x/hole ingress[0]   ◀ decides
";
        let opts = TreeOptions {
            path_only: true,
            ..TreeOptions::default()
        };
        assert_eq!(d.tree(opts), want);
        let d = Dump::new("x/a").side(&ms, None).focus(Focus {
            identity: None,
            protocol: Protocol::Udp,
            port: 85,
        });
        let want = "\
x/a ingress: 9 keys, 2 covered entries
  default when no key matches: deny
  focus: UDP/85 from an address without identity: deny: no key matches, the default applies
   * any identity
   └─ (no matching key: the default applies)
";
        assert_eq!(d.tree(opts), want);

        // A grouping line ("TCP" of `*`) without a matching key under it is left out.
        let d95 = Dump::new("x/a")
            .side(&ms, None)
            .labels(labels)
            .focus(Focus {
                identity: Some(7),
                protocol: Protocol::Tcp,
                port: 95,
            });
        let want = "\
x/a ingress: 9 keys, 2 covered entries
  default when no key matches: deny
  focus: TCP/95 from identity 7 (y/pod=b): allow, decided by key [7 TCP] (200, 0) OrderedNetworkPolicy x/tcp-for-7 ingress[0]
   identity 7 (y/pod=b)
=> └─ TCP  allow  (200, 0)  OrderedNetworkPolicy x/tcp-for-7 ingress[0]  ◀ decides
   * any identity
   └─ (no matching key: the default applies)
";
        assert_eq!(d95.tree(opts), want);
        // A state without `*` keys still shows where the lookup would go on.
        let only_7 = MapState::build(
            Direction::Ingress,
            Verdict::Deny,
            [entry(
                3,
                "tcp-for-7",
                (200, 0),
                Verdict::Allow,
                Selector::ids([7]),
                L4Match::Proto(Protocol::Tcp),
            )],
        )
        .unwrap();
        let d8 = Dump::new("x/a").side(&only_7, None).focus(Focus {
            identity: Some(8),
            protocol: Protocol::Tcp,
            port: 95,
        });
        let want = "\
x/a ingress: 1 key, 0 covered entries
  default when no key matches: deny
  focus: TCP/95 from identity 8: deny: no key matches, the default applies
   identity 8
   └─ (no keys of its own: the lookup goes on with the * keys)
   * any identity
   └─ (no keys of its own: the default applies)
";
        assert_eq!(d8.tree(opts), want);

        // Without the header: only the path, for callers that print their own summary.
        let opts = TreeOptions {
            path_only: true,
            omit_header: true,
            ..TreeOptions::default()
        };
        let want = "   * any identity\n   └─ (no matching key: the default applies)\n";
        assert_eq!(d.tree(opts), want);
    }

    #[test]
    fn full_tree_with_focus_marks_every_matching_line() {
        let sm = small();
        let d = Dump::new("x/a")
            .side(&sm, Some("not isolated".into()))
            .labels(|id| Some(format!("l{id}")))
            .focus(Focus {
                identity: Some(3),
                protocol: Protocol::Tcp,
                port: 81,
            });
        let want = "\
x/a ingress: 2 keys, 1 covered entry
  default when no key matches: allow (not isolated)
  focus: TCP/81 from identity 3 (l3): deny, decided by key [3 TCP/81] (-5, 0) ClusterOrderedNetworkPolicy guard ingress[0]
   * any identity
   └─ TCP
 >    └─ 80-81  allow  (0, 0)   NetworkPolicy x/web ingress[0]                ◀ matches, not consulted: the identity has its own key
         └─ 80  deny   (10, 0)  OrderedNetworkPolicy x/late ingress[0]        covered by [* TCP/80-81]
   identity 3 (l3)
   └─ TCP
=>    └─ 81     deny   (-5, 0)  ClusterOrderedNetworkPolicy guard ingress[0]  ◀ decides
";
        assert_eq!(d.tree(TreeOptions::default()), want);
    }

    fn strip_ansi(s: &str) -> String {
        let mut out = String::new();
        let mut chars = s.chars();
        while let Some(c) = chars.next() {
            if c == '\x1b' {
                for c in chars.by_ref() {
                    if c == 'm' {
                        break;
                    }
                }
            } else {
                out.push(c);
            }
        }
        out
    }

    #[test]
    fn colour_only_adds_escapes() {
        let ms = sample();
        let d = Dump::new("x/a")
            .side(&ms, None)
            .labels(labels)
            .focus(Focus {
                identity: Some(7),
                protocol: Protocol::Tcp,
                port: 85,
            });
        for path_only in [false, true] {
            let plain = d.tree(TreeOptions {
                path_only,
                legend: true,
                ..TreeOptions::default()
            });
            let coloured = d.tree(TreeOptions {
                path_only,
                legend: true,
                color: true,
                ..TreeOptions::default()
            });
            assert!(!plain.contains('\x1b'));
            assert!(coloured.contains("\x1b[31mdeny \x1b[0m"), "{coloured}");
            assert!(coloured.contains("\x1b[32mallow\x1b[0m"), "{coloured}");
            assert!(coloured.contains("\x1b[1;36m=>\x1b[0m"), "{coloured}");
            assert_eq!(strip_ansi(&coloured), plain);
        }
    }

    #[test]
    fn json_is_exact_and_sorted() {
        let sm = small();
        let d = Dump::new("x/a")
            .side(&sm, Some("not isolated".into()))
            .labels(|id| Some(format!("l{id}")))
            .focus(Focus {
                identity: Some(3),
                protocol: Protocol::Tcp,
                port: 81,
            });
        let want = json!({
            "endpoint": "x/a",
            "directions": [{
                "direction": "ingress",
                "default": "allow",
                "defaultNote": "not isolated",
                "keyCount": 2,
                "coveredCount": 1,
                "focus": {"identity": 3, "protocol": "TCP", "port": 81, "verdict": "deny",
                          "decidedBy": {"identity": 3, "key": "TCP/81"}},
                "peers": [
                    {"identity": null, "label": "any identity",
                     "keys": [{"key": "TCP/80-81", "parent": null, "protocol": "TCP",
                               "ports": [80, 81], "prefixLen": 23, "verdict": "allow",
                               "order": {"priority": 0, "index": 0}, "entries": [1],
                               "origins": [{"kind": "NetworkPolicy", "namespace": "x",
                                            "name": "web", "direction": "ingress",
                                            "ruleIndex": 0, "priority": 0, "action": "allow"}],
                               "synthesized": false, "focus": "not-consulted"}],
                     "covered": [{"key": "TCP/80", "entry": 3, "verdict": "deny",
                                  "order": {"priority": 10, "index": 0},
                                  "origin": {"kind": "OrderedNetworkPolicy", "namespace": "x",
                                             "name": "late", "direction": "ingress",
                                             "ruleIndex": 0, "priority": 10, "action": "deny"},
                                  "coveredBy": {"identity": null, "key": "TCP/80-81"}}]},
                    {"identity": 3, "label": "l3",
                     "keys": [{"key": "TCP/81", "parent": null, "protocol": "TCP",
                               "ports": [81, 81], "prefixLen": 24, "verdict": "deny",
                               "order": {"priority": -5, "index": 0}, "entries": [2],
                               "origins": [{"kind": "ClusterOrderedNetworkPolicy",
                                            "namespace": null, "name": "guard",
                                            "direction": "ingress", "ruleIndex": 0,
                                            "priority": -5, "action": "deny"}],
                               "synthesized": false, "focus": "decides"}],
                     "covered": []}
                ]
            }]
        });
        assert_eq!(d.json(), want);
        // Object keys come out sorted, so the text is stable too.
        let text = d.json_string();
        assert!(text.starts_with("{\n  \"directions\": ["), "{text}");
        assert!(text.ends_with("\"endpoint\": \"x/a\"\n}\n"), "{text}");
    }

    #[test]
    fn json_parents_and_focus_agree_with_the_state() {
        let ms = sample();
        for id in [Some(7), Some(9), None] {
            for port in 78..=92 {
                let focus = Focus {
                    identity: id,
                    protocol: Protocol::Tcp,
                    port,
                };
                let doc = Dump::new("x/a").side(&ms, None).focus(focus).json();
                let side = &doc["directions"][0];
                let want = match ms.lookup(id, Protocol::Tcp.number(), port) {
                    Decision::Matched { key, .. } => json!({
                        "identity": peer_identity(key.peer),
                        "key": prefix_text(&key.prefix),
                    }),
                    Decision::Default(_) => Value::Null,
                };
                assert_eq!(side["focus"]["decidedBy"], want, "{id:?} TCP/{port}");
                let decides: Vec<&Value> = side["peers"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .flat_map(|p| p["keys"].as_array().unwrap())
                    .filter(|k| k["focus"] == "decides")
                    .collect();
                assert_eq!(decides.len(), usize::from(!want.is_null()), "{id:?} {port}");
            }
        }
        let doc = Dump::new("x/a").side(&ms, None).json();
        let keys: Vec<(Value, Value)> = doc["directions"][0]["peers"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|p| p["keys"].as_array().unwrap())
            .map(|k| (k["key"].clone(), k["parent"].clone()))
            .collect();
        assert_eq!(keys.len(), ms.len());
        // `*`: the grouping line "TCP" is no key, so 80-87 has no parent; identity 7: TCP is one.
        assert_eq!(keys[0], (json!("TCP/80-87"), Value::Null));
        assert_eq!(keys[1], (json!("TCP/85"), json!("TCP/80-87")));
        assert_eq!(keys[5], (json!("TCP/80-87"), json!("TCP")));
        assert_eq!(keys[6], (json!("TCP/85"), json!("TCP/80-87")));
    }

    #[test]
    fn dot_is_exact() {
        let sm = small();
        let d = Dump::new("x/a")
            .side(&sm, Some("not isolated".into()))
            .labels(|id| Some(format!("l{id}")))
            .focus(Focus {
                identity: Some(3),
                protocol: Protocol::Tcp,
                port: 81,
            });
        let want = r#"digraph "mapstate x/a" {
  graph [rankdir=LR, fontname="monospace", labelloc=t, label="MapState of x/a"];
  node [shape=box, style=rounded, fontname="monospace", fontsize=10];
  edge [arrowhead=none];
  subgraph "cluster_ingress" {
    label="x/a ingress: default allow (not isolated)\nfocus TCP/81 identity 3 (l3): deny by [3 TCP/81]";
    "ingress|*" [shape=ellipse, style=solid, label="* any identity"];
    "ingress|*|TCP" [label="TCP", shape=plaintext];
    "ingress|*|TCP/80-81" [label="TCP/80-81\nallow (0, 0)\nNetworkPolicy x/web ingress[0]\n(not-consulted)", color=darkgreen, penwidth=2];
    "ingress|*|TCP/80" [label="TCP/80\ncovered: deny (10, 0) OrderedNetworkPolicy x/late ingress[0]", style="rounded,dashed", color=gray50, fontcolor=gray40];
    "ingress|3" [shape=ellipse, style=solid, label="identity 3 (l3)"];
    "ingress|3|TCP" [label="TCP", shape=plaintext];
    "ingress|3|TCP/81" [label="TCP/81\ndeny (-5, 0)\nClusterOrderedNetworkPolicy guard ingress[0]\n<< decides >>", color=red3, penwidth=3, peripheries=2];
    "ingress|*" -> "ingress|*|TCP";
    "ingress|*|TCP" -> "ingress|*|TCP/80-81";
    "ingress|*|TCP/80-81" -> "ingress|*|TCP/80";
    "ingress|*|TCP/80" -> "ingress|*|TCP/80-81" [style=dashed, color=gray50, arrowhead=normal, constraint=false, label="covered by"];
    "ingress|3" -> "ingress|3|TCP";
    "ingress|3|TCP" -> "ingress|3|TCP/81";
  }
}
"#;
        assert_eq!(d.dot(), want);
        // Quotes and backslashes in caller-supplied text are escaped.
        assert_eq!(dot_str("a\"b\\c\nd"), r#""a\"b\\c\nd""#);
    }

    #[test]
    fn both_directions_and_an_empty_state() {
        let ms = small();
        let empty = MapState::new(Direction::Egress, Verdict::Allow);
        let d = Dump::new("x/a")
            .side(&ms, None)
            .side(&empty, Some("not isolated".into()));
        let tree = d.tree(TreeOptions::default());
        assert!(
            tree.ends_with(
                "\n\nx/a egress: 0 keys, 0 covered entries\n  default when no key matches: allow (not isolated)\n  (no keys)\n"
            ),
            "{tree}"
        );
        let doc = d.json();
        assert_eq!(doc["directions"][1]["direction"], "egress");
        assert_eq!(doc["directions"][1]["peers"], json!([]));
        let dot = d.dot();
        assert!(
            dot.contains("subgraph \"cluster_ingress\"")
                && dot.contains("subgraph \"cluster_egress\"")
        );
    }
}
