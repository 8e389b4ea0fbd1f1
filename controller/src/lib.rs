//! The `ordnet` crate: the node agent as a library (the binary's `ordnet agent`, and the agent
//! integration tests, run it in-process), and what the binary's subcommands share with it.
//!
//! | module | what |
//! |---|---|
//! | [`agent`] | the node agent: watchers, apply loop, enforcers (bpf, none), status, debug API |
//! | [`program`] | [`program::NodeProgram`]: the one path from an engine to any datapath |
//! | [`observe`] | the datapath's verdict events attributed to rules, filtered, rendered (`ordnet observe`) |
//! | [`offline`] | the offline verdicts: every pod a local endpoint of an in-memory datapath |
//! | [`render`] | matrix, trace, dump and trie rendering for the CLI and the debug API |
//! | [`rule_counters`] | the kernel's per-rule counters: filtered, rendered, as metrics (`ordnet observe --counters`) |
//!
//! The binary (`src/main.rs`) adds the command line (`src/cli/`) and `ordnet lab` (`src/lab/`).

pub mod agent;
pub mod observe;
pub mod offline;
pub mod program;
pub mod render;
pub mod rule_counters;
pub mod whatif;
