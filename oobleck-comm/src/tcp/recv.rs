//! A Data frame's payload off the socket: straight into a receiver's posted buffer when one of
//! exactly this length is waiting (see `Mailbox::claim`), else into a new `Vec` for the
//! mailbox.
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

/// How often a reader filling a posted buffer looks at its cancel flag.
const CANCEL_POLL: Duration = Duration::from_millis(5);

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
    if let Some(c) = (len > 0).then(|| mailbox.claim(key, len)).flatten() {
        let filled = fill(s, &c, len);
        match filled {
            Ok(Fill::Done) => {
                mailbox.release(c, true);
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

/// Reads `len` bytes into the claimed buffer, polling the cancel flag.
fn fill(s: &TcpStream, c: &Claim, len: usize) -> std::io::Result<Fill> {
    s.set_read_timeout(Some(CANCEL_POLL))?;
    let out = (|| {
        let mut got = 0;
        while got < len {
            if c.cancel.load(SeqCst) {
                return Ok(Fill::Cancelled(got));
            }
            // SAFETY: the claim gives this thread `len` bytes at `c.ptr` until released, and
            // `got < len`.
            let n = unsafe { libc::recv(s.as_raw_fd(), c.ptr.add(got).cast(), len - got, 0) };
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
    })();
    s.set_read_timeout(None)?;
    out
}
