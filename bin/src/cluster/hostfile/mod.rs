//! `train --hostfile FILE`: the hosts of a multi-machine job and the ssh commands that start one
//! `oobleck agent` on each (DESIGN.md section 2, "Multi-machine mode").
//!
//! ```text
//! # one node per line; `#` starts a comment (to the end of the line), blank lines are ignored
//! # [user@]host[:sshport]   [data=IP]            [oobleck=/path/to/oobleck]
//! gpu-01                                          # ssh's defaults for user and port
//! alice@gpu-02:2222         data=10.0.0.2         # workers bind the data plane on 10.0.0.2
//! 10.1.0.3                  oobleck=/opt/oobleck/bin/oobleck
//! [fe80::1%eth0]:22                               # IPv6 with a port goes in brackets
//! ```
//!
//! - `data=IP`: the address the node's workers bind for the data plane (`oobleck agent --host`).
//!   Default: the agent decides.
//! - `oobleck=PATH`: the `oobleck` binary on that node. Default: the absolute path of the local
//!   `oobleck` binary, since the machines of a cluster usually share one image.
//! - The same host and ssh port twice is an error (one agent per node), and so are unknown keys,
//!   a key given twice, an empty host, a bad port and a file without hosts.
//!
//! Launch: for each host, `ssh -o BatchMode=yes ... [-p PORT] [user@]host -- 'oobleck' 'agent'
//! '--master' HOST:PORT ['--host' IP] '--master-wait' S '--token-stdin' '--exit-with-parent'`. The
//! job token is the first line written to ssh's stdin, so it is never in any argv nor in the
//! remote shell's command line; ssh's stdin then stays open for as long as the caller holds
//! [`Launched::stdin`], and at EOF (the master closed it, or the connection died) the agent takes
//! its master for lost: it looks for one for `--master-wait` seconds, then exits.
//! `$OOBLECK_SSH` replaces `ssh` (a wrapper, or a fake one in tests).

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::fmt;
use std::net::IpAddr;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use tokio::io::AsyncWriteExt;
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

/// One node of a hostfile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostEntry {
    /// The ssh destination host (name, IPv4, or IPv6 without brackets).
    pub host: String,
    /// The ssh user; `None`: ssh's default (`~/.ssh/config`, then the local user).
    pub user: Option<String>,
    /// The ssh port; `None`: ssh's default.
    pub port: Option<u16>,
    /// `data=`: the data-plane address the node's workers bind; `None`: the agent decides.
    pub data_host: Option<String>,
    /// `oobleck=`: the remote binary; `None`: the local binary's absolute path.
    pub oobleck: Option<String>,
}

impl fmt::Display for HostEntry {
    /// `[user@]host[:port]`, as written in the hostfile.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(u) = &self.user {
            write!(f, "{u}@")?;
        }
        match self.port {
            Some(p) if self.host.contains(':') => write!(f, "[{}]:{p}", self.host),
            Some(p) => write!(f, "{}:{p}", self.host),
            None => write!(f, "{}", self.host),
        }
    }
}

/// Parses a hostfile (format in the module header); `source` only names the file in errors.
pub fn parse_hostfile(text: &str, source: &Path) -> Result<Vec<HostEntry>> {
    let mut entries: Vec<HostEntry> = Vec::new();
    // (lowercased host, ssh port) -> line of its first appearance
    let mut seen: HashMap<(String, u16), usize> = HashMap::new();
    for (i, raw) in text.lines().enumerate() {
        let line_no = i + 1;
        let at = || format!("{}:{line_no}", source.display());
        let line = raw.split('#').next().unwrap_or_default();
        let mut fields = line.split_whitespace();
        let Some(first) = fields.next() else {
            continue;
        };
        let (user, host, port) = parse_destination(first).with_context(at)?;
        let mut entry = HostEntry {
            host,
            user,
            port,
            data_host: None,
            oobleck: None,
        };
        for field in fields {
            let (key, value) = field.split_once('=').ok_or_else(|| {
                anyhow!(
                    "{}: expected key=value after the host, found {field:?} (keys: data, oobleck)",
                    at()
                )
            })?;
            if value.is_empty() {
                bail!("{}: {key}= needs a value", at());
            }
            let slot = match key {
                "data" => {
                    value
                        .parse::<IpAddr>()
                        .map_err(|_| anyhow!("{}: data={value}: expected an IP address", at()))?;
                    &mut entry.data_host
                }
                "oobleck" => &mut entry.oobleck,
                _ => bail!("{}: unknown key {key:?} (keys: data, oobleck)", at()),
            };
            if slot.is_some() {
                bail!("{}: {key}= given twice", at());
            }
            *slot = Some(value.to_string());
        }
        // `node` and `node:22` are the same sshd unless ~/.ssh/config says otherwise: too rare
        // to be worth a second agent on one node.
        let key = (entry.host.to_ascii_lowercase(), entry.port.unwrap_or(22));
        if let Some(first_line) = seen.insert(key, line_no) {
            bail!(
                "{}: {entry} is already on line {first_line} (one agent per node)",
                at()
            );
        }
        entries.push(entry);
    }
    if entries.is_empty() {
        bail!(
            "{}: no hosts (one `[user@]host[:sshport]` per line)",
            source.display()
        );
    }
    Ok(entries)
}

/// Splits `[user@]host[:port]` (IPv6 with a port as `[addr]:port`).
fn parse_destination(s: &str) -> Result<(Option<String>, String, Option<u16>)> {
    let (user, rest) = match s.split_once('@') {
        Some((u, r)) => {
            if u.is_empty() {
                bail!("{s:?}: empty user before '@'");
            }
            if u.starts_with('-') || u.chars().any(|c| c.is_control() || c == '@') {
                bail!("{s:?}: bad user name {u:?}");
            }
            (Some(u.to_string()), r)
        }
        None => (None, s),
    };
    let (host, port) = if let Some(inner) = rest.strip_prefix('[') {
        let (h, after) = inner
            .split_once(']')
            .ok_or_else(|| anyhow!("{s:?}: '[' without ']'"))?;
        match after {
            "" => (h, None),
            _ => match after.strip_prefix(':') {
                Some(p) => (h, Some(p)),
                None => bail!("{s:?}: expected ':port' after ']'"),
            },
        }
    } else if rest.matches(':').count() == 1 {
        let (h, p) = rest.split_once(':').expect("one ':' was counted");
        (h, Some(p))
    } else {
        // No colon, or a bare IPv6 address (whose port, if any, needs brackets).
        (rest, None)
    };
    if host.is_empty() {
        bail!("{s:?}: empty host");
    }
    // A leading '-' would make ssh read the host as an option.
    if host.starts_with('-')
        || !host
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_' | ':' | '%'))
    {
        bail!("{s:?}: bad host name {host:?}");
    }
    let port = match port {
        None => None,
        Some(p) => match p.parse::<u16>() {
            Ok(n) if n > 0 => Some(n),
            _ => bail!("{s:?}: bad ssh port {p:?} (expected 1-65535)"),
        },
    };
    Ok((user, host.to_string(), port))
}

/// Quotes `s` as one word for a POSIX shell: words made only of safe characters stay as they
/// are, the rest go in single quotes with each `'` written as `'\''`.
pub fn shell_quote(s: &str) -> String {
    let safe = |c: char| c.is_ascii_alphanumeric() || "-_./:=@,+%".contains(c);
    if !s.is_empty() && s.chars().all(safe) {
        return s.to_string();
    }
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// Where the remote agents find their master, and how long they look for it once it is lost
/// (`--master-wait`, which ssh's end counts as).
#[derive(Debug, Clone, Copy)]
pub struct MasterAt<'a> {
    pub addr: &'a str,
    pub wait_s: u64,
}

/// The command line the remote shell runs: the agent, quoted word by word. It carries no secret.
pub fn remote_command(entry: &HostEntry, remote_oobleck: &str, master: MasterAt) -> String {
    let wait = master.wait_s.to_string();
    let mut words = vec![remote_oobleck, "agent", "--master", master.addr];
    if let Some(d) = &entry.data_host {
        words.extend(["--host", d.as_str()]);
    }
    words.extend([
        "--master-wait",
        &wait,
        "--token-stdin",
        "--exit-with-parent",
    ]);
    let quoted: Vec<String> = words.into_iter().map(shell_quote).collect();
    // `exec`: the agent replaces the remote shell, so ssh's stdin is the agent's own.
    format!("exec {}", quoted.join(" "))
}

/// The ssh program: `$OOBLECK_SSH` if set, else `ssh`.
pub fn ssh_program() -> OsString {
    std::env::var_os("OOBLECK_SSH")
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| OsString::from("ssh"))
}

/// The ssh command that starts `entry`'s agent, not yet spawned. stdin is piped (the caller
/// writes the token line and keeps it open); stdout is piped because the agent's report lines
/// travel on it as in local mode (the caller must read it, or the agent blocks once the pipe
/// fills); stderr is inherited so ssh's own errors and the agent's logs reach the terminal.
pub fn ssh_command(
    ssh: &OsStr,
    entry: &HostEntry,
    remote_oobleck: &str,
    master: MasterAt,
) -> Command {
    let mut cmd = Command::new(ssh);
    cmd.args(["-o", "BatchMode=yes", "-o", "ConnectTimeout=10"])
        // A dead link is noticed within about a minute, so ssh exits and the master sees it.
        .args([
            "-o",
            "ServerAliveInterval=15",
            "-o",
            "ServerAliveCountMax=4",
        ])
        // No tty: the agent must see EOF on stdin when the connection goes, not a hangup.
        .arg("-T");
    if let Some(p) = entry.port {
        cmd.arg("-p").arg(p.to_string());
    }
    match &entry.user {
        Some(u) => cmd.arg(format!("{u}@{}", entry.host)),
        None => cmd.arg(&entry.host),
    };
    cmd.arg("--")
        .arg(remote_command(entry, remote_oobleck, master))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true);
    cmd
}

/// The binary agents run: `$OOBLECK_BIN`, else the running `train` itself (`train agent` is
/// the agent, and a local cluster's agents are this process's children).
pub fn agent_binary() -> Result<std::path::PathBuf> {
    match std::env::var_os("OOBLECK_BIN") {
        Some(p) => Ok(std::path::PathBuf::from(p)),
        None => std::env::current_exe().context("locating the running binary"),
    }
}

/// [`agent_binary`] by its absolute path: the remote default for hosts without `oobleck=`.
pub fn local_oobleck() -> Result<String> {
    let path = agent_binary()?;
    let abs = std::path::absolute(&path)
        .with_context(|| format!("making {} absolute", path.display()))?;
    abs.into_os_string().into_string().map_err(|p| {
        anyhow!(
            "the oobleck binary's path {p:?} is not UTF-8; give the remote path with oobleck= in \
             the hostfile"
        )
    })
}

/// One started agent: ssh and its pipes. The remote agent lives as long as `stdin` stays open;
/// dropping this kills ssh (`kill_on_drop`), which closes the connection, and the agent exits.
#[derive(Debug)]
pub struct Launched {
    pub entry: HostEntry,
    pub child: Child,
    /// Held open: the agent exits at EOF.
    pub stdin: ChildStdin,
    /// The agent's stdout through ssh (report lines); read it.
    pub stdout: ChildStdout,
}

/// Starts one agent per entry over ssh (`ssh_program()`), pointing it at `master`
/// (`HOST:PORT`, as the remote nodes reach it), and writes `token` as the first line of each
/// ssh's stdin, each write bounded by `timeout`. On any failure every ssh already started is
/// killed and the error names the host.
pub async fn launch(
    entries: &[HostEntry],
    master: MasterAt<'_>,
    token: &str,
    timeout: Duration,
) -> Result<Vec<Launched>> {
    launch_with(&ssh_program(), entries, master, token, timeout).await
}

async fn launch_with(
    ssh: &OsStr,
    entries: &[HostEntry],
    master: MasterAt<'_>,
    token: &str,
    timeout: Duration,
) -> Result<Vec<Launched>> {
    if token.is_empty() || token.contains(['\n', '\r']) {
        bail!("the job token must be one non-empty line");
    }
    let default_oobleck = match entries.iter().any(|e| e.oobleck.is_none()) {
        true => Some(local_oobleck()?),
        false => None,
    };
    let mut started: Vec<Launched> = Vec::with_capacity(entries.len());
    for entry in entries {
        let remote = entry
            .oobleck
            .as_deref()
            .or(default_oobleck.as_deref())
            .expect("resolved above for every entry without oobleck=");
        match spawn_one(ssh, entry, remote, master, token, timeout).await {
            Ok(l) => started.push(l),
            Err(e) => {
                kill_all(started).await;
                return Err(e);
            }
        }
    }
    Ok(started)
}

async fn spawn_one(
    ssh: &OsStr,
    entry: &HostEntry,
    remote: &str,
    master: MasterAt<'_>,
    token: &str,
    timeout: Duration,
) -> Result<Launched> {
    let mut child = ssh_command(ssh, entry, remote, master)
        .spawn()
        .with_context(|| format!("starting the agent on {entry}: running {ssh:?}"))?;
    let mut stdin = child.stdin.take().context("ssh stdin")?;
    let stdout = child.stdout.take().context("ssh stdout")?;
    let line = format!("{token}\n");
    let write = async {
        stdin.write_all(line.as_bytes()).await?;
        stdin.flush().await
    };
    let written = tokio::time::timeout(timeout, write).await;
    let err = match written {
        Ok(Ok(())) => {
            return Ok(Launched {
                entry: entry.clone(),
                child,
                stdin,
                stdout,
            })
        }
        Ok(Err(e)) => anyhow!(e).context(format!(
            "sending the token to the agent on {entry} (did ssh exit?)"
        )),
        Err(_) => anyhow!("sending the token to the agent on {entry}: timed out after {timeout:?}"),
    };
    let _ = child.start_kill();
    let _ = tokio::time::timeout(Duration::from_secs(5), child.wait()).await;
    Err(err)
}

/// Kills and reaps every started ssh (bounded: a process that survives SIGKILL for 5 s is left
/// to `kill_on_drop`).
async fn kill_all(started: Vec<Launched>) {
    for mut l in started {
        drop(l.stdin);
        let _ = l.child.start_kill();
        let _ = tokio::time::timeout(Duration::from_secs(5), l.child.wait()).await;
    }
}

#[cfg(test)]
mod tests;
