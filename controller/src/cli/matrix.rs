//! `ordnet matrix`: the verdict of every ordered pair of endpoints on one protocol and port,
//! as a table or as CLI.md's JSON. Every pod is programmed as a local endpoint of an in-memory
//! datapath and every verdict is a crafted frame decided by the XDP program's own decision
//! function over the flattened maps (`ordnet::offline`). The output is `ordnet::render::matrix`,
//! which the agent's debug API uses for `--agent` too.

use std::net::IpAddr;
use std::process::ExitCode;

use ordnet::render::matrix::{Format, render};
use ordnet::render::{Style, color_wanted};
use ordnet_engine::IpFamily;

use super::load::{LoadedEngine, load_engine, protocol};
use super::{MatrixArgs, TableOrJson};

/// The width the table may take: `$COLUMNS`, else 160.
fn max_width() -> usize {
    std::env::var("COLUMNS")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(160)
}

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
    let format = match args.output {
        TableOrJson::Table => Format::Table,
        TableOrJson::Json => Format::Json,
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
    let proto = protocol(args.protocol);
    if let Some(addr) = &args.source.agent {
        let mut query = format!(
            "/v1/matrix?protocol={proto}&port={}&family={}&output={}&color={}&width={}",
            args.port,
            args.family,
            format.as_str(),
            u8::from(color_wanted()),
            max_width()
        );
        for ip in &externals {
            query.push_str(&format!(
                "&external={}",
                ordnet::agent::client::encode(&ip.to_string())
            ));
        }
        return ordnet::agent::client::print_answer("matrix", addr, &query);
    }
    let loaded = match load_engine("matrix", &args.source) {
        Ok(e) => e,
        Err(code) => return code,
    };
    let staged = loaded.staged_view();
    let LoadedEngine { engine, exit, .. } = loaded;
    let dp = match ordnet::offline::OfflineDatapath::build(&engine) {
        Ok(dp) => dp,
        Err(e) => {
            eprintln!("ordnet matrix: {e}");
            return ExitCode::from(1);
        }
    };
    let m = ordnet::offline::matrix(&engine, dp.plane(), proto, args.port, &externals, family);
    let style = Style::new(color_wanted());
    print!("{}", render(&m, family, format, style, max_width()));
    // Staged policies are left out above; say what they would change (stderr: the answer on
    // stdout stays the contract's).
    if let Some(view) = staged {
        match ordnet::offline::OfflineDatapath::build(&view) {
            Ok(sdp) => {
                let s = ordnet::offline::matrix(
                    &view,
                    sdp.plane(),
                    proto,
                    args.port,
                    &externals,
                    family,
                );
                eprint!("{}", staged_note(&m, &s));
            }
            Err(e) => eprintln!("ordnet matrix: the staged policies: {e}"),
        }
    }
    exit
}

/// The cells where the matrix with the staged policies enforced (`staged`) differs from `m`.
fn staged_note(m: &ordnet_engine::Matrix, staged: &ordnet_engine::Matrix) -> String {
    let changes: Vec<String> = m
        .results
        .iter()
        .filter_map(|r| {
            let now = staged.verdict(&r.from, &r.to)?;
            (now != r.verdict).then(|| {
                format!(
                    "  {} -> {}: {} -> {}",
                    r.from,
                    r.to,
                    r.verdict.as_str(),
                    now.as_str()
                )
            })
        })
        .collect();
    let mut out = format!(
        "ordnet matrix: staged policies are left out (spec.mode: Staged); enforced (--staged), they would change {} cell{}",
        changes.len(),
        if changes.len() == 1 { "" } else { "s" }
    );
    out.push_str(if changes.is_empty() { "\n" } else { ":\n" });
    for c in changes {
        out.push_str(&c);
        out.push('\n');
    }
    out
}
