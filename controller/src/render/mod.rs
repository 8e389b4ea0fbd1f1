//! The one renderer of `matrix`, `trace` and `dump`: the offline CLI and the agent's debug API
//! (behind `ordnet matrix|trace|dump --agent ADDR`) both call it, so their output is identical
//! in every format. Here: names of identities and rules, the colour decision, ANSI styles,
//! aligned tables and the verdict grid; the three outputs are in [`matrix`], [`trace`] and
//! [`dump`].

pub mod dump;
pub mod matrix;
pub mod trace;
pub mod trie;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::IsTerminal;

use ordnet_engine::{Engine, MatrixVerdict};
use ordnet_mapstate::{Action, Identity, Origin, Tier, Verdict};

/// What an identity stands for, e.g. `prod/app=api [prod/api]`, `cidr 10.0.0.0/8`, `world`.
pub fn identity_label(engine: &Engine, id: Identity) -> Option<String> {
    engine.identity_info(id).map(|info| info.label())
}

/// `OrderedNetworkPolicy prod/artifacts-ports` (the policy an origin belongs to).
pub fn policy_name(o: &Origin) -> String {
    match &o.namespace {
        Some(ns) => format!("{} {ns}/{}", o.kind, o.name),
        None => format!("{} {}", o.kind, o.name),
    }
}

/// Every field of a rule: kind, namespace/name, direction, rule index, priority, action.
pub fn rule_text(o: &Origin) -> String {
    let mut text = policy_name(o);
    if o.tier != Tier::Ordnet {
        let _ = write!(text, ", {} tier", o.tier);
    }
    let _ = write!(text, ", {} rule {}", o.direction, o.rule_index);
    if let Some(name) = &o.rule_name {
        let _ = write!(text, " {name:?}");
    }
    let _ = write!(
        text,
        ", priority {}, action {}",
        o.priority,
        match (o.action, o.tier) {
            (Action::Allow, Tier::Ordnet) => "Allow",
            (Action::Allow, _) => "Accept",
            (Action::Deny, _) => "Deny",
            (Action::Pass, _) => "Pass",
        }
    );
    if let Some(p) = &o.passed_by {
        let _ = write!(text, " (reached through the Pass of {})", rule_text(p));
    }
    text
}

/// Colour only when stdout is a terminal and `NO_COLOR` is unset or empty (no-color.org).
pub fn color_wanted() -> bool {
    let no_color = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty());
    !no_color && std::io::stdout().is_terminal()
}

/// ANSI styling that is a no-op when colour is off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Style {
    /// Whether escapes are written (see [`color_wanted`]).
    pub color: bool,
}

impl Style {
    /// A style that colours when `color` is on.
    pub fn new(color: bool) -> Style {
        Style { color }
    }

    fn wrap(&self, code: &str, s: &str) -> String {
        ansi(self.color, code, s)
    }

    /// `s` in bold.
    pub fn bold(&self, s: &str) -> String {
        self.wrap("1", s)
    }

    /// `s` dimmed.
    pub fn dim(&self, s: &str) -> String {
        self.wrap("2", s)
    }

    /// `s` in green.
    pub fn green(&self, s: &str) -> String {
        self.wrap("32", s)
    }

    /// `s` in yellow.
    pub fn yellow(&self, s: &str) -> String {
        self.wrap("33", s)
    }

    /// `s` in bold red.
    pub fn red(&self, s: &str) -> String {
        self.wrap("1;31", s)
    }

    /// `s` in the verdict's colour (green allow, red deny).
    pub fn verdict(&self, v: Verdict, s: &str) -> String {
        match v {
            Verdict::Allow => self.green(s),
            Verdict::Deny => self.red(s),
        }
    }
}

/// `s` in SGR style `code` (e.g. `1;31`) when `color` is on; plain otherwise.
pub fn ansi(color: bool, code: &str, s: &str) -> String {
    if color && !s.is_empty() {
        format!("\x1b[{code}m{s}\x1b[0m")
    } else {
        s.to_string()
    }
}

/// Display width of plain text (no escapes inside).
pub fn width(s: &str) -> usize {
    s.chars().count()
}

/// `s` padded with spaces to display width `w`.
pub fn pad(s: &str, w: usize) -> String {
    let mut out = s.to_string();
    for _ in width(s)..w {
        out.push(' ');
    }
    out
}

/// One cell: its plain text (for widths) and its styled text.
#[derive(Debug, Clone)]
pub struct Cell {
    plain: String,
    styled: String,
}

impl Cell {
    /// A cell without styling.
    pub fn plain(s: impl Into<String>) -> Cell {
        let s = s.into();
        Cell {
            styled: s.clone(),
            plain: s,
        }
    }

    /// A cell whose styled text is `style(plain)`.
    pub fn styled(s: impl Into<String>, style: impl Fn(&str) -> String) -> Cell {
        let plain = s.into();
        Cell {
            styled: style(&plain),
            plain,
        }
    }
}

/// How [`table`] places a cell in its column.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Align {
    /// Padded on the right (the default for columns without an entry).
    Left,
    /// Padded on both sides, the odd space on the right.
    Center,
}

/// Aligned columns separated by `gap` spaces; trailing spaces are trimmed.
pub fn table(rows: &[Vec<Cell>], align: &[Align], gap: usize) -> String {
    let ncols = rows.iter().map(Vec::len).max().unwrap_or(0);
    let mut widths = vec![0; ncols];
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            widths[i] = widths[i].max(width(&c.plain));
        }
    }
    let mut out = String::new();
    for r in rows {
        let mut line = String::new();
        for (i, c) in r.iter().enumerate() {
            if i > 0 {
                line.push_str(&" ".repeat(gap));
            }
            let room = widths[i] - width(&c.plain);
            let (before, after) = match align.get(i).copied().unwrap_or(Align::Left) {
                Align::Left => (0, room),
                Align::Center => (room / 2, room - room / 2),
            };
            line.push_str(&" ".repeat(before));
            line.push_str(&c.styled);
            line.push_str(&" ".repeat(after));
        }
        let _ = writeln!(out, "{}", line.trim_end());
    }
    out
}

/// The verdict grid of a matrix: rows = sources (`endpoints`), columns = destinations
/// (`endpoints`, then the destination-only `services`), `.` allow, `X` deny, `~` mixed (a
/// Service some of whose backends are allowed), `-` not probed; columns are numbered when
/// names would be wider than `max_width`.
pub fn verdict_grid(
    title: &str,
    endpoints: &[String],
    services: &[String],
    verdicts: &BTreeMap<(String, String), MatrixVerdict>,
    style: Style,
    max_width: usize,
) -> String {
    let columns: Vec<&String> = endpoints.iter().chain(services).collect();
    let name_w = endpoints.iter().map(|e| width(e)).max().unwrap_or(0);
    let by_name: usize = columns.iter().map(|e| width(e) + 2).sum();
    let numbered = name_w + 2 + by_name > max_width;
    let digits = columns.len().to_string().len();
    let label = |i: usize, e: &str| {
        if numbered {
            format!("{:>w$} {e}", i + 1, w = digits)
        } else {
            e.to_string()
        }
    };
    let mut rows = Vec::new();
    let mut header = vec![Cell::styled(title, |s| style.bold(s))];
    for (i, e) in columns.iter().enumerate() {
        let h = if numbered {
            (i + 1).to_string()
        } else {
            (*e).clone()
        };
        header.push(Cell::styled(h, |s| style.bold(s)));
    }
    rows.push(header);
    let (mut denied, mut mixed, mut probed) = (0usize, 0usize, 0usize);
    for (i, from) in endpoints.iter().enumerate() {
        let mut row = vec![Cell::styled(label(i, from), |s| style.bold(s))];
        for to in &columns {
            let cell = match verdicts.get(&(from.clone(), (*to).clone())) {
                Some(MatrixVerdict::Allow) => {
                    probed += 1;
                    Cell::styled(".", |s| style.green(s))
                }
                Some(MatrixVerdict::Deny) => {
                    probed += 1;
                    denied += 1;
                    Cell::styled("X", |s| style.red(s))
                }
                Some(MatrixVerdict::Mixed) => {
                    probed += 1;
                    mixed += 1;
                    Cell::styled("~", |s| style.yellow(s))
                }
                None => Cell::styled("-", |s| style.dim(s)),
            };
            row.push(cell);
        }
        rows.push(row);
    }
    let mut out = String::new();
    if numbered {
        // The destination-only columns are named here (rows name the others).
        for (k, svc) in services.iter().enumerate() {
            let _ = writeln!(out, "{:>w$} {svc}", endpoints.len() + k + 1, w = digits);
        }
    }
    let mut align = vec![Align::Left];
    align.extend(std::iter::repeat_n(Align::Center, columns.len()));
    out.push_str(&table(&rows, &align, 2));
    out.push('\n');
    let mixed_legend = if services.is_empty() {
        String::new()
    } else {
        format!("  {}", style.yellow("~") + " mixed (some backends)")
    };
    let _ = writeln!(
        out,
        "{}  {}{mixed_legend}  {}   rows: source, columns: destination",
        style.green(".") + " allow",
        style.red("X") + " deny",
        style.dim("-") + " not probed (two external addresses)",
    );
    if mixed == 0 {
        let _ = writeln!(
            out,
            "{denied} of {probed} pair{} denied",
            if probed == 1 { "" } else { "s" }
        );
    } else {
        let _ = writeln!(
            out,
            "{denied} of {probed} pair{} denied, {mixed} mixed",
            if probed == 1 { "" } else { "s" }
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grid_input() -> (Vec<String>, BTreeMap<(String, String), MatrixVerdict>) {
        let eps: Vec<String> = ["qa/grafana", "prod/db", "192.0.2.10"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let mut v = BTreeMap::new();
        for a in &eps {
            for b in &eps {
                if a.starts_with("192") && b.starts_with("192") {
                    continue;
                }
                let deny = a == "qa/grafana" && b == "prod/db" || a.starts_with("192");
                let verdict = if deny { Verdict::Deny } else { Verdict::Allow };
                v.insert((a.clone(), b.clone()), verdict.into());
            }
        }
        (eps, v)
    }

    #[test]
    fn grid_by_name() {
        let (eps, v) = grid_input();
        let got = verdict_grid("TCP/80", &eps, &[], &v, Style::new(false), 200);
        let want = "\
TCP/80      qa/grafana  prod/db  192.0.2.10
qa/grafana      .          X         .
prod/db         .          .         .
192.0.2.10      X          X         -

. allow  X deny  - not probed (two external addresses)   rows: source, columns: destination
3 of 8 pairs denied
";
        assert_eq!(got, want);
    }

    #[test]
    fn grid_numbered_when_too_wide() {
        let (eps, v) = grid_input();
        let got = verdict_grid("TCP/80", &eps, &[], &v, Style::new(false), 30);
        let want = "\
TCP/80        1  2  3
1 qa/grafana  .  X  .
2 prod/db     .  .  .
3 192.0.2.10  X  X  -

. allow  X deny  - not probed (two external addresses)   rows: source, columns: destination
3 of 8 pairs denied
";
        assert_eq!(got, want);
    }

    /// Services are columns only (never rows), after the endpoints; a mixed one is `~`.
    #[test]
    fn service_columns_and_mixed() {
        let (eps, mut v) = grid_input();
        let svc = vec!["svc:prod/db".to_string()];
        v.insert(("qa/grafana".into(), svc[0].clone()), MatrixVerdict::Mixed);
        v.insert(("prod/db".into(), svc[0].clone()), MatrixVerdict::Allow);
        v.insert(("192.0.2.10".into(), svc[0].clone()), MatrixVerdict::Deny);
        let got = verdict_grid("TCP/80", &eps, &svc, &v, Style::new(false), 200);
        let want = "\
TCP/80      qa/grafana  prod/db  192.0.2.10  svc:prod/db
qa/grafana      .          X         .            ~
prod/db         .          .         .            .
192.0.2.10      X          X         -            X

. allow  X deny  ~ mixed (some backends)  - not probed (two external addresses)   rows: source, columns: destination
4 of 11 pairs denied, 1 mixed
";
        assert_eq!(got, want);
    }

    #[test]
    fn colour_keeps_alignment() {
        let (eps, v) = grid_input();
        let plain = verdict_grid("TCP/80", &eps, &[], &v, Style::new(false), 200);
        let coloured = verdict_grid("TCP/80", &eps, &[], &v, Style::new(true), 200);
        assert!(coloured.contains("\x1b[1;31mX\x1b[0m"));
        assert!(coloured.contains("\x1b[32m.\x1b[0m"));
        let mut stripped = String::new();
        let mut it = coloured.chars();
        while let Some(c) = it.next() {
            if c == '\x1b' {
                it.by_ref().find(|&c| c == 'm');
            } else {
                stripped.push(c);
            }
        }
        assert_eq!(stripped, plain);
    }
}
