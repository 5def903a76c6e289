//! How `train` and `oobleck` end on an error: its message chain on stderr and exit status 1.
//!
//! A `main` returning `anyhow::Result` prints the error's `Debug`, which appends the backtrace
//! anyhow captured when the error was made whenever `RUST_BACKTRACE` (or `RUST_LIB_BACKTRACE`)
//! is set. Many Rust users keep `RUST_BACKTRACE=1` in their environment, so every bad flag
//! ended in twenty frames of `std::rt`. Here the text is the one that `main` printed without a
//! backtrace, byte for byte:
//!
//! ```text
//! Error: reading profile p.json
//!
//! Caused by:
//!     No such file or directory (os error 2)
//! ```
//!
//! (with numbered `0:`, `1:` causes when there are several). Panics are untouched: the panic
//! hook still prints a backtrace under `RUST_BACKTRACE=1`, since a panic is a bug of ours. An
//! error's backtrace is still there for whoever asks for it by name: with `RUST_LIB_BACKTRACE`
//! set (and not `0`) the report is anyhow's, backtrace included.
//!
//! Why not set `RUST_LIB_BACKTRACE=0` at startup to skip the capture too: it would be
//! inherited by the agents and workers these binaries start, hiding the one way to ask for an
//! error's backtrace there, and the capture only walks the stack (no symbols) on an error path.

use std::fmt::Write as _;
use std::process::ExitCode;

/// Ends `main`: `Ok` is success; an error prints its report on stderr and gives status 1 (what
/// `main` returning the error gave).
pub fn report(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let lib_backtrace = std::env::var_os("RUST_LIB_BACKTRACE").is_some_and(|v| v != "0");
            if lib_backtrace {
                eprintln!("Error: {e:?}");
            } else {
                eprintln!("Error: {}", message_chain(&e));
            }
            ExitCode::FAILURE
        }
    }
}

/// anyhow's `Debug` of an error without its backtrace: the message, then its causes, one per
/// line, indented four spaces (and numbered when there are several).
pub fn message_chain(e: &anyhow::Error) -> String {
    let mut out = e.to_string();
    let causes: Vec<String> = e.chain().skip(1).map(|c| c.to_string()).collect();
    if causes.is_empty() {
        return out;
    }
    out.push_str("\n\nCaused by:");
    let numbered = causes.len() > 1;
    for (n, cause) in causes.iter().enumerate() {
        out.push('\n');
        // A cause of several lines keeps its later lines under its first.
        for (i, line) in cause.split('\n').enumerate() {
            match (i, numbered) {
                (0, true) => _ = write!(out, "{n: >5}: "),
                (0, false) => out.push_str("    "),
                (_, true) => out.push_str("\n       "),
                (_, false) => out.push_str("\n    "),
            }
            out.push_str(line);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::message_chain;
    use anyhow::{anyhow, Context};

    /// The text is anyhow's `Debug` up to the backtrace it appends when one was captured.
    fn same_as_anyhow(e: &anyhow::Error) {
        let debug = format!("{e:?}");
        let without_backtrace = debug.split("\n\nStack backtrace:").next().unwrap_or("");
        assert_eq!(message_chain(e), without_backtrace);
    }

    #[test]
    fn a_lone_message_is_one_line() {
        let e = anyhow!("unknown device `x`");
        assert_eq!(message_chain(&e), "unknown device `x`");
        same_as_anyhow(&e);
    }

    #[test]
    fn one_cause_is_indented_without_a_number() {
        let e = Err::<(), _>(anyhow!("No such file"))
            .context("reading profile p.json")
            .unwrap_err();
        assert_eq!(
            message_chain(&e),
            "reading profile p.json\n\nCaused by:\n    No such file"
        );
        same_as_anyhow(&e);
    }

    #[test]
    fn several_causes_are_numbered_and_multiline_causes_stay_aligned() {
        let e = Err::<(), _>(anyhow!("bad\nvalue"))
            .context("parsing job.toml")
            .context("starting the job")
            .unwrap_err();
        assert_eq!(
            message_chain(&e),
            "starting the job\n\nCaused by:\n    0: parsing job.toml\n    1: bad\n       value"
        );
        same_as_anyhow(&e);
    }
}
