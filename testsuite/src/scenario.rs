//! The scenario files of `data/conformance/` (a copy of the shared `conformance/` directory)
//! and `data/lab/`: their objects, external addresses, expected matrices and endpoints. The
//! one reader of that format for every test that uses the scenarios.

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// `data/<sub>` of this crate (`conformance` or `lab`).
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

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    pub name: String,
    pub source: String,
    pub description: String,
    /// Only in `data/lab`: the family the pods are probed at.
    #[serde(default)]
    pub family: Option<u8>,
    pub objects: Vec<serde_yaml::Value>,
    #[serde(default)]
    pub externals: Vec<IpAddr>,
    pub expect: Vec<Probe>,
}

/// One expected matrix: every ordered pair of distinct endpoints has the verdict `default`,
/// or the opposite one when listed in `exceptions` as `"from -> to"`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Probe {
    pub protocol: String,
    pub port: u16,
    pub default: String,
    #[serde(default)]
    pub exceptions: Vec<String>,
}

impl Scenario {
    /// Reads and parses one scenario file (unknown fields are errors).
    pub fn load(path: &Path) -> Result<Scenario, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        serde_yaml::from_str(&text)
            .map_err(|e| format!("{}: unreadable scenario: {e}", path.display()))
    }

    /// The objects as one multi-document YAML stream (what `ordnet ... -f` reads).
    pub fn manifest(&self) -> String {
        self.objects
            .iter()
            .map(|o| format!("---\n{}", serde_yaml::to_string(o).expect("YAML")))
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
    pub fn allows(&self, from: &str, to: &str) -> Result<bool, String> {
        let default = self.default_allows()?;
        Ok(if from == to {
            true
        } else if self
            .exceptions
            .iter()
            .any(|e| *e == format!("{from} -> {to}"))
        {
            !default
        } else {
            default
        })
    }

    /// The exceptions that name no ordered pair of two distinct endpoints of `endpoints`.
    pub fn bad_exceptions<'a>(&'a self, endpoints: &[String]) -> Vec<&'a str> {
        self.exceptions
            .iter()
            .filter(|ex| match ex.split_once(" -> ") {
                Some((a, b)) => {
                    a == b || !endpoints.iter().any(|e| e == a) || !endpoints.iter().any(|e| e == b)
                }
                None => true,
            })
            .map(String::as_str)
            .collect()
    }
}
