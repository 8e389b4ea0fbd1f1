//! The fake server's HTTP side: paths to resources, JSON responses and Status errors, and the
//! request handler (list, get, create, replace, patch, delete; watches go to `watch.rs`).

use super::*;

/// A parsed request path.
#[derive(Debug)]
pub(crate) struct Target {
    pub(crate) resource: usize,
    /// `None`: all namespaces (or a cluster-scoped resource).
    pub(crate) namespace: Option<String>,
    pub(crate) name: Option<String>,
    pub(crate) status: bool,
}

impl Target {
    /// The part of the object a write to this path changes.
    fn part(&self) -> Part {
        if self.status {
            Part::Status
        } else {
            Part::Main
        }
    }
}

pub(crate) fn parse_path(path: &str) -> Result<Target, ApiError> {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, version, rest) = match segs.as_slice() {
        ["api", v, rest @ ..] => ("", *v, rest),
        ["apis", g, v, rest @ ..] => (*g, *v, rest),
        _ => {
            return Err(err(
                404,
                "NotFound",
                format!("the server could not find {path}"),
            ));
        }
    };
    let not_found = || err(404, "NotFound", format!("the server could not find {path}"));
    let (namespace, rest) = match rest {
        ["namespaces", ns, plural, tail @ ..]
            if resource_index(group, version, plural).is_some_and(|i| RESOURCES[i].namespaced) =>
        {
            (Some(ns.to_string()), {
                let mut v = vec![*plural];
                v.extend_from_slice(tail);
                v
            })
        }
        _ => (None, rest.to_vec()),
    };
    let (plural, name, sub) = match rest.as_slice() {
        [plural] => (*plural, None, None),
        [plural, name] => (*plural, Some(name.to_string()), None),
        [plural, name, sub] => (*plural, Some(name.to_string()), Some(*sub)),
        _ => return Err(not_found()),
    };
    let resource = resource_index(group, version, plural).ok_or_else(not_found)?;
    let status = match sub {
        None => false,
        Some("status") if RESOURCES[resource].status => true,
        Some(_) => return Err(not_found()),
    };
    if RESOURCES[resource].namespaced && name.is_some() && namespace.is_none() {
        return Err(not_found());
    }
    Ok(Target {
        resource,
        namespace,
        name,
        status,
    })
}

pub(crate) fn query_map(query: Option<&str>) -> BTreeMap<String, String> {
    form_urlencoded::parse(query.unwrap_or_default().as_bytes())
        .into_owned()
        .collect()
}

pub(crate) type BoxBody = http_body_util::combinators::BoxBody<Bytes, Infallible>;

pub(crate) fn json_response(code: u16, body: &Value) -> Response<BoxBody> {
    Response::builder()
        .status(StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())).boxed())
        .expect("response")
}

pub(crate) fn error_response(e: &ApiError) -> Response<BoxBody> {
    json_response(e.code, &status_json(e))
}

/// A list, paged when the client asks (`limit`, then `continue` with the token of the previous
/// page): every page is served as of the first page's resource version.
fn list(
    inner: &Inner,
    target: &Target,
    query: &BTreeMap<String, String>,
) -> Result<(u16, Value), ApiError> {
    let def = RESOURCES[target.resource];
    let limit = match query.get("limit").map(|l| l.parse::<usize>()) {
        None => 0,
        Some(Ok(l)) => l,
        Some(Err(_)) => return Err(err(400, "BadRequest", "limit: not a number")),
    };
    {
        // A server answers 410 to a paged list (its pages are served as of one resource
        // version, which compaction can expire); a plain list reads the current state.
        let mut faults = inner.faults();
        if limit > 0 && faults.failing_lists > 0 {
            faults.failing_lists -= 1;
            return Err(err(
                410,
                "Expired",
                "fake API server: the list failed with 410 Gone (a played fault)",
            ));
        }
    }
    let st = inner.lock();
    let (at, after) = match query.get("continue").filter(|c| !c.is_empty()) {
        None => (st.rv, None),
        Some(token) => parse_continue(token).ok_or_else(|| {
            err(
                400,
                "BadRequest",
                format!("continue: invalid token {token:?}"),
            )
        })?,
    };
    let (items, remaining) = st.list_page(
        target.resource,
        target.namespace.as_deref(),
        Some(at),
        after.as_ref(),
        limit,
    )?;
    let mut metadata = json!({"resourceVersion": at.to_string()});
    if remaining > 0
        && let Some(last) = items.last()
    {
        let ns = meta_str(last, "namespace").unwrap_or_default();
        let name = meta_str(last, "name").unwrap_or_default();
        metadata["continue"] = json!(format!("{at}/{ns}/{name}"));
        metadata["remainingItemCount"] = json!(remaining);
    }
    Ok((
        200,
        json!({
            "apiVersion": def.api_version(),
            "kind": format!("{}List", def.kind),
            "metadata": metadata,
            "items": items,
        }),
    ))
}

/// A continue token: `RV/NAMESPACE/NAME` of the last object served.
fn parse_continue(token: &str) -> Option<(u64, Option<(String, String)>)> {
    let mut parts = token.splitn(3, '/');
    let rv = parts.next()?.parse().ok()?;
    let ns = parts.next()?.to_string();
    let name = parts.next()?.to_string();
    Some((rv, Some((ns, name))))
}

pub(crate) async fn handle(inner: Arc<Inner>, req: Request<Incoming>) -> Response<BoxBody> {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let query = query_map(req.uri().query());
    let content_type = req
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .map(|s| s.split(';').next().unwrap_or(s).trim().to_string());
    inner.lock().requests.push(RequestRecord {
        method: method.to_string(),
        uri: req.uri().to_string(),
        content_type: content_type.clone(),
    });
    let delay = inner.faults().delay;
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let target = match parse_path(&path) {
        Ok(t) => t,
        Err(e) => return error_response(&e),
    };
    if inner
        .faults()
        .absent
        .contains(&RESOURCES[target.resource].plural)
    {
        return error_response(&err(
            404,
            "NotFound",
            format!("the server could not find the requested resource ({path})"),
        ));
    }
    for unsupported in ["labelSelector", "fieldSelector"] {
        if query.get(unsupported).is_some_and(|v| !v.is_empty()) {
            return error_response(&err(
                400,
                "BadRequest",
                format!("fake API server: {unsupported} is not implemented"),
            ));
        }
    }
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return error_response(&err(400, "BadRequest", e.to_string())),
    };
    let parse_body = || -> Result<Value, ApiError> {
        serde_json::from_slice::<Value>(&body)
            .or_else(|_| yaml_serde::from_slice::<Value>(&body))
            .map_err(|e| err(400, "BadRequest", format!("invalid body: {e}")))
    };
    let def = RESOURCES[target.resource];
    let ns = target.namespace.clone().unwrap_or_default();
    let result: Result<(u16, Value), ApiError> = match (&method, &target.name) {
        (&Method::GET, None) => {
            if query.get("watch").is_some_and(|w| w == "1" || w == "true") {
                return start_watch(inner, &target, &query);
            }
            list(&inner, &target, &query)
        }
        (&Method::GET, Some(name)) => {
            let st = inner.lock();
            st.objects
                .get(&(target.resource, ns.clone(), name.clone()))
                .cloned()
                .map(|o| (200, o))
                .ok_or_else(|| {
                    err(
                        404,
                        "NotFound",
                        format!("{} \"{name}\" not found", def.plural),
                    )
                })
        }
        (&Method::POST, None) => parse_body().and_then(|obj| {
            let mut st = inner.lock();
            st.create(target.resource, &ns, obj).map(|o| (201, o))
        }),
        (&Method::PUT, Some(name)) => parse_body().and_then(|obj| {
            if meta_str(&obj, "name").is_some_and(|n| n != name) {
                return Err(err(
                    400,
                    "BadRequest",
                    "the name of the object does not match the name in the URL",
                ));
            }
            let key = (target.resource, ns.clone(), name.clone());
            let mut st = inner.lock();
            st.store_update(&key, obj, target.part()).map(|o| (200, o))
        }),
        (&Method::PATCH, Some(name)) => parse_body().and_then(|patch| {
            apply_patch(
                &inner,
                &target,
                name,
                content_type.as_deref(),
                &query,
                patch,
            )
        }),
        (&Method::DELETE, Some(name)) => {
            let mut st = inner.lock();
            st.delete(&(target.resource, ns.clone(), name.clone()))
                .map(|o| (200, o))
        }
        _ => Err(err(
            405,
            "MethodNotAllowed",
            format!("{method} {path} is not supported"),
        )),
    };
    match result {
        Ok((code, value)) => {
            let rv = inner.lock().rv;
            inner.notify(rv);
            json_response(code, &value)
        }
        Err(e) => error_response(&e),
    }
}

/// `PATCH` of one object: server-side apply (`application/apply-patch+yaml`, which needs a
/// `fieldManager` and creates a missing object) or a merge patch (JSON or strategic, treated
/// alike; a `metadata.resourceVersion` in the patch is a precondition).
fn apply_patch(
    inner: &Inner,
    target: &Target,
    name: &str,
    content_type: Option<&str>,
    query: &BTreeMap<String, String>,
    patch: Value,
) -> Result<(u16, Value), ApiError> {
    let def = RESOURCES[target.resource];
    let ns = target.namespace.clone().unwrap_or_default();
    let name = name.to_string();
    let key = (target.resource, ns.clone(), name.clone());
    let part = target.part();
    let mut st = inner.lock();
    match content_type {
        Some("application/apply-patch+yaml") => {
            if query.get("fieldManager").is_none_or(|m| m.is_empty()) {
                return Err(err(
                    422,
                    "Invalid",
                    "fieldManager: Required value: is required for apply patch",
                ));
            }
            match st.objects.get(&key).cloned() {
                Some(mut current) => {
                    merge_patch(&mut current, &patch);
                    if let Some(m) = current["metadata"].as_object_mut() {
                        m.remove("resourceVersion");
                    }
                    st.store_update(&key, current, part).map(|o| (200, o))
                }
                None if target.status => Err(err(
                    404,
                    "NotFound",
                    format!("{} \"{name}\" not found", def.plural),
                )),
                None => {
                    let mut obj = patch;
                    obj["metadata"]["name"] = json!(name);
                    st.create(target.resource, &ns, obj).map(|o| (201, o))
                }
            }
        }
        Some("application/merge-patch+json") | Some("application/strategic-merge-patch+json") => {
            match st.objects.get(&key).cloned() {
                Some(mut current) => {
                    let precondition = meta_str(&patch, "resourceVersion").map(str::to_string);
                    merge_patch(&mut current, &patch);
                    match precondition {
                        Some(rv) => current["metadata"]["resourceVersion"] = json!(rv),
                        None => {
                            if let Some(m) = current["metadata"].as_object_mut() {
                                m.remove("resourceVersion");
                            }
                        }
                    }
                    st.store_update(&key, current, part).map(|o| (200, o))
                }
                None => Err(err(
                    404,
                    "NotFound",
                    format!("{} \"{name}\" not found", def.plural),
                )),
            }
        }
        other => Err(err(
            415,
            "UnsupportedMediaType",
            format!("fake API server: patch type {other:?} is not implemented"),
        )),
    }
}
