//! The kernel's per-rule counters as operators see them (`docs/observe.md` §8): one row per
//! rule (and per isolation default) with the new flows it allowed, the flows and packets it
//! denied, since the agent started. Filtered like `ordnet observe`, rendered as a table or
//! JSON (`/v1/counters`, `ordnet observe --counters`, `ordnet lab --observe`), and turned into
//! the `ordnet_rule_*` metrics.

use ordnet_datapath::{RuleId, RuleTotals};
use ordnet_mapstate::{Action, Direction};
use serde::Serialize;

use crate::agent::metrics::Sample;
use crate::render::{Align, Cell, Style, table};

/// One rule's counts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RuleCounterRow {
    /// The rule (or default) counted.
    pub rule: RuleId,
    /// Its policy's priority and the rule's action, when known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub priority: Option<i32>,
    /// The rule's action, when known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub action: Option<Action>,
    /// New flows allowed, in every direction that judged them.
    pub flows_allowed: u64,
    /// Denied flows (first denied packets).
    pub flows_denied: u64,
    /// Denied packets.
    pub packets_denied: u64,
}

/// Which rows to show: those of one policy (`name` or `namespace/name`), or of one namespace's
/// policies (the defaults always pass: they belong to no policy).
#[derive(Debug, Clone, Default)]
pub struct CounterFilter {
    /// Only this policy.
    pub policy: Option<String>,
    /// Only the policies of this namespace.
    pub namespace: Option<String>,
}

impl CounterFilter {
    fn passes(&self, id: &RuleId) -> bool {
        let RuleId::Rule {
            namespace, name, ..
        } = id
        else {
            return self.policy.is_none();
        };
        let policy = self
            .policy
            .as_deref()
            .is_none_or(|p| match p.split_once('/') {
                Some((ns, n)) => namespace.as_deref() == Some(ns) && name == n,
                None => name == p,
            });
        let ns = self
            .namespace
            .as_deref()
            .is_none_or(|want| namespace.as_deref() == Some(want));
        policy && ns
    }
}

/// The rows of `totals` that pass `filter`, in rule order.
pub fn rows(totals: &RuleTotals, filter: &CounterFilter) -> Vec<RuleCounterRow> {
    totals
        .totals()
        .iter()
        .filter(|(id, _)| filter.passes(id))
        .map(|(id, c)| {
            let origin = totals.origin(id);
            RuleCounterRow {
                rule: id.clone(),
                priority: origin.map(|o| o.priority),
                action: origin.map(|o| o.action),
                flows_allowed: c.flows_allowed,
                flows_denied: c.flows_denied,
                packets_denied: c.packets_denied,
            }
        })
        .collect()
}

fn direction_name(d: Direction) -> &'static str {
    match d {
        Direction::Ingress => "ingress",
        Direction::Egress => "egress",
    }
}

/// How a row names its rule: `Kind ns/name ingress rule 2`, `ingress default (deny)`.
pub fn rule_name(id: &RuleId) -> String {
    match id {
        RuleId::Rule {
            policy_kind,
            namespace,
            name,
            direction,
            index,
        } => {
            let policy = match namespace {
                Some(ns) => format!("{policy_kind} {ns}/{name}"),
                None => format!("{policy_kind} {name}"),
            };
            format!("{policy} {} rule {index}", direction_name(*direction))
        }
        RuleId::Default { direction, allow } => format!(
            "{} default ({})",
            direction_name(*direction),
            if *allow {
                "allow: not isolated"
            } else {
                "deny: isolated"
            }
        ),
        RuleId::Unattributed => "unattributed".to_string(),
    }
}

/// The rows as a table (or a line saying there are none).
pub fn text(rows: &[RuleCounterRow], style: Style) -> String {
    if rows.is_empty() {
        return "no rule has counted a flow yet\n".to_string();
    }
    let mut t = vec![
        [
            "RULE",
            "ACTION",
            "FLOWS ALLOWED",
            "FLOWS DENIED",
            "PACKETS DENIED",
        ]
        .map(|h| Cell::styled(h, |s| style.bold(s)))
        .to_vec(),
    ];
    for r in rows {
        let action = match (&r.rule, r.action) {
            (_, Some(a)) => format!("{a:?}"),
            (RuleId::Default { allow: true, .. }, None) => "Allow".into(),
            (RuleId::Default { allow: false, .. }, None) => "Deny".into(),
            _ => String::new(),
        };
        t.push(vec![
            Cell::plain(rule_name(&r.rule)),
            Cell::plain(action),
            Cell::plain(r.flows_allowed.to_string()),
            Cell::plain(r.flows_denied.to_string()),
            Cell::plain(r.packets_denied.to_string()),
        ]);
    }
    table(&t, &[Align::Left], 2)
}

/// The rows as JSON (`{"rules": [...]}`).
pub fn json(rows: &[RuleCounterRow]) -> String {
    serde_json::to_string_pretty(&serde_json::json!({ "rules": rows })).expect("rows serialize")
        + "\n"
}

/// The `ordnet_rule_*` metrics: per rule (labels `kind`, `namespace`, `policy`, `direction`,
/// `rule`) and per isolation default (`policy="default"`, `rule="allow"|"deny"`). The series
/// are bounded by the rules the kernel's counter elements name (`RuleTotals::forget_unowned`).
pub fn samples(totals: &RuleTotals) -> Vec<Sample> {
    let mut out = Vec::new();
    for (id, c) in totals.totals() {
        let labels: Vec<(&'static str, String)> = match id {
            RuleId::Rule {
                policy_kind,
                namespace,
                name,
                direction,
                index,
            } => vec![
                ("kind", policy_kind.clone()),
                ("namespace", namespace.clone().unwrap_or_default()),
                ("policy", name.clone()),
                ("direction", direction_name(*direction).into()),
                ("rule", index.to_string()),
            ],
            RuleId::Default { direction, allow } => vec![
                ("kind", String::new()),
                ("namespace", String::new()),
                ("policy", "default".into()),
                ("direction", direction_name(*direction).into()),
                ("rule", if *allow { "allow" } else { "deny" }.into()),
            ],
            RuleId::Unattributed => vec![
                ("kind", String::new()),
                ("namespace", String::new()),
                ("policy", "unattributed".into()),
                ("direction", String::new()),
                ("rule", String::new()),
            ],
        };
        for (name, help, value) in [
            (
                "ordnet_rule_flows_allowed",
                "New flows a rule allowed (per direction judged), since the agent started.",
                c.flows_allowed,
            ),
            (
                "ordnet_rule_flows_denied",
                "Flows a rule denied (their first denied packet), since the agent started.",
                c.flows_denied,
            ),
            (
                "ordnet_rule_packets_denied",
                "Packets a rule denied, since the agent started.",
                c.packets_denied,
            ),
        ] {
            out.push(Sample {
                name,
                help,
                counter: true,
                labels: labels.clone(),
                value,
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(ns: Option<&str>, name: &str) -> RuleId {
        RuleId::Rule {
            policy_kind: "NetworkPolicy".into(),
            namespace: ns.map(str::to_string),
            name: name.into(),
            direction: Direction::Ingress,
            index: 1,
        }
    }

    #[test]
    fn filters_by_policy_and_namespace() {
        let by = |policy: Option<&str>, namespace: Option<&str>| CounterFilter {
            policy: policy.map(str::to_string),
            namespace: namespace.map(str::to_string),
        };
        let a = rule(Some("x"), "a");
        let dflt = RuleId::Default {
            direction: Direction::Egress,
            allow: false,
        };
        assert!(by(None, None).passes(&a));
        assert!(by(Some("a"), None).passes(&a));
        assert!(by(Some("x/a"), None).passes(&a));
        assert!(!by(Some("y/a"), None).passes(&a));
        assert!(!by(Some("b"), None).passes(&a));
        assert!(by(None, Some("x")).passes(&a));
        assert!(!by(None, Some("y")).passes(&a));
        assert!(by(None, Some("y")).passes(&dflt));
        assert!(!by(Some("a"), None).passes(&dflt));
        assert_eq!(
            rule_name(&a),
            "NetworkPolicy x/a ingress rule 1".to_string()
        );
        assert_eq!(rule_name(&dflt), "egress default (deny: isolated)");
    }
}
