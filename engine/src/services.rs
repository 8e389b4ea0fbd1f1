//! Services, as far as policy needs them (SEMANTICS.md §2, "Services"): a packet to a Service
//! address is judged as the flow to the backend kube-proxy translates it to.
//!
//! * The datapath needs the **frontends** only: every ClusterIP, external IP and load-balancer
//!   IP with each Service port, and every NodePort (on the node's addresses, which the caller
//!   knows). A new flow to a frontend is judged after translation (`docs/datapath.md` §14);
//!   the backends never enter the datapath, so Service and EndpointSlice changes cannot open a
//!   transient allow.
//! * `ordnet matrix`, `lab` and the agent's debug API need the **backends**, to name the
//!   verdict of each: the pods of the Service's namespace that its selector selects and that are
//!   endpoints (an address, not host-network, not terminated), each with the target port of the
//!   Service port resolved on it (a named `targetPort` by name and protocol among the pod's
//!   container ports; a pod without it is no backend of that port, as the EndpointSlice
//!   controller leaves it out). A Service without a selector has no backends known here.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use ordnet_mapstate::Protocol;
use serde::Serialize;

use crate::build::Engine;
use crate::identity::resolve_named;
use crate::model::{EngineError, Labels, parse_protocol};
use crate::store::PodKey;

/// Where a Service port sends its traffic on a backend.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum TargetPort {
    /// A port number.
    Number(u16),
    /// A container port name, resolved on each backend (name and protocol).
    Name(String),
}

/// One port of a Service.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct ServicePort {
    /// `spec.ports[].name`.
    pub name: Option<String>,
    /// `spec.ports[].protocol` (absent = TCP).
    pub protocol: Protocol,
    /// The frontend port (on every ClusterIP, external and load-balancer IP).
    pub port: u16,
    /// `targetPort`; absent = `port`, a numeric string = that number.
    pub target: TargetPort,
    /// The port on every node address (type NodePort or LoadBalancer).
    pub node_port: Option<u16>,
}

/// What the engine keeps of a Service.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ServiceRec {
    /// ClusterIPs (one per family; none for a headless Service).
    pub cluster_ips: Vec<IpAddr>,
    /// `spec.externalIPs` and `status.loadBalancer.ingress[].ip`.
    pub external_ips: Vec<IpAddr>,
    /// `spec.ports`, in order.
    pub ports: Vec<ServicePort>,
    /// `None`: no selector (backends managed by hand; unknown here).
    pub selector: Option<Arc<Labels>>,
    /// `spec.externalTrafficPolicy: Local` (node ports and external IPs keep the client address
    /// and reach only the node's own backends).
    pub external_local: bool,
}

impl ServiceRec {
    /// The ClusterIP of `family`, if the Service has one.
    pub fn cluster_ip(&self, family: crate::build::IpFamily) -> Option<IpAddr> {
        self.cluster_ips
            .iter()
            .copied()
            .find(|ip| family.contains(*ip))
    }
}

/// One backend of a Service port.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Backend {
    /// `namespace/name`.
    pub pod: String,
    /// The port the backend receives the flow on.
    pub port: u16,
}

/// `namespace/name` of a Service.
pub type ServiceKey = (String, String);

/// Reads a Service. Errors name the Service and the field.
pub fn read_service(svc: &Service) -> Result<(ServiceKey, ServiceRec), EngineError> {
    let name = svc.metadata.name.clone().unwrap_or_default();
    let namespace = svc
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| ordnet_crds::DEFAULT_NAMESPACE.to_string());
    let err = |field: String, message: String| EngineError {
        object: format!("Service {namespace}/{name}"),
        field,
        message,
    };
    if name.is_empty() {
        return Err(err("metadata.name".into(), "required".into()));
    }
    let spec = svc.spec.clone().unwrap_or_default();
    let addr = |text: &str, field: String| -> Result<Option<IpAddr>, EngineError> {
        if text.is_empty() || text == "None" {
            return Ok(None);
        }
        text.parse::<IpAddr>()
            .map(Some)
            .map_err(|_| err(field, format!("{text:?} is not an IP address")))
    };
    let mut cluster_ips = Vec::new();
    if let Some(ip) = addr(
        spec.cluster_ip.as_deref().unwrap_or(""),
        "spec.clusterIP".into(),
    )? {
        cluster_ips.push(ip);
    }
    for (i, text) in spec.cluster_ips.iter().flatten().enumerate() {
        if let Some(ip) = addr(text, format!("spec.clusterIPs[{i}]"))?
            && !cluster_ips.contains(&ip)
        {
            cluster_ips.push(ip);
        }
    }
    let mut external_ips = Vec::new();
    for (i, text) in spec.external_ips.iter().flatten().enumerate() {
        external_ips.extend(addr(text, format!("spec.externalIPs[{i}]"))?);
    }
    let ingress = svc
        .status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_ref());
    for (i, lb) in ingress.into_iter().flatten().enumerate() {
        if let Some(text) = lb.ip.as_deref() {
            external_ips.extend(addr(text, format!("status.loadBalancer.ingress[{i}].ip"))?);
        }
    }
    external_ips.sort();
    external_ips.dedup();
    let mut ports = Vec::new();
    for (i, p) in spec.ports.iter().flatten().enumerate() {
        let field = format!("spec.ports[{i}]");
        let number = |n: i32, f: &str| {
            u16::try_from(n)
                .ok()
                .filter(|&n| n >= 1)
                .ok_or_else(|| err(format!("{field}.{f}"), format!("{n} is not a port number")))
        };
        let protocol = parse_protocol(p.protocol.as_deref()).ok_or_else(|| {
            err(
                format!("{field}.protocol"),
                format!(
                    "{:?} is not supported: use TCP, UDP or SCTP",
                    p.protocol.as_deref().unwrap_or_default()
                ),
            )
        })?;
        let port = number(p.port, "port")?;
        let target = match &p.target_port {
            None => TargetPort::Number(port),
            Some(IntOrString::Int(n)) => TargetPort::Number(number(*n, "targetPort")?),
            Some(IntOrString::String(s)) => match s.parse::<i32>() {
                Ok(n) => TargetPort::Number(number(n, "targetPort")?),
                Err(_) => TargetPort::Name(s.clone()),
            },
        };
        let node_port = p.node_port.map(|n| number(n, "nodePort")).transpose()?;
        ports.push(ServicePort {
            name: p.name.clone(),
            protocol,
            port,
            target,
            node_port,
        });
    }
    Ok((
        (namespace, name),
        ServiceRec {
            cluster_ips,
            external_ips,
            ports,
            selector: spec
                .selector
                .filter(|s| !s.is_empty())
                .map(|s| Arc::new(s.into_iter().collect())),
            external_local: spec.external_traffic_policy.as_deref() == Some("Local"),
        },
    ))
}

impl Engine {
    /// The Services, by `(namespace, name)`.
    pub fn services(&self) -> impl Iterator<Item = (&ServiceKey, &ServiceRec)> {
        self.store.services.iter().map(|(k, v)| (k, &**v))
    }

    /// One Service.
    pub fn service(&self, namespace: &str, name: &str) -> Option<&ServiceRec> {
        self.store
            .services
            .get(&(namespace.to_string(), name.to_string()))
            .map(|s| &**s)
    }

    /// Every Service frontend that is an address of its own: (ClusterIP, external or
    /// load-balancer IP, protocol, port), sorted. The NodePorts are [`Engine::node_ports`].
    pub fn service_frontends(&self) -> BTreeSet<(IpAddr, Protocol, u16)> {
        let mut out = BTreeSet::new();
        for svc in self.store.services.values() {
            for ip in svc.cluster_ips.iter().chain(&svc.external_ips) {
                for p in &svc.ports {
                    out.insert((*ip, p.protocol, p.port));
                }
            }
        }
        out
    }

    /// Every (protocol, NodePort) of every Service: frontends on each of the node's addresses.
    pub fn node_ports(&self) -> BTreeSet<(Protocol, u16)> {
        self.store
            .services
            .values()
            .flat_map(|s| s.ports.iter())
            .filter_map(|p| p.node_port.map(|n| (p.protocol, n)))
            .collect()
    }

    /// The backends of Service `namespace/name` for its port (`protocol`, `port`), sorted by
    /// pod: the ready pods with an address of its namespace that its selector selects and, for
    /// a named target port, that have such a container port (kube-proxy's endpoints). `None`
    /// when the Service or the port does not exist; empty without a selector.
    pub fn service_backends(
        &self,
        namespace: &str,
        name: &str,
        protocol: Protocol,
        port: u16,
    ) -> Option<Vec<Backend>> {
        let svc = self.service(namespace, name)?;
        let sp = svc
            .ports
            .iter()
            .find(|p| p.protocol == protocol && p.port == port)?;
        let Some(selector) = &svc.selector else {
            return Some(Vec::new());
        };
        let start: PodKey = (namespace.to_string(), String::new());
        let mut out = Vec::new();
        for ((ns, pod), rec) in self.store.pods.range(start..) {
            if ns != namespace {
                break;
            }
            if !rec.addressed()
                || !rec.ready
                || !selector.iter().all(|(k, v)| rec.labels.get(k) == Some(v))
            {
                continue;
            }
            let target = match &sp.target {
                TargetPort::Number(n) => Some(*n),
                TargetPort::Name(n) => resolve_named(&rec.ports, n, protocol).first().copied(),
            };
            if let Some(port) = target {
                out.push(Backend {
                    pod: format!("{ns}/{pod}"),
                    port,
                });
            }
        }
        Some(out)
    }
}

/// A Service as one more destination of a matrix (`svc:namespace/name`): the frontend it is
/// probed at and the backends it translates to, each at its address of the probed family.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceDestination {
    /// `svc:namespace/name`.
    pub name: String,
    /// The ClusterIP of the family.
    pub frontend: IpAddr,
    /// `(namespace/name, address, port)` of every backend that is an endpoint of this engine
    /// with an address of the family, sorted.
    pub backends: Vec<(String, IpAddr, u16)>,
}

impl Engine {
    /// The Services a matrix probes on (`protocol`, `port`) over `family`: those with such a
    /// port, a ClusterIP of the family and at least one backend that is an endpoint of this
    /// engine (offline: every pod; an agent: the pods of its node), sorted by name. A Service
    /// without such backends is not probed (CLI.md).
    pub fn service_destinations(
        &self,
        protocol: Protocol,
        port: u16,
        family: crate::build::IpFamily,
    ) -> Vec<ServiceDestination> {
        let mut out = Vec::new();
        for ((ns, name), svc) in &self.store.services {
            let Some(frontend) = svc.cluster_ip(family) else {
                continue;
            };
            let Some(backends) = self.service_backends(ns, name, protocol, port) else {
                continue;
            };
            let backends: Vec<(String, IpAddr, u16)> = backends
                .into_iter()
                .filter_map(|b| {
                    let (bns, bname) = b.pod.split_once('/')?;
                    let addr = self.endpoint(bns, bname)?.address(family)?;
                    Some((b.pod, addr, b.port))
                })
                .collect();
            if backends.is_empty() {
                continue;
            }
            out.push(ServiceDestination {
                name: format!("svc:{ns}/{name}"),
                frontend,
                backends,
            });
        }
        out
    }
}
