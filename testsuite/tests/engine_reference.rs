//! The engine (identities, selector cache, MapStates, `Engine::flow` = MapState lookups only)
//! against the reference evaluator (`ordnet_testsuite::reference`, SEMANTICS.md evaluated on
//! the objects directly) on random clusters: every pair of pods and external addresses, both
//! IP families, every protocol and a set of ports.
//!
//! The reference itself is checked first against the hand-written expectations of every
//! conformance scenario, so a bug shared by both cannot hide behind agreement.

#[path = "../../engine/tests/common/cluster_gen.rs"]
mod cluster_gen;

use std::collections::BTreeSet;
use std::net::IpAddr;

use cluster_gen::{EXTERNALS, PROBE_PORTS, Rng, World, random_change};
use ordnet_engine::{Engine, FlowEnd, IpFamily, matrix};
use ordnet_mapstate::{Protocol, Verdict};
use ordnet_testsuite::reference::{End, Reference};
use quickcheck::{QuickCheck, TestResult};

fn end(name: &str) -> End {
    match name.parse::<IpAddr>() {
        Ok(ip) => End::Ip(ip),
        Err(_) => {
            let (ns, n) = name.split_once('/').expect("ns/name");
            End::Pod {
                namespace: ns.into(),
                name: n.into(),
            }
        }
    }
}

/// Compares every matrix cell of `engine` with the reference; returns the mismatches.
fn compare(
    engine: &Engine,
    reference: &Reference,
    externals: &[IpAddr],
    ports: &[u16],
) -> Vec<String> {
    let mut wrong = Vec::new();
    for family in [IpFamily::V4, IpFamily::V6] {
        for proto in Protocol::ALL {
            for &port in ports {
                let m = matrix(engine, proto, port, externals, family);
                for r in &m.results {
                    let want = reference.allowed(
                        &end(&r.from),
                        &end(&r.to),
                        family == IpFamily::V6,
                        proto.number(),
                        port,
                    );
                    let got = r.verdict == Verdict::Allow;
                    if want != Some(got) {
                        let t = engine.flow(
                            &engine
                                .resolve(&r.from)
                                .unwrap_or(FlowEnd::Ip([0, 0, 0, 0].into())),
                            &engine
                                .resolve(&r.to)
                                .unwrap_or(FlowEnd::Ip([0, 0, 0, 0].into())),
                            family,
                            proto,
                            port,
                        );
                        wrong.push(format!(
                            "{:?} {proto}/{port} {} -> {}: engine {got}, reference {want:?}\n  trace: {}",
                            family,
                            r.from,
                            r.to,
                            serde_json::to_string(&t).unwrap_or_default()
                        ));
                    }
                }
            }
        }
    }
    wrong
}

fn externals() -> Vec<IpAddr> {
    EXTERNALS.iter().map(|s| s.parse().unwrap()).collect()
}

fn check_world(world: &World, ports: &[u16]) -> Result<(), String> {
    let objects = world.objects();
    let engine = Engine::build(&objects);
    if !engine.errors().is_empty() {
        return Err(format!("engine errors: {:?}", engine.errors()));
    }
    let reference = Reference::new(&objects)?;
    let wrong = compare(&engine, &reference, &externals(), ports);
    if wrong.is_empty() {
        Ok(())
    } else {
        let policies: Vec<String> = world
            .nps
            .values()
            .chain(world.onps.values())
            .chain(world.conps.values())
            .map(|v| v.to_string())
            .collect();
        let pods: Vec<String> = world.pods.values().map(|v| v.to_string()).collect();
        let nss: Vec<String> = world.namespaces.values().map(|v| v.to_string()).collect();
        Err(format!(
            "{} mismatches, first ones:\n{}\nnamespaces:\n{}\npods:\n{}\npolicies:\n{}",
            wrong.len(),
            wrong.iter().take(5).cloned().collect::<Vec<_>>().join("\n"),
            nss.join("\n"),
            pods.join("\n"),
            policies.join("\n")
        ))
    }
}

#[test]
fn engine_equals_reference_on_random_clusters() {
    fn prop(seed: u64) -> TestResult {
        let mut r = Rng::new(seed);
        let world = World::random(&mut r);
        match check_world(&world, &PROBE_PORTS) {
            Ok(()) => TestResult::passed(),
            Err(e) => TestResult::error(format!("seed {seed}: {e}")),
        }
    }
    QuickCheck::new()
        .tests(300)
        .max_tests(300)
        .quickcheck(prop as fn(u64) -> TestResult);
}

/// The incrementally updated engine answers like the reference too (after each change).
#[test]
fn incremental_engine_equals_reference() {
    let seeds: u64 = std::env::var("ORDNET_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(30);
    for seed in 0..seeds {
        let mut r = Rng::new(seed.wrapping_mul(7919));
        let mut world = World::random(&mut r);
        let mut engine = Engine::build(&world.objects());
        let mut counter = 0;
        for step in 0..15 {
            let change = random_change(&mut r, &mut world, &mut counter);
            let d = engine.apply(change);
            assert!(d.errors.is_empty(), "{:?}", d.errors);
            let reference = Reference::new(&world.objects()).expect("reference");
            let wrong = compare(&engine, &reference, &externals(), &[53, 80, 8080]);
            assert!(
                wrong.is_empty(),
                "seed {seed} step {step}: {}",
                wrong.iter().take(5).cloned().collect::<Vec<_>>().join("\n")
            );
        }
    }
}

// ----- the reference against the conformance expectations -----

#[derive(serde::Deserialize)]
struct Scenario {
    name: String,
    objects: Vec<yaml_serde::Value>,
    #[serde(default)]
    externals: Vec<IpAddr>,
    expect: Vec<Probe>,
}

#[derive(serde::Deserialize)]
struct Probe {
    protocol: String,
    port: u16,
    default: String,
    #[serde(default)]
    exceptions: Vec<String>,
}

#[test]
fn reference_matches_conformance_expectations() {
    let files = ordnet_testsuite::scenario::conformance_files();
    assert!(files.len() >= 70);
    let mut wrong = Vec::new();
    let mut checked = 0;
    for path in &files {
        let sc: Scenario =
            yaml_serde::from_str(&std::fs::read_to_string(path).unwrap()).expect("scenario");
        let stream: String = sc
            .objects
            .iter()
            .map(|o| format!("---\n{}", yaml_serde::to_string(o).unwrap()))
            .collect();
        let outcome = ordnet_crds::validated(ordnet_crds::load_str(path, &stream));
        assert!(!outcome.has_errors(), "{}", sc.name);
        let reference = Reference::new(&outcome.objects).expect("reference");
        let mut ends: Vec<String> = outcome
            .objects
            .pods
            .iter()
            .filter(|p| {
                p.object
                    .status
                    .as_ref()
                    .and_then(|s| s.pod_ip.as_ref())
                    .is_some()
            })
            .map(|p| {
                format!(
                    "{}/{}",
                    p.object.metadata.namespace.as_deref().unwrap_or("default"),
                    p.object.metadata.name.as_deref().unwrap_or("")
                )
            })
            .collect();
        let pods: BTreeSet<String> = ends.iter().cloned().collect();
        ends.extend(sc.externals.iter().map(|ip| ip.to_string()));
        for p in &sc.expect {
            let proto = match p.protocol.as_str() {
                "TCP" => 6,
                "UDP" => 17,
                _ => 132,
            };
            let exceptions: BTreeSet<&str> = p.exceptions.iter().map(String::as_str).collect();
            for a in &ends {
                for b in &ends {
                    if a == b || (!pods.contains(a) && !pods.contains(b)) {
                        continue;
                    }
                    let listed = exceptions.contains(format!("{a} -> {b}").as_str());
                    let want = (p.default == "allow") != listed;
                    let got = reference.allowed(&end(a), &end(b), false, proto, p.port);
                    checked += 1;
                    if got != Some(want) {
                        wrong.push(format!(
                            "{} {}/{}: {a} -> {b}: expected {want}, reference {got:?}",
                            sc.name, p.protocol, p.port
                        ));
                    }
                }
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    assert!(checked > 500, "only {checked} pairs checked");
}
