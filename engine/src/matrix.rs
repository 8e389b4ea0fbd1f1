//! The `matrix` computation (`ordnet matrix`).

use std::net::IpAddr;

use ordnet_mapstate::{Protocol, Verdict};
use serde::Serialize;
use serde::ser::SerializeStruct;

use crate::engine::{Engine, FlowEnd, IpFamily, ser_verdict};

/// The verdict of every ordered pair of endpoints, and of every endpoint towards every Service,
/// for one protocol and port.
///
/// Serializes as CLI.md's JSON: `{"protocol":"TCP","port":80,"results":[{"from":"x/a","to":"y/b",
/// "verdict":"allow"},...]}` (`endpoints` and `services` are not serialized).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Matrix {
    pub protocol: Protocol,
    pub port: u16,
    /// Row/column order: pods (`ns/name`, sorted) then external addresses (as given).
    #[serde(skip)]
    pub endpoints: Vec<String>,
    /// More columns (destinations only): the Services probed (`svc:ns/name`, sorted).
    #[serde(skip)]
    pub services: Vec<String>,
    /// Row-major: for each source in `endpoints`, each destination in `endpoints` then in
    /// `services`; pairs of two external addresses are left out.
    pub results: Vec<MatrixResult>,
}

/// The verdict of one pair: a flow to a pod or an address is allowed or denied; a flow to a
/// Service can also be allowed to some of its backends only.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum MatrixVerdict {
    Allow,
    Deny,
    /// Some backends allowed, some denied.
    Mixed,
}

impl MatrixVerdict {
    /// `allow`, `deny` or `mixed`.
    pub fn as_str(self) -> &'static str {
        match self {
            MatrixVerdict::Allow => "allow",
            MatrixVerdict::Deny => "deny",
            MatrixVerdict::Mixed => "mixed",
        }
    }

    /// The verdict towards a Service from the verdicts towards its backends (at least one).
    pub fn of(backends: impl IntoIterator<Item = Verdict>) -> MatrixVerdict {
        let (mut allow, mut deny) = (false, false);
        for v in backends {
            match v {
                Verdict::Allow => allow = true,
                Verdict::Deny => deny = true,
            }
        }
        match (allow, deny) {
            (true, true) => MatrixVerdict::Mixed,
            (true, false) => MatrixVerdict::Allow,
            _ => MatrixVerdict::Deny,
        }
    }
}

impl From<Verdict> for MatrixVerdict {
    fn from(v: Verdict) -> Self {
        match v {
            Verdict::Allow => MatrixVerdict::Allow,
            Verdict::Deny => MatrixVerdict::Deny,
        }
    }
}

impl PartialEq<Verdict> for MatrixVerdict {
    fn eq(&self, other: &Verdict) -> bool {
        *self == MatrixVerdict::from(*other)
    }
}

impl std::fmt::Display for MatrixVerdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The verdict towards one backend of a Service.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BackendVerdict {
    /// `ns/name` of the backend pod.
    pub to: String,
    #[serde(serialize_with = "ser_verdict")]
    pub verdict: Verdict,
}

/// One pair of a [`Matrix`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MatrixResult {
    pub from: String,
    pub to: String,
    pub verdict: MatrixVerdict,
    /// Towards a Service: the verdict of every backend (serialized only when `mixed`).
    pub backends: Vec<BackendVerdict>,
}

impl Serialize for MatrixResult {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mixed = self.verdict == MatrixVerdict::Mixed;
        let mut st = s.serialize_struct("MatrixResult", if mixed { 4 } else { 3 })?;
        st.serialize_field("from", &self.from)?;
        st.serialize_field("to", &self.to)?;
        st.serialize_field("verdict", &self.verdict)?;
        if mixed {
            st.serialize_field("backends", &self.backends)?;
        }
        st.end()
    }
}

impl Matrix {
    /// The verdict of one pair, if it is in the matrix.
    pub fn verdict(&self, from: &str, to: &str) -> Option<MatrixVerdict> {
        self.results
            .iter()
            .find(|r| r.from == from && r.to == to)
            .map(|r| r.verdict)
    }

    /// Every destination column: `endpoints`, then `services`.
    pub fn destinations(&self) -> impl Iterator<Item = &String> {
        self.endpoints.iter().chain(&self.services)
    }
}

/// Computes the matrix: every pod endpoint with an address of `family` (probed at its first
/// address of that family; the primary one when it is of that family) and every external address,
/// as sources and destinations, and every Service ([`Engine::service_destinations`]) as a
/// destination. A pod with itself is included (always allowed); pairs of two external addresses
/// are not. Each verdict is [`Engine::flow`], i.e. MapState lookups only; towards a Service, the
/// flow to each backend at its target port (a backend that is the source itself: allowed, a
/// pod's own traffic).
pub fn matrix(
    engine: &Engine,
    proto: Protocol,
    port: u16,
    externals: &[IpAddr],
    family: IpFamily,
) -> Matrix {
    let mut ends: Vec<(String, FlowEnd, bool)> = Vec::new();
    for ep in engine.endpoints() {
        if ep.address(family).is_some() {
            ends.push((
                ep.id(),
                FlowEnd::Pod {
                    namespace: ep.namespace.clone(),
                    name: ep.name.clone(),
                },
                true,
            ));
        }
    }
    for ip in externals {
        ends.push((ip.to_string(), FlowEnd::Ip(*ip), false));
    }
    let services = engine.service_destinations(proto, port, family);
    let mut results = Vec::new();
    for (from_name, from, from_pod) in &ends {
        for (to_name, to, to_pod) in &ends {
            if !from_pod && !to_pod {
                continue;
            }
            let t = engine.flow(from, to, family, proto, port);
            results.push(MatrixResult {
                from: from_name.clone(),
                to: to_name.clone(),
                verdict: t.verdict.into(),
                backends: Vec::new(),
            });
        }
        for svc in &services {
            let backends: Vec<BackendVerdict> = svc
                .backends
                .iter()
                .map(|(pod, _, bport)| {
                    let (ns, name) = pod.split_once('/').unwrap_or(("", pod));
                    let to = FlowEnd::Pod {
                        namespace: ns.to_string(),
                        name: name.to_string(),
                    };
                    BackendVerdict {
                        to: pod.clone(),
                        verdict: engine.flow(from, &to, family, proto, *bport).verdict,
                    }
                })
                .collect();
            results.push(MatrixResult {
                from: from_name.clone(),
                to: svc.name.clone(),
                verdict: MatrixVerdict::of(backends.iter().map(|b| b.verdict)),
                backends,
            });
        }
    }
    Matrix {
        protocol: proto,
        port,
        endpoints: ends.into_iter().map(|(n, _, _)| n).collect(),
        services: services.into_iter().map(|s| s.name).collect(),
        results,
    }
}
