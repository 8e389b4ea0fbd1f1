//! The flow log (`--flow-log PATH`): every attributed verdict event as one JSON line (the
//! record `/v1/observe` serves), for log collectors. The file is rotated by size: when a line
//! would take it past `max_bytes` it becomes `PATH.1` (the older ones shift to `PATH.2` ...,
//! the last one, `PATH.<files - 1>`, is removed) and a new `PATH` is started, so the log never
//! holds more than `files` files of about `max_bytes` each.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write as _};
use std::path::{Path, PathBuf};

use crate::observe::FlowRecord;

/// Default size at which the flow log is rotated.
pub const DEFAULT_MAX_BYTES: u64 = 100 << 20;
/// Default number of files kept (the current one included).
pub const DEFAULT_FILES: u32 = 5;

/// An open flow log.
pub struct FlowLog {
    path: PathBuf,
    max_bytes: u64,
    files: u32,
    out: BufWriter<File>,
    size: u64,
}

impl FlowLog {
    /// Opens (appends to) the log at `path`, rotated at `max_bytes`, keeping `files` files.
    pub fn open(path: &Path, max_bytes: u64, files: u32) -> std::io::Result<FlowLog> {
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        let size = file.metadata()?.len();
        Ok(FlowLog {
            path: path.to_path_buf(),
            max_bytes: max_bytes.max(1),
            files: files.max(1),
            out: BufWriter::new(file),
            size,
        })
    }

    /// Appends the records, one JSON line each, rotating as needed; flushes at the end.
    pub fn write(&mut self, records: &[FlowRecord]) -> std::io::Result<()> {
        for r in records {
            let mut line = serde_json::to_vec(r).map_err(std::io::Error::other)?;
            line.push(b'\n');
            if self.size > 0 && self.size + line.len() as u64 > self.max_bytes {
                self.rotate()?;
            }
            self.out.write_all(&line)?;
            self.size += line.len() as u64;
        }
        self.out.flush()
    }

    fn numbered(&self, n: u32) -> PathBuf {
        let mut p = self.path.clone().into_os_string();
        p.push(format!(".{n}"));
        PathBuf::from(p)
    }

    fn rotate(&mut self) -> std::io::Result<()> {
        self.out.flush()?;
        if self.files == 1 {
            self.out = BufWriter::new(File::create(&self.path)?);
            self.size = 0;
            return Ok(());
        }
        let _ = std::fs::remove_file(self.numbered(self.files - 1));
        for n in (1..self.files - 1).rev() {
            let from = self.numbered(n);
            if from.exists() {
                std::fs::rename(&from, self.numbered(n + 1))?;
            }
        }
        std::fs::rename(&self.path, self.numbered(1))?;
        self.out = BufWriter::new(
            OpenOptions::new()
                .create(true)
                .append(true)
                .open(&self.path)?,
        );
        self.size = 0;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::observe::{Attribution, FlowRecord};
    use ordnet_datapath::{Observed, common::event::FlowEvent};

    fn record(seq: u64) -> FlowRecord {
        let e = FlowEvent {
            family: 4,
            protocol: 6,
            verdict: 2,
            reason: 4,
            dport: 80,
            ..FlowEvent::default()
        };
        FlowRecord {
            seq,
            time_ms: 0,
            event: Observed::of(&e),
            protocol: "TCP".into(),
            src_pod: None,
            dst_pod: None,
            egress: None,
            ingress: None,
            attribution: Attribution::Exact,
            attributed_revision: 1,
            staged: None,
        }
    }

    #[test]
    fn rotates_by_size_and_keeps_the_given_number_of_files() {
        let dir = std::env::temp_dir().join(format!("ordnet-flowlog-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("flows.jsonl");
        // Three lines per file (of two-digit sequence numbers: one-digit lines are shorter),
        // three files.
        let line = serde_json::to_vec(&record(10)).unwrap().len() as u64 + 1;
        let mut log = FlowLog::open(&path, 3 * line, 3).unwrap();
        let all: Vec<FlowRecord> = (1..=20).map(record).collect();
        log.write(&all).unwrap();
        let read = |p: &Path| -> Vec<u64> {
            std::fs::read_to_string(p)
                .unwrap()
                .lines()
                .map(|l| {
                    serde_json::from_str::<serde_json::Value>(l).unwrap()["seq"]
                        .as_u64()
                        .unwrap()
                })
                .collect()
        };
        assert_eq!(read(&path), vec![19, 20]);
        assert_eq!(read(&dir.join("flows.jsonl.1")), vec![16, 17, 18]);
        assert_eq!(read(&dir.join("flows.jsonl.2")), vec![13, 14, 15]);
        assert!(!dir.join("flows.jsonl.3").exists());
        // Reopened, it appends to the current file.
        drop(log);
        let mut log = FlowLog::open(&path, 3 * line, 3).unwrap();
        log.write(&[record(21)]).unwrap();
        assert_eq!(read(&path), vec![19, 20, 21]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
