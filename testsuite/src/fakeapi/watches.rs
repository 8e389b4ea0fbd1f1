//! Watches: newline-delimited events replayed from the change log after a resource version,
//! bookmarks (periodic, on demand, and the end of the initial events), 410 Gone after
//! compaction, timeouts, and the server-side end of every watch on restart.

use super::*;

/// A streaming body fed by a channel (one watch).
pub(crate) struct ChannelBody(mpsc::Receiver<Bytes>);

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b))))
    }
}

fn watch_event(kind: &str, object: &Value) -> Bytes {
    let mut line = json!({"type": kind, "object": object}).to_string();
    line.push('\n');
    Bytes::from(line)
}

fn bookmark(def: &ResourceDef, rv: u64, initial_end: bool) -> Bytes {
    let mut meta = json!({"resourceVersion": rv.to_string()});
    if initial_end {
        meta["annotations"] = json!({"k8s.io/initial-events-end": "true"});
    }
    watch_event(
        "BOOKMARK",
        &json!({"apiVersion": def.api_version(), "kind": def.kind, "metadata": meta}),
    )
}

pub(crate) fn start_watch(
    inner: Arc<Inner>,
    target: &Target,
    query: &BTreeMap<String, String>,
) -> Response<BoxBody> {
    let def = RESOURCES[target.resource];
    let resource = target.resource;
    let namespace = target.namespace.clone();
    let bookmarks = query
        .get("allowWatchBookmarks")
        .is_some_and(|v| v == "true");
    let send_initial = query.get("sendInitialEvents").is_some_and(|v| v == "true");
    let timeout = query
        .get("timeoutSeconds")
        .and_then(|t| t.parse::<u64>().ok())
        .map(Duration::from_secs)
        .unwrap_or(Duration::from_secs(1800));
    let from: Option<u64> = match query.get("resourceVersion").map(String::as_str) {
        None | Some("") | Some("0") => None,
        Some(v) => match v.parse() {
            Ok(n) => Some(n),
            Err(_) => {
                return error_response(&err(
                    400,
                    "BadRequest",
                    format!("invalid resourceVersion {v:?}"),
                ));
            }
        },
    };
    let (tx, rx) = mpsc::channel::<Bytes>(256);
    let mut signal = inner.signal.subscribe();
    let epoch = signal.borrow().1;
    let mut bookmark_epoch = signal.borrow().2;
    let interval = *inner
        .bookmark_interval
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let mut first: Vec<Bytes> = Vec::new();
    let mut cursor: u64;
    {
        let st = inner.lock();
        match from {
            Some(n) if n < st.compacted => {
                let e = err(
                    410,
                    "Expired",
                    format!("too old resource version: {n} ({})", st.compacted),
                );
                first.push(watch_event("ERROR", &status_json(&e)));
                cursor = u64::MAX;
            }
            Some(n) => cursor = n,
            None => {
                for obj in st.list(resource, namespace.as_deref()) {
                    first.push(watch_event("ADDED", &obj));
                }
                cursor = st.rv;
            }
        }
        if send_initial && from.is_none() {
            first.push(bookmark(&def, cursor, true));
        }
    }
    tokio::spawn(async move {
        for b in first {
            if tx.send(b).await.is_err() {
                return;
            }
        }
        if cursor == u64::MAX {
            return;
        }
        let deadline = tokio::time::Instant::now() + timeout;
        let mut ticker = tokio::time::interval(interval);
        ticker.tick().await;
        loop {
            // Everything after the cursor.
            let mut expired = false;
            let pending: Vec<Bytes> = {
                let st = inner.lock();
                if cursor.saturating_add(1) < st.compacted {
                    // History this watch had not sent yet was compacted away: tell the client.
                    expired = true;
                    let e = err(
                        410,
                        "Expired",
                        format!("too old resource version: {cursor}"),
                    );
                    vec![watch_event("ERROR", &status_json(&e))]
                } else {
                    let start = st.log.partition_point(|e| e.rv <= cursor);
                    let out = st.log[start..]
                        .iter()
                        .filter(|e| {
                            e.resource == resource
                                && namespace.as_deref().is_none_or(|n| n == e.namespace)
                        })
                        .map(|e| watch_event(e.kind, &e.object))
                        .collect();
                    cursor = st.rv;
                    out
                }
            };
            for b in pending {
                if tx.send(b).await.is_err() {
                    return;
                }
            }
            if expired {
                return;
            }
            tokio::select! {
                changed = signal.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    let (_, e, b) = *signal.borrow_and_update();
                    if e != epoch {
                        return;
                    }
                    if b != bookmark_epoch {
                        bookmark_epoch = b;
                        if bookmarks && tx.send(bookmark(&def, cursor, false)).await.is_err() {
                            return;
                        }
                    }
                }
                _ = ticker.tick() => {
                    // The cursor: everything up to it has been sent.
                    if bookmarks && tx.send(bookmark(&def, cursor, false)).await.is_err() {
                        return;
                    }
                }
                _ = tokio::time::sleep_until(deadline) => return,
            }
        }
    });
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/json")
        .header("transfer-encoding", "chunked")
        .body(ChannelBody(rx).boxed())
        .expect("response")
}
