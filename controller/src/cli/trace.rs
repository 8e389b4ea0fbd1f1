//! `ordnet trace`: the verdict of one flow and why. The verdict is the datapath's: every pod is
//! programmed as a local endpoint of an in-memory datapath and a crafted frame of the flow is
//! decided by the XDP program's decision function (`ordnet::offline`). The explanation is
//! `Engine::flow` (MapState lookups): for each side the identities used, the key and entry that
//! matched and the deciding rule(s), or the default and what isolates the endpoint, then the
//! lookup path through that endpoint's MapState. If the two ever disagree, that is a bug: it is
//! reported as an internal error (exit 3) instead of printing either. The output is
//! `ordnet::render::trace`, which the agent's debug API uses for `--agent` too.

use std::process::ExitCode;

use ordnet::offline::{OfflineDatapath, TraceError, trace, trace_family};
use ordnet::render::trace::{Format, render};
use ordnet::render::{Style, color_wanted};
use ordnet_engine::IpFamily;

use super::load::{LoadedEngine, load_engine, protocol};
use super::{TextOrJson, TraceArgs};

/// Runs `ordnet trace`.
pub fn run(args: &TraceArgs) -> ExitCode {
    let format = match args.output {
        TextOrJson::Text => Format::Text,
        TextOrJson::Json => Format::Json,
    };
    if let Some(addr) = &args.source.agent {
        let query = format!(
            "/v1/trace?from={}&to={}&protocol={}&port={}&output={}&color={}",
            ordnet::agent::client::encode(&args.from),
            ordnet::agent::client::encode(&args.to),
            protocol(args.protocol),
            args.port,
            format.as_str(),
            u8::from(color_wanted())
        );
        return ordnet::agent::client::print_answer("trace", addr, &query);
    }
    let loaded = match load_engine("trace", &args.source) {
        Ok(e) => e,
        Err(code) => return code,
    };
    let staged = loaded.staged_view();
    let LoadedEngine { engine, exit, .. } = loaded;
    let resolve = |flag: &str, s: &str| {
        engine.resolve(s).map_err(|e| {
            eprintln!("ordnet trace: {flag} {s}: {e}");
            ExitCode::from(1)
        })
    };
    let from = match resolve("--from", &args.from) {
        Ok(f) => f,
        Err(code) => return code,
    };
    let to = match resolve("--to", &args.to) {
        Ok(t) => t,
        Err(code) => return code,
    };
    let family = match trace_family(&from, &to, IpFamily::V4) {
        Ok(f) => f,
        Err((a, b)) => {
            eprintln!("ordnet trace: --from {a} and --to {b} are not of the same IP family");
            return ExitCode::from(1);
        }
    };
    let proto = protocol(args.protocol);
    let dp = match OfflineDatapath::build(&engine) {
        Ok(dp) => dp,
        Err(e) => {
            eprintln!("ordnet trace: {e}");
            return ExitCode::from(1);
        }
    };
    let t = match trace(&engine, dp.plane(), &from, &to, family, proto, args.port) {
        Ok(t) => t,
        Err(TraceError::Input(e)) => {
            eprintln!("ordnet trace: {e}");
            return ExitCode::from(1);
        }
        Err(TraceError::Disagreement(e)) => {
            eprintln!(
                "ordnet trace: INTERNAL ERROR: the datapath and the engine disagree: {e}\n\
                 ordnet trace: this is a bug in ordnet; please report it with these manifests"
            );
            return ExitCode::from(3);
        }
    };
    let style = Style::new(color_wanted());
    print!(
        "{}",
        render(
            &engine, &from, &to, family, proto, args.port, &t, format, style
        )
    );
    // Staged policies are left out above; when they would decide this flow differently, say
    // so (stderr: the answer on stdout stays the contract's).
    if let Some(view) = staged {
        let s = view.flow(&from, &to, family, proto, args.port);
        if s.verdict != t.verdict {
            eprintln!(
                "ordnet trace: staged policies (spec.mode: Staged) would {} this flow: ordnet trace --staged says why",
                s.verdict.as_str().to_uppercase()
            );
        }
    }
    exit
}
