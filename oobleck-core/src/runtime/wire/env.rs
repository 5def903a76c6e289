//! The environment a parent process gives its child: the runtime starts node agents and
//! workers by re-executing the user's binary ([`std::env::current_exe`]) with no arguments (the
//! binary's flags are its own) and says what each is here, the way MPI programs re-run the same
//! binary.
//!
//! | variable                   | role   | meaning                                          |
//! |----------------------------|--------|--------------------------------------------------|
//! | `OOBLECK_ROLE`             | both   | `agent` or `worker`; unset: the user's process    |
//! | `OOBLECK_MASTER`           | agent  | the master's control address, `HOST:PORT`        |
//! | `OOBLECK_TOKEN`            | agent  | the job's shared secret                           |
//! | `OOBLECK_HOST`             | agent  | optional: the IP its workers bind their data plane on |
//! | `OOBLECK_AGENT_WAIT`       | agent  | optional: seconds to wait for the master (120)    |
//! | `OOBLECK_EXIT_WITH_PARENT` | agent  | `1`: stdin closing means the master is lost        |
//! | `OOBLECK_MASTER_WAIT`      | agent  | optional: seconds to look for a lost master (60)  |
//! | `OOBLECK_RANK`             | worker | the worker's global rank                          |

/// The job's shared secret of the control plane.
pub const TOKEN_ENV: &str = "OOBLECK_TOKEN";
/// What this process was started as.
pub const ROLE_ENV: &str = "OOBLECK_ROLE";
/// The master's control address of an agent.
pub const MASTER_ENV: &str = "OOBLECK_MASTER";
/// The data-plane IP of an agent's workers.
pub const HOST_ENV: &str = "OOBLECK_HOST";
/// Seconds an agent waits for its master.
pub const AGENT_WAIT_ENV: &str = "OOBLECK_AGENT_WAIT";
/// `1`: the agent takes its stdin closing for the master lost (it looks for one, then exits).
pub const EXIT_WITH_PARENT_ENV: &str = "OOBLECK_EXIT_WITH_PARENT";
/// Seconds an agent that lost its master looks for one before it stops its workers.
pub const MASTER_WAIT_ENV: &str = "OOBLECK_MASTER_WAIT";
/// A worker's global rank.
pub const RANK_ENV: &str = "OOBLECK_RANK";
/// Agents of the job on this agent's machine (a local cluster's: all of them); default 1. Its
/// workers share the machine's cores with theirs.
pub const HOST_AGENTS_ENV: &str = "OOBLECK_HOST_AGENTS";

/// `OOBLECK_ROLE` of a node agent.
pub const AGENT: &str = "agent";
/// `OOBLECK_ROLE` of a worker.
pub const WORKER: &str = "worker";
