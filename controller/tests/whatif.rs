//! `ordnet whatif` (`ordnet::whatif::replay`) against `matrix` and the reference evaluator, on
//! random clusters with some ordered policies staged: a flow history recorded with the verdicts
//! of the enforced policies, replayed with the staged ones enforced, names exactly the flows
//! whose cell differs between `matrix --staged` and `matrix`; and every replayed verdict is the
//! reference evaluator's with the staged policies read as enforced (SEMANTICS.md, evaluated on
//! the objects directly: a bug shared by the engine's two answers cannot hide).

#[path = "../../engine/tests/common/cluster_gen.rs"]
mod cluster_gen;

use std::collections::BTreeSet;
use std::net::IpAddr;

use cluster_gen::{EXTERNALS, PROBE_PORTS, Rng, World};
use ordnet::whatif::{SeenFlow, replay};
use ordnet_engine::{BuildOptions, Engine, IpFamily, matrix};
use ordnet_mapstate::{Protocol, Verdict};
use ordnet_testsuite::reference::{End, Reference};
use quickcheck::{QuickCheck, TestResult};
use serde_json::json;

/// The address a matrix row or column stands for (a pod's first address of the family).
fn address(engine: &Engine, name: &str, family: IpFamily) -> Option<IpAddr> {
    if let Ok(ip) = name.parse() {
        return Some(ip);
    }
    let (ns, n) = name.split_once('/')?;
    engine
        .endpoint(ns, n)?
        .ips
        .iter()
        .copied()
        .find(|ip| family.contains(*ip))
}

fn check(seed: u64) -> Result<usize, String> {
    let mut r = Rng::new(seed);
    let mut world = World::random(&mut r);
    for p in world.onps.values_mut().chain(world.conps.values_mut()) {
        if r.below(2) == 0 {
            p["spec"]["mode"] = json!("Staged");
        }
    }
    let objects = world.objects();
    let enforced = Engine::build(&objects);
    let staged = Engine::build_with(
        &objects,
        &BuildOptions {
            staged: true,
            ..BuildOptions::default()
        },
    );
    if !enforced.errors().is_empty() || !staged.errors().is_empty() {
        return Err(format!("engine errors: {:?}", staged.errors()));
    }
    let reference = Reference::new_with(&objects, true)?;
    let externals: Vec<IpAddr> = EXTERNALS.iter().map(|s| s.parse().unwrap()).collect();
    let family = IpFamily::V4;
    let proto = *r.pick(&Protocol::ALL);
    let port = *r.pick(&PROBE_PORTS);
    let before = matrix(&enforced, proto, port, &externals, family);
    let after = matrix(&staged, proto, port, &externals, family);
    // The history: every cell of the enforced matrix between two addresses, with its verdict.
    let mut history = Vec::new();
    let mut want = BTreeSet::new();
    for cell in &before.results {
        let (Some(src), Some(dst)) = (
            address(&enforced, &cell.from, family),
            address(&enforced, &cell.to, family),
        ) else {
            continue;
        };
        let allowed = cell.verdict == Verdict::Allow;
        history.push(SeenFlow {
            src,
            dst,
            protocol: proto,
            port,
            allowed,
        });
        let now = after
            .verdict(&cell.from, &cell.to)
            .ok_or_else(|| format!("{} -> {} not in matrix --staged", cell.from, cell.to))?;
        if (now == Verdict::Allow) != allowed {
            want.insert((src, dst));
        }
    }
    let changed = replay(&staged, &history);
    let got: BTreeSet<(IpAddr, IpAddr)> =
        changed.iter().map(|c| (c.flow.src, c.flow.dst)).collect();
    if got != want {
        return Err(format!(
            "seed {seed}: {proto}/{port}: whatif changed {got:?}, matrix --staged differs at {want:?}"
        ));
    }
    for f in &history {
        let end = |ip: IpAddr| End::Ip(ip);
        let reference_allows =
            reference.allowed(&end(f.src), &end(f.dst), false, proto.number(), port);
        let whatif_allows = f.allowed != got.contains(&(f.src, f.dst));
        if reference_allows != Some(whatif_allows) {
            return Err(format!(
                "seed {seed}: {proto}/{port} {} -> {}: whatif says allowed={whatif_allows}, the reference {reference_allows:?}",
                f.src, f.dst
            ));
        }
    }
    Ok(want.len())
}

#[test]
fn whatif_equals_the_difference_of_matrix_with_and_without_staged_policies() {
    fn prop(seed: u64) -> TestResult {
        match check(seed) {
            Ok(_) => TestResult::passed(),
            Err(e) => TestResult::error(e),
        }
    }
    QuickCheck::new()
        .tests(200)
        .max_tests(200)
        .quickcheck(prop as fn(u64) -> TestResult);
    // The property is not vacuous: staging changes verdicts in most clusters.
    let changing = (0..40u64)
        .filter(|s| check(*s).is_ok_and(|n| n > 0))
        .count();
    assert!(
        changing >= 10,
        "only {changing} of 40 clusters had a changed flow"
    );
}
