//! `ordnet::program` (engine → datapath) on random clusters and random change sequences:
//!
//! * after every batch of changes, the tables programmed incrementally (`NodeProgram::apply`
//!   with the engine's deltas) mean exactly what programming the same engine from scratch
//!   (`NodeProgram::program_full` on empty tables) gives: equal `MemTables::canonical()` forms,
//!   endpoint ids replaced by pod names; no change set ever needs the full-update fallback;
//! * the final datapath decides every flow (pod and external addresses, both families, every
//!   protocol) as `Engine::flow` of an engine built from scratch from the final objects;
//! * a change set that does not fit (a delta applied twice) falls back to a full update of that
//!   endpoint and the result is still exact;
//! * a new `NodeProgram` taking over a programmed datapath (agent restart) keeps every
//!   endpoint's id, removes nothing and changes nothing;
//! * (root) the same program and deltas written to the kernel datapath give maps equal to the
//!   in-memory ones, and the loaded XDP program (`BPF_PROG_TEST_RUN`) decides every probe like
//!   the in-memory decision.
//!
//! Both a cluster-wide engine (every pod local, as the CLI programs it) and a node-scoped one
//! (`build_for_node`, as the agent programs it) are covered.

#[path = "../../engine/tests/common/cluster_gen.rs"]
mod cluster_gen;

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Duration;

use cluster_gen::{EXTERNALS, Rng, World, random_change};
use ordnet::program::NodeProgram;
use ordnet_datapath::common::craft::{L4, frame_between};
use ordnet_datapath::common::layout::IpKey;
use ordnet_datapath::common::{Reason, Verdict as Xdp};
use ordnet_datapath::{
    CanonicalRecord, ControlPlane as _, Datapath, DatapathConfig, MemDatapath, MemTables, XdpAction,
};
use ordnet_engine::{BuildOptions, Engine, FlowEnd, IpFamily};
use ordnet_mapstate::{Protocol, Verdict};

const HOST: &str = "10.0.0.254";

fn config() -> DatapathConfig {
    DatapathConfig {
        max_rulesets: 256,
        max_blocks: 2048,
        grace: Duration::ZERO,
        ..DatapathConfig::default()
    }
}

/// The canonical tables with endpoint ids replaced by the endpoints' names.
type View = BTreeMap<IpKey, (Option<String>, CanonicalRecord)>;

fn view(p: &NodeProgram, tables: &MemTables) -> View {
    tables
        .canonical()
        .ipcache
        .into_iter()
        .map(|(k, mut r)| {
            let name = (r.endpoint != 0).then(|| {
                p.endpoint_name(r.endpoint)
                    .unwrap_or_else(|| panic!("endpoint {} has no name", r.endpoint))
                    .to_string()
            });
            r.endpoint = 0;
            (k, (name, r))
        })
        .collect()
}

fn scratch(engine: &Engine) -> (NodeProgram, MemDatapath) {
    let mut dp = MemDatapath::new(&config());
    let mut p = NodeProgram::new();
    p.set_host_addresses(&mut dp, &[HOST.parse().unwrap()])
        .unwrap();
    p.program_full(engine, &mut dp).unwrap();
    (p, dp)
}

/// Compares the two programmings; returns the first differences.
fn compare(what: &str, a: (&NodeProgram, &MemDatapath), b: (&NodeProgram, &MemDatapath)) {
    let (va, vb) = (view(a.0, a.1.tables()), view(b.0, b.1.tables()));
    if va == vb && a.1.tables().cidr == b.1.tables().cidr {
        return;
    }
    let mut diffs = Vec::new();
    for k in va.keys().chain(vb.keys()) {
        if va.get(k) != vb.get(k) {
            let short = |v: Option<&(Option<String>, CanonicalRecord)>| {
                v.map(|(n, r)| {
                    format!(
                        "{n:?} identity {} flags {} defaults {}/{} keys {}/{}",
                        r.identity,
                        r.flags,
                        r.ingress.0,
                        r.egress.0,
                        r.ingress.1.keys.len(),
                        r.egress.1.keys.len()
                    )
                })
            };
            diffs.push(format!(
                "{:?}: incremental {:?}, scratch {:?}",
                ordnet_datapath::key_ip(k),
                short(va.get(k)),
                short(vb.get(k))
            ));
        }
    }
    if a.1.tables().cidr != b.1.tables().cidr {
        diffs.push(format!(
            "cidr: incremental {:?}, scratch {:?}",
            a.1.tables().cidr.keys().collect::<Vec<_>>(),
            b.1.tables().cidr.keys().collect::<Vec<_>>()
        ));
    }
    diffs.dedup();
    panic!(
        "{what}: incremental != scratch:\n  {}",
        diffs.into_iter().take(8).collect::<Vec<_>>().join("\n  ")
    );
}

/// Every flow between pod addresses and external addresses: the datapath's decision equals
/// `Engine::flow` of `reference`.
fn check_verdicts(what: &str, dp: &MemDatapath, reference: &Engine) {
    let mut addrs: Vec<IpAddr> = Vec::new();
    for ep in reference.endpoints() {
        addrs.extend(&ep.ips);
    }
    // Pods that are not endpoints of a node-scoped reference: their addresses are in its
    // ipcache as host prefixes.
    for (net, _) in reference.ipcache() {
        if net.prefix_len() == net.max_prefix_len() {
            addrs.push(net.addr());
        }
    }
    addrs.extend(EXTERNALS.iter().map(|s| s.parse::<IpAddr>().unwrap()));
    addrs.sort();
    addrs.dedup();
    let mut wrong = Vec::new();
    for &src in &addrs {
        for &dst in &addrs {
            if src.is_ipv4() != dst.is_ipv4() {
                continue;
            }
            for proto in Protocol::ALL {
                for port in [53u16, 80, 8080] {
                    let l4 = match proto {
                        Protocol::Tcp => L4::Tcp {
                            sport: 40000,
                            dport: port,
                        },
                        Protocol::Udp => L4::Udp {
                            sport: 40000,
                            dport: port,
                        },
                        Protocol::Sctp => L4::Sctp {
                            sport: 40000,
                            dport: port,
                        },
                    };
                    let d = dp.decide(&frame_between(src, dst, l4).unwrap());
                    let t = reference.flow(
                        &FlowEnd::Ip(src),
                        &FlowEnd::Ip(dst),
                        IpFamily::of(src),
                        proto,
                        port,
                    );
                    let got = if d.verdict == Xdp::Pass {
                        Verdict::Allow
                    } else {
                        Verdict::Deny
                    };
                    if got != t.verdict {
                        wrong.push(format!(
                            "{src} -> {dst} {proto}/{port}: datapath {got} ({:?}), engine {}",
                            d.reason, t.verdict
                        ));
                    }
                    if src == dst && d.reason != Reason::SameEndpoint {
                        assert!(
                            matches!(d.reason, Reason::NotLocal | Reason::Host),
                            "{src} to itself: {:?}",
                            d.reason
                        );
                    }
                }
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "{what}: {} wrong verdicts:\n  {}",
        wrong.len(),
        wrong.into_iter().take(8).collect::<Vec<_>>().join("\n  ")
    );
}

fn options(node: Option<&str>) -> BuildOptions {
    BuildOptions {
        node: node.map(str::to_string),
        ..BuildOptions::default()
    }
}

#[test]
fn incremental_programming_equals_programming_from_scratch() {
    let seeds: u64 = std::env::var("ORDNET_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(40);
    let mut batches = 0;
    let mut change_sets = 0;
    for seed in 0..seeds {
        for node in [None, Some("n1")] {
            let mut r = Rng::new(seed.wrapping_mul(104_729).wrapping_add(17));
            let mut world = World::random(&mut r);
            let mut engine = Engine::build_with(&world.objects(), &options(node));
            let (mut program, mut dp) = scratch(&engine);
            let mut counter = 0;
            for step in 0..20 {
                // One to three changes per batch, as the agent batches them.
                let n = 1 + r.below(3);
                let mut deltas = Vec::new();
                for _ in 0..n {
                    let change = random_change(&mut r, &mut world, &mut counter);
                    let d = engine.apply(change);
                    assert!(d.errors.is_empty(), "{:?}", d.errors);
                    deltas.push(d);
                }
                if std::env::var("ORDNET_DEBUG").is_ok_and(|v| v == format!("{seed} {step}")) {
                    for d in &deltas {
                        eprintln!(
                            "delta: added {:?} removed {:?} ipcache {:?}",
                            d.endpoints_added, d.endpoints_removed, d.ipcache
                        );
                        for u in &d.updates {
                            eprintln!(
                                "  update {} {:?} isolated {:?} rebuilt {} +{:?} ~{:?} -{:?}",
                                u.endpoint,
                                u.direction,
                                u.isolated,
                                u.rebuilt,
                                u.changes
                                    .added
                                    .iter()
                                    .map(|(k, e)| (k, e.verdict))
                                    .collect::<Vec<_>>(),
                                u.changes
                                    .changed
                                    .iter()
                                    .map(|(k, _, e)| (k, e.verdict))
                                    .collect::<Vec<_>>(),
                                u.changes
                                    .removed
                                    .iter()
                                    .map(|(k, e)| (k, e.verdict))
                                    .collect::<Vec<_>>()
                            );
                        }
                    }
                }
                program
                    .apply(&engine, &deltas, &mut dp)
                    .unwrap_or_else(|e| panic!("seed {seed} {node:?} step {step}: {e}"));
                batches += 1;
                let what = format!("seed {seed} node {node:?} step {step}");
                let (p2, dp2) = scratch(&engine);
                compare(&what, (&program, &dp), (&p2, &dp2));
                let names: Vec<String> = engine.endpoints().iter().map(|e| e.id()).collect();
                assert_eq!(
                    program.endpoint_ids().keys().cloned().collect::<Vec<_>>(),
                    names,
                    "{what}"
                );
            }
            assert_eq!(
                program.stats().fallbacks,
                0,
                "seed {seed}: the engine's change sets always fit"
            );
            change_sets += program.stats().change_sets;
            let reference = Engine::build_with(&world.objects(), &options(node));
            check_verdicts(&format!("seed {seed} node {node:?}"), &dp, &reference);
        }
    }
    println!("{batches} batches, {change_sets} change sets, all equal to a full programming");
    assert!(
        change_sets > 100,
        "only {change_sets} change sets exercised"
    );
}

#[test]
fn stale_change_sets_fall_back_to_a_full_update() {
    let mut fallbacks = 0;
    for seed in 0..20u64 {
        let mut r = Rng::new(seed + 900);
        let mut world = World::random(&mut r);
        let mut engine = Engine::build(&world.objects());
        let (mut program, mut dp) = scratch(&engine);
        let mut counter = 0;
        for _ in 0..10 {
            let change = random_change(&mut r, &mut world, &mut counter);
            let d = engine.apply(change);
            program
                .apply(&engine, std::slice::from_ref(&d), &mut dp)
                .unwrap();
            let keyed = d.updates.iter().any(|u| {
                !u.changes.added.is_empty()
                    || !u.changes.removed.is_empty()
                    || u.changes
                        .changed
                        .iter()
                        .any(|(_, a, b)| a.verdict != b.verdict)
            });
            if keyed && d.endpoints_added.is_empty() && d.endpoints_removed.is_empty() {
                // The same change sets again: they no longer fit.
                let before = program.stats().fallbacks;
                program.apply(&engine, &[d], &mut dp).unwrap();
                assert!(program.stats().fallbacks > before, "seed {seed}");
                fallbacks += program.stats().fallbacks - before;
            }
            let (p2, dp2) = scratch(&engine);
            compare(&format!("seed {seed}"), (&program, &dp), (&p2, &dp2));
        }
    }
    assert!(fallbacks > 5, "only {fallbacks} fallbacks exercised");
}

#[test]
fn a_new_program_takes_over_a_programmed_datapath_unchanged() {
    for seed in 0..20u64 {
        let mut r = Rng::new(seed + 7000);
        let world = World::random(&mut r);
        let engine = Engine::build_for_node(&world.objects(), "n1");
        let (old, mut dp) = scratch(&engine);
        let before = dp.tables().canonical();
        let ids = old.endpoint_ids().clone();
        // A restarted agent: a fresh NodeProgram over the adopted datapath.
        let mut new = NodeProgram::new();
        new.set_host_addresses(&mut dp, &[HOST.parse().unwrap()])
            .unwrap();
        new.program_full(&engine, &mut dp).unwrap();
        assert_eq!(new.endpoint_ids(), &ids, "seed {seed}: ids kept");
        assert_eq!(new.stats().endpoints_removed, 0, "seed {seed}");
        let after = dp.tables().canonical();
        assert_eq!(before, after, "seed {seed}: nothing changed");
    }
}

#[test]
fn duplicate_addresses_are_an_error_naming_both_pods() {
    let pod = |name: &str| {
        serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "x"},
            "spec": {"containers": [{"name": "c", "image": "i"}]},
            "status": {"podIP": "10.1.0.1"}
        })
    };
    let objects = ordnet_crds::ClusterObjects {
        pods: ["a", "b"]
            .iter()
            .map(|n| ordnet_crds::Loaded {
                object: serde_json::from_value(pod(n)).unwrap(),
                source: None,
            })
            .collect(),
        ..Default::default()
    };
    let engine = Engine::build(&objects);
    let mut dp = MemDatapath::new(&config());
    let e = NodeProgram::new()
        .program_full(&engine, &mut dp)
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "endpoint x/b: address 10.1.0.1 is also the address of endpoint x/a"
    );
    assert!(dp.endpoints().is_empty(), "nothing half-applied");
}

/// True when the kernel test may run; false (after saying so) when it must skip. Panics when it
/// would skip under CI.
fn privileged() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let euid = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .unwrap_or("?")
        .to_string();
    if euid == "0" {
        return true;
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "CI is set but the kernel datapath test needs root (euid is {euid}); refusing to skip"
    );
    eprintln!("SKIPPED: the kernel datapath needs root (euid {euid}); with CI set this fails");
    false
}

#[test]
fn the_kernel_datapath_is_programmed_like_the_in_memory_one() {
    if !privileged() {
        return;
    }
    let mut probes = 0;
    for seed in 0..6u64 {
        let mut r = Rng::new(seed + 31_000);
        let mut world = World::random(&mut r);
        let mut engine = Engine::build(&world.objects());
        let mut kernel = Datapath::create(config()).expect("load the XDP program");
        let mut mem = MemDatapath::new(&config());
        let (mut pk, mut pm) = (NodeProgram::new(), NodeProgram::new());
        for (p, dp) in [
            (
                &mut pk,
                &mut kernel as &mut dyn ordnet_datapath::ControlPlane,
            ),
            (&mut pm, &mut mem),
        ] {
            p.set_host_addresses(dp, &[HOST.parse().unwrap()]).unwrap();
            p.program_full(&engine, dp).unwrap();
        }
        let mut counter = 0;
        for _ in 0..8 {
            let change = random_change(&mut r, &mut world, &mut counter);
            let d = engine.apply(change);
            pk.apply(&engine, std::slice::from_ref(&d), &mut kernel)
                .unwrap();
            pm.apply(&engine, &[d], &mut mem).unwrap();
        }
        assert_eq!(
            kernel.verify().unwrap(),
            Vec::<String>::new(),
            "seed {seed}"
        );
        assert_eq!(
            view(&pk, kernel.tables()),
            view(&pm, mem.tables()),
            "seed {seed}"
        );
        let mut addrs: Vec<IpAddr> = engine
            .endpoints()
            .iter()
            .flat_map(|e| e.ips.clone())
            .collect();
        addrs.extend(EXTERNALS.iter().map(|s| s.parse::<IpAddr>().unwrap()));
        for &src in &addrs {
            for &dst in &addrs {
                if src.is_ipv4() != dst.is_ipv4() {
                    continue;
                }
                for l4 in [
                    L4::Tcp {
                        sport: 40000,
                        dport: 80,
                    },
                    L4::Udp {
                        sport: 40001,
                        dport: 53,
                    },
                    L4::Sctp {
                        sport: 40002,
                        dport: 8080,
                    },
                ] {
                    let frame = frame_between(src, dst, l4).unwrap();
                    let want = XdpAction::from(mem.decide(&frame).verdict);
                    let got = kernel.test_run(&frame).unwrap().action;
                    assert_eq!(got, want, "seed {seed}: {src} -> {dst} {l4:?}");
                    probes += 1;
                }
                // Each probe is a new flow for both.
                kernel.ct_clear().unwrap();
            }
        }
    }
    println!("{probes} probes: kernel == in-memory");
    assert!(probes > 100, "only {probes} probes");
}
