//! ordnet datapath (userspace side): loads the XDP program that `build.rs` built, gives access
//! to its map, and runs it on test frames through `BPF_PROG_TEST_RUN`.
//!
//! ```no_run
//! use ordnet_datapath::{Datapath, common::{ACTION_DENY, PortKey, craft}};
//! let mut dp = Datapath::load()?; // needs root (CAP_BPF + CAP_NET_ADMIN)
//! dp.set_port_verdict(PortKey::new(4, 6, 80), ACTION_DENY)?;
//! let frame = craft::ipv4_frame(craft::L4::Tcp { sport: 1234, dport: 80 });
//! let run = dp.test_run(&frame)?;
//! assert_eq!(run.action, ordnet_datapath::XdpAction::Drop);
//! # Ok::<(), ordnet_datapath::DatapathError>(())
//! ```

use std::time::Duration;

use aya::{
    Ebpf, TestRunOptions,
    maps::{HashMap, MapData, MapError},
    programs::{ProgramError, TestRun as _, Xdp},
};
pub use ordnet_datapath_common as common;
use ordnet_datapath_common::{PORT_VERDICTS_MAP, PROGRAM_NAME, PortKey, Verdict};

/// The eBPF object (ELF) built by `build.rs` from `datapath/ebpf`.
pub static EBPF_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/ordnet-xdp"));

/// Errors of the loader.
#[derive(Debug, thiserror::Error)]
pub enum DatapathError {
    #[error("loading the eBPF object: {0}")]
    Object(#[from] Box<aya::EbpfError>),
    #[error("XDP program {PROGRAM_NAME}: {0}")]
    Program(#[from] ProgramError),
    #[error("map {PORT_VERDICTS_MAP}: {0}")]
    Map(#[from] MapError),
    #[error("the eBPF object has no {0}")]
    Missing(&'static str),
}

/// Return value of an XDP program.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum XdpAction {
    Aborted,
    Drop,
    Pass,
    Tx,
    Redirect,
    /// A value outside the known actions.
    Other(u32),
}

impl From<u32> for XdpAction {
    fn from(v: u32) -> Self {
        match v {
            0 => Self::Aborted,
            1 => Self::Drop,
            2 => Self::Pass,
            3 => Self::Tx,
            4 => Self::Redirect,
            other => Self::Other(other),
        }
    }
}

impl From<Verdict> for XdpAction {
    fn from(v: Verdict) -> Self {
        match v {
            Verdict::Pass => Self::Pass,
            Verdict::Drop => Self::Drop,
        }
    }
}

/// Result of one `BPF_PROG_TEST_RUN` call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TestRunOutcome {
    /// What the program returned.
    pub action: XdpAction,
    /// Kernel-measured average duration of one run (total / repeat).
    pub avg_duration: Duration,
}

/// The loaded XDP program and its map.
pub struct Datapath {
    ebpf: Ebpf,
    port_verdicts: HashMap<MapData, PortKey, u8>,
}

impl Datapath {
    /// Creates the map and loads (verifies) the XDP program in the kernel. Needs root, or
    /// CAP_BPF + CAP_NET_ADMIN (+ CAP_PERFMON for the verifier's full pointer checks).
    ///
    /// Does not raise `RLIMIT_MEMLOCK`: kernels since 5.11 account BPF memory to the memory
    /// cgroup instead.
    pub fn load() -> Result<Self, DatapathError> {
        let mut ebpf = Ebpf::load(EBPF_OBJECT).map_err(Box::new)?;
        let program: &mut Xdp = ebpf
            .program_mut(PROGRAM_NAME)
            .ok_or(DatapathError::Missing(PROGRAM_NAME))?
            .try_into()?;
        program.load()?;
        let map = ebpf
            .take_map(PORT_VERDICTS_MAP)
            .ok_or(DatapathError::Missing(PORT_VERDICTS_MAP))?;
        let port_verdicts = HashMap::try_from(map)?;
        Ok(Self {
            ebpf,
            port_verdicts,
        })
    }

    /// The loaded XDP program (e.g. to attach it to an interface).
    pub fn program(&self) -> Result<&Xdp, DatapathError> {
        Ok(self
            .ebpf
            .program(PROGRAM_NAME)
            .ok_or(DatapathError::Missing(PROGRAM_NAME))?
            .try_into()?)
    }

    /// Mutable access to the loaded XDP program (attach/detach).
    pub fn program_mut(&mut self) -> Result<&mut Xdp, DatapathError> {
        Ok(self
            .ebpf
            .program_mut(PROGRAM_NAME)
            .ok_or(DatapathError::Missing(PROGRAM_NAME))?
            .try_into()?)
    }

    /// The `PORT_VERDICTS` map.
    pub fn port_verdicts(&self) -> &HashMap<MapData, PortKey, u8> {
        &self.port_verdicts
    }

    /// Sets the action (`ACTION_ALLOW` / `ACTION_DENY`) for a key.
    pub fn set_port_verdict(&mut self, key: PortKey, action: u8) -> Result<(), DatapathError> {
        Ok(self.port_verdicts.insert(key, action, 0)?)
    }

    /// Removes the entry for `key`; returns whether there was one.
    pub fn remove_port_verdict(&mut self, key: &PortKey) -> Result<bool, DatapathError> {
        match self.port_verdicts.remove(key) {
            Ok(()) => Ok(true),
            Err(MapError::KeyNotFound) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// The action stored for `key`, if any.
    pub fn port_verdict(&self, key: &PortKey) -> Result<Option<u8>, DatapathError> {
        match self.port_verdicts.get(key, 0) {
            Ok(v) => Ok(Some(v)),
            Err(MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Removes every entry.
    pub fn clear_port_verdicts(&mut self) -> Result<(), DatapathError> {
        let keys = self
            .port_verdicts
            .keys()
            .collect::<Result<Vec<PortKey>, MapError>>()?;
        for key in keys {
            self.remove_port_verdict(&key)?;
        }
        Ok(())
    }

    /// Runs the program once on `frame` (which must be at least 14 bytes: the kernel rejects
    /// shorter XDP test input with `EINVAL`).
    pub fn test_run(&self, frame: &[u8]) -> Result<TestRunOutcome, DatapathError> {
        self.test_run_repeat(frame, 1)
    }

    /// Runs the program `repeat` times on `frame`; `avg_duration` is the kernel's per-run
    /// average, i.e. the cost of the program per packet plus the test harness' per-run reset.
    pub fn test_run_repeat(
        &self,
        frame: &[u8],
        repeat: u32,
    ) -> Result<TestRunOutcome, DatapathError> {
        let result = self.program()?.test_run(TestRunOptions {
            data_in: Some(frame),
            repeat,
            ..TestRunOptions::default()
        })?;
        Ok(TestRunOutcome {
            action: XdpAction::from(result.return_value),
            avg_duration: result.duration,
        })
    }

    /// The verdict userspace computes for `frame` with the shared parser and verdict function
    /// (`ordnet_datapath_common::{parse, verdict}`) against the live map: the same code and
    /// the same data the kernel program uses.
    pub fn userspace_verdict(&self, frame: &[u8]) -> Result<Verdict, DatapathError> {
        let parsed = common::parse(frame);
        let mut lookup_error = None;
        let verdict = common::verdict(&parsed, |key| match self.port_verdict(key) {
            Ok(v) => v,
            Err(e) => {
                lookup_error = Some(e);
                None
            }
        });
        match lookup_error {
            Some(e) => Err(e),
            None => Ok(verdict),
        }
    }
}
