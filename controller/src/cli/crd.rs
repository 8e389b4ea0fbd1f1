//! `ordnet crd`: prints the CustomResourceDefinitions of the ordnet kinds (the YAML committed
//! as `deploy/crds/ordnet.io_crds.yaml`); with `--upstream`, the upstream ClusterNetworkPolicy's
//! (committed as `deploy/crds/upstream/`), for clusters that lack network-policy-api's.

use std::io::Write;
use std::process::ExitCode;

/// Runs `ordnet crd [--upstream]`.
pub fn run(upstream: bool) -> ExitCode {
    let yaml = if upstream {
        ordnet_crds::cnp_crd_yaml()
    } else {
        ordnet_crds::crd_yaml()
    };
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
