//! What the lab needs from the system: network namespaces entered per thread (`setns`), the
//! `ip` command (iproute2), the single-lab lock, per-namespace sysctls and signal handling.

use std::fs::File;
use std::io::{Read as _, Seek as _, Write as _};
use std::os::fd::AsRawFd as _;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};

use super::error::LabError;

/// Where iproute2 keeps named network namespaces (bind mounts).
pub const NETNS_DIR: &str = "/run/netns";

/// The lock file that makes one lab at a time (it names the holder).
pub const LOCK_PATH: &str = "/run/ordnet-lab.lock";

/// A named network namespace, open (entering it needs only this descriptor).
#[derive(Debug)]
pub struct Netns {
    pub name: String,
    file: File,
}

impl Netns {
    pub fn open(name: &str) -> Result<Netns, LabError> {
        let path = Path::new(NETNS_DIR).join(name);
        let file = File::open(&path).map_err(|e| LabError::io(path.display().to_string(), e))?;
        Ok(Netns {
            name: name.to_string(),
            file,
        })
    }

    /// Moves the calling thread (only it) into this namespace: sockets it creates afterwards,
    /// interface names it resolves and `/proc/sys/net` it writes are this namespace's.
    pub fn enter(&self) -> Result<(), LabError> {
        setns(&self.file, &self.name)
    }
}

fn setns(file: &File, what: &str) -> Result<(), LabError> {
    // SAFETY: a valid descriptor of a network namespace; affects the calling thread only.
    let r = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
    if r != 0 {
        return Err(LabError::io(
            format!("setns into network namespace {what}"),
            std::io::Error::last_os_error(),
        ));
    }
    Ok(())
}

/// Runs `f` with the calling thread in `ns`, then moves the thread back to the namespace it was
/// in (also when `f` fails).
pub fn in_netns<T, E: From<LabError>>(
    ns: &Netns,
    f: impl FnOnce() -> Result<T, E>,
) -> Result<T, E> {
    let home = File::open("/proc/thread-self/ns/net")
        .map_err(|e| LabError::io("/proc/thread-self/ns/net", e))?;
    ns.enter()?;
    let out = f();
    setns(&home, "of the lab process")?;
    out
}

/// Writes a sysctl of the namespace the calling thread is in (`net.ipv4.ip_forward` →
/// `/proc/sys/net/ipv4/ip_forward`: `/proc/sys/net` is the calling thread's namespace's).
pub fn sysctl(key: &str, value: &str) -> Result<(), LabError> {
    let path = PathBuf::from("/proc/sys").join(key.replace('.', "/"));
    std::fs::write(&path, value).map_err(|e| LabError::io(format!("sysctl {key}={value}"), e))
}

/// Runs `ip ARGS...` with `stdin` as its input (`ip -batch -`). The child gets its own process
/// group, so a Ctrl-C on the terminal does not kill it half-way (the lab cleans up itself).
pub fn ip(args: &[&str], stdin: Option<&str>) -> Result<(), LabError> {
    run("ip", "iproute2", args, stdin)
}

/// Runs `bridge ARGS...` (iproute2's bridge tool) with `stdin` as its input.
pub fn bridge(args: &[&str], stdin: Option<&str>) -> Result<(), LabError> {
    run("bridge", "iproute2", args, stdin)
}

/// The index of interface `name` in the calling thread's network namespace.
pub fn ifindex(name: &str) -> Result<u32, LabError> {
    let c = std::ffi::CString::new(name).map_err(|e| {
        LabError::io(
            format!("interface name {name:?}"),
            std::io::Error::new(std::io::ErrorKind::InvalidInput, e),
        )
    })?;
    // SAFETY: a valid NUL-terminated string.
    let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if i == 0 {
        return Err(LabError::io(
            format!("interface {name}"),
            std::io::Error::last_os_error(),
        ));
    }
    Ok(i)
}

/// Runs `nft -f -` with `script` in network namespace `netns` (`ip netns exec`).
pub fn nft(netns: &str, script: &str) -> Result<(), LabError> {
    run(
        "ip",
        "iproute2",
        &["netns", "exec", netns, "nft", "-f", "-"],
        Some(script),
    )
    .map_err(|e| match e {
        LabError::Command {
            command, stderr, ..
        } if stderr.contains("No such file") || stderr.contains("nft: not found") => {
            LabError::Command {
                command,
                stderr,
                hint: "\n(the `nft` command of Debian's `nftables` package is needed: scripts/setup installs it)",
            }
        }
        e => e,
    })
}

/// Runs `program ARGS...` (from Debian's `package`) with `stdin` as its input, in its own
/// process group.
fn run(
    program: &str,
    package: &'static str,
    args: &[&str],
    stdin: Option<&str>,
) -> Result<(), LabError> {
    let mut cmd = Command::new(program);
    cmd.args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .process_group(0);
    let mut child = cmd.spawn().map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            LabError::Missing {
                program: program.to_string(),
                package,
            }
        } else {
            LabError::io(format!("{program} {}", args.join(" ")), e)
        }
    })?;
    if let Some(input) = stdin {
        let mut pipe = child.stdin.take().expect("piped stdin");
        // A failed write shows up as the command's own error below.
        let _ = pipe.write_all(input.as_bytes());
    }
    let out = child
        .wait_with_output()
        .map_err(|e| LabError::io(format!("{program} {}", args.join(" ")), e))?;
    if !out.status.success() {
        let what = match stdin {
            Some(input) => format!(
                "{program} {} with input:\n{}",
                args.join(" "),
                input.trim_end()
            ),
            None => format!("{program} {}", args.join(" ")),
        };
        return Err(LabError::Command {
            command: what,
            stderr: String::from_utf8_lossy(&out.stderr).trim_end().to_string(),
            hint: "",
        });
    }
    Ok(())
}

/// The names of the named network namespaces.
pub fn netns_names() -> Vec<String> {
    match std::fs::read_dir(NETNS_DIR) {
        Ok(dir) => dir
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect(),
        Err(_) => Vec::new(),
    }
}

/// The held single-lab lock (released when dropped or when the process dies).
#[derive(Debug)]
pub struct LabLock {
    _file: File,
}

/// Takes the lock without waiting; when another lab holds it, the error names its pid.
pub fn lock(run_id: &str) -> Result<LabLock, LabError> {
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(LOCK_PATH)
        .map_err(|e| LabError::io(LOCK_PATH, e))?;
    // SAFETY: a valid descriptor; flock is released on close or process exit.
    let r = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if r != 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            let holder = holder.trim();
            let pid = holder
                .split_whitespace()
                .skip_while(|w| *w != "pid")
                .nth(1)
                .unwrap_or("?");
            return Err(LabError::Busy {
                pid: pid.to_string(),
                holder: if holder.is_empty() {
                    "no details".to_string()
                } else {
                    holder.to_string()
                },
            });
        }
        return Err(LabError::io(format!("flock {LOCK_PATH}"), err));
    }
    let record = format!(
        "pid {} run {run_id} started {}\n",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0)
    );
    file.set_len(0)
        .and_then(|_| file.rewind())
        .and_then(|_| file.write_all(record.as_bytes()))
        .map_err(|e| LabError::io(LOCK_PATH, e))?;
    Ok(LabLock { _file: file })
}

/// The first SIGINT/SIGTERM/SIGHUP received (0: none).
static SIGNAL: AtomicI32 = AtomicI32::new(0);

/// Blocks SIGINT, SIGTERM and SIGHUP in the calling thread (and so in every thread it starts
/// afterwards) and starts a thread that receives them with `sigwait`: the lab polls
/// [`interrupted`] and cleans up instead of dying. Call before starting any other thread.
pub fn catch_signals() -> Result<(), LabError> {
    // SAFETY: plain signal-set manipulation on a local set; SIG_DFL is a valid disposition.
    let set = unsafe {
        // A shell starts background commands with SIGINT ignored, and an ignored signal is
        // discarded instead of pending: restore the default so `kill -INT` reaches sigwait.
        // (SIGHUP keeps what it has: under nohup the lab survives a hang-up.)
        libc::signal(libc::SIGINT, libc::SIG_DFL);
        libc::signal(libc::SIGTERM, libc::SIG_DFL);
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            libc::sigaddset(&mut set, s);
        }
        let r = libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        if r != 0 {
            return Err(LabError::io(
                "pthread_sigmask",
                std::io::Error::from_raw_os_error(r),
            ));
        }
        set
    };
    std::thread::Builder::new()
        .name("lab-signals".into())
        .spawn(move || {
            loop {
                let mut sig = 0;
                // SAFETY: `set` is a valid signal set; `sig` a valid out pointer.
                if unsafe { libc::sigwait(&set, &mut sig) } != 0 {
                    continue;
                }
                if SIGNAL
                    .compare_exchange(0, sig, Ordering::SeqCst, Ordering::SeqCst)
                    .is_ok()
                {
                    eprintln!("ordnet lab: {} received: cleaning up", signal_name(sig));
                } else {
                    eprintln!("ordnet lab: still cleaning up, please wait");
                }
            }
        })
        .map_err(|e| LabError::io("starting the signal thread", e))?;
    Ok(())
}

/// The signal that interrupted the lab, if any.
pub fn interrupted() -> Option<i32> {
    match SIGNAL.load(Ordering::SeqCst) {
        0 => None,
        s => Some(s),
    }
}

pub fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGINT => "SIGINT",
        libc::SIGTERM => "SIGTERM",
        libc::SIGHUP => "SIGHUP",
        _ => "signal",
    }
}

/// Whether the process runs as root (the lab needs CAP_SYS_ADMIN, CAP_NET_ADMIN and CAP_BPF).
pub fn is_root() -> bool {
    // SAFETY: no arguments, no failure.
    unsafe { libc::geteuid() == 0 }
}
