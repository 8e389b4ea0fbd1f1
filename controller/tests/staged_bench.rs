//! What a staged policy costs the agent (ignored by default; run in release):
//!
//! ```text
//! cargo test --release -p ordnet --test staged_bench -- --ignored --nocapture
//! ```
//!
//! The scale generator's cluster (2,000 pods, 1,000 policies) as node-0's engine; then a staged
//! ClusterOrderedNetworkPolicy isolating every pod's ingress. Prints what the staged view takes
//! (the time to copy the engine and add the policy, and the resident memory it adds) and the
//! agent's time per verdict event: attributing it to its rules (what every event costs already)
//! and judging it again with the staged view (what a staged policy adds). The datapath is not
//! involved: a staged policy never reaches the maps, so ns/packet is the same with or without
//! one, new flows and established (docs/observe.md §10).

use std::net::IpAddr;
use std::time::Instant;

use ordnet::observe::{Endpoints, attribute, staged_verdict};
use ordnet_datapath::Observed;
use ordnet_datapath::common::event::{BY_ALLOWED, BY_DEFAULT, FlowEvent};
use ordnet_engine::{BuildOptions, Engine, Object, ObjectChange};
use ordnet_testsuite::scale::{self, Shape};

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|n| n.parse().ok())
        })
        .unwrap_or(0)
}

fn words(ip: IpAddr) -> [u32; 4] {
    let mut b = [0u8; 16];
    match ip {
        IpAddr::V4(v4) => b[..4].copy_from_slice(&v4.octets()),
        IpAddr::V6(v6) => b = v6.octets(),
    }
    ordnet_datapath::common::addr_words(b)
}

#[test]
#[ignore]
fn staged_view_cost() {
    let shape = Shape {
        pods: 2000,
        policies: 1000,
    };
    let text: Vec<String> = shape.objects().iter().map(|v| v.to_string()).collect();
    let loaded = ordnet_crds::load_str(std::path::Path::new("scale"), &text.join("\n---\n"));
    let node = scale::node_name(0);
    let engine = Engine::build_with(
        &loaded.objects,
        &BuildOptions {
            node: Some(node.clone()),
            ..Default::default()
        },
    );
    let staged: ordnet_crds::ClusterOrderedNetworkPolicy =
        serde_json::from_value(serde_json::json!({
        "apiVersion": "ordnet.io/v1alpha1", "kind": "ClusterOrderedNetworkPolicy",
        "metadata": {"name": "staged-lockdown"},
        "spec": {"mode": "Staged", "priority": -100, "defaultDeny": {"ingress": true}}}))
        .unwrap();
    let rss_before = rss_kib();
    let started = Instant::now();
    let mut view = engine.staged_view();
    view.apply(ObjectChange::Upsert(Object::ClusterOrderedNetworkPolicy(
        staged,
    )));
    let copied = started.elapsed();
    let rss_view = rss_kib().saturating_sub(rss_before);
    // Events: every local endpoint to 50 pods of the cluster, TCP/80, allowed on both sides.
    let locals: Vec<IpAddr> = engine
        .endpoints()
        .iter()
        .filter(|e| e.node.as_deref() == Some(node.as_str()))
        .filter_map(|e| e.ips.first().copied())
        .collect();
    let all: Vec<IpAddr> = engine
        .endpoints()
        .iter()
        .filter_map(|e| e.ips.first().copied())
        .collect();
    let eps = Endpoints::of(&engine);
    let mut events = Vec::new();
    for (i, src) in locals.iter().enumerate() {
        for k in 0..50 {
            let dst = all[(i * 37 + k * 101) % all.len()];
            events.push(Observed::of(&FlowEvent {
                revision: 1,
                packets: 1,
                hook: 1,
                verdict: 1,
                reason: 1,
                family: 4,
                protocol: 6,
                egress: BY_DEFAULT | BY_ALLOWED,
                ingress: BY_DEFAULT | BY_ALLOWED,
                sport: 40000 + k as u16,
                dport: 80,
                src: words(*src),
                dst: words(dst),
                ..FlowEvent::default()
            }));
        }
    }
    let rounds = 5;
    let started = Instant::now();
    let mut records = Vec::new();
    for _ in 0..rounds {
        records = events
            .iter()
            .enumerate()
            .map(|(i, e)| attribute(&engine, &eps, 1, i as u64, 0, e))
            .collect();
    }
    let attributed = started.elapsed();
    let started = Instant::now();
    let mut changed = 0;
    for _ in 0..rounds {
        changed = records
            .iter()
            .filter(|r| staged_verdict(&view, r).is_some())
            .count();
    }
    let judged = started.elapsed();
    let per = |d: std::time::Duration| d.as_nanos() as f64 / (rounds * events.len()) as f64;
    println!(
        "staged view of node-0 ({} local endpoints of {} pods, {} policies): copied and the staged policy added in {:.1} ms, +{:.1} MiB resident",
        locals.len(),
        shape.pods,
        shape.policies,
        copied.as_secs_f64() * 1e3,
        rss_view as f64 / 1024.0
    );
    println!(
        "per verdict event ({} events x {rounds}): attribution {:.0} ns (every event), staged judgement {:.0} ns (with a staged policy); {changed} would change",
        events.len(),
        per(attributed),
        per(judged)
    );
    assert!(changed > 0, "the staged lockdown changes flows");
}
