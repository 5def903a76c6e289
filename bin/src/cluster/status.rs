//! `oobleck status`: the master's view of a running job (nodes, pipelines, generation,
//! committed step, throughput). With `--run DIR` of a job that serves its status page, it is
//! read from the page's `/api/status` (with the job's token); otherwise, and for `--master`,
//! the master is asked over the authenticated control protocol.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use oobleck_core::runtime::wire::client::{request_kill, request_status, request_stop};
use oobleck_core::runtime::wire::protocol::ClusterStatus;
use oobleck_core::runtime::wire::Token;

/// File in the run directory naming the master's control address (written by `train`).
pub const MASTER_FILE: &str = "master.json";
/// File in the run directory holding a local job's token (mode 0600, removed at the end).
pub const TOKEN_FILE: &str = "master.token";

/// Show the state of a running job.
#[derive(Debug, Clone, clap::Args)]
pub struct StatusArgs {
    /// The master's control address, HOST:PORT.
    #[arg(long, conflicts_with = "run")]
    pub master: Option<String>,
    /// The job's shared secret (with --master).
    #[arg(long, env = "OOBLECK_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// A local job's run directory: address and token are read from it.
    #[arg(long)]
    pub run: Option<PathBuf>,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// Seconds to wait for the master.
    #[arg(long, default_value_t = 5)]
    pub timeout: u64,
}

/// `oobleck status`: the job's state, or where its master is.
#[derive(Debug, Clone, clap::Args)]
pub struct StatusCmd {
    #[command(flatten)]
    pub target: StatusArgs,
    /// Print only the HOST:PORT of the master that answered (with --run, a standby that took
    /// over answers for a master that is gone): where an agent of another allocation joins.
    #[arg(long, conflicts_with = "json")]
    pub leader: bool,
}

/// Kill one node of a running job, as a crash would (SIGKILL of its agent and workers): for
/// demos and fault drills. With `--fault-threshold` >= 1 the job recovers on the nodes left.
#[derive(Debug, Clone, clap::Args)]
pub struct KillNodeArgs {
    /// The node id (`oobleck status` lists them).
    pub node: u32,
    #[command(flatten)]
    pub target: StatusArgs,
}

/// Stop a running job after its next step, with that step's checkpoint, as SIGTERM to its
/// master does, from any machine (a scheduler's notice: `deploy/slurm/train.sbatch` at USR1).
#[derive(Debug, Clone, clap::Args)]
pub struct StopArgs {
    /// Who asks, for the job's events and output.
    #[arg(long, default_value = "oobleck stop")]
    pub reason: String,
    #[command(flatten)]
    pub target: StatusArgs,
}

/// Writes the files `oobleck status --run` reads; the token file is readable by its owner only.
/// `status_url`: the live status page's address, when it is served.
pub fn publish(
    run: &Path,
    addr: SocketAddr,
    token: &Token,
    status_url: Option<&str>,
) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut files = serde_json::json!({ "addr": addr.to_string() });
    if let Some(u) = status_url {
        files["status_url"] = u.into();
    }
    std::fs::write(run.join(MASTER_FILE), serde_json::to_string(&files)?)
        .with_context(|| format!("writing {}", run.join(MASTER_FILE).display()))?;
    let path = run.join(TOKEN_FILE);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&path)
        .with_context(|| format!("creating {}", path.display()))?;
    f.write_all(token.expose().as_bytes())
        .with_context(|| format!("writing {}", path.display()))
}

/// Removes the token file at the end of a job.
pub fn unpublish(run: &Path) {
    let _ = std::fs::remove_file(run.join(TOKEN_FILE));
}

pub(super) fn target(a: &StatusArgs) -> Result<(SocketAddr, Token)> {
    if let Some(run) = &a.run {
        let text = std::fs::read_to_string(run.join(MASTER_FILE)).with_context(|| {
            format!(
                "{} has no {MASTER_FILE}: is it the run directory of a cluster job?",
                run.display()
            )
        })?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("parsing {}", run.join(MASTER_FILE).display()))?;
        let addr: SocketAddr = v["addr"]
            .as_str()
            .context("master.json has no addr")?
            .parse()
            .context("master.json: addr is not host:port")?;
        let secret = match &a.token {
            Some(t) => t.clone(),
            None => std::fs::read_to_string(run.join(TOKEN_FILE)).with_context(|| {
                format!(
                    "{} has no {TOKEN_FILE} (the job has ended?); pass --token",
                    run.display()
                )
            })?,
        };
        return Ok((addr, Token::new(secret.trim())?));
    }
    let Some(addr) = &a.master else {
        bail!("pass --master HOST:PORT (with --token or OOBLECK_TOKEN) or --run DIR");
    };
    let Some(secret) = &a.token else {
        bail!("--master needs the job's token: --token or OOBLECK_TOKEN");
    };
    Ok((super::resolve(addr)?, Token::new(secret)?))
}

/// Renders a status as text.
pub fn render(s: &ClusterStatus) -> String {
    let mut out = format!(
        "nodes {}/{} | generation {} | committed step {} | {:.1} samples/s\n",
        s.nodes.len(),
        s.expected_nodes,
        s.generation,
        s.committed_step
            .map(|c| c.to_string())
            .unwrap_or_else(|| "-".into()),
        s.samples_per_s
    );
    if s.epoch > 0 {
        out.push_str(&render_masters(s));
    }
    out.push_str(&render_plan(s));
    for n in &s.nodes {
        let role = if s.joining.contains(&n.node) {
            " | joining: admitted at a step boundary".to_string()
        } else if let Some((_, why)) = s.draining.iter().find(|d| d.0 == n.node) {
            format!(" | draining ({why}): leaves at the next step boundary")
        } else if s.spare.contains(&n.node) {
            " | spare: no template combination uses it".to_string()
        } else {
            String::new()
        };
        out.push_str(&format!(
            "node {} at {}: {} devices, last seen {} ms ago{role}\n",
            n.node, n.addr, n.devices, n.last_seen_ms
        ));
    }
    out.push_str(&render_ranks(s));
    out
}

/// The answering master's epoch and its standbys:
/// `master epoch 2 | standby masters at 10.0.0.2:7001` (or `| no standby master`).
pub fn render_masters(s: &ClusterStatus) -> String {
    let standbys = match s.standbys.as_slice() {
        [] => "no standby master".to_string(),
        list => format!("standby masters at {}", list.join(", ")),
    };
    format!("master epoch {} | {standbys}\n", s.epoch)
}

/// Each rank's times of the last committed step, one line each, stragglers marked:
/// `rank 1 on node 1: compute 310.2 ms | p2p 4.1 ms | collective 12.0 ms | step 402.3 ms`.
pub fn render_ranks(s: &ClusterStatus) -> String {
    if s.ranks.is_empty() {
        return String::new();
    }
    let step = s
        .committed_step
        .map_or_else(|| "-".into(), |c| c.to_string());
    let mut out = format!("ranks in step {step}:\n");
    for r in &s.ranks {
        let t = &r.times;
        out.push_str(&format!(
            "rank {} on node {}: compute {:.1} ms | p2p {:.1} ms | collective {:.1} ms | step \
             {:.1} ms{}\n",
            r.rank,
            r.node,
            t.compute_ms,
            t.p2p_ms,
            t.collective_ms,
            t.step_ms,
            if r.straggler {
                " | STRAGGLER: slower than its peers for the same work, step after step"
            } else {
                ""
            }
        ));
    }
    out
}

/// The pipelines of a status, one line each: template, microbatch share and stage layout,
/// e.g. `pipeline 0: 2-node template, 8 of 16 microbatches | layers 0-3 on node 0 | layers
/// 3-6 on node 1 (2 devices)`.
pub fn render_plan(s: &ClusterStatus) -> String {
    let total: u32 = s.pipelines.iter().map(|p| p.microbatches).sum();
    let mut out = String::new();
    for p in &s.pipelines {
        out.push_str(&format!(
            "pipeline {}: {}-node template, {} of {total} microbatches",
            p.id, p.template_nodes, p.microbatches
        ));
        for st in &p.stages {
            out.push_str(&format!(
                " | layers {}-{} on node {}",
                st.layers.0, st.layers.1, st.node
            ));
            if st.devices > 1 {
                out.push_str(&format!(" ({} devices)", st.devices));
            }
        }
        out.push('\n');
    }
    out
}

/// The status page's address a run directory names (`None`: none, or not `--run`).
fn page_url(a: &StatusArgs) -> Option<String> {
    let run = a.run.as_ref()?;
    let text = std::fs::read_to_string(run.join(MASTER_FILE)).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    v["status_url"].as_str().map(str::to_string)
}

/// The status through the job's status page: its `/api/status`, whose `cluster` is what the
/// master answers over the control plane.
fn status_from_page(url: &str, a: &StatusArgs) -> Result<ClusterStatus> {
    use crate::status_page::client::{fetch, page_addr};
    let (_, token) = target(a)?;
    let addr = page_addr(url)?;
    let timeout = Duration::from_secs(a.timeout.max(1));
    let (code, body) = fetch(
        addr,
        hyper::Method::GET,
        "/api/status",
        Some(token.expose()),
        timeout,
    )?;
    if code != 200 {
        bail!("the status page at {url} answered {code}: {body}");
    }
    let v: serde_json::Value =
        serde_json::from_str(&body).with_context(|| format!("{url}api/status: not JSON"))?;
    if v["cluster"].is_null() {
        bail!(
            "the status page at {url} has no answer from the master yet{}",
            v["error"]
                .as_str()
                .map(|e| format!(": {e}"))
                .unwrap_or_default()
        );
    }
    serde_json::from_value(v["cluster"].clone())
        .with_context(|| format!("{url}api/status: `cluster` is not a status"))
}

/// How often `oobleck status` asks the page again when the master has not answered it yet,
/// and the pause between: the master refuses a newcomer only while every handshake slot is
/// younger than 250 ms (a storm of strangers), so a second try a moment later gets through.
const PAGE_TRIES: usize = 5;
const PAGE_PAUSE: Duration = Duration::from_millis(300);

/// [`status_from_page`], asked again (up to [`PAGE_TRIES`] times) while the page has no answer
/// from the master yet.
fn status_from_page_retrying(url: &str, a: &StatusArgs) -> Result<ClusterStatus> {
    let mut tries = 1;
    loop {
        match status_from_page(url, a) {
            Err(e)
                if tries < PAGE_TRIES
                    && e.to_string().contains("no answer from the master yet") =>
            {
                tries += 1;
                std::thread::sleep(PAGE_PAUSE);
            }
            other => return other,
        }
    }
}

pub fn run(cmd: &StatusCmd) -> Result<()> {
    let a = &cmd.target;
    let control = || {
        ask_at(a, "for its status", |addr, token, t| async move {
            request_status(addr, &token, t).await
        })
    };
    if cmd.leader {
        println!("{}", control()?.0);
        return Ok(());
    }
    let control = || control().map(|(_, status)| status);
    let status = match page_url(a) {
        // The page is the master's: once a standby took over, the standby answers.
        Some(url) => match status_from_page_retrying(&url, a) {
            Ok(s) => s,
            Err(e) if !standbys(a).is_empty() => control().map_err(|c| e.context(c))?,
            Err(e) => return Err(e),
        },
        None => control()?,
    };
    show(a, &status, None)
}

pub fn kill_node(a: &KillNodeArgs) -> Result<()> {
    let node = a.node;
    let status = ask(
        &a.target,
        &format!("to kill node {node}"),
        |addr, token, t| async move { request_kill(addr, &token, node, t).await },
    )?;
    let head = format!("node {node} is being killed; the job before it:");
    show(&a.target, &status, Some(&head))
}

pub fn stop(a: &StopArgs) -> Result<()> {
    let reason = a.reason.clone();
    let (addr, status) = ask_at(&a.target, "to stop", |addr, token, t| {
        let reason = reason.clone();
        async move { request_stop(addr, &token, &reason, t).await }
    })?;
    let head = format!(
        "the master at {addr} stops the job after its next step (step {}), with that step's \
         checkpoint; the job before it:",
        status.committed_step.unwrap_or(0) + 1
    );
    show(&a.target, &status, Some(&head))
}

/// One request to the master `a` names, within its `--timeout`. With `--run`, a master that
/// cannot be reached is followed by the standbys the run names (`standbys.json`), in order: one
/// of them answers once it took over, and the person is told.
pub(super) fn ask<F, Fut>(a: &StatusArgs, what: &str, request: F) -> Result<ClusterStatus>
where
    F: Fn(SocketAddr, Token, Duration) -> Fut,
    Fut: std::future::Future<Output = oobleck_core::runtime::wire::WireResult<ClusterStatus>>,
{
    Ok(ask_at(a, what, request)?.1)
}

/// [`ask`], and the address of the master that answered.
fn ask_at<F, Fut>(a: &StatusArgs, what: &str, request: F) -> Result<(SocketAddr, ClusterStatus)>
where
    F: Fn(SocketAddr, Token, Duration) -> Fut,
    Fut: std::future::Future<Output = oobleck_core::runtime::wire::WireResult<ClusterStatus>>,
{
    let (addr, token) = target(a)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting a runtime")?;
    let timeout = Duration::from_secs(a.timeout.max(1));
    let unreachable = match rt.block_on(request(addr, token.clone(), timeout)) {
        Ok(status) => return Ok((addr, status)),
        Err(e) if is_unreachable(&e) => e,
        Err(e) => return Err(e).with_context(|| format!("asking the master at {addr} {what}")),
    };
    for standby in standbys(a) {
        match rt.block_on(request(standby, token.clone(), timeout)) {
            Ok(status) => {
                eprintln!(
                    "the master at {addr} does not answer ({unreachable}); the standby at \
                     {standby} took over (epoch {})",
                    status.epoch
                );
                return Ok((standby, status));
            }
            Err(e) if is_unreachable(&e) => continue,
            Err(e) => return Err(e).with_context(|| format!("asking {standby} {what}")),
        }
    }
    Err(unreachable).with_context(|| format!("asking the master at {addr} {what}"))
}

/// Nothing answers at the address (no listener, no route, silence): another may.
fn is_unreachable(e: &oobleck_core::runtime::wire::WireError) -> bool {
    use oobleck_core::runtime::wire::WireError;
    matches!(e, WireError::Io { .. } | WireError::Timeout { .. })
}

/// Where the standbys of the run `a` names take over (`standbys.json`, written by its master
/// as they come and go); none without `--run`.
fn standbys(a: &StatusArgs) -> Vec<SocketAddr> {
    use oobleck_core::runtime::master::STANDBYS_FILE;
    let Some(run) = &a.run else {
        return Vec::new();
    };
    let Ok(text) = std::fs::read_to_string(run.join(STANDBYS_FILE)) else {
        return Vec::new();
    };
    let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
    v["standbys"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s.as_str()?.parse().ok())
        .collect()
}

/// The job's active master and its token: the one `a` names, or (with `--run`) the standby
/// that took over once it is gone.
pub(super) fn leader(a: &StatusArgs) -> Result<(SocketAddr, Token)> {
    let (addr, token) = target(a)?;
    if standbys(a).is_empty() {
        return Ok((addr, token));
    }
    let (active, _) = ask_at(a, "where it is", |addr, token, t| async move {
        request_status(addr, &token, t).await
    })?;
    Ok((active, token))
}

/// Prints a status as JSON (`--json`) or text, after `head` in text.
pub(super) fn show(a: &StatusArgs, status: &ClusterStatus, head: Option<&str>) -> Result<()> {
    if a.json {
        println!("{}", serde_json::to_string_pretty(status)?);
    } else {
        if let Some(h) = head {
            println!("{h}");
        }
        print!("{}", render(status));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use oobleck_core::runtime::wire::protocol::NodeStatus;

    #[test]
    fn status_names_joining_draining_and_spare_nodes() {
        let node = |n: u32| NodeStatus {
            node: n,
            addr: format!("127.0.0.1:{}", 5000 + n),
            devices: 1,
            last_seen_ms: 20,
        };
        let s = ClusterStatus {
            nodes: (0..4).map(node).collect(),
            expected_nodes: 3,
            pipelines: Vec::new(),
            generation: 2,
            committed_step: Some(41),
            samples_per_s: 12.0,
            joining: vec![3],
            draining: vec![(1, "SIGTERM".into())],
            spare: vec![2],
            ranks: Vec::new(),
            epoch: 2,
            standbys: vec!["127.0.0.1:7001".into()],
        };
        let text = render(&s);
        assert!(
            text.contains("\nmaster epoch 2 | standby masters at 127.0.0.1:7001\n"),
            "{text}"
        );
        assert!(
            text.starts_with("nodes 4/3 | generation 2 | committed step 41"),
            "{text}"
        );
        assert!(text.contains("node 0 at 127.0.0.1:5000: 1 devices, last seen 20 ms ago\n"));
        assert!(text.contains("node 1 at 127.0.0.1:5001: 1 devices, last seen 20 ms ago | draining (SIGTERM): leaves at the next step boundary\n"), "{text}");
        assert!(
            text.contains("| spare: no template combination uses it"),
            "{text}"
        );
        assert!(text.contains("node 3 at 127.0.0.1:5003: 1 devices, last seen 20 ms ago | joining: admitted at a step boundary"), "{text}");
        assert!(
            !text.contains("ranks in step"),
            "no times, no rank lines: {text}"
        );
    }

    #[test]
    fn status_shows_each_ranks_times_and_marks_stragglers() {
        use oobleck_core::execution::StepTimes;
        use oobleck_core::runtime::wire::protocol::RankStatus;
        let rank = |rank: u32, compute_ms: f64, straggler: bool| RankStatus {
            rank,
            node: rank,
            times: StepTimes {
                compute_ms,
                p2p_ms: 4.0,
                collective_ms: 12.5,
                step_ms: 402.3,
                marks: 40,
                ..Default::default()
            },
            straggler,
        };
        let s = ClusterStatus {
            nodes: Vec::new(),
            expected_nodes: 2,
            pipelines: Vec::new(),
            generation: 0,
            committed_step: Some(9),
            samples_per_s: 1.0,
            joining: Vec::new(),
            draining: Vec::new(),
            spare: Vec::new(),
            ranks: vec![rank(0, 120.0, false), rank(1, 310.2, true)],
            epoch: 0,
            standbys: Vec::new(),
        };
        let text = render(&s);
        assert!(text.contains("ranks in step 9:\nrank 0 on node 0: compute 120.0 ms | p2p 4.0 ms | collective 12.5 ms | step 402.3 ms\n"), "{text}");
        assert!(text.contains("rank 1 on node 1: compute 310.2 ms | p2p 4.0 ms | collective 12.5 ms | step 402.3 ms | STRAGGLER: slower than its peers for the same work, step after step\n"), "{text}");
        // Older masters send no ranks: their status still reads.
        let mut v = serde_json::to_value(&s).expect("json");
        v.as_object_mut().expect("an object").remove("ranks");
        let back: ClusterStatus = serde_json::from_value(v).expect("parses without ranks");
        assert!(back.ranks.is_empty());
    }
}
