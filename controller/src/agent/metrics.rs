//! The agent's Prometheus metrics. The agent keeps its counters and histograms here (plain
//! atomics, updated on the apply path); a scrape takes a snapshot of them, of every kind's watch
//! health, of the datapath's own numbers and of the process (`/proc/self`), and
//! `prometheus-client` encodes it (OpenMetrics text), with `ordnet_build_info`.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use ordnet_engine::Engine;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

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

/// One sample of the datapath's own metrics ([`Enforcer::metrics`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// The family's name (a counter's without `_total`: the encoder adds it).
    pub name: &'static str,
    /// The family's help text.
    pub help: &'static str,
    /// Counter or gauge.
    pub counter: bool,
    /// Label pairs.
    pub labels: Vec<(&'static str, String)>,
    /// The value.
    pub value: u64,
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
    /// `ordnet_observed_events_total{attribution}`: verdict events attributed (exact, current,
    /// changed: `crate::observe::Attribution`).
    pub observed_events: [Counter; 3],
    /// `ordnet_flow_log_errors_total`: failed writes of the flow log.
    pub flow_log_errors: Counter,
    sizes: Mutex<Sizes>,
    /// The datapath's own metrics as of the last programming ([`Enforcer::metrics`]).
    datapath: Mutex<Vec<Sample>>,
    /// The datapath's health notes as of the last programming ([`Enforcer::health`]).
    health: Mutex<Vec<String>>,
}

impl Metrics {
    /// Counts one attributed verdict event.
    pub fn observed(&self, a: crate::observe::Attribution) {
        use crate::observe::Attribution;
        let i = match a {
            Attribution::Exact => 0,
            Attribution::Current => 1,
            Attribution::Changed => 2,
        };
        self.observed_events[i].inc();
    }

    /// Records the sizes of `engine` and `dp`, and the datapath's own metrics.
    pub fn set_sizes(&self, engine: &Engine, dp: &dyn Enforcer) {
        let [ingress, egress] = engine.endpoint_keys();
        let s = Sizes {
            identities: engine.identity_count() as u64,
            endpoints: dp.programmed().len() as u64,
            shared_mapstates: engine.shared_mapstates() as u64,
            ipcache: dp.ipcache_len() as u64,
            entries_ingress: ingress as u64,
            entries_egress: egress as u64,
        };
        *self.sizes.lock().unwrap_or_else(|e| e.into_inner()) = s;
        self.set_datapath(dp);
    }

    /// Records the datapath's own metrics and health notes (also between programmings: after
    /// `/v1/counters` read the per-rule counters).
    pub fn set_datapath(&self, dp: &dyn Enforcer) {
        *self.datapath.lock().unwrap_or_else(|e| e.into_inner()) = dp.metrics();
        *self.health.lock().unwrap_or_else(|e| e.into_inner()) = dp.health();
    }

    /// The datapath's health notes recorded last ([`Enforcer::health`]).
    pub fn health(&self) -> Vec<String> {
        self.health
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The sizes recorded last ([`Metrics::set_sizes`]).
    pub fn sizes(&self) -> Sizes {
        *self.sizes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The OpenMetrics text exposition of everything, as of now.
    pub fn render(&self, ready: bool, invalid_now: usize, watch: &WatchHealth) -> String {
        let snapshot = self.snapshot(ready, invalid_now, watch);
        let mut registry = Registry::default();
        registry.register_collector(Box::new(snapshot));
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &registry)
            .expect("writing to a String");
        out
    }

    fn snapshot(&self, ready: bool, invalid_now: usize, watch: &WatchHealth) -> Snapshot {
        let mut f = Snapshot::default();
        f.info(
            "ordnet_build",
            "The agent's version.",
            vec![("version", env!("CARGO_PKG_VERSION").to_string())],
        );
        let s = self.sizes();
        f.gauge(
            "ordnet_ready",
            "1 once the initial sync is programmed.",
            u64::from(ready) as f64,
        );
        f.gauge(
            "ordnet_identities",
            "Identities allocated.",
            s.identities as f64,
        );
        f.gauge(
            "ordnet_endpoints",
            "Local endpoints programmed.",
            s.endpoints as f64,
        );
        f.gauge(
            "ordnet_ipcache_entries",
            "ipcache prefixes programmed.",
            s.ipcache as f64,
        );
        f.gauge(
            "ordnet_shared_mapstates",
            "Distinct MapStates (endpoints with equal inputs share one).",
            s.shared_mapstates as f64,
        );
        f.family(
            "ordnet_mapstate_entries",
            "MapState keys programmed, summed over local endpoints.",
            MetricType::Gauge,
            vec![
                (
                    vec![("direction", "ingress".into())],
                    Value::Gauge(s.entries_ingress as f64),
                ),
                (
                    vec![("direction", "egress".into())],
                    Value::Gauge(s.entries_egress as f64),
                ),
            ],
        );
        f.gauge(
            "ordnet_invalid_objects",
            "Objects currently not enforced because the engine cannot use them at all.",
            invalid_now as f64,
        );
        for (name, help, c) in [
            (
                "ordnet_object_changes",
                "Object changes applied to the engine.",
                &self.object_changes,
            ),
            (
                "ordnet_update_batches",
                "Coalesced batches of changes applied.",
                &self.batches,
            ),
            (
                "ordnet_invalid_objects",
                "Object versions seen that the engine cannot use at all (not enforced).",
                &self.invalid_objects,
            ),
            (
                "ordnet_engine_errors",
                "Objects the engine could not use.",
                &self.engine_errors,
            ),
            (
                "ordnet_datapath_errors",
                "Datapath programming errors.",
                &self.datapath_errors,
            ),
            (
                "ordnet_flow_log_errors",
                "Failed writes of the flow log (--flow-log).",
                &self.flow_log_errors,
            ),
        ] {
            // `ordnet_invalid_objects` is also a gauge: the counter's samples end in `_total`.
            f.counter(name, help, c.get());
        }
        for (name, help, h) in [
            (
                "ordnet_compile_duration_seconds",
                "Engine computation per batch (the first one: the full build).",
                &self.compile_seconds,
            ),
            (
                "ordnet_apply_duration_seconds",
                "Engine computation plus datapath programming per batch.",
                &self.apply_seconds,
            ),
            (
                "ordnet_change_latency_seconds",
                "From the first watch event of a batch received to the datapath updated.",
                &self.change_latency_seconds,
            ),
        ] {
            f.family(
                name,
                help,
                MetricType::Histogram,
                vec![(vec![], Value::Histogram(h.data()))],
            );
        }
        f.family(
            "ordnet_observed_events",
            "Verdict events of the datapath attributed to rules (docs/observe.md), by how the \
             attribution relates to the judgement: exact (same revision, same lookup result), \
             current (an older revision that today's state decides the same way), changed \
             (today's state decides differently: the policy changed since).",
            MetricType::Counter,
            ["exact", "current", "changed"]
                .into_iter()
                .zip(&self.observed_events)
                .map(|(a, c)| {
                    (
                        vec![("attribution", a.to_string())],
                        Value::Counter(c.get()),
                    )
                })
                .collect(),
        );
        watch_metrics(&mut f, watch);
        let datapath = self
            .datapath
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        for sample in datapath {
            let kind = if sample.counter {
                MetricType::Counter
            } else {
                MetricType::Gauge
            };
            let value = if sample.counter {
                Value::Counter(sample.value)
            } else {
                Value::Gauge(sample.value as f64)
            };
            f.push(sample.name, sample.help, kind, sample.labels, value);
        }
        process_metrics(&mut f);
        f
    }
}

/// A value of a sample.
#[derive(Debug, Clone)]
enum Value {
    Counter(u64),
    /// A counter with a fractional value (CPU seconds).
    CounterF(f64),
    Gauge(f64),
    Histogram(HistogramData),
    Info,
}

type Labels = Vec<(&'static str, String)>;

/// A family of one scrape: name, help, type, and its samples.
type FamilyData = (&'static str, &'static str, MetricType, Vec<(Labels, Value)>);

/// Every family of one scrape, in order, encoded by `prometheus-client`.
#[derive(Debug, Default)]
struct Snapshot {
    families: Vec<FamilyData>,
}

impl Snapshot {
    fn family(
        &mut self,
        name: &'static str,
        help: &'static str,
        kind: MetricType,
        points: Vec<(Labels, Value)>,
    ) {
        self.families.push((name, help, kind, points));
    }

    /// One sample, into the family of that name (a new one if it is not the last).
    fn push(
        &mut self,
        name: &'static str,
        help: &'static str,
        kind: MetricType,
        labels: Labels,
        v: Value,
    ) {
        match self.families.last_mut() {
            Some(last) if last.0 == name => last.3.push((labels, v)),
            _ => self.family(name, help, kind, vec![(labels, v)]),
        }
    }

    fn gauge(&mut self, name: &'static str, help: &'static str, v: f64) {
        self.family(
            name,
            help,
            MetricType::Gauge,
            vec![(vec![], Value::Gauge(v))],
        );
    }

    fn counter(&mut self, name: &'static str, help: &'static str, v: u64) {
        self.family(
            name,
            help,
            MetricType::Counter,
            vec![(vec![], Value::Counter(v))],
        );
    }

    /// A counter with a fractional value (CPU seconds).
    fn counter_f(&mut self, name: &'static str, help: &'static str, v: f64) {
        self.family(
            name,
            help,
            MetricType::Counter,
            vec![(vec![], Value::CounterF(v))],
        );
    }

    fn info(&mut self, name: &'static str, help: &'static str, labels: Labels) {
        self.family(name, help, MetricType::Info, vec![(labels, Value::Info)]);
    }
}

/// One sample's value, encoded as its type.
#[derive(Debug)]
struct Point<'a>(&'a Value);

impl EncodeMetric for Point<'_> {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::MetricEncoder,
    ) -> Result<(), std::fmt::Error> {
        match self.0 {
            Value::Counter(v) => encoder.encode_counter::<NoLabelSet, _, u64>(v, None),
            Value::Gauge(v) => encoder.encode_gauge(v),
            Value::CounterF(v) => encoder.encode_counter::<NoLabelSet, _, u64>(v, None),
            Value::Histogram(h) => {
                // Per-bucket counts; the encoder adds them up (`f64::MAX` is `+Inf`).
                let buckets: Vec<(f64, u64)> = BUCKETS
                    .iter()
                    .copied()
                    .chain([f64::MAX])
                    .zip(h.counts)
                    .collect();
                encoder.encode_histogram::<NoLabelSet>(h.sum, h.count, &buckets, None)
            }
            // Info samples carry their labels themselves (`Collector::encode`).
            Value::Info => Ok(()),
        }
    }

    fn metric_type(&self) -> MetricType {
        match self.0 {
            Value::Counter(_) | Value::CounterF(_) => MetricType::Counter,
            Value::Gauge(_) => MetricType::Gauge,
            Value::Histogram(_) => MetricType::Histogram,
            Value::Info => MetricType::Info,
        }
    }
}

impl Collector for Snapshot {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for (name, help, kind, points) in &self.families {
            let mut family = encoder.encode_descriptor(name, help, None, *kind)?;
            match points.as_slice() {
                [(labels, Value::Info)] => {
                    let labels: Vec<(&str, &str)> =
                        labels.iter().map(|(k, v)| (*k, v.as_str())).collect();
                    family.encode_info(&labels)?;
                }
                [(labels, value)] if labels.is_empty() => Point(value).encode(family)?,
                _ => {
                    for (labels, value) in points {
                        let labels: Vec<(&str, &str)> =
                            labels.iter().map(|(k, v)| (*k, v.as_str())).collect();
                        Point(value).encode(family.encode_family(&labels)?)?;
                    }
                }
            }
        }
        Ok(())
    }
}

/// Per kind: staleness, the age of what was heard last, and the watch's failure counts.
fn watch_metrics(f: &mut Snapshot, watch: &WatchHealth) {
    let now = std::time::Instant::now();
    let all = watch.all();
    let per_kind = |v: &dyn Fn(&super::KindHealth) -> Value| -> Vec<(Labels, Value)> {
        all.iter()
            .map(|(k, h)| (vec![("kind", k.name().to_string())], v(h)))
            .collect()
    };
    f.family(
        "ordnet_watch_stale_seconds",
        "For how long the view of this kind may have been behind the API server (0: in step); the last programmed state is enforced meanwhile.",
        MetricType::Gauge,
        per_kind(&|h| Value::Gauge(h.stale_for(now).map_or(0.0, |d| d.as_secs_f64()))),
    );
    f.family(
        "ordnet_watch_last_heard_seconds",
        "Age of the last list page, event or bookmark received for this kind.",
        MetricType::Gauge,
        per_kind(&|h| {
            Value::Gauge(
                h.last_heard
                    .map_or(f64::NAN, |t| now.duration_since(t).as_secs_f64()),
            )
        }),
    );
    f.family(
        "ordnet_watch_errors",
        "Failed list and watch requests (retried after a bounded backoff).",
        MetricType::Counter,
        per_kind(&|h| Value::Counter(h.errors)),
    );
    f.family(
        "ordnet_watch_reconnects",
        "Watches started again after a failure.",
        MetricType::Counter,
        per_kind(&|h| Value::Counter(h.reconnects)),
    );
    f.family(
        "ordnet_watch_silent",
        "Watches taken for dead after hearing nothing (no event, no bookmark) past their timeout.",
        MetricType::Counter,
        per_kind(&|h| Value::Counter(h.silent)),
    );
    f.family(
        "ordnet_watch_relists",
        "Lists after the first one (the resource version was gone: 410).",
        MetricType::Counter,
        per_kind(&|h| Value::Counter(h.relists)),
    );
}

/// The standard process metrics, from `/proc/self` (Linux).
fn process_metrics(f: &mut Snapshot) {
    // SAFETY: a plain query.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    if let Ok(stat) = std::fs::read_to_string("/proc/self/stat") {
        // The fields after the command (which may contain spaces) in parentheses.
        let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let field = |n: usize| -> f64 {
            fields
                .get(n - 3)
                .and_then(|v| v.parse().ok())
                .unwrap_or(0.0)
        };
        f.counter_f(
            "process_cpu_seconds",
            "User and system CPU time spent, seconds.",
            (field(14) + field(15)) / ticks,
        );
        f.gauge(
            "process_virtual_memory_bytes",
            "Virtual memory size, bytes.",
            field(23),
        );
        let boot = std::fs::read_to_string("/proc/stat")
            .ok()
            .and_then(|s| {
                s.lines().find_map(|l| {
                    l.strip_prefix("btime ")
                        .and_then(|v| v.trim().parse::<f64>().ok())
                })
            })
            .unwrap_or(0.0);
        f.gauge(
            "process_start_time_seconds",
            "Start time of the process since the Unix epoch, seconds.",
            boot + field(22) / ticks,
        );
    }
    if let Some(resident) = super::heap::resident_bytes() {
        f.gauge(
            "process_resident_memory_bytes",
            "Resident memory size, bytes.",
            resident as f64,
        );
    }
    if let Ok(fds) = std::fs::read_dir("/proc/self/fd") {
        f.gauge(
            "process_open_fds",
            "Open file descriptors.",
            fds.count() as f64,
        );
    }
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: a valid rlimit to fill.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0 {
        f.gauge(
            "process_max_fds",
            "Maximum number of open file descriptors.",
            limit.rlim_cur as f64,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exposition_is_openmetrics_with_cumulative_buckets_build_info_and_process_metrics() {
        let m = Metrics::default();
        m.change_latency_seconds.observe(0.0003);
        m.change_latency_seconds.observe(0.02);
        m.change_latency_seconds.observe(100.0);
        m.batches.inc();
        let out = m.render(true, 0, &WatchHealth::default());
        for want in [
            "ordnet_change_latency_seconds_bucket{le=\"0.0001\"} 0\n",
            "ordnet_change_latency_seconds_bucket{le=\"0.0005\"} 1\n",
            "ordnet_change_latency_seconds_bucket{le=\"0.025\"} 2\n",
            "ordnet_change_latency_seconds_bucket{le=\"10.0\"} 2\n",
            "ordnet_change_latency_seconds_bucket{le=\"+Inf\"} 3\n",
            "ordnet_change_latency_seconds_count 3\n",
            "ordnet_update_batches_total 1\n",
            "# TYPE ordnet_update_batches counter\n",
            "ordnet_ready 1.0\n",
            "ordnet_build_info{version=\"",
            "ordnet_watch_stale_seconds{kind=\"Pod\"} 0.0\n",
            "process_resident_memory_bytes ",
            "process_cpu_seconds_total ",
            "process_open_fds ",
        ] {
            assert!(out.contains(want), "{want:?} missing from\n{out}");
        }
        assert!(out.ends_with("# EOF\n"), "{out}");
    }
}
