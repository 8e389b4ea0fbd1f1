//! Every conformance scenario through `Engine::build` + `matrix` (the engine's own check; the
//! testsuite runs the same scenarios through the CLI's path).

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use ordnet_engine::{Engine, IpFamily, matrix};
use ordnet_mapstate::{Protocol, Verdict};
use serde::Deserialize;

#[derive(Deserialize)]
struct Scenario {
    name: String,
    objects: Vec<serde_yaml::Value>,
    #[serde(default)]
    externals: Vec<IpAddr>,
    expect: Vec<Probe>,
}

#[derive(Deserialize)]
struct Probe {
    protocol: String,
    port: u16,
    default: String,
    #[serde(default)]
    exceptions: Vec<String>,
}

fn dir() -> PathBuf {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    let copy = here.join("../testsuite/data/conformance");
    if copy.is_dir() {
        copy
    } else {
        here.join("../../shared/conformance")
    }
}

fn proto(s: &str) -> Protocol {
    Protocol::ALL
        .into_iter()
        .find(|p| p.as_str() == s)
        .expect("protocol")
}

#[test]
fn conformance_scenarios() {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir())
        .expect("scenario directory")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    assert!(files.len() >= 60, "only {} scenarios found", files.len());
    let mut failures = Vec::new();
    let mut pairs = 0;
    for path in &files {
        let sc: Scenario =
            serde_yaml::from_str(&std::fs::read_to_string(path).expect("read")).expect("yaml");
        let stream: String = sc
            .objects
            .iter()
            .map(|o| format!("---\n{}", serde_yaml::to_string(o).expect("yaml")))
            .collect();
        let outcome = ordnet_crds::validated(ordnet_crds::manifest::load_str(path, &stream));
        assert!(!outcome.has_errors(), "{}: invalid objects", sc.name);
        let engine = Engine::build(&outcome.objects);
        assert!(
            engine.errors().is_empty(),
            "{}: {:?}",
            sc.name,
            engine.errors()
        );
        for p in &sc.expect {
            let default = if p.default == "allow" {
                Verdict::Allow
            } else {
                Verdict::Deny
            };
            let exceptions: BTreeSet<&str> = p.exceptions.iter().map(String::as_str).collect();
            let m = matrix(
                &engine,
                proto(&p.protocol),
                p.port,
                &sc.externals,
                IpFamily::V4,
            );
            for r in &m.results {
                pairs += 1;
                let key = format!("{} -> {}", r.from, r.to);
                let want = if r.from == r.to {
                    Verdict::Allow
                } else if exceptions.contains(key.as_str()) {
                    if default == Verdict::Allow {
                        Verdict::Deny
                    } else {
                        Verdict::Allow
                    }
                } else {
                    default
                };
                if r.verdict != want {
                    failures.push(format!(
                        "{} {}/{}: {key}: expected {want}, got {}",
                        sc.name, p.protocol, p.port, r.verdict
                    ));
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} wrong:\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert!(pairs > 1000);
}
