//! `ordnet matrix`: the verdict of every ordered pair of endpoints on one protocol and port,
//! as a table or as CLI.md's JSON. Every pod is programmed as a local endpoint of an in-memory
//! datapath and every verdict is a crafted frame decided by the XDP program's own decision
//! function over the flattened maps (`ordnet::offline`).

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::process::ExitCode;

use ordnet_engine::IpFamily;

use super::MatrixArgs;
use super::TableOrJson;
use super::render::{self, Style};

/// Runs `ordnet matrix`.
pub fn run(args: &MatrixArgs) -> ExitCode {
    let family = match args.family {
        4 => IpFamily::V4,
        6 => IpFamily::V6,
        other => {
            eprintln!("ordnet matrix: --family must be 4 or 6, not {other}");
            return ExitCode::from(2);
        }
    };
    let mut externals: Vec<IpAddr> = Vec::new();
    for ip in &args.external {
        if !family.contains(*ip) {
            eprintln!(
                "ordnet matrix: --external {ip} is not an IPv{} address (--family {})",
                args.family, args.family
            );
            return ExitCode::from(2);
        }
        if !externals.contains(ip) {
            externals.push(*ip);
        }
    }
    if let Some(addr) = &args.source.agent {
        if args.output != TableOrJson::Json {
            eprintln!("ordnet matrix: not implemented yet: --agent with -o table (use -o json)");
            return ExitCode::from(2);
        }
        let mut query = format!(
            "/v1/matrix?protocol={}&port={}&family={}",
            format!("{:?}", args.protocol).to_uppercase(),
            args.port,
            args.family
        );
        for ip in &externals {
            query.push_str(&format!(
                "&external={}",
                ordnet::agent::client::encode(&ip.to_string())
            ));
        }
        return ordnet::agent::client::print_answer("matrix", addr, &query);
    }
    let engine = match render::load_engine("matrix", &args.source) {
        Ok(e) => e,
        Err(code) => return code,
    };
    let proto = render::protocol(args.protocol);
    let dp = match ordnet::offline::OfflineDatapath::build(&engine) {
        Ok(dp) => dp,
        Err(e) => {
            eprintln!("ordnet matrix: {e}");
            return ExitCode::from(1);
        }
    };
    let m = ordnet::offline::matrix(&engine, &dp, proto, args.port, &externals, family);
    match args.output {
        TableOrJson::Json => {
            println!(
                "{}",
                serde_json::to_string_pretty(&m).expect("the matrix serializes")
            );
        }
        TableOrJson::Table => {
            if m.endpoints.is_empty() {
                println!(
                    "no endpoints: no pod has an IPv{} address and no --external was given",
                    args.family
                );
                return ExitCode::SUCCESS;
            }
            let verdicts: BTreeMap<(String, String), _> = m
                .results
                .iter()
                .map(|r| ((r.from.clone(), r.to.clone()), r.verdict))
                .collect();
            let max_width = std::env::var("COLUMNS")
                .ok()
                .and_then(|c| c.parse().ok())
                .unwrap_or(160);
            let style = Style::new(render::color_wanted());
            print!(
                "{}",
                render::verdict_grid(
                    &format!("{proto}/{}", args.port),
                    &m.endpoints,
                    &verdicts,
                    style,
                    max_width
                )
            );
        }
    }
    ExitCode::SUCCESS
}
