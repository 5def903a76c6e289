//! Stage runtime: one rank runs its stage of a 1F1B pipeline, then joins the per-layer
//! gradient sync, global-norm clipping and the AdamW step.
//!
//! ```text
//!  Layout (layout.rs: pipelines of StageSpec{layers, ranks}, microbatch runs)
//!     │
//!  StageRunner::run_iteration (stage.rs, stage/iteration.rs) ── schedule::device_stream ─► one handler per
//!     │   instruction on Iteration, the call's state: recv_activation, forward,
//!     │   send_activation, recv_gradient, backward, send_gradient (p2p over a
//!     │   &dyn Communicator, TensorBuf f32 or bf16); the last backward hands each finished
//!     │   bucket of layers to a background thread that all-reduces it
//!     ▼  local gradients (sum over this pipeline's microbatches, each loss scaled by 1/B)
//!  sync_gradients ── sync.rs, on StageRunner::sync_ctx (what the sync needs of the stage)
//!     │                  ── all-reduce per bucket of layers not reduced in the background
//!     │                  ── all-reduce of tied parameters (holders of any of their layers)
//!     │                  ── all-reduce of per-rank (sum of squares, loss) slots
//!     ▼
//!  clip by the global norm ──► AdamW::step on the rank's own parameters
//!                              (StageRunner::train_step does all three)
//! ```
//!
//! `progress.rs` marks what a rank is doing for the watchdog. See `README.md` beside this file
//! for why the result equals a single-process run.

mod layout;
mod progress;
mod stage;
mod sync;

pub use layout::{Bucket, Layout, PipelineSpec, Position, StageSpec};
pub use progress::{Doing, Kind, Mark, OpHook, Progress, Snapshot, StepTimes, Watched};
pub use stage::{sync_gradients, StageConfig, StageRunner};
pub use sync::{IterationOutput, OverlapStats, SyncReport, BUCKET_ELEMS};

use candle_core::{Device, Tensor};
use oobleck_comm::{DType, TensorBuf};

use crate::{Error, Result};

/// Copies a tensor to a host buffer (contiguous, little-endian), keeping its shape: bf16 as it
/// is (mixed precision's activations and their gradients cross the wire at 2 bytes, as the
/// planner's bf16 profile prices them; the values are unchanged), everything else as f32.
pub fn tensor_to_buf(t: &Tensor) -> Result<TensorBuf> {
    if t.dtype() == candle_core::DType::BF16 {
        let v: Vec<half::bf16> = t.flatten_all()?.to_vec1()?;
        let bytes = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        return Ok(TensorBuf::from_bytes(
            DType::BF16,
            t.dims().to_vec(),
            bytes,
        )?);
    }
    let v: Vec<f32> = t
        .to_dtype(candle_core::DType::F32)?
        .flatten_all()?
        .to_vec1()?;
    Ok(TensorBuf::from_f32(t.dims().to_vec(), &v)?)
}

/// Reads an f32 (or bf16, see [`tensor_to_buf`]) buffer back into a tensor on `device`.
pub fn buf_to_tensor(b: &TensorBuf, device: &Device) -> Result<Tensor> {
    if b.dtype() == DType::BF16 {
        let v: Vec<half::bf16> = (b.as_bytes().chunks_exact(2))
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]))
            .collect();
        return Ok(Tensor::from_vec(v, b.shape(), device)?);
    }
    let v = buf_f32(b)?;
    Ok(Tensor::from_vec(v, b.shape(), device)?)
}

/// The values of an f32 buffer.
pub(crate) fn buf_f32(b: &TensorBuf) -> Result<Vec<f32>> {
    if b.dtype() != DType::F32 {
        return Err(Error::DataPlaneDType {
            expected: DType::F32,
            found: b.dtype(),
        });
    }
    Ok(b.as_bytes()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod wire_tests {
    use super::*;

    #[test]
    fn bf16_crosses_the_wire_as_bf16_and_everything_else_as_f32() {
        let dev = Device::Cpu;
        let x = Tensor::new(&[[1.5f32, -2.25], [3.0, 0.1]], &dev).unwrap();
        let b = x.to_dtype(candle_core::DType::BF16).unwrap();
        let buf = tensor_to_buf(&b).unwrap();
        assert_eq!((buf.dtype(), buf.as_bytes().len()), (DType::BF16, 8));
        let back = buf_to_tensor(&buf, &dev).unwrap();
        assert_eq!(back.dtype(), candle_core::DType::BF16);
        let same = |t: &Tensor| -> Vec<f32> {
            let t = t.to_dtype(candle_core::DType::F32).unwrap();
            t.flatten_all().unwrap().to_vec1().unwrap()
        };
        assert_eq!(same(&back), same(&b));
        let buf = tensor_to_buf(&x).unwrap();
        assert_eq!((buf.dtype(), buf.as_bytes().len()), (DType::F32, 16));
        assert_eq!(same(&buf_to_tensor(&buf, &dev).unwrap()), same(&x));
    }
}
