//! Real connections between lab namespaces: a server per destination and port (in its
//! namespace, bound to its probed address) and one client per probe (a worker thread enters
//! the source's namespace with `setns`), optionally from a chosen source port (the lab steers a
//! probe to a Service's backend by its source port). All probes run concurrently, so a run
//! takes about one timeout.
//!
//! * TCP: a connect (the three-way handshake completes).
//! * UDP: a request that the server echoes; the client waits for the echo.
//! * SCTP with kernel support: an SCTP stream socket connect (the four-way association setup).
//! * SCTP without it: an INIT over a raw IP socket (protocol 132) that a raw-socket responder in
//!   the destination namespace answers with an INIT-ACK; the client waits for the INIT-ACK.
//!
//! A packet the datapath drops is never answered: the probe times out (deny). A refusal (TCP
//! RST, ICMP unreachable) is an error of the lab, not a verdict.

use std::io::ErrorKind;
use std::mem::MaybeUninit;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use socket2::{Domain, Protocol, SockAddr, Socket, Type};

use super::error::LabError;
use super::sctp;
use super::sys::{self, Netns};

/// How a protocol is probed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    Tcp,
    Udp,
    /// Kernel SCTP sockets.
    SctpSocket,
    /// INIT → INIT-ACK over raw IP sockets.
    SctpRaw,
}

impl Method {
    pub fn describe(self) -> &'static str {
        match self {
            Method::Tcp => "TCP connect",
            Method::Udp => "UDP request and echoed reply",
            Method::SctpSocket => "SCTP association (kernel SCTP sockets)",
            Method::SctpRaw => {
                "SCTP INIT -> INIT-ACK over raw IP sockets (protocol 132; this kernel has no SCTP \
                 sockets)"
            }
        }
    }

    /// The IP protocol number of the probed flows.
    pub fn ip_protocol(self) -> u8 {
        match self {
            Method::Tcp => 6,
            Method::Udp => 17,
            Method::SctpSocket | Method::SctpRaw => 132,
        }
    }
}

/// Kernel SCTP sockets if this kernel has them (in the namespace of the calling thread: the
/// protocol is global), else raw sockets.
pub fn sctp_method() -> Method {
    match Socket::new(
        Domain::IPV4,
        Type::STREAM,
        Some(Protocol::from(sctp::IPPROTO_SCTP)),
    ) {
        Ok(_) => Method::SctpSocket,
        Err(_) => Method::SctpRaw,
    }
}

/// A probed end: its namespace and the address it is probed at.
#[derive(Debug, Clone)]
pub struct End {
    pub netns: Arc<Netns>,
    pub addr: IpAddr,
}

/// What one probe saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Answered: the connection (or exchange) completed; `local` is the client's address and
    /// port (the flow's 5-tuple is `local` → destination:port).
    Connected { local: SocketAddr },
    /// No answer within the timeout.
    TimedOut,
    /// Anything else (refused, unreachable, a socket error): a fault of the lab.
    Failed(String),
}

const POLL: Duration = Duration::from_millis(100);

/// The running servers; stopped and joined when dropped.
pub struct Servers {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl Drop for Servers {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn domain(ip: IpAddr) -> Domain {
    if ip.is_ipv4() {
        Domain::IPV4
    } else {
        Domain::IPV6
    }
}

fn stream_protocol(method: Method) -> Protocol {
    if method == Method::Tcp {
        Protocol::TCP
    } else {
        Protocol::from(sctp::IPPROTO_SCTP)
    }
}

fn timed_out(e: &std::io::Error) -> bool {
    matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)
}

/// Opens the server socket of `end` (in the calling thread's namespace).
fn server_socket(method: Method, addr: IpAddr, port: u16) -> std::io::Result<Socket> {
    let d = domain(addr);
    let s = match method {
        Method::Tcp | Method::SctpSocket => {
            let s = Socket::new(d, Type::STREAM, Some(stream_protocol(method)))?;
            s.set_reuse_address(true)?;
            s
        }
        Method::Udp => Socket::new(d, Type::DGRAM, Some(Protocol::UDP))?,
        Method::SctpRaw => Socket::new(d, Type::RAW, Some(Protocol::from(sctp::IPPROTO_SCTP)))?,
    };
    // (IPV6_V6ONLY is refused on raw sockets, which are bound to one address anyway.)
    if addr.is_ipv6() && method != Method::SctpRaw {
        s.set_only_v6(true)?;
    }
    let bind_port = if method == Method::SctpRaw { 0 } else { port };
    s.bind(&SocketAddr::new(addr, bind_port).into())?;
    if matches!(method, Method::Tcp | Method::SctpSocket) {
        s.listen(1024)?;
    }
    s.set_read_timeout(Some(POLL))?;
    Ok(s)
}

fn serve(method: Method, s: Socket, port: u16, stop: &AtomicBool) {
    let mut buf = [MaybeUninit::<u8>::uninit(); 2048];
    let mut tag = Rng::new();
    while !stop.load(Ordering::SeqCst) {
        match method {
            Method::Tcp | Method::SctpSocket => match s.accept() {
                // The handshake is what is probed: close at once.
                Ok((conn, _)) => drop(conn),
                Err(e) if timed_out(&e) => {}
                Err(_) => std::thread::sleep(POLL),
            },
            Method::Udp => match s.recv_from(&mut buf) {
                Ok((n, from)) => {
                    let data = init_bytes(&buf[..n]);
                    let _ = s.send_to(&data, &from);
                }
                Err(e) if timed_out(&e) => {}
                Err(_) => std::thread::sleep(POLL),
            },
            Method::SctpRaw => match s.recv_from(&mut buf) {
                Ok((n, from)) => {
                    let data = init_bytes(&buf[..n]);
                    let Some(payload) = sctp_payload(&data, from.is_ipv4()) else {
                        continue;
                    };
                    if let Some(p) = sctp::parse(payload)
                        && p.is_init()
                        && p.dport == port
                    {
                        let reply = sctp::init_ack(&p, tag.nonzero());
                        let _ = s.send_to(&reply, &from);
                    }
                }
                Err(e) if timed_out(&e) => {}
                Err(_) => std::thread::sleep(POLL),
            },
        }
    }
}

/// Starts one server per `(end, port)` (each in its namespace, bound to its address) and
/// returns once every one is listening.
pub fn start_servers(listeners: &[(End, u16)], method: Method) -> Result<Servers, LabError> {
    let stop = Arc::new(AtomicBool::new(false));
    let mut servers = Servers {
        stop: stop.clone(),
        threads: Vec::new(),
    };
    let (tx, rx) = mpsc::channel::<Result<(), LabError>>();
    for (end, port) in listeners {
        let (end, port, stop, tx) = (end.clone(), *port, stop.clone(), tx.clone());
        let t = std::thread::Builder::new()
            .name("lab-server".into())
            .stack_size(256 * 1024)
            .spawn(move || {
                let opened = end.netns.enter().and_then(|_| {
                    server_socket(method, end.addr, port).map_err(|source| LabError::Server {
                        what: format!("server on {} port {port} in {}", end.addr, end.netns.name),
                        source,
                    })
                });
                match opened {
                    Ok(s) => {
                        let _ = tx.send(Ok(()));
                        serve(method, s, port, &stop);
                    }
                    Err(e) => {
                        let _ = tx.send(Err(e));
                    }
                }
            })
            .map_err(|e| LabError::io("starting a server thread", e))?;
        servers.threads.push(t);
    }
    drop(tx);
    for _ in listeners {
        match rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e),
            Err(_) => return Err(LabError::ServerGone),
        }
    }
    Ok(servers)
}

fn init_bytes(b: &[MaybeUninit<u8>]) -> Vec<u8> {
    // SAFETY: the kernel wrote these `n` bytes (recv_from returned n).
    b.iter().map(|x| unsafe { x.assume_init() }).collect()
}

/// The SCTP part of what a raw socket received (IPv4 raw sockets include the IP header).
fn sctp_payload(data: &[u8], v4: bool) -> Option<&[u8]> {
    if !v4 {
        return Some(data);
    }
    let ihl = usize::from(*data.first()? & 0x0f) * 4;
    data.get(ihl..)
}

/// A small xorshift generator for verification tags and nonces (not security relevant).
struct Rng(u64);

impl Rng {
    fn new() -> Rng {
        static SEQ: AtomicU32 = AtomicU32::new(1);
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1);
        let seed = t
            ^ (u64::from(std::process::id()) << 32)
            ^ u64::from(SEQ.fetch_add(1, Ordering::Relaxed)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        Rng(seed | 1)
    }

    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    fn nonzero(&mut self) -> u32 {
        loop {
            let v = self.next() as u32;
            if v != 0 {
                return v;
            }
        }
    }
}

/// Source ports of raw SCTP probes: distinct within a run.
static RAW_PORT: AtomicU32 = AtomicU32::new(0);

fn stream_probe(
    method: Method,
    from: IpAddr,
    sport: u16,
    to: SocketAddr,
    timeout: Duration,
) -> Outcome {
    let attempt = || -> std::io::Result<Socket> {
        let s = Socket::new(domain(from), Type::STREAM, Some(stream_protocol(method)))?;
        if sport != 0 {
            s.set_reuse_address(true)?;
        }
        s.bind(&SocketAddr::new(from, sport).into())?;
        Ok(s)
    };
    let s = match attempt() {
        Ok(s) => s,
        Err(e) => return Outcome::Failed(format!("socket bound to {from}: {e}")),
    };
    match s.connect_timeout(&to.into(), timeout) {
        Ok(()) => match s.local_addr().map(|a| a.as_socket()) {
            Ok(Some(local)) => Outcome::Connected { local },
            _ => Outcome::Failed("no local address after connect".into()),
        },
        Err(e) if timed_out(&e) => Outcome::TimedOut,
        Err(e) => Outcome::Failed(format!("connect to {to}: {e}")),
    }
}

fn udp_probe(from: IpAddr, sport: u16, to: SocketAddr, timeout: Duration) -> Outcome {
    let deadline = Instant::now() + timeout;
    let nonce = format!("ordnet-lab {}", Rng::new().next());
    let setup = || -> std::io::Result<Socket> {
        let s = Socket::new(domain(from), Type::DGRAM, Some(Protocol::UDP))?;
        s.bind(&SocketAddr::new(from, sport).into())?;
        s.connect(&to.into())?;
        Ok(s)
    };
    let s = match setup() {
        Ok(s) => s,
        Err(e) => return Outcome::Failed(format!("UDP socket {from} -> {to}: {e}")),
    };
    let local = match s.local_addr().map(|a| a.as_socket()) {
        Ok(Some(a)) => a,
        _ => return Outcome::Failed("no local address".into()),
    };
    let mut buf = [MaybeUninit::<u8>::uninit(); 512];
    resend_until(
        &s,
        deadline,
        to,
        ("send", || s.send(nonce.as_bytes()).map(drop)),
        || {
            let n = s.recv(&mut buf)?;
            Ok((init_bytes(&buf[..n]) == nonce.as_bytes()).then_some(Outcome::Connected { local }))
        },
    )
}

/// Sends a request with `send` every 300 ms until `deadline` (a datagram can be lost; each
/// resend is the same flow) and reads replies with `recv` in between, until one is the answer
/// (`Some`; `None` is a reply to ignore). A read timeout ends a wait; another error fails.
fn resend_until(
    s: &Socket,
    deadline: Instant,
    to: SocketAddr,
    (what, mut send): (&str, impl FnMut() -> std::io::Result<()>),
    mut recv: impl FnMut() -> std::io::Result<Option<Outcome>>,
) -> Outcome {
    loop {
        let now = Instant::now();
        if now >= deadline {
            return Outcome::TimedOut;
        }
        if let Err(e) = send() {
            return Outcome::Failed(format!("{what} to {to}: {e}"));
        }
        let wait_until = (now + Duration::from_millis(300)).min(deadline);
        while Instant::now() < wait_until {
            let left = wait_until.saturating_duration_since(Instant::now());
            if s.set_read_timeout(Some(left.max(Duration::from_millis(1))))
                .is_err()
            {
                return Outcome::Failed("setting a read timeout".into());
            }
            match recv() {
                Ok(Some(outcome)) => return outcome,
                Ok(None) => {}
                Err(e) if timed_out(&e) => break,
                Err(e) => return Outcome::Failed(format!("receive from {to}: {e}")),
            }
        }
    }
}

fn sctp_raw_probe(from: IpAddr, sport: u16, to: SocketAddr, timeout: Duration) -> Outcome {
    let deadline = Instant::now() + timeout;
    let mut rng = Rng::new();
    let sport = if sport != 0 {
        sport
    } else {
        // Above the lab's Service steering ranges (see `kubeproxy`).
        33_000 + (RAW_PORT.fetch_add(1, Ordering::Relaxed) % 27_000) as u16
    };
    let tag = rng.nonzero();
    let setup = || -> std::io::Result<Socket> {
        let s = Socket::new(
            domain(from),
            Type::RAW,
            Some(Protocol::from(sctp::IPPROTO_SCTP)),
        )?;
        s.bind(&SocketAddr::new(from, 0).into())?;
        Ok(s)
    };
    let s = match setup() {
        Ok(s) => s,
        Err(e) => return Outcome::Failed(format!("raw SCTP socket bound to {from}: {e}")),
    };
    let init = sctp::init(sport, to.port(), tag);
    let dest: SockAddr = SocketAddr::new(to.ip(), 0).into();
    let mut buf = [MaybeUninit::<u8>::uninit(); 2048];
    resend_until(
        &s,
        deadline,
        to,
        ("send INIT", || s.send_to(&init, &dest).map(drop)),
        || {
            let (n, src) = s.recv_from(&mut buf)?;
            if src.as_socket().map(|a| a.ip()) != Some(to.ip()) {
                return Ok(None);
            }
            let data = init_bytes(&buf[..n]);
            let Some(p) = sctp_payload(&data, to.is_ipv4()).and_then(sctp::parse) else {
                return Ok(None);
            };
            let answer =
                p.is_init_ack() && p.sport == to.port() && p.dport == sport && p.vtag == tag;
            Ok(answer.then_some(Outcome::Connected {
                local: SocketAddr::new(from, sport),
            }))
        },
    )
}

/// One probe: from the end `source` to `dest`, from source port `sport` (0: any).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Probe {
    pub source: usize,
    pub dest: SocketAddr,
    pub sport: u16,
}

/// Runs every probe concurrently (each from its source's namespace); one outcome per probe.
/// Stops starting probes when the lab is interrupted (those get `Failed`).
pub fn probe_all(ends: &[End], pairs: &[Probe], method: Method, timeout: Duration) -> Vec<Outcome> {
    let results: Arc<Mutex<Vec<Outcome>>> =
        Arc::new(Mutex::new(vec![
            Outcome::Failed("not probed".into());
            pairs.len()
        ]));
    let next = Arc::new(AtomicUsize::new(0));
    let workers = pairs.len().clamp(1, 256);
    let ends: Arc<Vec<End>> = Arc::new(ends.to_vec());
    let pairs: Arc<Vec<Probe>> = Arc::new(pairs.to_vec());
    let mut threads = Vec::new();
    for _ in 0..workers {
        let (results, next, ends, todo) =
            (results.clone(), next.clone(), ends.clone(), pairs.clone());
        let spawned = std::thread::Builder::new()
            .name("lab-probe".into())
            .stack_size(256 * 1024)
            .spawn(move || {
                let mut current: Option<usize> = None;
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= todo.len() || sys::interrupted().is_some() {
                        return;
                    }
                    let Probe {
                        source: s,
                        dest: to,
                        sport,
                    } = todo[i];
                    if current != Some(s) {
                        if let Err(e) = ends[s].netns.enter() {
                            results.lock().expect("results")[i] = Outcome::Failed(e.to_string());
                            continue;
                        }
                        current = Some(s);
                    }
                    let from = ends[s].addr;
                    let outcome = match method {
                        Method::Tcp | Method::SctpSocket => {
                            stream_probe(method, from, sport, to, timeout)
                        }
                        Method::Udp => udp_probe(from, sport, to, timeout),
                        Method::SctpRaw => sctp_raw_probe(from, sport, to, timeout),
                    };
                    results.lock().expect("results")[i] = outcome;
                }
            });
        match spawned {
            Ok(t) => threads.push(t),
            // Fewer workers only make the run slower.
            Err(_) if !threads.is_empty() => break,
            Err(e) => {
                return vec![Outcome::Failed(format!("starting a probe thread: {e}")); pairs.len()];
            }
        }
    }
    for t in threads {
        let _ = t.join();
    }
    results.lock().expect("results").clone()
}
