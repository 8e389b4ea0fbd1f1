//! The agent's Prometheus metrics (text exposition format 0.0.4, written by hand).

use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use ordnet_engine::Engine;
use ordnet_mapstate::Direction;

use super::{Enforcer, WatchHealth};

/// A monotonically increasing count.
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    /// Adds one.
    pub fn inc(&self) {
        self.add(1);
    }
    /// Adds `n`.
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }
    /// The current count.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Upper bounds (seconds) of the duration histograms' buckets.
pub const BUCKETS: [f64; 14] = [
    0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
];

/// A duration histogram with [`BUCKETS`].
#[derive(Debug, Default)]
pub struct Histogram(Mutex<HistogramData>);

/// A copy of a [`Histogram`]'s state.
#[derive(Debug, Default, Clone)]
pub struct HistogramData {
    /// Non-cumulative counts per bucket, then the `+Inf` overflow.
    pub counts: [u64; BUCKETS.len() + 1],
    /// Sum of the observed durations, seconds.
    pub sum: f64,
    /// Number of observations.
    pub count: u64,
}

impl Histogram {
    /// Records one duration, in seconds.
    pub fn observe(&self, seconds: f64) {
        let mut h = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let i = BUCKETS
            .iter()
            .position(|b| seconds <= *b)
            .unwrap_or(BUCKETS.len());
        h.counts[i] += 1;
        h.sum += seconds;
        h.count += 1;
    }
    /// A consistent copy of the buckets, sum and count.
    pub fn data(&self) -> HistogramData {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// Sizes, as of the last programming.
#[derive(Debug, Default, Clone, Copy)]
pub struct Sizes {
    /// Identities allocated by the engine (`ordnet_identities`).
    pub identities: u64,
    /// Local endpoints programmed in the datapath (`ordnet_endpoints`).
    pub endpoints: u64,
    /// Ingress MapState keys programmed, summed over local endpoints.
    pub entries_ingress: u64,
    /// Egress MapState keys programmed, summed over local endpoints.
    pub entries_egress: u64,
    /// Distinct MapStates of the engine (`ordnet_shared_mapstates`).
    pub shared_mapstates: u64,
    /// ipcache prefixes programmed (`ordnet_ipcache_entries`).
    pub ipcache: u64,
}

/// Every metric of the agent.
#[derive(Debug, Default)]
pub struct Metrics {
    /// `ordnet_object_changes_total`: object changes applied to the engine.
    pub object_changes: Counter,
    /// `ordnet_update_batches_total`: coalesced batches applied.
    pub batches: Counter,
    /// `ordnet_invalid_objects_total`: object versions the engine cannot use at all.
    pub invalid_objects: Counter,
    /// `ordnet_engine_errors_total`: objects the engine left out or did not apply.
    pub engine_errors: Counter,
    /// `ordnet_datapath_errors_total`: failed programming or upkeep of the datapath.
    pub datapath_errors: Counter,
    /// `ordnet_compile_duration_seconds`: engine computation per batch (the first one: the
    /// full build).
    pub compile_seconds: Histogram,
    /// `ordnet_apply_duration_seconds`: engine computation plus datapath programming per batch.
    pub apply_seconds: Histogram,
    /// `ordnet_change_latency_seconds`: from a batch's first watch event to the datapath
    /// updated.
    pub change_latency_seconds: Histogram,
    sizes: Mutex<Sizes>,
    /// The datapath's own metrics as of the last programming (`Datapath::write_metrics`).
    datapath_text: Mutex<String>,
}

impl Metrics {
    /// Records the sizes of `engine` and `dp`, and the datapath's own metrics text.
    pub fn set_sizes(&self, engine: &Engine, dp: &dyn Enforcer) {
        let mut s = Sizes {
            identities: engine.identities().count() as u64,
            endpoints: dp.programmed().len() as u64,
            shared_mapstates: engine.shared_mapstates() as u64,
            ipcache: dp.ipcache().len() as u64,
            ..Sizes::default()
        };
        for ep in engine.endpoints() {
            s.entries_ingress += engine.policy(ep, Direction::Ingress).mapstate.len() as u64;
            s.entries_egress += engine.policy(ep, Direction::Egress).mapstate.len() as u64;
        }
        *self.sizes.lock().unwrap_or_else(|e| e.into_inner()) = s;
        let mut text = String::new();
        dp.write_metrics(&mut text);
        *self.datapath_text.lock().unwrap_or_else(|e| e.into_inner()) = text;
    }

    /// The sizes recorded last ([`Metrics::set_sizes`]).
    pub fn sizes(&self) -> Sizes {
        *self.sizes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The Prometheus text exposition.
    pub fn render(&self, ready: bool, invalid_now: usize, watch: &WatchHealth) -> String {
        let mut out = String::new();
        watch_metrics(&mut out, watch);
        let s = self.sizes();
        gauge(
            &mut out,
            "ordnet_ready",
            "1 once the initial sync is programmed.",
            u64::from(ready),
        );
        gauge(
            &mut out,
            "ordnet_identities",
            "Identities allocated.",
            s.identities,
        );
        gauge(
            &mut out,
            "ordnet_endpoints",
            "Local endpoints programmed.",
            s.endpoints,
        );
        gauge(
            &mut out,
            "ordnet_ipcache_entries",
            "ipcache prefixes programmed.",
            s.ipcache,
        );
        gauge(
            &mut out,
            "ordnet_shared_mapstates",
            "Distinct MapStates (endpoints with equal inputs share one).",
            s.shared_mapstates,
        );
        let _ = writeln!(
            out,
            "# HELP ordnet_mapstate_entries MapState keys programmed, summed over local endpoints.\n\
             # TYPE ordnet_mapstate_entries gauge\n\
             ordnet_mapstate_entries{{direction=\"ingress\"}} {}\n\
             ordnet_mapstate_entries{{direction=\"egress\"}} {}",
            s.entries_ingress, s.entries_egress
        );
        gauge(
            &mut out,
            "ordnet_invalid_objects",
            "Objects currently not enforced because the engine cannot use them at all.",
            invalid_now as u64,
        );
        counter(
            &mut out,
            "ordnet_object_changes_total",
            "Object changes applied to the engine.",
            &self.object_changes,
        );
        counter(
            &mut out,
            "ordnet_update_batches_total",
            "Coalesced batches of changes applied.",
            &self.batches,
        );
        counter(
            &mut out,
            "ordnet_invalid_objects_total",
            "Object versions seen that the engine cannot use at all (not enforced).",
            &self.invalid_objects,
        );
        counter(
            &mut out,
            "ordnet_engine_errors_total",
            "Objects the engine could not use.",
            &self.engine_errors,
        );
        counter(
            &mut out,
            "ordnet_datapath_errors_total",
            "Datapath programming errors.",
            &self.datapath_errors,
        );
        histogram(
            &mut out,
            "ordnet_compile_duration_seconds",
            "Engine computation per batch (the first one: the full build).",
            &self.compile_seconds,
        );
        histogram(
            &mut out,
            "ordnet_apply_duration_seconds",
            "Engine computation plus datapath programming per batch.",
            &self.apply_seconds,
        );
        histogram(
            &mut out,
            "ordnet_change_latency_seconds",
            "From the first watch event of a batch received to the datapath updated.",
            &self.change_latency_seconds,
        );
        out.push_str(&self.datapath_text.lock().unwrap_or_else(|e| e.into_inner()));
        out
    }
}

/// Per kind: staleness, the age of what was heard last, and the watch's failure counts.
fn watch_metrics(out: &mut String, watch: &WatchHealth) {
    let now = std::time::Instant::now();
    let all = watch.all();
    let family = |out: &mut String,
                  name: &str,
                  kind: &str,
                  help: &str,
                  v: &dyn Fn(&super::KindHealth) -> String| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (k, h) in &all {
            let _ = writeln!(out, "{name}{{kind=\"{}\"}} {}", k.name(), v(h));
        }
    };
    family(
        out,
        "ordnet_watch_stale_seconds",
        "gauge",
        "For how long the view of this kind may have been behind the API server (0: in step); the last programmed state is enforced meanwhile.",
        &|h| format!("{}", h.stale_for(now).map_or(0.0, |d| d.as_secs_f64())),
    );
    family(
        out,
        "ordnet_watch_last_heard_seconds",
        "gauge",
        "Age of the last list page, event or bookmark received for this kind.",
        &|h| match h.last_heard {
            Some(t) => format!("{}", now.duration_since(t).as_secs_f64()),
            None => "NaN".to_string(),
        },
    );
    family(
        out,
        "ordnet_watch_errors_total",
        "counter",
        "Failed list and watch requests (retried after a bounded backoff).",
        &|h| h.errors.to_string(),
    );
    family(
        out,
        "ordnet_watch_reconnects_total",
        "counter",
        "Watches started again after a failure.",
        &|h| h.reconnects.to_string(),
    );
    family(
        out,
        "ordnet_watch_silent_total",
        "counter",
        "Watches taken for dead after hearing nothing (no event, no bookmark) past their timeout.",
        &|h| h.silent.to_string(),
    );
    family(
        out,
        "ordnet_watch_relists_total",
        "counter",
        "Lists after the first one (the resource version was gone: 410).",
        &|h| h.relists.to_string(),
    );
}

fn gauge(out: &mut String, name: &str, help: &str, v: u64) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
}

fn counter(out: &mut String, name: &str, help: &str, c: &Counter) {
    let _ = writeln!(
        out,
        "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
        c.get()
    );
}

fn histogram(out: &mut String, name: &str, help: &str, h: &Histogram) {
    let d = h.data();
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
    let mut cumulative = 0;
    for (i, b) in BUCKETS.iter().enumerate() {
        cumulative += d.counts[i];
        let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {cumulative}");
    }
    cumulative += d.counts[BUCKETS.len()];
    let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {cumulative}");
    let _ = writeln!(out, "{name}_sum {}", d.sum);
    let _ = writeln!(out, "{name}_count {}", d.count);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let h = Histogram::default();
        h.observe(0.0003);
        h.observe(0.02);
        h.observe(100.0);
        let mut out = String::new();
        histogram(&mut out, "x", "help", &h);
        assert!(out.contains("x_bucket{le=\"0.0001\"} 0\n"));
        assert!(out.contains("x_bucket{le=\"0.0005\"} 1\n"));
        assert!(out.contains("x_bucket{le=\"0.025\"} 2\n"));
        assert!(out.contains("x_bucket{le=\"10\"} 2\n"));
        assert!(out.contains("x_bucket{le=\"+Inf\"} 3\n"));
        assert!(out.contains("x_count 3\n"));
    }
}
