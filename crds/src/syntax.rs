//! Kubernetes name, label and port syntax, as the API server checks it.
//!
//! Each function returns `Err(message)` with a message for a person. They never panic.

/// Longest DNS-1123 label (namespace names, label-name parts).
pub const DNS1123_LABEL_MAX: usize = 63;
/// Longest DNS-1123 subdomain (object names, label-key prefixes).
pub const DNS1123_SUBDOMAIN_MAX: usize = 253;
/// Longest label value and label-key name part.
pub const LABEL_VALUE_MAX: usize = 63;
/// Longest IANA service name (named ports).
pub const PORT_NAME_MAX: usize = 15;

fn shown(s: &str) -> String {
    // Keep messages short and printable whatever the input.
    let mut out: String = s.chars().take(80).flat_map(char::escape_debug).collect();
    if s.chars().count() > 80 {
        out.push_str("...");
    }
    format!("\"{out}\"")
}

/// A DNS-1123 label: 1-63 lowercase alphanumerics or '-', starting and ending alphanumeric.
pub fn dns1123_label(s: &str) -> Result<(), String> {
    if s.is_empty() {
        return Err("must not be empty".into());
    }
    if s.len() > DNS1123_LABEL_MAX {
        return Err(format!(
            "{} is longer than {DNS1123_LABEL_MAX} characters",
            shown(s)
        ));
    }
    let ok_char = |c: u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    let b = s.as_bytes();
    if !b.iter().all(|&c| ok_char(c) || c == b'-') || !ok_char(b[0]) || !ok_char(b[b.len() - 1]) {
        return Err(format!(
            "{} is not a valid DNS-1123 label: lowercase letters, digits and '-', starting and ending with a letter or digit",
            shown(s)
        ));
    }
    Ok(())
}

/// A DNS-1123 subdomain: at most 253 characters, dot-separated DNS-1123 labels.
pub fn dns1123_subdomain(s: &str) -> Result<(), String> {
    if s.is_empty() {
        return Err("must not be empty".into());
    }
    if s.len() > DNS1123_SUBDOMAIN_MAX {
        return Err(format!(
            "{} is longer than {DNS1123_SUBDOMAIN_MAX} characters",
            shown(s)
        ));
    }
    let ok_char = |c: u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    let valid = s.split('.').all(|part| {
        let b = part.as_bytes();
        !b.is_empty()
            && b.iter().all(|&c| ok_char(c) || c == b'-')
            && ok_char(b[0])
            && ok_char(b[b.len() - 1])
    });
    if !valid {
        return Err(format!(
            "{} is not a valid DNS-1123 subdomain: lowercase letters, digits, '-' and '.', each dot-separated part starting and ending with a letter or digit",
            shown(s)
        ));
    }
    Ok(())
}

/// The shape shared by label values and the name part of label keys:
/// alphanumerics, '-', '_' and '.', starting and ending alphanumeric (or empty).
fn label_chars_ok(s: &str) -> bool {
    let b = s.as_bytes();
    if b.is_empty() {
        return true;
    }
    let alnum = |c: u8| c.is_ascii_alphanumeric();
    b.iter()
        .all(|&c| alnum(c) || c == b'-' || c == b'_' || c == b'.')
        && alnum(b[0])
        && alnum(b[b.len() - 1])
}

/// A label key (a "qualified name"): an optional DNS-1123 subdomain prefix and '/', then a
/// name of 1-63 alphanumerics, '-', '_' or '.', starting and ending alphanumeric.
pub fn label_key(s: &str) -> Result<(), String> {
    let (prefix, name) = match s.split_once('/') {
        Some((prefix, name)) => {
            if name.contains('/') {
                return Err(format!(
                    "{} is not a valid label key: at most one '/' (prefix/name)",
                    shown(s)
                ));
            }
            (Some(prefix), name)
        }
        None => (None, s),
    };
    if let Some(prefix) = prefix {
        if prefix.is_empty() {
            return Err(format!(
                "{} is not a valid label key: the prefix before '/' must not be empty",
                shown(s)
            ));
        }
        if let Err(e) = dns1123_subdomain(prefix) {
            return Err(format!("the prefix of label key {}: {e}", shown(s)));
        }
    }
    if name.is_empty() {
        return Err(format!(
            "{} is not a valid label key: the name part must not be empty",
            shown(s)
        ));
    }
    if name.len() > LABEL_VALUE_MAX {
        return Err(format!(
            "{} is not a valid label key: the name part is longer than {LABEL_VALUE_MAX} characters",
            shown(s)
        ));
    }
    if !label_chars_ok(name) {
        return Err(format!(
            "{} is not a valid label key: the name part may contain letters, digits, '-', '_' and '.', and must start and end with a letter or digit",
            shown(s)
        ));
    }
    Ok(())
}

/// A label value: empty, or up to 63 alphanumerics, '-', '_' or '.', starting and ending alphanumeric.
pub fn label_value(s: &str) -> Result<(), String> {
    if s.len() > LABEL_VALUE_MAX {
        return Err(format!(
            "{} is not a valid label value: longer than {LABEL_VALUE_MAX} characters",
            shown(s)
        ));
    }
    if !label_chars_ok(s) {
        return Err(format!(
            "{} is not a valid label value: letters, digits, '-', '_' and '.', starting and ending with a letter or digit",
            shown(s)
        ));
    }
    Ok(())
}

/// A named port (IANA_SVC_NAME): 1-15 lowercase letters, digits and '-', at least one letter,
/// no '-' at either end, no "--".
pub fn port_name(s: &str) -> Result<(), String> {
    if s.is_empty() {
        return Err("a named port must not be empty".into());
    }
    if s.len() > PORT_NAME_MAX {
        return Err(format!(
            "{} is not a valid port name: longer than {PORT_NAME_MAX} characters",
            shown(s)
        ));
    }
    if !s
        .bytes()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-')
    {
        return Err(format!(
            "{} is not a valid port name: only lowercase letters, digits and '-' are allowed",
            shown(s)
        ));
    }
    if !s.bytes().any(|c| c.is_ascii_lowercase()) {
        return Err(format!(
            "{} is not a valid port name: it must contain at least one letter",
            shown(s)
        ));
    }
    if s.starts_with('-') || s.ends_with('-') {
        return Err(format!(
            "{} is not a valid port name: it must not start or end with '-'",
            shown(s)
        ));
    }
    if s.contains("--") {
        return Err(format!(
            "{} is not a valid port name: it must not contain \"--\"",
            shown(s)
        ));
    }
    Ok(())
}

/// A port number: 1-65535.
pub fn port_number(n: i64) -> Result<(), String> {
    if (1..=65535).contains(&n) {
        Ok(())
    } else {
        Err(format!(
            "{n} is not a valid port number: must be between 1 and 65535"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dns_labels() {
        for ok in ["a", "x", "kube-system", "a1", "1a", &"a".repeat(63)] {
            assert!(dns1123_label(ok).is_ok(), "{ok}");
        }
        for bad in ["", "-a", "a-", "A", "a.b", "a_b", &"a".repeat(64), "ä"] {
            assert!(dns1123_label(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn dns_subdomains() {
        for ok in [
            "a",
            "a.b",
            "allow-grafana",
            "x.y-z.w",
            &"a.".repeat(126)[..251],
        ] {
            assert!(dns1123_subdomain(ok).is_ok(), "{ok}");
        }
        for bad in ["", ".a", "a.", "a..b", "A", "a_b", &"a".repeat(254)] {
            assert!(dns1123_subdomain(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn label_keys_and_values() {
        for ok in [
            "pod",
            "kubernetes.io/metadata.name",
            "app.kubernetes.io/name",
            "A_b.c-D",
            "x/y",
        ] {
            assert!(label_key(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "/a",
            "a/",
            "a/b/c",
            "-a",
            "a-",
            "Ex/a",
            "a b",
            &"a".repeat(64),
        ] {
            assert!(label_key(bad).is_err(), "{bad}");
        }
        for ok in ["", "a", "A.b_c-1", &"v".repeat(63)] {
            assert!(label_value(ok).is_ok(), "{ok}");
        }
        for bad in ["-a", "a-", "a b", "a/b", &"v".repeat(64)] {
            assert!(label_value(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn port_names() {
        for ok in [
            "dns",
            "serve-80-tcp",
            "http",
            "a",
            "a1",
            "1a",
            "abcdefghijklmno",
        ] {
            assert!(port_name(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "80",
            "-dns",
            "dns-",
            "a--b",
            "DNS",
            "a_b",
            "abcdefghijklmnop",
        ] {
            assert!(port_name(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn port_numbers() {
        assert!(port_number(1).is_ok());
        assert!(port_number(65535).is_ok());
        assert!(port_number(0).is_err());
        assert!(port_number(65536).is_err());
        assert!(port_number(-1).is_err());
    }
}
