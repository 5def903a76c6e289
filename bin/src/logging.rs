//! The log of every process these binaries run: warnings and errors on stderr (`RUST_LOG`
//! says otherwise), coloured only for a person at a terminal, not in a log file. Set up before
//! the process takes a node role, so an agent's and a worker's warnings (a data plane refusing
//! strangers, a report dropped) reach their stderr too, which a local job's agents share with
//! `train`.

pub fn init() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}
