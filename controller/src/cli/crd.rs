//! `ordnet crd`: prints the CustomResourceDefinitions of the ordnet kinds (the YAML committed
//! as `deploy/crds/ordnet.io_crds.yaml`).

use std::io::Write;
use std::process::ExitCode;

/// Runs `ordnet crd`.
pub fn run() -> ExitCode {
    let yaml = ordnet_crds::crd_yaml();
    let mut out = std::io::stdout().lock();
    match out.write_all(yaml.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => ExitCode::SUCCESS,
        // `ordnet crd | head` is not an error worth a message.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ordnet crd: cannot write: {e}");
            ExitCode::from(1)
        }
    }
}
