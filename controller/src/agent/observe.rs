//! The agent's verdict events (`docs/observe.md`): reads the datapath's event ring buffer as
//! events arrive, attributes each batch to the rules that decided (`crate::observe`) under the
//! same locks programming takes (so the engine is the one the tables were written from), and
//! keeps the last ones, numbered, for the debug API's `/v1/observe` (`ordnet observe`).

use std::sync::Arc;
use std::time::Duration;

use ordnet_datapath::EventReader;
use ordnet_datapath::common::event::FlowEvent;
use tokio::io::unix::AsyncFd;

use super::AgentState;
use crate::observe::attribute_batch;

/// How many attributed events the agent keeps by default (`--observe-buffer`).
pub const DEFAULT_JOURNAL: usize = 10_000;

/// How often the loop looks at the ring buffer: the programs wake the reader only once a
/// quarter of the ring is waiting (a wake-up per event costs an interrupt), so events reach
/// the journal within this much.
const POLL: Duration = Duration::from_millis(100);

/// How often the loop asks the datapath whether its programs were loaded again (a new ring
/// buffer).
const RECHECK: Duration = Duration::from_secs(1);

/// Reads, attributes and records the datapath's verdict events for as long as the agent runs.
pub async fn observe_loop(state: Arc<AgentState>) {
    let mut reader: Option<AsyncFd<EventReader>> = None;
    let mut raw: Vec<FlowEvent> = Vec::new();
    let mut checked: Option<tokio::time::Instant> = None;
    loop {
        // A new load of the programs (start, growth) has a new ring buffer.
        let fresh = if checked.is_none_or(|t| t.elapsed() >= RECHECK) {
            checked = Some(tokio::time::Instant::now());
            state.datapath().take_events()
        } else {
            None
        };
        if let Some(r) = fresh {
            // SAFETY: the reader owns the ring buffer's file descriptor and always returns that
            // one; the `AsyncFd` owns the reader, so the descriptor stays open while registered.
            let registered =
                unsafe { AsyncFd::register_with_interest(r, tokio::io::Interest::READABLE) };
            match registered {
                Ok(fd) => {
                    // What the old ring still holds comes first.
                    if let Some(old) = reader.as_mut() {
                        old.get_mut().drain(&mut raw);
                    }
                    reader = Some(fd);
                }
                Err(e) => {
                    let (_, e) = e.into_parts();
                    tracing::warn!(error = %e, "cannot poll the verdict events");
                }
            }
        }
        let Some(fd) = reader.as_mut() else {
            tokio::time::sleep(RECHECK).await;
            continue;
        };
        if raw.is_empty() {
            tokio::select! {
                guard = fd.readable_mut() => {
                    if let Ok(mut g) = guard {
                        g.clear_ready();
                    }
                }
                _ = tokio::time::sleep(POLL) => {}
            }
        }
        fd.get_mut().drain(&mut raw);
        if raw.is_empty() {
            continue;
        }
        let batch = std::mem::take(&mut raw);
        let state2 = state.clone();
        let _ = tokio::task::spawn_blocking(move || record(&state2, &batch)).await;
    }
}

/// Attributes a batch of raw events and appends them to the journal (and the flow log).
pub fn record(state: &AgentState, batch: &[FlowEvent]) {
    let records = state.with_programmed(|engine, dp| attribute_batch(engine, dp.plane(), batch, 0));
    let Some(mut records) = records else {
        return;
    };
    // What the staged policies would do (outside the engine's lock: the view has its own).
    state.judge_staged(&mut records);
    state
        .history
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .record(&records);
    // Numbered once attributed: the journal's lock is never held across programming's.
    let mut journal = state.journal.lock().unwrap_or_else(|e| e.into_inner());
    let first = journal.next_seq();
    for (i, r) in records.iter_mut().enumerate() {
        state.metrics.observed(r.attribution);
        r.seq = first + i as u64;
    }
    if let Some(log) = state
        .flow_log
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_mut()
        && let Err(e) = log.write(&records)
    {
        state.metrics.flow_log_errors.inc();
        tracing::warn!(error = %e, "writing the flow log failed");
    }
    for r in records {
        journal.push(r);
    }
}
