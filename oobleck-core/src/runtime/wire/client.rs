//! The client's side of the control-plane handshake, and the one-shot requests of the tools
//! (`oobleck status`, `oobleck kill-node`, `oobleck drain`).
//!
//! A node agent opens its connection the same way ([`open`]) and then keeps it (see
//! `runtime::node::link`); a tool sends one request and reads the master's status back.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

use super::auth::Token;
use super::error::{WireError, WireResult};
use super::protocol::{self, ClusterStatus, Message, PeerRole, BINARY_VERSION, PROTOCOL_VERSION};

pub(crate) fn timeout_err(op: &'static str, t: Duration) -> WireError {
    WireError::Timeout {
        op,
        ms: t.as_millis() as u64,
    }
}

pub(crate) struct Welcomed {
    pub node: Option<u32>,
    /// A returning agent was given its old node id back.
    pub adopted: bool,
    /// The master's epoch.
    pub epoch: u64,
    pub heartbeat: Duration,
    pub lease: Duration,
}

/// Connects and authenticates as `role`; the whole exchange is bounded by `timeout`.
pub(crate) async fn open(
    master: SocketAddr,
    token: &Token,
    role: PeerRole,
    timeout: Duration,
) -> WireResult<(OwnedReadHalf, OwnedWriteHalf, Welcomed)> {
    let run = async {
        let stream = TcpStream::connect(master)
            .await
            .map_err(|source| WireError::Io {
                op: "connect to master",
                source,
            })?;
        let _ = stream.set_nodelay(true);
        let (mut r, mut w) = stream.into_split();
        let hello = Message::Hello {
            protocol: PROTOCOL_VERSION,
            binary_version: BINARY_VERSION.to_string(),
            role,
            job: token.job().map(String::from),
        };
        protocol::write_frame(&mut w, &hello, timeout).await?;
        let (node, nonce) = match expect(&mut r, timeout, "challenge").await? {
            Message::Challenge { node, nonce } => (node, nonce),
            other => return Err(unexpected("challenge", &other)),
        };
        let mac = token.respond(&nonce, node, PROTOCOL_VERSION);
        protocol::write_frame(&mut w, &Message::AuthResponse { mac }, timeout).await?;
        match expect(&mut r, timeout, "welcome").await? {
            Message::Welcome {
                node: n,
                heartbeat_ms,
                lease_ms,
                adopted,
                epoch,
            } if n == node && heartbeat_ms > 0 && lease_ms > heartbeat_ms => Ok((
                r,
                w,
                Welcomed {
                    node,
                    adopted,
                    epoch,
                    heartbeat: Duration::from_millis(heartbeat_ms),
                    lease: Duration::from_millis(lease_ms),
                },
            )),
            other => Err(unexpected(
                "welcome for our node with heartbeat < lease",
                &other,
            )),
        }
    };
    tokio::time::timeout(timeout, run)
        .await
        .map_err(|_| timeout_err("register with master", timeout))?
}

fn unexpected(expected: &'static str, got: &Message) -> WireError {
    WireError::Unexpected {
        expected,
        got: format!("a {} message", got.kind()),
    }
}

/// Reads one handshake message; a `Refused` becomes [`WireError::Refused`].
async fn expect(r: &mut OwnedReadHalf, t: Duration, what: &'static str) -> WireResult<Message> {
    match protocol::read_frame(r, t).await? {
        Some(Message::Refused { reason }) => Err(WireError::Refused { reason }),
        Some(m) => Ok(m),
        None => Err(WireError::Closed {
            peer: format!("master (while waiting for {what})"),
        }),
    }
}

/// Asks the master for its status as an authenticated client (what `oobleck status` does).
pub async fn request_status(
    master: SocketAddr,
    token: &Token,
    timeout: Duration,
) -> WireResult<ClusterStatus> {
    request(
        master,
        token,
        Message::StatusRequest,
        "request status",
        timeout,
    )
    .await
}

/// Asks the master to kill `node`'s processes (what `oobleck kill-node` does). The master
/// answers with its status; an unknown node comes back as [`WireError::Refused`].
pub async fn request_kill(
    master: SocketAddr,
    token: &Token,
    node: u32,
    timeout: Duration,
) -> WireResult<ClusterStatus> {
    request(
        master,
        token,
        Message::KillNode { node },
        "request a kill",
        timeout,
    )
    .await
}

/// Asks the master to stop after its next step with that step's checkpoint, as SIGTERM to it
/// does (what `oobleck stop` does); `reason` says who asks, in its events and output. The master
/// answers with its status.
pub async fn request_stop(
    master: SocketAddr,
    token: &Token,
    reason: &str,
    timeout: Duration,
) -> WireResult<ClusterStatus> {
    let msg = Message::Stop {
        reason: reason.to_string(),
    };
    request(master, token, msg, "request a stop", timeout).await
}

/// Asks the master to drain `node` at the next step boundary (what `oobleck drain` does). The
/// master answers with its status; an unknown node comes back as [`WireError::Refused`].
pub async fn request_drain(
    master: SocketAddr,
    token: &Token,
    node: u32,
    force: bool,
    timeout: Duration,
) -> WireResult<ClusterStatus> {
    let reason = "oobleck drain".to_string();
    let msg = Message::Drain {
        node,
        reason,
        force,
    };
    request(master, token, msg, "request a drain", timeout).await
}

/// One request of an authenticated client, answered by the master's status.
async fn request(
    master: SocketAddr,
    token: &Token,
    msg: Message,
    what: &'static str,
    timeout: Duration,
) -> WireResult<ClusterStatus> {
    let run = async {
        let (mut r, mut w, _) = open(master, token, PeerRole::Client, timeout).await?;
        protocol::write_frame(&mut w, &msg, timeout).await?;
        match expect(&mut r, timeout, "the master's status").await? {
            Message::StatusResponse { status } => Ok(status),
            other => Err(unexpected("status_response", &other)),
        }
    };
    tokio::time::timeout(timeout, run)
        .await
        .map_err(|_| timeout_err(what, timeout))?
}
