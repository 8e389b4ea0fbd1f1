//! Two pods on routed veths, in a network namespace of their own, with real sockets: the
//! handoff test (`tests/xdp_testrun.rs`) and the whole-path benchmark (`benches/xdp.rs`) send
//! real packets through both programs with it. Not part of enforcement (feature `bench`).
//!
//! The "node" is a namespace the calling thread enters ([`in_own_netns`]); each pod is a named
//! namespace (`ip netns`) behind a veth whose host side (`hosts()[i]`) is in the node, with a
//! /32 route to the pod and a gateway route in the pod, like a routed CNI (`ptp`).

use std::{
    net::{IpAddr, Ipv4Addr},
    process::Command,
};

use ordnet_mapstate::MapState;

use crate::{ControlPlane as _, Datapath, DatapathError, EndpointSpec};

/// Runs `f` on a thread of its own in a new network namespace (the node): interfaces, links
/// and sockets it makes stay there, and vanish with it.
pub fn in_own_netns<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::spawn(|| {
        // SAFETY: a plain syscall; only this thread (and the commands it starts) move.
        if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
            panic!("unshare(CLONE_NEWNET): {}", std::io::Error::last_os_error());
        }
        f()
    })
    .join()
    .unwrap_or_else(|e| std::panic::resume_unwind(e))
}

/// Runs a shell command, panicking with its output on failure.
fn sh(cmd: &str) {
    let out = Command::new("sh")
        .args(["-c", cmd])
        .output()
        .unwrap_or_else(|e| panic!("{cmd}: {e}"));
    assert!(
        out.status.success(),
        "{cmd}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Two pods, A (`10.88.0.1`) and B (`10.88.0.2`), behind host-side veths `hoa` and `hob` in the
/// current thread's namespace (see [`in_own_netns`]). Their namespaces are deleted on drop.
pub struct TwoPods {
    names: [String; 2],
}

impl TwoPods {
    /// The pods' addresses.
    pub const ADDRS: [Ipv4Addr; 2] = [Ipv4Addr::new(10, 88, 0, 1), Ipv4Addr::new(10, 88, 0, 2)];
    /// The host-side interfaces.
    pub const HOSTS: [&'static str; 2] = ["hoa", "hob"];

    /// Creates both pods (namespace names made unique with the process id and `tag`) and
    /// turns forwarding on in the current namespace.
    pub fn new(tag: &str) -> TwoPods {
        let id = std::process::id();
        let names = [format!("{tag}-a-{id}"), format!("{tag}-b-{id}")];
        let pods = TwoPods { names };
        sh("ip link set lo up && sysctl -qw net.ipv4.ip_forward=1");
        for i in 0..2 {
            let (ns, host, addr) = (&pods.names[i], Self::HOSTS[i], Self::ADDRS[i]);
            sh(&format!(
                "ip netns add {ns} && ip -n {ns} link set lo up && \
                 ip link add {host} type veth peer name eth0 netns {ns} && \
                 ip addr add 169.254.1.1/32 dev {host} && ip link set {host} up && \
                 ip route add {addr}/32 dev {host} && \
                 ip -n {ns} addr add {addr}/32 dev eth0 && ip -n {ns} link set eth0 up && \
                 ip -n {ns} route add 169.254.1.1/32 dev eth0 && \
                 ip -n {ns} route add default via 169.254.1.1"
            ));
        }
        pods
    }

    /// The interface index of pod `i`'s host-side veth.
    pub fn ifindex(i: usize) -> u32 {
        let name = std::ffi::CString::new(Self::HOSTS[i]).expect("no NUL");
        // SAFETY: a valid C string; if_nametoindex only reads it.
        unsafe { libc::if_nametoindex(name.as_ptr()) }
    }

    /// Makes pod `i` endpoint `i + 1` with identity `identity` and `[ingress, egress]`
    /// policies (`policies[i]`), records both host-side interfaces, and attaches both programs
    /// to them (XDP natively where the driver allows it).
    pub fn enforce(
        &self,
        dp: &mut Datapath,
        policies: [(u32, &MapState, &MapState); 2],
    ) -> Result<(), DatapathError> {
        let ips = Self::ADDRS.map(|a| [IpAddr::from(a)]);
        let endpoints: Vec<(u32, EndpointSpec)> = (0..2)
            .map(|i| {
                let (identity, ingress, egress) = policies[i];
                let spec = EndpointSpec {
                    ips: &ips[i],
                    identity,
                    identities: &[],
                    ingress,
                    egress,
                };
                (i as u32 + 1, spec)
            })
            .collect();
        dp.update_endpoints(&endpoints)?;
        for (i, host) in Self::HOSTS.iter().enumerate() {
            dp.set_interface(Self::ifindex(i), i as u32 + 1, Some(&ips[i]))?;
            dp.attach_native_or_generic(host)?;
            dp.attach_tc(host)?;
        }
        Ok(())
    }

    /// Runs `f` in pod `i`'s namespace (on a thread of its own: sockets it makes stay there).
    pub fn in_pod<T: Send + 'static>(&self, i: usize, f: impl FnOnce() -> T + Send + 'static) -> T {
        let path = format!("/run/netns/{}", self.names[i]);
        std::thread::spawn(move || {
            use std::os::fd::AsRawFd as _;
            let ns = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
            // SAFETY: a valid namespace file descriptor; only this thread moves.
            if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                panic!("setns {path}: {}", std::io::Error::last_os_error());
            }
            f()
        })
        .join()
        .unwrap_or_else(|e| std::panic::resume_unwind(e))
    }
}

impl Drop for TwoPods {
    fn drop(&mut self) {
        for ns in &self.names {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
    }
}
