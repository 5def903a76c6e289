//! A drained node's worker as a **donor** (`reconfig::Donor`): it joins the next
//! generation's data plane, a rank after the plan's own, only to send the layers that no
//! node that stays holds; then it waits to be let go (its agent's `Shutdown` closes its
//! stdin). It runs no stage and never trains.

use std::time::Instant;

use super::inbox::{report, Inbox};
use super::state::{exchange, CopyHooks, Held};
use super::steps::BROKEN_WAIT;
use super::{connect_tcp, protocol, Flow, Listening, DATA_TIMEOUT};
use crate::planning::world_size;
use crate::runtime::error::Result;
use crate::runtime::wire::pipe::{StateSource, ToWorker, WorkerAssignment};
use crate::runtime::wire::records::WorkerReport;

/// How many donors the generation of `a` has.
pub(super) fn donors(a: &WorkerAssignment) -> usize {
    match &a.source {
        StateSource::Peers { donors, .. } => donors.len(),
        _ => 0,
    }
}

/// `a` makes this worker a donor: its rank is past the plan's.
pub(super) fn is_donor(a: &WorkerAssignment) -> bool {
    a.rank >= world_size(&a.plan)
}

/// Sends this donor's share of the copies, reports `Formed` (with no layers of its own), and
/// waits to be let go. The connection stays open until then, so every copy is read.
pub(super) fn donate(
    a: &WorkerAssignment,
    listening: Listening,
    inbox: &Inbox,
    mut held: Held,
) -> Result<Flow> {
    let rank = a.rank;
    let StateSource::Peers { step, copies, .. } = &a.source else {
        return Err(protocol(
            rank,
            "is a donor, but its generation does not start in place".into(),
        ));
    };
    if held.step != *step {
        return Err(protocol(
            rank,
            format!(
                "donates the state of step {}, but the plan resumes at step {step}",
                held.step
            ),
        ));
    }
    let world = world_size(&a.plan) as usize + donors(a);
    let connecting = Instant::now();
    let comm = connect_tcp(a, world, listening, inbox)?;
    let connect_s = connecting.elapsed().as_secs_f64();
    let copied = exchange(
        comm.as_ref(),
        rank,
        &mut held,
        copies,
        DATA_TIMEOUT,
        CopyHooks::none(),
    )?;
    tracing::info!(rank, layers = ?held.layer_list(), secs = copied.seconds, "donated");
    report(
        a.generation,
        &WorkerReport::Formed {
            rank,
            step: *step,
            layers: Vec::new(),
            connect_s,
            copy_s: copied.seconds,
            copy_bytes: 0,
        },
    )?;
    let next = inbox.next(BROKEN_WAIT, "being let go after donating layers");
    drop(comm);
    match next {
        Ok(ToWorker::Reassign { assignment }) => Ok(Flow::Next(assignment, held)),
        _ => Ok(Flow::Done),
    }
}
