//! Command line definition (the contract is `shared/spec/CLI.md`) and dispatch.

use std::net::IpAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};

mod agent;
mod crd;
mod dump;
pub(crate) mod load;
mod matrix;
mod observe;
mod trace;
mod validate;
mod whatif;

/// ordnet: ordered Kubernetes network policy with an O(1) XDP datapath.
#[derive(Debug, Parser)]
#[command(name = "ordnet", version, about, long_about = None, propagate_version = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Verdict for every ordered pair of pods (and external addresses) on one protocol and port.
    Matrix(MatrixArgs),
    /// Explain the verdict of one flow: the entry and the rule that decided each side.
    Trace(TraceArgs),
    /// Show one endpoint's MapState trie (tree, json or Graphviz dot).
    Dump(DumpArgs),
    /// Show what a node's datapath decided on live traffic: new flows and denied packets, with
    /// the rule behind each verdict (from a running agent).
    Observe(ObserveArgs),
    /// Replay a flow history against the manifests (staged policies enforced): the flows
    /// whose verdict would change, and what would decide them.
    Whatif(WhatifArgs),
    /// Check every policy in the manifests and report all problems.
    Validate(ValidateArgs),
    /// Print the CustomResourceDefinitions of the ordnet kinds.
    Crd(CrdArgs),
    /// Build the pods as network namespaces, enforce with XDP and probe real connections (root).
    Lab(LabArgs),
    /// Run the node agent: watch the cluster, program this node's datapath, write status.
    Agent(Box<agent::AgentArgs>),
}

/// `ordnet crd` arguments.
#[derive(Debug, Args, Clone)]
pub struct CrdArgs {
    /// Print the upstream ClusterNetworkPolicy CRD (policy.networking.k8s.io, v1beta1 and
    /// v1alpha2) instead, for a cluster that does not have network-policy-api's.
    #[arg(long)]
    pub upstream: bool,
}

/// Where the cluster state comes from: manifests (`-f`) or a running agent (`--agent`).
#[derive(Debug, Args, Clone)]
pub struct Source {
    /// Manifest file or directory (repeatable; directories are read recursively).
    #[arg(
        short = 'f',
        long = "filename",
        value_name = "PATH",
        required_unless_present = "agent"
    )]
    pub files: Vec<PathBuf>,
    /// Ask a running agent's debug API instead of reading manifests.
    #[arg(long, value_name = "ADDR", conflicts_with = "files")]
    pub agent: Option<String>,
    /// Enforce the staged policies too (`spec.mode: Staged`), as if their mode were
    /// `Enforce`: what they would do. Without it a staged policy decides nothing.
    #[arg(long, conflicts_with = "agent")]
    pub staged: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ProtocolArg {
    #[value(name = "TCP", alias = "tcp")]
    Tcp,
    #[value(name = "UDP", alias = "udp")]
    Udp,
    #[value(name = "SCTP", alias = "sctp")]
    Sctp,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TableOrJson {
    Table,
    Json,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TextOrJson {
    Text,
    Json,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DumpFormat {
    Tree,
    Json,
    Dot,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DirectionArg {
    Ingress,
    Egress,
}

#[derive(Debug, Args)]
pub struct MatrixArgs {
    #[command(flatten)]
    pub source: Source,
    #[arg(long, value_enum, default_value = "TCP")]
    pub protocol: ProtocolArg,
    #[arg(long, default_value_t = 80)]
    pub port: u16,
    /// An external address, probed as a source and as a destination (repeatable).
    #[arg(long, value_name = "IP")]
    pub external: Vec<IpAddr>,
    /// Probe pods at their IPv4 (4) or IPv6 (6) address.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u8).range(4..=6))]
    pub family: u8,
    #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
    pub output: TableOrJson,
}

#[derive(Debug, Args)]
pub struct TraceArgs {
    #[command(flatten)]
    pub source: Source,
    /// Source: `namespace/pod` or an IP address.
    #[arg(long, value_name = "SRC")]
    pub from: String,
    /// Destination: `namespace/pod` or an IP address.
    #[arg(long, value_name = "DST")]
    pub to: String,
    #[arg(long, value_enum, default_value = "TCP")]
    pub protocol: ProtocolArg,
    #[arg(long, default_value_t = 80)]
    pub port: u16,
    #[arg(short = 'o', long = "output", value_enum, default_value = "text")]
    pub output: TextOrJson,
}

/// `ordnet whatif` arguments.
#[derive(Debug, Args)]
pub struct WhatifArgs {
    /// Manifest file or directory (repeatable; directories are read recursively): the
    /// cluster's objects and the proposed ones; with `--agent`, the proposed ones only. Staged
    /// policies among them are enforced.
    #[arg(short = 'f', long = "filename", value_name = "PATH", required = true)]
    pub files: Vec<PathBuf>,
    /// The flow history: the agent's flow log (`ordnet agent --flow-log`), or JSON lines
    /// `{"src", "dst", "protocol", "port", "allowed"}`; `-` for standard input.
    #[arg(
        long,
        value_name = "FILE",
        required_unless_present = "agent",
        conflicts_with = "agent"
    )]
    pub flows: Option<PathBuf>,
    /// Replay a running agent's own flow history (`ordnet agent --flow-history`) against its
    /// objects plus those of `-f`.
    #[arg(long, value_name = "ADDR")]
    pub agent: Option<String>,
    #[arg(short = 'o', long = "output", value_enum, default_value = "text")]
    pub output: TextOrJson,
}

/// `ordnet observe` arguments.
#[derive(Debug, Args)]
pub struct ObserveArgs {
    /// The agent's debug API (`HOST:PORT`): the node whose datapath's verdicts are shown.
    #[arg(long, value_name = "ADDR")]
    pub agent: String,
    /// Show the last N events that pass the filters.
    #[arg(short = 'n', long, value_name = "N", default_value_t = 20)]
    pub last: u64,
    /// Keep following: print new events as they arrive (every half second) until interrupted.
    #[arg(short = 'f', long)]
    pub follow: bool,
    /// Show the per-rule counters instead of events: per rule (and isolation default), the
    /// new flows it allowed and the flows and packets it denied since the agent started.
    /// `--policy` and `--namespace` select rules; the other filters do not apply.
    #[arg(long, conflicts_with_all = ["follow", "pod", "verdict", "direction", "protocol", "port"])]
    pub counters: bool,
    /// Only events with this pod (`namespace/name`) at either end.
    #[arg(long, value_name = "NS/NAME")]
    pub pod: Option<String>,
    /// Only events with a pod of this namespace at either end.
    #[arg(long, value_name = "NS")]
    pub namespace: Option<String>,
    /// Only allowed or only denied events.
    #[arg(long, value_enum)]
    pub verdict: Option<VerdictArg>,
    /// Only events whose lookup in this direction was made.
    #[arg(long, value_enum)]
    pub direction: Option<DirectionArg>,
    /// Only events decided by a rule of this policy (`name` or `namespace/name`), or by the
    /// default of an endpoint it isolates.
    #[arg(long, value_name = "NAME")]
    pub policy: Option<String>,
    /// Only this IP protocol (TCP, UDP, SCTP, ICMP, ICMPv6, or a number).
    #[arg(long, value_name = "PROTOCOL")]
    pub protocol: Option<String>,
    /// Only this destination port.
    #[arg(long)]
    pub port: Option<u16>,
    #[arg(short = 'o', long = "output", value_enum, default_value = "text")]
    pub output: TextOrJson,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum VerdictArg {
    Allow,
    Deny,
}

#[derive(Debug, Args)]
pub struct DumpArgs {
    #[command(flatten)]
    pub source: Source,
    /// The endpoint, as `namespace/pod`.
    #[arg(long, value_name = "NS/NAME")]
    pub pod: String,
    /// Only this direction (default: both).
    #[arg(long, value_enum)]
    pub direction: Option<DirectionArg>,
    #[arg(short = 'o', long = "output", value_enum, default_value = "tree")]
    pub output: DumpFormat,
}

#[derive(Debug, Args)]
pub struct ValidateArgs {
    /// Manifest file or directory (repeatable).
    #[arg(short = 'f', long = "filename", value_name = "PATH", required = true)]
    pub files: Vec<PathBuf>,
    /// `text`: one line per problem (errors on stdout, warnings on stderr); `json`: one object
    /// with every problem on stdout, for CI pipelines.
    #[arg(short = 'o', long = "output", value_enum, default_value = "text")]
    pub output: TextOrJson,
}

#[derive(Debug, Args)]
pub struct LabArgs {
    /// Manifest file or directory (repeatable).
    #[arg(short = 'f', long = "filename", value_name = "PATH", required = true)]
    pub files: Vec<PathBuf>,
    /// Open real connections between every pair and print observed vs expected.
    #[arg(long)]
    pub probe: bool,
    #[arg(long, value_enum, default_value = "TCP")]
    pub protocol: ProtocolArg,
    #[arg(long, default_value_t = 80)]
    pub port: u16,
    /// An external address: one more namespace, reaching the pods through the node's uplink
    /// (repeatable).
    #[arg(long, value_name = "IP")]
    pub external: Vec<IpAddr>,
    /// Probe pods at their IPv4 (4) or IPv6 (6) address.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u8).range(4..=6))]
    pub family: u8,
    #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
    pub output: TableOrJson,
    /// How the pods are wired to the node, as a CNI would: `ptp` (routed veths, per-pod routes
    /// in the main table), `bridge` (every pod a port of one bridge, traffic between pods
    /// switched, as the `bridge` plugin and flannel do), `policy-routing` (per-pod routes in a
    /// table an `ip rule` looks up), `flannel` (two nodes, each a bridge of its pods, a VXLAN
    /// overlay between them, a datapath on each).
    #[arg(long, value_enum, default_value = "ptp")]
    pub cni: CniShape,
    /// The MTU of every link of the lab (68..=65535; 9001 is EKS's).
    #[arg(long, default_value_t = 1500, value_parser = clap::value_parser!(u32).range(68..=65535))]
    pub mtu: u32,
    /// How many uplinks the (first) node has: with 2 or more, the world sends the node's pods
    /// their traffic from outside over the extra uplinks (`uplink2`, ...) while the node's
    /// default route stays on `uplink`, so traffic from outside comes in by one uplink and
    /// leaves by another, both hooked.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=8))]
    pub uplinks: u8,
    /// With `--probe`: show the datapath's verdict events for the probes (each new flow and
    /// the denied packets, with the rule that decided), as `ordnet observe` shows them; with
    /// `-o json` every probed flow lists its events.
    #[arg(long)]
    pub observe: bool,
}

/// How `ordnet lab` wires its pods ([`LabArgs::cni`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CniShape {
    Ptp,
    Bridge,
    PolicyRouting,
    Flannel,
}

/// Runs one parsed command line and returns the process exit code.
pub fn run(cli: Cli) -> ExitCode {
    match cli.command {
        Command::Matrix(args) => matrix::run(&args),
        Command::Trace(args) => trace::run(&args),
        Command::Dump(args) => dump::run(&args),
        Command::Observe(args) => observe::run(&args),
        Command::Whatif(args) => whatif::run(&args),
        Command::Validate(args) => validate::run(&args),
        Command::Crd(a) => crd::run(a.upstream),
        Command::Lab(args) => crate::lab::run(&args),
        Command::Agent(args) => agent::run(*args),
    }
}
