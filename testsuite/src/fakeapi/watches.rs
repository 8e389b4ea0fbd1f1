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

/// What a watch request asks for.
struct WatchParams {
    bookmarks: bool,
    send_initial: bool,
    timeout: Duration,
    /// `resourceVersion`: events after it (`None`: the current objects first).
    from: Option<u64>,
}

impl WatchParams {
    fn parse(query: &BTreeMap<String, String>) -> Result<WatchParams, ApiError> {
        let from =
            match query.get("resourceVersion").map(String::as_str) {
                None | Some("") | Some("0") => None,
                Some(v) => Some(v.parse().map_err(|_| {
                    err(400, "BadRequest", format!("invalid resourceVersion {v:?}"))
                })?),
            };
        Ok(WatchParams {
            bookmarks: query
                .get("allowWatchBookmarks")
                .is_some_and(|v| v == "true"),
            send_initial: query.get("sendInitialEvents").is_some_and(|v| v == "true"),
            timeout: query
                .get("timeoutSeconds")
                .and_then(|t| t.parse::<u64>().ok())
                .map(Duration::from_secs)
                .unwrap_or(Duration::from_secs(1800)),
            from,
        })
    }
}

/// One watch's position and filter.
pub(super) struct Cursor {
    pub(super) resource: usize,
    pub(super) namespace: Option<String>,
    /// Everything up to this resource version has been sent (`u64::MAX`: the watch ended).
    pub(super) rv: u64,
}

impl Cursor {
    /// The events after the cursor (advancing it), or a 410 Gone error event when history the
    /// watch had not sent yet was compacted away (`true`: the watch ends). Nothing, and the end,
    /// once the watches were dropped after `epoch` (checked under the state's lock, so a
    /// restart's compaction and drop are one step for the watch).
    pub(super) fn pending(&mut self, inner: &Inner, epoch: u64) -> (Vec<Bytes>, bool) {
        let st = inner.lock();
        if inner.signal.borrow().1 != epoch {
            return (Vec::new(), true);
        }
        if self.rv.saturating_add(1) < st.compacted {
            let e = err(
                410,
                "Expired",
                format!("too old resource version: {}", self.rv),
            );
            return (vec![watch_event("ERROR", &status_json(&e))], true);
        }
        let start = st.log.partition_point(|e| e.rv <= self.rv);
        let out = st.log[start..]
            .iter()
            .filter(|e| {
                e.resource == self.resource
                    && self.namespace.as_deref().is_none_or(|n| n == e.namespace)
            })
            .map(|e| watch_event(e.kind, &e.object))
            .collect();
        self.rv = st.rv;
        (out, false)
    }
}

pub(crate) fn start_watch(
    inner: Arc<Inner>,
    target: &Target,
    query: &BTreeMap<String, String>,
) -> Response<BoxBody> {
    let def = RESOURCES[target.resource];
    let params = match WatchParams::parse(query) {
        Ok(p) => p,
        Err(e) => return error_response(&e),
    };
    let (tx, rx) = mpsc::channel::<Bytes>(256);
    if inner.faults().silent_watches {
        // Accepted, then nothing at all until the server is stopped or the client goes away.
        let mut generation = inner.generation.subscribe();
        tokio::spawn(async move {
            tokio::select! {
                _ = generation.changed() => {}
                _ = tx.closed() => {}
            }
        });
        return watch_response(rx);
    }
    // Subscribed now: a restart after this request ends the watch.
    let signal = inner.signal.subscribe();
    let (first, cursor) = initial_events(&inner, target, &params);
    tokio::spawn(stream(inner, signal, def, params, cursor, first, tx));
    watch_response(rx)
}

fn watch_response(rx: mpsc::Receiver<Bytes>) -> Response<BoxBody> {
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/json")
        .header("transfer-encoding", "chunked")
        .body(ChannelBody(rx).boxed())
        .expect("response")
}

/// What a watch sends first: the current objects as `ADDED` (no resource version given), or a
/// 410 Gone error (a version older than the compaction point); the initial-events-end bookmark
/// when asked for.
fn initial_events(inner: &Inner, target: &Target, params: &WatchParams) -> (Vec<Bytes>, Cursor) {
    let def = RESOURCES[target.resource];
    let mut cursor = Cursor {
        resource: target.resource,
        namespace: target.namespace.clone(),
        rv: 0,
    };
    let mut first: Vec<Bytes> = Vec::new();
    let st = inner.lock();
    match params.from {
        Some(n) if n < st.compacted => {
            let e = err(
                410,
                "Expired",
                format!("too old resource version: {n} ({})", st.compacted),
            );
            first.push(watch_event("ERROR", &status_json(&e)));
            cursor.rv = u64::MAX;
        }
        Some(n) => cursor.rv = n,
        None => {
            for obj in st.list(target.resource, target.namespace.as_deref()) {
                first.push(watch_event("ADDED", &obj));
            }
            cursor.rv = st.rv;
        }
    }
    if params.send_initial && params.from.is_none() {
        first.push(bookmark(&def, cursor.rv, true));
    }
    (first, cursor)
}

/// The watch's stream: the first events, then every change after the cursor as it happens,
/// bookmarks (periodic and on demand) when allowed, until the timeout, a restart of the
/// server (its epoch changes) or the client going away.
async fn stream(
    inner: Arc<Inner>,
    mut signal: watch::Receiver<(u64, u64, u64)>,
    def: ResourceDef,
    params: WatchParams,
    mut cursor: Cursor,
    first: Vec<Bytes>,
    tx: mpsc::Sender<Bytes>,
) {
    let epoch = signal.borrow().1;
    let mut bookmark_epoch = signal.borrow().2;
    let interval = *inner
        .bookmark_interval
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    for b in first {
        if tx.send(b).await.is_err() {
            return;
        }
    }
    if cursor.rv == u64::MAX {
        return;
    }
    let deadline = tokio::time::Instant::now() + params.timeout;
    let mut ticker = tokio::time::interval(interval);
    ticker.tick().await;
    loop {
        let (pending, expired) = cursor.pending(&inner, epoch);
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
                    if params.bookmarks && tx.send(bookmark(&def, cursor.rv, false)).await.is_err() {
                        return;
                    }
                }
            }
            _ = ticker.tick() => {
                // The cursor: everything up to it has been sent.
                if params.bookmarks && tx.send(bookmark(&def, cursor.rv, false)).await.is_err() {
                    return;
                }
            }
            _ = tokio::time::sleep_until(deadline) => return,
        }
    }
}
