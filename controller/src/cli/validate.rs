//! `ordnet validate -f PATH...`: loads the manifests, checks every object and prints each
//! problem as `FILE: KIND NAMESPACE/NAME: FIELD: message` (cluster-scoped: `KIND NAME`).
//!
//! Errors go to stdout, warnings (ignored kinds, legal but suspicious input) to stderr, as does
//! the closing summary. Exit code 1 if there is any error, else 0.

use std::io::Write;
use std::process::ExitCode;

use super::ValidateArgs;

/// Runs `ordnet validate`.
pub fn run(args: &ValidateArgs) -> ExitCode {
    let outcome = ordnet_crds::load_and_validate(&args.files);
    let mut stdout = std::io::stdout().lock();
    let mut stderr = std::io::stderr().lock();
    let mut errors = 0usize;
    for problem in &outcome.problems {
        // Write errors are ignored: the exit code still tells the result.
        if problem.is_error() {
            errors += 1;
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
        ExitCode::from(1)
    } else {
        let n = outcome.objects.loaded_count();
        let _ = writeln!(stderr, "{n} object{} valid", if n == 1 { "" } else { "s" });
        ExitCode::SUCCESS
    }
}
