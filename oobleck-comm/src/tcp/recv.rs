//! A Data frame's payload off the socket: straight into a receiver's posted buffer when one of
//! exactly this length is waiting (see `Mailbox::claim`), else into a new `Vec` for the
//! mailbox. A buffer posted to accumulate gets the payload added to it, read through a small
//! buffer that stays in cache.
//!
//! While it fills a posted buffer the socket reads with a short timeout, so the cancel flag
//! of a receiver that gave up (its deadline, an abort) is seen within milliseconds even when
//! the peer stalls mid-frame; the receiver waits for the release before it returns.

use std::io::{ErrorKind, Read};
use std::net::TcpStream;
use std::os::unix::io::AsRawFd;
use std::sync::atomic::Ordering::SeqCst;
use std::time::Duration;

use crate::error::FrameError;
use crate::frame::HEADER_LEN;
use crate::mailbox::{Claim, Key, Mailbox};
use crate::tensor::add_into;

/// How often a reader filling a posted buffer looks at its cancel flag.
const CANCEL_POLL: Duration = Duration::from_millis(5);

/// How much of an accumulated payload is read before it is added (a multiple of every
/// element size; small enough to stay in the core's cache between the read and the add).
const ADD_PIECE: usize = 64 << 10;

thread_local! {
    /// The reader thread's buffer for accumulated payloads, kept from one claim to the next.
    static PIECE: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

enum Fill {
    Done,
    /// The receiver gave up after this many bytes.
    Cancelled(usize),
    /// The connection ended after this many bytes.
    Eof(usize),
}

/// Reads `len` payload bytes of `key`: `None` when they went into a posted buffer.
pub(super) fn read_payload(
    s: &mut TcpStream,
    key: Key,
    len: usize,
    mailbox: &Mailbox,
) -> std::io::Result<Result<Option<Vec<u8>>, FrameError>> {
    let truncated = |got: usize| FrameError::Truncated {
        got: HEADER_LEN + got,
        want: HEADER_LEN + len,
    };
    // One allocation of the validated length (the frame cap bounds it).
    let mut buf: Vec<u8> = Vec::new();
    if let Some(c) = (len > 0).then(|| mailbox.claim(key, len, true)).flatten() {
        let filled = fill(s, &c, len);
        match filled {
            Ok(Fill::Done) => {
                mailbox.release(c, true);
                return Ok(Ok(None));
            }
            Ok(Fill::Cancelled(n)) if c.add.is_some() => {
                // The buffer holds partial sums: nothing to rebuild the message from, and its
                // receiver has failed. Drop it, keeping the stream in step.
                mailbox.release(c, false);
                let rest = (len - n) as u64;
                let got = std::io::copy(&mut s.by_ref().take(rest), &mut std::io::sink())?;
                if got < rest {
                    return Ok(Err(truncated(len - (rest - got) as usize)));
                }
                return Ok(Ok(None));
            }
            Ok(Fill::Cancelled(n)) => {
                // Keep the message whole for the mailbox, as if nobody had been waiting.
                buf.reserve_exact(len);
                // SAFETY: the claim keeps `c.ptr` valid for `len >= n` bytes until released;
                // `buf` has room for `len`.
                unsafe {
                    std::ptr::copy_nonoverlapping(c.ptr, buf.as_mut_ptr(), n);
                    buf.set_len(n);
                }
                mailbox.release(c, false);
            }
            Ok(Fill::Eof(n)) => {
                mailbox.release(c, false);
                return Ok(Err(truncated(n)));
            }
            Err(e) => {
                mailbox.release(c, false);
                return Err(e);
            }
        }
    } else {
        buf.reserve_exact(len);
    }
    let before = buf.len();
    // `read_to_end` fills spare capacity without zeroing it first.
    let got = s
        .by_ref()
        .take((len - before) as u64)
        .read_to_end(&mut buf)?;
    if before + got < len {
        return Ok(Err(truncated(before + got)));
    }
    Ok(Ok(Some(buf)))
}

/// Reads `len` bytes into the claimed buffer (or adds them to it), polling the cancel flag.
fn fill(s: &TcpStream, c: &Claim, len: usize) -> std::io::Result<Fill> {
    s.set_read_timeout(Some(CANCEL_POLL))?;
    let out = match c.add {
        // SAFETY: the claim gives this thread `len` bytes at `c.ptr` until released.
        None => unsafe { recv_exact(s, c, c.ptr, len) },
        Some(dtype) => PIECE.with_borrow_mut(|piece| {
            piece.resize(ADD_PIECE.min(len), 0);
            let mut done = 0;
            while done < len {
                let n = piece.len().min(len - done);
                // SAFETY: `piece` has room for `n` bytes.
                match unsafe { recv_exact(s, c, piece.as_mut_ptr(), n) }? {
                    Fill::Done => {}
                    Fill::Cancelled(got) => return Ok(Fill::Cancelled(done + got)),
                    Fill::Eof(got) => return Ok(Fill::Eof(done + got)),
                }
                // SAFETY: the claim gives this thread `len` bytes at `c.ptr` until released,
                // and `done + n <= len`.
                let acc = unsafe { std::slice::from_raw_parts_mut(c.ptr.add(done), n) };
                add_into(dtype, acc, &piece[..n]);
                done += n;
            }
            Ok(Fill::Done)
        }),
    };
    s.set_read_timeout(None)?;
    out
}

/// Reads exactly `len` bytes to `dst`, polling the claim's cancel flag.
///
/// # Safety
/// `dst` must be valid for writes of `len` bytes and not otherwise in use.
unsafe fn recv_exact(s: &TcpStream, c: &Claim, dst: *mut u8, len: usize) -> std::io::Result<Fill> {
    let mut got = 0;
    while got < len {
        if c.cancel.load(SeqCst) {
            return Ok(Fill::Cancelled(got));
        }
        // SAFETY: the caller gives `len` bytes at `dst`, and `got < len`.
        let n = unsafe { libc::recv(s.as_raw_fd(), dst.add(got).cast(), len - got, 0) };
        if n > 0 {
            got += n as usize;
            continue;
        }
        if n == 0 {
            return Ok(Fill::Eof(got));
        }
        let e = std::io::Error::last_os_error();
        if !matches!(
            e.kind(),
            ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
        ) {
            return Err(e);
        }
    }
    Ok(Fill::Done)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::{CommError, Op};
    use crate::mailbox::Due;
    use crate::tensor::DType;
    use std::io::Write;
    use std::net::TcpListener;
    use std::time::Instant;

    const N: usize = 100_000;

    fn f32_bytes(v: f32) -> Vec<u8> {
        bytemuck::cast_slice(&vec![v; N]).to_vec()
    }

    fn key() -> Key {
        Key {
            peer: 1,
            channel: 7,
            seq: 0,
            part: 3,
        }
    }

    fn due(after: Duration) -> Due {
        Due {
            deadline: Instant::now() + after,
            op: Op::AllReduce,
            timeout: after,
        }
    }

    /// A connected pair: (the reader's end, the writer's end).
    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let w = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        (l.accept().unwrap().0, w)
    }

    /// Starts a receiver that posts a buffer of ones to accumulate the message of `key()`,
    /// and waits until the post is in.
    fn post_ones(
        mailbox: &std::sync::Arc<Mailbox>,
        wait: Duration,
    ) -> std::thread::JoinHandle<(crate::error::Result<()>, Vec<u8>)> {
        let mb = mailbox.clone();
        let h = std::thread::spawn(move || {
            let mut acc = f32_bytes(1.0);
            let out = mb.take_into(
                &mut [(key(), &mut acc[..])],
                Some(DType::F32),
                due(wait),
                |_, got| CommError::Invalid(format!("length {got}")),
                |_, _| Ok(()),
            );
            (out, acc)
        });
        while !mailbox.is_posted(key()) {
            std::thread::sleep(Duration::from_millis(1));
        }
        h
    }

    #[test]
    fn a_payload_is_added_into_a_buffer_posted_to_accumulate() {
        let mailbox = std::sync::Arc::new(Mailbox::new(0, 2, 1));
        let receiver = post_ones(&mailbox, Duration::from_secs(30));
        let (mut r, mut w) = pair();
        let writer = std::thread::spawn(move || w.write_all(&f32_bytes(2.0)).unwrap());
        let got = read_payload(&mut r, key(), N * 4, &mailbox)
            .unwrap()
            .unwrap();
        assert!(
            got.is_none(),
            "went into the posted buffer, not the mailbox"
        );
        writer.join().unwrap();
        let (out, acc) = receiver.join().unwrap();
        out.unwrap();
        assert_eq!(acc, f32_bytes(3.0));
    }

    #[test]
    fn a_cancelled_accumulation_drops_the_message_and_keeps_the_stream_in_step() {
        let mailbox = std::sync::Arc::new(Mailbox::new(0, 2, 1));
        let receiver = post_ones(&mailbox, Duration::from_millis(300));
        let (mut r, mut w) = pair();
        let data = f32_bytes(2.0);
        let writer = std::thread::spawn(move || {
            w.write_all(&data[..data.len() / 2]).unwrap();
            // The receiver's deadline passes with half the payload read.
            std::thread::sleep(Duration::from_millis(600));
            w.write_all(&data[data.len() / 2..]).unwrap();
            w.write_all(b"nextfram").unwrap();
        });
        let got = read_payload(&mut r, key(), N * 4, &mailbox)
            .unwrap()
            .unwrap();
        assert!(got.is_none(), "dropped, not handed to the mailbox");
        let (out, _) = receiver.join().unwrap();
        assert!(matches!(out, Err(CommError::Timeout { .. })), "{out:?}");
        let mut next = [0u8; 8];
        r.read_exact(&mut next).unwrap();
        assert_eq!(&next, b"nextfram");
        writer.join().unwrap();
        let left = mailbox.take(key(), due(Duration::from_millis(20)));
        assert!(matches!(left, Err(CommError::Timeout { .. })), "{left:?}");
    }
}
