//! `ordnet dump`: one endpoint's MapState trie (both directions, or one), as a tree, JSON or
//! Graphviz dot. The output is `ordnet::render::dump`, which the agent's debug API uses for
//! `--agent` too.

use std::process::ExitCode;

use ordnet::render::dump::{Format, render};
use ordnet::render::{Style, color_wanted};
use ordnet_mapstate::Direction;

use super::load::{LoadedEngine, load_engine};
use super::{DirectionArg, DumpArgs, DumpFormat};

/// Runs `ordnet dump`.
pub fn run(args: &DumpArgs) -> ExitCode {
    let format = match args.output {
        DumpFormat::Tree => Format::Tree,
        DumpFormat::Json => Format::Json,
        DumpFormat::Dot => Format::Dot,
    };
    if let Some(addr) = &args.source.agent {
        let mut query = format!(
            "/v1/dump?pod={}&output={}&color={}",
            ordnet::agent::client::encode(&args.pod),
            format.as_str(),
            u8::from(color_wanted())
        );
        match args.direction {
            Some(DirectionArg::Ingress) => query.push_str("&direction=ingress"),
            Some(DirectionArg::Egress) => query.push_str("&direction=egress"),
            None => {}
        }
        return ordnet::agent::client::print_answer("dump", addr, &query);
    }
    let LoadedEngine { engine, exit, .. } = match load_engine("dump", &args.source) {
        Ok(e) => e,
        Err(code) => return code,
    };
    let Some((ns, name)) = args.pod.split_once('/') else {
        eprintln!("ordnet dump: --pod {}: expected NAMESPACE/NAME", args.pod);
        return ExitCode::from(1);
    };
    let Some(ep) = engine.endpoint(ns, name) else {
        // The engine's resolver says why (no such pod, host network, no address).
        let why = match engine.resolve(&args.pod) {
            Err(e) => e.to_string(),
            Ok(_) => format!("{} is not an endpoint", args.pod),
        };
        eprintln!("ordnet dump: --pod {}: {why}", args.pod);
        return ExitCode::from(1);
    };
    let dirs: Vec<Direction> = match args.direction {
        None => vec![Direction::Ingress, Direction::Egress],
        Some(DirectionArg::Ingress) => vec![Direction::Ingress],
        Some(DirectionArg::Egress) => vec![Direction::Egress],
    };
    let style = Style::new(color_wanted());
    print!("{}", render(&engine, ep, &dirs, format, style));
    exit
}
