//! The static cost of a CRD's CEL validation rules, estimated the way the Kubernetes API server
//! estimates it when a CRD is created or updated (apiextensions-apiserver's CRD validation:
//! cel-go's `checker` cost estimator with the Kubernetes library's estimates and the size of
//! every value taken from the schema).
//!
//! The API server refuses a CRD when one rule's estimated cost, multiplied by the largest number
//! of times the rule can run in one object (the product of `maxItems`/`maxProperties` of every
//! list and map around it), exceeds [`PER_EXPRESSION_LIMIT`], or when the sum over the rules of
//! one version's schema exceeds [`CRD_LIMIT`]. `kube-cel`'s own analysis is a coarse heuristic that ignores that
//! multiplication and the sizes the API server assumes (a string's `maxLength` counts 4 bytes per
//! character): it calls today's refused rule cheap, so it cannot catch this.
//!
//! What is modelled, for the expressions the CRDs of this repository use: literals, `self` and
//! comprehension variables, field selection and `has()`, the logical and comparison operators,
//! `size`, `type`, `in`, the comprehension macros (`all`, `exists`, `exists_one`, `map`,
//! `filter`), the string functions `matches`, `contains`, `startsWith`, `endsWith`, and the
//! Kubernetes IP/CIDR library. The estimate equals the API server's for these (checked against
//! its own figures in `tests/cel_cost.rs`); an expression outside this set is an error, never a
//! guess, so a new kind of rule has to be modelled before the test accepts it.

use kube_cel::cel::common::ast::{CallExpr, Expr, IdedExpr, LiteralValue};
use kube_cel::cel::parser::Parser;
use serde_json::Value;

/// The elements of a JSON array (none when `v` is not one).
pub fn items(v: &Value) -> impl Iterator<Item = &Value> {
    v.as_array().into_iter().flatten()
}

/// The API server's limit on one rule's estimated cost times its cardinality
/// (`StaticEstimatedCostLimit`).
pub const PER_EXPRESSION_LIMIT: u64 = 10_000_000;
/// The API server's limit on the sum over a CRD's rules (`StaticEstimatedCRDCostLimit`).
pub const CRD_LIMIT: u64 = 100_000_000;
/// The API server's largest request (`MaxRequestSizeBytes`): the size bound of unbounded values.
const MAX_REQUEST_BYTES: u64 = 3 * 1024 * 1024;
/// cel-go's cost factors.
const STRING_TRAVERSAL: f64 = 0.1;
const REGEX_STRING_LENGTH: f64 = 0.25;

/// One rule's estimate.
#[derive(Clone, Debug)]
pub struct RuleCost {
    /// The CRD's name and version.
    pub crd: String,
    /// Where the rule is in the schema (`.spec.ingress[].from[].ipBlock`).
    pub path: String,
    /// The rule's text.
    pub rule: String,
    /// Estimated cost of one evaluation.
    pub per_call: u64,
    /// How many times it can run in one object (`None`: unbounded).
    pub cardinality: Option<u64>,
    /// `per_call × cardinality`: what the API server compares with [`PER_EXPRESSION_LIMIT`].
    pub total: u64,
}

/// The estimates of every rule of every version of `crd` (a CustomResourceDefinition as JSON).
pub fn crd_rule_costs(crd: &Value) -> Result<Vec<RuleCost>, String> {
    let name = crd["metadata"]["name"].as_str().unwrap_or("?");
    let mut out = Vec::new();
    for version in items(&crd["spec"]["versions"]) {
        let schema = &version["schema"]["openAPIV3Schema"];
        let label = format!("{name}/{}", version["name"].as_str().unwrap_or("?"));
        walk(&label, "", schema, Some(1), &mut out)?;
    }
    Ok(out)
}

/// The sums the API server compares with [`CRD_LIMIT`]: every rule's cost, per version (the
/// limit applies to each version's `openAPIV3Schema`; a rule under 1% of it still counts, it is
/// only left out of the error message).
pub fn version_totals(costs: &[RuleCost]) -> Vec<(String, u64)> {
    let mut totals: Vec<(String, u64)> = Vec::new();
    for c in costs {
        match totals.iter_mut().find(|(v, _)| *v == c.crd) {
            Some((_, t)) => *t = t.saturating_add(c.total),
            None => totals.push((c.crd.clone(), c.total)),
        }
    }
    totals
}

fn walk(
    crd: &str,
    path: &str,
    node: &Value,
    cardinality: Option<u64>,
    out: &mut Vec<RuleCost>,
) -> Result<(), String> {
    for rule in items(&node["x-kubernetes-validations"]) {
        let text = rule["rule"].as_str().unwrap_or_default();
        let per_call = rule_cost(text, node).map_err(|e| format!("{crd} {path}: `{text}`: {e}"))?;
        // An unbounded cardinality is estimated by the API server from the request size: no
        // rule of ours may rely on that, so count it as the request size (an upper bound).
        let total = per_call.saturating_mul(cardinality.unwrap_or(MAX_REQUEST_BYTES));
        out.push(RuleCost {
            crd: crd.to_string(),
            path: if path.is_empty() {
                ".".into()
            } else {
                path.into()
            },
            rule: text.to_string(),
            per_call,
            cardinality,
            total,
        });
    }
    // The factor by which this node multiplies its children's cardinality
    // (`extractMaxElements`).
    let factor = match kind(node) {
        Kind::List => node["maxItems"].as_u64(),
        Kind::Map => node["maxProperties"].as_u64(),
        _ => Some(1),
    };
    let child = match (cardinality, factor) {
        (Some(c), Some(f)) => Some(c.saturating_mul(f)),
        _ => None,
    };
    if let Some(props) = node["properties"].as_object() {
        for (name, prop) in props {
            walk(crd, &format!("{path}.{name}"), prop, child, out)?;
        }
    }
    if node["items"].is_object() {
        walk(crd, &format!("{path}[]"), &node["items"], child, out)?;
    }
    if node["additionalProperties"].is_object() {
        walk(
            crd,
            &format!("{path}{{}}"),
            &node["additionalProperties"],
            child,
            out,
        )?;
    }
    Ok(())
}

/// The estimated cost of one evaluation of `rule` with `self` = `node`.
pub fn rule_cost(rule: &str, node: &Value) -> Result<u64, String> {
    let expr = Parser::new()
        .parse(rule)
        .map_err(|e| format!("does not parse: {e:?}"))?;
    let mut est = Estimator {
        root: node,
        locals: Vec::new(),
    };
    Ok(est.cost(&expr)?.cost)
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Object,
    Map,
    List,
    String,
    IntOrString,
    Scalar,
}

fn kind(node: &Value) -> Kind {
    if node["x-kubernetes-int-or-string"] == Value::Bool(true) {
        return Kind::IntOrString;
    }
    match node["type"].as_str() {
        Some("object") if node["additionalProperties"].is_object() => Kind::Map,
        Some("object") => Kind::Object,
        Some("array") => Kind::List,
        Some("string") => Kind::String,
        _ => Kind::Scalar,
    }
}

/// A schema node's `MaxElements` as the API server's CEL declarations have it: a string's
/// `maxLength` in bytes (4 a character), else its longest enum value, else a request's size; a
/// list's `maxItems`, a map's `maxProperties`, else how many fit in a request; 0 for objects and
/// scalars.
fn node_size(node: &Value) -> u64 {
    let max_length = node["maxLength"].as_u64().map(|l| l.saturating_mul(4));
    match kind(node) {
        Kind::IntOrString => max_length.unwrap_or(MAX_REQUEST_BYTES - 2),
        Kind::String => max_length
            .or_else(|| {
                node["enum"].as_array().map(|values| {
                    values
                        .iter()
                        .filter_map(Value::as_str)
                        .map(|s| s.chars().count() as u64)
                        .max()
                        .unwrap_or(0)
                })
            })
            .unwrap_or(match node["format"].as_str() {
                Some("date") => 10,
                Some("duration" | "date-time") => 64,
                _ => MAX_REQUEST_BYTES - 2,
            }),
        // Unbounded: at least 1 byte an item and a separator (an upper bound of the API
        // server's estimate, which uses the items' smallest serialized size).
        Kind::List => node["maxItems"]
            .as_u64()
            .unwrap_or((MAX_REQUEST_BYTES - 2) / 2),
        Kind::Map => node["maxProperties"]
            .as_u64()
            .unwrap_or((MAX_REQUEST_BYTES - 2) / 7),
        Kind::Object | Kind::Scalar => 0,
    }
}

/// The type of a value, as far as the cost depends on it.
#[derive(Clone, Debug)]
enum Ty<'a> {
    /// A value of the schema: its node.
    Node(&'a Value),
    /// A map's key (the API server declares keys as plain strings of size 0).
    MapKey,
    Str,
    Int,
    Bool,
    Cidr,
    Ip,
    /// A type value (`int`, `string`, `type(x)`).
    Type,
    List,
}

#[derive(Clone, Debug)]
struct Est<'a> {
    cost: u64,
    ty: Ty<'a>,
    /// The largest size (characters, bytes or elements); `None` = unknown.
    size: Option<u64>,
}

impl<'a> Est<'a> {
    fn new(cost: u64, ty: Ty<'a>, size: Option<u64>) -> Self {
        Est { cost, ty, size }
    }
    fn size(&self) -> u64 {
        self.size.unwrap_or(u64::MAX)
    }
    fn is_stringish(&self) -> bool {
        match &self.ty {
            Ty::Str | Ty::MapKey => true,
            Ty::Node(n) => matches!(kind(n), Kind::String | Kind::IntOrString),
            _ => false,
        }
    }
}

fn factor(size: u64, f: f64) -> u64 {
    let x = size as f64 * f;
    if x >= u64::MAX as f64 {
        u64::MAX
    } else {
        x.ceil() as u64
    }
}

struct Estimator<'a> {
    root: &'a Value,
    /// Comprehension variables: name, type, size.
    locals: Vec<(String, Ty<'a>, Option<u64>)>,
}

impl<'a> Estimator<'a> {
    fn node_est(&self, cost: u64, node: &'a Value) -> Est<'a> {
        Est::new(cost, Ty::Node(node), Some(node_size(node)))
    }

    fn cost(&mut self, e: &IdedExpr) -> Result<Est<'a>, String> {
        match &e.expr {
            Expr::Literal(lit) => Ok(match lit {
                LiteralValue::String(s) => Est::new(0, Ty::Str, Some(s.chars().count() as u64)),
                LiteralValue::Bytes(b) => Est::new(0, Ty::Str, Some(b.len() as u64)),
                LiteralValue::Boolean(_) => Est::new(0, Ty::Bool, Some(1)),
                _ => Est::new(0, Ty::Int, Some(1)),
            }),
            Expr::Ident(name) => self.ident(name),
            Expr::Select(sel) => {
                let operand = self.cost(&sel.operand)?;
                let Ty::Node(node) = operand.ty else {
                    return Err(format!("selecting .{} from a {:?}", sel.field, operand.ty));
                };
                let field = &node["properties"][&sel.field];
                if field.is_null() {
                    return Err(format!("no field {}", sel.field));
                }
                // Selecting from an object costs 1; `has()` adds nothing (the API server's
                // environment sets PresenceTestHasCost(false)).
                let cost = operand.cost + u64::from(!sel.test);
                if sel.test {
                    Ok(Est::new(cost, Ty::Bool, Some(1)))
                } else {
                    Ok(self.node_est(cost, field))
                }
            }
            Expr::Call(call) => self.call(call),
            Expr::Comprehension(comp) => {
                let range = self.cost(&comp.iter_range)?;
                let init = self.cost(&comp.accu_init)?;
                let elem = match &range.ty {
                    Ty::Node(n) if kind(n) == Kind::List => {
                        let items = &n["items"];
                        (Ty::Node(items), Some(node_size(items)))
                    }
                    Ty::Node(n) if kind(n) == Kind::Map => (Ty::MapKey, Some(0)),
                    other => return Err(format!("iterating over a {other:?}")),
                };
                if comp.iter_var2.is_some() {
                    return Err("two-variable comprehensions are not modelled".into());
                }
                self.locals.push((comp.iter_var.clone(), elem.0, elem.1));
                self.locals
                    .push((comp.accu_var.clone(), init.ty.clone(), init.size));
                let cond = self.cost(&comp.loop_cond)?;
                let step = self.cost(&comp.loop_step)?;
                self.locals.pop();
                self.locals.pop();
                self.locals
                    .push((comp.accu_var.clone(), init.ty.clone(), init.size));
                let result = self.cost(&comp.result)?;
                self.locals.pop();
                let per_item = cond.cost.saturating_add(step.cost);
                let cost = range
                    .cost
                    .saturating_add(init.cost)
                    .saturating_add(result.cost)
                    .saturating_add(range.size().saturating_mul(per_item));
                Ok(Est::new(cost, result.ty, result.size))
            }
            Expr::List(list) => {
                let mut cost = 10u64;
                for el in &list.elements {
                    cost = cost.saturating_add(self.cost(el)?.cost);
                }
                Ok(Est::new(cost, Ty::List, Some(list.elements.len() as u64)))
            }
            other => Err(format!("{other:?} is not modelled")),
        }
    }

    fn ident(&self, name: &str) -> Result<Est<'a>, String> {
        if let Some((_, ty, size)) = self.locals.iter().rev().find(|(n, ..)| n == name) {
            return Ok(Est::new(1, ty.clone(), *size));
        }
        match name {
            "self" => Ok(self.node_est(1, self.root)),
            // Type names: the API server looks their "path" up from `self`, which yields the
            // size of `self` itself.
            "int" | "uint" | "double" | "bool" | "string" | "bytes" | "list" | "map"
            | "null_type" | "type" => Ok(Est::new(1, Ty::Type, Some(node_size(self.root)))),
            other => Err(format!("identifier {other} is not modelled")),
        }
    }

    fn call(&mut self, call: &CallExpr) -> Result<Est<'a>, String> {
        let name = call.func_name.as_str();
        let target = match &call.target {
            Some(t) => Some(self.cost(t)?),
            None => None,
        };
        let mut args = Vec::with_capacity(call.args.len());
        for a in &call.args {
            args.push(self.cost(a)?);
        }
        let sum = target
            .iter()
            .chain(args.iter())
            .fold(0u64, |s, a| s.saturating_add(a.cost));
        let arg = |i: usize| -> Result<&Est<'a>, String> {
            args.get(i)
                .ok_or_else(|| format!("{name} without argument {i}"))
        };
        let tgt = || {
            target
                .as_ref()
                .ok_or_else(|| format!("{name} without a target"))
        };
        let bool_of = |cost: u64| Ok(Est::new(sum.saturating_add(cost), Ty::Bool, Some(1)));
        match name {
            // Short-circuiting: the cost of both sides, nothing more.
            "_&&_" | "_||_" => bool_of(0),
            "_?_:_" => {
                let (c, t, f) = (arg(0)?, arg(1)?, arg(2)?);
                let size = t.size.zip(f.size).map(|(a, b)| a.max(b));
                Ok(Est::new(
                    c.cost.saturating_add(t.cost.max(f.cost)),
                    t.ty.clone(),
                    size,
                ))
            }
            "!_" | "@not_strictly_false" => bool_of(1),
            "_==_" | "_!=_" => {
                let (l, r) = (arg(0)?, arg(1)?);
                if matches!((&l.ty, &r.ty), (Ty::Cidr, Ty::Cidr) | (Ty::Ip, Ty::Ip)) {
                    return bool_of(1);
                }
                bool_of(factor(l.size().min(r.size()), STRING_TRAVERSAL))
            }
            "_<_" | "_<=_" | "_>_" | "_>=_" => {
                let (l, r) = (arg(0)?, arg(1)?);
                if l.is_stringish() && r.is_stringish() {
                    bool_of(factor(l.size().min(r.size()), STRING_TRAVERSAL))
                } else {
                    bool_of(1)
                }
            }
            "size" => Ok(Est::new(sum.saturating_add(1), Ty::Int, Some(1))),
            "type" => Ok(Est::new(sum.saturating_add(1), Ty::Type, None)),
            "@in" => bool_of(arg(1)?.size()),
            "matches" => {
                let (s, re) = match &target {
                    Some(t) => (t, arg(0)?),
                    None => (arg(0)?, arg(1)?),
                };
                let str_cost = factor(s.size().saturating_add(1), STRING_TRAVERSAL);
                let re_cost = factor(re.size(), REGEX_STRING_LENGTH);
                bool_of(str_cost.saturating_mul(re_cost))
            }
            "contains" => {
                let (s, sub) = (tgt()?, arg(0)?);
                bool_of(
                    factor(s.size(), STRING_TRAVERSAL)
                        .saturating_mul(factor(sub.size(), STRING_TRAVERSAL)),
                )
            }
            "startsWith" | "endsWith" => bool_of(factor(arg(0)?.size(), STRING_TRAVERSAL)),
            "isCIDR" | "isIP" => bool_of(factor(arg(0)?.size(), STRING_TRAVERSAL)),
            "cidr" => Ok(Est::new(
                sum.saturating_add(factor(arg(0)?.size(), STRING_TRAVERSAL)),
                Ty::Cidr,
                None,
            )),
            "ip" => match &target {
                Some(t) if matches!(t.ty, Ty::Cidr) => {
                    Ok(Est::new(sum.saturating_add(1), Ty::Ip, None))
                }
                _ => Ok(Est::new(
                    sum.saturating_add(factor(arg(0)?.size(), STRING_TRAVERSAL)),
                    Ty::Ip,
                    None,
                )),
            },
            "family" | "prefixLength" => Ok(Est::new(sum.saturating_add(1), Ty::Int, Some(1))),
            "masked" => Ok(Est::new(sum.saturating_add(1), Ty::Cidr, None)),
            "isUnspecified"
            | "isLoopback"
            | "isLinkLocalMulticast"
            | "isLinkLocalUnicast"
            | "isGlobalUnicast" => bool_of(1),
            "containsIP" | "containsCIDR" => {
                // Comparing two byte lists of 4..16 bytes each; containsCIDR also masks (16
                // bytes again, plus 1); a string argument is parsed first.
                let mut cost = factor(32, STRING_TRAVERSAL);
                if name == "containsCIDR" {
                    cost += factor(16, STRING_TRAVERSAL) + 1;
                }
                let a = arg(0)?;
                if a.is_stringish() {
                    cost = cost.saturating_add(factor(a.size(), STRING_TRAVERSAL));
                }
                bool_of(cost)
            }
            other => Err(format!("function {other} is not modelled")),
        }
    }
}
