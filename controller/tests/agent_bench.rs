//! Agent benchmark (ignored by default; run in release):
//!
//! ```text
//! cargo test --release -p ordnet --test agent_bench -- --ignored --nocapture
//! ```
//!
//! 2,000 pods (200 on the agent's node) in 20 namespaces and 1,000 policies (700
//! OrderedNetworkPolicies, 250 NetworkPolicies, 50 ClusterOrderedNetworkPolicies) through the
//! fake API server; then 200 changes one at a time (pod relabels, namespace relabels, priority
//! edits), each timed from the write to the fake API server until the agent has applied a batch
//! (so the latency includes the watch delivery and the agent's coalescing window). Prints
//! p50/p99/max, per kind also the agent's own time for the batch (engine and datapath update)
//! and the engine's part of it (from the agent's histograms), the initial sync time and
//! the process's resident memory growth while the agent synced (the fake server's objects are
//! loaded before). Targets (issue): p99 <= 50 ms, memory <= 200 MiB.

use std::time::{Duration, Instant};

use ordnet::agent::{self, AgentConfig, NoneDatapath};
use ordnet_testsuite::fakeapi::FakeApi;
use serde_json::json;

const NODE: &str = "node-0";
const NAMESPACES: usize = 20;
const PODS: usize = 2000;
const NODES: usize = 10;

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

fn load(api: &FakeApi) {
    for n in 0..NAMESPACES {
        api.create(json!({"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": format!("ns{n}"), "labels": {"team": format!("t{}", n % 5), "env": if n % 2 == 0 {"prod"} else {"dev"}}}}))
            .unwrap();
    }
    for p in 0..PODS {
        let ns = p % NAMESPACES;
        api.create(json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"namespace": format!("ns{ns}"), "name": format!("pod{p}"),
                "labels": {"app": format!("app{}", p % 50), "tier": format!("tier{}", p % 3)}},
            "spec": {"nodeName": format!("node-{}", p % NODES), "containers": [{"name": "c", "image": "i",
                "ports": [{"name": "http", "containerPort": 8080, "protocol": "TCP"}]}]},
            "status": {"podIP": format!("10.{}.{}.{}", 1 + p / 65536, (p / 256) % 256, p % 256)}}))
            .unwrap();
    }
    for i in 0..700 {
        let ns = i % NAMESPACES;
        api.create(json!({"apiVersion": "ordnet.io/v1alpha1", "kind": "OrderedNetworkPolicy",
            "metadata": {"namespace": format!("ns{ns}"), "name": format!("onp{i}")},
            "spec": {"priority": (i % 100) as i64 + 1,
                "podSelector": {"matchLabels": {"app": format!("app{}", i % 50)}},
                "ingress": [
                    {"action": if i % 3 == 0 {"Deny"} else {"Allow"},
                     "from": [{"podSelector": {"matchLabels": {"tier": format!("tier{}", i % 3)}}}],
                     "ports": [{"protocol": "TCP", "port": 8080}]},
                    {"action": "Allow", "from": [{"namespaceSelector": {"matchLabels": {"team": format!("t{}", i % 5)}}}]}
                ],
                "egress": [{"action": "Allow", "to": [{"ipBlock": {"cidr": format!("192.168.{}.0/24", i % 200)}}]}]}}))
            .unwrap();
    }
    for i in 0..250 {
        let ns = i % NAMESPACES;
        api.create(json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"namespace": format!("ns{ns}"), "name": format!("np{i}")},
            "spec": {"podSelector": {"matchLabels": {"tier": format!("tier{}", i % 3)}},
                "policyTypes": ["Ingress"],
                "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": format!("app{}", (i * 7) % 50)}}}],
                             "ports": [{"protocol": "TCP", "port": "http"}]}]}}))
            .unwrap();
    }
    for i in 0..50 {
        api.create(json!({"apiVersion": "ordnet.io/v1alpha1", "kind": "ClusterOrderedNetworkPolicy",
            "metadata": {"name": format!("conp{i}")},
            "spec": {"priority": -(i as i64) - 1,
                "namespaceSelector": {"matchLabels": {"env": if i % 2 == 0 {"prod"} else {"dev"}}},
                "ingress": [{"action": if i % 4 == 0 {"Deny"} else {"Allow"},
                    "from": [{"namespaceSelector": {"matchLabels": {"team": format!("t{}", i % 5)}}}],
                    "ports": [{"protocol": "TCP", "port": 9000 + i as i64}]}]}}))
            .unwrap();
    }
}

/// The next value of a label `PREFIX<k>` (k + 1 modulo `n`): always a real change.
fn next(current: &serde_json::Value, prefix: &str, n: usize) -> String {
    let k: usize = current
        .as_str()
        .and_then(|v| v.strip_prefix(prefix))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    format!("{prefix}{}", (k + 1) % n)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: run in release with --ignored --nocapture"]
async fn bench_2000_pods_1000_policies() {
    let api = FakeApi::start().await.unwrap();
    load(&api);
    // Another agent holds the status Lease for the whole run, so no status writes (and their
    // watch echoes) mix into the timed batches.
    api.hold_lease(
        "kube-system",
        ordnet::agent::status::LEASE_NAME,
        "elsewhere",
    )
    .unwrap();
    let rss_before = rss_kib();
    let started = Instant::now();
    let h = agent::start(
        AgentConfig {
            node: NODE.into(),
            debug_addr: "127.0.0.1:0".parse().unwrap(),
            namespace: "kube-system".into(),
            lease_renew_every: Duration::from_secs(5),
            watch: agent::WatchConfig::default(),
            cni_socket: None,
            metrics_addr: Some("127.0.0.1:0".parse().unwrap()),
            follow_netlink: false,
            maintain_every: agent::MAINTAIN_EVERY,
            observe_journal: agent::observe::DEFAULT_JOURNAL,
            flow_log: None,
            traffic_window: Some(agent::traffic::DEFAULT_WINDOW),
            flow_history: agent::history::DEFAULT_FLOW_HISTORY,
        },
        api.client(),
        Box::new(NoneDatapath::default()),
    )
    .await
    .unwrap();
    assert!(agent::wait_until(Duration::from_secs(300), || h.state.ready()).await);
    let sync = started.elapsed();
    let rss_ready = rss_kib();
    let endpoints = h
        .state
        .with_programmed(|_, dp| dp.programmed().len())
        .unwrap();
    assert_eq!(endpoints, PODS / NODES);

    let mut latencies = Vec::new();
    let mut by_kind: [Vec<Duration>; 4] = Default::default();
    // Per kind: the engine's time (Engine::apply) and the agent's whole batch (engine and
    // datapath update), from the agent's own histograms.
    let mut engine_by_kind: [Vec<Duration>; 4] = Default::default();
    let mut batch_by_kind: [Vec<Duration>; 4] = Default::default();
    let sums = || {
        (
            h.state.metrics.compile_seconds.data().sum,
            h.state.metrics.apply_seconds.data().sum,
        )
    };
    for i in 0..200 {
        let before = h.state.metrics.batches.get();
        let (engine0, batch0) = sums();
        let t0 = Instant::now();
        match i % 4 {
            // Relabel a local pod.
            0 | 1 => {
                let p = (i * 37) % (PODS / NODES) * NODES;
                let ns = p % NAMESPACES;
                let mut o = api
                    .get("v1", "Pod", &format!("ns{ns}"), &format!("pod{p}"))
                    .unwrap();
                o["metadata"]["labels"]["app"] =
                    json!(next(&o["metadata"]["labels"]["app"], "app", 50));
                api.update(o).unwrap();
            }
            // Relabel a namespace.
            2 => {
                let n = i % NAMESPACES;
                let mut o = api.get("v1", "Namespace", "", &format!("ns{n}")).unwrap();
                o["metadata"]["labels"]["team"] =
                    json!(next(&o["metadata"]["labels"]["team"], "t", 5));
                api.update(o).unwrap();
            }
            // Edit a priority.
            _ => {
                let k = (i * 11) % 700;
                let ns = k % NAMESPACES;
                let mut o = api
                    .get(
                        "ordnet.io/v1alpha1",
                        "OrderedNetworkPolicy",
                        &format!("ns{ns}"),
                        &format!("onp{k}"),
                    )
                    .unwrap();
                o["spec"]["priority"] = json!(200 + i as i64);
                api.update(o).unwrap();
            }
        }
        let mut done = false;
        while t0.elapsed() < Duration::from_secs(10) {
            if h.state.metrics.batches.get() > before {
                done = true;
                break;
            }
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
        assert!(done, "change {i} was not applied within 10 s");
        latencies.push(t0.elapsed());
        by_kind[i % 4].push(t0.elapsed());
        let (engine1, batch1) = sums();
        engine_by_kind[i % 4].push(Duration::from_secs_f64(engine1 - engine0));
        batch_by_kind[i % 4].push(Duration::from_secs_f64(batch1 - batch0));
    }
    assert!(!h.state.is_status_writer());
    latencies.sort();
    let merged = |v: &mut [Vec<Duration>; 4]| {
        let pods = std::mem::take(&mut v[1]);
        v[0].extend(pods);
        for l in v.iter_mut() {
            l.sort();
        }
    };
    merged(&mut by_kind);
    merged(&mut engine_by_kind);
    merged(&mut batch_by_kind);
    for (k, name) in [
        (0, "pod app label"),
        (2, "namespace label"),
        (3, "priority"),
    ] {
        let p = |l: &[Duration]| {
            format!(
                "p50 {:.2?}, max {:.2?}",
                percentile(l, 0.5),
                l.last().unwrap()
            )
        };
        println!(
            "  {name}: latency {}; in the agent {}; of which Engine::apply {}",
            p(&by_kind[k]),
            p(&batch_by_kind[k]),
            p(&engine_by_kind[k]),
        );
    }
    let s = h.state.metrics.sizes();
    let (compile, apply) = (
        h.state.metrics.compile_seconds.data(),
        h.state.metrics.apply_seconds.data(),
    );
    println!(
        "  engine (Engine::apply) {:.1} ms of {:.1} ms in the agent's batches, incl. the initial build",
        compile.sum * 1000.0,
        apply.sum * 1000.0
    );
    println!(
        "agent bench: {PODS} pods ({endpoints} local), 1000 policies; initial sync {:.2?}; \
         change->programmed over {} changes: p50 {:.2?}, p99 {:.2?}, max {:.2?}; \
         RSS growth while syncing {} MiB (process RSS {} MiB); identities {}, mapstate keys {}+{}",
        sync,
        latencies.len(),
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.99),
        latencies.last().unwrap(),
        (rss_ready.saturating_sub(rss_before)) / 1024,
        rss_kib() / 1024,
        s.identities,
        s.entries_ingress,
        s.entries_egress,
    );
}
