//! Scale benchmark (issue 13; ignored by default, run in release):
//!
//! ```text
//! cargo test --release -p ordnet --test scale_bench -- --ignored --nocapture
//! ORDNET_SCALE=10000:1000,50000:5000 cargo test --release -p ordnet --test scale_bench -- --ignored --nocapture
//! ```
//!
//! The `ordnet agent` binary (`--datapath none`, a process of its own, so its memory is its
//! own; with node-local identity classes as by default, `ORDNET_CLASSES=0` without;
//! `ORDNET_SCALE_DATAPATH=bpf`, as root: the bpf datapath, writing real kernel maps pinned under
//! a directory of the run's own, removed at the end; no interface is attached) against
//! the fake API server filled with a generated cluster
//! ([`ordnet_testsuite::scale`]: 100 pods per node, 20 per namespace, realistic pod objects,
//! half NetworkPolicies and half ordered, mixed selectors). Per cluster size (pods:policies,
//! default 2k, 10k and 50k pods at 1 policy per 10 and per 2 pods) it prints the time from start
//! to ready, the agent's resident memory once ready, right after the changes, once quiet after
//! them (it gives back what a burst left freed a second after its last change) and its peak
//! (`VmRSS`, `VmHWM`), KiB per cluster pod (once quiet), and p50/p99/max of change → programmed
//! (from the write to the API server until the agent has applied the batch: its debug API's
//! `/v1/batches` answers then, and the engine's and the datapath's share are read from its
//! `/metrics` after) for local and remote pod relabels, namespace relabels, NetworkPolicy edits
//! and OrderedNetworkPolicy edits (200 changes per kind, `ORDNET_SCALE_CHANGES` to change it:
//! p99 is then the third slowest, and the slowest is printed as max; with 40, as before
//! 2026-11-29, p99 was the slowest; back to back, `ORDNET_SCALE_PAUSE_MS=N` for a pause before
//! each), the first change of each kind (the very first after ready pays for the pages the
//! agent gave back after its initial sync), and what the three slowest took in the engine, in
//! the datapath, before the agent received them and in its batching; at the end the growth from
//! 10k to 50k pods and the marginal memory per pod. Prints numbers, asserts only that the agent
//! gets ready and applies every change.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ordnet_testsuite::fakeapi::FakeApi;
use ordnet_testsuite::scale::{self, Shape};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// How long after the changes the agent's memory is read again: it gives back what they left
/// freed once it has programmed nothing for a second (`agent/heap.rs`), which takes it up to
/// ~15 ms at 50k pods.
const QUIET: Duration = Duration::from_secs(2);

/// `ORDNET_SCALE_PAUSE_MS=N`: a pause of N ms before each change (none by default: back to
/// back).
fn pause_before_each_change() -> Duration {
    match std::env::var("ORDNET_SCALE_PAUSE_MS") {
        Ok(v) => Duration::from_millis(
            v.trim()
                .parse()
                .expect("ORDNET_SCALE_PAUSE_MS: milliseconds"),
        ),
        Err(_) => Duration::ZERO,
    }
}

/// Changes of each kind, interleaved (`ORDNET_SCALE_CHANGES`, default 200): enough for p99 to be
/// a percentile and not the slowest change (the nearest rank: with 200, the third slowest).
fn changes_per_kind() -> usize {
    std::env::var("ORDNET_SCALE_CHANGES")
        .ok()
        .map(|v| match v.trim().parse() {
            Ok(n) if n > 0 => n,
            _ => panic!("ORDNET_SCALE_CHANGES: a number of changes per kind, at least 1"),
        })
        .unwrap_or(200)
}

fn shapes() -> Vec<Shape> {
    let text = std::env::var("ORDNET_SCALE").unwrap_or_else(|_| {
        "2000:200,2000:1000,10000:1000,10000:5000,50000:5000,50000:25000".into()
    });
    text.split(',')
        .map(|s| {
            let (p, q) = s.split_once(':').expect("ORDNET_SCALE: PODS:POLICIES,...");
            Shape {
                pods: p.trim().parse().expect("pods"),
                policies: q.trim().parse().expect("policies"),
            }
        })
        .collect()
}

/// `VmRSS` and `VmHWM` of a process, in KiB.
fn memory_kib(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

async fn get(addr: &str, path: &str) -> Option<(u16, String)> {
    let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).await.ok()?;
    let code = out.split_whitespace().nth(1)?.parse().ok()?;
    let body = out.split_once("\r\n\r\n").map(|(_, b)| b.to_string())?;
    Some((code, body))
}

/// The agent's counters the benchmark reads from its `/metrics`: batches applied, and the sums
/// of the engine's time, of the engine's plus the datapath's time, and of the agent's own
/// latency (from the first watch event of a batch received to the datapath updated) over them.
#[derive(Clone, Copy)]
struct Counters {
    batches: u64,
    compile: f64,
    apply: f64,
    in_agent: f64,
}

async fn counters(addr: &str) -> Counters {
    let (_, body) = get(addr, "/metrics").await.expect("agent /metrics");
    let value = |name: &str| {
        body.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or_else(|| panic!("{name} missing from the agent's /metrics"))
    };
    Counters {
        batches: value("ordnet_update_batches_total") as u64,
        compile: value("ordnet_compile_duration_seconds_sum"),
        apply: value("ordnet_apply_duration_seconds_sum"),
        in_agent: value("ordnet_change_latency_seconds_sum"),
    }
}

fn free_addr() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().to_string()
}

struct Agent {
    child: Child,
    addr: String,
    log: PathBuf,
    /// The bpf datapath's pin directory ([`bpf_datapath`]).
    pins: Option<PathBuf>,
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(pins) = &self.pins {
            let _ = std::fs::remove_dir_all(pins);
        }
    }
}

/// `ORDNET_SCALE_DATAPATH=bpf`: the agent writes real kernel maps (root).
fn bpf_datapath() -> bool {
    std::env::var("ORDNET_SCALE_DATAPATH").is_ok_and(|v| v == "bpf")
}

/// `ORDNET_CLASSES=0`: the agent runs without node-local identity classes.
fn classes_off() -> bool {
    std::env::var("ORDNET_CLASSES").is_ok_and(|v| v == "0")
}

fn spawn_agent(api: &FakeApi, tag: &str) -> Agent {
    let dir = std::env::temp_dir();
    let kubeconfig = dir.join(format!(
        "ordnet-scale-{}-{tag}.kubeconfig",
        std::process::id()
    ));
    std::fs::write(&kubeconfig, api.kubeconfig_yaml()).unwrap();
    let log = dir.join(format!("ordnet-scale-{}-{tag}.log", std::process::id()));
    let addr = free_addr();
    let pins = bpf_datapath().then(|| {
        PathBuf::from(format!(
            "/sys/fs/bpf/ordnet-scale-{}-{tag}",
            std::process::id()
        ))
    });
    let mut command = Command::new(env!("CARGO_BIN_EXE_ordnet"));
    command.args(["agent", "--node", &scale::node_name(0)]);
    match &pins {
        // Room for the busiest generated node's keys (10k pods / 5k policies: ~380,000 class
        // keys), so that no endpoint is denied for lack of room.
        Some(pins) => command
            .args(["--datapath", "bpf", "--policy-map-entries", "1048576"])
            .env("ORDNET_PIN_DIR", pins),
        None => command.args(["--datapath", "none"]),
    };
    let child = command
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .args(["--debug-addr", &addr])
        .args(["--metrics-addr", "none", "--cni-socket", "none"])
        // `ORDNET_CLASSES=0`: without node-local identity classes (on by default, as in the
        // bpf datapath, which keeps the same userspace state).
        .args([
            "--policy-classes",
            if classes_off() { "false" } else { "true" },
        ])
        .env("POD_NAMESPACE", "kube-system")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("ordnet agent");
    Agent {
        child,
        addr,
        log,
        pins,
    }
}

struct Run {
    shape: Shape,
    ready: Duration,
    /// Resident memory once ready (before the changes).
    ready_rss_kib: u64,
    /// Resident memory right after the changes.
    burst_rss_kib: u64,
    /// Resident memory [`QUIET`] after the changes (what the agent holds between changes).
    rss_kib: u64,
    /// The peak.
    peak_kib: u64,
    /// Per change kind, in the order they were made.
    latencies: Vec<Vec<Latency>>,
}

/// One change → programmed: in all, and of which the agent's engine and its datapath
/// programming, and how much of it passed in the agent (from the first event of the batch
/// received: its batching, the engine and the datapath; before that: the API server, the
/// watch and decoding).
#[derive(Clone, Copy)]
struct Latency {
    /// The change's number within its kind (`scale::change`'s `n`).
    n: usize,
    total: Duration,
    engine: Duration,
    datapath: Duration,
    in_agent: Duration,
}

/// The nearest-rank percentile: the smallest value with at least `p` of them at or below it.
fn pct(sorted: &[Duration], p: f64) -> Duration {
    let rank = (sorted.len() as f64 * p).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// As the status writer, the agent first writes every ordered policy's status (thousands of
/// writes, their echoes applied as batches): the changes are timed once it has written nothing
/// for two seconds, as a Lease holder between bursts would have.
async fn wait_for_first_statuses(api: &FakeApi) {
    let waited = Instant::now();
    let mut last = (api.resource_version(), Instant::now());
    while last.1.elapsed() < Duration::from_secs(2) && waited.elapsed() < Duration::from_secs(300) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = api.resource_version();
        if now != last.0 {
            last = (now, Instant::now());
        }
    }
    eprintln!(
        "  the status writer's first statuses written within {:.1} s",
        waited.elapsed().as_secs_f64()
    );
}

/// Makes the `n`-th change of kind `k` and times it until the agent has programmed it, with the
/// engine's and the datapath's share from the agent's counters.
async fn time_change(api: &FakeApi, shape: &Shape, agent: &Agent, k: usize, n: usize) -> Latency {
    let before = counters(&agent.addr).await;
    // Timed from the write: reading the object and changing it is the benchmark's work (for a
    // pod at 10k pods 0.1-0.3 ms: it generates the pod again to find its name).
    let next = scale::next_change(api, shape, k, n);
    let t0 = Instant::now();
    let _ = api.update(next).expect("the change is written");
    // Answered when the next batch is programmed: the agent is not polled while it works
    // (polling `/metrics` every 0.5 ms loaded both cores meanwhile: docs/agent.md, "Not done
    // yet", 2026-11-29).
    let waited = format!("/v1/batches?after={}&timeout=30", before.batches);
    get(&agent.addr, &waited).await.expect("agent /v1/batches");
    let total = t0.elapsed();
    let now = counters(&agent.addr).await;
    assert!(
        now.batches > before.batches,
        "{} {n} not applied within 30 s; agent log: {}",
        scale::CHANGE_KINDS[k],
        agent.log.display()
    );
    // (Never below zero: with `ORDNET_SCALE_STATUS_WRITER` another batch, a status write's echo,
    // may be half-way through its sums when they are read.)
    let secs = |s: f64| Duration::from_secs_f64(s.max(0.0));
    Latency {
        n,
        total,
        engine: secs(now.compile - before.compile),
        datapath: secs((now.apply - now.compile) - (before.apply - before.compile)),
        in_agent: secs(now.in_agent - before.in_agent),
    }
}

async fn run(shape: Shape) -> Run {
    let api = FakeApi::start().await.unwrap();
    api.set_bookmark_interval(Duration::from_secs(30));
    let loading = Instant::now();
    for o in shape.objects() {
        api.create(o).unwrap();
    }
    // Another agent holds the status Lease for the whole run, so no status writes (and their
    // watch echoes) mix into the timed batches. `ORDNET_SCALE_STATUS_WRITER=1`: the agent under
    // test takes it, to see what the status writer's analysis costs its changes (an echo's batch
    // may then end a change's wait early: its latencies are a lower bound, their outliers not).
    if std::env::var_os("ORDNET_SCALE_STATUS_WRITER").is_none() {
        api.hold_lease(
            "kube-system",
            ordnet::agent::status::LEASE_NAME,
            "elsewhere",
        )
        .unwrap();
    }
    eprintln!(
        "  {} pods / {} policies: {} objects loaded in {:.1?}",
        shape.pods,
        shape.policies,
        api.resource_version(),
        loading.elapsed()
    );
    let tag = format!("{}-{}", shape.pods, shape.policies);
    let agent = spawn_agent(&api, &tag);
    let pid = agent.child.id();
    let started = Instant::now();
    loop {
        if let Some((200, _)) = get(&agent.addr, "/readyz").await {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(600),
            "the agent was not ready within 600 s; its log: {}",
            agent.log.display()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let ready = started.elapsed();
    // Of which the initial build (engine and datapath programming), from the agent's histogram.
    let (_, metrics) = get(&agent.addr, "/metrics").await.expect("agent /metrics");
    let build = metrics
        .lines()
        .find_map(|l| l.strip_prefix("ordnet_apply_duration_seconds_sum "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap_or(f64::NAN);
    eprintln!(
        "  ready after {:.2} s, of which the initial build and programming {build:.2} s",
        ready.as_secs_f64()
    );
    if std::env::var_os("ORDNET_SCALE_STATUS_WRITER").is_some() {
        wait_for_first_statuses(&api).await;
    }
    // Let the allocator settle after the initial build (freed pages, the watch buffers).
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (ready_rss_kib, _) = memory_kib(pid);
    let mut latencies = vec![Vec::new(); scale::CHANGE_KINDS.len()];
    let pause = pause_before_each_change();
    for n in 0..changes_per_kind() {
        for (k, l) in latencies.iter_mut().enumerate() {
            if !pause.is_zero() {
                tokio::time::sleep(pause).await;
            }
            l.push(time_change(&api, &shape, &agent, k, n).await);
        }
    }
    let (burst_rss_kib, _) = memory_kib(pid);
    tokio::time::sleep(QUIET).await;
    let (rss_kib, peak_kib) = memory_kib(pid);
    drop(agent);
    Run {
        shape,
        ready,
        ready_rss_kib,
        burst_rss_kib,
        rss_kib,
        peak_kib,
        latencies,
    }
}

fn report(r: &Run) {
    let s = r.shape;
    println!(
        "{:>6} pods {:>6} policies: ready {:>6.2} s, RSS {:>6.1} MiB once ready, {:>6.1} MiB right after the changes and {:>6.1} MiB once quiet, peak {:>6.1} MiB, {:>5.1} KiB per cluster pod",
        s.pods,
        s.policies,
        r.ready.as_secs_f64(),
        r.ready_rss_kib as f64 / 1024.0,
        r.burst_rss_kib as f64 / 1024.0,
        r.rss_kib as f64 / 1024.0,
        r.peak_kib as f64 / 1024.0,
        r.rss_kib as f64 / s.pods as f64,
    );
    for (k, l) in r.latencies.iter().enumerate() {
        let first = l[0].total;
        let mut l = l.clone();
        l.sort_by_key(|l| l.total);
        let total: Vec<Duration> = l.iter().map(|l| l.total).collect();
        let mut engine: Vec<Duration> = l.iter().map(|l| l.engine).collect();
        let mut datapath: Vec<Duration> = l.iter().map(|l| l.datapath).collect();
        engine.sort();
        datapath.sort();
        // The make-up of the three slowest (p99 is the third): engine + datapath, the time
        // before the agent received the change, and the agent's own time besides the two.
        let tail: Vec<String> = l
            .iter()
            .rev()
            .take(3)
            .map(|c| {
                format!(
                    "{:.2} (#{}: engine {:.2} + datapath {:.2}, received after {:.2}, batched {:.2})",
                    ms(c.total),
                    c.n,
                    ms(c.engine),
                    ms(c.datapath),
                    ms(c.total.saturating_sub(c.in_agent)),
                    ms(c.in_agent.saturating_sub(c.engine + c.datapath)),
                )
            })
            .collect();
        println!(
            "      {:<26} p50 {:>7.2} ms  p99 {:>7.2} ms  max {:>7.2} ms  first {:>7.2} ms  ({} changes); engine p50 {:.2} ms, datapath p50 {:.2} ms; the slowest (ms): {}",
            scale::CHANGE_KINDS[k],
            ms(pct(&total, 0.5)),
            ms(pct(&total, 0.99)),
            ms(l.last().expect("not empty").total),
            ms(first),
            l.len(),
            ms(pct(&engine, 0.5)),
            ms(pct(&datapath, 0.5)),
            tail.join(", "),
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: run in release with --ignored --nocapture"]
async fn agent_at_scale() {
    let mut runs: Vec<Run> = Vec::new();
    for shape in shapes() {
        let r = run(shape).await;
        report(&r);
        runs.push(r);
    }
    println!();
    for a in &runs {
        for b in runs.iter().filter(|b| {
            b.shape.pods > a.shape.pods
                && b.shape.policies * a.shape.pods == a.shape.policies * b.shape.pods
        }) {
            let growth = b.rss_kib as f64 / a.rss_kib as f64;
            let marginal =
                (b.rss_kib as f64 - a.rss_kib as f64) / (b.shape.pods - a.shape.pods) as f64;
            println!(
                "{}→{} pods at 1 policy per {} pods: RSS ×{growth:.2} for ×{:.1} pods; marginal {marginal:.1} KiB per pod",
                a.shape.pods,
                b.shape.pods,
                a.shape.pods / a.shape.policies.max(1),
                b.shape.pods as f64 / a.shape.pods as f64,
            );
        }
    }
}

/// Counts the live heap bytes of this process (and their peak), for [`memory_breakdown`] and
/// the fill benchmarks. [`engine_changes`], which times the engine's threads, switches it off
/// for its process ([`stop_counting`]): two threads updating the two shared counters on every
/// allocation made two threads look 10-30 % slower than one.
struct Counting;

static LIVE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
static PEAK: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
static COUNT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Stops counting allocations in this process, for good: a timing benchmark's threads then
/// allocate as the agent's do. A later [`live`] or [`peak`] panics.
fn stop_counting() {
    COUNT.store(false, std::sync::atomic::Ordering::Relaxed);
}

fn counting() -> bool {
    COUNT.load(std::sync::atomic::Ordering::Relaxed)
}

unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        use std::sync::atomic::Ordering::Relaxed;
        let p = unsafe { std::alloc::System.alloc(layout) };
        if !p.is_null() && counting() {
            let now = LIVE.fetch_add(layout.size(), Relaxed) + layout.size();
            PEAK.fetch_max(now, Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        unsafe { std::alloc::System.dealloc(ptr, layout) };
        if counting() {
            LIVE.fetch_sub(layout.size(), std::sync::atomic::Ordering::Relaxed);
        }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new: usize) -> *mut u8 {
        use std::sync::atomic::Ordering::Relaxed;
        let p = unsafe { std::alloc::System.realloc(ptr, layout, new) };
        if !p.is_null() && counting() {
            if new >= layout.size() {
                let now = LIVE.fetch_add(new - layout.size(), Relaxed) + new - layout.size();
                PEAK.fetch_max(now, Relaxed);
            } else {
                LIVE.fetch_sub(layout.size() - new, Relaxed);
            }
        }
        p
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

fn live() -> usize {
    assert!(
        counting(),
        "allocations are not counted in this process (a timing benchmark ran in it): run the \
         memory benchmarks on their own"
    );
    LIVE.load(std::sync::atomic::Ordering::Relaxed)
}

/// Resets the peak to the current live bytes; returns the live bytes.
fn reset_peak() -> usize {
    let now = live();
    PEAK.store(now, std::sync::atomic::Ordering::Relaxed);
    now
}

fn peak() -> usize {
    assert!(counting(), "allocations are not counted in this process");
    PEAK.load(std::sync::atomic::Ordering::Relaxed)
}

/// Where the agent's memory goes, per component, measured with a counting allocator by building
/// each component the way the agent does (in this process, from the generated objects) and by
/// dropping the engine one part at a time ([`ordnet_engine::Engine::dismantle`]).
#[test]
#[ignore = "benchmark: run in release with --ignored --nocapture"]
fn memory_breakdown() {
    let text = std::env::var("ORDNET_SCALE")
        .unwrap_or_else(|_| "2000:200,10000:1000,50000:5000,10000:5000".into());
    for s in text.split(',') {
        let (p, q) = s.split_once(':').expect("PODS:POLICIES");
        let shape = Shape {
            pods: p.parse().unwrap(),
            policies: q.parse().unwrap(),
        };
        let mut parts: Vec<(String, usize)> = Vec::new();
        println!(
            "(an Object is {} bytes inline, a ReadPod {})",
            std::mem::size_of::<ordnet_engine::Object>(),
            std::mem::size_of::<ordnet_engine::ReadPod>()
        );

        // The agent's view: per object its key and resourceVersion (the applier's view keeps no
        // object); the objects themselves, slimmed as the watchers deliver them, wait for the
        // initial build (transient) and are then dropped.
        let base = reset_peak();
        let mut initial = Initial::default();
        let mut keys = Vec::new();
        for v in shape.objects() {
            let o = typed(v).slimmed();
            let (ns, name) = o.key();
            keys.push((o.kind(), ns, name, o.meta().resource_version.clone()));
            push(&mut initial, o);
        }
        let copy = live() - base;
        let view: std::collections::BTreeMap<_, _> = keys
            .into_iter()
            .map(|(kind, ns, name, rv)| ((kind, ns, name), rv))
            .collect();
        let before = reset_peak();
        let engine = initial.build(scale::node_name(0));
        let build_peak = peak() - before;

        print_mapstates(&engine);

        let (dp, mirror, program_peak) = program_mirror(&engine);
        // Not in it: the record of every programmed key (only the tests keep one).
        let before = live();
        let mut record = ordnet::agent::datapath::Record::with_keys();
        record.program_full(&engine);
        let record_bytes = live() - before;
        drop(record);

        // The shadowed-rule analysis of the status writer: its peak, transient.
        let before = reset_peak();
        let started = Instant::now();
        let inputs = engine.shadow_inputs();
        let inputs_took = started.elapsed();
        let shadowed = inputs.analyze();
        let shadow_took = started.elapsed();
        let shadow_peak = peak() - before;
        drop(shadowed);

        let mut last = live();
        engine.dismantle(|part| {
            let now = live();
            parts.push((format!("engine: {part}"), last.saturating_sub(now)));
            last = now;
        });
        let label = if classes_off() {
            "datapath tables (none)"
        } else {
            "datapath tables (none, classes)"
        };
        parts.push((label.into(), mirror));
        let before = live();
        drop(view);
        parts.insert(0, ("view (key, resourceVersion)".into(), before - live()));
        println!(
            "  (not kept by the agent: a record of every programmed key, as the tests keep, {:.1} MiB)",
            record_bytes as f64 / 1048576.0
        );
        let total: usize = parts.iter().map(|(_, b)| b).sum();
        let engine_bytes: usize = parts
            .iter()
            .filter(|(n, _)| n.starts_with("engine"))
            .map(|(_, b)| b)
            .sum();
        println!(
            "{} pods, {} policies: {:.1} MiB kept ({:.1} KiB per cluster pod); transient: objects waiting for the initial build {:.1} MiB, build peak {:.1} MiB above them, datapath programming peak {:.1} MiB above what it keeps, shadow analysis peak {:.1} MiB in {:.0} ms (of which {:.0} ms copying its inputs under the engine's lock); engine {:.1} MiB",
            shape.pods,
            shape.policies,
            total as f64 / 1048576.0,
            total as f64 / 1024.0 / shape.pods as f64,
            copy as f64 / 1048576.0,
            build_peak as f64 / 1048576.0,
            program_peak as f64 / 1048576.0,
            shadow_peak as f64 / 1048576.0,
            shadow_took.as_secs_f64() * 1e3,
            inputs_took.as_secs_f64() * 1e3,
            engine_bytes as f64 / 1048576.0,
        );
        for (name, b) in &parts {
            println!(
                "    {name:<32} {:>8.1} MiB {:>7.2} KiB/pod",
                *b as f64 / 1048576.0,
                *b as f64 / 1024.0 / shape.pods as f64
            );
        }
        drop(dp);
    }
}

/// What the MapStates of `engine` hold: distinct states, their keys, the keys every endpoint
/// gets (for [`memory_breakdown`]).
fn print_mapstates(engine: &ordnet_engine::Engine) {
    use ordnet_mapstate::Direction;
    let mut distinct = std::collections::HashSet::new();
    let (mut keys, mut per_ep, mut entries, mut covered) = (0usize, 0usize, 0usize, 0usize);
    for ep in engine.endpoints() {
        for dir in [Direction::Ingress, Direction::Egress] {
            let ms = &engine.policy(ep, dir).mapstate;
            per_ep += ms.len();
            if distinct.insert(ms as *const _ as usize) {
                keys += ms.len();
                entries += ms.policy_entry_count();
                covered += ms.covered().len();
            }
        }
    }
    println!(
        "  {} endpoints, {} identities, {} selectors; {} distinct MapStates with {keys} keys, {covered} covered notes and {entries} policy entries; {per_ep} keys over every endpoint",
        engine.endpoints().len(),
        engine.identities().count(),
        engine.selector_count(),
        distinct.len(),
    );
}

/// The datapath mirror as the agent keeps it (`--datapath none`: what was programmed, and the
/// in-memory tables; with classes, as by default, the translation and the class-level tables
/// too: what the bpf datapath keeps in userspace), programmed from `engine`: the datapath, the
/// bytes it keeps and its programming's peak above them (for [`memory_breakdown`]).
fn program_mirror(engine: &ordnet_engine::Engine) -> (ordnet::agent::NoneDatapath, usize, usize) {
    use ordnet::agent::{Enforcer, NoneDatapath};
    let before = reset_peak();
    let mut dp = if classes_off() {
        NoneDatapath::default()
    } else {
        NoneDatapath::with_classes()
    };
    dp.program_full(engine).unwrap();
    let kept = live() - before;
    (dp, kept, peak() - before - kept)
}

fn typed(v: serde_json::Value) -> ordnet_engine::Object {
    use ordnet_engine::Object;
    let kind = v["kind"].as_str().unwrap_or_default().to_string();
    fn f<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> T {
        serde_json::from_value(v).expect("generated object")
    }
    match kind.as_str() {
        "Namespace" => Object::Namespace(f(v)),
        "Pod" => Object::Pod(f(v)),
        "Service" => Object::Service(f(v)),
        "NetworkPolicy" => Object::NetworkPolicy(f(v)),
        "OrderedNetworkPolicy" => Object::OrderedNetworkPolicy(f(v)),
        _ => Object::ClusterOrderedNetworkPolicy(f(v)),
    }
}

/// The objects of an initial build as the agent hands them to the engine: pods already read.
#[derive(Default)]
struct Initial {
    objects: ordnet_crds::ClusterObjects,
    read_pods: Vec<ordnet_engine::ReadPod>,
}

impl Initial {
    fn build(self, node: String) -> ordnet_engine::Engine {
        ordnet_engine::Engine::build_with_read_pods(
            &self.objects,
            self.read_pods,
            &ordnet_engine::BuildOptions {
                node: Some(node),
                ..Default::default()
            },
        )
    }
}

fn push(initial: &mut Initial, o: ordnet_engine::Object) {
    let objects = &mut initial.objects;
    use ordnet_engine::Object;
    fn l<T>(object: T) -> ordnet_crds::Loaded<T> {
        ordnet_crds::Loaded {
            object,
            source: None,
        }
    }
    match o {
        Object::Namespace(o) => objects.namespaces.push(l(o)),
        Object::Pod(o) => objects.pods.push(l(*o)),
        Object::ReadPod(o) => initial.read_pods.push(*o),
        Object::Service(o) => objects.services.push(l(*o)),
        Object::NetworkPolicy(o) => objects.network_policies.push(l(o)),
        Object::OrderedNetworkPolicy(o) => objects.ordered_policies.push(l(o)),
        Object::ClusterOrderedNetworkPolicy(o) => objects.cluster_ordered_policies.push(l(o)),
        Object::ClusterNetworkPolicy(o) => objects.cluster_network_policies.push(l(*o)),
        Object::Node(o) => objects.nodes.push(l(*o)),
    }
}

/// One change of [`engine_changes`]: the engine's and the datapath's time, and what the
/// datapath wrote (identity-level policy keys, rule sets installed into fresh slots and changed
/// in place, write batches).
#[derive(Clone, Copy)]
struct Change {
    /// The change's number within its kind (`scale::change`'s `n`).
    n: usize,
    engine: Duration,
    datapath: Duration,
    keys: u32,
    installed: u32,
    updated: u32,
    batches: u32,
    /// The class translation's work for this change (splits, merges, joins, records
    /// rewritten, class keys written), when the datapath keeps classes.
    classes: Option<[usize; 5]>,
}

/// The engine alone (no agent; the fake API server only writes the changes): built for node 0
/// from the generated cluster, then the changes of [`agent_at_scale`] (the same objects, in the
/// same order) applied one at a time through [`ordnet_engine::Engine::apply`], each timed (what
/// the agent's latency is made of, and what a profiler should look at: `perf record` on this
/// test). Back to back by default; `ORDNET_SCALE_PAUSE_MS=N` sleeps N ms before each change, as
/// the agent idles between changes (which the next change pays for on a VM: see
/// docs/agent.md, "Not done yet").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: run in release with --ignored --nocapture"]
async fn engine_changes() {
    use ordnet::agent::{Enforcer, NoneDatapath};
    use ordnet_engine::ObjectChange;
    // Timed on several threads (the engine's jobs): allocations as in the agent, uncounted.
    stop_counting();
    // `ORDNET_CHANGE_KINDS=4` (indices into `scale::CHANGE_KINDS`, comma-separated): only those
    // kinds, to profile one.
    let kinds: Vec<usize> = match std::env::var("ORDNET_CHANGE_KINDS") {
        Ok(v) => v
            .split(',')
            .map(|k| k.trim().parse().expect("ORDNET_CHANGE_KINDS: indices"))
            .collect(),
        Err(_) => (0..scale::CHANGE_KINDS.len()).collect(),
    };
    let pause = pause_before_each_change();
    for shape in shapes() {
        let api = FakeApi::start().await.unwrap();
        let mut initial = Initial::default();
        for v in shape.objects() {
            let written = api.create(v).unwrap();
            push(&mut initial, typed(written).slimmed());
        }
        let started = Instant::now();
        let mut engine = initial.build(scale::node_name(0));
        println!(
            "{} pods {} policies: built in {:.2} s",
            shape.pods,
            shape.policies,
            started.elapsed().as_secs_f64()
        );
        // The datapath keeps node-local identity classes as the agent does (the translation's
        // time is in the datapath's; its splits, merges, joins, records rewritten and class
        // keys written are printed per kind); `ORDNET_CLASSES=0`: without them.
        let classes = !classes_off();
        let mut dp = if classes {
            NoneDatapath::with_classes()
        } else {
            NoneDatapath::default()
        };
        dp.program_full(&engine).unwrap();
        let class_stats = |dp: &NoneDatapath| dp.classes().map(|c| c.classes.stats());
        let mut class_work = vec![[0usize; 5]; scale::CHANGE_KINDS.len()];
        // The agent benchmark's changes, in its order: per kind, the engine's and the
        // datapath's time (`--datapath none`: the same programming as bpf).
        let mut times = vec![Vec::new(); scale::CHANGE_KINDS.len()];
        for n in 0..changes_per_kind() {
            for (k, t) in times.iter_mut().enumerate() {
                if !kinds.contains(&k) {
                    continue;
                }
                let written = scale::change(&api, &shape, k, n);
                let change = ObjectChange::Upsert(typed(written).slimmed());
                let before = class_stats(&dp);
                let written = dp.node_program().stats().writes;
                if !pause.is_zero() {
                    std::thread::sleep(pause);
                }
                let started = Instant::now();
                let d = engine.apply(change);
                let computed = started.elapsed();
                dp.apply(&engine, &[d]).unwrap();
                let programmed = started.elapsed() - computed;
                let now = dp.node_program().stats().writes;
                let work = before
                    .zip(class_stats(&dp))
                    .map(|(a, b)| class_work_between(a, b));
                t.push(Change {
                    n,
                    engine: computed,
                    datapath: programmed,
                    keys: now.policy_writes - written.policy_writes,
                    installed: now.rulesets_installed - written.rulesets_installed,
                    updated: now.rulesets_updated - written.rulesets_updated,
                    batches: now.batches - written.batches,
                    classes: work,
                });
                if let Some(w) = work {
                    for (sum, d) in class_work[k].iter_mut().zip(w) {
                        *sum += d;
                    }
                }
            }
        }
        for (k, t) in times.iter().enumerate() {
            if t.is_empty() {
                continue;
            }
            report_changes(scale::CHANGE_KINDS[k], t);
            if classes {
                let [splits, merges, joins, moved, keys] = class_work[k];
                println!(
                    "      classes over {} changes: {splits} splits, {merges} merges, {joins} joins, {moved} records rewritten, {keys} class keys written",
                    t.len()
                );
            }
        }
    }
}

/// Prints one kind's changes of [`engine_changes`]: the engine's and the datapath's times, their
/// sum (what the agent's change latency is made of, less the watch and the batching) and the
/// make-up of the three slowest by that sum (with classes, their class work too), and what the
/// datapath wrote.
fn report_changes(kind: &str, t: &[Change]) {
    let mut e: Vec<Duration> = t.iter().map(|t| t.engine).collect();
    let mut d: Vec<Duration> = t.iter().map(|t| t.datapath).collect();
    e.sort();
    d.sort();
    let mut keys: Vec<u32> = t.iter().map(|t| t.keys).collect();
    keys.sort_unstable();
    let mut batches: Vec<u32> = t.iter().map(|t| t.batches).collect();
    batches.sort_unstable();
    let slowest = t.iter().max_by_key(|t| t.datapath).expect("not empty");
    println!(
        "    {:<26} engine p50 {:>7.2} ms p99 {:>7.2} ms max {:>7.2} ms; datapath p50 {:>6.2} ms max {:>6.2} ms",
        kind,
        ms(pct(&e, 0.5)),
        ms(pct(&e, 0.99)),
        ms(*e.last().unwrap()),
        ms(pct(&d, 0.5)),
        ms(*d.last().unwrap()),
    );
    // What the datapath's time follows: the identity-level policy keys a change writes
    // (a rule set installed writes all of its keys).
    // Batches are one syscall each in the kernel writer (`KernelTables`).
    println!(
        "      policy keys written p50 {}, max {}; write batches p50 {}, max {}; the slowest datapath change wrote {} keys in {} batches, installed {} rule sets and changed {} in place",
        keys[keys.len() / 2],
        keys[keys.len() - 1],
        batches[batches.len() / 2],
        batches[batches.len() - 1],
        slowest.keys,
        slowest.batches,
        slowest.installed,
        slowest.updated,
    );
    let mut by_total: Vec<&Change> = t.iter().collect();
    by_total.sort_by_key(|c| c.engine + c.datapath);
    let total: Vec<Duration> = by_total.iter().map(|c| c.engine + c.datapath).collect();
    let tail: Vec<String> = by_total
        .iter()
        .rev()
        .take(3)
        .map(|c| {
            let classes = match c.classes {
                Some([splits, merges, joins, moved, keys]) => format!(
                    "; {splits} splits, {merges} merges, {joins} joins, {moved} records, {keys} class keys"
                ),
                None => String::new(),
            };
            format!(
                "#{}: {:.2} + {:.2} ms ({} keys, {} installed, {} in place{classes})",
                c.n,
                ms(c.engine),
                ms(c.datapath),
                c.keys,
                c.installed,
                c.updated
            )
        })
        .collect();
    println!(
        "      engine + datapath p50 {:.2} ms p99 {:.2} ms max {:.2} ms; the slowest: {}",
        ms(pct(&total, 0.5)),
        ms(pct(&total, 0.99)),
        ms(*total.last().expect("not empty")),
        tail.join(", ")
    );
}

/// What one node's datapath holds, and what it would hold with node-local identity classes
/// (issue 25): for a sample of nodes per shape (`ORDNET_FILL_NODES`, default 3: the first, the
/// middle and the last), the engine of that node programmed onto an in-memory datapath whose
/// policy map is not bounded (so every key the node needs is counted, none denied), then:
///
/// * rule sets and policy keys as written today (identity keys + `*` bookkeeping keys), and
///   their fill of the default maps;
/// * identity classes, three definitions: **per node** (identities whose keys are equal in
///   every rule set of the node share a class; the ipcache holds one class per address),
///   **per direction** (the same over the ingress rule sets and over the egress ones: two
///   classes per address), **per rule set** (the lower bound: identities with equal keys in
///   one rule set; the ipcache cannot hold it); for each, the classes and the keys written.
#[test]
#[ignore = "benchmark: run in release with --ignored --nocapture"]
fn datapath_fill() {
    use ordnet::agent::datapath::Programmer;
    use ordnet_datapath::{ControlPlane as _, DatapathConfig, MemDatapath};
    use std::collections::BTreeSet;

    let text = std::env::var("ORDNET_SCALE").unwrap_or_else(|_| "10000:1000,50000:5000".into());
    let samples: usize = std::env::var("ORDNET_FILL_NODES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    for s in text.split(',') {
        let (p, q) = s.split_once(':').expect("PODS:POLICIES");
        let shape = Shape {
            pods: p.parse().unwrap(),
            policies: q.parse().unwrap(),
        };
        let nodes = shape.nodes();
        let picked: BTreeSet<usize> = (0..samples)
            .map(|k| {
                if samples == 1 {
                    0
                } else {
                    k * (nodes - 1) / (samples - 1)
                }
            })
            .collect();
        let objects: Vec<ordnet_engine::Object> = shape
            .objects()
            .into_iter()
            .map(|v| typed(v).slimmed())
            .collect();
        println!(
            "{} pods, {} policies, {nodes} nodes; nodes sampled: {picked:?}",
            shape.pods, shape.policies
        );
        for node in picked {
            let mut initial = Initial::default();
            for o in &objects {
                push(&mut initial, o.clone());
            }
            // Unbounded: every key the node needs is counted, none denied.
            let config = DatapathConfig {
                policy_entries: u32::MAX,
                max_rulesets: 4096,
                ..DatapathConfig::default()
            };
            let started = Instant::now();
            let engine = initial.build(scale::node_name(node));
            let heap = live();
            let mut dp = MemDatapath::new(&config).keep_keys_in_store();
            let mut programmer = Programmer::default();
            programmer.program_full(&engine, &mut dp).unwrap();
            let took = started.elapsed();
            let plain_heap = live() - heap;
            print_node_fill(node, dp.control(), took);
            drop((dp, programmer));
            // The same programming with node-local identity classes kept beside it: what the
            // translation (ordnet_datapath::classes) would write, counted exactly.
            let started = Instant::now();
            let heap = live();
            let mut dp = MemDatapath::with_classes(&config).keep_keys_in_store();
            let mut programmer = Programmer::default();
            programmer.program_full(&engine, &mut dp).unwrap();
            let took = started.elapsed();
            // Released rule sets cleared and retired classes' keys deleted (both after the
            // grace period), as the agent's next operation would.
            std::thread::sleep(Duration::from_millis(50));
            dp.reclaim().unwrap();
            std::thread::sleep(Duration::from_millis(50));
            // The retired classes' keys (`ControlPlane::reclaim` clears below the identity
            // level too).
            dp.reclaim().unwrap();
            let classed = dp.classes().expect("kept");
            if let Err(e) = classed.classes.check() {
                panic!("node {node}: the classes are not exact: {e}");
            }
            print_class_fill(dp.classes().expect("kept"), took);
            // What the agent's datapath side holds (rule set store, tables, and with classes
            // the translation and the class-level tables too).
            println!(
                "    datapath heap: {:.1} MiB identity-level, {:.1} MiB with classes",
                plain_heap as f64 / 1048576.0,
                (live() - heap) as f64 / 1048576.0
            );
        }
    }
}

/// The class work between two stats: splits, merges, joins, records rewritten, class keys
/// written.
fn class_work_between(
    a: ordnet_datapath::classes::ClassStats,
    b: ordnet_datapath::classes::ClassStats,
) -> [usize; 5] {
    [
        b.splits - a.splits,
        b.merges - a.merges,
        b.joins - a.joins,
        b.moved - a.moved,
        b.key_writes - a.key_writes,
    ]
}

/// Prints the class-level tables of one node's programmed datapath (see [`datapath_fill`]).
fn print_class_fill(c: &ordnet_datapath::classes::Classed, took: Duration) {
    use ordnet_datapath::common::layout::DEFAULT_POLICY_ENTRIES;
    let s = c.classes.stats();
    let held = c.class_tables.policy_keys();
    println!(
        "    classes built (per direction, incremental): {} + {} rule sets, {} + {} classes, {} + {} class keys; \
         policy map holds {held} keys with the `*` ones ({:.1} % of the default map); \
         {} splits, {} merges, {} records rewritten; programmed with classes in {:.2} s",
        s.rulesets[0],
        s.rulesets[1],
        s.classes[0],
        s.classes[1],
        s.keys[0],
        s.keys[1],
        100.0 * held as f64 / f64::from(DEFAULT_POLICY_ENTRIES),
        s.splits,
        s.merges,
        s.moved,
        took.as_secs_f64()
    );
}

/// Classes of `slots` (one direction's rule sets) split into `groups` groups, each rule set,
/// largest first, joining the group it adds fewest keys to (greedy): `(classes, keys)` summed
/// over the groups.
fn grouped_classes(
    mut slots: Vec<u32>,
    groups: usize,
    keys: &std::collections::BTreeMap<u32, Vec<(u32, u32, u8)>>,
) -> (usize, usize) {
    slots.sort_by_key(|s| std::cmp::Reverse(keys[s].len()));
    let mut members: Vec<Vec<u32>> = vec![Vec::new(); groups];
    for &slot in &slots {
        let best = (0..groups)
            .min_by_key(|&g| {
                let mut with = members[g].clone();
                with.push(slot);
                group_keys(&with, keys).1 - group_keys(&members[g], keys).1
            })
            .unwrap();
        members[best].push(slot);
    }
    members.iter().fold((0, 0), |(c, k), m| {
        let (mc, mk) = group_keys(m, keys);
        (c + mc, k + mk)
    })
}

/// Classes over the rule sets `slots` (identities with equal keys in all of them share one) and
/// the keys they write there: `(classes, keys)`.
fn group_keys(
    slots: &[u32],
    keys: &std::collections::BTreeMap<u32, Vec<(u32, u32, u8)>>,
) -> (usize, usize) {
    use std::collections::{HashMap, HashSet};
    use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
    let h = BuildHasherDefault::<DefaultHasher>::default();
    let mut sig: HashMap<u32, u64> = HashMap::new();
    for slot in slots {
        for &(i, p, v) in &keys[slot] {
            let e = sig.entry(i).or_insert(0);
            *e = e.wrapping_add(h.hash_one((slot, p, v)));
        }
    }
    let classes: HashSet<u64> = sig.values().copied().collect();
    let mut written = 0;
    for slot in slots {
        let distinct: HashSet<(u64, u32)> =
            keys[slot].iter().map(|&(i, p, _)| (sig[&i], p)).collect();
        written += distinct.len();
    }
    (classes.len(), written)
}

/// The rule sets, policy keys and class counts of one node's programmed datapath (see
/// [`datapath_fill`]).
fn print_node_fill(node: usize, control: &ordnet_datapath::Control, took: Duration) {
    use ordnet_datapath::common::layout::{DEFAULT_MAX_RULESETS, DEFAULT_POLICY_ENTRIES};
    use std::collections::{BTreeMap, HashMap};
    let store = control.store();
    // Which directions use each slot.
    let mut dirs: BTreeMap<u32, [bool; 2]> = BTreeMap::new();
    for st in control.endpoints().values() {
        dirs.entry(st.ingress.ruleset).or_default()[0] = true;
        dirs.entry(st.egress.ruleset).or_default()[1] = true;
    }
    dirs.remove(&0);
    let (mut keys, mut wildcard) = (0usize, 0usize);
    // Per identity: its (slot, prefix, verdict) keys, for the signatures.
    let mut sig: HashMap<u32, Vec<(u32, u32, u8)>> = HashMap::new();
    for &slot in dirs.keys() {
        let c = store.content(slot).unwrap();
        keys += c.specific.len();
        wildcard += c.wildcard.len();
        for (&(id, prefix), &v) in &c.specific {
            sig.entry(id).or_default().push((slot, prefix, v.verdict));
        }
    }
    // Classes over the slots `within`: identities with equal keys there share one; the
    // keys written are one per (slot, class, prefix).
    let classes_over = |within: &dyn Fn(u32) -> bool| -> (usize, usize) {
        let mut classes: HashMap<Vec<(u32, u32, u8)>, usize> = HashMap::new();
        for keys in sig.values() {
            let mine: Vec<(u32, u32, u8)> = keys.iter().copied().filter(|k| within(k.0)).collect();
            if !mine.is_empty() {
                *classes.entry(mine).or_default() += 1;
            }
        }
        let written = classes.keys().map(Vec::len).sum();
        (classes.len(), written)
    };
    let per_node = classes_over(&|_| true);
    let ingress = classes_over(&|s| dirs[&s][0]);
    let egress = classes_over(&|s| dirs[&s][1]);
    let mut per_ruleset = (0usize, 0usize);
    for &slot in dirs.keys() {
        let c = classes_over(&|s| s == slot);
        per_ruleset = (per_ruleset.0 + c.0, per_ruleset.1 + c.1);
    }
    let fill = |n: usize| 100.0 * n as f64 / f64::from(DEFAULT_POLICY_ENTRIES);
    println!(
        "  node {node}: {} endpoints, {} rule sets ({:.0} % of {DEFAULT_MAX_RULESETS} slots), {} identities with keys; built and programmed in {:.2} s",
        control.endpoints().len(),
        dirs.len(),
        100.0 * dirs.len() as f64 / f64::from(DEFAULT_MAX_RULESETS),
        sig.len(),
        took.as_secs_f64()
    );
    println!(
        "    policy keys today (identities): {} = {keys} identity + {wildcard} `*`: {:.1} % of the default map ({DEFAULT_POLICY_ENTRIES})",
        keys + wildcard,
        fill(keys + wildcard)
    );
    for (name, (classes, written)) in [
        ("per node", per_node),
        (
            "per direction",
            (ingress.0 + egress.0, ingress.1 + egress.1),
        ),
        ("per rule set (bound)", per_ruleset),
    ] {
        println!(
            "    classes {name:<21} {classes:>7} classes, {:>8} keys ({:>5.1} % of the map, {:>5.1}× fewer)",
            written + wildcard,
            fill(written + wildcard),
            (keys + wildcard) as f64 / (written + wildcard).max(1) as f64
        );
    }
    println!(
        "      (per direction: ingress {} rule sets, {} classes / {} keys, egress {} / {} / {})",
        dirs.values().filter(|u| u[0]).count(),
        ingress.0,
        ingress.1,
        dirs.values().filter(|u| u[1]).count(),
        egress.0,
        egress.1
    );
    // Several class ids per address and direction, each for a group of the rule sets
    // (greedy: each rule set, largest first, joins the group it adds fewest keys to).
    let slot_keys: BTreeMap<u32, Vec<(u32, u32, u8)>> = dirs
        .keys()
        .map(|&slot| {
            let c = store.content(slot).unwrap();
            (
                slot,
                c.specific
                    .iter()
                    .map(|(&(i, p), &v)| (i, p, v.verdict))
                    .collect(),
            )
        })
        .collect();
    for groups in [2usize, 4, 8] {
        let mut total = (0usize, 0usize);
        for d in 0..2 {
            let slots: Vec<u32> = dirs.iter().filter(|(_, u)| u[d]).map(|(s, _)| *s).collect();
            let (c, k) = grouped_classes(slots, groups, &slot_keys);
            total = (total.0 + c, total.1 + k);
        }
        println!(
            "    classes per direction, {groups} groups {:>7} classes, {:>8} keys ({:>5.1} % of the map, {:>5.1}× fewer)",
            total.0,
            total.1 + wildcard,
            fill(total.1 + wildcard),
            (keys + wildcard) as f64 / (total.1 + wildcard).max(1) as f64
        );
    }
}
