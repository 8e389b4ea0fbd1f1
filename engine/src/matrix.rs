//! The `matrix` computation (`ordnet matrix`).

use std::net::IpAddr;

use ordnet_mapstate::{Protocol, Verdict};
use serde::Serialize;

use crate::engine::{Engine, FlowEnd, IpFamily, ser_verdict};

/// The verdict of every ordered pair of endpoints for one protocol and port.
///
/// Serializes as CLI.md's JSON: `{"protocol":"TCP","port":80,"results":[{"from":"x/a","to":"y/b",
/// "verdict":"allow"},...]}` (`endpoints` is not serialized).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Matrix {
    pub protocol: Protocol,
    pub port: u16,
    /// Row/column order: pods (`ns/name`, sorted) then external addresses (as given).
    #[serde(skip)]
    pub endpoints: Vec<String>,
    /// Row-major: for each source in `endpoints`, each destination in `endpoints`; pairs of two
    /// external addresses are left out.
    pub results: Vec<MatrixResult>,
}

/// One pair of a [`Matrix`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MatrixResult {
    pub from: String,
    pub to: String,
    #[serde(serialize_with = "ser_verdict")]
    pub verdict: Verdict,
}

impl Matrix {
    /// The verdict of one pair, if it is in the matrix.
    pub fn verdict(&self, from: &str, to: &str) -> Option<Verdict> {
        self.results
            .iter()
            .find(|r| r.from == from && r.to == to)
            .map(|r| r.verdict)
    }
}

/// Computes the matrix: every pod endpoint with an address of `family` (probed at its first
/// address of that family; the primary one when it is of that family) and every external address,
/// as sources and destinations. A pod with itself is included (always allowed); pairs of two
/// external addresses are not. Each verdict is [`Engine::flow`], i.e. MapState lookups only.
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
                verdict: t.verdict,
            });
        }
    }
    Matrix {
        protocol: proto,
        port,
        endpoints: ends.into_iter().map(|(n, _, _)| n).collect(),
        results,
    }
}
