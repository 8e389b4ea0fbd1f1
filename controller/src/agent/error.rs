//! What can go wrong in the agent outside the engine (whose problems are per object).

use std::path::PathBuf;

use crate::program::ProgramError;

/// An error of the agent's datapath or its connection to the cluster.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// Writing the engine's state to the datapath failed (the datapath is then reprogrammed
    /// in full).
    #[error(transparent)]
    Program(#[from] ProgramError),
    /// A delta did not fit what the agent recorded as programmed.
    #[error("{endpoint} {direction}: {what}")]
    Record {
        /// `ns/name` of the endpoint the delta names.
        endpoint: String,
        /// `ingress` or `egress`.
        direction: &'static str,
        /// What did not fit, e.g. `removal of a key that is not programmed`.
        what: &'static str,
    },
    /// Creating, adopting or pinning the kernel datapath.
    #[error("{what} in {}: {source}", pin_dir.display())]
    Open {
        /// `creating the datapath` or `adopting the pins`.
        what: &'static str,
        /// The datapath's bpffs pin directory.
        pin_dir: PathBuf,
        /// The datapath's error.
        #[source]
        source: Box<ordnet_datapath::DatapathError>,
    },
    /// Mounting a bpffs.
    #[error("{what} at {}: {source}", path.display())]
    Bpffs {
        /// What was being done, e.g. `mounting a bpffs`.
        what: &'static str,
        /// The directory that must be on a bpffs.
        path: PathBuf,
        /// The system error.
        #[source]
        source: std::io::Error,
    },
    /// Reading this node's addresses.
    #[error("reading this node's addresses: {0}")]
    HostAddresses(#[source] std::io::Error),
    /// Reading the kubeconfig or inferring the cluster configuration.
    #[error("{what}: {message}")]
    Config {
        /// The source: `--kubeconfig PATH`, or `no cluster configuration` when inferred.
        what: String,
        /// The kube error, as text.
        message: String,
    },
    /// Creating the kube client.
    #[error("kube client: {0}")]
    Client(#[source] kube::Error),
}
