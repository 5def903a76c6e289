//! The wire format of the TCP backend: fixed 40-byte headers, then the payload.
//!
//! ```text
//!  0        4        6        8               16               24               32       36       40
//!  +--------+--------+--------+----------------+----------------+----------------+--------+--------+
//!  | magic  |version | kind   | generation     | channel        | seq            | part   | len    |
//!  | u32 LE | u16 LE | u16 LE | u64 LE         | u64 LE         | u64 LE         | u32 LE | u32 LE |
//!  +--------+--------+--------+----------------+----------------+----------------+--------+--------+
//!  | payload: `len` bytes, len <= the receiver's cap (default 64 MiB)                               |
//!  +------------------------------------------------------------------------------------------------+
//! ```
//!
//! * `magic` is `b"OBKC"`; `version` is [`VERSION`]; anything else closes the connection.
//! * `kind` 1 = `Hello`, 2 = `Data`, 3 = `Challenge`. `Hello` and `Challenge` only set up a
//!   connection (channel, seq and part 0; payloads below; the exchange is drawn in
//!   `src/tcp/handshake.rs`). `Local` (4) follows the handshake on every connection: the two
//!   ranks compare hosts and agree on a shared-memory segment (`src/tcp/local.rs`).
//! * `generation` must equal the receiver's: a frame from another generation closes the
//!   connection with `StaleGeneration`.
//! * `(channel, seq, part)` names the message, so concurrent operations on different groups
//!   never confuse their frames: p2p messages use `channel = tag` (high bit clear) and a
//!   per-(peer, tag) counter; collectives use `channel = group id | 1 << 63` and a per-group
//!   operation counter, with `part` numbering the chunks of one operation.
//! * A clean close happens only between frames; a close inside a frame is `Truncated`.
//!
//! Handshake payloads. An unkeyed group sends only the 12-byte Hello. In a keyed group (the
//! master gave the generation a [`crate::SecretKey`]) the acceptor sends a Challenge as soon
//! as it accepts, and both Hellos carry a nonce and a MAC:
//!
//! ```text
//!   Hello, unkeyed (12 bytes)    from u32 LE | to u32 LE | world u32 LE
//!   Hello, keyed (76 bytes)      from u32 LE | to u32 LE | world u32 LE | nonce [32] | mac [32]
//!   Challenge (32 bytes)         nonce [32]
//!   Local, offer                 1 | enabled u8 | host identity (UTF-8, rest of the payload)
//!   Local, segment               2 | created u8 | segment file name (UTF-8, rest)
//!   Local, ack                   3 | mapped u8
//!
//!   mac = HMAC-SHA256(key, "oobleck-data-hello" | generation u64 LE | from u32 LE | to u32 LE
//!                          | world u32 LE | the receiver's nonce | the sender's nonce)
//! ```
//!
//! The connector's nonce is fresh; the acceptor's Hello repeats its Challenge's nonce. The MAC
//! binds the purpose, the generation, both ranks, the group size and both nonces, so a Hello
//! captured from one connection proves nothing on another. These frames extend version 1
//! rather than replace it (the version stays 1): an unkeyed group's bytes are exactly those of
//! earlier builds, and an earlier build meeting a keyed peer refuses it (`unknown frame kind
//! 3`, or a Hello of 76 bytes).

use std::io::{ErrorKind, IoSlice, Read, Write};

use crate::error::FrameError;
use crate::key::KEY_BYTES;

pub const MAGIC: u32 = u32::from_le_bytes(*b"OBKC");
pub const VERSION: u16 = 1;
pub const HEADER_LEN: usize = 40;
/// Default cap on a frame's payload.
pub const DEFAULT_MAX_FRAME: u32 = 64 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Hello = 1,
    Data = 2,
    Challenge = 3,
    /// Shared-memory setup between ranks of one host, right after the handshake
    /// (`src/tcp/local.rs`).
    Local = 4,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub kind: Kind,
    pub generation: u64,
    pub channel: u64,
    pub seq: u64,
    pub part: u32,
    pub len: u32,
}

impl Header {
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4..6].copy_from_slice(&VERSION.to_le_bytes());
        b[6..8].copy_from_slice(&(self.kind as u16).to_le_bytes());
        b[8..16].copy_from_slice(&self.generation.to_le_bytes());
        b[16..24].copy_from_slice(&self.channel.to_le_bytes());
        b[24..32].copy_from_slice(&self.seq.to_le_bytes());
        b[32..36].copy_from_slice(&self.part.to_le_bytes());
        b[36..40].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Validates a header: magic, version, kind, length cap and generation.
    pub fn decode(b: &[u8; HEADER_LEN], generation: u64, cap: u32) -> Result<Header, FrameError> {
        let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let magic = u32_at(0);
        if magic != MAGIC {
            return Err(FrameError::BadMagic {
                found: magic,
                expected: MAGIC,
            });
        }
        let version = u16_at(4);
        if version != VERSION {
            return Err(FrameError::BadVersion {
                found: version,
                supported: VERSION,
            });
        }
        let kind = match u16_at(6) {
            1 => Kind::Hello,
            2 => Kind::Data,
            3 => Kind::Challenge,
            4 => Kind::Local,
            k => return Err(FrameError::BadKind(k)),
        };
        let len = u32_at(36);
        if len > cap {
            return Err(FrameError::TooLong {
                len: len.into(),
                cap: cap.into(),
            });
        }
        let found = u64_at(8);
        if found != generation {
            return Err(FrameError::StaleGeneration {
                found,
                expected: generation,
            });
        }
        Ok(Header {
            kind,
            generation: found,
            channel: u64_at(16),
            seq: u64_at(24),
            part: u32_at(32),
            len,
        })
    }
}

/// Reads exactly `buf.len()` bytes; `Ok(false)` if the stream ended before the first byte.
fn read_full(r: &mut impl Read, buf: &mut [u8]) -> std::io::Result<Result<bool, FrameError>> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) if got == 0 => return Ok(Ok(false)),
            Ok(0) => {
                return Ok(Err(FrameError::Truncated {
                    got,
                    want: buf.len(),
                }))
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(Ok(true))
}

/// Outcome of reading one frame.
#[derive(Debug)]
pub enum ReadOutcome {
    /// A whole, valid frame.
    Frame(Header, Vec<u8>),
    /// The peer closed cleanly between frames.
    Closed,
    /// The bytes were not a valid frame; the connection must be closed.
    Bad(FrameError),
}

/// Reads and validates one frame's header (`None`: closed cleanly between frames); the
/// caller reads its `len` payload bytes.
pub(crate) fn read_header(
    r: &mut impl Read,
    generation: u64,
    cap: u32,
) -> std::io::Result<Result<Option<Header>, FrameError>> {
    let mut hb = [0u8; HEADER_LEN];
    match read_full(r, &mut hb)? {
        Ok(true) => {}
        Ok(false) => return Ok(Ok(None)),
        Err(e) => return Ok(Err(e)),
    }
    Ok(Header::decode(&hb, generation, cap).map(Some))
}

/// Reads one frame: the header is validated (magic, version, kind, cap, generation) before
/// any payload is read or allocated.
pub fn read_frame(r: &mut impl Read, generation: u64, cap: u32) -> std::io::Result<ReadOutcome> {
    let header = match read_header(r, generation, cap)? {
        Ok(Some(h)) => h,
        Ok(None) => return Ok(ReadOutcome::Closed),
        Err(e) => return Ok(ReadOutcome::Bad(e)),
    };
    let len = header.len as usize;
    // One allocation of the validated length: growing in steps would reallocate and copy
    // large payloads several times. The cap bounds what a lying header can make us reserve.
    let mut payload = Vec::with_capacity(len);
    // `read_to_end` fills spare capacity without zeroing it first.
    let got = r.by_ref().take(len as u64).read_to_end(&mut payload)?;
    if got < len {
        return Ok(ReadOutcome::Bad(FrameError::Truncated {
            got: HEADER_LEN + got,
            want: HEADER_LEN + len,
        }));
    }
    Ok(ReadOutcome::Frame(header, payload))
}

/// Writes one frame: header then the payload parts, without copying the payload.
pub fn write_frame(w: &mut impl Write, header: &Header, parts: &[&[u8]]) -> std::io::Result<()> {
    debug_assert_eq!(
        parts.iter().map(|p| p.len()).sum::<usize>(),
        header.len as usize
    );
    let h = header.encode();
    // One gathered write of header and payload, straight from the caller's buffers: no copy,
    // and a small frame leaves as one segment (with TCP_NODELAY a separate header write
    // would be a segment of its own).
    let mut slices: Vec<IoSlice> = std::iter::once(&h[..])
        .chain(parts.iter().copied())
        .filter(|p| !p.is_empty())
        .map(IoSlice::new)
        .collect();
    write_all_vectored(w, &mut slices)
}

/// `Write::write_all_vectored`, which is not stable yet.
fn write_all_vectored(w: &mut impl Write, mut bufs: &mut [IoSlice]) -> std::io::Result<()> {
    while !bufs.is_empty() {
        match w.write_vectored(bufs) {
            Ok(0) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::WriteZero,
                    "failed to write whole frame",
                ))
            }
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Bytes of an unkeyed `Hello` payload, of a keyed one and of a `Challenge` payload.
pub const HELLO_LEN: usize = 12;
pub const KEYED_HELLO_LEN: usize = HELLO_LEN + 2 * KEY_BYTES;
pub const CHALLENGE_LEN: usize = KEY_BYTES;

/// Payload of a keyed group's `Hello`: who is speaking to whom, a nonce, and the MAC that
/// proves the sender holds the generation's key (see the module doc for what it covers).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyedHello {
    pub from: u32,
    pub to: u32,
    pub world: u32,
    pub nonce: [u8; KEY_BYTES],
    pub mac: [u8; KEY_BYTES],
}

impl KeyedHello {
    pub fn encode(&self) -> [u8; KEYED_HELLO_LEN] {
        let mut b = [0u8; KEYED_HELLO_LEN];
        b[..HELLO_LEN].copy_from_slice(&encode_hello(self.from, self.to, self.world));
        b[HELLO_LEN..HELLO_LEN + KEY_BYTES].copy_from_slice(&self.nonce);
        b[HELLO_LEN + KEY_BYTES..].copy_from_slice(&self.mac);
        b
    }

    pub fn decode(p: &[u8]) -> Result<KeyedHello, FrameError> {
        if p.len() != KEYED_HELLO_LEN {
            return Err(FrameError::Malformed(format!(
                "keyed hello payload of {} bytes (expected {KEYED_HELLO_LEN})",
                p.len()
            )));
        }
        let (from, to, world) = decode_hello(&p[..HELLO_LEN])?;
        let key_bytes = |at: usize| -> [u8; KEY_BYTES] {
            p[at..at + KEY_BYTES].try_into().expect("KEY_BYTES bytes")
        };
        Ok(KeyedHello {
            from,
            to,
            world,
            nonce: key_bytes(HELLO_LEN),
            mac: key_bytes(HELLO_LEN + KEY_BYTES),
        })
    }
}

/// The nonce of a `Challenge` payload.
pub fn decode_challenge(p: &[u8]) -> Result<[u8; KEY_BYTES], FrameError> {
    p.try_into().map_err(|_| {
        FrameError::Malformed(format!(
            "challenge payload of {} bytes (expected {CHALLENGE_LEN})",
            p.len()
        ))
    })
}

/// Payload of an unkeyed group's `Hello` frame.
pub fn encode_hello(from: u32, to: u32, world: u32) -> [u8; 12] {
    let mut b = [0u8; 12];
    b[0..4].copy_from_slice(&from.to_le_bytes());
    b[4..8].copy_from_slice(&to.to_le_bytes());
    b[8..12].copy_from_slice(&world.to_le_bytes());
    b
}

pub fn decode_hello(p: &[u8]) -> Result<(u32, u32, u32), FrameError> {
    if p.len() != 12 {
        return Err(FrameError::Malformed(format!(
            "hello payload of {} bytes (expected 12)",
            p.len()
        )));
    }
    let at = |i: usize| u32::from_le_bytes(p[i..i + 4].try_into().expect("4 bytes"));
    Ok((at(0), at(4), at(8)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::io::Cursor;

    fn data(len: u32) -> Header {
        Header {
            kind: Kind::Data,
            generation: 7,
            channel: 3,
            seq: 9,
            part: 1,
            len,
        }
    }

    fn frame_bytes(h: &Header, payload: &[u8]) -> Vec<u8> {
        let mut v = Vec::new();
        write_frame(&mut v, h, &[payload]).unwrap();
        v
    }

    fn read(bytes: &[u8]) -> ReadOutcome {
        read_frame(&mut Cursor::new(bytes), 7, 1024).unwrap()
    }

    #[test]
    fn round_trips_small_and_large_frames() {
        for len in [0u32, 5, 1000] {
            let payload: Vec<u8> = (0..len).map(|i| i as u8).collect();
            match read(&frame_bytes(&data(len), &payload)) {
                ReadOutcome::Frame(h, p) => {
                    assert_eq!(h, data(len));
                    assert_eq!(p, payload);
                }
                other => panic!("expected a frame, got {other:?}"),
            }
        }
        let big: Vec<u8> = vec![1; 20 << 20];
        let bytes = frame_bytes(&data(big.len() as u32), &big);
        match read_frame(&mut Cursor::new(bytes), 7, 32 << 20).unwrap() {
            ReadOutcome::Frame(_, p) => assert_eq!(p, big),
            other => panic!("expected a frame, got {other:?}"),
        }
    }

    #[test]
    fn clean_close_between_frames_is_closed() {
        assert!(matches!(read(&[]), ReadOutcome::Closed));
    }

    #[test]
    fn rejects_wrong_magic() {
        let mut b = frame_bytes(&data(0), &[]);
        b[0] ^= 0xff;
        assert!(matches!(
            read(&b),
            ReadOutcome::Bad(FrameError::BadMagic { .. })
        ));
    }

    #[test]
    fn rejects_unknown_version_and_kind() {
        let mut b = frame_bytes(&data(0), &[]);
        b[4] = 99;
        assert!(matches!(
            read(&b),
            ReadOutcome::Bad(FrameError::BadVersion { found: 99, .. })
        ));
        let mut b = frame_bytes(&data(0), &[]);
        b[6] = 42;
        assert!(matches!(
            read(&b),
            ReadOutcome::Bad(FrameError::BadKind(42))
        ));
    }

    #[test]
    fn rejects_length_above_cap_before_reading_the_body() {
        let b = data(1025).encode();
        assert!(matches!(
            read(&b),
            ReadOutcome::Bad(FrameError::TooLong {
                len: 1025,
                cap: 1024
            })
        ));
    }

    #[test]
    fn rejects_truncated_header_and_body() {
        let b = frame_bytes(&data(100), &[0; 100]);
        assert!(matches!(
            read(&b[..10]),
            ReadOutcome::Bad(FrameError::Truncated { got: 10, want: 40 })
        ));
        assert!(matches!(
            read(&b[..90]),
            ReadOutcome::Bad(FrameError::Truncated { got: 90, want: 140 })
        ));
    }

    #[test]
    fn rejects_frames_of_another_generation() {
        let mut h = data(0);
        h.generation = 6;
        assert!(matches!(
            read(&frame_bytes(&h, &[])),
            ReadOutcome::Bad(FrameError::StaleGeneration {
                found: 6,
                expected: 7
            })
        ));
    }

    #[test]
    fn hello_payload_is_checked() {
        assert_eq!(decode_hello(&encode_hello(1, 2, 3)).unwrap(), (1, 2, 3));
        assert!(decode_hello(&[0; 11]).is_err());
    }

    #[test]
    fn keyed_hello_and_challenge_payloads_are_checked() {
        let h = KeyedHello {
            from: 2,
            to: 0,
            world: 3,
            nonce: [7; KEY_BYTES],
            mac: [9; KEY_BYTES],
        };
        let b = h.encode();
        assert_eq!(&b[..HELLO_LEN], &encode_hello(2, 0, 3));
        assert_eq!(KeyedHello::decode(&b).unwrap(), h);
        assert!(KeyedHello::decode(&b[..HELLO_LEN]).is_err());
        assert_eq!(
            decode_challenge(&[5; CHALLENGE_LEN]).unwrap(),
            [5; KEY_BYTES]
        );
        assert!(decode_challenge(&[5; CHALLENGE_LEN + 1]).is_err());
        let mut c = data(0);
        c.kind = Kind::Challenge;
        assert!(
            matches!(read(&frame_bytes(&c, &[])), ReadOutcome::Frame(h, _) if h.kind == Kind::Challenge)
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, rng_seed: proptest::test_runner::RngSeed::Fixed(4), failure_persistence: None, ..ProptestConfig::default() })]

        /// Random bytes never panic the decoder, and whatever it accepts is within the cap and
        /// of our generation.
        #[test]
        fn decoder_survives_random_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let mut cur = Cursor::new(&bytes[..]);
            while let ReadOutcome::Frame(h, p) = read_frame(&mut cur, 7, 64).unwrap() {
                prop_assert!(h.len <= 64);
                prop_assert_eq!(h.generation, 7);
                prop_assert_eq!(p.len(), h.len as usize);
            }
        }

        /// Valid headers with random fields survive mutation of one byte: accepted or rejected,
        /// never a panic.
        #[test]
        fn decoder_survives_mutated_valid_frames(len in 0u32..64, pos in 0usize..HEADER_LEN, byte in any::<u8>()) {
            let mut b = frame_bytes(&data(len), &vec![0xab; len as usize]);
            b[pos] = byte;
            let _ = read(&b);
        }
    }

    /// Takes at most 5 bytes per call, from one slice at a time: a socket's short writes.
    struct Trickle(Vec<u8>);

    impl Write for Trickle {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            let n = b.len().min(5);
            self.0.extend_from_slice(&b[..n]);
            Ok(n)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_frame_written_in_short_pieces_reads_back_whole() {
        let parts: [&[u8]; 3] = [b"abcdefg", b"", b"hijklmnopqrstuvwxyz"];
        let mut w = Trickle(Vec::new());
        write_frame(&mut w, &data(26), &parts).unwrap();
        match read_frame(&mut Cursor::new(w.0), 7, 1 << 20).unwrap() {
            ReadOutcome::Frame(h, p) => {
                assert_eq!(h, data(26));
                assert_eq!(p, b"abcdefghijklmnopqrstuvwxyz");
            }
            _ => panic!("not a frame"),
        }
    }
}
