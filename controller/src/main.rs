//! `ordnet`: the ordnet command line and node agent.
//!
//! Exit codes (CLI.md): 0 success, 1 invalid input, 2 usage error; `lab` adds 3 and 4 (src/lab).

use std::process::ExitCode;

use clap::Parser;

mod cli;
mod lab;

fn main() -> ExitCode {
    let args = cli::Cli::parse();
    cli::run(args)
}
