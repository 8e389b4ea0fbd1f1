//! What traffic did, in policy status (`status.traffic`, docs/observe.md §9).
//!
//! The kernel's per-rule counters are per node; a policy's status is cluster-wide and written by
//! one agent (the status writer, `status.rs`). So:
//!
//! * every agent whose datapath counts per rule publishes, every window
//!   (`--traffic-window`, [`DEFAULT_WINDOW`]), one **node report**: a ConfigMap
//!   `ordnet-traffic-<node>` in the agent's namespace, labelled [`REPORT_LABEL`], written by
//!   server-side apply, whose [`REPORT_KEY`] holds a [`NodeReport`]: per rule of an ordered
//!   policy that counted anything since the agent started, what it counted in the last window and
//!   in all. One write per node and window, whatever the number of policies;
//! * the status writer lists them once per window ([`Cluster::refresh`]), leaves out the reports
//!   that stopped changing (a node gone: [`STALE_WINDOWS`] windows by its own clock, as the Lease
//!   is judged, so clock skew does not matter), and sums them per policy ([`Cluster::traffic`]):
//!   the rules that decided something in the last window with what they decided, and the rules
//!   that decided nothing on any reporting node since it began counting.
//!
//! A policy's status is written when what it says changes, so a policy whose rules see traffic
//! is written at most once per window.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::jiff::Timestamp;
use kube::api::{ListParams, Patch, PatchParams};
use kube::{Api, Client};
use ordnet_crds::{
    Direction, MAX_STAGED_EXAMPLES, PolicyTraffic, RuleTraffic, StagedRuleTraffic, StagedTraffic,
};
use ordnet_datapath::common::layout::RuleCount;
use ordnet_datapath::{RuleId, RuleTotals};
use ordnet_engine::ObjectKind;
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::staged::{StagedCount, StagedRule};
use super::{AgentState, ObjKey};

/// The length of a window by default (`ordnet agent --traffic-window`).
pub const DEFAULT_WINDOW: Duration = Duration::from_secs(60);
/// The label of the node reports (value `"true"`).
pub const REPORT_LABEL: &str = "ordnet.io/traffic-report";
/// The ConfigMap key of a node report.
pub const REPORT_KEY: &str = "report.json";
/// The name of a node report is this and the node's name.
pub const REPORT_PREFIX: &str = "ordnet-traffic-";
/// Most rules in one node report (about 120 bytes each: a ConfigMap holds 1 MiB). The rules
/// that decided least in the last window are left out first; [`NodeReport::left_out`] counts
/// them, and the status writer then does not claim any rule unmatched.
pub const MAX_REPORTED_RULES: usize = 6000;
/// A report that has not changed for this many of its windows, by the status writer's clock,
/// is left out (its agent stopped: the node is gone, or the agent cannot write).
pub const STALE_WINDOWS: u32 = 3;

/// What one node's datapath counted, per rule of an ordered policy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeReport {
    /// The node.
    pub node: String,
    /// The window's length, in seconds.
    pub window_seconds: u32,
    /// When the agent began counting (RFC 3339).
    pub counting_since: String,
    /// When this report was made (RFC 3339); it changes with every report.
    pub window_end: String,
    /// Per rule that counted anything since counting began.
    pub rules: Vec<ReportedRule>,
    /// Rules left out to keep the report small ([`MAX_REPORTED_RULES`]).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub left_out: u64,
    /// Per rule of a staged policy that would have changed a flow since counting began.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub staged: Vec<ReportedStaged>,
    /// Per staged policy: the last flows it would change on this node.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub examples: Vec<ReportedExamples>,
}

/// What one rule of a staged policy would have changed on one node: `[flows it would deny,
/// flows it would allow]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReportedStaged {
    /// `OrderedNetworkPolicy` or `ClusterOrderedNetworkPolicy`.
    pub kind: String,
    /// The policy's namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// The policy's name.
    pub name: String,
    /// The direction.
    pub direction: Direction,
    /// The rule's index; absent: the isolation the policy adds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index: Option<u32>,
    /// In the last window.
    pub window: [u64; 2],
    /// Since counting began.
    pub total: [u64; 2],
}

/// The last flows a staged policy would change on one node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReportedExamples {
    /// `OrderedNetworkPolicy` or `ClusterOrderedNetworkPolicy`.
    pub kind: String,
    /// The policy's namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// The policy's name.
    pub name: String,
    /// The flows, oldest first.
    pub flows: Vec<String>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// One rule's counts: `[flows allowed, flows denied, packets denied]`.
pub type Counts = [u64; 3];

/// What one rule counted on one node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReportedRule {
    /// `OrderedNetworkPolicy` or `ClusterOrderedNetworkPolicy`.
    pub kind: String,
    /// The policy's namespace (none for a cluster-wide policy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// The policy's name.
    pub name: String,
    /// The rule's direction.
    pub direction: Direction,
    /// The rule's index in the policy's rules of that direction.
    pub index: u32,
    /// Counted in the last window.
    pub window: Counts,
    /// Counted since counting began.
    pub total: Counts,
}

fn counts(c: RuleCount) -> Counts {
    [c.flows_allowed, c.flows_denied, c.packets_denied]
}

/// The node side: the totals at the end of the last window, to report the growth since.
#[derive(Debug, Default)]
pub struct Windows {
    last: BTreeMap<RuleId, Counts>,
    last_staged: BTreeMap<StagedRule, [u64; 2]>,
}

impl Windows {
    /// The report of `totals` now (and the start of the next window).
    pub fn report(
        &mut self,
        node: &str,
        window: Duration,
        counting_since: Timestamp,
        now: Timestamp,
        totals: &BTreeMap<RuleId, RuleCount>,
    ) -> NodeReport {
        let mut rules = Vec::new();
        let mut last = BTreeMap::new();
        for (id, count) in totals {
            let RuleId::Rule {
                policy_kind,
                namespace,
                name,
                direction,
                index,
            } = id
            else {
                continue;
            };
            if !matches!(
                ObjectKind::named(policy_kind),
                Some(ObjectKind::OrderedNetworkPolicy | ObjectKind::ClusterOrderedNetworkPolicy)
            ) {
                continue;
            }
            let total = counts(*count);
            let before = self.last.get(id).copied().unwrap_or_default();
            // A total smaller than before: the rule's totals were forgotten and began again.
            let window = if (0..3).any(|i| total[i] < before[i]) {
                total
            } else {
                [0, 1, 2].map(|i| total[i] - before[i])
            };
            last.insert(id.clone(), total);
            rules.push(ReportedRule {
                kind: policy_kind.clone(),
                namespace: namespace.clone(),
                name: name.clone(),
                direction: match direction {
                    ordnet_mapstate::Direction::Ingress => Direction::Ingress,
                    ordnet_mapstate::Direction::Egress => Direction::Egress,
                },
                index: *index,
                window,
                total,
            });
        }
        self.last = last;
        let mut left_out = 0;
        if rules.len() > MAX_REPORTED_RULES {
            // Keep the rules that decided most in the window, then in all.
            rules.sort_by_key(|r| {
                std::cmp::Reverse((r.window.iter().sum::<u64>(), r.total.iter().sum::<u64>()))
            });
            left_out = (rules.len() - MAX_REPORTED_RULES) as u64;
            rules.truncate(MAX_REPORTED_RULES);
        }
        NodeReport {
            node: node.to_string(),
            window_seconds: u32::try_from(window.as_secs()).unwrap_or(u32::MAX),
            counting_since: counting_since.to_string(),
            window_end: now.to_string(),
            rules,
            left_out,
            staged: Vec::new(),
            examples: Vec::new(),
        }
    }

    /// Adds what the staged rules would have changed (`counts`: since counting began) and the
    /// staged policies' examples to `report`.
    pub fn add_staged(
        &mut self,
        report: &mut NodeReport,
        counts: &BTreeMap<StagedRule, StagedCount>,
        examples: &super::staged::StagedExamples,
    ) {
        let mut last = BTreeMap::new();
        for (k, total) in counts {
            let before = self.last_staged.get(k).copied().unwrap_or_default();
            last.insert(k.clone(), *total);
            report.staged.push(ReportedStaged {
                kind: k.kind.clone(),
                namespace: k.namespace.clone(),
                name: k.name.clone(),
                direction: match k.direction {
                    ordnet_mapstate::Direction::Ingress => Direction::Ingress,
                    ordnet_mapstate::Direction::Egress => Direction::Egress,
                },
                index: k.rule,
                window: [0, 1].map(|i| total[i].saturating_sub(before[i])),
                total: *total,
            });
        }
        self.last_staged = last;
        report.examples = examples
            .iter()
            .map(|((kind, namespace, name), flows)| ReportedExamples {
                kind: kind.clone(),
                namespace: namespace.clone(),
                name: name.clone(),
                flows: flows.clone(),
            })
            .collect();
    }
}

/// The ConfigMap name of `node`'s report: [`REPORT_PREFIX`] and the node's name, or, for a
/// name too long for a ConfigMap, its first characters and a hash of all of it.
pub fn report_name(node: &str) -> String {
    let name = format!("{REPORT_PREFIX}{node}");
    if name.len() <= 253 {
        return name;
    }
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    node.hash(&mut h);
    let keep: String = node.chars().take(200).collect();
    format!(
        "{REPORT_PREFIX}{}-{:016x}",
        keep.trim_end_matches(['.', '-']),
        h.finish()
    )
}

/// Publishes this node's report every `window` while the datapath counts per rule.
pub async fn report_loop(
    client: Client,
    state: Arc<AgentState>,
    namespace: String,
    window: Duration,
) {
    let api: Api<ConfigMap> = Api::namespaced(client, &namespace);
    let name = report_name(&state.node);
    let since = Timestamp::now();
    let mut windows = Windows::default();
    let mut tick = tokio::time::interval(window);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        state.datapath().collect_rule_counts();
        let totals =
            state.with_programmed(|_, dp| dp.rule_totals().map(RuleTotals::totals).cloned());
        let (staged, examples) = state.staged_counts();
        // A datapath that counts per rule reports; another only what staged policies would do.
        let totals = match totals {
            None => continue,
            Some(Some(t)) => t,
            Some(None) if !staged.is_empty() => BTreeMap::new(),
            Some(None) => continue,
        };
        let mut report = windows.report(&state.node, window, since, Timestamp::now(), &totals);
        windows.add_staged(&mut report, &staged, &examples);
        let body = json!({
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": name, "labels": {REPORT_LABEL: "true"}},
            "data": {REPORT_KEY: serde_json::to_string(&report).unwrap_or_default()},
        });
        let params = PatchParams::apply(super::status::FIELD_MANAGER).force();
        if let Err(e) = api.patch(&name, &params, &Patch::Apply(&body)).await {
            tracing::warn!(report = %format!("{namespace}/{name}"), error = %e, "writing the traffic report failed");
        }
    }
}

/// Per (direction, rule or its isolation) of a staged policy: `[would deny, would allow]`.
type StagedSums = BTreeMap<(Direction, Option<u32>), [u64; 2]>;

/// Sums of one rule over the nodes: (last window, since counting began).
type RuleSums = (Counts, Counts);

/// The status writer's side: the nodes' reports, summed per policy.
#[derive(Debug, Default)]
pub struct Cluster {
    /// Per node: its report's `windowEnd` and when this writer saw it change.
    seen: BTreeMap<String, (String, Instant)>,
    sums: BTreeMap<ObjKey, BTreeMap<(Direction, u32), RuleSums>>,
    /// Per staged policy: per (direction, rule or its isolation), `[would deny, would allow]`
    /// in the last window; and its examples.
    staged: BTreeMap<ObjKey, StagedSums>,
    examples: BTreeMap<ObjKey, Vec<String>>,
    nodes: u32,
    window_seconds: u32,
    /// Some report left rules out: no rule is claimed unmatched.
    incomplete: bool,
    listed: Option<Instant>,
    /// This writer's own window, in seconds (said while no node reports).
    configured_seconds: u32,
    /// One more for every list of reports taken ([`Cluster::generation`]).
    generation: u64,
}

/// The apply loop's key of a policy of kind `kind` (`None`: not a kind the agent knows).
fn policy_key(kind: &str, namespace: Option<String>, name: String) -> Option<ObjKey> {
    let kind = ObjectKind::named(kind)?;
    Some((kind, namespace.unwrap_or_default(), name))
}

fn add(a: Counts, b: Counts) -> Counts {
    [0, 1, 2].map(|i| a[i].saturating_add(b[i]))
}

impl Cluster {
    /// Lists the reports when a window has passed since the last list.
    pub async fn refresh(&mut self, client: &Client, namespace: &str, window: Duration) {
        if self.listed.is_some_and(|t| t.elapsed() < window) {
            return;
        }
        let api: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
        // The agent's namespace holds few ConfigMaps: all are listed, the reports picked by
        // their label.
        let list = match api.list(&ListParams::default()).await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(namespace, error = %e, "listing the traffic reports failed");
                return;
            }
        };
        self.listed = Some(Instant::now());
        self.configured_seconds = u32::try_from(window.as_secs_f64().ceil() as u64)
            .unwrap_or(u32::MAX)
            .max(1);
        let reports = list
            .items
            .iter()
            .filter(|cm| {
                cm.metadata
                    .labels
                    .as_ref()
                    .and_then(|l| l.get(REPORT_LABEL))
                    .is_some_and(|v| v == "true")
            })
            .filter_map(|cm| {
                let text = cm.data.as_ref()?.get(REPORT_KEY)?;
                match serde_json::from_str::<NodeReport>(text) {
                    Ok(r) => Some(r),
                    Err(e) => {
                        let name = cm.metadata.name.as_deref().unwrap_or_default();
                        tracing::warn!(report = %format!("{namespace}/{name}"), error = %e, "a traffic report that cannot be read is left out");
                        None
                    }
                }
            })
            .collect();
        self.take(reports, Instant::now());
    }

    /// Changes whenever what [`Cluster::traffic`] and [`Cluster::staged`] say may have changed.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Takes the reports listed at `now`.
    pub fn take(&mut self, reports: Vec<NodeReport>, now: Instant) {
        self.generation += 1;
        self.seen
            .retain(|node, _| reports.iter().any(|r| &r.node == node));
        self.sums.clear();
        self.staged.clear();
        self.examples.clear();
        self.nodes = 0;
        self.window_seconds = 0;
        self.incomplete = false;
        for r in reports {
            let seen = self
                .seen
                .entry(r.node.clone())
                .or_insert_with(|| (r.window_end.clone(), now));
            if seen.0 != r.window_end {
                *seen = (r.window_end.clone(), now);
            }
            let stale = Duration::from_secs(u64::from(r.window_seconds.max(1))) * STALE_WINDOWS;
            if now.duration_since(seen.1) > stale {
                continue;
            }
            self.nodes += 1;
            self.window_seconds = self.window_seconds.max(r.window_seconds);
            self.incomplete |= r.left_out > 0;
            for rule in r.rules {
                let Some(key) = policy_key(&rule.kind, rule.namespace, rule.name) else {
                    continue;
                };
                let sums = self
                    .sums
                    .entry(key)
                    .or_default()
                    .entry((rule.direction, rule.index))
                    .or_default();
                *sums = (add(sums.0, rule.window), add(sums.1, rule.total));
            }
            for st in r.staged {
                let Some(key) = policy_key(&st.kind, st.namespace, st.name) else {
                    continue;
                };
                let sums = self
                    .staged
                    .entry(key)
                    .or_default()
                    .entry((st.direction, st.index))
                    .or_default();
                *sums = [0, 1].map(|i| sums[i].saturating_add(st.window[i]));
            }
            for ex in r.examples {
                let Some(key) = policy_key(&ex.kind, ex.namespace, ex.name) else {
                    continue;
                };
                let list = self.examples.entry(key).or_default();
                let room = MAX_STAGED_EXAMPLES.saturating_sub(list.len());
                // The newest of each node's (at most three), while there is room.
                let skip = ex.flows.len().saturating_sub(room.min(3));
                list.extend(ex.flows.into_iter().skip(skip));
            }
        }
    }

    /// `status.staged` of the staged policy `key` (`None` before the first list).
    pub fn staged(&self, key: &ObjKey) -> Option<StagedTraffic> {
        self.listed?;
        let int = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        let rules = self
            .staged
            .get(key)
            .into_iter()
            .flatten()
            .filter(|(_, c)| c.iter().any(|n| *n > 0))
            .map(|((direction, index), c)| StagedRuleTraffic {
                direction: *direction,
                index: *index,
                flows_would_deny: int(c[0]),
                flows_would_allow: int(c[1]),
            })
            .collect();
        Some(StagedTraffic {
            nodes: self.nodes,
            window_seconds: if self.nodes == 0 {
                self.configured_seconds
            } else {
                self.window_seconds
            },
            rules,
            examples: self.examples.get(key).cloned().unwrap_or_default(),
        })
    }

    /// `status.traffic` of the policy `key`, which has `ingress` and `egress` rules (`None`
    /// before the first list). While no node reports, it says so (`nodes: 0`) and nothing else:
    /// the field is never removed by an explicit `null`, which kube-apiserver 1.36 refuses for an
    /// object with required fields (kubernetes#140173).
    pub fn traffic(&self, key: &ObjKey, ingress: u32, egress: u32) -> Option<PolicyTraffic> {
        self.listed?;
        if self.nodes == 0 {
            return Some(PolicyTraffic {
                nodes: 0,
                window_seconds: self.configured_seconds,
                ..PolicyTraffic::default()
            });
        }
        let empty = BTreeMap::new();
        let sums = self.sums.get(key).unwrap_or(&empty);
        let int = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        let rules = sums
            .iter()
            .filter(|(_, (window, _))| window.iter().any(|n| *n > 0))
            .map(|((direction, index), (w, _))| RuleTraffic {
                direction: *direction,
                index: *index,
                flows_allowed: int(w[0]),
                flows_denied: int(w[1]),
                packets_denied: int(w[2]),
            })
            .collect();
        let unmatched_rules = if self.incomplete {
            Vec::new()
        } else {
            [(Direction::Ingress, ingress), (Direction::Egress, egress)]
                .into_iter()
                .flat_map(|(d, n)| (0..n).map(move |i| (d, i)))
                .filter(|slot| {
                    sums.get(slot)
                        .is_none_or(|(_, total)| total.iter().all(|n| *n == 0))
                })
                .map(|(d, i)| format!("{}[{i}]", d.field()))
                .collect()
        };
        Some(PolicyTraffic {
            nodes: self.nodes,
            window_seconds: self.window_seconds,
            rules,
            unmatched_rules,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(kind: &str, ns: Option<&str>, name: &str, egress: bool, index: u32) -> RuleId {
        RuleId::Rule {
            policy_kind: kind.into(),
            namespace: ns.map(str::to_string),
            name: name.into(),
            direction: if egress {
                ordnet_mapstate::Direction::Egress
            } else {
                ordnet_mapstate::Direction::Ingress
            },
            index,
        }
    }

    fn count(a: u64, d: u64, p: u64) -> RuleCount {
        RuleCount {
            flows_allowed: a,
            flows_denied: d,
            packets_denied: p,
        }
    }

    fn at(secs: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + secs).unwrap()
    }

    #[test]
    fn a_window_is_the_growth_since_the_last_report_of_ordered_policies_rules() {
        let web = rule("OrderedNetworkPolicy", Some("shop"), "web", false, 1);
        let np = rule("NetworkPolicy", Some("shop"), "np", false, 0);
        let mut w = Windows::default();
        let mut totals = BTreeMap::from([
            (web.clone(), count(5, 1, 3)),
            (np.clone(), count(9, 0, 0)),
            (RuleId::Unattributed, count(1, 1, 1)),
        ]);
        let first = w.report("n1", Duration::from_secs(60), at(0), at(60), &totals);
        // NetworkPolicy rules and what no rule decided have no status to go to.
        assert_eq!(first.rules.len(), 1, "{first:?}");
        let r = &first.rules[0];
        assert_eq!(
            (r.kind.as_str(), r.namespace.as_deref(), r.name.as_str()),
            ("OrderedNetworkPolicy", Some("shop"), "web")
        );
        assert_eq!((r.direction, r.index), (Direction::Ingress, 1));
        assert_eq!((r.window, r.total), ([5, 1, 3], [5, 1, 3]));
        assert_eq!(first.window_seconds, 60);
        assert_eq!(first.window_end, at(60).to_string());
        totals.insert(web.clone(), count(7, 1, 10));
        let second = w.report("n1", Duration::from_secs(60), at(0), at(120), &totals);
        assert_eq!(
            (second.rules[0].window, second.rules[0].total),
            ([2, 0, 7], [7, 1, 10])
        );
        // Forgotten (the rule had no element for a while) and counting again from less.
        totals.insert(web.clone(), count(1, 0, 0));
        let third = w.report("n1", Duration::from_secs(60), at(0), at(180), &totals);
        assert_eq!(third.rules[0].window, [1, 0, 0]);
        // The round trip through the ConfigMap.
        let text = serde_json::to_string(&third).unwrap();
        assert_eq!(serde_json::from_str::<NodeReport>(&text).unwrap(), third);
        assert!(!text.contains("leftOut"), "{text}");
    }

    #[test]
    fn a_report_keeps_the_busiest_rules_and_counts_the_rest() {
        let mut totals = BTreeMap::new();
        for i in 0..(MAX_REPORTED_RULES as u32 + 5) {
            let busy = if i == MAX_REPORTED_RULES as u32 + 4 {
                100
            } else {
                1
            };
            totals.insert(
                rule("ClusterOrderedNetworkPolicy", None, "g", true, i),
                count(busy, 0, 0),
            );
        }
        let r = Windows::default().report("n", DEFAULT_WINDOW, at(0), at(1), &totals);
        assert_eq!(r.rules.len(), MAX_REPORTED_RULES);
        assert_eq!(r.left_out, 5);
        assert_eq!(r.rules[0].index, MAX_REPORTED_RULES as u32 + 4);
    }

    fn report(node: &str, end: i64, rules: Vec<(&str, u32, Counts, Counts)>) -> NodeReport {
        NodeReport {
            node: node.into(),
            window_seconds: 10,
            counting_since: at(0).to_string(),
            window_end: at(end).to_string(),
            rules: rules
                .into_iter()
                .map(|(name, index, window, total)| ReportedRule {
                    kind: "OrderedNetworkPolicy".into(),
                    namespace: Some("shop".into()),
                    name: name.into(),
                    direction: Direction::Ingress,
                    index,
                    window,
                    total,
                })
                .collect(),
            left_out: 0,
            staged: Vec::new(),
            examples: Vec::new(),
        }
    }

    fn key(name: &str) -> ObjKey {
        (ObjectKind::OrderedNetworkPolicy, "shop".into(), name.into())
    }

    #[test]
    fn the_status_sums_the_fresh_reports_and_names_the_rules_that_never_decided() {
        let mut c = Cluster::default();
        assert_eq!(
            c.traffic(&key("web"), 3, 1),
            None,
            "never listed: no traffic"
        );
        let t0 = Instant::now();
        c.listed = Some(t0);
        c.configured_seconds = 10;
        c.take(Vec::new(), t0);
        assert_eq!(
            c.traffic(&key("web"), 3, 1),
            Some(PolicyTraffic {
                nodes: 0,
                window_seconds: 10,
                ..PolicyTraffic::default()
            }),
            "no report: nothing claimed"
        );
        let a = report(
            "a",
            10,
            vec![
                ("web", 0, [1, 0, 0], [4, 0, 0]),
                ("web", 2, [0; 3], [0, 1, 1]),
            ],
        );
        let b = report(
            "b",
            10,
            vec![
                ("web", 0, [2, 1, 5], [2, 1, 5]),
                ("db", 0, [1, 0, 0], [1, 0, 0]),
            ],
        );
        c.take(vec![a.clone(), b.clone()], t0);
        let t = c.traffic(&key("web"), 3, 1).unwrap();
        assert_eq!((t.nodes, t.window_seconds), (2, 10));
        // Rule 2 decided nothing in the window (not listed) but did before (not unmatched).
        assert_eq!(
            t.rules,
            vec![RuleTraffic {
                direction: Direction::Ingress,
                index: 0,
                flows_allowed: 3,
                flows_denied: 1,
                packets_denied: 5
            }]
        );
        assert_eq!(t.unmatched_rules, ["ingress[1]", "egress[0]"]);
        // A policy no node counted for: every rule unmatched.
        let none = c.traffic(&key("other"), 1, 0).unwrap();
        assert!(none.rules.is_empty());
        assert_eq!(none.unmatched_rules, ["ingress[0]"]);

        // b goes on reporting, a stops: after three of its windows a is left out.
        let later = t0 + Duration::from_secs(31);
        let b2 = report("b", 40, vec![("web", 0, [0, 0, 1], [2, 1, 6])]);
        c.take(vec![a.clone(), b2.clone()], later);
        let t = c.traffic(&key("web"), 3, 1).unwrap();
        assert_eq!(t.nodes, 1);
        assert_eq!(t.rules[0].packets_denied, 1);
        assert_eq!(t.unmatched_rules, ["ingress[1]", "ingress[2]", "egress[0]"]);

        // A report that left rules out: no rule is claimed unmatched.
        let mut b3 = report("b", 50, vec![]);
        b3.left_out = 3;
        c.take(vec![b3], later);
        assert!(
            c.traffic(&key("web"), 3, 1)
                .unwrap()
                .unmatched_rules
                .is_empty()
        );
    }

    /// What staged rules would change: windows on the node (growth since the last report),
    /// sums and examples over the nodes in the status of the staged policy.
    #[test]
    fn what_staged_policies_would_change_is_windowed_and_summed() {
        let rule = |index: Option<u32>| StagedRule {
            kind: "OrderedNetworkPolicy".into(),
            namespace: Some("qa".into()),
            name: "lockdown".into(),
            direction: ordnet_mapstate::Direction::Ingress,
            rule: index,
        };
        let policy = (
            "OrderedNetworkPolicy".to_string(),
            Some("qa".to_string()),
            "lockdown".to_string(),
        );
        let mut w = Windows::default();
        let mut counts = BTreeMap::from([(rule(None), [4, 0]), (rule(Some(0)), [0, 1])]);
        let examples = BTreeMap::from([(policy.clone(), vec!["a".to_string(), "b".to_string()])]);
        let mut first = w.report("n1", DEFAULT_WINDOW, at(0), at(60), &BTreeMap::new());
        w.add_staged(&mut first, &counts, &examples);
        assert_eq!(first.staged.len(), 2);
        assert_eq!(
            (first.staged[0].index, first.staged[0].window),
            (None, [4, 0])
        );
        counts.insert(rule(None), [6, 0]);
        let mut second = w.report("n1", DEFAULT_WINDOW, at(0), at(120), &BTreeMap::new());
        w.add_staged(&mut second, &counts, &examples);
        assert_eq!(second.staged[0].window, [2, 0]);
        assert_eq!(second.staged[1].window, [0, 0]);
        // A second node: the sums of the windows, the examples of both.
        let mut other = w.report("n2", DEFAULT_WINDOW, at(0), at(120), &BTreeMap::new());
        let mut fresh = Windows::default();
        let ex2 = BTreeMap::from([(policy.clone(), vec!["c".to_string()])]);
        fresh.add_staged(&mut other, &BTreeMap::from([(rule(None), [1, 0])]), &ex2);
        other.node = "n2".into();
        let mut c = Cluster::default();
        let t0 = Instant::now();
        c.listed = Some(t0);
        c.take(vec![second, other], t0);
        let key = (
            ObjectKind::OrderedNetworkPolicy,
            "qa".to_string(),
            "lockdown".to_string(),
        );
        let st = c.staged(&key).unwrap();
        assert_eq!(st.nodes, 2);
        assert_eq!(
            st.rules,
            vec![StagedRuleTraffic {
                direction: Direction::Ingress,
                index: None,
                flows_would_deny: 3,
                flows_would_allow: 0
            }]
        );
        assert_eq!(st.examples, ["a", "b", "c"]);
    }

    #[test]
    fn report_names_fit_a_configmap() {
        assert_eq!(report_name("node-1"), "ordnet-traffic-node-1");
        let long = "a".repeat(250);
        let n = report_name(&long);
        assert!(n.len() <= 253 && n.starts_with(REPORT_PREFIX), "{n}");
        assert_ne!(n, report_name(&"a".repeat(251)));
    }
}
