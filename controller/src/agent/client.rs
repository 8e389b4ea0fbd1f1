//! A minimal blocking client of the agent's debug API, for `ordnet matrix|trace|dump --agent
//! ADDR` (plain HTTP/1.1 on a loopback or node address; no TLS, no redirects).

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

/// Why a request to the agent failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AgentError {
    /// Could not connect or read (the agent is not running there).
    Unreachable(String),
    /// The agent answered with an error status (its message, e.g. a bad parameter, 4xx; or
    /// not ready yet, 503).
    Status(u16, String),
}

impl std::fmt::Display for AgentError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AgentError::Unreachable(m) => write!(f, "{m}"),
            AgentError::Status(code, m) => write!(f, "the agent answered {code}: {}", m.trim_end()),
        }
    }
}

/// Percent-encodes a query value.
pub fn encode(value: &str) -> String {
    let mut out = String::new();
    for b in value.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' | b'/' | b':' => {
                out.push(b as char)
            }
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

/// `GET path_and_query` from the agent at `addr` (`HOST:PORT`, or `http://HOST:PORT`); the body
/// of a 200 answer.
pub fn get(addr: &str, path_and_query: &str) -> Result<String, AgentError> {
    get_with_headers(addr, path_and_query).map(|(_, body)| body)
}

/// [`get`], with the answer's header lines (`name: value`, names lowercased).
pub fn get_with_headers(
    addr: &str,
    path_and_query: &str,
) -> Result<(Vec<(String, String)>, String), AgentError> {
    request(addr, "GET", path_and_query, None)
}

/// `POST path_and_query` with `body` (YAML): the answer's body on 200, else the error.
pub fn post(addr: &str, path_and_query: &str, body: &str) -> Result<String, AgentError> {
    request(addr, "POST", path_and_query, Some(body)).map(|(_, body)| body)
}

fn request(
    addr: &str,
    method: &str,
    path_and_query: &str,
    body: Option<&str>,
) -> Result<(Vec<(String, String)>, String), AgentError> {
    let addr = addr.trim_start_matches("http://").trim_end_matches('/');
    let unreachable = |e: std::io::Error| AgentError::Unreachable(format!("agent {addr}: {e}"));
    let target = addr
        .to_socket_addrs()
        .map_err(unreachable)?
        .next()
        .ok_or_else(|| AgentError::Unreachable(format!("agent {addr}: no address")))?;
    let mut stream =
        TcpStream::connect_timeout(&target, Duration::from_secs(5)).map_err(unreachable)?;
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .map_err(unreachable)?;
    match body {
        None => write!(
            stream,
            "{method} {path_and_query} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nAccept: */*\r\n\r\n"
        ),
        Some(b) => write!(
            stream,
            "{method} {path_and_query} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nAccept: */*\r\nContent-Type: application/yaml\r\nContent-Length: {}\r\n\r\n{b}",
            b.len()
        ),
    }
    .map_err(unreachable)?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).map_err(unreachable)?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| AgentError::Unreachable(format!("agent {addr}: not an HTTP answer")))?;
    let code: u16 = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| AgentError::Unreachable(format!("agent {addr}: not an HTTP answer")))?;
    let chunked = head.lines().any(|l| {
        l.to_ascii_lowercase()
            .starts_with("transfer-encoding: chunked")
    });
    let body = if chunked {
        dechunk(body)
    } else {
        body.to_string()
    };
    if code == 200 {
        let headers = head
            .lines()
            .skip(1)
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
            .collect();
        Ok((headers, body))
    } else {
        Err(AgentError::Status(code, body))
    }
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].trim_start_matches("\r\n");
    }
    out
}

/// `ordnet CMD --agent ADDR`: prints the agent's answer to `path_and_query` as is (it is already
/// the offline command's output); exit 0, or 1 with the agent's or the connection's message
/// (3 if the agent reports an internal error).
pub fn print_answer(cmd: &str, addr: &str, path_and_query: &str) -> std::process::ExitCode {
    match get(addr, path_and_query) {
        Ok(body) => {
            print!("{body}");
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("ordnet {cmd}: {e}");
            // 500: the agent's datapath and engine disagree (a bug), as exit 3 offline.
            let internal = matches!(e, AgentError::Status(500, _));
            std::process::ExitCode::from(if internal { 3 } else { 1 })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_query_values() {
        assert_eq!(encode("x/a"), "x/a");
        assert_eq!(encode("a b&c=d"), "a%20b%26c%3Dd");
        assert_eq!(encode("fe80::1"), "fe80::1");
    }

    #[test]
    fn dechunks() {
        assert_eq!(dechunk("3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"), "abcde");
    }

    #[test]
    fn unreachable_agent() {
        // A port nothing listens on (bound then closed).
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let e = get(&format!("127.0.0.1:{port}"), "/healthz").unwrap_err();
        assert!(matches!(e, AgentError::Unreachable(_)), "{e:?}");
    }
}
