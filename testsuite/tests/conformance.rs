//! The conformance scenarios (`data/conformance/`, a copy of the shared `conformance/`
//! directory) run through the CLI's code path: the manifest loader and validator of
//! `ordnet_crds`, `Engine::build`, every pod programmed as a local endpoint of an in-memory
//! datapath (`ordnet::offline::OfflineDatapath`, through `ordnet::program`, the agent's code
//! path) and `ordnet::offline::matrix`, which decides a crafted frame per pair with the XDP
//! program's decision function over the flattened maps (what `ordnet matrix` prints). The
//! engine's own MapState-lookup matrix (`ordnet_engine::matrix`) must agree pair by pair.
//!
//! For every scenario and every `expect` probe, every ordered pair of distinct endpoints (pods
//! with an IPv4 address, and the scenario's external addresses; pairs of two externals are skipped)
//! must have the verdict `default`, or the opposite one when the pair is listed in `exceptions`.
//! A pod with itself must be allowed. The endpoints are taken from the scenario's objects, not
//! from the engine, so an endpoint that the engine loses is reported too.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use ordnet_datapath::ControlPlane as _;
use ordnet_engine::MatrixVerdict;
use ordnet_engine::{Engine, IpFamily};
use ordnet_mapstate::Protocol;
use ordnet_testsuite::scenario::{self, Scenario};

/// The copy in this crate.
fn data_dir() -> PathBuf {
    scenario::data_dir("conformance")
}

/// The shared original: `../shared/conformance` relative to the workspace root.
fn shared_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/conformance")
}

fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("directory entry").path())
        .filter(|p| p.is_file())
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            let bytes = std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            (name, bytes)
        })
        .collect()
}

#[test]
fn copy_is_in_sync_with_shared() {
    let shared = shared_dir();
    if !shared.is_dir() {
        println!(
            "note: {} does not exist; the sync check of data/conformance is skipped",
            shared.display()
        );
        return;
    }
    let want = files(&shared);
    let have = files(&data_dir());
    let mut diffs = Vec::new();
    for (name, bytes) in &want {
        match have.get(name) {
            None => diffs.push(format!("missing in data/conformance: {name}")),
            Some(b) if b != bytes => diffs.push(format!("differs from shared: {name}")),
            Some(_) => {}
        }
    }
    for name in have.keys().filter(|n| !want.contains_key(*n)) {
        diffs.push(format!("not in shared (removed upstream?): {name}"));
    }
    assert!(
        diffs.is_empty(),
        "testsuite/data/conformance is out of sync with {}:\n  {}\nrefresh it with: \
         rm -r testsuite/data/conformance && cp -a {} testsuite/data/conformance",
        shared.display(),
        diffs.join("\n  "),
        shared.display()
    );
}

fn parse_protocol(s: &str) -> Result<Protocol, String> {
    Protocol::ALL
        .into_iter()
        .find(|p| p.as_str() == s)
        .ok_or_else(|| format!("unknown protocol {s:?}"))
}

/// Loads the objects exactly as `ordnet matrix -f` does (loader + validator) and builds the engine.
fn build(sc: &Scenario, path: &Path) -> Result<Engine, String> {
    let outcome = ordnet_crds::validated(ordnet_crds::load_str(path, &sc.manifest()));
    if outcome.has_errors() {
        let problems: Vec<String> = outcome
            .problems
            .iter()
            .filter(|p| p.is_error())
            .map(|p| p.to_string())
            .collect();
        return Err(format!("invalid objects:\n    {}", problems.join("\n    ")));
    }
    Ok(Engine::build(&outcome.objects))
}

struct Counts {
    scenarios: usize,
    probes: usize,
    pairs: usize,
}

/// Checks one scenario; returns the failure report (empty when it passes).
fn check(path: &Path, counts: &mut Counts) -> Vec<String> {
    let sc = match Scenario::load(path) {
        Ok(s) => s,
        Err(e) => return vec![e],
    };
    let stem = path.file_stem().unwrap().to_string_lossy();
    if sc.name != stem {
        return vec![format!(
            "{}: name {:?} is not the file name",
            path.display(),
            sc.name
        )];
    }
    let engine = match build(&sc, path) {
        Ok(e) => e,
        Err(e) => return vec![format!("{}: {e}", sc.name)],
    };
    counts.scenarios += 1;
    let pods = sc.pods(4);
    let dp = match ordnet::offline::OfflineDatapath::build(&engine) {
        Ok(dp) => dp,
        Err(e) => return vec![format!("{}: programming the datapath: {e}", sc.name)],
    };
    // Every pod is a local endpoint of the datapath, so every pair is decided by its lookups.
    if dp.datapath.endpoints().len() != pods.len() {
        return vec![format!(
            "{}: {} endpoints programmed for {} pods",
            sc.name,
            dp.datapath.endpoints().len(),
            pods.len()
        )];
    }
    let all: Vec<String> = pods.iter().cloned().chain(sc.external_names()).collect();
    let is_pod: BTreeSet<&String> = pods.iter().collect();
    let mut report = Vec::new();
    for probe in &sc.expect {
        let what = format!("{} {}/{}", sc.name, probe.protocol, probe.port);
        let proto = match (parse_protocol(&probe.protocol), probe.default_allows()) {
            (Ok(p), Ok(_)) => p,
            (Err(e), _) | (_, Err(e)) => {
                report.push(format!("{what}: {e}"));
                continue;
            }
        };
        counts.probes += 1;
        let services = sc.services(&probe.protocol, probe.port, 4);
        for ex in probe.bad_exceptions(&all, &services) {
            report.push(format!(
                "{what}: exception {ex:?} names no pair of endpoints"
            ));
        }
        let m = ordnet::offline::matrix(
            &engine,
            dp.plane(),
            proto,
            probe.port,
            &sc.externals,
            IpFamily::V4,
        );
        let by_engine =
            ordnet_engine::matrix(&engine, proto, probe.port, &sc.externals, IpFamily::V4);
        if m != by_engine {
            report.push(format!(
                "{what}: the datapath's matrix differs from the engine's MapState lookups"
            ));
        }
        let mut got: BTreeMap<(String, String), Vec<MatrixVerdict>> = BTreeMap::new();
        for r in &m.results {
            got.entry((r.from.clone(), r.to.clone()))
                .or_default()
                .push(r.verdict);
        }
        let mut wrong = Vec::new();
        for from in &all {
            for to in all.iter().chain(&services) {
                if !is_pod.contains(from) && !is_pod.contains(to) && !services.contains(to) {
                    continue;
                }
                let pair = (from.clone(), to.clone());
                let want = match probe.verdict(from, to) {
                    Ok(v) => v,
                    Err(e) => {
                        wrong.push(e);
                        continue;
                    }
                };
                counts.pairs += 1;
                match got.remove(&pair).as_deref() {
                    Some([v]) if v.as_str() == want => {}
                    Some([v]) => wrong.push(format!("{from} -> {to}: expected {want}, got {v}")),
                    Some(vs) => wrong.push(format!(
                        "{from} -> {to}: expected {want}, got {} results {vs:?}",
                        vs.len()
                    )),
                    None => wrong.push(format!("{from} -> {to}: expected {want}, missing")),
                }
            }
        }
        for ((from, to), vs) in got {
            wrong.push(format!(
                "{from} -> {to}: unexpected pair in the matrix ({vs:?})"
            ));
        }
        if !wrong.is_empty() {
            report.push(format!(
                "{what} (default {}): {} wrong pair{}:\n    {}",
                probe.default,
                wrong.len(),
                if wrong.len() == 1 { "" } else { "s" },
                wrong.join("\n    ")
            ));
        }
    }
    report
}

#[test]
fn every_scenario_passes_through_the_matrix() {
    let scenarios = scenario::conformance_files();
    assert!(
        scenarios.len() >= 70,
        "expected the conformance scenarios in {} and data/scenarios",
        data_dir().display()
    );
    let mut counts = Counts {
        scenarios: 0,
        probes: 0,
        pairs: 0,
    };
    let mut failed = Vec::new();
    for path in &scenarios {
        let report = check(path, &mut counts);
        if !report.is_empty() {
            failed.push(report.join("\n  "));
        }
    }
    println!(
        "conformance: {} scenarios, {} probes, {} pairs checked, {} scenario(s) failing",
        counts.scenarios,
        counts.probes,
        counts.pairs,
        failed.len()
    );
    assert!(
        failed.is_empty(),
        "{} of {} conformance scenarios fail:\n  {}",
        failed.len(),
        scenarios.len(),
        failed.join("\n  ")
    );
}
