//! Label selectors: validation (as the API server does it) and a parsed form that matches labels.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

use crate::problem::FieldError;
use crate::syntax;

/// One requirement of a parsed selector. All requirements of a selector are ANDed.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Requirement {
    /// The label is present and its value is one of these.
    In(String, BTreeSet<String>),
    /// The label is absent, or its value is none of these.
    NotIn(String, BTreeSet<String>),
    /// The label is present (any value).
    Exists(String),
    /// The label is absent.
    DoesNotExist(String),
}

impl Requirement {
    /// Whether `labels` satisfy this requirement.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        match self {
            Requirement::In(k, vs) => labels.get(k).is_some_and(|v| vs.contains(v)),
            Requirement::NotIn(k, vs) => labels.get(k).is_none_or(|v| !vs.contains(v)),
            Requirement::Exists(k) => labels.contains_key(k),
            Requirement::DoesNotExist(k) => !labels.contains_key(k),
        }
    }
}

/// A validated label selector. The empty selector (`{}`) matches everything.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Selector {
    /// Sorted and deduplicated, so that equal selectors compare equal.
    pub requirements: Vec<Requirement>,
}

impl Selector {
    /// Parses and validates `selector`. Errors carry field paths relative to the selector
    /// (`matchExpressions[0].operator`); use [`validate_label_selector`] for absolute paths.
    pub fn parse(selector: &LabelSelector) -> Result<Selector, Vec<FieldError>> {
        let mut errors = Vec::new();
        validate_label_selector(selector, "", &mut errors);
        if errors
            .iter()
            .any(|e| e.severity == crate::problem::Severity::Error)
        {
            return Err(errors);
        }
        let mut requirements = Vec::new();
        for (k, v) in selector.match_labels.iter().flatten() {
            requirements.push(Requirement::In(k.clone(), BTreeSet::from([v.clone()])));
        }
        for expr in selector.match_expressions.iter().flatten() {
            let values: BTreeSet<String> = expr.values.iter().flatten().cloned().collect();
            let key = expr.key.clone();
            requirements.push(match expr.operator.as_str() {
                "In" => Requirement::In(key, values),
                "NotIn" => Requirement::NotIn(key, values),
                "Exists" => Requirement::Exists(key),
                // Validation above admits only the four operators.
                _ => Requirement::DoesNotExist(key),
            });
        }
        requirements.sort();
        requirements.dedup();
        Ok(Selector { requirements })
    }

    /// The selector that matches everything (`{}`).
    pub fn everything() -> Selector {
        Selector::default()
    }

    /// Whether this selector matches every label set.
    pub fn is_everything(&self) -> bool {
        self.requirements.is_empty()
    }

    /// Whether `labels` satisfy every requirement.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.requirements.iter().all(|r| r.matches(labels))
    }
}

fn join(base: &str, field: &str) -> String {
    if base.is_empty() {
        field.to_string()
    } else {
        format!("{base}.{field}")
    }
}

/// Validates a label selector as the API server does; `path` is the selector's field path.
pub fn validate_label_selector(selector: &LabelSelector, path: &str, out: &mut Vec<FieldError>) {
    for (k, v) in selector.match_labels.iter().flatten() {
        let field = join(path, &format!("matchLabels.{k}"));
        if let Err(e) = syntax::label_key(k) {
            out.push(FieldError::error(field.clone(), e));
        }
        if let Err(e) = syntax::label_value(v) {
            out.push(FieldError::error(field, e));
        }
    }
    for (i, expr) in selector.match_expressions.iter().flatten().enumerate() {
        let base = join(path, &format!("matchExpressions[{i}]"));
        if let Err(e) = syntax::label_key(&expr.key) {
            out.push(FieldError::error(format!("{base}.key"), e));
        }
        let values = expr.values.as_deref().unwrap_or_default();
        match expr.operator.as_str() {
            "In" | "NotIn" => {
                if values.is_empty() {
                    out.push(FieldError::error(
                        format!("{base}.values"),
                        format!("must not be empty when operator is {}", expr.operator),
                    ));
                }
            }
            "Exists" | "DoesNotExist" => {
                if !values.is_empty() {
                    out.push(FieldError::error(
                        format!("{base}.values"),
                        format!("must be empty when operator is {}", expr.operator),
                    ));
                }
            }
            other => out.push(FieldError::error(
                format!("{base}.operator"),
                format!("{other:?} is not a valid operator: use In, NotIn, Exists or DoesNotExist"),
            )),
        }
        for (j, value) in values.iter().enumerate() {
            if let Err(e) = syntax::label_value(value) {
                out.push(FieldError::error(format!("{base}.values[{j}]"), e));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn expr(key: &str, op: &str, values: Option<&[&str]>) -> LabelSelectorRequirement {
        LabelSelectorRequirement {
            key: key.into(),
            operator: op.into(),
            values: values.map(|v| v.iter().map(|s| s.to_string()).collect()),
        }
    }

    #[test]
    fn empty_selector_matches_everything() {
        let s = Selector::parse(&LabelSelector::default()).unwrap();
        assert!(s.is_everything());
        assert!(s.matches(&labels(&[])));
        assert!(s.matches(&labels(&[("a", "b")])));
    }

    #[test]
    fn operators() {
        let sel = LabelSelector {
            match_labels: Some(BTreeMap::from([("ns".to_string(), "x".to_string())])),
            match_expressions: Some(vec![
                expr("pod", "In", Some(&["a", "b"])),
                expr("tier", "NotIn", Some(&["db"])),
                expr("app", "Exists", None),
                expr("legacy", "DoesNotExist", Some(&[])),
            ]),
        };
        let s = Selector::parse(&sel).unwrap();
        assert!(s.matches(&labels(&[("ns", "x"), ("pod", "a"), ("app", "")])));
        assert!(s.matches(&labels(&[
            ("ns", "x"),
            ("pod", "b"),
            ("app", "1"),
            ("tier", "web")
        ])));
        assert!(!s.matches(&labels(&[("ns", "y"), ("pod", "a"), ("app", "")])));
        assert!(!s.matches(&labels(&[("ns", "x"), ("pod", "c"), ("app", "")])));
        assert!(!s.matches(&labels(&[
            ("ns", "x"),
            ("pod", "a"),
            ("app", ""),
            ("tier", "db")
        ])));
        assert!(!s.matches(&labels(&[("ns", "x"), ("pod", "a")])));
        assert!(!s.matches(&labels(&[
            ("ns", "x"),
            ("pod", "a"),
            ("app", ""),
            ("legacy", "")
        ])));
    }

    #[test]
    fn invalid_selectors_name_the_field() {
        let sel = LabelSelector {
            match_labels: Some(BTreeMap::from([("bad key".to_string(), "v".to_string())])),
            match_expressions: Some(vec![
                expr("pod", "in", Some(&["a"])),
                expr("pod", "In", Some(&[])),
                expr("pod", "Exists", Some(&["a"])),
                expr("pod", "NotIn", Some(&["-bad"])),
            ]),
        };
        let errors = Selector::parse(&sel).unwrap_err();
        let fields: Vec<&str> = errors.iter().map(|e| e.field.as_str()).collect();
        assert_eq!(
            fields,
            [
                "matchLabels.bad key",
                "matchExpressions[0].operator",
                "matchExpressions[1].values",
                "matchExpressions[2].values",
                "matchExpressions[3].values[0]",
            ]
        );
    }
}
