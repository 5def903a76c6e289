//! Tests of the control protocol's framing and messages.

use super::*;
use proptest::prelude::*;

const T: Duration = Duration::from_secs(2);

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a current-thread runtime always builds")
}

fn decode_all(bytes: &[u8]) -> WireResult<Option<Message>> {
    rt().block_on(async {
        let mut r = bytes;
        read_frame(&mut r, T).await
    })
}

fn samples() -> Vec<Message> {
    vec![
        Message::Hello {
            protocol: PROTOCOL_VERSION,
            binary_version: "0.1.0".into(),
            role: PeerRole::Agent { devices: 2 },
            job: Some("4242".into()),
        },
        Message::Challenge {
            node: Some(3),
            nonce: vec![7; 32],
        },
        Message::Heartbeat { node: 3, seq: 9 },
        Message::StatusRequest,
        Message::Refused {
            reason: "bad token".into(),
        },
        Message::Worker {
            node: 1,
            generation: 2,
            report: WorkerReport::Ready {
                rank: 2,
                step: 7,
                loss: 3.25,
                grad_norm: 0.5,
                microbatches: vec![0, 1],
                samples: Some(7),
                times: None,
            },
        },
        Message::Worker {
            node: 1,
            generation: 2,
            report: WorkerReport::Exited {
                rank: 4,
                status: ExitStatus {
                    code: Some(1),
                    signal: None,
                },
                error: Some("Error: rank 3 lost".into()),
            },
        },
    ]
}

#[test]
fn every_sample_message_round_trips_through_a_frame() {
    for msg in samples() {
        let frame = encode_frame(&msg).unwrap();
        assert_eq!(decode_all(&frame).unwrap(), Some(msg));
    }
}

#[test]
fn a_worker_report_travels_inside_one_message_as_the_worker_wrote_it() {
    let reports = [
        WorkerReport::Listening {
            rank: 3,
            addr: "10.0.0.2:41000".into(),
            pid: 77,
        },
        WorkerReport::Saved {
            rank: 3,
            step: 4,
            state: "/runs/x/cluster/step-000004/rank-3.safetensors".into(),
            stall_ms: 1.5,
        },
        WorkerReport::Broken {
            rank: 3,
            step: 4,
            error: "rank 3: step 5: rank 1 lost".into(),
            corrupt: None,
        },
        WorkerReport::Done {
            rank: 3,
            step: 9,
            state: None,
            commit_wait_ms: 2.5,
        },
    ];
    for report in reports {
        let msg = Message::Worker {
            node: 2,
            generation: 5,
            report: report.clone(),
        };
        let frame = encode_frame(&msg).unwrap();
        assert_eq!(decode_all(&frame).unwrap(), Some(msg.clone()));
        // The report keeps its own tag inside the message's: the pipe's line, unchanged.
        let v = serde_json::to_value(&msg).unwrap();
        assert_eq!(v["type"], "worker");
        assert_eq!(v["report"], serde_json::to_value(&report).unwrap());
        assert_eq!(msg.kind(), "worker");
    }
}

#[test]
fn an_empty_stream_is_a_clean_close() {
    assert!(decode_all(&[]).unwrap().is_none());
}

#[test]
fn a_close_inside_the_header_or_body_is_truncated() {
    let frame = encode_frame(&Message::StatusRequest).unwrap();
    let err = decode_all(&frame[..5]).unwrap_err();
    assert!(
        matches!(
            err,
            WireError::Truncated {
                part: "header",
                got: 5,
                ..
            }
        ),
        "{err}"
    );
    let err = decode_all(&frame[..frame.len() - 1]).unwrap_err();
    assert!(
        matches!(err, WireError::Truncated { part: "body", .. }),
        "{err}"
    );
}

#[test]
fn header_faults_have_their_own_errors() {
    let good = encode_frame(&Message::StatusRequest).unwrap();
    let mut bad = good.clone();
    bad[0] = b'X';
    assert!(matches!(decode_all(&bad), Err(WireError::BadMagic { .. })));
    let old = encode_frame_with_version(&Message::StatusRequest, 6).unwrap();
    assert!(matches!(
        decode_all(&old),
        Err(WireError::UnsupportedVersion {
            found: 6,
            supported: PROTOCOL_VERSION
        })
    ));
    let mut bad = good.clone();
    bad[7] = 1;
    assert!(matches!(
        decode_all(&bad),
        Err(WireError::ReservedBits { found: 1 })
    ));
    let mut bad = good.clone();
    bad[8..12].copy_from_slice(&(MAX_FRAME_BYTES + 1).to_be_bytes());
    assert!(matches!(
        decode_all(&bad),
        Err(WireError::FrameTooLarge { .. })
    ));
    let mut bad = good[..HEADER_BYTES].to_vec();
    bad[8..12].copy_from_slice(&3u32.to_be_bytes());
    bad.extend_from_slice(b"{x}");
    assert!(matches!(
        decode_all(&bad),
        Err(WireError::Malformed { len: 3, .. })
    ));
}

#[test]
fn an_unknown_message_type_is_malformed() {
    let err = decode_body(br#"{"type":"launch_missiles"}"#).unwrap_err();
    assert!(matches!(err, WireError::Malformed { .. }), "{err}");
}

#[test]
fn a_silent_peer_times_out() {
    rt().block_on(async {
        let (mut a, _b) = tokio::io::duplex(64);
        let err = read_frame(&mut a, Duration::from_millis(20))
            .await
            .unwrap_err();
        assert!(matches!(err, WireError::Timeout { ms: 20, .. }), "{err}");
    });
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, rng_seed: proptest::test_runner::RngSeed::Fixed(0x00b1_ec4b), ..ProptestConfig::default() })]

    /// Random bytes never panic the decoder: it returns a message, a clean close or an error.
    #[test]
    fn random_bytes_never_panic_the_decoder(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = decode_all(&bytes);
    }

    /// A valid header followed by random bytes (the likelier corruption) is Ok or a clean Err.
    #[test]
    fn random_bodies_behind_a_valid_header_never_panic(body in proptest::collection::vec(any::<u8>(), 0..256), extra in 0u32..64) {
        let mut frame = Vec::new();
        frame.extend_from_slice(&MAGIC);
        frame.extend_from_slice(&PROTOCOL_VERSION.to_be_bytes());
        frame.extend_from_slice(&0u16.to_be_bytes());
        frame.extend_from_slice(&(body.len() as u32 + extra).to_be_bytes());
        frame.extend_from_slice(&body);
        let res = decode_all(&frame);
        if extra > 0 {
            let is_truncated = matches!(res, Err(WireError::Truncated { part: "body", .. }));
            prop_assert!(is_truncated);
        }
    }

    /// Flipping one byte of a valid frame is Ok or a clean Err.
    #[test]
    fn single_byte_corruptions_never_panic(which in 0usize..6, pos in any::<prop::sample::Index>(), val in any::<u8>()) {
        let mut frame = encode_frame(&samples()[which]).unwrap();
        let i = pos.index(frame.len());
        frame[i] = val;
        let _ = decode_all(&frame);
    }
}

#[test]
fn a_mirror_record_carries_its_bytes_raw_after_the_frame() {
    let bytes: Vec<u8> = (0..=255u8).cycle().take(10_000).collect();
    let msg = Message::Mirror {
        seq: 3,
        path: "checkpoints/step-4/rank-0.safetensors".into(),
        offset: 64,
        truncate: false,
        len: bytes.len() as u64,
    };
    let mut wire = Vec::new();
    rt().block_on(write_frame_with(&mut wire, &msg, &bytes, T))
        .expect("write");
    // Raw: the frame and the bytes, not an encoding of them.
    assert_eq!(
        wire.len(),
        encode_frame(&msg).expect("frame").len() + bytes.len()
    );
    rt().block_on(async {
        let mut r = &wire[..];
        assert_eq!(read_frame(&mut r, T).await.expect("frame"), Some(msg));
        assert_eq!(read_payload(&mut r, 10_000, T).await.expect("bytes"), bytes);
    });
}

#[test]
fn a_payload_cut_short_or_over_the_limit_is_refused() {
    rt().block_on(async {
        let mut r = &[1u8, 2, 3][..];
        match read_payload(&mut r, 10, T).await {
            Err(WireError::Truncated { part, got, .. }) => assert_eq!((part, got), ("payload", 3)),
            other => panic!("expected truncated, got {other:?}"),
        }
        let mut r = &[][..];
        let huge = MAX_PAYLOAD + 1;
        match read_payload(&mut r, huge, T).await {
            Err(WireError::FrameTooLarge { len, .. }) => assert_eq!(len, huge),
            other => panic!("expected too large, got {other:?}"),
        }
    });
}
