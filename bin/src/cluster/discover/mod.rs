//! Where this machine is in a multi-machine job, read from its environment when the flags do
//! not say: one code path for every scheduler, each recorded environment a unit test.
//!
//! The order, first match wins (flags are the caller's and come before all of it):
//!
//! | source | this node's index | nodes | node 0's host (the master) | devices | the job |
//! |---|---|---|---|---|---|
//! | `OOBLECK_MASTER` | `OOBLECK_NODE_INDEX` | `OOBLECK_NUM_NODES` | its `HOST` | - | - |
//! | Slurm (`SLURM_JOB_ID` and `SLURM_STEP_ID`: a task `srun` started) | `SLURM_PROCID` | `SLURM_STEP_NUM_TASKS`, `SLURM_NTASKS` | first of `SLURM_STEP_NODELIST`, `SLURM_JOB_NODELIST`; its `NodeAddr` where `scontrol show node` says | `SLURM_GPUS_ON_NODE` | `SLURM_JOB_ID` |
//! | LeaderWorkerSet (`LWS_LEADER_ADDRESS`) | `LWS_WORKER_INDEX` | `LWS_GROUP_SIZE` | `LWS_LEADER_ADDRESS` | - | `LWS_LEADER_ADDRESS` |
//! | JobSet (`JOBSET_NAME`) | `JOB_COMPLETION_INDEX` | `OOBLECK_NUM_NODES` | `<jobset>-<replicated job>-0-0.<jobset>` | - | `JOBSET_NAME` |
//! | SkyPilot (`SKYPILOT_NODE_RANK`) | `SKYPILOT_NODE_RANK` | `SKYPILOT_NUM_NODES` | first of `SKYPILOT_NODE_IPS` | `SKYPILOT_NUM_GPUS_PER_NODE` | `SKYPILOT_TASK_ID` |
//!
//! `OOBLECK_JOB` names the job over any of these. A master refuses, with an error naming both
//! jobs, an agent of another named job that proves the same token (two jobs a user started
//! with one `OOBLECK_TOKEN` whose masters share an address).
//!
//! The master listens on `OOBLECK_MASTER_PORT` ([`DEFAULT_MASTER_PORT`] unless set) of node 0.
//! Node 0 runs the master and its own agent; every node runs one agent.
//!
//! A Slurm "node" of the job is a task: with one task per node (`--ntasks-per-node=1`, the
//! recipe's) they are the same; several tasks on one machine each play a node (how a test
//! runs a multi-node job on one host). Task 0 runs on the first host of the node list, as
//! Slurm's block and cyclic distributions both place it.
//!
//! Failures are loud and name what to fix, before anything starts ([`check`]): a multi-node
//! job whose master host resolves to a loopback address (each node would rendezvous with
//! itself and the job hang at start: pith-train #91, pytorch #73656), a node count that
//! disagrees with `--expect-nodes`, an index outside the allocation, a missing or malformed
//! variable, two schedulers that name different masters.

mod hostlist;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::net::IpAddr;

/// [`Placement::node_index`] of an `OOBLECK_MASTER` without `OOBLECK_NODE_INDEX`: enough for an
/// agent (`train agent`), not for `train`, which must know whether it is node 0.
pub const UNKNOWN_INDEX: usize = usize::MAX;

/// The master's port when `OOBLECK_MASTER_PORT` is not set.
pub const DEFAULT_MASTER_PORT: u16 = 29_400;

/// Which environment said where this node is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Oobleck,
    Slurm,
    LeaderWorkerSet,
    JobSet,
    SkyPilot,
}

impl Source {
    pub fn name(self) -> &'static str {
        match self {
            Source::Oobleck => "OOBLECK_* variables",
            Source::Slurm => "Slurm",
            Source::LeaderWorkerSet => "LeaderWorkerSet",
            Source::JobSet => "JobSet",
            Source::SkyPilot => "SkyPilot",
        }
    }
}

/// This machine's place in its job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub source: Source,
    /// This node's index in the allocation; 0 runs the master.
    pub node_index: usize,
    /// Nodes of the allocation, when the environment says (a JobSet does not).
    pub num_nodes: Option<usize>,
    /// Distinct hosts of the allocation, where the environment lists them (Slurm's node
    /// list, SkyPilot's IPs); pods of a LeaderWorkerSet or JobSet are one host each.
    pub hosts: Option<usize>,
    /// Node 0's host name or IP, and the variable it came from (for errors).
    pub master_host: String,
    pub master_from: &'static str,
    pub master_port: u16,
    /// Devices of this node, when the environment says.
    pub devices_per_node: Option<usize>,
    /// The job's name, where the environment gives one (`OOBLECK_JOB` over the scheduler's:
    /// Slurm's job id, the LeaderWorkerSet group's leader, the JobSet, SkyPilot's task id):
    /// a master refuses agents of another named job that share its token.
    pub job: Option<String>,
}

impl Placement {
    /// `HOST:PORT` of the master (IPv6 hosts bracketed).
    pub fn master_addr(&self) -> String {
        match self.master_host.parse::<IpAddr>() {
            Ok(IpAddr::V6(ip)) => format!("[{ip}]:{}", self.master_port),
            _ => format!("{}:{}", self.master_host, self.master_port),
        }
    }

    /// Whether this node runs the master.
    pub fn is_master_node(&self) -> bool {
        self.node_index == 0
    }
}

/// A snapshot of the variables discovery reads, taken in one place ([`Env::of_process`]) so
/// that the rules are pure code on values (tests pass recorded environments).
#[derive(Debug, Clone, Default)]
pub struct Env {
    vars: BTreeMap<String, String>,
    /// `scontrol show hostnames LIST`, for expressions the parser refuses (none in tests).
    scontrol: Option<ExpandFn>,
    /// A Slurm node's `NodeAddr` (`scontrol show node NAME`), `None` in recorded environments
    /// unless a test gives one.
    node_addr: Option<NodeAddrFn>,
}

/// Expands a hostlist the way Slurm does, `None` when it cannot.
type ExpandFn = fn(&str) -> Option<Vec<String>>;

/// The address Slurm reaches a node at, `None` when it cannot say.
type NodeAddrFn = fn(&str) -> Option<String>;

impl Env {
    pub fn of_process() -> Self {
        Self {
            vars: std::env::vars().collect(),
            scontrol: Some(scontrol_hostnames),
            node_addr: Some(scontrol_node_addr),
        }
    }

    pub fn from_pairs<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a str)>) -> Self {
        let vars = pairs
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Self {
            vars,
            scontrol: None,
            node_addr: None,
        }
    }

    /// This recorded environment, with Slurm answering `NodeAddr`s as `node_addr` does.
    pub fn with_node_addr(mut self, node_addr: NodeAddrFn) -> Self {
        self.node_addr = Some(node_addr);
        self
    }

    /// The variable `name`, trimmed; `None` when unset or blank.
    pub(crate) fn get(&self, name: &str) -> Option<&str> {
        self.vars
            .get(name)
            .map(|v| v.trim())
            .filter(|v| !v.is_empty())
    }

    fn required(&self, name: &'static str, of: Source) -> Result<&str, String> {
        self.get(name).ok_or_else(|| {
            format!(
                "{} is set up but {name} is not: is this a task of the job?",
                of.name()
            )
        })
    }

    fn number(&self, name: &'static str) -> Result<Option<usize>, String> {
        self.get(name)
            .map(|v| {
                v.parse()
                    .map_err(|_| format!("{name}={v:?} is not a whole number"))
            })
            .transpose()
    }
}

/// Where this node is, from the first source of the table in the module docs that is set;
/// `None` when none is. Errors name the variable to fix.
pub fn discover(env: &Env) -> Result<Option<Placement>, String> {
    let port = match env.get("OOBLECK_MASTER_PORT") {
        None => DEFAULT_MASTER_PORT,
        Some(p) => p
            .parse()
            .map_err(|_| format!("OOBLECK_MASTER_PORT={p:?} is not a port (1 to 65535)"))?,
    };
    let named = |mut p: Placement| {
        if let Some(job) = env.get("OOBLECK_JOB") {
            p.job = Some(job.to_string()); // the user's name for the job over the scheduler's
        }
        p
    };
    // OOBLECK_MASTER is the user's choice over any scheduler's.
    if let Some(p) = oobleck(env)? {
        check_index(&p)?;
        return Ok(Some(named(p)));
    }
    let readers: [Reader; 4] = [slurm, leader_worker_set, jobset, skypilot];
    let mut found: Vec<Placement> = Vec::new();
    for read in readers {
        found.extend(read(env, port)?);
    }
    let Some(first) = found.first().cloned() else {
        return Ok(None);
    };
    // Two schedulers (SkyPilot on a Slurm cluster) must agree on the master.
    if let Some(other) = found.iter().find(|p| p.master_host != first.master_host) {
        return Err(format!(
            "two schedulers name different masters: {} says {} ({}), {} says {} ({}); set \
             OOBLECK_MASTER=HOST:PORT to choose",
            first.source.name(),
            first.master_host,
            first.master_from,
            other.source.name(),
            other.master_host,
            other.master_from
        ));
    }
    check_index(&first)?;
    Ok(Some(named(first)))
}

type Reader = fn(&Env, u16) -> Result<Option<Placement>, String>;

fn oobleck(env: &Env) -> Result<Option<Placement>, String> {
    let Some(master) = env.get("OOBLECK_MASTER") else {
        return Ok(None);
    };
    let (host, port) = master
        .rsplit_once(':')
        .ok_or(format!("OOBLECK_MASTER={master:?} is not HOST:PORT"))?;
    let port = port
        .parse()
        .map_err(|_| format!("OOBLECK_MASTER={master:?}: {port:?} is not a port"))?;
    Ok(Some(Placement {
        source: Source::Oobleck,
        node_index: env.number("OOBLECK_NODE_INDEX")?.unwrap_or(UNKNOWN_INDEX),
        num_nodes: env.number("OOBLECK_NUM_NODES")?,
        // The user named the master: trusted, loopback included (one machine's test jobs).
        hosts: Some(1),
        master_host: host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_string(),
        master_from: "OOBLECK_MASTER",
        master_port: port,
        devices_per_node: None,
        job: None,
    }))
}

fn slurm(env: &Env, port: u16) -> Result<Option<Placement>, String> {
    if env.get("SLURM_JOB_ID").is_none() || env.get("SLURM_STEP_ID").is_none() {
        return Ok(None); // not a task of a job step: the batch script itself, or no Slurm
    }
    let (list_var, list) = match env.get("SLURM_STEP_NODELIST") {
        Some(l) => ("SLURM_STEP_NODELIST", l),
        None => (
            "SLURM_JOB_NODELIST",
            env.required("SLURM_JOB_NODELIST", Source::Slurm)?,
        ),
    };
    let hosts = match (hostlist::expand(list), env.scontrol) {
        (Ok(hosts), _) => hosts,
        (Err(e), Some(scontrol)) => scontrol(list).ok_or(format!(
            "{list_var}={list:?}: {e}; `scontrol show hostnames` did not help"
        ))?,
        (Err(e), None) => return Err(format!("{list_var}={list:?}: {e}")),
    };
    let index = env.required("SLURM_PROCID", Source::Slurm)?;
    let node_index = index
        .parse()
        .map_err(|_| format!("SLURM_PROCID={index:?} is not a whole number"))?;
    let tasks = match env.number("SLURM_STEP_NUM_TASKS")? {
        Some(n) => n,
        None => env
            .number("SLURM_NTASKS")?
            .ok_or("Slurm is set up but neither SLURM_STEP_NUM_TASKS nor SLURM_NTASKS is")?,
    };
    if let Some(n) = env
        .number("SLURM_STEP_NUM_NODES")?
        .filter(|&n| n != hosts.len())
    {
        return Err(format!(
            "SLURM_STEP_NUM_NODES={n} but {list_var}={list:?} lists {} hosts",
            hosts.len()
        ));
    }
    // Slurm reaches a node at its NodeAddr, which need not be its name (nodes named for a
    // rack, or several slurmd of one host): so do the agents.
    let (master_host, master_from) = match env.node_addr.and_then(|f| f(&hosts[0])) {
        Some(addr) if addr != hosts[0] => (addr, node_addr_of(list_var)),
        _ => (hosts[0].clone(), list_var),
    };
    Ok(Some(Placement {
        source: Source::Slurm,
        node_index,
        num_nodes: Some(tasks),
        hosts: Some(hosts.len()),
        master_host,
        master_from,
        master_port: port,
        devices_per_node: env.number("SLURM_GPUS_ON_NODE")?,
        job: env.get("SLURM_JOB_ID").map(String::from),
    }))
}

/// Where a master host taken from a node's `NodeAddr` came from, for errors.
fn node_addr_of(list_var: &str) -> &'static str {
    match list_var {
        "SLURM_STEP_NODELIST" => "the NodeAddr of SLURM_STEP_NODELIST's first node",
        _ => "the NodeAddr of SLURM_JOB_NODELIST's first node",
    }
}

fn leader_worker_set(env: &Env, port: u16) -> Result<Option<Placement>, String> {
    let Some(leader) = env.get("LWS_LEADER_ADDRESS") else {
        return Ok(None);
    };
    let index = env.required("LWS_WORKER_INDEX", Source::LeaderWorkerSet)?;
    Ok(Some(Placement {
        source: Source::LeaderWorkerSet,
        node_index: index
            .parse()
            .map_err(|_| format!("LWS_WORKER_INDEX={index:?} is not a whole number"))?,
        num_nodes: env.number("LWS_GROUP_SIZE")?,
        hosts: None,
        master_host: leader.to_string(),
        master_from: "LWS_LEADER_ADDRESS",
        master_port: port,
        devices_per_node: None,
        // A group's leader address names the group (`<lws>-<group>.<lws>.<namespace>`).
        job: Some(leader.to_string()),
    }))
}

fn jobset(env: &Env, port: u16) -> Result<Option<Placement>, String> {
    let Some(name) = env.get("JOBSET_NAME") else {
        return Ok(None);
    };
    let job = env.required("REPLICATED_JOB_NAME", Source::JobSet)?;
    let index = env.required("JOB_COMPLETION_INDEX", Source::JobSet)?;
    Ok(Some(Placement {
        source: Source::JobSet,
        node_index: index
            .parse()
            .map_err(|_| format!("JOB_COMPLETION_INDEX={index:?} is not a whole number"))?,
        num_nodes: env.number("OOBLECK_NUM_NODES")?,
        hosts: None,
        // JobSet's stable DNS names: pod <jobset>-<job>-<job index>-<pod index> in the
        // headless service named after the JobSet (`network.enableDNSHostnames`).
        master_host: format!("{name}-{job}-0-0.{name}"),
        master_from: "JOBSET_NAME",
        master_port: port,
        devices_per_node: None,
        job: Some(name.to_string()),
    }))
}

fn skypilot(env: &Env, port: u16) -> Result<Option<Placement>, String> {
    let Some(rank) = env.get("SKYPILOT_NODE_RANK") else {
        return Ok(None);
    };
    let ips = env.required("SKYPILOT_NODE_IPS", Source::SkyPilot)?;
    let ips: Vec<&str> = ips.split_whitespace().collect();
    let said = env.number("SKYPILOT_NUM_NODES")?;
    if let Some(n) = said.filter(|&n| n != ips.len()) {
        return Err(format!(
            "SKYPILOT_NUM_NODES={n} but SKYPILOT_NODE_IPS lists {} addresses",
            ips.len()
        ));
    }
    Ok(Some(Placement {
        source: Source::SkyPilot,
        node_index: rank
            .parse()
            .map_err(|_| format!("SKYPILOT_NODE_RANK={rank:?} is not a whole number"))?,
        num_nodes: Some(ips.len()),
        hosts: Some(ips.iter().collect::<std::collections::BTreeSet<_>>().len()),
        master_host: ips[0].to_string(),
        master_from: "SKYPILOT_NODE_IPS",
        master_port: port,
        devices_per_node: env.number("SKYPILOT_NUM_GPUS_PER_NODE")?,
        job: env.get("SKYPILOT_TASK_ID").map(String::from),
    }))
}

/// The node's index must be inside the allocation.
fn check_index(p: &Placement) -> Result<(), String> {
    if p.node_index == UNKNOWN_INDEX {
        return Ok(()); // an agent told only where its master is; `train` asks for the index
    }
    match p.num_nodes {
        Some(n) if p.node_index >= n => Err(format!(
            "{}: this node's index {} is outside the job's {n} nodes",
            p.source.name(),
            p.node_index
        )),
        _ => Ok(()),
    }
}

/// The checks that need the caller's flags and the resolver (DNS is I/O, so it is passed in):
/// the node count against `--expect-nodes`, and a master host that resolves to a loopback
/// address in an allocation of several hosts (an `OOBLECK_MASTER` the user set is trusted).
pub fn check(
    p: &Placement,
    expect_nodes: Option<usize>,
    resolve: impl Fn(&str) -> std::io::Result<Vec<IpAddr>>,
) -> Result<(), String> {
    if let (Some(n), Some(expected)) = (p.num_nodes, expect_nodes) {
        if n != expected {
            return Err(format!(
                "--expect-nodes {expected} but {} gives this job {n} nodes; drop --expect-nodes \
                 or fix the allocation",
                p.source.name()
            ));
        }
    }
    let nodes = p.num_nodes.or(expect_nodes).unwrap_or(2);
    if p.hosts.unwrap_or(nodes) < 2 {
        return Ok(()); // one machine: the master is on it, loopback included
    }
    let ips = resolve(&p.master_host).map_err(|e| {
        format!(
            "the master's host {} ({}) does not resolve: {e}",
            p.master_host, p.master_from
        )
    })?;
    if let Some(ip) = ips.iter().find(|ip| ip.is_loopback()) {
        if p.master_host.parse::<IpAddr>().is_ok() {
            return Err(format!(
                "the master's address {ip} ({}) is a loopback address: each of the {nodes} nodes \
                 would wait for a master on itself. Give node 0 an address the other nodes \
                 reach there (Slurm: NodeAddr in slurm.conf), or set OOBLECK_MASTER=IP:PORT",
                p.master_from
            ));
        }
        return Err(format!(
            "the master's host {} ({}) resolves to {ip}, a loopback address: each of the {nodes} \
             nodes would wait for a master on itself. Make {} resolve to an address the other \
             nodes reach (often a 127.0.1.1 line in /etc/hosts), or set OOBLECK_MASTER=IP:PORT",
            p.master_host, p.master_from, p.master_host
        ));
    }
    Ok(())
}

/// The addresses `host` resolves to (for [`check`]'s loopback rule).
pub fn lookup(host: &str) -> std::io::Result<Vec<IpAddr>> {
    use std::net::ToSocketAddrs;
    Ok((host, 0).to_socket_addrs()?.map(|a| a.ip()).collect())
}

/// Where an agent given no `--master` finds its master (`master_addr`) and which job it is
/// of: from the environment, checked.
pub fn master_from_env(env: &Env) -> Result<Placement, String> {
    let p = discover(env)?.ok_or(
        "no --master, and nothing in the environment says where the master is: pass --master \
         HOST:PORT or set OOBLECK_MASTER=HOST:PORT, or run it as a task of a Slurm step, a \
         LeaderWorkerSet or JobSet pod, or a SkyPilot task",
    )?;
    check(&p, None, lookup)?;
    Ok(p)
}

/// `scontrol show hostnames LIST`, if Slurm's tools are installed and answer within 10 s.
fn scontrol_hostnames(list: &str) -> Option<Vec<String>> {
    let text = scontrol(&["show", "hostnames", list])?;
    let hosts: Vec<String> = text.split_whitespace().map(str::to_string).collect();
    (!hosts.is_empty()).then_some(hosts)
}

/// `NodeAddr` of `scontrol show node NAME`, if Slurm answers within 10 s.
fn scontrol_node_addr(node: &str) -> Option<String> {
    node_addr_in(&scontrol(&["show", "node", node, "--oneliner"])?)
}

/// The `NodeAddr=` field of `scontrol show node` output.
fn node_addr_in(text: &str) -> Option<String> {
    text.split_whitespace()
        .find_map(|f| f.strip_prefix("NodeAddr="))
        .filter(|a| !a.is_empty() && *a != "(null)")
        .map(String::from)
}

/// The output of `scontrol ARGS`, if it is installed, answers within 10 s and succeeds.
fn scontrol(args: &[&str]) -> Option<String> {
    use std::io::Read;
    let mut child = std::process::Command::new("scontrol")
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .ok()?;
    let mut stdout = child.stdout.take()?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut text = String::new();
        let _ = tx.send(stdout.read_to_string(&mut text).map(|_| text));
    });
    let text = rx.recv_timeout(std::time::Duration::from_secs(10));
    if text.is_err() {
        let _ = child.kill(); // no answer in time: not one we can use
    }
    let status = child.wait().ok()?;
    let text = text.ok()?.ok()?;
    status.success().then_some(text)
}
