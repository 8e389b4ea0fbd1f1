//! The plugin's `main` (the `ordnet-cni` binary of the `ordnet` package is only a call to it):
//! the chained CNI plugin, CNI spec 1.0 (see the crate's documentation).
//!
//! * `ADD`: asks the agent to enforce the pod on its host-side interfaces and passes the main
//!   plugin's result on once it has; when the agent cannot be reached or refuses, sets those
//!   interfaces down and fails with code 11 (try again later): fail closed.
//! * `DEL`: tells the agent; never fails because the agent is away (the agent reconciles from
//!   the API server when it is back, and the main plugin removes the interfaces).
//! * `CHECK`: asks the agent whether the pod is enforced.
//! * `STATUS` (1.1.0): whether the agent is ready (code 50 if not); `GC`: nothing to collect.
//! * `VERSION`: the versions it speaks.

use std::io::Read;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use crate::{
    Attachment, CallError, CniError, DEFAULT_SOCKET, DEFAULT_TIMEOUT, NetConf, Request,
    SUPPORTED_VERSIONS, attachment, call,
};
use serde_json::{Value, json};

/// Runs the plugin: the command from `CNI_COMMAND`, the configuration from stdin, the result
/// or the error on stdout.
pub fn main() -> ExitCode {
    let command = std::env::var("CNI_COMMAND").unwrap_or_default();
    let result = match command.as_str() {
        "VERSION" => {
            println!(
                "{}",
                json!({"cniVersion": "1.0.0", "supportedVersions": SUPPORTED_VERSIONS})
            );
            return ExitCode::SUCCESS;
        }
        "ADD" | "DEL" | "CHECK" | "STATUS" | "GC" => run(&command),
        "" => Err(CniError::new(
            4,
            "CNI_COMMAND is not set",
            "ordnet-cni is a CNI plugin: the container runtime runs it",
        )),
        other => Err(CniError::new(
            4,
            format!("CNI_COMMAND {other:?} is not supported"),
            "ADD, DEL, CHECK, STATUS, GC and VERSION are",
        )),
    };
    match result {
        Ok(None) => ExitCode::SUCCESS,
        Ok(Some(out)) => {
            println!("{out}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            println!(
                "{}",
                serde_json::to_string(&e).expect("an error serializes")
            );
            ExitCode::from(1)
        }
    }
}

fn env(name: &str) -> Result<String, CniError> {
    std::env::var(name)
        .ok()
        .filter(|v| !v.is_empty())
        .ok_or_else(|| CniError::new(4, format!("{name} is not set"), "the runtime must set it"))
}

fn run(command: &str) -> Result<Option<String>, CniError> {
    let mut stdin = Vec::new();
    std::io::stdin()
        .read_to_end(&mut stdin)
        .map_err(|e| CniError::new(5, "reading the network configuration", e.to_string()))?;
    let conf = NetConf::parse(&stdin)?;
    let version = conf.cni_version.clone();
    let with_version = |mut e: CniError| {
        e.cni_version = version.clone();
        e
    };
    let socket = PathBuf::from(conf.socket.clone().unwrap_or(DEFAULT_SOCKET.into()));
    let timeout = conf
        .timeout_seconds
        .map(Duration::from_secs)
        .unwrap_or(DEFAULT_TIMEOUT);
    let ask = |request: &Request| call(&socket, request, timeout);
    match command {
        "STATUS" => match ask(&Request::Status) {
            Ok(r) if r.ok => Ok(None),
            Ok(r) => Err(with_version(CniError::new(
                50,
                "the ordnet agent is not ready",
                r.message,
            ))),
            Err(e) => Err(with_version(unreachable(50, &socket, &e))),
        },
        "GC" => Ok(None),
        _ => {
            let container = env("CNI_CONTAINERID").map_err(with_version)?;
            let args = std::env::var("CNI_ARGS").unwrap_or_default();
            let a =
                attachment(&container, &args, conf.prev_result.as_ref()).map_err(with_version)?;
            match command {
                "ADD" => add(&conf, &a, ask).map_err(with_version),
                "DEL" => {
                    // Best effort: the agent follows the API server anyway.
                    if let Err(e) = ask(&Request::Del(a.clone())) {
                        eprintln!(
                            "ordnet-cni: DEL of {}: the agent at {} was not told: {e}",
                            a.who(),
                            socket.display()
                        );
                    }
                    Ok(None)
                }
                _ => match ask(&Request::Check(a.clone())) {
                    Ok(r) if r.ok => Ok(None),
                    Ok(r) => Err(with_version(CniError::new(
                        100,
                        format!("{} is not enforced", a.who()),
                        r.message,
                    ))),
                    Err(e) => Err(with_version(unreachable(11, &socket, &e))),
                },
            }
        }
    }
}

fn unreachable(code: u32, socket: &std::path::Path, e: &CallError) -> CniError {
    CniError::new(
        code,
        "the ordnet agent cannot be reached",
        format!("{}: {e}", socket.display()),
    )
}

fn add(
    conf: &NetConf,
    a: &Attachment,
    ask: impl Fn(&Request) -> Result<crate::Response, CallError>,
) -> Result<Option<String>, CniError> {
    let Some(prev) = conf.prev_result.clone() else {
        return Err(CniError::new(
            7,
            "ordnet-cni is a chained plugin: there is no prevResult",
            "list it after the main plugin (the one that creates the interfaces) in the conflist",
        ));
    };
    let refused = match ask(&Request::Add(a.clone())) {
        Ok(r) if r.ok => return Ok(Some(passthrough(prev, &conf.cni_version))),
        Ok(r) => (100, "the ordnet agent cannot enforce", r.message),
        Err(e) => (11, "the ordnet agent cannot be reached", e.to_string()),
    };
    // Fail closed: no packet in or out of the pod until a later ADD succeeds.
    let mut downed = Vec::new();
    for iface in &a.host_interfaces {
        match set_down(iface) {
            Ok(()) => downed.push(iface.as_str()),
            Err(e) => eprintln!("ordnet-cni: setting {iface} down: {e}"),
        }
    }
    let (code, msg, why) = refused;
    Err(CniError::new(
        // Try again later: the runtime retries the sandbox.
        if code == 100 { 11 } else { code },
        format!("{msg} {}: failing closed", a.who()),
        format!(
            "{why}; the pod's host-side interfaces ({}) are down, so no packet passes until the agent enforces the pod on a retry",
            if downed.is_empty() {
                "none".to_string()
            } else {
                downed.join(", ")
            }
        ),
    ))
}

/// The main plugin's result, in the configuration's version (a chained plugin passes it on).
fn passthrough(mut prev: Value, version: &str) -> String {
    prev["cniVersion"] = json!(version);
    prev.to_string()
}

/// Clears `IFF_UP` on `iface` (in the runtime's network namespace, the host's).
fn set_down(iface: &str) -> std::io::Result<()> {
    if iface.len() >= libc::IFNAMSIZ {
        return Err(std::io::Error::other("interface name too long"));
    }
    // SAFETY: a plain datagram socket for the interface ioctls; closed below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `ifreq` is plain data; the name fits (checked above) and stays NUL-terminated.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in req.ifr_name.iter_mut().zip(iface.bytes()) {
        *d = s as libc::c_char;
    }
    // SAFETY: valid socket and request for SIOCGIFFLAGS / SIOCSIFFLAGS.
    let result = unsafe {
        if libc::ioctl(fd, libc::SIOCGIFFLAGS, &mut req) < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            req.ifr_ifru.ifru_flags &= !(libc::IFF_UP as libc::c_short);
            if libc::ioctl(fd, libc::SIOCSIFFLAGS, &req) < 0 {
                Err(std::io::Error::last_os_error())
            } else {
                Ok(())
            }
        }
    };
    // SAFETY: our own socket.
    unsafe { libc::close(fd) };
    result
}
