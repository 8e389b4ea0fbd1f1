//! `ordnet whatif`: a flow history replayed against the manifests with their staged policies
//! enforced; prints the flows whose verdict would change (`ordnet::whatif`). With `--agent`,
//! the agent's own flow history against its objects plus the manifests (`POST /v1/whatif`).

use std::process::ExitCode;

use super::load::{LoadedEngine, load_engine};
use super::{Source, TextOrJson, WhatifArgs};

/// Runs `ordnet whatif`.
pub fn run(args: &WhatifArgs) -> ExitCode {
    if let Some(addr) = &args.agent {
        return ask_agent(args, addr);
    }
    let Some(path) = &args.flows else {
        eprintln!("ordnet whatif: --flows or --agent is required");
        return ExitCode::from(2);
    };
    let text = if path.as_os_str() == "-" {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut s).map(|_| s)
    } else {
        std::fs::read_to_string(path)
    };
    let text = match text {
        Ok(t) => t,
        Err(e) => {
            eprintln!("ordnet whatif: --flows {}: {e}", path.display());
            return ExitCode::from(1);
        }
    };
    let history = match ordnet::whatif::read_history(&text) {
        Ok(h) => h,
        Err(e) => {
            eprintln!("ordnet whatif: --flows {}: {e}", path.display());
            return ExitCode::from(1);
        }
    };
    let source = Source {
        files: args.files.clone(),
        agent: None,
        staged: true,
    };
    let LoadedEngine { engine, exit, .. } = match load_engine("whatif", &source) {
        Ok(e) => e,
        Err(code) => return code,
    };
    let changed = ordnet::whatif::replay(&engine, &history.flows);
    match args.output {
        TextOrJson::Text => print!("{}", ordnet::whatif::text(&history, &changed)),
        TextOrJson::Json => print!("{}", ordnet::whatif::json(&history, &changed)),
    }
    exit
}

/// `--agent`: the manifests, validated here (errors name their files), sent as JSON documents.
fn ask_agent(args: &WhatifArgs, addr: &str) -> ExitCode {
    let outcome = ordnet_crds::load_and_validate(&args.files);
    for p in &outcome.problems {
        eprintln!("{p}");
    }
    let errors = outcome.problems.iter().filter(|p| p.is_error()).count();
    if errors > 0 {
        eprintln!(
            "ordnet whatif: {errors} error{} in the manifests; nothing asked",
            if errors == 1 { "" } else { "s" }
        );
        return ExitCode::from(1);
    }
    let o = &outcome.objects;
    let mut docs: Vec<String> = Vec::new();
    let mut add = |v: serde_json::Result<String>| docs.extend(v.ok());
    o.namespaces
        .iter()
        .for_each(|x| add(serde_json::to_string(&x.object)));
    o.nodes
        .iter()
        .for_each(|x| add(serde_json::to_string(&x.object)));
    o.pods
        .iter()
        .for_each(|x| add(serde_json::to_string(&x.object)));
    o.services
        .iter()
        .for_each(|x| add(serde_json::to_string(&x.object)));
    o.network_policies
        .iter()
        .for_each(|x| add(serde_json::to_string(&x.object)));
    o.ordered_policies
        .iter()
        .for_each(|x| add(serde_json::to_string(&x.object)));
    o.cluster_ordered_policies
        .iter()
        .for_each(|x| add(serde_json::to_string(&x.object)));
    o.cluster_network_policies
        .iter()
        .for_each(|x| add(serde_json::to_string(&x.object)));
    let output = match args.output {
        TextOrJson::Text => "text",
        TextOrJson::Json => "json",
    };
    match ordnet::agent::client::post(
        addr,
        &format!("/v1/whatif?output={output}"),
        &docs.join("\n---\n"),
    ) {
        Ok(body) => {
            print!("{body}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("ordnet whatif: {e}");
            ExitCode::from(1)
        }
    }
}
