//! `ordnet agent`: its command line, and running the agent library until a signal.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::builder::NonEmptyStringValueParser;
use clap::{Args, CommandFactory, ValueEnum};
use ordnet::agent;

use super::Cli;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DatapathArg {
    Bpf,
    None,
}

#[derive(Debug, Args)]
pub struct AgentArgs {
    /// The name of the node this agent runs on.
    #[arg(long, env = "NODE_NAME", value_parser = NonEmptyStringValueParser::new())]
    pub node: String,
    /// Kubeconfig to use (default: in-cluster config, then the usual kubeconfig lookup).
    #[arg(long, value_name = "PATH")]
    pub kubeconfig: Option<PathBuf>,
    #[arg(long, value_enum, default_value = "bpf")]
    pub datapath: DatapathArg,
    /// The node's uplink interface (traffic from other nodes): the programs are attached there
    /// too (--datapath bpf only).
    #[arg(long, value_name = "IFACE", value_parser = NonEmptyStringValueParser::new())]
    pub uplink: Option<String>,
    /// Address of the debug API (health, metrics, matrix/trace/dump), as IP:PORT.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:9090")]
    pub debug_addr: SocketAddr,
}

/// Runs `ordnet agent` until SIGTERM/SIGINT (exit 0) or a fatal error (exit 1); usage errors
/// exit 2.
pub fn run(args: AgentArgs) -> ExitCode {
    if args.uplink.is_some() && args.datapath != DatapathArg::Bpf {
        Cli::command()
            .error(
                clap::error::ErrorKind::ArgumentConflict,
                "--uplink only applies to --datapath bpf",
            )
            .exit();
    }
    let debug_addr = args.debug_addr;
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("ordnet agent: {e}");
            return ExitCode::from(1);
        }
    };
    runtime.block_on(async move {
        let client = match agent::client_for(args.kubeconfig.as_deref()).await {
            Ok(c) => c,
            Err(e) => {
                eprintln!("ordnet agent: {e}");
                return ExitCode::from(1);
            }
        };
        let config = agent::AgentConfig {
            node: args.node,
            debug_addr,
            namespace: std::env::var("POD_NAMESPACE").unwrap_or_else(|_| "kube-system".into()),
            lease_renew_every: agent::status::RENEW_EVERY,
        };
        let (datapath, kind): (Box<dyn agent::Enforcer>, &str) = if args.datapath == DatapathArg::Bpf {
            let pin_dir = agent::bpf::pin_dir_from_env();
            match agent::bpf::BpfDatapath::open(&pin_dir, args.uplink.clone()) {
                Ok(dp) => {
                    match dp.opened() {
                        agent::bpf::Opened::Created => eprintln!(
                            "ordnet agent: datapath bpf: new maps pinned in {}",
                            pin_dir.display()
                        ),
                        agent::bpf::Opened::Adopted {
                            endpoints,
                            rulesets,
                            links,
                        } => eprintln!(
                            "ordnet agent: datapath bpf: adopted the pins in {} ({endpoints} endpoints, {rulesets} rule sets, attached to {}); enforcing them until the initial sync",
                            pin_dir.display(),
                            if links.is_empty() { "nothing".to_string() } else { links.join(", ") }
                        ),
                    }
                    (Box::new(dp), "bpf")
                }
                Err(e) => {
                    eprintln!("ordnet agent: --datapath bpf: {e}");
                    return ExitCode::from(1);
                }
            }
        } else {
            (Box::new(agent::NoneDatapath::default()), "none")
        };
        let mut handle = match agent::start(config, client, datapath).await {
            Ok(h) => h,
            Err(e) => {
                eprintln!("ordnet agent: --debug-addr {debug_addr}: {e}");
                return ExitCode::from(1);
            }
        };
        eprintln!(
            "ordnet agent: node {}, datapath {kind}, debug API on http://{}",
            handle.state.node,
            handle.debug_addr()
        );
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(e) => {
                    eprintln!("ordnet agent: {e}");
                    return ExitCode::from(1);
                }
            };
        let stopped = |kind: &str| {
            if kind == "bpf" {
                eprintln!(
                    "ordnet agent: stopping; the pinned maps and attachments stay (enforcement continues, a restarted agent adopts them)"
                );
            }
            ExitCode::SUCCESS
        };
        tokio::select! {
            _ = term.recv() => stopped(kind),
            _ = tokio::signal::ctrl_c() => stopped(kind),
            _ = handle.wait() => {
                eprintln!("ordnet agent: a task ended unexpectedly");
                ExitCode::from(1)
            }
        }
    })
}
