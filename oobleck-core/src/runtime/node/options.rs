//! How a node agent finds and joins its job ([`AgentOptions`]), and the defaults the
//! command lines share.

use std::time::Duration;

/// How long an agent that lost its master looks for one before it stops its workers
/// (`--master-wait`): a supervised master (systemd, a Kubernetes Deployment) is back within
/// seconds to tens of seconds, and a minute of idle workers costs less than replaying the
/// steps since the last checkpoint.
pub const DEFAULT_MASTER_WAIT: Duration = Duration::from_secs(60);

/// How a node agent finds and joins its job.
#[derive(Clone)]
pub struct AgentOptions {
    /// The master's control address, `HOST:PORT` (a name or an IP).
    pub master: String,
    /// The job's shared secret (never sent over the network; the master checks it by
    /// challenge-response).
    pub token: String,
    /// The job this agent is of, where its launcher names one (a Slurm job id): a master of
    /// another named job that shares the token refuses it, saying so.
    pub job: Option<String>,
    /// The IP this node's workers bind their data-plane ports on. `None`: the address this
    /// machine reaches the master from.
    pub host: Option<String>,
    /// Exit (stopping the workers) when stdin closes: for agents started by the job's own
    /// process or over ssh, so none outlives its parent.
    pub exit_with_parent: bool,
    /// How long to keep retrying while the master cannot be reached (it may start later).
    pub wait: Duration,
    /// After the master is lost, how long to look for one (keeping the workers) before
    /// stopping the workers and exiting. Never zero.
    pub master_wait: Duration,
    /// A file that appears, or an `http://` endpoint, that says this machine will be taken
    /// away (`notice.rs`): the node then drains, as at SIGTERM.
    pub preemption_notice: Option<String>,
    /// How often the notice is looked at.
    pub notice_interval: Duration,
    /// After asking to leave, how long to wait for the master to release the node at a step
    /// boundary before leaving anyway.
    pub drain_wait: Duration,
}

impl AgentOptions {
    /// Options with the defaults for everything but where the master is and its token.
    pub fn new(master: String, token: String) -> AgentOptions {
        AgentOptions {
            master,
            token,
            job: None,
            host: None,
            exit_with_parent: false,
            wait: Duration::from_secs(120),
            master_wait: DEFAULT_MASTER_WAIT,
            preemption_notice: None,
            notice_interval: Duration::from_secs(5),
            drain_wait: Duration::from_secs(60),
        }
    }
}

impl std::fmt::Debug for AgentOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentOptions")
            .field("master", &self.master)
            .field("token", &"<redacted>")
            .field("job", &self.job)
            .field("host", &self.host)
            .field("exit_with_parent", &self.exit_with_parent)
            .field("wait", &self.wait)
            .field("master_wait", &self.master_wait)
            .field("preemption_notice", &self.preemption_notice)
            .field("notice_interval", &self.notice_interval)
            .field("drain_wait", &self.drain_wait)
            .finish()
    }
}
