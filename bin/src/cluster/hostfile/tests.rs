//! `hostfile`'s tests: parsing host files and the ssh launch through a stand-in.

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
