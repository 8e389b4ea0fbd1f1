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
        endpoint: String,
        direction: &'static str,
        what: &'static str,
    },
    /// Creating, adopting or pinning the kernel datapath.
    #[error("{what} in {}: {source}", pin_dir.display())]
    Open {
        what: &'static str,
        pin_dir: PathBuf,
        #[source]
        source: Box<ordnet_datapath::DatapathError>,
    },
    /// Mounting a bpffs.
    #[error("{what} at {}: {source}", path.display())]
    Bpffs {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// Reading this node's addresses.
    #[error("reading this node's addresses: {0}")]
    HostAddresses(#[source] std::io::Error),
    /// Reading the kubeconfig or inferring the cluster configuration.
    #[error("{what}: {message}")]
    Config { what: String, message: String },
    /// Creating the kube client.
    #[error("kube client: {0}")]
    Client(#[source] kube::Error),
}
