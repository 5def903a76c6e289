//! The log of every process these binaries run: warnings and errors on stderr (`RUST_LOG`
//! says otherwise), and the progress of preparing raw `--data` into the cache (it can take
//! hours and must not look like a hang); coloured only for a person at a terminal, not in a
//! log file. Set up before the process takes a node role, so an agent's and a worker's
//! warnings (a data plane refusing strangers, a report dropped) reach their stderr too, which
//! a local job's agents share with `train`.

/// Warnings, and the info lines of `train --data RAW`'s preparation (prepare/cache.rs).
const DEFAULT_FILTER: &str = "warn,oobleck_models::data::prepare::cache=info";

pub fn init() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(DEFAULT_FILTER)),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}
