//! Policy status and Events.
//!
//! * Exactly one agent writes status at a time: the holder of the `coordination.k8s.io/v1`
//!   Lease [`LEASE_NAME`] (in the agent's namespace). Every agent tries to acquire it every
//!   [`RENEW_EVERY`] (configurable); the holder renews it; a holder that stopped renewing for
//!   `leaseDurationSeconds` loses it to the next agent that looks. Updates are guarded by the
//!   Lease's resourceVersion (409 Conflict = somebody else was faster).
//! * The status writer sets, on every OrderedNetworkPolicy and ClusterOrderedNetworkPolicy,
//!   `status.observedGeneration` and the `Accepted` condition (`True`/`Valid`, or
//!   `False`/`Invalid` with the validation errors naming the fields) by server-side apply on the
//!   `/status` subresource (field manager [`FIELD_MANAGER`]). It writes only when the stored
//!   status differs from the wanted one.
//! * Every agent publishes a Warning Event (events.k8s.io/v1) for each invalid object version
//!   it sees, whether or not it holds the Lease.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::{Api, Client, Resource};
use ordnet_crds::{ClusterOrderedNetworkPolicy, OrderedNetworkPolicy, PolicyStatus};
use ordnet_engine::Object;
use serde_json::json;
use tokio::sync::{mpsc, watch};

use super::ObjKey;

/// The Lease that elects the status writer.
pub const LEASE_NAME: &str = "ordnet-status-writer";
/// The server-side apply field manager of the status writer.
pub const FIELD_MANAGER: &str = "ordnet-agent";
/// How long a Lease holds without renewal.
pub const LEASE_SECONDS: i32 = 15;
/// How often the Lease is renewed or tried (by default; see `AgentConfig::lease_renew_every`).
pub const RENEW_EVERY: Duration = Duration::from_secs(5);

/// What the status of one policy should say.
#[derive(Debug, Clone, PartialEq)]
pub struct WantedStatus {
    pub generation: Option<i64>,
    /// Empty = accepted; otherwise the validation errors.
    pub errors: Vec<String>,
    /// The status stored in the API server, as last seen by the watch.
    pub current: Option<PolicyStatus>,
}

impl WantedStatus {
    fn condition(&self) -> (&'static str, &'static str, String) {
        if self.errors.is_empty() {
            (
                "True",
                "Valid",
                "the policy is valid and enforced".to_string(),
            )
        } else {
            ("False", "Invalid", self.errors.join("; "))
        }
    }

    /// Whether the stored status already says what it should.
    pub fn satisfied(&self) -> bool {
        let Some(cur) = &self.current else {
            return false;
        };
        let (status, reason, message) = self.condition();
        cur.observed_generation == self.generation
            && cur.conditions.iter().any(|c| {
                c.type_ == "Accepted"
                    && c.status == status
                    && c.reason == reason
                    && c.message == message
                    && c.observed_generation == self.generation
            })
    }
}

/// The wanted status of a policy object, or `None` for other kinds.
pub fn wanted(object: &Object, errors: &[String]) -> Option<WantedStatus> {
    let (generation, current) = match object {
        Object::OrderedNetworkPolicy(p) => (p.metadata.generation, p.status.clone()),
        Object::ClusterOrderedNetworkPolicy(p) => (p.metadata.generation, p.status.clone()),
        _ => return None,
    };
    Some(WantedStatus {
        generation,
        errors: errors.to_vec(),
        current,
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
    loop {
        let held = match try_hold(&leases, &identity).await {
            Ok(h) => h,
            Err(e) => {
                eprintln!("ordnet agent: lease {namespace}/{LEASE_NAME}: {e}");
                false
            }
        };
        if held != leader.swap(held, Ordering::SeqCst) {
            eprintln!(
                "ordnet agent: {} the status writer lease",
                if held { "acquired" } else { "lost" }
            );
        }
        tokio::time::sleep(every).await;
    }
}

async fn try_hold(leases: &Api<Lease>, identity: &str) -> Result<bool, kube::Error> {
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
            let duration = i64::from(spec.lease_duration_seconds.unwrap_or(LEASE_SECONDS));
            let expired = spec
                .renew_time
                .as_ref()
                .is_none_or(|t| now.0.as_second() - t.0.as_second() > duration);
            if !mine && !expired {
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

/// Runs the status writer: whenever `wanted` changes (or leadership is gained), writes every
/// status that is not satisfied yet.
pub async fn status_loop(
    client: Client,
    leader: Arc<AtomicBool>,
    mut wanted: watch::Receiver<BTreeMap<ObjKey, WantedStatus>>,
) {
    // What this writer last wrote, per object: so it does not write again before the watch
    // shows the result.
    let mut written: BTreeMap<ObjKey, WantedStatus> = BTreeMap::new();
    loop {
        if leader.load(Ordering::SeqCst) {
            let todo: Vec<(ObjKey, WantedStatus)> = wanted
                .borrow_and_update()
                .iter()
                .filter(|(k, w)| {
                    !w.satisfied()
                        && written.get(*k).is_none_or(|prev| {
                            prev.generation != w.generation || prev.errors != w.errors
                        })
                })
                .map(|(k, w)| (k.clone(), w.clone()))
                .collect();
            for (key, w) in todo {
                match write_status(&client, &key, &w).await {
                    Ok(()) => {
                        written.insert(key, w);
                    }
                    Err(e) => eprintln!("ordnet agent: status of {}: {e}", key.2),
                }
            }
            written.retain(|k, _| wanted.borrow().contains_key(k));
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

async fn write_status(client: &Client, key: &ObjKey, w: &WantedStatus) -> Result<(), kube::Error> {
    let (status, reason, message) = w.condition();
    let previous = w
        .current
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Accepted"));
    // The transition time moves only when the condition's status changes.
    let transition = match previous {
        Some(c) if c.status == status => c.last_transition_time.clone(),
        _ => k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(Timestamp::now()),
    };
    let kind = super::kind_name(super::KINDS[key.0]);
    let body = json!({
        "apiVersion": "ordnet.io/v1alpha1",
        "kind": kind,
        "status": {
            "observedGeneration": w.generation,
            "conditions": [{
                "type": "Accepted",
                "status": status,
                "reason": reason,
                "message": message,
                "observedGeneration": w.generation,
                "lastTransitionTime": transition,
            }],
        },
    });
    let params = PatchParams::apply(FIELD_MANAGER).force();
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

/// A problem to publish as an Event.
#[derive(Debug)]
pub struct ProblemEvent {
    pub object: Object,
    pub errors: Vec<String>,
}

/// Publishes a Warning Event per problem (reason `InvalidObject`, action `Validate`).
pub async fn event_loop(
    client: Client,
    node: String,
    mut rx: mpsc::UnboundedReceiver<ProblemEvent>,
) {
    let recorder = Recorder::new(
        client,
        Reporter {
            controller: "ordnet-agent".into(),
            instance: Some(node),
        },
    );
    while let Some(p) = rx.recv().await {
        let reference = match &p.object {
            Object::Namespace(o) => o.object_ref(&()),
            Object::Pod(o) => o.object_ref(&()),
            Object::NetworkPolicy(o) => o.object_ref(&()),
            Object::OrderedNetworkPolicy(o) => o.object_ref(&()),
            Object::ClusterOrderedNetworkPolicy(o) => o.object_ref(&()),
        };
        let event = Event {
            type_: EventType::Warning,
            reason: "InvalidObject".into(),
            note: Some(truncate(&format!("skipped: {}", p.errors.join("; ")), 1000)),
            action: "Validate".into(),
            secondary: None,
        };
        if let Err(e) = recorder.publish(&event, &reference).await {
            eprintln!("ordnet agent: publishing an event: {e}");
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
