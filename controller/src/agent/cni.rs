//! The agent's side of the CNI plugin (`ordnet-cni`, crate `ordnet-cni`): a unix socket in a
//! host directory ([`ordnet_cni::DEFAULT_SOCKET`] unless `--cni-socket` says otherwise), one
//! request per connection.
//!
//! An `ADD` is passed to the apply loop, which makes the pod an endpoint with the addresses the
//! runtime gave it and its own policy, programs the datapath and attaches the programs to the
//! pod's interface in one batch; the answer goes back once that batch is programmed. A pod the
//! agent has not seen yet (the watch is a few milliseconds behind the kubelet) is asked for
//! again every 50 ms for up to [`CNI_WAIT`]; after that the answer is "not enforced" and the
//! plugin fails closed.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use ordnet_cni::{Attachment, Request, Response};
use ordnet_engine::ObjectKind;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use super::watchers::WatchMsg;
use super::{AgentState, ObjKey};

/// How long an `ADD` waits for the agent to know the pod and enforce it.
pub const CNI_WAIT: Duration = Duration::from_secs(10);

/// A CNI request for the apply loop.
#[derive(Debug, Clone)]
pub(crate) enum CniOp {
    Add(Attachment),
    Del(Attachment),
    Check(Attachment),
}

impl CniOp {
    /// The pod's key in the view, when the runtime said which pod it is.
    pub(crate) fn pod_key(&self) -> Option<ObjKey> {
        let a = match self {
            CniOp::Add(a) | CniOp::Del(a) | CniOp::Check(a) => a,
        };
        Some((
            ObjectKind::Pod,
            a.pod_namespace.clone()?,
            a.pod_name.clone()?,
        ))
    }
}

/// The apply loop's answer.
#[derive(Debug, Clone)]
pub(crate) enum CniReply {
    Done(String),
    /// Not (yet) enforced, and why.
    NotYet(String),
}

/// Listens on `path` (its directory is created; a stale socket is replaced; mode 0600).
pub(crate) fn serve(
    path: &Path,
    state: Arc<AgentState>,
    tx: mpsc::UnboundedSender<WatchMsg>,
) -> std::io::Result<JoinHandle<()>> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let listener = UnixListener::bind(path)?;
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    let path: PathBuf = path.to_path_buf();
    Ok(tokio::spawn(async move {
        loop {
            match listener.accept().await {
                Ok((stream, _)) => {
                    let (state, tx) = (state.clone(), tx.clone());
                    tokio::spawn(async move {
                        if let Err(e) = connection(stream, &state, &tx).await {
                            tracing::warn!(error = %e, "CNI request failed");
                        }
                    });
                }
                Err(e) => {
                    tracing::error!(socket = %path.display(), error = %e, "CNI socket");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }))
}

async fn connection(
    stream: UnixStream,
    state: &AgentState,
    tx: &mpsc::UnboundedSender<WatchMsg>,
) -> std::io::Result<()> {
    let (read, mut write) = stream.into_split();
    let mut line = String::new();
    let mut reader = BufReader::new(read.take(64 * 1024));
    reader.read_line(&mut line).await?;
    let response = match serde_json::from_str::<Request>(line.trim()) {
        Err(e) => Response {
            ok: false,
            message: format!("not a request: {e}"),
        },
        Ok(request) => answer(request, state, tx).await,
    };
    let mut out = serde_json::to_string(&response).expect("a response serializes");
    out.push('\n');
    write.write_all(out.as_bytes()).await
}

async fn answer(
    request: Request,
    state: &AgentState,
    tx: &mpsc::UnboundedSender<WatchMsg>,
) -> Response {
    let op = match request {
        Request::Status => {
            return if state.ready() {
                Response {
                    ok: true,
                    message: "ready".into(),
                }
            } else {
                Response {
                    ok: false,
                    message: "the agent's initial sync is not done".into(),
                }
            };
        }
        Request::Add(a) => CniOp::Add(a),
        Request::Del(a) => CniOp::Del(a),
        Request::Check(a) => CniOp::Check(a),
    };
    let retry = matches!(op, CniOp::Add(_));
    let who = match &op {
        CniOp::Add(a) | CniOp::Del(a) | CniOp::Check(a) => a.who(),
    };
    let deadline = tokio::time::Instant::now() + CNI_WAIT;
    loop {
        let (reply_tx, reply_rx) = oneshot::channel();
        if tx.send(WatchMsg::Cni(op.clone(), reply_tx)).is_err() {
            return Response {
                ok: false,
                message: "the agent is stopping".into(),
            };
        }
        let reply = reply_rx
            .await
            .unwrap_or(CniReply::NotYet("the agent is stopping".into()));
        match reply {
            CniReply::Done(message) => {
                tracing::info!(pod = %who, "{message}");
                return Response { ok: true, message };
            }
            CniReply::NotYet(why) if retry && tokio::time::Instant::now() < deadline => {
                tracing::debug!(pod = %who, reason = %why, "CNI ADD waits");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            CniReply::NotYet(why) => {
                tracing::warn!(pod = %who, reason = %why, "CNI request not done");
                return Response {
                    ok: false,
                    message: why,
                };
            }
        }
    }
}
