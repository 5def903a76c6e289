//! A single-producer single-consumer byte ring in a shared segment: one direction of a pair
//! of ranks on one host. Messages are streamed through it, so any size fits any ring.
//!
//! ```text
//!   base+0    head   u64   bytes ever written (only the writer stores it)
//!   base+64   tail   u64   bytes ever consumed (only the reader stores it)
//!   base+128  data_seq u32, reader_waiting u32     futex: "head moved", reader asleep
//!   base+192  space_seq u32, writer_waiting u32    futex: "tail moved", writer asleep
//!   base+256  data[cap]: records of channel u64 | seq u64 | part u32 | len u32 | payload,
//!             each padded to 8 bytes, wrapping at cap
//! ```
//!
//! The writer copies bytes, then publishes `head` (SeqCst, so the bytes happen-before the
//! reader's load of it); the reader copies out, then publishes `tail`. Both publish every
//! `PUBLISH` bytes, so the two copies of a long message overlap. A side with nothing to
//! do spins briefly, then sleeps on the futex word the other side bumps after publishing; the
//! sleep is capped (a few ms), so stop flags and deadlines are seen soon even if a wake-up
//! were lost.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::segment::{futex_wait, futex_wake, Segment};
use crate::comm::Rank;
use crate::error::{CommError, FrameError, Result};
use crate::mailbox::{Key, Mailbox};

pub(crate) const RING_HEADER: usize = 256;
const MSG_HEADER: usize = 24;
const SPINS: u32 = 64;
const NAP: Duration = Duration::from_millis(5);
/// Bytes either side copies before it publishes its position: the writer fills chunk k+1
/// while the reader drains chunk k, so a large message streams with both copies running at
/// once instead of alternating ring-sized halves.
const PUBLISH: usize = 64 << 10;

/// One direction of a pair, `cap` data bytes at `base` in `seg`.
#[derive(Clone)]
pub(crate) struct Ring {
    seg: Arc<Segment>,
    base: usize,
    cap: usize,
}

impl Ring {
    pub fn new(seg: Arc<Segment>, base: usize, cap: usize) -> Ring {
        assert!(
            base % 64 == 0 && base + RING_HEADER + cap <= seg.len(),
            "ring inside its segment"
        );
        Ring { seg, base, cap }
    }

    fn head(&self) -> &AtomicU64 {
        self.seg.atomic_u64(self.base)
    }
    fn tail(&self) -> &AtomicU64 {
        self.seg.atomic_u64(self.base + 64)
    }
    fn data_seq(&self) -> &AtomicU32 {
        self.seg.atomic_u32(self.base + 128)
    }
    fn reader_waiting(&self) -> &AtomicU32 {
        self.seg.atomic_u32(self.base + 132)
    }
    fn space_seq(&self) -> &AtomicU32 {
        self.seg.atomic_u32(self.base + 192)
    }
    fn writer_waiting(&self) -> &AtomicU32 {
        self.seg.atomic_u32(self.base + 196)
    }

    /// Copies `src` to stream position `pos` (wrapping).
    fn copy_in(&self, pos: u64, src: &[u8]) {
        let off = (pos % self.cap as u64) as usize;
        let first = src.len().min(self.cap - off);
        // SAFETY: both ranges lie inside the ring's data area; the protocol (head/tail) gives
        // the writer these bytes exclusively until it publishes them.
        unsafe {
            let data = self.seg.ptr().add(self.base + RING_HEADER);
            std::ptr::copy_nonoverlapping(src.as_ptr(), data.add(off), first);
            std::ptr::copy_nonoverlapping(src.as_ptr().add(first), data, src.len() - first);
        }
    }

    /// Copies from stream position `pos` into `dst` (wrapping).
    fn copy_out(&self, pos: u64, dst: *mut u8, len: usize) {
        let off = (pos % self.cap as u64) as usize;
        let first = len.min(self.cap - off);
        // SAFETY: inside the data area; the reader owns published, unconsumed bytes; `dst`
        // has room for `len` bytes (the caller's buffer).
        unsafe {
            let data = self.seg.ptr().add(self.base + RING_HEADER);
            std::ptr::copy_nonoverlapping(data.add(off), dst, first);
            std::ptr::copy_nonoverlapping(data, dst.add(first), len - first);
        }
    }

    /// Wakes the reader (new data, or a local stop/close it must see).
    pub fn wake_reader(&self) {
        self.data_seq().fetch_add(1, SeqCst);
        if self.reader_waiting().load(SeqCst) != 0 {
            futex_wake(self.data_seq());
        }
    }

    fn wake_writer(&self) {
        self.space_seq().fetch_add(1, SeqCst);
        if self.writer_waiting().load(SeqCst) != 0 {
            futex_wake(self.space_seq());
        }
    }
}

/// Waits (spin, then futex naps) until `ready()`; `give_up()` is checked between naps.
fn wait_until<E>(
    seq: &AtomicU32,
    waiting: &AtomicU32,
    ready: impl Fn() -> bool,
    give_up: impl Fn() -> Option<E>,
) -> Result<(), E> {
    // No `yield_now` between spinning and sleeping: on a busy machine a yield hands the core
    // to a compute thread for its whole slice (~2 ms per wait: a 4 KiB shm all-reduce took
    // 2.2 ms under `OOBLECK_BENCH_LOAD=2`, 120 us without the yields), while a futex sleeper
    // is woken at once.
    for _ in 0..SPINS {
        if ready() {
            return Ok(());
        }
        std::hint::spin_loop();
    }
    loop {
        let s = seq.load(SeqCst);
        waiting.store(1, SeqCst);
        if ready() {
            waiting.store(0, SeqCst);
            return Ok(());
        }
        futex_wait(seq, s, NAP);
        waiting.store(0, SeqCst);
        if ready() {
            return Ok(());
        }
        if let Some(e) = give_up() {
            return Err(e);
        }
    }
}

/// The sending end of a ring; `write` may be called from many threads (one at a time).
pub(crate) struct RingWriter {
    ring: Ring,
    lock: Mutex<()>,
}

impl RingWriter {
    pub fn new(ring: Ring) -> Self {
        RingWriter {
            ring,
            lock: Mutex::new(()),
        }
    }

    /// Streams one message. `check` is asked while waiting for space (abort, peer failure);
    /// at `deadline` the wait fails with `timed_out()`.
    pub fn write(
        &self,
        (channel, seq, part): (u64, u64, u32),
        parts: &[&[u8]],
        deadline: Instant,
        check: impl Fn() -> Option<CommError>,
        timed_out: impl Fn() -> CommError,
    ) -> Result<()> {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        let len32 = u32::try_from(len)
            .map_err(|_| CommError::Invalid(format!("message of {len} bytes")))?;
        let mut hdr = [0u8; MSG_HEADER];
        hdr[0..8].copy_from_slice(&channel.to_le_bytes());
        hdr[8..16].copy_from_slice(&seq.to_le_bytes());
        hdr[16..20].copy_from_slice(&part.to_le_bytes());
        hdr[20..24].copy_from_slice(&len32.to_le_bytes());
        let r = &self.ring;
        let _g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let mut head = r.head().load(SeqCst);
        let pad = (8 - (MSG_HEADER + len) % 8) % 8;
        let zeros = [0u8; 8];
        for piece in std::iter::once(&hdr[..])
            .chain(parts.iter().copied())
            .chain(std::iter::once(&zeros[..pad]))
        {
            let mut done = 0;
            while done < piece.len() {
                let free = r.cap - (head - r.tail().load(SeqCst)) as usize;
                if free == 0 {
                    // Let the reader drain what is written, then wait for room.
                    r.head().store(head, SeqCst);
                    r.wake_reader();
                    wait_until(
                        r.space_seq(),
                        r.writer_waiting(),
                        || (head - r.tail().load(SeqCst)) < r.cap as u64,
                        || check().or_else(|| (Instant::now() >= deadline).then(&timed_out)),
                    )?;
                    continue;
                }
                let n = free.min(piece.len() - done).min(PUBLISH);
                r.copy_in(head, &piece[done..done + n]);
                head += n as u64;
                done += n;
                if n == PUBLISH {
                    r.head().store(head, SeqCst);
                    r.wake_reader();
                }
            }
        }
        r.head().store(head, SeqCst);
        r.wake_reader();
        Ok(())
    }
}

/// This rank's local view of one shared-memory peer: the incoming ring and why to stop.
pub(crate) struct Link {
    pub incoming: Ring,
    /// Set by our abort or drop: exit without failing the peer.
    pub stop: AtomicBool,
    /// Set by the TCP reader when the peer's connection ends: deliver every complete message
    /// still in the ring, then fail the peer with this error.
    pub closed: Mutex<Option<CommError>>,
}

impl Link {
    pub fn new(incoming: Ring) -> Self {
        Link {
            incoming,
            stop: AtomicBool::new(false),
            closed: Mutex::new(None),
        }
    }

    pub fn stop(&self) {
        self.stop.store(true, SeqCst);
        self.incoming.wake_reader();
    }

    pub fn close(&self, err: CommError) {
        self.closed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert(err);
        self.incoming.wake_reader();
    }

    fn closed_error(&self) -> Option<CommError> {
        self.closed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

enum Exit {
    Stop,
    Failed(CommError),
    /// The receiver gave up on the buffer we were filling (only while filling a claim).
    Cancelled,
}

/// Waits until `need` bytes past `tail` are published, giving up on stop, the peer's end or
/// the cancel flag.
type WaitFn<'a> = &'a dyn Fn(u64, u64, Option<&AtomicBool>) -> Result<(), Exit>;

/// Copies the body bytes `got..len` of the message at `*tail` into `dst`, publishing `tail`
/// as it goes; returns how many bytes are in `dst` and why it stopped early, if it did.
fn read_body(
    r: &Ring,
    tail: &mut u64,
    dst: *mut u8,
    mut got: usize,
    len: usize,
    wait: WaitFn,
    cancel: Option<&AtomicBool>,
) -> (usize, Option<Exit>) {
    while got < len {
        if cancel.is_some_and(|c| c.load(SeqCst)) {
            return (got, Some(Exit::Cancelled));
        }
        if let Err(e) = wait(*tail, 1, cancel) {
            return (got, Some(e));
        }
        let avail = (r.head().load(SeqCst) - *tail) as usize;
        let n = avail.min(len - got).min(PUBLISH);
        // SAFETY: `dst` has room for `len` bytes and `got + n <= len`.
        r.copy_out(*tail, unsafe { dst.add(got) }, n);
        got += n;
        *tail += n as u64;
        r.tail().store(*tail, SeqCst);
        r.wake_writer();
    }
    (got, None)
}

/// Reads one message body of `len` bytes: straight into the receiver's posted buffer when it
/// has one of that length (`Ok(None)`), else into a new `Vec` for the mailbox.
fn read_message(
    r: &Ring,
    tail: &mut u64,
    key: Key,
    len: usize,
    mailbox: &Mailbox,
    wait: WaitFn,
) -> Result<Option<Vec<u8>>, Exit> {
    let mut buf: Vec<u8> = Vec::new();
    let mut got = 0;
    if let Some(claim) = mailbox.claim(key, len, false) {
        match read_body(r, tail, claim.ptr, 0, len, wait, Some(&claim.cancel)) {
            (_, None) => {
                mailbox.release(claim, true);
                return Ok(None);
            }
            (n, Some(Exit::Cancelled)) => {
                // The receiver is gone (its op failed): keep the message whole in a Vec.
                buf.reserve_exact(len);
                // SAFETY: the claim keeps `claim.ptr` valid until released; `n <= len`.
                unsafe { std::ptr::copy_nonoverlapping(claim.ptr, buf.as_mut_ptr(), n) };
                got = n;
                mailbox.release(claim, false);
            }
            (_, Some(e)) => {
                mailbox.release(claim, false);
                return Err(e);
            }
        }
    } else {
        buf.reserve_exact(len);
    }
    let (n, end) = read_body(r, tail, buf.as_mut_ptr(), got, len, wait, None);
    if let Some(e) = end {
        return Err(e);
    }
    // SAFETY: the first `len` bytes were written above (`n == len`).
    unsafe { buf.set_len(n) };
    Ok(Some(buf))
}

/// The reader thread of one link: moves every message into the mailbox (or a receiver's
/// posted buffer) until stopped or the peer is gone. `cap` bounds a message's length (the
/// frame cap of the TCP path).
pub(crate) fn read_loop(link: &Link, peer: Rank, generation: u64, cap: u32, mailbox: &Mailbox) {
    let r = &link.incoming;
    let mut tail = r.tail().load(SeqCst);
    // Waits until `need` bytes past `tail` are published; a closed peer's last bytes count.
    let wait = |tail: u64, need: u64, cancel: Option<&AtomicBool>| -> Result<(), Exit> {
        wait_until(
            r.data_seq(),
            r.reader_waiting(),
            || r.head().load(SeqCst) - tail >= need,
            || {
                if link.stop.load(SeqCst) {
                    return Some(Exit::Stop);
                }
                if cancel.is_some_and(|c| c.load(SeqCst)) {
                    return Some(Exit::Cancelled);
                }
                let err = link.closed_error()?;
                // The peer is gone, so `head` is final: what is not there now never comes.
                (r.head().load(SeqCst) - tail < need).then_some(Exit::Failed(err))
            },
        )
    };
    let exit = loop {
        if let Err(e) = wait(tail, MSG_HEADER as u64, None) {
            break e;
        }
        let mut hdr = [0u8; MSG_HEADER];
        r.copy_out(tail, hdr.as_mut_ptr(), MSG_HEADER);
        let word = |a: usize| u64::from_le_bytes(hdr[a..a + 8].try_into().expect("8 bytes"));
        let part = u32::from_le_bytes(hdr[16..20].try_into().expect("4 bytes"));
        let len = u32::from_le_bytes(hdr[20..24].try_into().expect("4 bytes"));
        if len > cap {
            break Exit::Failed(CommError::Frame {
                peer: Some(peer),
                source: FrameError::TooLong {
                    len: len.into(),
                    cap: cap.into(),
                },
            });
        }
        tail += MSG_HEADER as u64;
        let len = len as usize;
        let key = Key {
            peer,
            channel: word(0),
            seq: word(8),
            part,
        };
        let body = match read_message(r, &mut tail, key, len, mailbox, &wait) {
            Ok(b) => b,
            Err(e) => break e,
        };
        let pad = ((8 - (MSG_HEADER + len) % 8) % 8) as u64;
        if let Err(e) = wait(tail, pad, None) {
            break e;
        }
        tail += pad;
        r.tail().store(tail, SeqCst);
        r.wake_writer();
        if let Some(buf) = body {
            mailbox.deliver(key, None, buf);
        }
    };
    if let Exit::Failed(err) = exit {
        tracing::debug!(peer, generation, error = %err, "shared-memory link ended");
        mailbox.fail_peer(peer, err);
    }
}
