//! The agent's debug API (HTTP/1.1, `--debug-addr`, loopback by default). Paths are documented
//! in `docs/agent.md`:
//!
//! * `GET /healthz`: 200 while the process serves;
//! * `GET /readyz`: 200 once the initial sync is programmed, 503 before; the body names every
//!   kind whose watch is stale (since when, the last error) while the last state is enforced;
//! * `GET /metrics`: the metrics (OpenMetrics text; also on `--metrics-addr`, see `metrics.rs`);
//! * `GET /v1/problems`: the objects skipped as invalid (JSON);
//! * `GET /v1/matrix?protocol=TCP&port=80&external=IP&family=4&output=table|json&width=N`:
//!   `ordnet matrix` over this node's endpoints (and the `external` addresses);
//! * `GET /v1/trace?from=SRC&to=DST&protocol=TCP&port=80&family=4&output=text|json`:
//!   `ordnet trace` (every pod end must be an endpoint of this node: only its MapStates are
//!   programmed here); 500 if the datapath and the engine's explanation disagree (a bug);
//! * `GET /v1/dump?pod=NS/NAME&direction=ingress|egress&output=tree|json|dot`: `ordnet dump`;
//! * `GET /v1/observe?last=N&since=SEQ&pod=NS/NAME&namespace=NS&verdict=allow|deny&direction=
//!   ingress|egress&policy=NAME&protocol=P&port=N&output=text|json`: the last `N` (default 20)
//!   verdict events after sequence number `SEQ` that pass the filters, attributed to their
//!   rules (`ordnet observe`); the header `X-Ordnet-Last` (and `last` in JSON) is the highest
//!   sequence number so far, to ask `since=` it next;
//! * `GET /v1/counters?policy=NAME&namespace=NS&output=text|json`: the kernel's per-rule
//!   counters (`ordnet observe --counters`): per rule, the new flows it allowed and the flows
//!   and packets it denied since the agent started; 404 when the datapath has none;
//! * `POST /v1/whatif?output=text|json` with manifests (YAML) as the body (at most
//!   [`MAX_WHATIF_BODY`]): `ordnet whatif --agent`: the node's flow history replayed against
//!   its objects plus those, staged policies enforced; 400 with the manifests' errors.
//!
//! `output` defaults to `json`; `color=1` asks for ANSI colours (the client decides, from its
//! own terminal); `width` is the table width (`$COLUMNS` of the client, default 160). The
//! answer is rendered by `crate::render`, the renderer of the offline commands, so
//! `ordnet matrix|trace|dump --agent ADDR` prints exactly what the offline command prints.
//! The verdicts of `matrix` and `trace` are the datapath's: crafted frames decided over the
//! tables this agent programmed (`Datapath::plane`), by `crate::offline`'s functions, the ones
//! the offline commands use; `trace` explains them with the engine whose MapStates the datapath
//! holds (they are updated together, under the same locks), and `dump` shows those MapStates.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use ordnet_datapath::ControlPlane;
use ordnet_engine::{Engine, FlowEnd, IdentityKind, IpFamily};
use ordnet_mapstate::{Direction, Protocol};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use super::AgentState;
use crate::offline::{self, TraceError};
use crate::render::{self, Style};

/// Binds `addr` and serves the debug API; returns the bound address and the server task.
pub async fn serve(
    addr: SocketAddr,
    state: Arc<AgentState>,
) -> std::io::Result<(SocketAddr, JoinHandle<()>)> {
    serve_with(addr, state, route, true).await
}

/// The largest body `POST /v1/whatif` reads.
pub const MAX_WHATIF_BODY: usize = 8 << 20;

/// Binds `addr` and serves only `GET /metrics` (`--metrics-addr`: on the node's addresses for
/// Prometheus, while the debug API stays on loopback).
pub async fn serve_metrics(
    addr: SocketAddr,
    state: Arc<AgentState>,
) -> std::io::Result<(SocketAddr, JoinHandle<()>)> {
    serve_with(
        addr,
        state,
        |state, req| match (req.method(), req.uri().path()) {
            (&Method::GET, "/metrics") => metrics(state),
            _ => text(StatusCode::NOT_FOUND, "only GET /metrics here"),
        },
        false,
    )
    .await
}

/// Serves `route` on `addr`; `debug_api`: also the asynchronous answers of the debug API
/// (`POST /v1/whatif`, `GET /v1/batches`).
async fn serve_with(
    addr: SocketAddr,
    state: Arc<AgentState>,
    route: fn(&AgentState, &Request<()>) -> Response<Full<Bytes>>,
    debug_api: bool,
) -> std::io::Result<(SocketAddr, JoinHandle<()>)> {
    let listener = TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let state = state.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req: Request<Incoming>| {
                    let state = state.clone();
                    async move {
                        if debug_api
                            && req.method() == Method::POST
                            && req.uri().path() == "/v1/whatif"
                        {
                            return Ok::<_, Infallible>(whatif(state, req).await);
                        }
                        if debug_api
                            && req.method() == Method::GET
                            && req.uri().path() == "/v1/batches"
                        {
                            return Ok(batches(&state, &query(&req)).await);
                        }
                        let req = Request::from_parts(req.into_parts().0, ());
                        if reads_no_engine(req.uri().path()) {
                            return Ok(route(&state, &req));
                        }
                        let answer = tokio::task::spawn_blocking(move || route(&state, &req));
                        Ok(answer.await.unwrap_or_else(|e| {
                            text(StatusCode::INTERNAL_SERVER_ERROR, e.to_string())
                        }))
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    Ok((bound, task))
}

/// The longest `/v1/batches` waits.
pub const MAX_BATCH_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

/// `GET /v1/batches?after=N&timeout=SECONDS`: the number of batches of changes programmed
/// (`ordnet_update_batches_total`), once it is above `after` or `timeout` (default 10 s, at
/// most [`MAX_BATCH_WAIT`]) passed, whichever is first; at once without `after`. Lets a script
/// or a benchmark wait for the next programming without polling the agent while it works.
async fn batches(state: &AgentState, q: &BTreeMap<String, Vec<String>>) -> Response<Full<Bytes>> {
    let after = match one(q, "after").map(str::parse::<u64>) {
        None => None,
        Some(Ok(n)) => Some(n),
        Some(Err(_)) => return text(StatusCode::BAD_REQUEST, "after: not a count"),
    };
    let timeout = match one(q, "timeout").map(str::parse::<f64>) {
        None => std::time::Duration::from_secs(10),
        Some(Ok(s)) if s.is_finite() && s >= 0.0 => {
            std::time::Duration::from_secs_f64(s).min(MAX_BATCH_WAIT)
        }
        Some(_) => {
            return text(StatusCode::BAD_REQUEST, "timeout: not a number of seconds");
        }
    };
    let n = match after {
        Some(after) => state.batches_after(after, timeout).await,
        None => *state.programmed.borrow(),
    };
    text(StatusCode::OK, format!("{n}\n"))
}

/// `POST /v1/whatif`: reads the manifests, replays the flow history off the async threads.
async fn whatif(state: Arc<AgentState>, req: Request<Incoming>) -> Response<Full<Bytes>> {
    use http_body_util::BodyExt;
    let q = query(&req);
    let format = match output(&q, render::trace::Format::parse, "text or json") {
        Ok(f) => f,
        Err(Bad(m) | Internal(m) | Denied(m)) => return text(StatusCode::BAD_REQUEST, m),
    };
    let body = match http_body_util::Limited::new(req.into_body(), MAX_WHATIF_BODY)
        .collect()
        .await
    {
        Ok(b) => b.to_bytes(),
        Err(e) => {
            return text(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("the manifests: {e} (at most {MAX_WHATIF_BODY} bytes)"),
            );
        }
    };
    let Ok(manifests) = String::from_utf8(body.to_vec()) else {
        return text(StatusCode::BAD_REQUEST, "the manifests are not UTF-8");
    };
    let answer = tokio::task::spawn_blocking(move || state.whatif(&manifests)).await;
    match answer {
        Ok(Ok((history, changed))) => match format {
            render::trace::Format::Json => json(crate::whatif::json(&history, &changed)),
            render::trace::Format::Text => respond(
                StatusCode::OK,
                "text/plain; charset=utf-8",
                crate::whatif::text(&history, &changed),
            ),
        },
        Ok(Err(m)) => text(StatusCode::BAD_REQUEST, m),
        Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

/// `GET /readyz`: 200 once the initial sync is programmed (with the datapath's health and the
/// stale watches, if any), 503 before. Reads no engine: it answers while a change is applied.
fn readyz(state: &AgentState) -> Response<Full<Bytes>> {
    let stale = stale_lines(state);
    let health = state.metrics.health();
    if state.ready() {
        if stale.is_empty() && health.is_empty() {
            text(StatusCode::OK, "ready")
        } else if stale.is_empty() {
            text(
                StatusCode::OK,
                format!("ready; datapath:\n{}", health.join("\n")),
            )
        } else {
            // Still ready: the last programmed state is enforced; say how old it may be.
            text(
                StatusCode::OK,
                format!(
                    "ready, enforcing the last programmed state; stale:\n{}",
                    stale.join("\n")
                ),
            )
        }
    } else if stale.is_empty() {
        text(
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: waiting for the initial lists",
        )
    } else {
        text(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "not ready: waiting for the initial lists; stale:\n{}",
                stale.join("\n")
            ),
        )
    }
}

fn metrics(state: &AgentState) -> Response<Full<Bytes>> {
    respond(
        StatusCode::OK,
        "application/openmetrics-text; version=1.0.0; charset=utf-8",
        state.metrics.render(
            state.ready(),
            state
                .problems()
                .iter()
                .filter(|p| p.enforced == "no")
                .count(),
            &state.watch,
        ),
    )
}

/// One line per stale kind: `Pod: stale for 12 s: <the last error>`.
fn stale_lines(state: &AgentState) -> Vec<String> {
    state
        .watch
        .stale(std::time::Instant::now())
        .into_iter()
        .map(|(kind, d, e)| {
            let mut line = format!("{}: stale for {} s", kind.name(), d.as_secs());
            if let Some(e) = e {
                line.push_str(": ");
                line.push_str(&e);
            }
            line
        })
        .collect()
}

fn respond(code: StatusCode, content_type: &str, body: String) -> Response<Full<Bytes>> {
    Response::builder()
        .status(code)
        .header("content-type", content_type)
        .body(Full::new(Bytes::from(body)))
        .expect("response")
}

fn text(code: StatusCode, body: impl Into<String>) -> Response<Full<Bytes>> {
    let mut b = body.into();
    if !b.ends_with('\n') {
        b.push('\n');
    }
    respond(code, "text/plain; charset=utf-8", b)
}

fn json(body: String) -> Response<Full<Bytes>> {
    respond(StatusCode::OK, "application/json", body)
}

/// The query parameters (repeated keys keep every value, in order).
fn query<B>(req: &Request<B>) -> BTreeMap<String, Vec<String>> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (k, v) in form_urlencoded::parse(req.uri().query().unwrap_or_default().as_bytes()) {
        out.entry(k.into_owned()).or_default().push(v.into_owned());
    }
    out
}

fn one<'a>(q: &'a BTreeMap<String, Vec<String>>, k: &str) -> Option<&'a str> {
    q.get(k).and_then(|v| v.last()).map(String::as_str)
}

/// Why a question has no answer.
#[derive(Debug)]
enum Failure {
    /// A bad request: 400 with the message.
    Bad(String),
    /// The datapath and the engine disagree (a bug): 500 with the message.
    Internal(String),
    /// The pod asked for is denied in both directions because its policy does not fit the
    /// datapath's maps, so what is asked for (its MapStates) is not what the datapath holds:
    /// 409 with the message.
    Denied(String),
}

use Failure::{Bad, Denied, Internal};

fn protocol(q: &BTreeMap<String, Vec<String>>) -> Result<Protocol, Failure> {
    match one(q, "protocol")
        .unwrap_or("TCP")
        .to_ascii_uppercase()
        .as_str()
    {
        "TCP" => Ok(Protocol::Tcp),
        "UDP" => Ok(Protocol::Udp),
        "SCTP" => Ok(Protocol::Sctp),
        other => Err(Bad(format!("protocol: {other:?} is not TCP, UDP or SCTP"))),
    }
}

fn port(q: &BTreeMap<String, Vec<String>>) -> Result<u16, Failure> {
    let p = one(q, "port").unwrap_or("80");
    p.parse()
        .map_err(|_| Bad(format!("port: {p:?} is not a port number")))
}

/// The output format (`output=`, default `json`).
fn output<F>(
    q: &BTreeMap<String, Vec<String>>,
    parse: fn(&str) -> Option<F>,
    formats: &str,
) -> Result<F, Failure> {
    let o = one(q, "output").unwrap_or("json");
    parse(o).ok_or_else(|| Bad(format!("output: {o:?} is not {formats}")))
}

/// `color=1`: ANSI colours; anything else: plain text.
fn style(q: &BTreeMap<String, Vec<String>>) -> Style {
    Style::new(matches!(one(q, "color"), Some("1" | "true")))
}

fn family(q: &BTreeMap<String, Vec<String>>) -> Result<IpFamily, Failure> {
    match one(q, "family").unwrap_or("4") {
        "4" => Ok(IpFamily::V4),
        "6" => Ok(IpFamily::V6),
        other => Err(Bad(format!("family: {other:?} is not 4 or 6"))),
    }
}

/// Whether [`route`]'s answer for `path` reads neither the engine nor the datapath, and so is
/// made on the async thread at once. The others may wait for the engine's lock, which a change
/// holds while it is applied (seconds for a full programming): they wait on the blocking pool,
/// not on the async threads the watches need meanwhile.
fn reads_no_engine(path: &str) -> bool {
    matches!(path, "/healthz" | "/readyz" | "/metrics")
}

fn route(state: &AgentState, req: &Request<()>) -> Response<Full<Bytes>> {
    if req.method() != Method::GET {
        return text(
            StatusCode::METHOD_NOT_ALLOWED,
            "only GET (and POST /v1/whatif)",
        );
    }
    let q = query(req);
    match req.uri().path() {
        "/healthz" => text(StatusCode::OK, "ok"),
        "/readyz" => readyz(state),
        "/metrics" => metrics(state),
        "/v1/observe" => match observe(state, &q) {
            Ok(r) => r,
            Err(Bad(m)) => text(StatusCode::BAD_REQUEST, m),
            Err(Internal(m) | Denied(m)) => text(StatusCode::INTERNAL_SERVER_ERROR, m),
        },
        "/v1/counters" => counters(state, &q),
        "/v1/problems" => json(
            serde_json::to_string_pretty(&state.problems()).expect("problems serialize") + "\n",
        ),
        path @ ("/v1/matrix" | "/v1/trace" | "/v1/dump") => {
            let answer = state.with_programmed(|engine, dp| match path {
                "/v1/matrix" => matrix(engine, dp.plane(), &q),
                "/v1/trace" => trace(engine, dp.plane(), dp.denied(), &q),
                _ => dump(engine, dp.denied(), &q),
            });
            match answer {
                None => text(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "not ready: waiting for the initial lists",
                ),
                Some(Ok(body)) => {
                    if one(&q, "output").is_none_or(|o| o == "json") {
                        json(body)
                    } else {
                        respond(StatusCode::OK, "text/plain; charset=utf-8", body)
                    }
                }
                Some(Err(Bad(m))) => text(StatusCode::BAD_REQUEST, m),
                Some(Err(Internal(m))) => text(StatusCode::INTERNAL_SERVER_ERROR, m),
                Some(Err(Denied(m))) => text(StatusCode::CONFLICT, m),
            }
        }
        _ => text(StatusCode::NOT_FOUND, "not found"),
    }
}

/// `/v1/counters`: the per-rule counters' totals that pass the query's filters.
fn counters(state: &AgentState, q: &BTreeMap<String, Vec<String>>) -> Response<Full<Bytes>> {
    use crate::rule_counters::{CounterFilter, json as counters_json, rows, text as counters_text};
    let format = match output(q, render::trace::Format::parse, "text or json") {
        Ok(f) => f,
        Err(Bad(m) | Internal(m) | Denied(m)) => return text(StatusCode::BAD_REQUEST, m),
    };
    let filter = CounterFilter {
        policy: one(q, "policy").map(str::to_string),
        namespace: one(q, "namespace").map(str::to_string),
    };
    let style = render::Style::new(one(q, "color") == Some("1"));
    // The counts as of now, not of the last upkeep (the metrics too).
    state.datapath().collect_rule_counts();
    let answer = state.with_programmed(|_, dp| {
        state.metrics.set_datapath(dp);
        dp.rule_totals().map(|totals| {
            let rows = rows(totals, &filter);
            match format {
                render::trace::Format::Json => counters_json(&rows),
                render::trace::Format::Text => counters_text(&rows, style),
            }
        })
    });
    match answer {
        None => text(
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: waiting for the initial lists",
        ),
        Some(None) => text(
            StatusCode::NOT_FOUND,
            "this agent's datapath has no per-rule counters (not the kernel datapath)",
        ),
        Some(Some(body)) if format == render::trace::Format::Json => json(body),
        Some(Some(body)) => respond(StatusCode::OK, "text/plain; charset=utf-8", body),
    }
}

/// `/v1/observe`: the journal's records that pass the query's filters.
fn observe(
    state: &AgentState,
    q: &BTreeMap<String, Vec<String>>,
) -> Result<Response<Full<Bytes>>, Failure> {
    use crate::observe::{Filter, Page, protocol_name};
    let number = |k: &str| -> Result<Option<u64>, Failure> {
        one(q, k)
            .map(|v| {
                v.parse::<u64>()
                    .map_err(|_| Bad(format!("{k}: not a number: {v}")))
            })
            .transpose()
    };
    let format = output(q, render::trace::Format::parse, "text or json")?;
    let protocol = match one(q, "protocol") {
        None => None,
        Some(p) => Some(
            (0..=255u8)
                .find(|n| protocol_name(*n).eq_ignore_ascii_case(p))
                .ok_or_else(|| Bad(format!("protocol: unknown: {p}")))?,
        ),
    };
    let filter = Filter {
        pod: one(q, "pod").map(str::to_string),
        namespace: one(q, "namespace").map(str::to_string),
        allowed: match one(q, "verdict") {
            None => None,
            Some("allow") => Some(true),
            Some("deny") => Some(false),
            Some(v) => return Err(Bad(format!("verdict: allow or deny, not {v}"))),
        },
        direction: match one(q, "direction") {
            None => None,
            Some("ingress") => Some(Direction::Ingress),
            Some("egress") => Some(Direction::Egress),
            Some(v) => return Err(Bad(format!("direction: ingress or egress, not {v}"))),
        },
        policy: one(q, "policy").map(str::to_string),
        protocol,
        port: number("port")?
            .map(|p| u16::try_from(p).map_err(|_| Bad(format!("port: out of range: {p}"))))
            .transpose()?,
    };
    let since = number("since")?.unwrap_or(0);
    let last = number("last")?.unwrap_or(20) as usize;
    let (records, last_seq) = {
        let journal = state.journal.lock().unwrap_or_else(|e| e.into_inner());
        (journal.select(since, &filter, last), journal.next_seq() - 1)
    };
    let body = match format {
        render::trace::Format::Json => {
            serde_json::to_string_pretty(&Page {
                records,
                last: last_seq,
            })
            .expect("records serialize")
                + "\n"
        }
        render::trace::Format::Text => records
            .iter()
            .map(|r| crate::observe::text(r, style(q)))
            .collect(),
    };
    let content = match format {
        render::trace::Format::Json => "application/json",
        render::trace::Format::Text => "text/plain; charset=utf-8",
    };
    let mut r = respond(StatusCode::OK, content, body);
    r.headers_mut()
        .insert("x-ordnet-last", hyper::header::HeaderValue::from(last_seq));
    Ok(r)
}

fn matrix(
    engine: &Engine,
    plane: &dyn ControlPlane,
    q: &BTreeMap<String, Vec<String>>,
) -> Result<String, Failure> {
    let proto = protocol(q)?;
    let port = port(q)?;
    let family = family(q)?;
    let mut externals: Vec<IpAddr> = Vec::new();
    for e in q.get("external").into_iter().flatten() {
        let ip: IpAddr = e
            .parse()
            .map_err(|_| Bad(format!("external: {e:?} is not an IP address")))?;
        if !family.contains(ip) {
            return Err(Bad(format!(
                "external: {ip} is not of the requested family"
            )));
        }
        if !externals.contains(&ip) {
            externals.push(ip);
        }
    }
    let format = output(q, render::matrix::Format::parse, "table or json")?;
    let width = match one(q, "width") {
        None => 160,
        Some(w) => w
            .parse()
            .map_err(|_| Bad(format!("width: {w:?} is not a number")))?,
    };
    let m = offline::matrix(engine, plane, proto, port, &externals, family);
    Ok(render::matrix::render(&m, family, format, style(q), width))
}

/// Whether `end` is evaluated by this node: a pod end (by name or by address) must be an
/// endpoint of this node, because only its MapStates are programmed here.
fn local_end(engine: &Engine, end: &FlowEnd, text: &str) -> Result<(), Failure> {
    match end {
        FlowEnd::Pod { namespace, name } => match engine.endpoint(namespace, name) {
            Some(_) => Ok(()),
            None => Err(Bad(format!(
                "{text}: {namespace}/{name} is not an endpoint of this node (ask the agent of its node)"
            ))),
        },
        FlowEnd::Ip(ip) => {
            if engine.endpoints().iter().any(|ep| ep.ips.contains(ip)) {
                return Ok(());
            }
            match engine.identity_info(engine.identity_of(*ip)) {
                Some(info) if matches!(info.kind, IdentityKind::Pod) => Err(Bad(format!(
                    "{text}: {ip} is the address of a pod of another node ({}); ask the agent of its node",
                    info.members.join(", ")
                ))),
                _ => Ok(()),
            }
        }
    }
}

/// The endpoint (`ns/name`) a flow end stands for, if it is a local endpoint that holds a
/// deny-all policy because its own does not fit the maps, and why.
fn denied_end<'a>(
    engine: &Engine,
    end: &FlowEnd,
    denied: &'a BTreeMap<String, String>,
) -> Option<(String, &'a str)> {
    let name = match end {
        FlowEnd::Pod { namespace, name } => format!("{namespace}/{name}"),
        FlowEnd::Ip(ip) => engine
            .endpoints()
            .iter()
            .find(|ep| ep.ips.contains(ip))?
            .id(),
    };
    let why = denied.get(&name)?;
    Some((name, why))
}

/// The trace of a flow with an end denied for lack of room: its verdict is deny, by the
/// deny-all policy the endpoint holds instead of its own.
fn denied_trace(format: render::trace::Format, name: &str, why: &str) -> String {
    match format {
        render::trace::Format::Text => format!(
            "verdict: DENY\n  {name} is denied in both directions (fail closed): its policy does \
             not fit this node's datapath maps: {why}\n"
        ),
        render::trace::Format::Json => {
            serde_json::json!({
                "verdict": "deny",
                "deniedEndpoint": name,
                "reason": "the endpoint's policy does not fit the datapath's maps: it is denied in both directions",
                "detail": why,
            })
            .to_string()
                + "\n"
        }
    }
}

fn trace(
    engine: &Engine,
    plane: &dyn ControlPlane,
    denied: &BTreeMap<String, String>,
    q: &BTreeMap<String, Vec<String>>,
) -> Result<String, Failure> {
    let format = output(q, render::trace::Format::parse, "text or json")?;
    let proto = protocol(q)?;
    let port = port(q)?;
    let family = family(q)?;
    let from_s = one(q, "from").ok_or_else(|| Bad("from: required".into()))?;
    let to_s = one(q, "to").ok_or_else(|| Bad("to: required".into()))?;
    let from = engine
        .resolve(from_s)
        .map_err(|e| Bad(format!("from: {e}")))?;
    let to = engine.resolve(to_s).map_err(|e| Bad(format!("to: {e}")))?;
    local_end(engine, &from, "from")?;
    local_end(engine, &to, "to")?;
    if let Some((name, why)) =
        denied_end(engine, &from, denied).or_else(|| denied_end(engine, &to, denied))
    {
        return Ok(denied_trace(format, &name, why));
    }
    // Like `ordnet trace`: the family of an address end, else IPv4 (or `family=`).
    let family = offline::trace_family(&from, &to, family)
        .map_err(|(a, b)| Bad(format!("from {a} and to {b} are not of the same IP family")))?;
    let t =
        offline::trace(engine, plane, &from, &to, family, proto, port).map_err(|e| match e {
            TraceError::Input(m) => Bad(m),
            TraceError::Disagreement(m) => Internal(format!(
                "INTERNAL ERROR: the datapath and the engine disagree: {m}; this is a bug in ordnet"
            )),
        })?;
    Ok(render::trace::render(
        engine,
        &from,
        &to,
        family,
        proto,
        port,
        &t,
        format,
        style(q),
    ))
}

fn dump(
    engine: &Engine,
    denied: &BTreeMap<String, String>,
    q: &BTreeMap<String, Vec<String>>,
) -> Result<String, Failure> {
    let format = output(q, render::dump::Format::parse, "tree, json or dot")?;
    let pod = one(q, "pod").ok_or_else(|| Bad("pod: required (NAMESPACE/NAME)".into()))?;
    let (ns, name) = pod
        .split_once('/')
        .ok_or_else(|| Bad(format!("pod: {pod:?}: expected NAMESPACE/NAME")))?;
    let dirs = match one(q, "direction") {
        None | Some("") => vec![Direction::Ingress, Direction::Egress],
        Some("ingress") => vec![Direction::Ingress],
        Some("egress") => vec![Direction::Egress],
        Some(other) => {
            return Err(Bad(format!(
                "direction: {other:?} is not ingress or egress"
            )));
        }
    };
    let ep = engine.endpoint(ns, name).ok_or_else(|| {
        Bad(match engine.resolve(pod) {
            Err(e) => format!("pod: {e}"),
            Ok(_) => format!("pod: {pod} is not an endpoint of this node"),
        })
    })?;
    // Its MapStates are not what the datapath holds: say what it does instead.
    if let Some(why) = denied.get(pod) {
        let keys: usize = dirs
            .iter()
            .map(|d| engine.policy(ep, *d).mapstate.len())
            .sum();
        return Err(Denied(format!(
            "{pod} is denied in both directions (fail closed): its MapStates ({keys} keys) do not \
             fit this node's datapath maps: {why}\n"
        )));
    }
    Ok(render::dump::render(engine, ep, &dirs, format, style(q)))
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use ordnet_datapath::ControlPlane as _;
    use serde_json::Value;

    use super::*;
    use crate::agent::{Enforcer, NoneDatapath};

    fn q(pairs: &[(&str, &str)]) -> BTreeMap<String, Vec<String>> {
        let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (k, v) in pairs {
            out.entry(k.to_string()).or_default().push(v.to_string());
        }
        out
    }

    /// The verdict of one pair in a JSON matrix.
    fn cell(m: &str, from: &str, to: &str) -> String {
        let m: Value = serde_json::from_str(m).unwrap();
        let r = m["results"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["from"] == from && r["to"] == to)
            .unwrap_or_else(|| panic!("no {from} -> {to} in {m}"));
        r["verdict"].as_str().unwrap().to_string()
    }

    /// `/readyz` and `/metrics` answer while a change holds the engine and the datapath (a full
    /// programming holds them for seconds at 50,000 pods: a readiness probe or a scrape must
    /// not wait for it). Fails by not answering: the locks are held until both answered or a
    /// minute passed.
    #[test]
    fn readiness_and_metrics_answer_while_a_change_is_applied() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/qa-prod");
        let outcome = ordnet_crds::load_and_validate(&[dir]);
        let engine = Engine::build_for_node(&outcome.objects, "node-1");
        let mut dp = NoneDatapath::default();
        dp.program_full(&engine).unwrap();
        let state = Arc::new(AgentState::new("node-1", Box::new(dp), None, 16, 16));
        assert_eq!(readyz(&state).status(), StatusCode::SERVICE_UNAVAILABLE);
        {
            let (mut slot, _dp) = state.lock_for_update();
            state.install_engine(&mut slot, engine);
        }
        let (tx, rx) = std::sync::mpsc::channel();
        // Held as a change holds them, from before the requests until they answered.
        let locked = state.lock_for_update();
        let asking = state.clone();
        std::thread::spawn(move || {
            let ready = readyz(&asking).status();
            let scraped = metrics(&asking).status();
            let _ = tx.send((ready, scraped));
        });
        let answered = rx.recv_timeout(std::time::Duration::from_secs(60));
        drop(locked);
        assert_eq!(
            answered.expect("/readyz and /metrics waited for the engine's lock"),
            (StatusCode::OK, StatusCode::OK)
        );
    }

    /// `/v1/batches?after=N` answers once batch N+1 is counted, not before; without `after`
    /// at once; a count or timeout that is not one is refused.
    #[tokio::test]
    async fn batches_waits_for_the_next_programming() {
        let state = Arc::new(AgentState::new(
            "node-1",
            Box::new(NoneDatapath::default()),
            None,
            16,
            16,
        ));
        let body = |r: Response<Full<Bytes>>| async move {
            use http_body_util::BodyExt;
            let b = r.into_body().collect().await.unwrap().to_bytes();
            String::from_utf8(b.to_vec()).unwrap()
        };
        state.count_batch();
        assert_eq!(body(batches(&state, &q(&[])).await).await, "1\n");
        // Already past: at once.
        assert_eq!(
            body(batches(&state, &q(&[("after", "0")])).await).await,
            "1\n"
        );
        let waiting = {
            let state = state.clone();
            tokio::spawn(async move {
                body(batches(&state, &q(&[("after", "1"), ("timeout", "60")])).await).await
            })
        };
        // Not answered before the next batch (the waiter subscribed: it answers 2, not 1).
        tokio::task::yield_now().await;
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        assert!(!waiting.is_finished());
        state.count_batch();
        assert_eq!(waiting.await.unwrap(), "2\n");
        // A timeout that passes answers the count as it is.
        let r = batches(&state, &q(&[("after", "5"), ("timeout", "0.01")])).await;
        assert_eq!(body(r).await, "2\n");
        for bad in [("after", "-1"), ("timeout", "soon"), ("timeout", "-3")] {
            let r = batches(&state, &q(&[bad])).await;
            assert_eq!(r.status(), StatusCode::BAD_REQUEST, "{bad:?}");
        }
    }

    #[test]
    fn verdicts_come_from_the_programmed_tables() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/qa-prod");
        let outcome = ordnet_crds::load_and_validate(&[dir]);
        assert!(outcome.problems.iter().all(|p| !p.is_error()));
        let engine = Engine::build_for_node(&outcome.objects, "node-1");
        let mut dp = NoneDatapath::default();
        dp.program_full(&engine).unwrap();
        let mq = q(&[("port", "8081"), ("output", "json")]);
        let tq = q(&[
            ("from", "qa/tester"),
            ("to", "prod/api"),
            ("port", "8081"),
            ("output", "json"),
        ]);
        let before = matrix(&engine, dp.plane(), &mq).unwrap_or_else(|_| panic!());
        assert_eq!(cell(&before, "qa/tester", "prod/api"), "deny");
        let t = trace(&engine, dp.plane(), &BTreeMap::new(), &tq).unwrap_or_else(|_| panic!());
        assert_eq!(
            serde_json::from_str::<Value>(&t).unwrap()["verdict"],
            "deny",
            "{t}"
        );

        // Corrupt the programmed tables behind the engine's back: prod/api is no longer a
        // local endpoint of the datapath, so its ingress policy is not looked up any more.
        let id = dp.node_program().endpoint_id("prod/api").unwrap();
        dp.tables_mut().remove_endpoint(id).unwrap();
        let after = matrix(&engine, dp.plane(), &mq).unwrap_or_else(|_| panic!());
        assert_eq!(cell(&after, "qa/tester", "prod/api"), "allow");
        assert_eq!(
            cell(&after, "qa/tester", "prod/artifacts"),
            cell(&before, "qa/tester", "prod/artifacts")
        );
        // The engine still explains a deny: trace reports the disagreement as an internal error.
        match trace(&engine, dp.plane(), &BTreeMap::new(), &tq) {
            Err(Internal(m)) => assert!(
                m.contains("INTERNAL ERROR") && m.contains("verdict: datapath allow"),
                "{m}"
            ),
            Err(Bad(m) | Denied(m)) => panic!("not the disagreement: {m}"),
            Ok(t) => panic!("no disagreement reported: {t}"),
        }
    }
}
