//! `ordnet observe`: what a node's datapath decided on live traffic, from its agent's debug
//! API (`/v1/observe`): the first packet of every new flow and the denied packets (aggregated
//! per flow), each with the rule behind the verdict, worded as `ordnet trace` words it
//! (`ordnet::observe`, `docs/observe.md`). The agent renders the text; `--follow` asks for
//! what came after the last event shown every half second. `--counters` shows the per-rule
//! counters instead (`/v1/counters`, `ordnet::rule_counters`).

use std::process::ExitCode;
use std::time::Duration;

use ordnet::agent::client::{encode, get_with_headers};
use ordnet::render::color_wanted;

use super::{DirectionArg, ObserveArgs, TextOrJson, VerdictArg};

/// Runs `ordnet observe`.
pub fn run(args: &ObserveArgs) -> ExitCode {
    let mut filters = String::new();
    let mut add = |k: &str, v: Option<String>| {
        if let Some(v) = v {
            filters.push_str(&format!("&{k}={}", encode(&v)));
        }
    };
    add("pod", args.pod.clone());
    add("namespace", args.namespace.clone());
    add(
        "verdict",
        args.verdict.map(|v| match v {
            VerdictArg::Allow => "allow".into(),
            VerdictArg::Deny => "deny".into(),
        }),
    );
    add(
        "direction",
        args.direction.map(|d| match d {
            DirectionArg::Ingress => "ingress".into(),
            DirectionArg::Egress => "egress".into(),
        }),
    );
    add("policy", args.policy.clone());
    add("protocol", args.protocol.clone());
    add("port", args.port.map(|p| p.to_string()));
    let output = match args.output {
        TextOrJson::Text => "text",
        TextOrJson::Json => "json",
    };
    if args.counters {
        let query = format!(
            "/v1/counters?output={output}&color={}{filters}",
            u8::from(color_wanted())
        );
        return match get_with_headers(&args.agent, &query) {
            Ok((_, body)) => {
                print!("{body}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("ordnet observe: {e}");
                ExitCode::from(1)
            }
        };
    }
    let mut since = 0u64;
    let mut last = args.last;
    loop {
        let query = format!(
            "/v1/observe?since={since}&last={last}&output={output}&color={}{filters}",
            u8::from(color_wanted())
        );
        match get_with_headers(&args.agent, &query) {
            Ok((headers, body)) => {
                print!("{body}");
                if let Some(n) = headers
                    .iter()
                    .find(|(k, _)| k == "x-ordnet-last")
                    .and_then(|(_, v)| v.parse().ok())
                {
                    since = n;
                }
            }
            Err(e) => {
                eprintln!("ordnet observe: {e}");
                return ExitCode::from(1);
            }
        }
        if !args.follow {
            return ExitCode::SUCCESS;
        }
        // Everything that came after, however much.
        last = u64::MAX >> 1;
        std::thread::sleep(Duration::from_millis(500));
    }
}
