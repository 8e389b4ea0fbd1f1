//! The lab's errors: system calls, commands it runs, and the single-lab lock. Each becomes exit
//! code 4 (the lab could not be built or run) with its message.

use super::sys::LOCK_PATH;

/// What went wrong building or running a lab.
#[derive(Debug, thiserror::Error)]
pub enum LabError {
    /// A system call or file operation (`what` names it).
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// A command the lab needs is not installed.
    #[error("the `{program}` command ({package}) is not installed")]
    Missing {
        program: String,
        package: &'static str,
    },
    /// A command failed (`command` with its input, `stderr` what it said).
    #[error("{command}\nfailed: {stderr}{hint}")]
    Command {
        command: String,
        stderr: String,
        /// An extra line when the failure has a known cause (e.g. a missing package).
        hint: &'static str,
    },
    /// Another lab holds the lock.
    #[error(
        "another ordnet lab is active (pid {pid}; {LOCK_PATH}: {holder}); stop it first \
         (Ctrl-C in its terminal, or kill -INT {pid}); it is left untouched"
    )]
    Busy { pid: String, holder: String },
    /// A lab topology the lab cannot build (e.g. too many members).
    #[error("{0}")]
    Topology(&'static str),
    /// A probe server could not be started (`what` names it).
    #[error("{what}: {source}")]
    Server {
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// Loading, attaching or programming the datapath (`what` names the step).
    #[error("{what}: {source}")]
    Datapath {
        what: String,
        #[source]
        source: Box<ordnet_datapath::DatapathError>,
    },
    /// A probe server thread ended before it was ready.
    #[error("a server thread ended before it was ready")]
    ServerGone,
}

impl LabError {
    /// An I/O error of `what`.
    pub fn io(what: impl Into<String>, source: std::io::Error) -> LabError {
        LabError::Io {
            what: what.into(),
            source,
        }
    }
}
