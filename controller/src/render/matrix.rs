//! `ordnet matrix` output: the verdict grid (rows = sources, columns = destinations) or
//! CLI.md's JSON.

use std::collections::BTreeMap;

use ordnet_engine::{IpFamily, Matrix, MatrixVerdict};

use super::Style;

/// Output formats of `matrix`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// The verdict grid ([`super::verdict_grid`]).
    Table,
    /// CLI.md's JSON (the serialized [`Matrix`]).
    Json,
}

impl Format {
    /// `table` or `json`.
    pub fn parse(s: &str) -> Option<Format> {
        match s {
            "table" => Some(Format::Table),
            "json" => Some(Format::Json),
            _ => None,
        }
    }

    /// The name [`Format::parse`] reads.
    pub fn as_str(self) -> &'static str {
        match self {
            Format::Table => "table",
            Format::Json => "json",
        }
    }
}

/// The output of `ordnet matrix` for `m` (probed over `family`); the table gets numbered
/// columns when named ones would be wider than `max_width`.
pub fn render(
    m: &Matrix,
    family: IpFamily,
    format: Format,
    style: Style,
    max_width: usize,
) -> String {
    match format {
        Format::Json => serde_json::to_string_pretty(m).expect("the matrix serializes") + "\n",
        Format::Table => {
            if m.endpoints.is_empty() {
                let n = match family {
                    IpFamily::V4 => 4,
                    IpFamily::V6 => 6,
                };
                return format!(
                    "no endpoints: no pod has an IPv{n} address and no --external was given\n"
                );
            }
            let verdicts: BTreeMap<(String, String), MatrixVerdict> = m
                .results
                .iter()
                .map(|r| ((r.from.clone(), r.to.clone()), r.verdict))
                .collect();
            super::verdict_grid(
                &format!("{}/{}", m.protocol, m.port),
                &m.endpoints,
                &m.services,
                &verdicts,
                style,
                max_width,
            )
        }
    }
}
