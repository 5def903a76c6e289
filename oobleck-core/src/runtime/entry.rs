//! The entry point of a user's binary: one call at the top of `main` that takes over when the
//! process was started as a node agent or a worker of a job, the way MPI programs re-run the
//! same binary. The runtime starts those processes by re-executing the binary
//! ([`std::env::current_exe`]) with no arguments (the binary's flags are its own) and says
//! what each is in the environment:
//!
//! The variables are listed in [`super::wire::env`].
//!
//! This module ends the process for those roles, so it prints: the error on stderr, in the
//! `Error: ...` form whose lines an agent sends the master when its worker fails.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use super::error::{error_chain, BoxError, Result, RuntimeError};
use super::node::{parse_master_wait, run_agent, AgentOptions};
use super::spec::TrainingSpec;
use super::wire::env::{
    AGENT, AGENT_WAIT_ENV, EXIT_WITH_PARENT_ENV, HOST_ENV, MASTER_ENV, MASTER_WAIT_ENV, RANK_ENV,
    ROLE_ENV, TOKEN_ENV, WORKER,
};
use super::wire::pipe::ERROR_TAG;
use super::worker::run_worker;
use super::workload::Workload;
use crate::runtime::wire::Token;

/// How long an agent waits for its master when `OOBLECK_AGENT_WAIT` is unset.
const DEFAULT_AGENT_WAIT_S: u64 = 120;

/// Exit code of a role that failed.
const FAILED: i32 = 1;
/// Exit code of a process started with a role this library does not have.
const UNKNOWN_ROLE: i32 = 2;

/// The role this process was started with (`OOBLECK_ROLE`), `None` for a user's own process.
pub fn role() -> Option<String> {
    std::env::var_os(ROLE_ENV).map(|r| r.to_string_lossy().into_owned())
}

/// The first call of a user's `main`: when this process was started as an agent or a worker
/// of a job, runs that role here and exits the process (0, or 1 after printing the error);
/// otherwise returns at once. `factory` builds the workload in each worker from the job's
/// training spec and workload settings ([`super::Factory`]). Every process first gets the training
/// allocator settings ([`super::tune_allocator`]).
pub fn take_over<F>(factory: F)
where
    F: Fn(&TrainingSpec, &serde_json::Value) -> std::result::Result<Box<dyn Workload>, BoxError>
        + Send
        + Sync
        + 'static,
{
    super::tune_allocator();
    let Some(role) = role() else {
        return;
    };
    let result = match role.as_str() {
        AGENT => agent_options_from_env().and_then(|opts| run_agent(&opts)),
        WORKER => rank_from_env().and_then(|rank| run_worker(rank, &factory)),
        other => {
            eprintln!(
                "{ERROR_TAG} {ROLE_ENV}={other:?} is not a role of the oobleck runtime (it starts \
                 its processes with {AGENT:?} or {WORKER:?}); unset {ROLE_ENV} to run this \
                 program yourself"
            );
            std::process::exit(UNKNOWN_ROLE);
        }
    };
    match result {
        Ok(()) => std::process::exit(0),
        Err(e) => {
            eprintln!("{}", error_report(&e));
            std::process::exit(FAILED);
        }
    }
}

/// The command that starts a local agent of the master at `master` from binary `exe`: when
/// its stdin (piped) closes, the master is lost, and it looks for one for `master_wait` before
/// it stops its workers and exits; it is killed when the returned child is dropped.
pub fn agent_command(
    exe: &Path,
    master: SocketAddr,
    token: &Token,
    wait_s: u64,
    master_wait: Duration,
) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(exe);
    cmd.env(ROLE_ENV, AGENT)
        .env(MASTER_ENV, master.to_string())
        .env(TOKEN_ENV, token.expose())
        .env(AGENT_WAIT_ENV, wait_s.to_string())
        .env(EXIT_WITH_PARENT_ENV, "1")
        .env(MASTER_WAIT_ENV, master_wait.as_secs().to_string())
        .env_remove(RANK_ENV)
        .env_remove(HOST_ENV)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true);
    // A Ctrl-C at the terminal signals the whole process group: the master alone takes it (and
    // stops the job after a step, with a checkpoint); the agent and the workers it starts,
    // which inherit the ignored signal, go when the master tells them to.
    // SAFETY: between fork and exec only `signal`, which is async-signal-safe, runs.
    unsafe {
        cmd.pre_exec(|| {
            libc::signal(libc::SIGINT, libc::SIG_IGN);
            Ok(())
        });
    }
    cmd
}

/// An error in the environment a role was started with.
fn bad_env(role: &str, what: String) -> RuntimeError {
    RuntimeError::Protocol {
        who: format!("{ROLE_ENV}={role}"),
        what,
    }
}

fn env_var(name: &str, role: &str) -> Result<Option<String>> {
    match std::env::var(name) {
        Ok(v) => Ok(Some(v)),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => {
            Err(bad_env(role, format!("{name} is not valid UTF-8")))
        }
    }
}

fn required(name: &str, role: &str) -> Result<String> {
    env_var(name, role)?.ok_or_else(|| {
        bad_env(
            role,
            format!("{name} is not set; the runtime sets it when it starts this process"),
        )
    })
}

/// An agent's options from its environment.
fn agent_options_from_env() -> Result<AgentOptions> {
    let wait_s = match env_var(AGENT_WAIT_ENV, AGENT)? {
        None => DEFAULT_AGENT_WAIT_S,
        Some(s) => s.trim().parse().map_err(|_| {
            bad_env(
                AGENT,
                format!("{AGENT_WAIT_ENV}={s:?} is not a whole number of seconds"),
            )
        })?,
    };
    let exit_with_parent = match env_var(EXIT_WITH_PARENT_ENV, AGENT)?.as_deref() {
        None | Some("0") | Some("") => false,
        Some("1") => true,
        Some(other) => {
            return Err(bad_env(
                AGENT,
                format!("{EXIT_WITH_PARENT_ENV}={other:?} must be 1 or 0"),
            ))
        }
    };
    let master_wait = match env_var(MASTER_WAIT_ENV, AGENT)? {
        None => super::node::DEFAULT_MASTER_WAIT,
        Some(s) => parse_master_wait(&s)
            .map_err(|e| bad_env(AGENT, format!("{MASTER_WAIT_ENV}={s:?}: {e}")))?,
    };
    Ok(AgentOptions {
        host: env_var(HOST_ENV, AGENT)?.filter(|h| !h.trim().is_empty()),
        exit_with_parent,
        wait: Duration::from_secs(wait_s),
        master_wait,
        ..AgentOptions::new(required(MASTER_ENV, AGENT)?, required(TOKEN_ENV, AGENT)?)
    })
}

/// A worker's rank from its environment.
fn rank_from_env() -> Result<u32> {
    let s = required(RANK_ENV, WORKER)?;
    s.trim().parse().map_err(|_| {
        bad_env(
            WORKER,
            format!("{RANK_ENV}={s:?} is not a rank (a whole number)"),
        )
    })
}

/// `Error: {e}`, then its other causes (as `anyhow` prints the error of `main`).
fn error_report(e: &RuntimeError) -> String {
    let chain = error_chain(e);
    let mut out = format!("{ERROR_TAG} {}", chain[0]);
    if chain.len() > 1 {
        out.push_str("\n\nCaused by:");
        for (i, c) in chain[1..].iter().enumerate() {
            out.push_str(&format!("\n    {i}: {c}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("disk full")]
    struct Inner;

    #[derive(Debug, thiserror::Error)]
    #[error("writing the state")]
    struct Outer(#[source] Inner);

    #[test]
    fn an_error_report_lists_each_cause_once() {
        // Context prints its source; the chain must not repeat it.
        let e = RuntimeError::Context {
            what: "rank 1: step 3".into(),
            source: Box::new(Inner),
        };
        assert_eq!(error_report(&e), "Error: rank 1: step 3: disk full");
        // A source the message leaves out is listed below it.
        let e = RuntimeError::workload(Outer(Inner));
        assert_eq!(
            error_report(&e),
            "Error: the workload: writing the state\n\nCaused by:\n    0: disk full"
        );
    }

    #[test]
    fn the_agent_command_names_the_role_and_everything_the_agent_reads() {
        let token = Token::new("s3cret").expect("token");
        let master: SocketAddr = "127.0.0.1:7000".parse().expect("literal");
        let cmd = agent_command(
            Path::new("/bin/true"),
            master,
            &token,
            10,
            Duration::from_secs(7),
        );
        let envs: Vec<(String, Option<String>)> = cmd
            .as_std()
            .get_envs()
            .map(|(k, v)| {
                (
                    k.to_string_lossy().into_owned(),
                    v.map(|v| v.to_string_lossy().into_owned()),
                )
            })
            .collect();
        let get = |k: &str| envs.iter().find(|e| e.0 == k).and_then(|e| e.1.clone());
        assert_eq!(get(ROLE_ENV).as_deref(), Some(AGENT));
        assert_eq!(get(MASTER_ENV).as_deref(), Some("127.0.0.1:7000"));
        assert_eq!(get(TOKEN_ENV).as_deref(), Some("s3cret"));
        assert_eq!(get(AGENT_WAIT_ENV).as_deref(), Some("10"));
        assert_eq!(get(EXIT_WITH_PARENT_ENV).as_deref(), Some("1"));
        assert_eq!(get(MASTER_WAIT_ENV).as_deref(), Some("7"));
        assert_eq!(cmd.as_std().get_args().count(), 0);
    }
}
