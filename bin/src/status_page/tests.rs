//! The page's HTTP surface on a real socket, with no master behind it (it never answers, so
//! `connected` is false): who gets in, the one-time link, unknown paths, the charts' names,
//! one reading shared by the requests of an interval, and the rate limit.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use oobleck_core::runtime::wire::Token;

use super::StatusPage;

/// One raw HTTP/1.1 request; the whole answer (status line, headers, body) as text.
fn raw(addr: SocketAddr, method: &str, path: &str, headers: &[(&str, &str)]) -> String {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut req = format!("{method} {path} HTTP/1.1\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("Content-Length: 0\r\n\r\n");
    s.write_all(req.as_bytes()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).expect("an answer");
    out
}

fn code(answer: &str) -> u16 {
    answer
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

/// A page for a master that is not there (a port nothing listens on).
fn page(bind: &str, run: &std::path::Path) -> (StatusPage, Token) {
    let token = Token::new("the-job-token").unwrap();
    let nobody: SocketAddr = "127.0.0.1:9".parse().unwrap();
    let p = StatusPage::start(bind.parse().unwrap(), run.to_path_buf(), nobody, &token, 1).unwrap();
    (p, token)
}

#[test]
fn off_loopback_every_request_needs_the_token_or_a_session() {
    let dir = tempfile::tempdir().unwrap();
    let (p, _) = page("0.0.0.0:0", dir.path());
    let at = SocketAddr::from(([127, 0, 0, 1], p.addr().port()));
    let host = ("Host", "node7.cluster:8080");
    for path in ["/", "/api/status", "/metrics", "/charts/loss.svg"] {
        let a = raw(at, "GET", path, &[host]);
        assert_eq!(code(&a), 401, "{path}: {a}");
        assert!(a.contains("one-time link"), "{a}");
    }
    let bearer = ("Authorization", "Bearer the-job-token");
    let a = raw(at, "GET", "/api/status", &[host, bearer]);
    assert_eq!(code(&a), 200, "{a}");
    assert!(
        a.contains("\"connected\":false") && a.contains("\"can_act\":true"),
        "{a}"
    );
    let wrong = ("Authorization", "Bearer the-job-tokem");
    assert_eq!(code(&raw(at, "GET", "/api/status", &[host, wrong])), 401);
    // The one-time link: a session cookie and a redirect to the page, once.
    let key = p.login_link().rsplit_once("key=").unwrap().1.to_string();
    let a = raw(at, "GET", &format!("/login?key={key}"), &[host]);
    assert_eq!(code(&a), 303, "{a}");
    let cookie = a
        .lines()
        .find_map(|l| l.strip_prefix("set-cookie: "))
        .expect("a session cookie");
    assert!(
        cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict"),
        "{cookie}"
    );
    let session = cookie.split(';').next().unwrap();
    let a = raw(at, "GET", "/", &[host, ("Cookie", session)]);
    assert_eq!(code(&a), 200);
    assert!(a.contains("<html"), "{a}");
    assert_eq!(
        code(&raw(at, "GET", &format!("/login?key={key}"), &[host])),
        401,
        "used"
    );
    // Unknown paths and charts, with credentials.
    assert_eq!(code(&raw(at, "GET", "/nope", &[host, bearer])), 404);
    assert_eq!(
        code(&raw(at, "GET", "/charts/nope.svg", &[host, bearer])),
        404
    );
    let a = raw(at, "GET", "/charts/loss.svg", &[host, bearer]);
    assert_eq!(code(&a), 200);
    assert!(a.contains("image/svg+xml") && a.contains("<svg"), "{a}");
}

#[test]
fn on_loopback_looking_is_open_acting_is_not_and_the_host_must_be_loopback() {
    let dir = tempfile::tempdir().unwrap();
    let (p, _) = page("127.0.0.1:0", dir.path());
    let at = p.addr();
    let host = ("Host", "127.0.0.1");
    let a = raw(at, "GET", "/api/status", &[host]);
    assert_eq!(code(&a), 200, "{a}");
    assert!(a.contains("\"can_act\":false"), "{a}");
    let a = raw(at, "POST", "/api/nodes/1/kill", &[host]);
    assert_eq!(code(&a), 401, "{a}");
    let a = raw(at, "GET", "/api/status", &[("Host", "attacker.example")]);
    assert_eq!(code(&a), 403, "DNS rebinding: {a}");
    // With the token, an action reaches for the master, which is not there: 502, in words.
    let a = raw(
        at,
        "POST",
        "/api/nodes/1/kill",
        &[host, ("Authorization", "Bearer the-job-token")],
    );
    assert_eq!(code(&a), 502, "{a}");
    assert!(a.contains("asking the master at 127.0.0.1:9"), "{a}");
    let a = raw(
        at,
        "POST",
        "/api/nodes/1/explode",
        &[host, ("Authorization", "Bearer the-job-token")],
    );
    assert_eq!(code(&a), 404, "{a}");
}

#[test]
fn a_taken_port_is_named_in_the_error() {
    let dir = tempfile::tempdir().unwrap();
    let (p, token) = page("127.0.0.1:0", dir.path());
    let taken = p.addr();
    let nobody: SocketAddr = "127.0.0.1:9".parse().unwrap();
    let e = StatusPage::start(taken, dir.path().to_path_buf(), nobody, &token, 1)
        .err()
        .expect("the port is taken");
    let e = format!("{e:#}");
    assert!(
        e.contains(&taken.to_string()) && e.contains("--status-addr"),
        "{e}"
    );
    assert_eq!(super::parse_addr(Some("off")).unwrap(), None);
    assert_eq!(
        super::parse_addr(None).unwrap(),
        Some(SocketAddr::from(([127, 0, 0, 1], 0)))
    );
    let e = format!("{:#}", super::parse_addr(Some("nonsense")).unwrap_err());
    assert!(e.contains("--status-addr nonsense"), "{e}");
}

/// A page on loopback for a master that is not there, with `tuning`.
fn tuned(run: &std::path::Path, tuning: super::Tuning) -> StatusPage {
    let token = Token::new("the-job-token").unwrap();
    let nobody: SocketAddr = "127.0.0.1:9".parse().unwrap();
    let bind = "127.0.0.1:0".parse().unwrap();
    StatusPage::start_tuned(bind, run.to_path_buf(), nobody, &token, 1, tuning).unwrap()
}

const GENEROUS: super::limit::Rate = super::limit::Rate {
    burst: 1000.0,
    per_s: 1000.0,
};

#[test]
fn requests_within_the_refresh_interval_share_one_reading_and_a_stale_one_is_taken_again() {
    let dir = tempfile::tempdir().unwrap();
    let host = ("Host", "127.0.0.1");
    let bearer = ("Authorization", "Bearer the-job-token");
    let hour = super::Tuning {
        refresh: Duration::from_secs(3600),
        rate: GENEROUS,
    };
    let p = tuned(dir.path(), hour);
    assert_eq!(p.refreshes(), 0, "nothing read before a request");
    for i in 0..20 {
        let path = ["/api/status", "/metrics", "/charts/loss.svg"][i % 3];
        let a = raw(p.addr(), "GET", path, &[host]);
        assert_eq!(code(&a), 200, "{path}: {a}");
    }
    let a = raw(p.addr(), "GET", "/api/status", &[host, bearer]);
    assert!(
        a.contains("\"can_act\":true"),
        "the same reading, acting: {a}"
    );
    assert_eq!(p.refreshes(), 1, "21 requests in one interval");
    drop(p);
    let always = super::Tuning {
        refresh: Duration::ZERO,
        rate: GENEROUS,
    };
    let p = tuned(dir.path(), always);
    for _ in 0..5 {
        assert_eq!(code(&raw(p.addr(), "GET", "/api/status", &[host])), 200);
    }
    assert_eq!(p.refreshes(), 5, "each reading older than the interval");
}

/// [`raw`] from the source address `from` (any 127.0.0.0/8 address is this machine).
fn raw_from(from: &str, at: SocketAddr, path: &str, headers: &[(&str, &str)]) -> String {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let std_stream = rt.block_on(async {
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.bind(format!("{from}:0").parse().unwrap()).unwrap();
        sock.connect(at).await.unwrap().into_std().unwrap()
    });
    std_stream.set_nonblocking(false).unwrap();
    let mut s = std_stream;
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut req = format!("GET {path} HTTP/1.1\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).expect("an answer");
    out
}

#[test]
fn a_client_over_its_rate_gets_429_while_other_clients_and_the_token_are_served() {
    let dir = tempfile::tempdir().unwrap();
    let host = ("Host", "127.0.0.1");
    let bearer = ("Authorization", "Bearer the-job-token");
    let tight = super::Tuning {
        refresh: super::REFRESH,
        // Three at once and, within the test, no more.
        rate: super::limit::Rate {
            burst: 3.0,
            per_s: 0.001,
        },
    };
    let p = tuned(dir.path(), tight);
    let at = p.addr();
    for _ in 0..3 {
        assert_eq!(
            code(&raw_from("127.0.0.1", at, "/api/status", &[host])),
            200
        );
    }
    let a = raw_from("127.0.0.1", at, "/api/status", &[host]);
    assert_eq!(code(&a), 429, "{a}");
    let retry = a
        .lines()
        .find_map(|l| l.strip_prefix("retry-after: "))
        .expect("a Retry-After header");
    assert!(retry.parse::<u64>().is_ok_and(|s| s >= 1), "{retry}");
    assert!(
        a.contains("text/plain") && a.contains("too many requests from 127.0.0.1"),
        "{a}"
    );
    // Another address is another client; the token has a bucket of its own on the same one,
    // so a logged-in page and its buttons go on working beside an anonymous flood.
    let b = raw_from("127.0.0.2", at, "/api/status", &[host]);
    assert_eq!(code(&b), 200, "{b}");
    let a = raw_from("127.0.0.1", at, "/api/status", &[host, bearer]);
    assert_eq!(code(&a), 200, "{a}");
    let a = raw(at, "POST", "/api/nodes/1/kill", &[host, bearer]);
    assert_eq!(code(&a), 502, "the action reached for the master: {a}");
}
