//! `ordnet whatif`: a flow history replayed against the manifests with their staged policies
//! enforced; prints the flows whose verdict would change (`ordnet::whatif`).

use std::process::ExitCode;

use super::load::{LoadedEngine, load_engine};
use super::{Source, TextOrJson, WhatifArgs};

/// Runs `ordnet whatif`.
pub fn run(args: &WhatifArgs) -> ExitCode {
    let text = if args.flows.as_os_str() == "-" {
        let mut s = String::new();
        match std::io::Read::read_to_string(&mut std::io::stdin(), &mut s) {
            Ok(_) => Ok(s),
            Err(e) => Err(e),
        }
    } else {
        std::fs::read_to_string(&args.flows)
    };
    let text = match text {
        Ok(t) => t,
        Err(e) => {
            eprintln!("ordnet whatif: --flows {}: {e}", args.flows.display());
            return ExitCode::from(1);
        }
    };
    let history = match ordnet::whatif::read_history(&text) {
        Ok(h) => h,
        Err(e) => {
            eprintln!("ordnet whatif: --flows {}: {e}", args.flows.display());
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
