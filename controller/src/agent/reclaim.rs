//! Clearing what the datapath released, between changes. A rule set no endpoint uses any more
//! (and, with identity classes, a retired class or a rule set leaving its class space) keeps
//! its keys for a grace period — a packet may still be reading them — and is cleared once it
//! is over: by the datapath's next update, unless something clears it first. Clearing a rule
//! set of tens of thousands of keys takes milliseconds (2-6 ms for ~19,000 keys at 10k pods /
//! 5k policies), which whichever change came next used to pay: an isolated change paid for the
//! one before it. The agent clears it once it has been due for [`IDLE`] with no change having
//! done it, on the blocking pool and under the same locks as a change. Changes that come in
//! quick succession still clear what is due themselves (clearing the moment it is due, the
//! clearing ran into the next change about as often as not: at 10k pods / 5k policies a remote
//! relabel's p99 rose from 15-18 to 19.5-22.4 ms, its engine p50 from 0.15 to 0.7-1.4 ms,
//! waiting for the locks); one that comes after a pause finds nothing left to clear.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use super::AgentState;

/// How long after its grace period a released rule set is left to the next change before the
/// agent clears it itself.
pub(super) const IDLE: Duration = Duration::from_millis(30);

/// Clears what the datapath released [`IDLE`] after it is due: `due` is when next
/// ([`super::Enforcer::reclaim_due`], published after every programming). A deadline that a
/// clearing left in place (it failed, or the datapath waits for a full programming) is not
/// tried again until the deadline changes, so a stuck one cannot spin.
pub(super) async fn reclaim_loop(
    state: Arc<AgentState>,
    mut due: watch::Receiver<Option<Instant>>,
) {
    let mut tried: Option<Instant> = None;
    loop {
        let next = *due.borrow_and_update();
        let at = match next {
            Some(at) if Some(at) != tried => at,
            _ => {
                if due.changed().await.is_err() {
                    return;
                }
                continue;
            }
        };
        tokio::select! {
            changed = due.changed() => {
                if changed.is_err() {
                    return;
                }
                continue;
            }
            () = tokio::time::sleep_until(tokio::time::Instant::from_std(at + IDLE)) => {}
        }
        tried = Some(at);
        let state = state.clone();
        let _ = tokio::task::spawn_blocking(move || clear_now(&state)).await;
    }
}

/// Clears what is due now ([`AgentState::between_changes`]: under the locks, recorded as any
/// programming); when a change cleared it meanwhile, only publishes the next deadline.
fn clear_now(state: &AgentState) {
    state.between_changes("clearing released rule sets failed", |_, dp| {
        if dp.reclaim_due().is_none_or(|at| at > Instant::now()) {
            state.publish_reclaim_due(dp);
            return None;
        }
        Some(dp.reclaim())
    });
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::time::Duration;

    use ordnet_engine::{Engine, ObjectChange, ObjectKind};

    use super::*;
    use crate::agent::{Enforcer, NoneDatapath};

    /// The policy keys the datapath's map holds.
    fn keys(dp: &dyn Enforcer) -> usize {
        dp.plane().policy_map_keys()
    }

    /// Rule sets released by a change are cleared once their grace period is over with no
    /// further change: by the loop (the datapath alone keeps them until its next update, which
    /// is checked first).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn released_rule_sets_are_cleared_without_another_change() {
        cleared_without_another_change(NoneDatapath::default()).await;
    }

    /// The same with identity classes: the loop goes on until the class layer's own delayed
    /// work (the released rule sets leaving their spaces, the classes retired) is done too.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn with_classes_released_rule_sets_are_cleared_without_another_change() {
        cleared_without_another_change(NoneDatapath::with_classes()).await;
    }

    async fn cleared_without_another_change(mut dp: NoneDatapath) {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/qa-prod");
        let outcome = ordnet_crds::load_and_validate(&[dir]);
        let mut engine = Engine::build_for_node(&outcome.objects, "node-1");
        dp.program_full(&engine).unwrap();
        assert!(keys(&dp) > 0, "the example programs no policy key");
        assert_eq!(dp.reclaim_due(), None);
        // Every local pod goes: each of their rule sets is released.
        let local: Vec<(String, String)> = engine
            .endpoints()
            .iter()
            .filter(|e| e.node.as_deref() == Some("node-1"))
            .map(|e| (e.namespace.clone(), e.name.clone()))
            .collect();
        assert!(!local.is_empty(), "the example has no pod on node-1");
        let deltas: Vec<_> = local
            .into_iter()
            .map(|(namespace, name)| {
                engine.apply(ObjectChange::Delete {
                    kind: ObjectKind::Pod,
                    namespace: Some(namespace),
                    name,
                })
            })
            .collect();
        dp.apply(&engine, &deltas).unwrap();
        let due = dp.reclaim_due().expect("the pods' rule sets are released");
        let released = keys(&dp);
        assert!(released > 0, "nothing left to clear");
        tokio::time::sleep_until(tokio::time::Instant::from_std(
            due + Duration::from_millis(50),
        ))
        .await;
        assert_eq!(keys(&dp), released, "cleared with no update");

        let state = Arc::new(AgentState::new("node-1", Box::new(dp), None, 16, 16));
        {
            let (mut slot, dp) = state.lock_for_update();
            state.after_programming(&engine, dp.as_ref());
            state.install_engine(&mut slot, engine);
        }
        tokio::spawn(reclaim_loop(state.clone(), state.reclaim_due.subscribe()));
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let (left, due) = state
                .with_programmed(|_, dp| (keys(dp), dp.reclaim_due()))
                .unwrap();
            if (left, due) == (0, None) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{left} of {released} policy keys left, next due {due:?}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}
