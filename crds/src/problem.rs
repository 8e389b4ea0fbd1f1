//! Problems found while loading or validating objects, and how they are printed.
//!
//! The printed form is the CLI contract's `FILE: KIND NAMESPACE/NAME: FIELD: message`
//! (cluster-scoped objects: `KIND NAME`). Parts that are unknown are left out: a YAML syntax
//! error has no object yet (`FILE: document 2: line 3 column 5: ...`).

use std::fmt;
use std::path::{Path, PathBuf};

/// How bad a problem is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Severity {
    /// The object is invalid: it is not applied, and the CLI exits with 1.
    Error,
    /// Worth telling, but the object is used as it is.
    Warning,
}

/// Which object a problem is about.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectRef {
    /// `Pod`, `NetworkPolicy`, `OrderedNetworkPolicy`, ...
    pub kind: String,
    /// The namespace; `None` for cluster-scoped objects.
    pub namespace: Option<String>,
    /// `metadata.name`.
    pub name: String,
}

impl ObjectRef {
    /// A reference to a namespaced object.
    pub fn namespaced(kind: &str, namespace: &str, name: &str) -> ObjectRef {
        ObjectRef {
            kind: kind.to_string(),
            namespace: Some(namespace.to_string()),
            name: name.to_string(),
        }
    }

    /// A reference to a cluster-scoped object.
    pub fn cluster(kind: &str, name: &str) -> ObjectRef {
        ObjectRef {
            kind: kind.to_string(),
            namespace: None,
            name: name.to_string(),
        }
    }
}

impl fmt::Display for ObjectRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.namespace {
            Some(ns) => write!(f, "{} {}/{}", self.kind, ns, self.name),
            None => write!(f, "{} {}", self.kind, self.name),
        }
    }
}

/// Where an object was read from.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Source {
    /// The file, as it was named on the command line (or found under a named directory).
    pub file: PathBuf,
    /// 1-based position of the YAML document in the file (for JSON: of the JSON value).
    pub document: usize,
    /// 0-based index in `items` when the object came out of a `List`.
    pub item: Option<usize>,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (document {}", self.file.display(), self.document)?;
        if let Some(item) = self.item {
            write!(f, ", items[{item}]")?;
        }
        f.write_str(")")
    }
}

/// A problem with one field of one object, before it is tied to a file
/// (what the per-object validators return).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FieldError {
    /// Error or warning.
    pub severity: Severity,
    /// The field path, e.g. `spec.ingress[0].ports[1].endPort`; empty for the whole object.
    pub field: String,
    /// What is wrong, for a person.
    pub message: String,
}

impl FieldError {
    /// An error at `field`.
    pub fn error(field: impl Into<String>, message: impl Into<String>) -> FieldError {
        FieldError {
            severity: Severity::Error,
            field: field.into(),
            message: message.into(),
        }
    }

    /// A warning at `field`.
    pub fn warning(field: impl Into<String>, message: impl Into<String>) -> FieldError {
        FieldError {
            severity: Severity::Warning,
            field: field.into(),
            message: message.into(),
        }
    }
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !self.field.is_empty() {
            write!(f, "{}: ", self.field)?;
        }
        if self.severity == Severity::Warning {
            f.write_str("warning: ")?;
        }
        f.write_str(&self.message)
    }
}

/// A problem found while loading or validating, with everything known about where it is.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Problem {
    /// Error or warning.
    pub severity: Severity,
    /// The file, when the object came from one.
    pub file: Option<PathBuf>,
    /// 1-based document number in the file, shown when the object is not known.
    pub document: Option<usize>,
    /// 0-based index in a `List`'s `items`, shown when the object is not known.
    pub item: Option<usize>,
    /// The object, when it is known.
    pub object: Option<ObjectRef>,
    /// The field path, when known.
    pub field: Option<String>,
    /// What is wrong.
    pub message: String,
}

impl Problem {
    /// A problem with a whole file (unreadable, not YAML ...).
    pub fn file(severity: Severity, file: &Path, message: impl Into<String>) -> Problem {
        Problem {
            severity,
            file: Some(file.to_path_buf()),
            document: None,
            item: None,
            object: None,
            field: None,
            message: message.into(),
        }
    }

    /// A problem at `source`, about `object` (if known) and `field` (if known).
    pub fn at(
        severity: Severity,
        source: Option<&Source>,
        object: Option<ObjectRef>,
        field: Option<String>,
        message: impl Into<String>,
    ) -> Problem {
        Problem {
            severity,
            file: source.map(|s| s.file.clone()),
            document: source.map(|s| s.document),
            item: source.and_then(|s| s.item),
            object,
            field: field.filter(|f| !f.is_empty()),
            message: message.into(),
        }
    }

    /// Ties a [`FieldError`] to its object and source.
    pub fn from_field_error(
        error: FieldError,
        source: Option<&Source>,
        object: &ObjectRef,
    ) -> Problem {
        Problem::at(
            error.severity,
            source,
            Some(object.clone()),
            Some(error.field),
            error.message,
        )
    }

    /// Whether this is an error (not a warning).
    pub fn is_error(&self) -> bool {
        self.severity == Severity::Error
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(file) = &self.file {
            write!(f, "{}: ", file.display())?;
        }
        match &self.object {
            Some(object) => write!(f, "{object}: ")?,
            None => {
                if let Some(document) = self.document {
                    write!(f, "document {document}")?;
                    if let Some(item) = self.item {
                        write!(f, " items[{item}]")?;
                    }
                    f.write_str(": ")?;
                }
            }
        }
        if let Some(field) = &self.field {
            write!(f, "{field}: ")?;
        }
        if self.severity == Severity::Warning {
            f.write_str("warning: ")?;
        }
        f.write_str(&self.message)
    }
}

/// Whether any of `problems` is an error.
pub fn has_errors(problems: &[Problem]) -> bool {
    problems.iter().any(Problem::is_error)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_follows_the_cli_contract() {
        let source = Source {
            file: PathBuf::from("p.yaml"),
            document: 2,
            item: None,
        };
        let p = Problem::at(
            Severity::Error,
            Some(&source),
            Some(ObjectRef::namespaced("OrderedNetworkPolicy", "qa", "web")),
            Some("spec.ingress[0].ports[1].endPort".into()),
            "must be >= port",
        );
        assert_eq!(
            p.to_string(),
            "p.yaml: OrderedNetworkPolicy qa/web: spec.ingress[0].ports[1].endPort: must be >= port"
        );
        let p = Problem::at(
            Severity::Warning,
            Some(&source),
            Some(ObjectRef::cluster("ClusterOrderedNetworkPolicy", "guard")),
            None,
            "x",
        );
        assert_eq!(
            p.to_string(),
            "p.yaml: ClusterOrderedNetworkPolicy guard: warning: x"
        );
        let p = Problem::at(Severity::Error, Some(&source), None, None, "bad YAML");
        assert_eq!(p.to_string(), "p.yaml: document 2: bad YAML");
    }
}
