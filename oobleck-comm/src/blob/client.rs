//! The client's side of one connection to a [`super::BlobSink`]: connect, read the hello,
//! send the request, then reads and writes that all stop at the call's deadline.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use super::wire::{self, BlobOp, Request, Status, HELLO_LEN, MAGIC, VERSION};
use crate::error::{CommError, Result};
use crate::key::{SecretKey, KEY_BYTES};

/// What a call is about, for its errors: every error of a call names the sink, the operation,
/// the name, and how far the body got.
pub(super) struct Call<'a> {
    pub(super) sink: SocketAddr,
    pub(super) op: BlobOp,
    pub(super) name: &'a str,
    /// The caller's timeout, for messages; `deadline` is what the reads and writes obey.
    pub(super) timeout: Duration,
    pub(super) deadline: Instant,
    /// Body bytes moved so far, and the body's length once known.
    pub(super) done: u64,
    pub(super) len: u64,
}

impl Call<'_> {
    /// The call broke off: no connection, a timeout, a bad answer, a connection closed early.
    pub(super) fn broken(&self, reason: String) -> CommError {
        let (sink, name) = (self.sink, self.name.to_string());
        match self.op {
            BlobOp::Put => CommError::BlobTransfer {
                sink,
                name,
                sent: self.done,
                len: self.len,
                reason,
            },
            BlobOp::Get | BlobOp::List => CommError::BlobFetch {
                sink,
                what: self.op.noun(),
                name,
                reason,
            },
        }
    }

    pub(super) fn fail(&self, what: &str, e: &std::io::Error) -> CommError {
        let reason = match e.kind() {
            ErrorKind::WouldBlock | ErrorKind::TimedOut => format!(
                "{what}: past the {}'s timeout of {:?}",
                self.op.noun(),
                self.timeout
            ),
            _ => format!("{what}: {e}"),
        };
        self.broken(reason)
    }

    /// The sink answered with a status other than 0.
    fn refused(&self, status: u8, message: String) -> CommError {
        let (sink, name) = (self.sink, self.name.to_string());
        let unauthorized = status == Status::Unauthorized as u8;
        match self.op {
            BlobOp::Put if unauthorized => CommError::BlobUnauthorized { sink, name },
            BlobOp::Put => CommError::BlobRefused {
                sink,
                name,
                message,
            },
            _ if status == Status::NotFound as u8 => CommError::BlobNotFound { sink, name },
            _ if unauthorized => self.broken(
                "the sink refused the request's MAC: this worker was given another job's or \
                 generation's key than the sink's (check that it asks with the key of the \
                 sink's current generation)"
                    .into(),
            ),
            _ => self.broken(format!("the sink refused: {message}")),
        }
    }

    /// The time left, or a timeout error once it is spent.
    fn left(&self, what: &str) -> Result<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(self.fail(what, &ErrorKind::TimedOut.into()));
        }
        Ok(left)
    }
}

/// One open connection whose request is sent.
pub(super) struct Client<'a> {
    pub(super) call: Call<'a>,
    s: TcpStream,
    /// Set by `open` once the hello gave the sink's nonce.
    request: Option<Request>,
    sink_nonce: [u8; KEY_BYTES],
}

impl<'a> Client<'a> {
    /// Connects, reads the sink's hello and sends the request for `call` (with the body's
    /// `len` and `sha256` for an upload, zeros otherwise).
    pub(super) fn open(
        call: Call<'a>,
        key: &SecretKey,
        len: u64,
        sha256: [u8; 32],
    ) -> Result<Client<'a>> {
        if call.name.len() > usize::from(u16::MAX) {
            return Err(CommError::Invalid(format!(
                "blob name of {} bytes (at most {})",
                call.name.len(),
                wire::MAX_NAME_BYTES
            )));
        }
        let timeout = call.deadline.saturating_duration_since(Instant::now());
        let s = TcpStream::connect_timeout(&call.sink, timeout.max(Duration::from_millis(1)))
            .map_err(|e| call.fail("connect", &e))?;
        let _ = s.set_nodelay(true);
        let mut c = Client {
            request: None,
            call,
            s,
            sink_nonce: [0; KEY_BYTES],
        };
        let mut hello = [0u8; HELLO_LEN];
        let what =
            "reading the sink's hello (a sink serving its limit of connections closes new ones)";
        c.read(&mut hello, what)?;
        if hello[..4] != MAGIC || hello[4..6] != VERSION.to_le_bytes() {
            return Err(c.call.broken(format!(
                "the peer is not a blob sink of version {VERSION} (hello starts {:02x?})",
                &hello[..6]
            )));
        }
        c.sink_nonce.copy_from_slice(&hello[6..]);
        let request = Request::new(key, &c.sink_nonce, c.call.op, c.call.name, len, sha256);
        c.write(&request.encode())?;
        c.request = Some(request);
        Ok(c)
    }

    /// Fills `buf` exactly.
    pub(super) fn read(&mut self, mut buf: &mut [u8], what: &str) -> Result<()> {
        while !buf.is_empty() {
            let left = self.call.left(what)?;
            (self.s.set_read_timeout(Some(left))).map_err(|e| self.call.fail(what, &e))?;
            match self.s.read(buf) {
                Ok(0) => return Err(self.call.fail(what, &ErrorKind::UnexpectedEof.into())),
                Ok(n) => buf = &mut buf[n..],
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(self.call.fail(what, &e)),
            }
        }
        Ok(())
    }

    /// Writes `buf`; if the sink broke the connection off, returns its reason when it gave one.
    pub(super) fn write(&mut self, mut buf: &[u8]) -> Result<()> {
        while !buf.is_empty() {
            let left = self.call.left("sending")?;
            (self.s.set_write_timeout(Some(left))).map_err(|e| self.call.fail("sending", &e))?;
            match self.s.write(buf) {
                Ok(0) => return Err(self.call.fail("sending", &ErrorKind::WriteZero.into())),
                Ok(n) => buf = &buf[n..],
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    // A sink that refuses mid-body (a disk error) answers, then closes.
                    let err = self.call.fail("sending", &e);
                    return Err(match self.read_answer() {
                        Ok((status, message)) if status != 0 => self.call.refused(status, message),
                        _ => err,
                    });
                }
            }
        }
        Ok(())
    }

    /// Reads one answer: its message for status 0, else the sink's refusal.
    pub(super) fn answer(&mut self) -> Result<String> {
        let (status, message) = self.read_answer()?;
        match status {
            0 => Ok(message),
            s => Err(self.call.refused(s, message)),
        }
    }

    fn read_answer(&mut self) -> Result<(u8, String)> {
        let what = "reading the sink's answer";
        let mut head = [0u8; 3];
        self.read(&mut head, what)?;
        let mut msg = vec![0u8; usize::from(u16::from_le_bytes([head[1], head[2]]))];
        self.read(&mut msg, what)?;
        Ok((head[0], String::from_utf8_lossy(&msg).into_owned()))
    }

    /// Reads the MAC after an answer's `payload` and checks that the sink holds the key.
    pub(super) fn check_answer_mac(&mut self, key: &SecretKey, payload: &[&[u8]]) -> Result<()> {
        let mut mac = [0u8; KEY_BYTES];
        self.read(&mut mac, "reading the answer's MAC")?;
        let request = (self.request.as_ref()).expect("open returns a Client with its request");
        if request.answer_verifies(key, &self.sink_nonce, payload, &mac) {
            return Ok(());
        }
        Err(self.call.broken(format!(
            "the answer's MAC does not verify under this worker's key: what answers at {} is \
             not a sink holding this generation's key (check the master's address and that \
             the worker was given the current generation's key)",
            self.call.sink
        )))
    }
}
