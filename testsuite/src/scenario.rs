//! The scenario files of `data/conformance/` (a copy of the shared `conformance/` directory),
//! `data/scenarios/` (our own, same format) and `data/lab/`: their objects, external addresses,
//! expected matrices and endpoints. The one reader of that format for every test that uses the
//! scenarios.

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// The directories whose scenarios every conformance test runs: the shared copy and our own.
pub const CONFORMANCE_DIRS: [&str; 2] = ["conformance", "scenarios"];

/// `data/<sub>` of this crate (`conformance`, `scenarios`, `lab` or `invalid`).
pub fn data_dir(sub: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("data").join(sub)
}

/// The scenario named `name` in `data/<sub>`.
pub fn path(sub: &str, name: &str) -> PathBuf {
    data_dir(sub).join(format!("{name}.yaml"))
}

/// The `.yaml` files of `dir`, sorted.
pub fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("directory entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    out.sort();
    out
}

/// The scenario named `name` in the first of [`CONFORMANCE_DIRS`] that has it (the path in
/// `data/conformance` when neither has it, so the error names the usual place).
pub fn find(name: &str) -> PathBuf {
    CONFORMANCE_DIRS
        .iter()
        .map(|d| path(d, name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| path(CONFORMANCE_DIRS[0], name))
}

/// Every scenario of [`CONFORMANCE_DIRS`], sorted by directory, then name.
pub fn conformance_files() -> Vec<PathBuf> {
    CONFORMANCE_DIRS
        .iter()
        .flat_map(|d| files(&data_dir(d)))
        .collect()
}

/// One scenario file (format: `data/conformance/README.md`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// The scenario's name: the file name without `.yaml`.
    pub name: String,
    /// Where the case comes from (an upstream e2e test, or `edge case: ...` for our own).
    pub source: String,
    /// One or two sentences on what the scenario checks.
    pub description: String,
    /// Only in `data/lab`: the family the pods are probed at.
    #[serde(default)]
    pub family: Option<u8>,
    /// The Kubernetes objects, as applied (Namespaces, Pods, Services, policies).
    pub objects: Vec<yaml_serde::Value>,
    /// Extra endpoints: addresses outside the cluster (passed as `--external`).
    #[serde(default)]
    pub externals: Vec<IpAddr>,
    /// The expected matrices, one per probed protocol and port.
    pub expect: Vec<Probe>,
}

/// One expected matrix: every ordered pair of distinct endpoints has the verdict `default`,
/// or the opposite one when listed in `exceptions` as `"from -> to"`; a pair towards a Service
/// listed as `"from -> svc:ns/name = mixed"` is mixed (some of its backends allowed).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Probe {
    /// `TCP`, `UDP` or `SCTP`.
    pub protocol: String,
    /// The destination port probed.
    pub port: u16,
    /// `allow` or `deny`: the verdict of every pair not listed in `exceptions`.
    pub default: String,
    /// Pairs with the opposite verdict (`"from -> to"`), or mixed Service pairs.
    #[serde(default)]
    pub exceptions: Vec<String>,
}

impl Scenario {
    /// Reads and parses one scenario file (unknown fields are errors).
    pub fn load(path: &Path) -> Result<Scenario, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        yaml_serde::from_str(&text)
            .map_err(|e| format!("{}: unreadable scenario: {e}", path.display()))
    }

    /// The objects as one multi-document YAML stream (what `ordnet ... -f` reads).
    pub fn manifest(&self) -> String {
        self.objects
            .iter()
            .map(|o| format!("---\n{}", yaml_serde::to_string(o).expect("YAML")))
            .collect()
    }

    /// The pods that are endpoints at `family` (4 or 6), as `namespace/name`, sorted: not
    /// `hostNetwork`, with an address of that family in `status.podIPs` or `status.podIP`.
    /// Taken from the objects, not from an engine, so an endpoint that one loses is noticed.
    pub fn pods(&self, family: u8) -> Vec<String> {
        let mut out: Vec<String> = self
            .objects
            .iter()
            .filter(|o| o["kind"].as_str() == Some("Pod"))
            .filter(|o| o["spec"]["hostNetwork"].as_bool() != Some(true))
            .filter(|o| {
                let mut ips: Vec<&str> = o["status"]["podIPs"]
                    .as_sequence()
                    .map(|s| s.iter().filter_map(|p| p["ip"].as_str()).collect())
                    .unwrap_or_default();
                ips.extend(o["status"]["podIP"].as_str());
                ips.iter()
                    .filter_map(|ip| ip.parse::<IpAddr>().ok())
                    .any(|ip| ip.is_ipv4() == (family == 4))
            })
            .map(|o| {
                format!(
                    "{}/{}",
                    o["metadata"]["namespace"].as_str().unwrap_or("default"),
                    o["metadata"]["name"].as_str().expect("pod name")
                )
            })
            .collect();
        out.sort();
        out
    }

    /// The external addresses as the matrix names them.
    pub fn external_names(&self) -> Vec<String> {
        self.externals.iter().map(|ip| ip.to_string()).collect()
    }

    /// The Services a matrix probes on (`protocol`, `port`) at `family` (CLI.md), as
    /// `svc:namespace/name`, sorted: a port of that protocol and number, a ClusterIP of the
    /// family (`spec.clusterIP` or `spec.clusterIPs`), and at least one backend: a pod of the
    /// Service's namespace that its (non-empty) selector selects, not reported unready
    /// (condition Ready=False), that is an endpoint at the
    /// family (see [`Scenario::pods`]) and, for a named `targetPort`, has a container port of
    /// that name and protocol. Read from the objects, independently of the engine.
    pub fn services(&self, protocol: &str, port: u16, family: u8) -> Vec<String> {
        let pods = self.pods(family);
        let mut out: Vec<String> = self
            .objects
            .iter()
            .filter(|o| o["kind"].as_str() == Some("Service"))
            .filter_map(|svc| {
                let ns = svc["metadata"]["namespace"].as_str().unwrap_or("default");
                let name = svc["metadata"]["name"].as_str()?;
                let spec = &svc["spec"];
                let mut ips: Vec<&str> = spec["clusterIPs"]
                    .as_sequence()
                    .map(|s| s.iter().filter_map(|v| v.as_str()).collect())
                    .unwrap_or_default();
                ips.extend(spec["clusterIP"].as_str());
                let has_ip = ips
                    .iter()
                    .filter_map(|ip| ip.parse::<IpAddr>().ok())
                    .any(|ip| ip.is_ipv4() == (family == 4));
                let sp = spec["ports"].as_sequence()?.iter().find(|p| {
                    p["protocol"].as_str().unwrap_or("TCP") == protocol
                        && p["port"].as_u64() == Some(u64::from(port))
                })?;
                let selector = spec["selector"].as_mapping().filter(|m| !m.is_empty())?;
                let named = sp["targetPort"]
                    .as_str()
                    .filter(|t| t.parse::<u16>().is_err());
                let backend = self.objects.iter().any(|pod| {
                    pod["kind"].as_str() == Some("Pod")
                        && pod["metadata"]["namespace"].as_str().unwrap_or("default") == ns
                        && pods.contains(&format!(
                            "{ns}/{}",
                            pod["metadata"]["name"].as_str().unwrap_or_default()
                        ))
                        && selector
                            .iter()
                            .all(|(k, v)| pod["metadata"]["labels"][k] == *v)
                        && !pod["status"]["conditions"]
                            .as_sequence()
                            .into_iter()
                            .flatten()
                            .any(|c| {
                                c["type"].as_str() == Some("Ready")
                                    && c["status"].as_str() == Some("False")
                            })
                        && named.is_none_or(|n| {
                            pod["spec"]["containers"]
                                .as_sequence()
                                .into_iter()
                                .flatten()
                                .flat_map(|c| c["ports"].as_sequence().into_iter().flatten())
                                .any(|cp| {
                                    cp["name"].as_str() == Some(n)
                                        && cp["protocol"].as_str().unwrap_or("TCP") == protocol
                                })
                        })
                });
                (has_ip && backend).then(|| format!("svc:{ns}/{name}"))
            })
            .collect();
        out.sort();
        out
    }
}

impl Probe {
    /// Whether `default` allows: `"allow"` or `"deny"`, anything else is an error.
    pub fn default_allows(&self) -> Result<bool, String> {
        match self.default.as_str() {
            "allow" => Ok(true),
            "deny" => Ok(false),
            other => Err(format!("unknown verdict {other:?}")),
        }
    }

    /// Whether the pair `from -> to` is expected to be allowed: an endpoint with itself
    /// always; a pair listed in `exceptions` the opposite of `default`; any other `default`.
    /// An error for a pair expected `mixed` (use [`Probe::verdict`]).
    pub fn allows(&self, from: &str, to: &str) -> Result<bool, String> {
        match self.verdict(from, to)? {
            "allow" => Ok(true),
            "deny" => Ok(false),
            v => Err(format!("{from} -> {to} is expected {v}")),
        }
    }

    /// The expected verdict of `from -> to`: `"allow"`, `"deny"` or `"mixed"` (towards a
    /// Service: some of its backends allowed).
    pub fn verdict(&self, from: &str, to: &str) -> Result<&'static str, String> {
        let default = self.default_allows()?;
        let pair = format!("{from} -> {to}");
        if from == to {
            return Ok("allow");
        }
        for e in &self.exceptions {
            match e.split_once(" = ") {
                Some((p, "mixed")) if p == pair => return Ok("mixed"),
                Some((p, v)) if p == pair => {
                    return Err(format!("exception {e:?}: unknown verdict {v:?}"));
                }
                None if *e == pair => return Ok(if default { "deny" } else { "allow" }),
                _ => {}
            }
        }
        Ok(if default { "allow" } else { "deny" })
    }

    /// The exceptions that name no ordered pair of two distinct endpoints of `endpoints` (as
    /// sources and destinations) or a source of `endpoints` and a Service of `services`.
    pub fn bad_exceptions<'a>(&'a self, endpoints: &[String], services: &[String]) -> Vec<&'a str> {
        self.exceptions
            .iter()
            .filter(|ex| {
                let (pair, mixed) = match ex.split_once(" = ") {
                    Some((p, "mixed")) => (p, true),
                    Some(_) => return true,
                    None => (ex.as_str(), false),
                };
                match pair.split_once(" -> ") {
                    Some((a, b)) => {
                        let service = services.iter().any(|s| s == b);
                        a == b
                            || !endpoints.iter().any(|e| e == a)
                            || !(service || endpoints.iter().any(|e| e == b))
                            || (mixed && !service)
                    }
                    None => true,
                }
            })
            .map(String::as_str)
            .collect()
    }
}
