//! `ordnet`: the ordnet command line and node agent.
//!
//! Exit codes (CLI.md): 0 success, 1 invalid input, 2 usage error (also: not implemented yet).

use std::process::ExitCode;

use clap::Parser;

mod cli;

fn main() -> ExitCode {
    let args = cli::Cli::parse();
    cli::run(args)
}
