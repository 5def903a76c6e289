//! The handshake on the control port: who a peer is (an agent, a returning agent, a tool, a
//! standby master), whether it speaks this protocol and proves the job's token, and what a
//! returning agent's word is worth (its epoch, its committed step) once it has.

use std::net::SocketAddr;

use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};

use super::conn::Shared;
use super::server::MasterEvent;
use crate::runtime::wire::auth;
use crate::runtime::wire::protocol::{
    self, Message, PeerRole, Return, BINARY_VERSION, PROTOCOL_VERSION,
};

pub(super) struct Admitted {
    pub(super) node: Option<u32>,
    pub(super) devices: u32,
    /// A returning agent given its old id back, and what it holds.
    pub(super) back: Option<Return>,
    /// A standby master, and where it takes over.
    pub(super) standby: Option<String>,
}

/// Runs the handshake. `Err(reason)` means refuse with that reason; `Ok(None)` means the peer
/// left before saying anything.
pub(super) async fn handshake(
    r: &mut OwnedReadHalf,
    w: &mut OwnedWriteHalf,
    shared: &Shared,
) -> Result<Option<Admitted>, String> {
    let t = shared.config.handshake_timeout;
    let (protocol, binary_version, role, job) = match protocol::read_frame(r, t).await {
        Ok(None) => return Ok(None),
        Ok(Some(Message::Hello {
            protocol,
            binary_version,
            role,
            job,
        })) => (protocol, binary_version, role, job),
        Ok(Some(other)) => return Err(format!("expected hello, got {}", other.kind())),
        Err(e) => return Err(e.to_string()),
    };
    if protocol != PROTOCOL_VERSION {
        return Err(format!(
            "protocol version {protocol} is not supported (master speaks {PROTOCOL_VERSION})"
        ));
    }
    if binary_version != BINARY_VERSION {
        return Err(format!(
            "binary version {binary_version} differs from the master's {BINARY_VERSION}"
        ));
    }
    let standby = match &role {
        PeerRole::Standby { listen } => Some(listen.clone()),
        _ => None,
    };
    // What a returning agent says is believed only once it proved the token.
    let returning = match &role {
        PeerRole::Returning(r) => Some(r.clone()),
        _ => None,
    };
    let (node, devices, back) = match role {
        PeerRole::Agent { devices: 0 } => {
            return Err("an agent must offer at least one device".into())
        }
        PeerRole::Returning(Return { devices: 0, .. }) => {
            return Err("an agent must offer at least one device".into())
        }
        // Refused after the token is proven (`check_returning`): under its own id.
        PeerRole::Returning(r) if r.epoch > shared.config.epoch => (Some(r.node), r.devices, None),
        PeerRole::Agent { devices } => (Some(shared.new_node()), devices, None),
        // Its old id, if this master expects it back; a new one otherwise.
        PeerRole::Returning(r) if shared.returns().contains(&r.node) => {
            (Some(r.node), r.devices, Some(r))
        }
        // A master stopped past its lease starts again (or steps down) to take its agents
        // back (`carry::give_up_if_stopped`): none of them is a new node of it meanwhile.
        PeerRole::Returning(r) if shared.stopped_past_lease() => {
            return Err(format!(
                "node {}: this master was stopped past its lease and starts again (or steps \
                 down) to take its agents back; try again",
                r.node
            ))
        }
        PeerRole::Returning(r) => (Some(shared.new_node()), r.devices, None),
        PeerRole::Client => (None, 0, None),
        PeerRole::Standby { ref listen } if listen.parse::<SocketAddr>().is_err() => {
            return Err(format!(
                "a standby master must say where it takes over as IP:PORT, not {listen:?}"
            ))
        }
        PeerRole::Standby { .. } => (None, 0, None),
    };

    let nonce = auth::nonce();
    let challenge = Message::Challenge {
        node,
        nonce: nonce.clone(),
    };
    protocol::write_frame(w, &challenge, shared.config.write_timeout)
        .await
        .map_err(|e| e.to_string())?;
    let mac = match protocol::read_frame(r, t).await {
        Ok(Some(Message::AuthResponse { mac })) => mac,
        Ok(Some(other)) => return Err(format!("expected auth_response, got {}", other.kind())),
        Ok(None) => return Err("closed during authentication".into()),
        Err(e) => return Err(e.to_string()),
    };
    if !shared
        .config
        .token
        .verify(&nonce, node, PROTOCOL_VERSION, &mac)
    {
        return Err(
            "authentication failed: wrong token. The peer's token (--token, \
                    --token-stdin or OOBLECK_TOKEN) is not this master's: is it of another job?"
                .into(),
        );
    }
    check_job(job.as_deref(), shared.config.token.job())?;
    if let Some(r) = &returning {
        check_returning(r, back.is_some(), shared)?;
    }
    // Taken only now, by an agent that proved the token: once, whoever came first.
    if let Some(b) = &back {
        if !shared.returns().remove(&b.node) {
            return Err(format!(
                "node {} came back twice: its id was given back already",
                b.node
            ));
        }
    }
    Ok(Some(Admitted {
        node,
        devices,
        back,
        standby,
    }))
}

/// A returning agent (its token proven) that this master must not take: one that saw a master
/// of a higher epoch (this one was replaced: it steps down), or one of its own agents that
/// committed a step past what this master's run directory recorded (the directory is a stale
/// copy, of a standby dropped for lagging, say: re-adopting from it would replay and
/// disturb the job; the agent looks on for the master that has its step).
fn check_returning(r: &Return, adopting: bool, shared: &Shared) -> Result<(), String> {
    if r.epoch > shared.config.epoch {
        shared.emit(MasterEvent::Replaced { epoch: r.epoch });
        return Err(format!(
            "this master was replaced: its epoch {} is behind the agent's {}",
            shared.config.epoch, r.epoch
        ));
    }
    match shared.config.recorded {
        Some(recorded) if adopting && r.committed > recorded => Err(format!(
            "this master's run directory is behind the job: it recorded step {recorded} as \
                 committed, and this agent committed step {}; it is a stale copy and takes no \
                 agent back (the agent looks on for the master with its step)",
            r.committed
        )),
        _ => Ok(()),
    }
}

/// A peer of another named job (its token proven: the two jobs share a secret) is refused,
/// saying which jobs; where either side names no job there is nothing to compare.
fn check_job(peer: Option<&str>, ours: Option<&str>) -> Result<(), String> {
    match (peer, ours) {
        (Some(peer), Some(ours)) if peer != ours => Err(format!(
            "this agent is of job {peer:?} and this master runs job {ours:?}: the two jobs share \
             a token and this address. Point the agent at its own job's master (--master, \
             OOBLECK_MASTER, or its scheduler's node list), give each job its own OOBLECK_TOKEN, \
             or set OOBLECK_JOB to the job it should join"
        )),
        _ => Ok(()),
    }
}
