//! Tests of `model.rs`: seeded initialisation, keyed dropout and the stage's passes.

use super::*;

#[test]
fn seeded_normal_depends_only_on_seed_and_name() {
    let d = Device::Cpu;
    let a = seeded_normal(7, "w", &[3, 5], 0.02, &d).unwrap();
    let b = seeded_normal(7, "w", &[3, 5], 0.02, &d).unwrap();
    let c = seeded_normal(7, "v", &[3, 5], 0.02, &d).unwrap();
    let diff = |x: &Tensor, y: &Tensor| {
        x.sub(y)
            .unwrap()
            .abs()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    };
    assert_eq!(diff(&a, &b), 0.0);
    assert!(diff(&a, &c) > 0.0);
}

#[test]
fn dropout_is_keyed_not_random() {
    let d = Device::Cpu;
    let x = Tensor::ones((4, 64), DType::F32, &d).unwrap();
    let key = DropoutKey {
        seed: 1,
        iteration: 2,
        microbatch: 3,
    };
    let ctx = ForwardCtx {
        targets: None,
        loss_scale: 1.0,
        train: true,
        dropout_key: key,
        rows: None,
        dtype: DType::F32,
    };
    let a = dropout(&x, 0.5, &ctx, 1, 0)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    let b = dropout(&x, 0.5, &ctx, 1, 0)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    let c = dropout(&x, 0.5, &ctx, 2, 0)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    assert_eq!(a, b);
    assert_ne!(a, c);
    let zeros = a.iter().flatten().filter(|v| **v == 0.0).count();
    assert!((64..192).contains(&zeros), "{zeros} of 256 dropped");
}

/// A device of a multi-device stage holding rows `[o, o + n)` draws exactly those rows of
/// the whole microbatch's mask.
#[test]
fn dropout_of_a_row_slice_is_that_slice_of_the_whole_mask() {
    let d = Device::Cpu;
    let whole = Tensor::ones((4, 3, 16), DType::F32, &d).unwrap();
    let ctx = ForwardCtx {
        train: true,
        dropout_key: DropoutKey {
            seed: 5,
            iteration: 1,
            microbatch: 2,
        },
        ..ForwardCtx::inference()
    };
    let full = dropout(&whole, 0.5, &ctx, 3, 1).unwrap();
    for (offset, n) in [(2, 2), (0, 2), (1, 1), (3, 1), (0, 4)] {
        let part = Tensor::ones((n, 3, 16), DType::F32, &d).unwrap();
        let sliced = ForwardCtx {
            rows: Some(RowSlice { offset, total: 4 }),
            ..ctx
        };
        let got = dropout(&part, 0.5, &sliced, 3, 1).unwrap();
        assert_eq!(
            got.to_vec3::<f32>().unwrap(),
            full.narrow(0, offset, n).unwrap().to_vec3::<f32>().unwrap(),
            "rows [{offset}, {})",
            offset + n
        );
    }
    // Rows differ from each other (each has its own stream).
    let rows = full.to_vec3::<f32>().unwrap();
    assert_ne!(rows[0], rows[1]);
    // A slice that does not fit the microbatch is an error, not a silent wrong mask.
    let part = Tensor::ones((2, 3, 16), DType::F32, &d).unwrap();
    let bad = ForwardCtx {
        rows: Some(RowSlice {
            offset: 3,
            total: 4,
        }),
        ..ctx
    };
    assert!(dropout(&part, 0.5, &bad, 3, 1).is_err());
}
