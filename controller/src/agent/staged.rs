//! Staged policies on live traffic (issue 27, docs/observe.md §10): the agent's **staged
//! view** — a copy of its engine that also enforces the staged policies, kept by the applier
//! (made when the first staged policy appears, following every change after that, dropped when
//! the last one goes) — judges every new flow and denial the datapath reports again, exactly:
//! a flow it would judge differently gets a [`StagedVerdict`] in its record ("staged policies
//! would DENY it", with the rule that would decide), and is counted per staged rule.
//!
//! Why in the agent and not a second lookup in the datapath: the kernel already reports every
//! new flow and every denial (the verdict events); judging them again costs nothing per packet
//! (established traffic and the programs are unchanged: issue 27's overhead criterion by
//! construction), and the answer is exact for every event the node emitted. What the rate
//! limit suppressed (`ordnet_datapath_verdict_events_total{outcome="suppressed"}`) is not judged:
//! the counts are of the flows seen. The price is memory: while a staged policy exists, the
//! agent keeps a second engine (about what the first one takes).
//!
//! [`StagedVerdict`]: crate::observe::StagedVerdict

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::{Mutex, RwLock};

use ordnet_engine::{Engine, ObjectChange, SideDecision};
use ordnet_mapstate::Direction;

use super::{AgentState, ObjKey};
use crate::observe::FlowRecord;

/// How many example flows are kept per staged policy.
pub const EXAMPLES: usize = 5;

/// A rule of a staged policy, or (`rule: None`) its isolation default.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct StagedRule {
    /// `OrderedNetworkPolicy` or `ClusterOrderedNetworkPolicy`.
    pub kind: String,
    /// The policy's namespace.
    pub namespace: Option<String>,
    /// The policy's name.
    pub name: String,
    /// The direction.
    pub direction: Direction,
    /// The rule's index; `None`: the isolation the policy adds (the default would deny).
    pub rule: Option<u32>,
}

/// Flows a staged rule would change: `[would deny, would allow]`, since the agent started.
pub type StagedCount = [u64; 2];

/// A staged policy: `(kind, namespace, name)`.
pub type StagedPolicy = (String, Option<String>, String);

/// Per staged policy, the last flows it would change (as text).
pub type StagedExamples = BTreeMap<StagedPolicy, Vec<String>>;

/// The staged view and what it would change.
#[derive(Debug, Default)]
pub struct Staged {
    /// The view, and the staged policies it enforces on top of the engine.
    view: RwLock<Option<(Engine, BTreeSet<ObjKey>)>>,
    counts: Mutex<BTreeMap<StagedRule, StagedCount>>,
    /// Per staged policy `(kind, namespace, name)`: the last flows it would change, as text.
    examples: Mutex<BTreeMap<StagedPolicy, VecDeque<String>>>,
}

/// The staged rules that would decide `r`'s flow differently (the deciding side(s) of its
/// staged verdict): a matched key's rules, or the policies whose isolation the default applies.
fn deciding(r: &FlowRecord) -> Vec<StagedRule> {
    let Some(st) = &r.staged else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for s in [&st.egress, &st.ingress].into_iter().flatten() {
        if (s.verdict == ordnet_mapstate::Verdict::Allow) != st.allowed {
            continue;
        }
        match &s.decision {
            SideDecision::Matched { entry, .. } => {
                out.extend(entry.origins.iter().map(|o| StagedRule {
                    kind: o.kind.clone(),
                    namespace: o.namespace.clone(),
                    name: o.name.clone(),
                    direction: o.direction,
                    rule: Some(o.rule_index),
                }))
            }
            SideDecision::Default { isolated_by, .. } => {
                out.extend(isolated_by.iter().map(|o| StagedRule {
                    kind: o.kind.clone(),
                    namespace: o.namespace.clone(),
                    name: o.name.clone(),
                    direction: s.direction,
                    rule: None,
                }))
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

impl AgentState {
    /// Replaces the staged view and its staged policies (`None`: no staged policy any more).
    pub(super) fn set_staged_view(&self, view: Option<(Engine, BTreeSet<ObjKey>)>) {
        *self.staged.view.write().unwrap_or_else(|e| e.into_inner()) = view;
    }

    /// Applies a batch of changes to the staged view (the same the engine got); `policies`:
    /// the staged policies after them.
    pub(super) fn update_staged_view(
        &self,
        changes: Vec<ObjectChange>,
        policies: BTreeSet<ObjKey>,
    ) {
        let mut view = self.staged.view.write().unwrap_or_else(|e| e.into_inner());
        if let Some((v, keys)) = view.as_mut() {
            *keys = policies;
            for c in changes {
                for e in v.apply(c).errors {
                    tracing::warn!(error = %e, "change not applied to the staged view");
                }
            }
        }
    }

    /// Judges `records` again with the staged view (if any), annotates those it would judge
    /// differently and counts them per staged rule (only rules of staged policies count: the
    /// others decide the same with or without them).
    pub(super) fn judge_staged(&self, records: &mut [FlowRecord]) {
        let guard = self.staged.view.read().unwrap_or_else(|e| e.into_inner());
        let Some((view, policies)) = guard.as_ref() else {
            return;
        };
        let staged = |kind: &str, ns: &Option<String>, name: &str| {
            ordnet_engine::ObjectKind::named(kind).is_some_and(|k| {
                policies.contains(&(k, ns.clone().unwrap_or_default(), name.to_string()))
            })
        };
        let mut counts = self.staged.counts.lock().unwrap_or_else(|e| e.into_inner());
        let mut examples = self
            .staged
            .examples
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        for r in records.iter_mut() {
            r.staged = crate::observe::staged_verdict(view, r);
            let Some(st) = &r.staged else {
                continue;
            };
            let rules: Vec<StagedRule> = deciding(r)
                .into_iter()
                .filter(|k| staged(&k.kind, &k.namespace, &k.name))
                .collect();
            let example = format!(
                "{} {} -> {} {}/{}: would be {}",
                if r.event.allowed { "allowed" } else { "denied" },
                r.src_pod.clone().unwrap_or_else(|| r.event.src.to_string()),
                r.dst_pod.clone().unwrap_or_else(|| r.event.dst.to_string()),
                r.protocol,
                r.event.dport,
                if st.allowed { "allowed" } else { "denied" }
            );
            for k in &rules {
                counts.entry(k.clone()).or_default()[usize::from(st.allowed)] += 1;
                let list = examples
                    .entry((k.kind.clone(), k.namespace.clone(), k.name.clone()))
                    .or_default();
                if list.back() != Some(&example) {
                    list.push_back(example.clone());
                    if list.len() > EXAMPLES {
                        list.pop_front();
                    }
                }
            }
        }
    }

    /// A copy of the staged view, if there is one (`POST /v1/whatif`).
    pub(super) fn staged_view_copy(&self) -> Option<Engine> {
        let guard = self.staged.view.read().unwrap_or_else(|e| e.into_inner());
        guard.as_ref().map(|(v, _)| v.clone())
    }

    /// What the staged rules would have changed since the agent started, and the last example
    /// flows of each staged policy.
    pub fn staged_counts(&self) -> (BTreeMap<StagedRule, StagedCount>, StagedExamples) {
        let counts = self
            .staged
            .counts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let examples = self
            .staged
            .examples
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(k, v)| (k.clone(), v.iter().cloned().collect()))
            .collect();
        (counts, examples)
    }
}
