//! The CRD schema as the API server applies it, emulated offline: every structural check the
//! schema states (types, enums, patterns, lengths, list and map bounds, numeric bounds, required
//! fields, defaults) and every CEL rule (`x-kubernetes-validations`, evaluated with the
//! Kubernetes CEL libraries of `kube-cel`).
//!
//! * Every ordered policy of the repository (conformance scenarios, example) is admitted.
//! * Every invalid fixture is refused by the schema, and `ordnet_crds::validate` reports an error
//!   at the same field (the agent's checks agree with the API server's).
//! * Every CEL rule compiles, none fails to evaluate on any fixture, and `docs/api.md` lists each
//!   rule's text.
//! * Every list and map under `spec` is bounded (`maxItems`/`maxProperties`): without bounds the
//!   API server estimates CEL costs over a 3 MiB request and refuses the CRD.
//!
//! Two things `kube-cel` does not provide are emulated here: CEL's `type()` (with `int` and
//! `string` as its results), and Go `netip`'s strict `isCIDR` (no leading zeros in octets or in
//! the prefix length, no IPv4-mapped IPv6), which the API server uses. The authoritative check of
//! compilation and cost remains `kubectl apply --dry-run=server` on a Kubernetes >= 1.31 API
//! server (docs/api.md).

use std::collections::HashMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kube_cel::KubeCelExt;
use kube_cel::cel::{Context, Program, Value as Cel, extractors::This};
use serde_json::{Value, json};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The openAPIV3Schema of `kind` as generated (and committed).
fn schema(kind: &str) -> Value {
    let crd = ordnet_crds::crds()
        .into_iter()
        .find(|c| c.spec.names.kind == kind)
        .expect("kind");
    serde_json::to_value(
        crd.spec.versions[0]
            .schema
            .as_ref()
            .and_then(|s| s.open_api_v3_schema.as_ref())
            .expect("schema"),
    )
    .expect("json")
}

fn cel_type(This(v): This<Cel>) -> String {
    match v {
        Cel::Int(_) | Cel::UInt(_) => "int",
        Cel::String(_) => "string",
        Cel::Bool(_) => "bool",
        Cel::List(_) => "list",
        Cel::Map(_) => "map",
        _ => "other",
    }
    .to_string()
}

/// `isCIDR` as the API server has it (Go `netip.ParsePrefix`, no IPv4-mapped addresses).
fn go_is_cidr(This(s): This<Arc<String>>) -> bool {
    let Some((addr, bits)) = s.split_once('/') else {
        return false;
    };
    let Ok(addr) = addr.parse::<IpAddr>() else {
        return false;
    };
    if let IpAddr::V6(v6) = addr
        && v6.to_ipv4_mapped().is_some()
    {
        return false;
    }
    let max = if addr.is_ipv4() { 32 } else { 128 };
    !bits.is_empty()
        && bits.bytes().all(|b| b.is_ascii_digit())
        && !(bits.len() > 1 && bits.starts_with('0'))
        && bits.parse::<u32>().is_ok_and(|b| b <= max)
}

fn context() -> Context<'static> {
    let mut ctx = Context::default().with_all();
    ctx.add_function("type", cel_type);
    ctx.add_function("isCIDR", go_is_cidr);
    for t in ["int", "string"] {
        ctx.add_variable_from_value(t, Cel::String(Arc::new(t.to_string())));
    }
    ctx
}

/// JSON as the API server hands it to CEL: integers are `int`.
fn to_cel(v: &Value) -> Cel {
    match v {
        Value::Null => Cel::Null,
        Value::Bool(b) => Cel::Bool(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => Cel::Int(i),
            None => Cel::Float(n.as_f64().unwrap_or(f64::NAN)),
        },
        Value::String(s) => Cel::String(Arc::new(s.clone())),
        Value::Array(a) => Cel::List(Arc::new(a.iter().map(to_cel).collect())),
        Value::Object(o) => {
            let map: HashMap<String, Cel> = o.iter().map(|(k, v)| (k.clone(), to_cel(v))).collect();
            Cel::from(map)
        }
    }
}

/// A refusal: (field path, message).
type Refusal = (String, String);

struct Admission {
    ctx: Context<'static>,
    /// Rule text → its compiled program (compiled once).
    programs: HashMap<String, Program>,
    /// Every rule that evaluated, and whether each rule ever failed.
    evaluated: HashMap<String, bool>,
}

impl Admission {
    fn new() -> Admission {
        Admission {
            ctx: context(),
            programs: HashMap::new(),
            evaluated: HashMap::new(),
        }
    }

    /// Validates `value` (already defaulted in place) against `schema` at `path`.
    fn check(&mut self, schema: &Value, value: &mut Value, path: &str, out: &mut Vec<Refusal>) {
        let refuse = |out: &mut Vec<Refusal>, m: String| out.push((path.to_string(), m));
        let int_or_string = schema["x-kubernetes-int-or-string"] == true;
        let ty = schema["type"].as_str();
        let type_ok = match (ty, &*value) {
            _ if int_or_string => value.is_i64() || value.is_string(),
            (Some("object"), v) => v.is_object(),
            (Some("array"), v) => v.is_array(),
            (Some("string"), v) => v.is_string(),
            (Some("integer"), v) => v.is_i64(),
            (Some("boolean"), v) => v.is_boolean(),
            _ => true,
        };
        if !type_ok {
            refuse(out, format!("wrong type, want {ty:?}"));
            return;
        }
        self.value_checks(schema, value, path, out);
        for sub in schema["allOf"].as_array().into_iter().flatten() {
            self.value_checks(sub, value, path, out);
        }
        match value {
            Value::Object(map) => {
                if let Some(props) = schema["properties"].as_object() {
                    for (name, sub) in props {
                        if !map.contains_key(name)
                            && let Some(d) = sub.get("default")
                        {
                            map.insert(name.clone(), d.clone());
                        }
                    }
                    for req in schema["required"].as_array().into_iter().flatten() {
                        let req = req.as_str().unwrap();
                        if !map.contains_key(req) {
                            out.push((join(path, req), "required".into()));
                        }
                    }
                    // Unknown fields are pruned by the API server.
                    map.retain(|k, _| props.contains_key(k));
                    for (name, sub) in props {
                        if let Some(v) = map.get_mut(name) {
                            self.check(sub, v, &join(path, name), out);
                        }
                    }
                }
                if let Some(sub) = schema.get("additionalProperties").filter(|s| s.is_object()) {
                    if let Some(max) = schema["maxProperties"].as_u64()
                        && map.len() as u64 > max
                    {
                        refuse(out, format!("more than {max} entries"));
                    }
                    for (k, v) in map.iter_mut() {
                        self.check(sub, v, &join(path, k), out);
                    }
                }
            }
            Value::Array(items) => {
                if let Some(max) = schema["maxItems"].as_u64()
                    && items.len() as u64 > max
                {
                    refuse(out, format!("more than {max} items"));
                }
                for (i, v) in items.iter_mut().enumerate() {
                    self.check(&schema["items"], v, &format!("{path}[{i}]"), out);
                }
            }
            _ => {}
        }
        for rule in schema["x-kubernetes-validations"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let text = rule["rule"].as_str().unwrap().to_string();
            let program = self.programs.entry(text.clone()).or_insert_with(|| {
                Program::compile(&text).unwrap_or_else(|e| panic!("{text}: {e}"))
            });
            let mut ctx = self.ctx.new_inner_scope();
            ctx.add_variable_from_value("self", to_cel(value));
            let passed = match program.execute(&ctx) {
                Ok(Cel::Bool(b)) => b,
                other => panic!("{path}: rule {text} did not evaluate to a bool: {other:?}"),
            };
            let failed = self.evaluated.entry(text).or_insert(false);
            *failed |= !passed;
            if !passed {
                let at = rule["fieldPath"]
                    .as_str()
                    .map_or(path.to_string(), |f| format!("{path}{f}"));
                out.push((at, rule["message"].as_str().unwrap().to_string()));
            }
        }
    }

    fn value_checks(&self, schema: &Value, value: &Value, path: &str, out: &mut Vec<Refusal>) {
        let mut refuse = |m: String| out.push((path.to_string(), m));
        if let Some(e) = schema["enum"].as_array()
            && !e.contains(value)
        {
            refuse(format!("{value} not in {e:?}"));
        }
        if let Value::String(s) = value {
            if let Some(max) = schema["maxLength"].as_u64()
                && s.chars().count() as u64 > max
            {
                refuse(format!("longer than {max}"));
            }
            if let Some(p) = schema["pattern"].as_str()
                && !regex::Regex::new(p).unwrap().is_match(s)
            {
                refuse(format!("should match {p}"));
            }
        }
        if let Some(n) = value.as_f64() {
            if let Some(min) = schema["minimum"].as_f64()
                && n < min
            {
                refuse(format!("below {min}"));
            }
            if let Some(max) = schema["maximum"].as_f64()
                && n > max
            {
                refuse(format!("above {max}"));
            }
        }
    }

    /// The refusals of `object` (a whole resource) by the schema of its kind.
    fn admit(&mut self, object: &Value) -> Vec<Refusal> {
        let kind = object["kind"].as_str().unwrap();
        let schema = schema(kind);
        let mut value = json!({"spec": object["spec"].clone()});
        let mut out = Vec::new();
        self.check(&schema, &mut value, "", &mut out);
        out
    }
}

fn join(base: &str, field: &str) -> String {
    if base.is_empty() {
        field.to_string()
    } else {
        format!("{base}.{field}")
    }
}

fn onp(spec: Value) -> Value {
    json!({"apiVersion": "ordnet.io/v1alpha1", "kind": "OrderedNetworkPolicy",
        "metadata": {"name": "p", "namespace": "q"}, "spec": spec})
}

fn conp(spec: Value) -> Value {
    json!({"apiVersion": "ordnet.io/v1alpha1", "kind": "ClusterOrderedNetworkPolicy",
        "metadata": {"name": "c"}, "spec": spec})
}

/// An ONP with one ingress rule.
fn rule(rule: Value) -> Value {
    onp(json!({"priority": 1, "podSelector": {}, "ingress": [rule]}))
}

/// ordnet's own validation errors of a policy object, as `field: message`.
fn ordnet_errors(object: &Value) -> Vec<String> {
    let text = serde_json::to_string(object).unwrap();
    let outcome = ordnet_crds::validated(ordnet_crds::load_str(Path::new("fixture.yaml"), &text));
    outcome
        .problems
        .iter()
        .filter(|p| p.is_error())
        .map(|p| format!("{}: {}", p.field.clone().unwrap_or_default(), p.message))
        .collect()
}

/// Every ordered policy object of the repository.
fn repository_policies() -> Vec<Value> {
    let mut files = Vec::new();
    for dir in [
        "testsuite/data/conformance",
        "testsuite/data/scenarios",
        "examples",
    ] {
        let mut stack = vec![repo().join(dir)];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    stack.push(p);
                } else if p.extension().is_some_and(|x| x == "yaml") {
                    files.push(p);
                }
            }
        }
    }
    let mut out = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        for doc in yaml_serde::Deserializer::from_str(&text) {
            let v: Value = match serde::Deserialize::deserialize(doc) {
                Ok(v) => v,
                Err(_) => continue,
            };
            let objects = match v.get("objects") {
                Some(Value::Array(a)) => a.clone(),
                _ => vec![v],
            };
            out.extend(
                objects
                    .into_iter()
                    .filter(|o| o["apiVersion"] == "ordnet.io/v1alpha1"),
            );
        }
    }
    out
}

#[test]
fn every_policy_of_the_repository_is_admitted() {
    let mut a = Admission::new();
    let policies = repository_policies();
    assert!(
        policies.len() >= 20,
        "only {} policies found",
        policies.len()
    );
    for p in &policies {
        let refused = a.admit(p);
        assert!(refused.is_empty(), "{p}\nrefused: {refused:?}");
    }
}

/// (fixture, field the API server names (prefix), message fragment, field ordnet names).
fn invalid_fixtures() -> Vec<(Value, &'static str, &'static str)> {
    vec![
        (
            rule(json!({"action": "Allow", "from": [{"ipBlock": {"cidr": "10.0.0.300/8"}}]})),
            "spec.ingress[0].from[0].ipBlock.cidr",
            "must be a CIDR",
        ),
        (
            rule(json!({"action": "Allow", "from": [{"ipBlock": {"cidr": "10.0.0.1"}}]})),
            "spec.ingress[0].from[0].ipBlock.cidr",
            "must be a CIDR",
        ),
        (
            rule(json!({"action": "Allow", "from": [{"ipBlock": {"cidr": "010.0.0.0/8"}}]})),
            "spec.ingress[0].from[0].ipBlock.cidr",
            "must be a CIDR",
        ),
        (
            rule(json!({"action": "Allow", "from": [{"ipBlock": {"cidr": "10.0.0.0/08"}}]})),
            "spec.ingress[0].from[0].ipBlock.cidr",
            "must be a CIDR",
        ),
        (
            rule(
                json!({"action": "Allow", "from": [{"ipBlock": {"cidr": "::ffff:10.0.0.0/104"}}]}),
            ),
            "spec.ingress[0].from[0].ipBlock.cidr",
            "must be a CIDR",
        ),
        (
            rule(json!({"action": "Allow", "from": [{"ipBlock": {"cidr": "10.0.0.0/33"}}]})),
            "spec.ingress[0].from[0].ipBlock.cidr",
            "must be a CIDR",
        ),
        (
            rule(
                json!({"action": "Deny", "from": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["nope"]}}]}),
            ),
            "spec.ingress[0].from[0].ipBlock.except[0]",
            "must be a CIDR",
        ),
        (
            rule(
                json!({"action": "Deny", "from": [{"ipBlock": {"cidr": "10.0.0.0/16", "except": ["10.0.0.0/8"]}}]}),
            ),
            "spec.ingress[0].from[0].ipBlock.except",
            "strict subset",
        ),
        (
            rule(
                json!({"action": "Deny", "from": [{"ipBlock": {"cidr": "10.0.0.0/16", "except": ["10.0.0.0/16"]}}]}),
            ),
            "spec.ingress[0].from[0].ipBlock.except",
            "strict subset",
        ),
        (
            rule(
                json!({"action": "Deny", "from": [{"ipBlock": {"cidr": "10.0.0.0/16", "except": ["10.1.0.0/24"]}}]}),
            ),
            "spec.ingress[0].from[0].ipBlock.except",
            "strict subset",
        ),
        (
            rule(
                json!({"action": "Deny", "from": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["fd00::/64"]}}]}),
            ),
            "spec.ingress[0].from[0].ipBlock.except",
            "same IP family",
        ),
        (
            rule(
                json!({"action": "Deny", "from": [{"ipBlock": {"cidr": "10.0.0.0/8"}, "namespaceSelector": {}}]}),
            ),
            "spec.ingress[0].from[0]",
            "may not be combined",
        ),
        (
            rule(json!({"action": "Deny", "from": [{}]})),
            "spec.ingress[0].from[0]",
            "an empty peer",
        ),
        (
            rule(json!({"action": "Reject"})),
            "spec.ingress[0].action",
            "not in",
        ),
        (
            rule(json!({"action": "Allow", "ports": [{"protocol": "ICMP"}]})),
            "spec.ingress[0].ports[0].protocol",
            "not in",
        ),
        (
            rule(json!({"action": "Allow", "ports": [{"port": 0}]})),
            "spec.ingress[0].ports[0].port",
            "between 1 and 65535",
        ),
        (
            rule(json!({"action": "Allow", "ports": [{"port": 65536}]})),
            "spec.ingress[0].ports[0].port",
            "between 1 and 65535",
        ),
        (
            rule(json!({"action": "Allow", "ports": [{"port": "serve_80"}]})),
            "spec.ingress[0].ports[0].port",
            "should match",
        ),
        (
            rule(json!({"action": "Allow", "ports": [{"port": "80"}]})),
            "spec.ingress[0].ports[0].port",
            "should match",
        ),
        (
            rule(json!({"action": "Allow", "ports": [{"port": "a--b"}]})),
            "spec.ingress[0].ports[0].port",
            "should match",
        ),
        (
            rule(json!({"action": "Allow", "ports": [{"port": "abcdefghijklmnop"}]})),
            "spec.ingress[0].ports[0].port",
            "longer than 15",
        ),
        (
            rule(json!({"action": "Allow", "ports": [{"endPort": 90}]})),
            "spec.ingress[0].ports[0].endPort",
            "requires a numeric port",
        ),
        (
            rule(json!({"action": "Allow", "ports": [{"port": "http", "endPort": 90}]})),
            "spec.ingress[0].ports[0].endPort",
            "requires a numeric port",
        ),
        (
            rule(json!({"action": "Allow", "ports": [{"port": 90, "endPort": 80}]})),
            "spec.ingress[0].ports[0].endPort",
            "greater than or equal",
        ),
        (
            rule(json!({"action": "Allow", "ports": [{"port": 90, "endPort": 65536}]})),
            "spec.ingress[0].ports[0].endPort",
            "above",
        ),
        (
            rule(
                json!({"action": "Allow", "from": [{"podSelector": {"matchExpressions": [{"key": "a", "operator": "Equals", "values": ["b"]}]}}]}),
            ),
            "spec.ingress[0].from[0].podSelector.matchExpressions[0].operator",
            "not in",
        ),
        (
            rule(
                json!({"action": "Allow", "from": [{"podSelector": {"matchExpressions": [{"key": "a", "operator": "In"}]}}]}),
            ),
            "spec.ingress[0].from[0].podSelector.matchExpressions[0].values",
            "must not be empty",
        ),
        (
            rule(
                json!({"action": "Allow", "from": [{"podSelector": {"matchExpressions": [{"key": "a", "operator": "Exists", "values": ["b"]}]}}]}),
            ),
            "spec.ingress[0].from[0].podSelector.matchExpressions[0].values",
            "must be empty",
        ),
        (
            rule(
                json!({"action": "Allow", "from": [{"namespaceSelector": {"matchLabels": {"a/b/c": "x"}}}]}),
            ),
            "spec.ingress[0].from[0].namespaceSelector.matchLabels",
            "label keys",
        ),
        (
            rule(
                json!({"action": "Allow", "from": [{"namespaceSelector": {"matchLabels": {"app": "web server"}}}]}),
            ),
            "spec.ingress[0].from[0].namespaceSelector.matchLabels.app",
            "should match",
        ),
        (
            rule(
                json!({"action": "Allow", "from": [{"podSelector": {"matchExpressions": [{"key": "-a", "operator": "Exists"}]}}]}),
            ),
            "spec.ingress[0].from[0].podSelector.matchExpressions[0].key",
            "should match",
        ),
        (
            onp(json!({"priority": -1, "podSelector": {}})),
            "spec.priority",
            "below",
        ),
        (
            onp(json!({"priority": 1, "podSelector": {"matchLabels": {"app": "-x-"}}})),
            "spec.podSelector.matchLabels.app",
            "should match",
        ),
        (
            conp(
                json!({"priority": 1, "namespaceSelector": {"matchExpressions": [{"key": "a", "operator": "NotIn", "values": []}]}}),
            ),
            "spec.namespaceSelector.matchExpressions[0].values",
            "must not be empty",
        ),
        (onp(json!({"priority": 1})), "spec.podSelector", "required"),
        (
            rule(json!({"from": []})),
            "spec.ingress[0].action",
            "required",
        ),
        (
            onp(
                json!({"priority": 1, "podSelector": {}, "ingress": vec![json!({"action": "Deny"}); 129]}),
            ),
            "spec.ingress",
            "more than 128",
        ),
        (
            rule(json!({"action": "Deny", "from": vec![json!({"podSelector": {}}); 17]})),
            "spec.ingress[0].from",
            "more than 16",
        ),
        (
            rule(json!({"action": "Deny", "ports": vec![json!({"port": 1}); 17]})),
            "spec.ingress[0].ports",
            "more than 16",
        ),
        (
            rule(
                json!({"action": "Deny", "from": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": (0..9).map(|i| format!("10.{i}.0.0/16")).collect::<Vec<_>>()}}]}),
            ),
            "spec.ingress[0].from[0].ipBlock.except",
            "more than 8",
        ),
        (
            rule(
                json!({"action": "Deny", "from": [{"podSelector": {"matchLabels": (0..17).map(|i| (format!("k{i}"), json!("v"))).collect::<serde_json::Map<_, _>>()}}]}),
            ),
            "spec.ingress[0].from[0].podSelector.matchLabels",
            "more than 16",
        ),
        (
            conp(
                json!({"priority": 1, "namespaceSelector": {"matchExpressions": vec![json!({"key": "a", "operator": "Exists"}); 9]}}),
            ),
            "spec.namespaceSelector.matchExpressions",
            "more than 8",
        ),
        (
            onp(
                json!({"priority": 1, "podSelector": {"matchExpressions": [{"key": "a", "operator": "In", "values": (0..65).map(|i| format!("v{i}")).collect::<Vec<_>>()}]}}),
            ),
            "spec.podSelector.matchExpressions[0].values",
            "more than 64",
        ),
    ]
}

#[test]
fn every_invalid_fixture_is_refused_by_the_schema_and_by_ordnet() {
    let mut a = Admission::new();
    let mut failures = Vec::new();
    for (object, field, fragment) in invalid_fixtures() {
        let refused = a.admit(&object);
        if !refused
            .iter()
            .any(|(f, m)| f.starts_with(field) && m.contains(fragment))
        {
            failures.push(format!(
                "schema: {object}\n  wanted {field}: ...{fragment}...\n  got {refused:?}"
            ));
        }
        let ours = ordnet_errors(&object);
        if !ours.iter().any(|e| e.starts_with(field)) {
            failures.push(format!(
                "ordnet validate: {object}\n  wanted an error at {field}\n  got {ours:?}"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn valid_edge_cases_are_admitted_by_both() {
    let mut a = Admission::new();
    for object in [
        // Host bits after the prefix: accepted (a warning from ordnet), as upstream.
        rule(
            json!({"action": "Deny", "from": [{"ipBlock": {"cidr": "10.1.2.3/8", "except": ["10.1.0.1/16"]}}]}),
        ),
        rule(
            json!({"action": "Deny", "from": [{"ipBlock": {"cidr": "2001:db8::/32", "except": ["2001:db8:1::/48"]}}]}),
        ),
        rule(
            json!({"action": "Allow", "ports": [{"port": "serve-80-tcp"}, {"port": 1, "endPort": 65535, "protocol": "SCTP"}, {"port": "80-http"}]}),
        ),
        rule(
            json!({"action": "Allow", "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "x", "app.kubernetes.io/name": ""}}}]}),
        ),
        rule(
            json!({"action": "Allow", "from": [{"podSelector": {"matchExpressions": [{"key": "example.com/tier", "operator": "NotIn", "values": ["a", "b-c"]}, {"key": "x", "operator": "DoesNotExist"}]}}]}),
        ),
        conp(json!({"priority": -2147483648, "egress": [{"action": "Deny"}]})),
        onp(json!({"priority": 2147483647, "podSelector": {}})),
    ] {
        let refused = a.admit(&object);
        assert!(refused.is_empty(), "{object}: {refused:?}");
        let ours = ordnet_errors(&object);
        assert!(ours.is_empty(), "{object}: {ours:?}");
    }
}

/// Every rule text of the CRDs, with the schema path it sits at.
fn rules() -> Vec<(String, String)> {
    fn walk(v: &Value, path: &str, out: &mut Vec<(String, String)>) {
        match v {
            Value::Object(m) => {
                for r in m
                    .get("x-kubernetes-validations")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    out.push((path.to_string(), r["rule"].as_str().unwrap().to_string()));
                }
                for (k, v) in m {
                    walk(v, &join(path, k), out);
                }
            }
            Value::Array(a) => a.iter().for_each(|v| walk(v, path, out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    for kind in ["OrderedNetworkPolicy", "ClusterOrderedNetworkPolicy"] {
        walk(&schema(kind), kind, &mut out);
    }
    out
}

#[test]
fn every_cel_rule_compiles_is_exercised_and_is_documented() {
    // The rules sit in a Markdown table there, with `|` escaped.
    let docs = std::fs::read_to_string(repo().join("docs/api.md"))
        .unwrap()
        .replace("\\|", "|");
    let mut a = Admission::new();
    for (object, _, _) in invalid_fixtures() {
        a.admit(&object);
    }
    for p in repository_policies() {
        a.admit(&p);
    }
    let mut missing = Vec::new();
    for (path, text) in rules() {
        Program::compile(&text).unwrap_or_else(|e| panic!("{path}: {text}: {e}"));
        // Both outcomes of every rule are seen: it admits the repository's policies and
        // refuses at least one fixture.
        match a.evaluated.get(&text) {
            None => missing.push(format!("{path}: never evaluated: {text}")),
            Some(false) => missing.push(format!("{path}: never refused anything: {text}")),
            Some(true) => {}
        }
        if !docs.contains(&format!("`{text}`")) {
            missing.push(format!("docs/api.md does not list `{text}`"));
        }
    }
    missing.sort();
    missing.dedup();
    assert!(missing.is_empty(), "{}", missing.join("\n"));
}

#[test]
fn every_list_and_map_under_spec_is_bounded() {
    fn walk(v: &Value, path: &str, out: &mut Vec<String>) {
        let Value::Object(m) = v else { return };
        if m.get("type") == Some(&json!("array")) && !m.contains_key("maxItems") {
            out.push(format!("{path}: array without maxItems"));
        }
        if m.get("additionalProperties").is_some_and(Value::is_object)
            && !m.contains_key("maxProperties")
        {
            out.push(format!("{path}: map without maxProperties"));
        }
        if m.get("type") == Some(&json!("string"))
            && !m.contains_key("maxLength")
            && !m.contains_key("enum")
        {
            out.push(format!("{path}: string without maxLength"));
        }
        if let Some(p) = m.get("properties").and_then(Value::as_object) {
            for (k, v) in p {
                walk(v, &join(path, k), out);
            }
        }
        for k in ["items", "additionalProperties"] {
            if let Some(v) = m.get(k) {
                walk(v, &format!("{path}[*]"), out);
            }
        }
    }
    let mut out = Vec::new();
    for kind in ["OrderedNetworkPolicy", "ClusterOrderedNetworkPolicy"] {
        walk(
            &schema(kind)["properties"]["spec"],
            &format!("{kind}.spec"),
            &mut out,
        );
    }
    assert!(out.is_empty(), "{}", out.join("\n"));
}
