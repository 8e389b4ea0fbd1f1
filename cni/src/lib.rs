//! `ordnet-cni`, the chained CNI plugin, and the protocol it speaks with the node agent.
//!
//! The container runtime runs the node's CNI chain when it creates a pod's sandbox: the main
//! plugin (Calico, `ptp`, ...) creates the interfaces and addresses, then `ordnet-cni` (listed
//! after it in the conflist) gets the main plugin's result as `prevResult` and asks the agent,
//! over a unix socket in a host directory ([`DEFAULT_SOCKET`]), to enforce the pod's policy on
//! its host-side interface **before the runtime starts the pod's containers**. The agent
//! answers once the pod is an endpoint with its own policy in the datapath and the programs are
//! attached to its interface; only then does the plugin pass the result on. If the agent cannot
//! be reached or cannot enforce the pod (it does not know the pod yet), the plugin fails
//! closed: it sets the pod's host-side interfaces down (no packet passes either way) and
//! returns CNI error 11 ("try again later"), so the runtime tears the sandbox down and tries
//! again, and the kubelet's event says why.
//!
//! The protocol: one JSON object per line, a [`Request`] from the plugin, a [`Response`] from
//! the agent, then the connection closes.

use std::io::{BufRead, BufReader, Write};
use std::net::IpAddr;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;

pub mod install;
pub mod plugin;

/// Where the agent listens unless the network configuration's `socket` says otherwise (a host
/// directory the agent's DaemonSet mounts).
pub const DEFAULT_SOCKET: &str = "/run/ordnet/cni.sock";

/// The CNI versions the plugin speaks (chaining, i.e. `prevResult`, exists since 0.3.0).
pub const SUPPORTED_VERSIONS: &[&str] = &["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];

/// How long the plugin waits for the agent's answer unless `timeoutSeconds` says otherwise.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(15);

/// One pod sandbox's attachment, as the plugin sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Attachment {
    /// `CNI_CONTAINERID`.
    pub container_id: String,
    /// `K8S_POD_NAMESPACE` of `CNI_ARGS` (the kubelet passes it).
    pub pod_namespace: Option<String>,
    /// `K8S_POD_NAME` of `CNI_ARGS`.
    pub pod_name: Option<String>,
    /// The host-side interfaces of the main plugin's result (those without a `sandbox`).
    pub host_interfaces: Vec<String>,
    /// The pod's addresses from the main plugin's result.
    pub ips: Vec<IpAddr>,
}

impl Attachment {
    /// `namespace/name`, or the container id when the runtime did not say which pod it is.
    pub fn who(&self) -> String {
        match (&self.pod_namespace, &self.pod_name) {
            (Some(ns), Some(name)) => format!("pod {ns}/{name}"),
            _ => format!("container {}", self.container_id),
        }
    }
}

/// What the plugin asks the agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "command", rename_all = "UPPERCASE")]
pub enum Request {
    /// Enforce the pod's policy on its interfaces; answer once it is.
    Add(Attachment),
    /// The sandbox goes away.
    Del(Attachment),
    /// Is the pod's policy enforced on its interfaces?
    Check(Attachment),
    /// Is the agent ready to enforce new pods?
    Status,
}

/// The agent's answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Response {
    /// Done (or true, for CHECK and STATUS).
    pub ok: bool,
    /// What was done, or why not.
    pub message: String,
}

/// Why a call to the agent failed.
#[derive(Debug)]
pub enum CallError {
    /// The socket is not there, refused, or the agent did not answer in time.
    Unreachable(std::io::Error),
    /// The agent answered something that is not a [`Response`].
    BadAnswer(String),
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallError::Unreachable(e) => write!(f, "{e}"),
            CallError::BadAnswer(a) => write!(f, "unreadable answer {a:?}"),
        }
    }
}

/// Sends `request` to the agent at `socket` and reads its answer, within `timeout`.
pub fn call(socket: &Path, request: &Request, timeout: Duration) -> Result<Response, CallError> {
    let mut stream = UnixStream::connect(socket).map_err(CallError::Unreachable)?;
    stream
        .set_read_timeout(Some(timeout))
        .and_then(|()| stream.set_write_timeout(Some(timeout)))
        .map_err(CallError::Unreachable)?;
    let mut line = serde_json::to_string(request).expect("a request serializes");
    line.push('\n');
    stream
        .write_all(line.as_bytes())
        .map_err(CallError::Unreachable)?;
    let mut answer = String::new();
    BufReader::new(&stream)
        .read_line(&mut answer)
        .map_err(CallError::Unreachable)?;
    serde_json::from_str(answer.trim()).map_err(|_| CallError::BadAnswer(answer))
}

/// A CNI error result (CNI spec 1.0, "Error"): printed on stdout, exit code 1.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CniError {
    /// Filled in when printed.
    #[serde(rename = "cniVersion")]
    pub cni_version: String,
    /// 1-99 are the spec's (4 invalid environment variables, 6 failed to decode content, 7
    /// invalid network config, 11 try again later, 50 the plugin is not available); 100 and up
    /// are this plugin's: 100 the agent refused.
    pub code: u32,
    /// Short message.
    pub msg: String,
    /// Longer explanation.
    pub details: String,
}

impl CniError {
    /// An error with `code`.
    pub fn new(code: u32, msg: impl Into<String>, details: impl Into<String>) -> CniError {
        CniError {
            cni_version: "1.0.0".into(),
            code,
            msg: msg.into(),
            details: details.into(),
        }
    }
}

/// The network configuration the runtime passes on stdin (the fields the plugin reads).
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NetConf {
    /// The version of the configuration; the result is printed in it.
    pub cni_version: String,
    /// The network's name.
    #[serde(default)]
    pub name: String,
    /// The main plugin's result (ADD, DEL, CHECK of a chained plugin).
    #[serde(default)]
    pub prev_result: Option<Value>,
    /// The agent's socket ([`DEFAULT_SOCKET`]).
    #[serde(default)]
    pub socket: Option<String>,
    /// How long to wait for the agent ([`DEFAULT_TIMEOUT`]).
    #[serde(default)]
    pub timeout_seconds: Option<u64>,
}

impl NetConf {
    /// Parses the runtime's stdin.
    pub fn parse(stdin: &[u8]) -> Result<NetConf, CniError> {
        let conf: NetConf = serde_json::from_slice(stdin).map_err(|e| {
            CniError::new(
                6,
                "failed to decode the network configuration",
                e.to_string(),
            )
        })?;
        if !SUPPORTED_VERSIONS.contains(&conf.cni_version.as_str()) {
            return Err(CniError::new(
                1,
                format!("CNI version {} is not supported", conf.cni_version),
                format!("supported: {}", SUPPORTED_VERSIONS.join(", ")),
            ));
        }
        Ok(conf)
    }
}

/// `CNI_ARGS` (`K1=V1;K2=V2`) as pairs.
pub fn cni_args(args: &str) -> Vec<(String, String)> {
    args.split(';')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect()
}

/// The attachment described by the runtime's environment and the main plugin's result.
pub fn attachment(
    container_id: &str,
    args: &str,
    prev_result: Option<&Value>,
) -> Result<Attachment, CniError> {
    let args = cni_args(args);
    let arg = |k: &str| {
        args.iter()
            .find(|(key, _)| key == k)
            .map(|(_, v)| v.clone())
    };
    let mut a = Attachment {
        container_id: container_id.to_string(),
        pod_namespace: arg("K8S_POD_NAMESPACE"),
        pod_name: arg("K8S_POD_NAME"),
        host_interfaces: Vec::new(),
        ips: Vec::new(),
    };
    let Some(prev) = prev_result else {
        return Ok(a);
    };
    let bad = |what: String| CniError::new(7, "invalid prevResult", what);
    let interfaces = prev["interfaces"].as_array().cloned().unwrap_or_default();
    for (i, iface) in interfaces.iter().enumerate() {
        let name = iface["name"]
            .as_str()
            .ok_or_else(|| bad(format!("interfaces[{i}].name is missing")))?;
        if iface["sandbox"].as_str().is_none_or(str::is_empty) {
            a.host_interfaces.push(name.to_string());
        }
    }
    for (i, ip) in prev["ips"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .enumerate()
    {
        let text = ip["address"]
            .as_str()
            .ok_or_else(|| bad(format!("ips[{i}].address is missing")))?;
        let addr = text.split('/').next().unwrap_or_default();
        a.ips.push(
            addr.parse()
                .map_err(|_| bad(format!("ips[{i}].address {text:?} is not an address")))?,
        );
    }
    Ok(a)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_attachment_comes_from_the_runtime_and_the_main_plugins_result() {
        let prev = json!({
            "cniVersion": "1.0.0",
            "interfaces": [
                {"name": "veth1234", "mac": "aa:bb:cc:dd:ee:ff"},
                {"name": "eth0", "mac": "11:22:33:44:55:66", "sandbox": "/var/run/netns/p"}
            ],
            "ips": [{"address": "10.1.0.5/24", "interface": 1, "gateway": "10.1.0.1"},
                    {"address": "fd00::5/64", "interface": 1}]
        });
        let a = attachment(
            "c1",
            "IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME=web-0",
            Some(&prev),
        )
        .unwrap();
        assert_eq!(a.host_interfaces, vec!["veth1234"]);
        assert_eq!(
            a.ips,
            vec![
                "10.1.0.5".parse::<IpAddr>().unwrap(),
                "fd00::5".parse().unwrap()
            ]
        );
        assert_eq!(a.who(), "pod shop/web-0");
        let line = serde_json::to_string(&Request::Add(a.clone())).unwrap();
        assert!(
            line.starts_with(r#"{"command":"ADD","containerId":"c1""#),
            "{line}"
        );
        assert_eq!(
            serde_json::from_str::<Request>(&line).unwrap(),
            Request::Add(a)
        );
        let bad = json!({"ips": [{"address": "nonsense"}]});
        assert_eq!(attachment("c1", "", Some(&bad)).unwrap_err().code, 7);
    }

    #[test]
    fn unsupported_versions_and_garbage_are_cni_errors() {
        assert_eq!(NetConf::parse(b"{").unwrap_err().code, 6);
        assert_eq!(
            NetConf::parse(br#"{"cniVersion": "9.9.9", "name": "n", "type": "ordnet-cni"}"#)
                .unwrap_err()
                .code,
            1
        );
        let c = NetConf::parse(
            br#"{"cniVersion": "1.0.0", "name": "n", "type": "ordnet-cni", "socket": "/x"}"#,
        )
        .unwrap();
        assert_eq!(c.socket.as_deref(), Some("/x"));
    }
}
