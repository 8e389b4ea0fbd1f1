//! `ordnet dump`: one endpoint's MapState trie (both directions, or one), rendered by
//! `ordnet_mapstate::dump` as a tree, JSON or Graphviz dot, with identity labels from the engine
//! and, per direction, what the default is and which policies isolate the endpoint.

use std::process::ExitCode;

use ordnet_engine::EndpointPolicy;
use ordnet_mapstate::Direction;
use ordnet_mapstate::dump::{Dump, TreeOptions};

use super::render::{self, Style};
use super::{DirectionArg, DumpArgs, DumpFormat};

/// Runs `ordnet dump`.
pub fn run(args: &DumpArgs) -> ExitCode {
    if let Some(addr) = &args.source.agent {
        if args.output != DumpFormat::Json {
            eprintln!(
                "ordnet dump: not implemented yet: --agent with -o tree or dot (use -o json)"
            );
            return ExitCode::from(2);
        }
        let mut query = format!("/v1/dump?pod={}", ordnet::agent::client::encode(&args.pod));
        match args.direction {
            Some(DirectionArg::Ingress) => query.push_str("&direction=ingress"),
            Some(DirectionArg::Egress) => query.push_str("&direction=egress"),
            None => {}
        }
        return ordnet::agent::client::print_answer("dump", addr, &query);
    }
    let engine = match render::load_engine("dump", &args.source) {
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
            Err(e) => e,
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
    let policies: Vec<&EndpointPolicy> = dirs.iter().map(|d| engine.policy(ep, *d)).collect();
    let mut dump = Dump::new(ep.id()).labels(|id| render::identity_label(&engine, id));
    for p in &policies {
        dump = dump.side(&p.mapstate, Some(default_note(&ep.id(), p)));
    }
    match args.output {
        DumpFormat::Json => print!("{}", dump.json_string()),
        DumpFormat::Dot => print!("{}", dump.dot()),
        DumpFormat::Tree => {
            let style = Style::new(render::color_wanted());
            let addrs: Vec<String> = ep
                .ips
                .iter()
                .zip(&ep.identities)
                .map(|(ip, id)| match render::identity_label(&engine, *id) {
                    Some(l) => format!("{ip} = identity {id} ({l})"),
                    None => format!("{ip} = identity {id}"),
                })
                .collect();
            println!(
                "{} {}",
                style.bold(&format!("endpoint {}:", ep.id())),
                addrs.join(", ")
            );
            println!();
            print!(
                "{}",
                dump.tree(TreeOptions {
                    color: style.color,
                    legend: true,
                    ..TreeOptions::default()
                })
            );
        }
    }
    ExitCode::SUCCESS
}

/// What the default is and why: `isolated by NetworkPolicy x/deny-all` / `not isolated`.
fn default_note(endpoint: &str, p: &EndpointPolicy) -> String {
    let dir = p.mapstate.direction();
    if p.isolated {
        let by: Vec<String> = p
            .isolated_by
            .iter()
            .map(|o| render::policy_name(o))
            .collect();
        format!("{endpoint} is isolated for {dir} by {}", by.join(", "))
    } else {
        format!("{endpoint} is not isolated for {dir}")
    }
}
