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
mod tests {
    use super::*;

    /// The master at `addr`, looked for 60 s once lost.
    fn at(addr: &str) -> MasterAt<'_> {
        MasterAt { addr, wait_s: 60 }
    }

    fn parse(text: &str) -> Result<Vec<HostEntry>> {
        parse_hostfile(text, Path::new("hosts.txt"))
    }

    fn err(text: &str) -> String {
        format!("{:#}", parse(text).expect_err("should be rejected"))
    }

    fn entry(host: &str) -> HostEntry {
        HostEntry {
            host: host.into(),
            user: None,
            port: None,
            data_host: None,
            oobleck: None,
        }
    }

    #[test]
    fn parses_every_field_and_skips_comments() {
        let text = "# cluster\n\n  gpu-01  \nalice@gpu-02:2222 data=10.0.0.2 # two\n\
                    10.1.0.3 oobleck=/opt/o/bin/oobleck data=10.1.0.3\n[fe80::1%eth0]:22\n::1\n";
        let got = parse(text).unwrap();
        let want = vec![
            entry("gpu-01"),
            HostEntry {
                user: Some("alice".into()),
                port: Some(2222),
                data_host: Some("10.0.0.2".into()),
                ..entry("gpu-02")
            },
            HostEntry {
                oobleck: Some("/opt/o/bin/oobleck".into()),
                data_host: Some("10.1.0.3".into()),
                ..entry("10.1.0.3")
            },
            HostEntry {
                port: Some(22),
                ..entry("fe80::1%eth0")
            },
            entry("::1"),
        ];
        assert_eq!(got, want);
        assert_eq!(got[1].to_string(), "alice@gpu-02:2222");
        assert_eq!(got[3].to_string(), "[fe80::1%eth0]:22");
    }

    #[test]
    fn rejects_bad_lines_with_file_and_line() {
        let cases = [
            ("a\nb color=red\n", "hosts.txt:2: unknown key \"color\""),
            ("a\nb data\n", "hosts.txt:2: expected key=value"),
            ("a data=\n", "hosts.txt:1: data= needs a value"),
            (
                "a data=node-b\n",
                "hosts.txt:1: data=node-b: expected an IP address",
            ),
            (
                "a data=1.2.3.4 data=1.2.3.5\n",
                "hosts.txt:1: data= given twice",
            ),
            ("u@:22\n", "hosts.txt:1: \"u@:22\": empty host"),
            ("@h\n", "hosts.txt:1: \"@h\": empty user"),
            ("[]:22\n", "empty host"),
            ("h:0\n", "hosts.txt:1: \"h:0\": bad ssh port \"0\""),
            ("h:70000\n", "bad ssh port \"70000\""),
            ("h:ssh\n", "bad ssh port \"ssh\""),
            ("h:\n", "bad ssh port \"\""),
            ("[::1]x\n", "expected ':port' after ']'"),
            ("-oProxyCommand=x\n", "bad host name"),
            ("h'x\n", "bad host name"),
            (
                "a\nb\nA:22 data=1.1.1.1\n",
                "hosts.txt:3: A:22 is already on line 1",
            ),
            (
                "a:2222\nbob@a:2222\n",
                "hosts.txt:2: bob@a:2222 is already on line 1",
            ),
            ("# nothing\n\n", "hosts.txt: no hosts"),
            ("", "hosts.txt: no hosts"),
        ];
        for (text, want) in cases {
            let got = err(text);
            assert!(got.contains(want), "{text:?}: {got:?} lacks {want:?}");
        }
        // Different ports on one host are different sshds (e.g. containers).
        assert_eq!(parse("a:2222\na:2223\n").unwrap().len(), 2);
    }

    /// Runs `sh -c "printf %s <quoted>"` and returns what sh printed.
    async fn through_sh(s: &str) -> String {
        let out = Command::new("sh")
            .arg("-c")
            .arg(format!("printf %s {}", shell_quote(s)))
            .kill_on_drop(true)
            .output();
        let out = tokio::time::timeout(Duration::from_secs(10), out)
            .await
            .expect("sh answered in time")
            .expect("sh ran");
        assert!(out.status.success(), "{s:?}: {out:?}");
        String::from_utf8(out.stdout).unwrap()
    }

    #[tokio::test]
    async fn shell_quote_survives_a_real_shell() {
        assert_eq!(shell_quote("/usr/bin/oobleck"), "/usr/bin/oobleck");
        assert_eq!(shell_quote("10.0.0.1:4242"), "10.0.0.1:4242");
        assert_eq!(shell_quote(""), "''");
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
        let nasty = [
            "",
            "a b",
            "it's",
            "''",
            "'",
            "\"double\"",
            "$HOME",
            "${x:-y}",
            "`id`",
            "$(id)",
            "a;rm -rf /tmp/x",
            "a && b || c | d",
            "back\\slash",
            "new\nline",
            "tab\there",
            "*?[a]~",
            "-n",
            "!event",
            "ünïcödé",
        ];
        for s in nasty {
            assert_eq!(through_sh(s).await, s, "quoted as {}", shell_quote(s));
        }
    }

    #[test]
    fn remote_command_quotes_every_word_and_carries_no_token() {
        let e = HostEntry {
            data_host: Some("10.0.0.2".into()),
            ..entry("h")
        };
        assert_eq!(
            remote_command(&e, "/opt/my dir/oobleck", at("10.0.0.1:4242")),
            "exec '/opt/my dir/oobleck' agent --master 10.0.0.1:4242 --host 10.0.0.2 \
             --master-wait 60 --token-stdin --exit-with-parent"
        );
        assert_eq!(
            remote_command(&entry("h"), "oobleck", at("m:1")),
            "exec oobleck agent --master m:1 --master-wait 60 --token-stdin --exit-with-parent"
        );
    }

    #[test]
    fn ssh_command_line() {
        let e = HostEntry {
            user: Some("alice".into()),
            port: Some(2222),
            ..entry("gpu-02")
        };
        let cmd = ssh_command(OsStr::new("my-ssh"), &e, "/o", at("m:1"));
        let std = cmd.as_std();
        assert_eq!(std.get_program(), "my-ssh");
        let args: Vec<&OsStr> = std.get_args().collect();
        let want = [
            "-o",
            "BatchMode=yes",
            "-o",
            "ConnectTimeout=10",
            "-o",
            "ServerAliveInterval=15",
            "-o",
            "ServerAliveCountMax=4",
            "-T",
            "-p",
            "2222",
            "alice@gpu-02",
            "--",
            "exec /o agent --master m:1 --master-wait 60 --token-stdin --exit-with-parent",
        ];
        assert_eq!(args, want);
        let plain = ssh_command(OsStr::new("ssh"), &entry("h"), "/o", at("m:1"));
        let args: Vec<&OsStr> = plain.as_std().get_args().collect();
        assert_eq!(&args[8..11], ["-T", "h", "--"]);
    }

    fn write_script(path: &Path, body: &str) {
        use std::os::unix::fs::PermissionsExt;
        std::fs::write(path, body).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }

    /// Waits (bounded) until `path` exists and returns its text.
    async fn wait_for(path: &Path) -> String {
        for _ in 0..200 {
            if let Ok(s) = std::fs::read_to_string(path) {
                return s;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("{} never appeared", path.display());
    }

    #[tokio::test]
    async fn token_travels_on_stdin_and_the_agent_lives_while_stdin_is_open() {
        // A directory name a shell would mangle, so the quoting is tested end to end.
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("it's a $dir; x");
        std::fs::create_dir(&dir).unwrap();
        let ssh = dir.join("fake-ssh");
        // Like ssh: options up to `--`, then the rest is one command for the remote shell.
        write_script(
            &ssh,
            "#!/bin/sh\nd=$(dirname \"$0\")\nprintf '%s\\n' \"$@\" > \"$d/ssh-argv\"\n\
             while [ \"$#\" -gt 0 ] && [ \"$1\" != -- ]; do shift; done\n\
             [ \"$#\" -gt 0 ] || { echo 'fake ssh: no --' >&2; exit 2; }\nshift\n\
             exec sh -c \"$*\"\n",
        );
        let agent = dir.join("fake oobleck");
        // Like `agent --token-stdin --exit-with-parent`: one line, then wait for EOF.
        write_script(
            &agent,
            "#!/bin/sh\nd=$(dirname \"$0\")\nIFS= read -r tok\n\
             { printf 'stdin:%s\\n' \"$tok\"; printf 'argv:%s\\n' \"$*\"; } > \"$d/seen.tmp\"\n\
             mv \"$d/seen.tmp\" \"$d/seen\"\ncat > /dev/null\necho eof > \"$d/eof\"\n",
        );
        let token = "s3cret-token-4f2a";
        let entries = vec![HostEntry {
            user: Some("alice".into()),
            port: Some(2222),
            data_host: Some("10.0.0.7".into()),
            oobleck: Some(agent.to_str().unwrap().to_string()),
            ..entry("node1")
        }];
        let mut launched = launch_with(
            ssh.as_os_str(),
            &entries,
            at("127.0.0.1:4242"),
            token,
            Duration::from_secs(5),
        )
        .await
        .unwrap();
        assert_eq!(launched.len(), 1);

        let seen = wait_for(&dir.join("seen")).await;
        let (stdin_part, argv_part) = seen.split_once("\nargv:").expect("two parts");
        assert_eq!(stdin_part, format!("stdin:{token}"));
        assert_eq!(
            argv_part.trim_end(),
            "agent --master 127.0.0.1:4242 --host 10.0.0.7 --master-wait 60 --token-stdin \
             --exit-with-parent"
        );
        let ssh_argv = std::fs::read_to_string(dir.join("ssh-argv")).unwrap();
        assert!(!ssh_argv.contains(token), "{ssh_argv}");
        assert!(
            ssh_argv.contains("-p\n2222\nalice@node1\n--\n"),
            "{ssh_argv}"
        );

        // Still running while stdin is held...
        tokio::time::sleep(Duration::from_millis(200)).await;
        let l = &mut launched[0];
        assert!(
            l.child.try_wait().unwrap().is_none(),
            "exited with stdin open"
        );
        assert!(!dir.join("eof").exists());
        // ...and gone, cleanly, once it is closed.
        let Launched {
            mut child, stdin, ..
        } = launched.pop().unwrap();
        drop(stdin);
        let status = tokio::time::timeout(Duration::from_secs(10), child.wait())
            .await
            .expect("the agent exits after EOF")
            .unwrap();
        assert!(status.success(), "{status:?}");
        assert_eq!(std::fs::read_to_string(dir.join("eof")).unwrap(), "eof\n");
    }

    #[tokio::test]
    async fn a_missing_ssh_is_an_error_naming_the_host() {
        let entries = vec![HostEntry {
            oobleck: Some("/o".into()),
            ..entry("node7")
        }];
        let e = launch_with(
            OsStr::new("/nonexistent/ssh-for-oobleck-tests"),
            &entries,
            at("m:1"),
            "t",
            Duration::from_secs(5),
        )
        .await
        .unwrap_err();
        let msg = format!("{e:#}");
        assert!(msg.contains("node7"), "{msg}");
        assert!(msg.contains("ssh-for-oobleck-tests"), "{msg}");
    }

    #[tokio::test]
    async fn rejects_a_token_that_is_not_one_line() {
        let entries = vec![entry("h")];
        for t in ["", "a\nb", "a\r"] {
            let e = launch_with(
                OsStr::new("ssh"),
                &entries,
                at("m:1"),
                t,
                Duration::from_secs(1),
            )
            .await
            .unwrap_err();
            assert!(e.to_string().contains("one non-empty line"), "{e}");
        }
    }
}
