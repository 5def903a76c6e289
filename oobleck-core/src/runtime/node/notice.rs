//! Preemption notices: how a node agent learns its machine will be taken away.
//!
//! Spot and preemptible VMs are told shortly before they go (GCP: about 30 s, AWS: about two
//! minutes). The agent watches one [`NoticeSource`] with [`wait_for_notice`]; when a notice
//! appears it asks the master to drain its node, so the node leaves at a step boundary
//! instead of being lost mid-step.
//!
//! A source is either a **file** that appears (any content; its trimmed content, if any, is
//! the reason) or an **HTTP endpoint** polled every interval, as the clouds' metadata
//! services offer:
//!
//! ```text
//!  cloud  endpoint                                                              no notice   notice
//!  GCP    http://metadata.google.internal/computeMetadata/v1/instance/preempted  200 FALSE   200 TRUE
//!  AWS    http://169.254.169.254/latest/meta-data/spot/instance-action           404         200 {"action":..,"time":..}
//! ```
//!
//! The HTTP rules, one GET per poll:
//! - Every request carries `Metadata-Flavor: Google` (GCP refuses requests without it; other
//!   services ignore it).
//! - HTTP 200 whose trimmed body is not empty and not (case-insensitively) `false` or `none`
//!   is a notice. 404 and every other status is no notice.
//! - Each request (name lookup, connect, answer, body) is bounded by the watch's `timeout`.
//!   An endpoint that cannot be reached is **not** a notice: the agent warns once, stays
//!   silent while the outage lasts, and warns again only after the endpoint answered and then
//!   failed again.
//! - Plain `http://` only: metadata services are plain http on a link-local address, so there
//!   is no TLS here and `https://` is refused when the source is parsed.
//! - AWS IMDSv2 wants a session token fetched with a `PUT` first; that is not built. Enable
//!   IMDSv1 on the instance, or run a small local relay that fetches the token and serves the
//!   notice (or writes a notice file).
//!
//! The client is hyper's bare HTTP/1 connection over a tokio socket: async, so the poll never
//! blocks the agent's single-threaded runtime.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Duration;

use http_body_util::{BodyExt, Empty, Limited};
use hyper::body::Bytes;
use hyper::header::HOST;
use hyper::{Request, StatusCode, Uri};
use hyper_util::rt::TokioIo;

use crate::runtime::error::{Result, RuntimeError};

/// Reasons are one line of at most this many characters (a notice body may be a JSON page).
const REASON_CHARS: usize = 200;
/// The most of a notice file or answer body that is read: notices are a word or a line.
const MAX_BODY_BYTES: usize = 64 * 1024;
/// A zero interval from a flag would spin the agent's only thread.
const MIN_INTERVAL: Duration = Duration::from_millis(10);
/// The header GCP's metadata server requires on every request.
const FLAVOR: (&str, &str) = ("Metadata-Flavor", "Google");

/// Where the notice comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum NoticeSource {
    /// A file that appears (any content; its trimmed content, if any, is the reason).
    File(PathBuf),
    /// An HTTP endpoint polled at an interval, as cloud metadata services offer.
    Http { url: String },
}

impl NoticeSource {
    /// `http://...` is an endpoint, anything without a `scheme://` a file path. `https://`,
    /// other schemes, a URL without a host and an empty string are errors saying what to pass.
    pub(crate) fn parse(s: &str) -> Result<NoticeSource> {
        let invalid = |why: &str| {
            RuntimeError::Invalid(format!(
                "preemption notice source `{s}`: {why}; pass a file path, or a plain http:// \
                 URL such as http://169.254.169.254/latest/meta-data/spot/instance-action (AWS) \
                 or http://metadata.google.internal/computeMetadata/v1/instance/preempted (GCP)"
            ))
        };
        let lower = s.to_ascii_lowercase();
        if s.trim().is_empty() {
            Err(invalid("it is empty"))
        } else if lower.starts_with("https://") {
            Err(invalid(
                "https is not supported: cloud metadata services are plain http on a \
                 link-local address",
            ))
        } else if lower.starts_with("http://") {
            let uri: Uri = s
                .parse()
                .map_err(|e| invalid(&format!("not a URL ({e})")))?;
            Target::of(&uri).map_err(|e| invalid(&e))?;
            Ok(NoticeSource::Http { url: s.to_string() })
        } else if let Some((scheme, _)) = s.split_once("://") {
            Err(invalid(&format!("the scheme `{scheme}` is not supported")))
        } else {
            Ok(NoticeSource::File(PathBuf::from(s)))
        }
    }
}

/// What to watch and how often.
#[derive(Debug, Clone)]
pub(crate) struct NoticeWatch {
    pub source: NoticeSource,
    /// Time between polls (at least 10 ms; a smaller one is raised to that).
    pub interval: Duration,
    /// Bound of each HTTP request, from name lookup to the end of the body.
    pub timeout: Duration,
}

/// Polls until a notice appears, then returns its reason in words, e.g. "preemption notice
/// file /x appeared" or "preemption notice from http://... (HTTP 200: TRUE)".
///
/// An endpoint that cannot be reached is no notice: it is warned about once per outage (on
/// the log and on stderr) and watched on. Never returns an error; never panics.
pub(crate) async fn wait_for_notice(watch: &NoticeWatch) -> String {
    let interval = watch.interval.max(MIN_INTERVAL);
    let mut outage = Outage::default();
    loop {
        let poll = match &watch.source {
            NoticeSource::File(path) => poll_file(path),
            NoticeSource::Http { url } => poll_http(url, watch.timeout).await,
        };
        match poll {
            Poll::Notice(reason) => return reason,
            Poll::Quiet => {
                outage.observe(true);
            }
            Poll::Unreachable(err) => {
                if outage.observe(false) {
                    let url = match &watch.source {
                        NoticeSource::Http { url } => url.as_str(),
                        NoticeSource::File(_) => "",
                    };
                    tracing::warn!(url, error = %err, "preemption notice endpoint unreachable");
                    eprintln!(
                        "oobleck agent: preemption notice endpoint {url} unreachable ({err}); \
                         still watching"
                    );
                }
            }
        }
        tokio::time::sleep(interval).await;
    }
}

/// The outcome of one poll.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Poll {
    /// A notice, with its reason.
    Notice(String),
    /// The source answered (or the file is absent): no notice.
    Quiet,
    /// The endpoint could not be asked (refused, timed out, unknown name, broken answer).
    Unreachable(String),
}

/// Whether an unreachable endpoint has been warned about since it last answered.
#[derive(Debug, Default)]
struct Outage {
    warned: bool,
}

impl Outage {
    /// Records one poll; true when this failure is the first since the endpoint answered
    /// (or since the start), so the caller warns.
    fn observe(&mut self, reachable: bool) -> bool {
        let warn = !reachable && !self.warned;
        self.warned = !reachable;
        warn
    }
}

/// A notice file is a notice as soon as it exists; its content is read only for the reason.
fn poll_file(path: &Path) -> Poll {
    if !path.exists() {
        return Poll::Quiet;
    }
    let mut content = Vec::new();
    let read = std::fs::File::open(path)
        .and_then(|f| f.take(MAX_BODY_BYTES as u64).read_to_end(&mut content));
    let content = one_line(&String::from_utf8_lossy(&content));
    let mut reason = format!("preemption notice file {} appeared", path.display());
    if read.is_ok() && !content.is_empty() {
        reason.push_str(&format!(" ({content})"));
    }
    Poll::Notice(reason)
}

/// One bounded GET of the endpoint, judged by [`http_verdict`].
async fn poll_http(url: &str, timeout: Duration) -> Poll {
    match tokio::time::timeout(timeout, get(url)).await {
        Err(_) => Poll::Unreachable(format!("no answer within {timeout:?}")),
        Ok(Err(err)) => Poll::Unreachable(err),
        Ok(Ok((status, body))) => http_verdict(url, status, &body),
    }
}

/// A 200 with a body that says something is a notice; anything else that answered is not.
fn http_verdict(url: &str, status: StatusCode, body: &str) -> Poll {
    let said = body.trim();
    let quiet_word = said.eq_ignore_ascii_case("false") || said.eq_ignore_ascii_case("none");
    if status == StatusCode::OK && !said.is_empty() && !quiet_word {
        let shown = one_line(said);
        return Poll::Notice(format!(
            "preemption notice from {url} (HTTP {}: {shown})",
            status.as_u16()
        ));
    }
    tracing::debug!(url, status = status.as_u16(), "no preemption notice");
    Poll::Quiet
}

/// Host, port and request target of an `http://` URL.
#[derive(Debug)]
struct Target {
    /// What to connect to: a name or an IP (IPv6 without brackets).
    connect: String,
    port: u16,
    /// The `Host` header: the host as written, with the port if one was given.
    host_header: String,
    path: String,
}

impl Target {
    fn of(uri: &Uri) -> std::result::Result<Target, String> {
        if uri.scheme_str().map(str::to_ascii_lowercase).as_deref() != Some("http") {
            return Err("not an http:// URL".into());
        }
        let authority = uri.authority().ok_or("the URL has no host")?;
        let host = authority.host();
        if host.is_empty() {
            return Err("the URL has no host".into());
        }
        let host_header = match authority.port_u16() {
            Some(port) => format!("{host}:{port}"),
            None => host.to_string(),
        };
        Ok(Target {
            connect: host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_string(),
            port: authority.port_u16().unwrap_or(80),
            host_header,
            path: uri.path_and_query().map_or("/", |p| p.as_str()).to_string(),
        })
    }
}

/// Ends the spawned connection task when the request is done or abandoned (timeout).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// GET `url` once over a fresh connection: its status and (lossy UTF-8) body, or what failed.
/// Unbounded in time; [`poll_http`] bounds it.
async fn get(url: &str) -> std::result::Result<(StatusCode, String), String> {
    let uri: Uri = url.parse().map_err(|e| format!("bad URL: {e}"))?;
    let target = Target::of(&uri)?;
    let tcp = tokio::net::TcpStream::connect((target.connect.as_str(), target.port))
        .await
        .map_err(|e| format!("connecting: {e}"))?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .map_err(|e| format!("HTTP handshake: {e}"))?;
    let _conn = AbortOnDrop(tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "preemption notice connection ended");
        }
    }));
    let request = Request::get(target.path.as_str())
        .header(HOST, target.host_header.as_str())
        .header(FLAVOR.0, FLAVOR.1)
        .body(Empty::<Bytes>::new())
        .map_err(|e| format!("building the request: {e}"))?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| format!("sending the request: {e}"))?;
    let status = response.status();
    if status != StatusCode::OK {
        return Ok((status, String::new()));
    }
    let body = Limited::new(response.into_body(), MAX_BODY_BYTES)
        .collect()
        .await
        .map_err(|e| format!("reading the answer: {e}"))?
        .to_bytes();
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

/// `s` as one trimmed line (whitespace runs become one space) of at most [`REASON_CHARS`]
/// characters, "..." marking a cut.
fn one_line(s: &str) -> String {
    let flat = s.split_whitespace().collect::<Vec<_>>().join(" ");
    match flat.char_indices().nth(REASON_CHARS) {
        Some((cut, _)) => format!("{}...", &flat[..cut]),
        None => flat,
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::net::{SocketAddr, TcpListener};
    use std::thread::JoinHandle;

    use super::*;

    /// Small enough that a test of a few polls takes a fraction of a second.
    const INTERVAL: Duration = Duration::from_millis(20);
    /// Bound of every wait that should end; far above what the polls take.
    const BOUND: Duration = Duration::from_secs(5);

    fn watch(source: NoticeSource) -> NoticeWatch {
        NoticeWatch {
            source,
            interval: INTERVAL,
            timeout: Duration::from_millis(500),
        }
    }

    fn http(addr: SocketAddr, path: &str) -> NoticeSource {
        NoticeSource::parse(&format!("http://{addr}{path}")).unwrap()
    }

    /// A port nothing listens on: bound, then let go.
    fn free_addr() -> SocketAddr {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
    }

    /// Serves one canned `(status line, body)` per connection, in order, then stops
    /// listening; returns the request heads it read.
    fn serve(
        listener: TcpListener,
        answers: Vec<(&'static str, &'static str)>,
    ) -> JoinHandle<Vec<String>> {
        std::thread::spawn(move || {
            let mut heads = Vec::new();
            for (status, body) in answers {
                let (mut stream, _) = listener.accept().unwrap();
                stream.set_read_timeout(Some(BOUND)).unwrap();
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") && stream.read(&mut byte).unwrap() == 1 {
                    head.push(byte[0]);
                }
                heads.push(String::from_utf8_lossy(&head).into_owned());
                let answer = format!(
                    "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                stream.write_all(answer.as_bytes()).unwrap();
            }
            heads
        })
    }

    #[test]
    fn parse_tells_http_urls_from_file_paths() {
        let url = "http://169.254.169.254/latest/meta-data/spot/instance-action";
        assert_eq!(
            NoticeSource::parse(url).unwrap(),
            NoticeSource::Http { url: url.into() }
        );
        assert!(matches!(
            NoticeSource::parse("HTTP://metadata.google.internal/x").unwrap(),
            NoticeSource::Http { .. }
        ));
        assert_eq!(
            NoticeSource::parse("/run/preempted").unwrap(),
            NoticeSource::File("/run/preempted".into())
        );
        assert_eq!(
            NoticeSource::parse("notice.txt").unwrap(),
            NoticeSource::File("notice.txt".into())
        );
    }

    #[test]
    fn parse_refuses_https_naming_plain_http() {
        let err = NoticeSource::parse("https://metadata.google.internal/x").unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("https is not supported"), "{msg}");
        assert!(msg.contains("plain http"), "{msg}");
    }

    #[test]
    fn parse_refuses_empty_sources_other_schemes_and_hostless_urls() {
        for (bad, says) in [
            ("", "it is empty"),
            ("  ", "it is empty"),
            ("ftp://host/notice", "scheme `ftp`"),
            ("http://", "not a URL"),
        ] {
            let msg = NoticeSource::parse(bad).unwrap_err().to_string();
            assert!(msg.contains(says), "{bad:?}: {msg}");
            assert!(msg.contains("pass a file path"), "{bad:?}: {msg}");
        }
    }

    #[test]
    fn only_a_200_that_says_something_is_a_notice() {
        let url = "http://x/";
        for (status, body, notice) in [
            (200, "TRUE", true),
            (200, " {\"action\": \"terminate\"}\n", true),
            (200, "FALSE", false),
            (200, "false\n", false),
            (200, "None", false),
            (200, "  \n", false),
            (404, "TRUE", false),
            (500, "TRUE", false),
            (503, "", false),
        ] {
            let status = StatusCode::from_u16(status).unwrap();
            let verdict = http_verdict(url, status, body);
            assert_eq!(
                matches!(verdict, Poll::Notice(_)),
                notice,
                "{status} {body:?}"
            );
        }
        assert_eq!(
            http_verdict(url, StatusCode::OK, "TRUE\n"),
            Poll::Notice("preemption notice from http://x/ (HTTP 200: TRUE)".into())
        );
    }

    #[test]
    fn warns_once_per_outage() {
        let mut outage = Outage::default();
        let polls = [false, false, true, true, false, false, true, false];
        let warned: Vec<bool> = polls.iter().map(|&r| outage.observe(r)).collect();
        assert_eq!(
            warned,
            [true, false, false, false, true, false, false, true]
        );
    }

    #[test]
    fn long_bodies_are_cut_to_one_short_line() {
        let long = "x".repeat(1000);
        let line = one_line(&long);
        assert_eq!(line.chars().count(), REASON_CHARS + 3);
        assert!(line.ends_with("..."));
        assert_eq!(one_line(" a\n b\t\tc \n"), "a b c");
        // A cut never splits a character.
        assert_eq!(one_line(&"é".repeat(300)).chars().count(), REASON_CHARS + 3);
    }

    #[tokio::test]
    async fn a_file_that_appears_is_a_notice_with_its_content() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("preempted");
        let writer = {
            let path = path.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(100));
                std::fs::write(path, "  spot reclaim at 12:00\n").unwrap();
            })
        };
        let reason = tokio::time::timeout(
            BOUND,
            wait_for_notice(&watch(NoticeSource::File(path.clone()))),
        )
        .await
        .expect("the notice file appeared, so the watch should end");
        writer.join().unwrap();
        assert_eq!(
            reason,
            format!(
                "preemption notice file {} appeared (spot reclaim at 12:00)",
                path.display()
            )
        );
    }

    #[tokio::test]
    async fn gcp_style_false_false_true_is_a_notice_on_the_third_poll() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = serve(
            listener,
            vec![("200 OK", "FALSE"), ("200 OK", "FALSE"), ("200 OK", "TRUE")],
        );
        let source = http(addr, "/computeMetadata/v1/instance/preempted");
        let reason = tokio::time::timeout(BOUND, wait_for_notice(&watch(source)))
            .await
            .expect("TRUE is a notice");
        assert!(reason.contains("(HTTP 200: TRUE)"), "{reason}");
        assert!(reason.contains(&addr.to_string()), "{reason}");
        let heads = server.join().unwrap();
        assert_eq!(heads.len(), 3, "one request per poll until the notice");
        for head in &heads {
            let head = head.to_ascii_lowercase();
            assert!(
                head.starts_with("get /computemetadata/v1/instance/preempted http/1.1"),
                "{head}"
            );
            assert!(head.contains("metadata-flavor: google\r\n"), "{head}");
            assert!(head.contains(&format!("host: {addr}\r\n")), "{head}");
        }
    }

    #[tokio::test]
    async fn aws_style_404_then_json_is_a_notice() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let json = r#"{"action": "terminate", "time": "2017-09-18T08:22:00Z"}"#;
        let server = serve(
            listener,
            vec![
                ("404 Not Found", "<html>Not Found</html>"),
                ("404 Not Found", "<html>Not Found</html>"),
                ("200 OK", json),
            ],
        );
        let source = http(addr, "/latest/meta-data/spot/instance-action");
        let reason = tokio::time::timeout(BOUND, wait_for_notice(&watch(source)))
            .await
            .expect("a 200 with JSON is a notice");
        assert!(reason.ends_with(&format!("(HTTP 200: {json})")), "{reason}");
        assert_eq!(server.join().unwrap().len(), 3);
    }

    #[tokio::test]
    async fn an_unreachable_endpoint_is_no_notice() {
        let addr = free_addr();
        assert!(matches!(
            poll_http(&format!("http://{addr}/"), Duration::from_secs(1)).await,
            Poll::Unreachable(_)
        ));
        let waited =
            tokio::time::timeout(5 * INTERVAL, wait_for_notice(&watch(http(addr, "/")))).await;
        assert!(
            waited.is_err(),
            "a refused connection is no notice: {waited:?}"
        );
    }

    #[tokio::test]
    async fn a_silent_endpoint_times_out_and_is_no_notice() {
        // Bound but never accepting: the connection is made, no answer ever comes.
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let poll = poll_http(&format!("http://{addr}/"), Duration::from_millis(50)).await;
        assert_eq!(poll, Poll::Unreachable("no answer within 50ms".into()));
        let mut silent = watch(http(addr, "/"));
        silent.timeout = Duration::from_millis(30);
        let waited = tokio::time::timeout(10 * INTERVAL, wait_for_notice(&silent)).await;
        assert!(
            waited.is_err(),
            "a silent endpoint is no notice: {waited:?}"
        );
        drop(listener);
    }

    #[tokio::test]
    async fn an_endpoint_that_comes_up_with_a_notice_is_heard() {
        let addr = free_addr();
        let server = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(150));
            let listener = TcpListener::bind(addr).expect("the reserved port is free again");
            serve(listener, vec![("200 OK", "TRUE")]).join().unwrap()
        });
        let reason = tokio::time::timeout(BOUND, wait_for_notice(&watch(http(addr, "/"))))
            .await
            .expect("the endpoint came up with a notice");
        assert!(reason.contains("TRUE"), "{reason}");
        assert_eq!(server.join().unwrap().len(), 1);
    }
}
