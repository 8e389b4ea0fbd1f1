//! `ordnet validate -f PATH... [-o text|json]`: loads the manifests, checks every object and
//! reports each problem.
//!
//! Text: each problem as `FILE: KIND NAMESPACE/NAME: FIELD: message` (cluster-scoped: `KIND
//! NAME`); errors go to stdout, warnings (ignored kinds, legal but suspicious input) to stderr,
//! as does the closing summary. JSON (for CI pipelines): one object on stdout,
//! `{"problems": [{"file", "kind", "namespace", "name", "field", "severity", "message"}]}`
//! (unknown parts are `null`), errors and warnings in the order found; nothing on stderr.
//! Exit code 1 if there is any error, else 0.

use std::io::Write;
use std::process::ExitCode;

use ordnet_crds::Problem;
use serde_json::{Value, json};

use super::{TextOrJson, ValidateArgs};

/// One problem as CLI.md's JSON object.
fn problem_json(p: &Problem) -> Value {
    let object = p.object.as_ref();
    json!({
        "file": p.file.as_ref().map(|f| f.display().to_string()),
        "kind": object.map(|o| o.kind.clone()),
        "namespace": object.and_then(|o| o.namespace.clone()),
        "name": object.map(|o| o.name.clone()),
        "field": p.field,
        "severity": if p.is_error() { "error" } else { "warning" },
        "message": p.message,
    })
}

/// Runs `ordnet validate`.
pub fn run(args: &ValidateArgs) -> ExitCode {
    let outcome = ordnet_crds::load_and_validate(&args.files);
    let errors = outcome.problems.iter().filter(|p| p.is_error()).count();
    let code = if errors > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    };
    let mut stdout = std::io::stdout().lock();
    if args.output == TextOrJson::Json {
        let problems: Vec<Value> = outcome.problems.iter().map(problem_json).collect();
        let _ = writeln!(stdout, "{}", json!({ "problems": problems }));
        let _ = stdout.flush();
        return code;
    }
    let mut stderr = std::io::stderr().lock();
    for problem in &outcome.problems {
        // Write errors are ignored: the exit code still tells the result.
        if problem.is_error() {
            let _ = writeln!(stdout, "{problem}");
        } else {
            let _ = writeln!(stderr, "{problem}");
        }
    }
    let _ = stdout.flush();
    if errors > 0 {
        let _ = writeln!(
            stderr,
            "{errors} error{} found",
            if errors == 1 { "" } else { "s" }
        );
    } else {
        let n = outcome.objects.loaded_count();
        let _ = writeln!(stderr, "{n} object{} valid", if n == 1 { "" } else { "s" });
    }
    code
}
