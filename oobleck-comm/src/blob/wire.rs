//! The bytes of the blob protocol drawn in the module doc of [`super`]: the hello, requests,
//! answers, the MACs of both directions, and which names a sink accepts.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;

use crate::key::{SecretKey, KEY_BYTES};

pub(super) const MAGIC: [u8; 4] = *b"OBKB";
/// Version 1 knew only uploads; version 2 adds the operation byte and the client's nonce.
pub(super) const VERSION: u16 = 2;
/// Purpose label bound into every request's MAC, so it cannot pass for another protocol's.
const LABEL: &[u8] = b"oobleck-blob";
/// Label of the sink's answer MACs: not a prefix of [`LABEL`] nor the reverse, so a request's
/// MAC can never stand for an answer's.
const ANSWER_LABEL: &[u8] = b"oobleck-sink";
/// Longest name, in bytes (a common file-name limit; names are short relative paths).
pub(super) const MAX_NAME_BYTES: usize = 255;
/// Longest message the sink sends in an answer.
const MAX_MESSAGE: usize = 1024;
pub(super) const HELLO_LEN: usize = 4 + 2 + KEY_BYTES;

/// What a request asks for: the byte after the version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(super) enum BlobOp {
    Put = 1,
    Get = 2,
    List = 3,
}

impl BlobOp {
    fn from_byte(b: u8) -> Option<BlobOp> {
        [BlobOp::Put, BlobOp::Get, BlobOp::List]
            .into_iter()
            .find(|op| *op as u8 == b)
    }

    /// The word for it in errors and logs.
    pub(super) fn noun(self) -> &'static str {
        match self {
            BlobOp::Put => "upload",
            BlobOp::Get => "download",
            BlobOp::List => "listing",
        }
    }
}

/// The status byte of an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(super) enum Status {
    Ok = 0,
    BadHeader = 1,
    Unauthorized = 2,
    BadName = 3,
    TooLarge = 4,
    Busy = 5,
    Checksum = 6,
    Short = 7,
    Disk = 8,
    NotFound = 9,
}

/// A refusal: the status and reason the client is told.
pub(super) struct Refusal(pub(super) Status, pub(super) String);

impl Refusal {
    pub(super) fn net(what: &str, e: &std::io::Error) -> Refusal {
        Refusal(Status::Short, format!("connection broke while {what}: {e}"))
    }
}

/// A client's request, as sent after the sink's hello.
pub(super) struct Request {
    pub(super) op: BlobOp,
    /// The client's nonce: the sink binds it into its answer's MAC.
    pub(super) nonce: [u8; KEY_BYTES],
    pub(super) name: Vec<u8>,
    /// The body's length and hash (an upload's; zero for a get or a list).
    pub(super) len: u64,
    pub(super) sha256: [u8; 32],
    pub(super) mac: [u8; KEY_BYTES],
}

impl Request {
    /// A request with its MAC under `key` and the sink's hello `sink_nonce`.
    pub(super) fn new(
        key: &SecretKey,
        sink_nonce: &[u8],
        op: BlobOp,
        name: &str,
        len: u64,
        sha256: [u8; 32],
    ) -> Request {
        let mut r = Request {
            op,
            nonce: crate::key::nonce(),
            name: name.as_bytes().to_vec(),
            len,
            sha256,
            mac: [0; KEY_BYTES],
        };
        r.mac = r.with_mac_parts(sink_nonce, |parts| key.mac(parts));
        r
    }

    /// Calls `f` with `[LABEL, sink nonce, op, client nonce, name, len, sha256]`: the name is
    /// the only part of variable length, so no two requests share the bytes the MAC covers.
    fn with_mac_parts<T>(&self, sink_nonce: &[u8], f: impl FnOnce(&[&[u8]]) -> T) -> T {
        let (op, len) = ([self.op as u8], self.len.to_le_bytes());
        f(&[
            LABEL,
            sink_nonce,
            &op,
            &self.nonce,
            &self.name,
            &len,
            &self.sha256,
        ])
    }

    pub(super) fn verifies(&self, key: &SecretKey, sink_nonce: &[u8]) -> bool {
        self.with_mac_parts(sink_nonce, |parts| key.verify(parts, &self.mac))
    }

    /// The MAC of an answer to this request: `[ANSWER_LABEL, client nonce, sink nonce, op,
    /// name_len, name, payload...]`, so it vouches for this request's answer only.
    pub(super) fn answer_mac(
        &self,
        key: &SecretKey,
        sink_nonce: &[u8],
        payload: &[&[u8]],
    ) -> [u8; KEY_BYTES] {
        self.with_answer_parts(sink_nonce, payload, |parts| key.mac(parts))
    }

    /// Whether `mac` is [`Request::answer_mac`] of `payload` (in constant time).
    pub(super) fn answer_verifies(
        &self,
        key: &SecretKey,
        sink_nonce: &[u8],
        payload: &[&[u8]],
        mac: &[u8],
    ) -> bool {
        self.with_answer_parts(sink_nonce, payload, |parts| key.verify(parts, mac))
    }

    fn with_answer_parts<T>(
        &self,
        sink_nonce: &[u8],
        payload: &[&[u8]],
        f: impl FnOnce(&[&[u8]]) -> T,
    ) -> T {
        let (op, name_len) = ([self.op as u8], (self.name.len() as u16).to_le_bytes());
        let head: [&[u8]; 6] = [
            ANSWER_LABEL,
            &self.nonce,
            sink_nonce,
            &op,
            &name_len,
            &self.name,
        ];
        f(&[&head[..], payload].concat())
    }

    /// The request on the wire; `name` is at most `u16::MAX` bytes (the caller checked).
    pub(super) fn encode(&self) -> Vec<u8> {
        let name_len = u16::try_from(self.name.len()).expect("the caller checked the length");
        [
            &MAGIC[..],
            &VERSION.to_le_bytes(),
            &[self.op as u8],
            &self.nonce,
            &name_len.to_le_bytes(),
            &self.name,
            &self.len.to_le_bytes(),
            &self.sha256,
            &self.mac,
        ]
        .concat()
    }
}

/// The sink's first bytes on every connection.
pub(super) fn hello(nonce: &[u8; KEY_BYTES]) -> Vec<u8> {
    [&MAGIC[..], &VERSION.to_le_bytes(), nonce].concat()
}

/// Reads a request, refusing another magic, version or operation before reading further.
pub(super) fn read_request(s: &mut TcpStream) -> Result<Request, Refusal> {
    let read = |s: &mut TcpStream, buf: &mut [u8]| {
        (s.read_exact(buf)).map_err(|e| Refusal::net("reading the request", &e))
    };
    let mut start = [0u8; 6];
    read(s, &mut start)?;
    let version = u16::from_le_bytes([start[4], start[5]]);
    if start[..4] != MAGIC {
        let why = format!("not a blob request (magic {:02x?})", &start[..4]);
        return Err(Refusal(Status::BadHeader, why));
    }
    if version != VERSION {
        let why = format!(
            "this sink speaks blob protocol version {VERSION}, the request is version \
             {version}: run the same build on the master and the workers"
        );
        return Err(Refusal(Status::BadHeader, why));
    }
    let mut fixed = [0u8; 1 + KEY_BYTES + 2];
    read(s, &mut fixed)?;
    let Some(op) = BlobOp::from_byte(fixed[0]) else {
        let why = format!(
            "unknown operation {} (this sink serves put 1, get 2, list 3)",
            fixed[0]
        );
        return Err(Refusal(Status::BadHeader, why));
    };
    let mut name = vec![0u8; usize::from(u16::from_le_bytes([fixed[33], fixed[34]]))];
    read(s, &mut name)?;
    let mut tail = [0u8; 8 + 32 + KEY_BYTES];
    read(s, &mut tail)?;
    Ok(Request {
        op,
        nonce: fixed[1..33].try_into().expect("32 bytes"),
        name,
        len: u64::from_le_bytes(tail[..8].try_into().expect("8 bytes")),
        sha256: tail[8..40].try_into().expect("32 bytes"),
        mac: tail[40..].try_into().expect("32 bytes"),
    })
}

/// An answer's bytes: status, message length, message (cut to `MAX_MESSAGE` bytes).
pub(super) fn answer(status: Status, message: &str) -> Vec<u8> {
    let mut end = message.len().min(MAX_MESSAGE);
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    let len = (end as u16).to_le_bytes();
    [&[status as u8][..], &len, &message.as_bytes()[..end]].concat()
}

pub(super) fn write_answer(
    s: &mut TcpStream,
    status: Status,
    message: &str,
) -> std::io::Result<()> {
    s.write_all(&answer(status, message))?;
    s.flush()
}

/// A name as the sink accepts it: a relative path of normal components, which it joins to its
/// root. Returns the reason (saying what a name must look like) otherwise. Clients check the
/// names of a listing with it too.
pub(super) fn check_name(raw: &[u8]) -> Result<PathBuf, String> {
    let rule = "a blob name is a relative path of 1 to 255 bytes of UTF-8 whose '/'-separated \
                components are not empty, '.' or '..', with no NUL, backslash or control \
                characters and not ending in '.partial' (e.g. 'gen-3/stage-1/params.safetensors')";
    let got = String::from_utf8_lossy(raw);
    let bad = |why: &str| Err(format!("{rule}; got {got:?}: {why}"));
    let Ok(name) = std::str::from_utf8(raw) else {
        return bad("not UTF-8");
    };
    if name.is_empty() || name.len() > MAX_NAME_BYTES {
        return bad(&format!("{} bytes", name.len()));
    }
    if name.starts_with('/') {
        return bad("absolute");
    }
    if let Some(c) = name.chars().find(|&c| c.is_control() || c == '\\') {
        return bad(&format!("contains {c:?}"));
    }
    if let Some(c) = name
        .split('/')
        .find(|c| c.is_empty() || *c == "." || *c == "..")
    {
        return bad(&format!("has a component {c:?}"));
    }
    if name.ends_with(".partial") {
        return bad("ends in '.partial', the suffix of files being uploaded");
    }
    // What is left has only `Component::Normal`s: it stays under the root it is joined to.
    Ok(PathBuf::from(name))
}
