//! Policy status and Events.
//!
//! * Exactly one agent writes status at a time: the holder of the `coordination.k8s.io/v1`
//!   Lease [`LEASE_NAME`] (in the agent's namespace). Every agent tries to acquire it every
//!   [`RENEW_EVERY`] (configurable); the holder renews it; a holder that stopped renewing for
//!   `leaseDurationSeconds` loses it to the next agent that looks. Expiry is measured on the
//!   looking agent's own clock, from when it last saw the Lease record change (as client-go's
//!   leader election does), so clock skew between nodes does not matter. A holder that stops
//!   (SIGTERM) releases it ([`release_lease`]) and the next agent takes it at once. Updates are
//!   guarded by the Lease's resourceVersion (409 Conflict = somebody else was faster).
//! * The status writer sets, on every OrderedNetworkPolicy and ClusterOrderedNetworkPolicy,
//!   `status.observedGeneration` and the `Accepted` condition (`True`/`Valid`, or
//!   `False`/`Invalid` with the validation errors naming the fields) by server-side apply on the
//!   `/status` subresource (field manager [`FIELD_MANAGER`]). On a valid policy it also sets
//!   `status.shadowedRules` and the `RulesShadowed` condition from
//!   `Engine::shadowed_rules` (cluster-wide, computed from this node's engine), and publishes a
//!   Warning Event `RuleShadowed` when a new set of shadowed rules is written. It also sets the
//!   printer-column fields `status.subject` (how many pods the policy selects across the
//!   cluster now, from the same engine and at the same time as the shadow analysis; see
//!   [`subjects`]) and `status.rules` (the rule counts of the spec, [`rule_counts`]), and
//!   `status.traffic`, the nodes' traffic reports summed ([`traffic`]). It writes
//!   only when the stored status differs from the wanted one, and never the same wanted status
//!   twice before the watch shows the first write.
//! * The shadowed-rule analysis runs in the status writer only, off the apply loop (its inputs
//!   copied in a blocking task under the engine's read lock, analysed after it), after the
//!   engine applied new changes, at most once per [`SHADOW_EVERY`] and at most 10 % of the time
//!   (the pause after an analysis is ten times its duration when that is longer), and only once
//!   the apply loop has applied nothing for [`SHADOW_QUIET`] (a change arriving during the copy
//!   waits for the lock) unless changes have waited [`SHADOW_STALEST`] for it. A valid policy's
//!   status is written only from an analysis of an engine that has applied that version of the
//!   policy.
//! * Every agent publishes a Warning Event (events.k8s.io/v1) for each invalid object version
//!   it sees, whether or not it holds the Lease.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::{Api, Client, Resource};
use ordnet_crds::{
    Action, CNP_GROUP, CNP_VERSION, CONDITION_ACCEPTED, CONDITION_RULES_SHADOWED,
    ClusterNetworkPolicy, ClusterOrderedNetworkPolicy, EVENT_RULE_SHADOWED,
    EVENT_RULES_FAILED_CLOSED, FailClosedEffect, FailedClosedRule, OrderedNetworkPolicy,
    OrderedSpec, PolicyStatus, PolicyTraffic, REASON_INVALID, REASON_NOT_SHADOWED,
    REASON_RULES_FAILED_CLOSED, REASON_SHADOWED, REASON_STAGED, REASON_VALID, RuleReference,
    ShadowedRule, StagedTraffic,
};
use ordnet_engine::Labels;
use ordnet_engine::{Engine, IdentityKind, Object, ObjectKind, PolicyKind, PolicyRef};
use ordnet_mapstate::{Action as MsAction, Direction};
use serde_json::json;
use tokio::sync::{mpsc, watch};

use super::{AgentState, Enforcement, ObjKey, traffic};

/// The Lease that elects the status writer.
pub const LEASE_NAME: &str = "ordnet-status-writer";
/// The server-side apply field manager of the status writer.
pub const FIELD_MANAGER: &str = "ordnet-agent";
/// How long a Lease holds without renewal.
pub const LEASE_SECONDS: i32 = 15;
/// How often the Lease is renewed or tried (by default; see `AgentConfig::lease_renew_every`).
pub const RENEW_EVERY: Duration = Duration::from_secs(5);
/// The shortest pause between two shadowed-rule analyses.
pub const SHADOW_EVERY: Duration = Duration::from_secs(1);
/// How long the apply loop must have applied nothing before the status writer copies the
/// analysis' inputs under the engine's read lock: a change that arrives during the copy waits
/// for it (~100 ms at 10k pods / 5k policies, ~450 ms at 50k / 5k).
pub const SHADOW_QUIET: Duration = Duration::from_millis(300);
/// The longest new changes wait for an analysis when the apply loop is never idle for
/// [`SHADOW_QUIET`]: then it runs anyway.
pub const SHADOW_STALEST: Duration = Duration::from_secs(30);
/// The longest condition message written (the API server allows 32 KiB).
const MAX_MESSAGE: usize = 4000;
/// `status.subject` of a policy the engine does not enforce (invalid, or left out by the engine).
pub const NOT_ENFORCED: &str = "not enforced";
/// `status.subject` of a valid staged policy (`spec.mode: Staged`).
pub const STAGED: &str = "staged";

/// What the apply loop knows about the status of one policy.
#[derive(Debug, Clone, PartialEq)]
pub struct WantedStatus {
    /// `metadata.generation` of the policy version seen (written as `observedGeneration`).
    pub generation: Option<i64>,
    /// The validation errors (empty = valid).
    pub errors: Vec<String>,
    /// Whether the engine enforces the policy (fully, or with rules failing closed).
    pub enforced: bool,
    /// The rules enforced fail-closed.
    pub failed: Vec<FailedClosedRule>,
    /// The status stored in the API server, as last seen by the watch.
    pub current: Option<PolicyStatus>,
    /// The policy, for Events.
    pub reference: ObjectReference,
    /// The apply loop's change number of this version of the object: a shadowed-rule report
    /// describes it once the engine has applied this number (`AgentState::applied`). A version
    /// that changed only the status (a status write's echo) keeps the number of the one before.
    pub seq: u64,
    /// Another number for every version the apply loop records, echoes of status writes too:
    /// what the writer's next pass looks at ([`Pass`]).
    pub stamp: u64,
    /// The rule counts of this version's spec ([`rule_counts`]).
    pub rules: String,
    /// An upstream ClusterNetworkPolicy: its status has only `conditions` (upstream's schema),
    /// `Accepted` alone.
    pub upstream: bool,
    /// How many ingress and egress rules the spec has (for `status.traffic.unmatchedRules`).
    pub slots: (u32, u32),
    /// A staged policy (`spec.mode: Staged`): it decides no packet.
    pub staged: bool,
}

/// The API form of a rule enforced fail-closed.
pub fn api_failed(r: &ordnet_engine::FailedRule) -> FailedClosedRule {
    FailedClosedRule {
        direction: match r.direction {
            Direction::Ingress => ordnet_crds::Direction::Ingress,
            Direction::Egress => ordnet_crds::Direction::Egress,
        },
        index: r.index,
        // (A ClusterNetworkPolicy's Pass rule fails closed like a Deny; its status has no
        // failedClosedRules list, only the condition message, which names the Pass.)
        action: match r.action {
            MsAction::Allow => Action::Allow,
            MsAction::Deny | MsAction::Pass => Action::Deny,
        },
        effect: match r.action {
            MsAction::Allow => FailClosedEffect::MatchesNothing,
            MsAction::Deny | MsAction::Pass => FailClosedEffect::DeniesAll,
        },
        message: format!(
            "{}: {}: {} instead",
            r.field,
            r.message,
            match r.action {
                MsAction::Allow => "the Allow rule matches nothing".to_string(),
                MsAction::Deny | MsAction::Pass => format!(
                    "the {} rule denies all {} of the policy's pods that no stronger rule decides",
                    if r.action == MsAction::Pass {
                        "Pass"
                    } else {
                        "Deny"
                    },
                    match r.direction {
                        Direction::Ingress => "ingress",
                        Direction::Egress => "egress",
                    }
                ),
            }
        ),
    }
}

/// The wanted status of a policy object (`seq`, `stamp`: see [`WantedStatus`]), or `None` for
/// other kinds.
pub fn wanted(
    object: &Object,
    errors: &[String],
    enforcement: &Enforcement,
    seq: u64,
    stamp: u64,
) -> Option<WantedStatus> {
    let (generation, current, reference, rules, slots) = match object {
        Object::OrderedNetworkPolicy(p) => (
            p.metadata.generation,
            p.status.clone(),
            p.object_ref(&()),
            rule_counts(&p.spec),
            rule_slots(&p.spec),
        ),
        Object::ClusterOrderedNetworkPolicy(p) => (
            p.metadata.generation,
            p.status.clone(),
            p.object_ref(&()),
            rule_counts(&p.spec),
            rule_slots(&p.spec),
        ),
        Object::ClusterNetworkPolicy(p) => (
            p.metadata.generation,
            p.status.as_ref().map(|st| PolicyStatus {
                conditions: st.conditions.clone(),
                ..PolicyStatus::default()
            }),
            p.object_ref(&()),
            String::new(),
            (0, 0),
        ),
        _ => return None,
    };
    let upstream = matches!(object, Object::ClusterNetworkPolicy(_));
    Some(WantedStatus {
        generation,
        errors: errors.to_vec(),
        enforced: *enforcement != Enforcement::None,
        failed: match enforcement {
            Enforcement::Partial(rules) => rules.iter().map(api_failed).collect(),
            _ => Vec::new(),
        },
        current,
        reference,
        seq,
        stamp,
        rules,
        upstream,
        slots,
        staged: object.staged(),
    })
}

/// How many ingress and egress rules a spec has.
fn rule_slots(spec: &impl OrderedSpec) -> (u32, u32) {
    let n = |d| u32::try_from(spec.rules(d).len()).unwrap_or(u32::MAX);
    (
        n(ordnet_crds::Direction::Ingress),
        n(ordnet_crds::Direction::Egress),
    )
}

/// `status.rules` (printer column Rules): the number of `Allow` and `Deny` rules per direction,
/// e.g. `in 2A/1D, out 0A/1D`.
pub fn rule_counts(spec: &impl OrderedSpec) -> String {
    let count = |rules: Vec<ordnet_crds::RuleView<'_>>| {
        let allow = rules.iter().filter(|r| r.action == Action::Allow).count();
        (allow, rules.len() - allow)
    };
    let (ia, id) = count(spec.rules(ordnet_crds::Direction::Ingress));
    let (ea, ed) = count(spec.rules(ordnet_crds::Direction::Egress));
    format!("in {ia}A/{id}D, out {ea}A/{ed}D")
}

/// `status.subject` (printer column Subject) of every ordered policy the engine holds: how many
/// pods its subject selects across the cluster now — `12 pods` for an OrderedNetworkPolicy,
/// `40 pods in 3 namespaces` for a ClusterOrderedNetworkPolicy (`0 pods` when it selects none).
///
/// Counted are the pods the policy applies to: pods with an address that are not host-network
/// (the engine's endpoints, of every node). Pods not started yet and host-network pods are not.
/// Works on a node-scoped engine: it reads only the identities (cluster-wide: every member pod
/// with its labels and its namespace's labels) and the policies' subjects, never MapStates.
pub fn subjects(engine: &Engine) -> BTreeMap<ObjKey, String> {
    // Every pod with an identity, once (a dual-stack pod may have one identity per address),
    // with its labels and its namespace's labels.
    let mut pods: BTreeMap<(&str, &str), (&Labels, &Labels)> = BTreeMap::new();
    for info in engine.identities() {
        if info.kind != IdentityKind::Pod {
            continue;
        }
        for member in &info.members {
            if let Some((ns, name)) = member.split_once('/') {
                pods.entry((ns, name))
                    .or_insert((&info.namespace_labels, &info.labels));
            }
        }
    }
    // Per namespace: its labels, and how many pods have each set of pod labels (pods with equal
    // labels in one namespace are selected together: each group is matched once).
    type Group<'a> = (&'a Labels, BTreeMap<&'a Labels, usize>);
    let mut groups: BTreeMap<&str, Group<'_>> = BTreeMap::new();
    for ((ns, _), (ns_labels, labels)) in pods {
        *groups
            .entry(ns)
            .or_insert_with(|| (ns_labels, BTreeMap::new()))
            .1
            .entry(labels)
            .or_default() += 1;
    }
    let plural = |n: usize, what: &str| format!("{n} {what}{}", if n == 1 { "" } else { "s" });
    let mut out = BTreeMap::new();
    for p in engine.policies() {
        let Some(key) = policy_key(&p.id) else {
            continue;
        };
        let namespaces: Vec<(&&str, &Group<'_>)> = match &p.id.namespace {
            Some(ns) => groups.get_key_value(ns.as_str()).into_iter().collect(),
            None => groups.iter().collect(),
        };
        let (mut selected, mut in_namespaces) = (0, 0);
        for (ns, (ns_labels, by_labels)) in namespaces {
            let n: usize = by_labels
                .iter()
                .filter(|(labels, _)| p.subject.selects(ns, ns_labels, labels))
                .map(|(_, n)| n)
                .sum();
            selected += n;
            in_namespaces += usize::from(n > 0);
        }
        let text = if p.id.kind == PolicyKind::Ordered || selected == 0 {
            plural(selected, "pod")
        } else {
            format!(
                "{} in {}",
                plural(selected, "pod"),
                plural(in_namespaces, "namespace")
            )
        };
        out.insert(key, text);
    }
    out
}

/// The apply loop's key of an ordered policy (`None` for a NetworkPolicy: it has no status).
fn policy_key(id: &PolicyRef) -> Option<ObjKey> {
    let kind = match id.kind {
        PolicyKind::Ordered => ObjectKind::OrderedNetworkPolicy,
        PolicyKind::ClusterOrdered => ObjectKind::ClusterOrderedNetworkPolicy,
        PolicyKind::ClusterNetwork => ObjectKind::ClusterNetworkPolicy,
        PolicyKind::NetworkPolicy => return None,
    };
    Some((
        kind,
        id.namespace.clone().unwrap_or_default(),
        id.name.clone(),
    ))
}

/// The status the writer wants one policy to have.
#[derive(Debug, Clone, PartialEq)]
pub struct Desired {
    /// `metadata.generation` the status describes (written as `observedGeneration`).
    pub generation: Option<i64>,
    /// The validation errors.
    pub errors: Vec<String>,
    /// Whether the engine enforces the policy (fully, or with rules failing closed).
    pub enforced: bool,
    /// The rules enforced fail-closed.
    pub failed: Vec<FailedClosedRule>,
    /// The shadowed rules (enforced policies only).
    pub shadowed: Vec<ShadowedRule>,
    /// `status.subject`: [`subjects`], or [`NOT_ENFORCED`].
    pub subject: String,
    /// `status.rules`: [`rule_counts`].
    pub rules: String,
    /// An upstream ClusterNetworkPolicy: `conditions` only, `Accepted` only.
    pub upstream: bool,
    /// `status.traffic` ([`traffic::Cluster::traffic`]; enforced ordered policies only).
    pub traffic: Option<PolicyTraffic>,
    /// A valid staged policy: `Accepted` says `Staged`, and nothing is analysed.
    pub staged: bool,
    /// `status.staged`: what a staged policy would have changed ([`traffic::Cluster::staged`]).
    pub would: Option<StagedTraffic>,
}

/// One condition: (type, status, reason, message).
type Cond = (&'static str, &'static str, &'static str, String);

impl Desired {
    /// The conditions, in the order they are written.
    pub fn conditions(&self) -> Vec<Cond> {
        if !self.enforced {
            return vec![(
                CONDITION_ACCEPTED,
                "False",
                REASON_INVALID,
                clip(&format!("not enforced: {}", self.errors.join("; "))),
            )];
        }
        if self.staged {
            let failing = if self.failed.is_empty() {
                String::new()
            } else {
                format!(
                    "; enforced, {} rule{} would fail closed (status.failedClosedRules)",
                    self.failed.len(),
                    if self.failed.len() == 1 { "" } else { "s" }
                )
            };
            return vec![(
                CONDITION_ACCEPTED,
                "True",
                REASON_STAGED,
                clip(&format!(
                    "the policy is valid and staged (spec.mode: Staged): it decides no packet{failing}"
                )),
            )];
        }
        let accepted = if !self.failed.is_empty() {
            (
                CONDITION_ACCEPTED,
                "False",
                REASON_RULES_FAILED_CLOSED,
                clip(&format!(
                    "enforced, but {} rule{} cannot be enforced as written and fail{} closed (status.failedClosedRules): {}",
                    self.failed.len(),
                    if self.failed.len() == 1 { "" } else { "s" },
                    if self.failed.len() == 1 { "s" } else { "" },
                    self.failed
                        .iter()
                        .map(|r| format!(
                            "spec.{}[{}] ({}): {}",
                            r.direction.field(),
                            r.index,
                            r.action,
                            r.message
                        ))
                        .collect::<Vec<_>>()
                        .join("; ")
                )),
            )
        } else if !self.errors.is_empty() {
            (
                CONDITION_ACCEPTED,
                "True",
                REASON_VALID,
                clip(&format!(
                    "enforced as written, but the CRD schema would refuse: {}",
                    self.errors.join("; ")
                )),
            )
        } else {
            (
                CONDITION_ACCEPTED,
                "True",
                REASON_VALID,
                "the policy is valid and enforced".to_string(),
            )
        };
        if self.upstream {
            // Shadowed rules are analysed for the ordnet kinds only.
            return vec![accepted];
        }
        let shadow = if self.shadowed.is_empty() {
            (
                CONDITION_RULES_SHADOWED,
                "False",
                REASON_NOT_SHADOWED,
                "no rule is shadowed by stronger rules".to_string(),
            )
        } else {
            (
                CONDITION_RULES_SHADOWED,
                "True",
                REASON_SHADOWED,
                clip(&shadow_summary(&self.shadowed)),
            )
        };
        vec![accepted, shadow]
    }

    /// Whether the stored status already says this.
    pub fn satisfied(&self, current: Option<&PolicyStatus>) -> bool {
        let Some(cur) = current else {
            return false;
        };
        let wanted = self.conditions();
        let same_conditions = wanted.iter().all(|(type_, status, reason, message)| {
            cur.conditions.iter().any(|c| {
                c.type_ == *type_
                    && c.status == *status
                    && c.reason == *reason
                    && c.message == *message
                    && c.observed_generation == self.generation
            })
        });
        if self.upstream {
            return same_conditions;
        }
        cur.observed_generation == self.generation
            && cur.shadowed_rules == self.shadowed
            && cur.failed_closed_rules == self.failed
            && cur.subject.as_deref() == Some(self.subject.as_str())
            && cur.rules.as_deref() == Some(self.rules.as_str())
            && cur.traffic == self.traffic
            && cur.staged == self.would
            && cur
                .conditions
                .iter()
                .filter(|c| {
                    [CONDITION_ACCEPTED, CONDITION_RULES_SHADOWED].contains(&c.type_.as_str())
                })
                .all(|c| wanted.iter().any(|w| w.0 == c.type_))
            && same_conditions
    }
}

/// `spec.ingress[1] is shadowed by ClusterOrderedNetworkPolicy g ingress[0] (priority -10,
/// Deny); ...`
fn shadow_summary(rules: &[ShadowedRule]) -> String {
    rules
        .iter()
        .map(|r| {
            format!(
                "spec.{}[{}] is shadowed by {}",
                r.direction.field(),
                r.index,
                r.shadowed_by
                    .iter()
                    .map(|b| reference_text(b, r.direction))
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

fn reference_text(b: &RuleReference, d: ordnet_crds::Direction) -> String {
    let name = match &b.namespace {
        Some(ns) => format!("{ns}/{}", b.name),
        None => b.name.clone(),
    };
    format!(
        "{} {name} {}[{}] (priority {}, {})",
        b.kind,
        d.field(),
        b.index,
        b.priority,
        b.action
    )
}

fn clip(s: &str) -> String {
    truncate(s, MAX_MESSAGE)
}

/// The engine's report of one policy's shadowed rules, in the API's form.
pub fn api_shadowed(rules: &[&ordnet_engine::ShadowedRule]) -> Vec<ShadowedRule> {
    rules
        .iter()
        .map(|r| {
            let direction = match r.direction {
                Direction::Ingress => ordnet_crds::Direction::Ingress,
                Direction::Egress => ordnet_crds::Direction::Egress,
            };
            let shadowed_by: Vec<RuleReference> = r
                .shadowed_by
                .iter()
                .map(|o| RuleReference {
                    kind: o.kind.clone(),
                    namespace: o.namespace.clone(),
                    name: o.name.clone(),
                    index: o.rule_index,
                    priority: o.priority,
                    action: match o.action {
                        MsAction::Allow => Action::Allow,
                        MsAction::Deny | MsAction::Pass => Action::Deny,
                    },
                })
                .collect();
            let message = format!(
                "never decides a packet: for every pod the policy selects, stronger rules take \
                 all the traffic it matches ({})",
                shadowed_by
                    .iter()
                    .map(|b| reference_text(b, direction))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
            ShadowedRule {
                direction,
                index: r.index,
                shadowed_by,
                message: Some(message),
            }
        })
        .collect()
}

/// The last shadowed-rule analysis.
struct Report {
    /// The change number the engine had applied when it was computed.
    seq: u64,
    /// Per policy with shadowed rules.
    rules: BTreeMap<ObjKey, Vec<ShadowedRule>>,
    /// Per ordered policy the engine holds: `status.subject`.
    subjects: BTreeMap<ObjKey, String>,
    at: Instant,
    took: Duration,
}

/// Whether a new shadowed-rule analysis is due: the engine applied changes since the last one
/// (`last`: its change number, how long ago it ran and how long it took), the pause after it is
/// over (at least [`SHADOW_EVERY`], ten times its duration when that is longer), and either the
/// apply loop has applied nothing for [`SHADOW_QUIET`] (`idle`) or the changes have waited for an
/// analysis for [`SHADOW_STALEST`] (`waiting`).
fn analysis_due(
    last: Option<(u64, Duration, Duration)>,
    applied: u64,
    idle: Duration,
    waiting: Duration,
) -> bool {
    if let Some((seq, ago, took)) = last
        && (seq == applied || ago < SHADOW_EVERY.max(took * 10))
    {
        return false;
    }
    idle >= SHADOW_QUIET || waiting >= SHADOW_STALEST
}

/// Runs a new analysis when one is due ([`analysis_due`]); `waiting_since`: when this writer
/// first saw changes the last analysis does not cover (reset by each analysis).
async fn refresh(
    state: &Arc<AgentState>,
    report: &mut Option<Report>,
    waiting_since: &mut Option<Instant>,
) {
    let applied = state.applied.load(Ordering::SeqCst);
    if report.as_ref().is_some_and(|r| r.seq == applied) {
        *waiting_since = None;
        return;
    }
    let waiting = waiting_since.get_or_insert_with(Instant::now).elapsed();
    let last = report.as_ref().map(|r| (r.seq, r.at.elapsed(), r.took));
    if !analysis_due(last, applied, state.idle_for(), waiting) {
        return;
    }
    *waiting_since = None;
    let started = Instant::now();
    let st = state.clone();
    let result = tokio::task::spawn_blocking(move || {
        // The inputs are copied under the engine's lock (the engine has applied at least this
        // change number); the analysis runs after releasing it, so that the applier does not
        // wait for it.
        let locked = Instant::now();
        let (seq, inputs, subjects) = st.with_engine(|e| {
            let seq = st.applied.load(Ordering::SeqCst);
            (seq, e.shadow_inputs(), subjects(e))
        })?;
        let copied = locked.elapsed();
        let rules = inputs.analyze();
        tracing::debug!(
            copy_ms = copied.as_secs_f64() * 1e3,
            analysis_ms = (locked.elapsed() - copied).as_secs_f64() * 1e3,
            idle_ms = st.idle_for().as_secs_f64() * 1e3,
            "shadowed-rule analysis (its inputs copied under the engine's read lock)"
        );
        Some((seq, rules, subjects))
    })
    .await;
    let Ok(Some((seq, rules, subjects))) = result else {
        return;
    };
    let mut by_policy: BTreeMap<ObjKey, Vec<&ordnet_engine::ShadowedRule>> = BTreeMap::new();
    for r in &rules {
        if let Some(key) = policy_key(&r.policy) {
            by_policy.entry(key).or_default().push(r);
        }
    }
    *report = Some(Report {
        seq,
        rules: by_policy
            .into_iter()
            .map(|(k, v)| (k, api_shadowed(&v)))
            .collect(),
        subjects,
        at: Instant::now(),
        took: started.elapsed(),
    });
}

/// What the status of `key` should be, or `None` while no analysis describes its version yet.
fn desired(
    key: &ObjKey,
    w: &WantedStatus,
    report: Option<&Report>,
    cluster: &traffic::Cluster,
) -> Option<Desired> {
    if !w.enforced {
        return Some(Desired {
            generation: w.generation,
            errors: w.errors.clone(),
            enforced: false,
            failed: Vec::new(),
            shadowed: Vec::new(),
            subject: NOT_ENFORCED.to_string(),
            rules: w.rules.clone(),
            upstream: w.upstream,
            traffic: None,
            staged: false,
            would: None,
        });
    }
    if w.staged {
        // Not in the engine (it decides nothing): no shadow analysis, subject or traffic yet.
        return Some(Desired {
            generation: w.generation,
            errors: w.errors.clone(),
            enforced: true,
            failed: w.failed.clone(),
            shadowed: Vec::new(),
            subject: STAGED.to_string(),
            rules: w.rules.clone(),
            upstream: false,
            traffic: None,
            staged: true,
            would: cluster.staged(key),
        });
    }
    let report = report.filter(|r| r.seq >= w.seq)?;
    Some(Desired {
        generation: w.generation,
        errors: w.errors.clone(),
        enforced: true,
        failed: w.failed.clone(),
        shadowed: report.rules.get(key).cloned().unwrap_or_default(),
        subject: report
            .subjects
            .get(key)
            .cloned()
            .unwrap_or_else(|| NOT_ENFORCED.to_string()),
        rules: w.rules.clone(),
        upstream: w.upstream,
        traffic: if w.upstream {
            None
        } else {
            cluster.traffic(key, w.slots.0, w.slots.1)
        },
        staged: false,
        would: None,
    })
}

/// Runs the Lease loop: keeps `leader` true while this agent holds the Lease.
pub async fn lease_loop(
    client: Client,
    namespace: String,
    identity: String,
    leader: Arc<AtomicBool>,
    every: Duration,
) {
    let leases: Api<Lease> = Api::namespaced(client, &namespace);
    let mut observed = Observed::default();
    loop {
        let held = match try_hold(&leases, &identity, &mut observed).await {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!(lease = %format!("{namespace}/{LEASE_NAME}"), error = %e, "status writer lease");
                false
            }
        };
        if held != leader.swap(held, Ordering::SeqCst) {
            tracing::info!(
                "{} the status writer lease",
                if held { "acquired" } else { "lost" }
            );
        }
        tokio::time::sleep(every).await;
    }
}

/// Gives the Lease up if `identity` holds it (on SIGTERM): another agent takes it over at its
/// next try instead of waiting for it to expire.
pub async fn release_lease(
    client: Client,
    namespace: &str,
    identity: &str,
) -> Result<bool, kube::Error> {
    let leases: Api<Lease> = Api::namespaced(client, namespace);
    let Some(mut lease) = leases.get_opt(LEASE_NAME).await? else {
        return Ok(false);
    };
    let spec = lease.spec.get_or_insert_with(Default::default);
    if spec.holder_identity.as_deref() != Some(identity) {
        return Ok(false);
    }
    spec.holder_identity = None;
    spec.lease_duration_seconds = Some(1);
    spec.renew_time = Some(MicroTime(Timestamp::now()));
    leases
        .replace(LEASE_NAME, &PostParams::default(), &lease)
        .await?;
    Ok(true)
}

/// Another holder's Lease record as this agent last saw it, and when (by this agent's own
/// clock) it last saw it change. A Lease is expired when its record has not changed for its
/// duration: the holder's clock and ours are never compared, so clock skew between nodes
/// cannot make two agents hold it at once (nor keep a dead holder's Lease alive).
#[derive(Debug, Default)]
struct Observed {
    record: Option<(Option<String>, Option<String>, Option<i32>)>,
    since: Option<Instant>,
}

impl Observed {
    fn expired(&mut self, spec: &k8s_openapi::api::coordination::v1::LeaseSpec) -> bool {
        let record = (
            spec.holder_identity.clone(),
            spec.renew_time.as_ref().map(|t| t.0.to_string()),
            spec.lease_transitions,
        );
        let now = Instant::now();
        if self.record.as_ref() != Some(&record) {
            self.record = Some(record);
            self.since = Some(now);
        }
        let duration =
            u64::try_from(spec.lease_duration_seconds.unwrap_or(LEASE_SECONDS)).unwrap_or(0);
        self.since
            .is_some_and(|t| now.duration_since(t) > Duration::from_secs(duration))
    }
}

async fn try_hold(
    leases: &Api<Lease>,
    identity: &str,
    observed: &mut Observed,
) -> Result<bool, kube::Error> {
    let now = MicroTime(Timestamp::now());
    match leases.get_opt(LEASE_NAME).await? {
        None => {
            let lease: Lease = serde_json::from_value(json!({
                "metadata": {"name": LEASE_NAME},
                "spec": {"holderIdentity": identity, "leaseDurationSeconds": LEASE_SECONDS,
                         "leaseTransitions": 0}
            }))
            .expect("a lease");
            let mut lease = lease;
            if let Some(spec) = lease.spec.as_mut() {
                spec.acquire_time = Some(now.clone());
                spec.renew_time = Some(now);
            }
            match leases.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
                Err(e) => Err(e),
            }
        }
        Some(mut lease) => {
            let spec = lease.spec.get_or_insert_with(Default::default);
            let mine = spec.holder_identity.as_deref() == Some(identity);
            let free = spec.holder_identity.as_deref().is_none_or(str::is_empty);
            if !mine && !free && !observed.expired(spec) {
                return Ok(false);
            }
            if !mine {
                spec.holder_identity = Some(identity.to_string());
                spec.acquire_time = Some(now.clone());
                spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
            }
            spec.lease_duration_seconds = Some(LEASE_SECONDS);
            spec.renew_time = Some(now);
            match leases
                .replace(LEASE_NAME, &PostParams::default(), &lease)
                .await
            {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
                Err(e) => Err(e),
            }
        }
    }
}

/// A hash of a stored status (as the watch showed it).
fn status_hash(status: Option<&PolicyStatus>) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    serde_json::to_vec(&status).unwrap_or_default().hash(&mut h);
    h.finish()
}

/// Which wanted statuses the writer's next pass compares with what it would write.
///
/// All of them when an input every status depends on changed since the last pass (a new
/// shadowed-rule report, new traffic reports, the Lease just taken); otherwise only those the
/// apply loop recorded since (a stamp above the last pass's) and those whose write failed. A
/// pass over every policy computes and compares each one's status (10-22 ms at 5,000 policies,
/// on a worker of the runtime); taken at every policy change, it ran on the apply loop's worker
/// while the loop gave the watchers their turns, and an OrderedNetworkPolicy edit at 10k pods /
/// 5k policies waited 10-24 ms for it (docs/agent.md, the status writer).
#[derive(Debug, Default)]
struct Pass {
    /// The inputs of the last pass: the report's time and the traffic reports' generation
    /// (`None`: no pass yet as the writer).
    inputs: Option<(Option<Instant>, u64)>,
    /// The highest stamp the last pass saw.
    seen: u64,
    /// Objects whose write failed: looked at again in the next pass.
    retry: BTreeSet<ObjKey>,
}

impl Pass {
    /// The entries of `all` this pass looks at, given the inputs it has now; what it saw is
    /// remembered.
    fn select<'a>(
        &mut self,
        all: &'a BTreeMap<ObjKey, WantedStatus>,
        inputs: (Option<Instant>, u64),
    ) -> impl Iterator<Item = (&'a ObjKey, &'a WantedStatus)> + use<'a> {
        let every = self.inputs != Some(inputs);
        let (after, retry) = (self.seen, std::mem::take(&mut self.retry));
        self.inputs = Some(inputs);
        self.seen = all.values().map(|w| w.stamp).max().unwrap_or(0).max(after);
        all.iter()
            .filter(move |(k, w)| every || w.stamp > after || retry.contains(*k))
    }
}

/// Runs the status writer: while this agent holds the Lease, keeps the shadowed-rule analysis
/// and the nodes' traffic reports (in `namespace`, every `traffic_window`: `None`, none) current
/// and writes every status that is not satisfied yet (on changes of `wanted`, and every second).
pub async fn status_loop(
    client: Client,
    state: Arc<AgentState>,
    mut wanted: watch::Receiver<BTreeMap<ObjKey, WantedStatus>>,
    namespace: String,
    traffic_window: Option<Duration>,
) {
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: "ordnet-agent".into(),
            instance: Some(state.node.clone()),
        },
    );
    // What this writer last wrote, per object, with the status the API server had then: so it
    // does not write the same again before the watch shows another status (its own write's echo,
    // or someone else's write, which it then writes over), and once only when its write did not
    // stick (the status seen after it is the one compared with next).
    let mut written: BTreeMap<ObjKey, (u64, Desired)> = BTreeMap::new();
    let mut report: Option<Report> = None;
    let mut waiting_since: Option<Instant> = None;
    let mut cluster = traffic::Cluster::default();
    let mut pass = Pass::default();
    loop {
        if state.is_status_writer() {
            refresh(&state, &mut report, &mut waiting_since).await;
            if let Some(window) = traffic_window {
                cluster.refresh(&client, &namespace, window).await;
            }
            let inputs = (report.as_ref().map(|r| r.at), cluster.generation());
            // Each unsatisfied status with the hash of the stored one (computed once: compared
            // with what the last write saw, and kept with this write).
            let todo: Vec<(ObjKey, WantedStatus, Desired, u64)> = {
                let all = wanted.borrow_and_update();
                pass.select(&all, inputs)
                    .filter_map(|(k, w)| {
                        let d = desired(k, w, report.as_ref(), &cluster)?;
                        if d.satisfied(w.current.as_ref()) {
                            return None;
                        }
                        let stored = status_hash(w.current.as_ref());
                        written
                            .get(k)
                            .is_none_or(|(seen, old)| *old != d || *seen != stored)
                            .then(|| (k.clone(), w.clone(), d, stored))
                    })
                    .collect()
            };
            for (key, w, d, stored) in todo {
                match write_status(&client, &key, &w, &d).await {
                    Ok(()) => {
                        let before = w.current.as_ref().map(|c| &c.shadowed_rules);
                        if !d.shadowed.is_empty() && before != Some(&d.shadowed) {
                            publish_shadowed(&recorder, &w.reference, &d.shadowed).await;
                        }
                        written.insert(key, (stored, d));
                    }
                    Err(e) => {
                        tracing::warn!(object = %key.2, error = %e, "writing status failed");
                        pass.retry.insert(key);
                    }
                }
            }
            // (Both in key order: one walk.)
            let all = wanted.borrow();
            let mut keys = all.keys().peekable();
            written.retain(|k, _| {
                while keys.next_if(|w| *w < k).is_some() {}
                keys.peek() == Some(&k)
            });
        } else {
            pass = Pass::default();
        }
        tokio::select! {
            changed = wanted.changed() => {
                if changed.is_err() {
                    return;
                }
            }
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
}

async fn publish_shadowed(
    recorder: &Recorder,
    reference: &ObjectReference,
    rules: &[ShadowedRule],
) {
    let event = Event {
        type_: EventType::Warning,
        reason: EVENT_RULE_SHADOWED.into(),
        note: Some(truncate(&shadow_summary(rules), 1000)),
        action: "Analyze".into(),
        secondary: None,
    };
    if let Err(e) = recorder.publish(&event, reference).await {
        tracing::warn!(error = %e, "publishing an event failed");
    }
}

async fn write_status(
    client: &Client,
    key: &ObjKey,
    w: &WantedStatus,
    d: &Desired,
) -> Result<(), kube::Error> {
    let now = k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(Timestamp::now());
    let conditions: Vec<serde_json::Value> = d
        .conditions()
        .into_iter()
        .map(|(type_, status, reason, message)| {
            let previous = w
                .current
                .as_ref()
                .and_then(|s| s.conditions.iter().find(|c| c.type_ == type_));
            // The transition time moves only when the condition's status changes.
            let transition = match previous {
                Some(c) if c.status == status => c.last_transition_time.clone(),
                _ => now.clone(),
            };
            json!({
                "type": type_,
                "status": status,
                "reason": reason,
                "message": message,
                "observedGeneration": d.generation,
                "lastTransitionTime": transition,
            })
        })
        .collect();
    let kind = key.0.name();
    // Server-side apply: a condition left out (RulesShadowed of an invalid policy) is removed
    // from what this manager owns; `shadowedRules` and `failedClosedRules` are always written
    // (`[]` when none), which clears them under any patch semantics.
    let mut body = json!({
        "apiVersion": "ordnet.io/v1alpha1",
        "kind": kind,
        "status": {
            "observedGeneration": d.generation,
            "conditions": conditions,
            "shadowedRules": d.shadowed,
            "failedClosedRules": d.failed,
            "subject": d.subject,
            "rules": d.rules,
        },
    });
    if let Some(t) = &d.traffic {
        // Never `null` (see `traffic::Cluster::traffic`); the lists always, `[]` when empty,
        // like `shadowedRules`.
        body["status"]["traffic"] = json!({
            "nodes": t.nodes,
            "windowSeconds": t.window_seconds,
            "rules": t.rules,
            "unmatchedRules": t.unmatched_rules,
        });
    }
    if let Some(st) = &d.would {
        body["status"]["staged"] = json!({
            "nodes": st.nodes,
            "windowSeconds": st.window_seconds,
            "rules": st.rules,
            "examples": st.examples,
        });
    }
    let params = PatchParams::apply(FIELD_MANAGER).force();
    if d.upstream {
        // Upstream's status schema: conditions only.
        let body = json!({
            "apiVersion": format!("{CNP_GROUP}/{CNP_VERSION}"),
            "kind": kind,
            "status": {"conditions": conditions},
        });
        let api: Api<ClusterNetworkPolicy> = Api::all(client.clone());
        api.patch_status(&key.2, &params, &Patch::Apply(&body))
            .await?;
        return Ok(());
    }
    if key.1.is_empty() {
        let api: Api<ClusterOrderedNetworkPolicy> = Api::all(client.clone());
        api.patch_status(&key.2, &params, &Patch::Apply(&body))
            .await?;
    } else {
        let api: Api<OrderedNetworkPolicy> = Api::namespaced(client.clone(), &key.1);
        api.patch_status(&key.2, &params, &Patch::Apply(&body))
            .await?;
    }
    Ok(())
}

/// What the event publisher publishes.
#[derive(Debug)]
pub enum AgentEvent {
    /// An object with problems (boxed: it carries the object).
    Problem(Box<ProblemEvent>),
    /// An endpoint denied because its policy does not fit the datapath's maps.
    Denied(DeniedEvent),
}

/// An object an Event is about, by kind and name.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct EventTarget {
    /// The kind (`Pod`, `NetworkPolicy`, ...).
    pub kind: String,
    /// The namespace, for a namespaced kind.
    pub namespace: Option<String>,
    /// The name.
    pub name: String,
}

impl std::fmt::Display for EventTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.namespace {
            Some(ns) => write!(f, "{} {ns}/{}", self.kind, self.name),
            None => write!(f, "{} {}", self.kind, self.name),
        }
    }
}

impl EventTarget {
    /// The reference an Event names (the API version of the kind).
    fn reference(&self) -> ObjectReference {
        let api_version = match self.kind.as_str() {
            "Pod" => "v1",
            "NetworkPolicy" => "networking.k8s.io/v1",
            k if k == ordnet_crds::KIND_CLUSTER_NETWORK_POLICY => ordnet_crds::CNP_API_VERSIONS[0],
            _ => ordnet_crds::API_VERSION,
        };
        ObjectReference {
            api_version: Some(api_version.into()),
            kind: Some(self.kind.clone()),
            namespace: self.namespace.clone(),
            name: Some(self.name.clone()),
            ..ObjectReference::default()
        }
    }
}

/// An endpoint denied in both directions because its policy does not fit the datapath's maps:
/// published on the pod and on every policy that isolates it.
#[derive(Debug)]
pub struct DeniedEvent {
    /// The pod.
    pub pod: EventTarget,
    /// The policies that isolate it.
    pub policies: Vec<EventTarget>,
    /// Why it does not fit.
    pub why: String,
}

/// A problem to publish as an Event.
#[derive(Debug)]
pub struct ProblemEvent {
    /// The object the Event is about.
    pub object: Object,
    /// Its problems, as in [`ObjectProblem::errors`](super::ObjectProblem::errors).
    pub errors: Vec<String>,
    /// What the agent does with it.
    pub enforcement: Enforcement,
}

/// Publishes a Warning Event per problem (action `Validate`): reason `InvalidObject` for an
/// object that is not enforced (or enforced as written despite validation errors), reason
/// [`EVENT_RULES_FAILED_CLOSED`] for a policy with rules that fail closed.
pub async fn event_loop(client: Client, node: String, mut rx: mpsc::UnboundedReceiver<AgentEvent>) {
    let recorder = Recorder::new(
        client,
        Reporter {
            controller: "ordnet-agent".into(),
            instance: Some(node),
        },
    );
    while let Some(e) = rx.recv().await {
        let p = match e {
            AgentEvent::Problem(p) => *p,
            AgentEvent::Denied(d) => {
                publish_denied(&recorder, &d).await;
                continue;
            }
        };
        let reference = match &p.object {
            Object::Namespace(o) => o.object_ref(&()),
            Object::Pod(o) => o.object_ref(&()),
            Object::ReadPod(_) => k8s_openapi::api::core::v1::Pod {
                metadata: p.object.meta().clone(),
                ..Default::default()
            }
            .object_ref(&()),
            Object::Service(o) => o.object_ref(&()),
            Object::NetworkPolicy(o) => o.object_ref(&()),
            Object::OrderedNetworkPolicy(o) => o.object_ref(&()),
            Object::ClusterOrderedNetworkPolicy(o) => o.object_ref(&()),
            Object::ClusterNetworkPolicy(o) => o.object_ref(&()),
            Object::Node(o) => o.object_ref(&()),
        };
        let (reason, note) = match &p.enforcement {
            Enforcement::None => (
                "InvalidObject",
                format!("not enforced: {}", p.errors.join("; ")),
            ),
            Enforcement::Partial(rules) => (
                EVENT_RULES_FAILED_CLOSED,
                format!(
                    "enforced with rules failing closed: {}",
                    rules
                        .iter()
                        .map(|r| r.to_string())
                        .collect::<Vec<_>>()
                        .join("; ")
                ),
            ),
            Enforcement::Full => (
                "InvalidObject",
                format!("enforced as written despite: {}", p.errors.join("; ")),
            ),
        };
        let event = Event {
            type_: EventType::Warning,
            reason: reason.into(),
            note: Some(truncate(&note, 1000)),
            action: "Validate".into(),
            secondary: None,
        };
        if let Err(e) = recorder.publish(&event, &reference).await {
            tracing::warn!(error = %e, "publishing an event failed");
        }
    }
}

/// Publishes the Events of an endpoint denied for lack of room: on the pod, and on each policy
/// that isolates it.
async fn publish_denied(recorder: &Recorder, d: &DeniedEvent) {
    let policies = d
        .policies
        .iter()
        .map(EventTarget::to_string)
        .collect::<Vec<_>>()
        .join(", ");
    let pod_note = format!(
        "all traffic of this pod is denied in both directions (fail closed): its policy does not \
         fit this node's datapath maps ({}); isolated by: {policies}",
        d.why
    );
    let policy_note = format!(
        "pod {} is denied in both directions (fail closed): its policy does not fit the \
         datapath maps of its node ({})",
        d.pod
            .namespace
            .as_deref()
            .map_or(d.pod.name.clone(), |ns| format!("{ns}/{}", d.pod.name)),
        d.why
    );
    let targets = std::iter::once((&d.pod, pod_note))
        .chain(d.policies.iter().map(|p| (p, policy_note.clone())));
    for (target, note) in targets {
        let event = Event {
            type_: EventType::Warning,
            reason: super::denied::EVENT_POLICY_DOES_NOT_FIT.into(),
            note: Some(truncate(&note, 1000)),
            action: "Program".into(),
            secondary: None,
        };
        if let Err(e) = recorder.publish(&event, &target.reference()).await {
            tracing::warn!(error = %e, "publishing an event failed");
        }
    }
}

fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

#[cfg(test)]
mod lease_tests {
    use super::*;
    use k8s_openapi::api::coordination::v1::LeaseSpec;

    fn spec(holder: &str, renewed_secs_ago: i64, duration: i32) -> LeaseSpec {
        let t = Timestamp::now() - k8s_openapi::jiff::SignedDuration::from_secs(renewed_secs_ago);
        LeaseSpec {
            holder_identity: Some(holder.into()),
            renew_time: Some(MicroTime(t)),
            lease_duration_seconds: Some(duration),
            ..LeaseSpec::default()
        }
    }

    /// A holder whose clock is an hour behind looks long expired by timestamps; by observation
    /// it is alive until its record stops changing for the Lease's duration.
    #[test]
    fn expiry_is_judged_by_the_observers_own_clock() {
        let mut seen = Observed::default();
        assert!(!seen.expired(&spec("node-a", 3600, 15)));
        // Renewed (a new record): still alive, however old its timestamp says it is.
        assert!(!seen.expired(&spec("node-a", 3599, 15)));
        // A record that has not changed for longer than the duration (0 s here) is expired,
        // even if its timestamp says it was renewed in the future (a clock ahead).
        let mut seen = Observed::default();
        let ahead = spec("node-b", -3600, 0);
        assert!(!seen.expired(&ahead));
        std::thread::sleep(Duration::from_millis(5));
        assert!(seen.expired(&ahead));
    }
}

#[cfg(test)]
mod analysis_tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// The analysis waits for the apply loop to be idle, or for the changes to have waited too
    /// long; never for changes it already covers, never before the pause after the last one.
    #[test]
    fn an_analysis_waits_for_a_quiet_moment() {
        let busy = MS * 5;
        let quiet = SHADOW_QUIET;
        // The first: as soon as the loop is quiet, or when the changes have waited too long.
        assert!(!analysis_due(None, 7, busy, MS));
        assert!(analysis_due(None, 7, quiet, MS));
        assert!(analysis_due(None, 7, busy, SHADOW_STALEST));
        // Changes since the last analysis, its pause over.
        let last = Some((5, SHADOW_EVERY * 2, MS * 20));
        assert!(!analysis_due(last, 7, busy, SHADOW_STALEST - MS));
        assert!(analysis_due(last, 7, quiet, MS));
        assert!(analysis_due(last, 7, busy, SHADOW_STALEST));
        // Nothing new: never, however quiet or long.
        assert!(!analysis_due(
            Some((7, SHADOW_STALEST * 2, MS)),
            7,
            quiet,
            SHADOW_STALEST
        ));
        // The pause: at least `SHADOW_EVERY`, ten times the last one's duration if longer.
        assert!(!analysis_due(
            Some((5, SHADOW_EVERY - MS, MS)),
            7,
            quiet,
            SHADOW_STALEST
        ));
        let slow = Duration::from_millis(450);
        assert!(!analysis_due(
            Some((5, slow * 9, slow)),
            7,
            quiet,
            SHADOW_STALEST
        ));
        assert!(analysis_due(Some((5, slow * 10, slow)), 7, quiet, MS));
    }

    fn wanted_at(stamp: u64) -> WantedStatus {
        WantedStatus {
            generation: Some(1),
            errors: Vec::new(),
            enforced: true,
            failed: Vec::new(),
            current: None,
            reference: ObjectReference::default(),
            seq: 1,
            stamp,
            rules: String::new(),
            upstream: false,
            slots: (1, 0),
            staged: false,
        }
    }

    fn picked(
        pass: &mut Pass,
        all: &BTreeMap<ObjKey, WantedStatus>,
        inputs: (Option<Instant>, u64),
    ) -> Vec<String> {
        pass.select(all, inputs).map(|(k, _)| k.2.clone()).collect()
    }

    /// A pass looks at every policy when the report or the traffic changed (and first), and
    /// otherwise only at the policies changed since the last pass and those whose write failed.
    #[test]
    fn a_pass_looks_at_what_changed() {
        let key = |n: &str| {
            (
                ObjectKind::OrderedNetworkPolicy,
                "ns".to_string(),
                n.to_string(),
            )
        };
        let mut all: BTreeMap<ObjKey, WantedStatus> = [("a", 1), ("b", 2), ("c", 3)]
            .map(|(n, s)| (key(n), wanted_at(s)))
            .into();
        let report = Some(Instant::now());
        let mut pass = Pass::default();
        assert_eq!(picked(&mut pass, &all, (None, 0)), ["a", "b", "c"]);
        assert!(picked(&mut pass, &all, (None, 0)).is_empty());
        // Changed (a later change number), new, failed: those alone.
        all.insert(key("b"), wanted_at(4));
        all.insert(key("d"), wanted_at(5));
        pass.retry.insert(key("a"));
        assert_eq!(picked(&mut pass, &all, (None, 0)), ["a", "b", "d"]);
        assert!(picked(&mut pass, &all, (None, 0)).is_empty());
        // A removal leaves nothing to look at; a new report or new traffic: everything.
        all.remove(&key("d"));
        assert!(picked(&mut pass, &all, (None, 0)).is_empty());
        assert_eq!(picked(&mut pass, &all, (report, 0)), ["a", "b", "c"]);
        assert!(picked(&mut pass, &all, (report, 0)).is_empty());
        assert_eq!(picked(&mut pass, &all, (report, 1)), ["a", "b", "c"]);
        // A fresh pass (the Lease taken again): everything.
        let mut pass = Pass::default();
        assert_eq!(picked(&mut pass, &all, (report, 1)), ["a", "b", "c"]);
    }
}
