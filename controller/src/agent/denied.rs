//! Endpoints denied because their rule sets do not fit the datapath's maps
//! ([`NodeProgram::denied`](crate::program::NodeProgram::denied)): they hold a deny-all policy
//! in both directions until there is room. Each change is reported once, loudly: a log line
//! (`WARN` when an endpoint is denied, `INFO` when it is enforced by its own policy again) and
//! a Warning Event (reason [`EVENT_POLICY_DOES_NOT_FIT`]) on the pod and on every policy that
//! isolates it. The metrics and `/readyz` say it for as long as it lasts (`datapath.rs`).

use std::collections::{BTreeMap, BTreeSet};

use ordnet_engine::Engine;
use ordnet_mapstate::Direction;
use tokio::sync::mpsc;

use super::status::{AgentEvent, DeniedEvent, EventTarget};

/// The reason of the Events about an endpoint denied for lack of room.
pub const EVENT_POLICY_DOES_NOT_FIT: &str = "PolicyDoesNotFit";

/// The denied endpoints last reported, and where the Events go.
#[derive(Debug, Default)]
pub struct DeniedReport {
    last: BTreeMap<String, String>,
    events: Option<mpsc::UnboundedSender<AgentEvent>>,
}

impl DeniedReport {
    /// A report that publishes Events through `events`.
    pub fn new(events: mpsc::UnboundedSender<AgentEvent>) -> DeniedReport {
        DeniedReport {
            last: BTreeMap::new(),
            events: Some(events),
        }
    }

    /// Reports what changed since the last call: endpoints newly denied (or denied for another
    /// reason) and endpoints enforced by their own policies again.
    pub fn observe(&mut self, engine: &Engine, denied: &BTreeMap<String, String>) {
        if &self.last == denied {
            return;
        }
        for (who, why) in denied {
            if self.last.get(who) == Some(why) {
                continue;
            }
            let (namespace, name) = who.split_once('/').unwrap_or(("", who));
            let policies = isolating_policies(engine, namespace, name);
            tracing::warn!(
                endpoint = %who,
                policies = %policies.iter().map(EventTarget::to_string).collect::<Vec<_>>().join(","),
                error = %why,
                "the endpoint's policy does not fit the datapath's maps: all its traffic is denied \
                 in both directions until it fits"
            );
            if let Some(tx) = &self.events {
                let _ = tx.send(AgentEvent::Denied(DeniedEvent {
                    pod: EventTarget {
                        kind: "Pod".into(),
                        namespace: Some(namespace.to_string()),
                        name: name.to_string(),
                    },
                    policies,
                    why: why.clone(),
                }));
            }
        }
        for who in self.last.keys().filter(|w| !denied.contains_key(*w)) {
            tracing::info!(endpoint = %who, "the endpoint's policy fits the datapath's maps again: enforced as written");
        }
        self.last = denied.clone();
    }
}

/// The policies that isolate the endpoint `namespace/name` in either direction (the ones whose
/// rules it would have).
fn isolating_policies(engine: &Engine, namespace: &str, name: &str) -> Vec<EventTarget> {
    let Some(ep) = engine.endpoint(namespace, name) else {
        return Vec::new();
    };
    let mut out = BTreeSet::new();
    for dir in Direction::ALL {
        for o in &engine.policy(ep, dir).isolated_by {
            out.insert(EventTarget {
                kind: o.kind.clone(),
                namespace: o.namespace.clone(),
                name: o.name.clone(),
            });
        }
    }
    out.into_iter().collect()
}
