//! What a worker holds between generations, and the layer copies of an in-place
//! reconfiguration (`StateSource::Peers`).
//!
//! A worker keeps the training state of committed step `step` per layer: every parameter of
//! the layer and its AdamW entries (`exp_avg`, `exp_avg_sq`, `step`). A layer copy moves one
//! layer from a holder to a rank of the new generation that lacks it, over that generation's
//! data plane:
//!
//! ```text
//!  holder ── manifest (JSON in an i64 tensor: names, kinds, dtypes, shapes, checksums) ──► rank
//!  holder ── one message per tensor, in manifest order ──────────────────────────────────► rank
//!           tags: COPY_TAG | layer << 20 | index (index 0: the manifest)
//! ```
//!
//! Every rank walks the same copy list in the same order (sends may return before they are
//! received, so no order deadlocks), and every tensor is checked against the sender's
//! checksum.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use oobleck_comm::{Communicator, DType, TensorBuf};
use serde::{Deserialize, Serialize};

use super::protocol;
use crate::execution::StageRunner;
use crate::optim::AdamW;
use crate::reconfig::LayerCopy;
use crate::runtime::error::{Context, Result, RuntimeError};

/// Tags of layer copies: above every pipeline tag (`iteration << 32 | ...`, at most bit 61).
const COPY_TAG: u64 = 1 << 62;

/// One layer's training state.
#[derive(Debug, Clone, Default)]
pub(super) struct LayerState {
    pub params: Vec<(String, Tensor)>,
    /// AdamW entries of the layer's parameters, as [`AdamW::export_state`] names them.
    pub opt: Vec<(String, Tensor)>,
}

/// The state a worker holds of committed step `step`, by layer.
#[derive(Debug, Default)]
pub(super) struct Held {
    pub step: u64,
    pub layers: BTreeMap<usize, LayerState>,
}

impl Held {
    pub fn nothing(step: u64) -> Held {
        Held {
            step,
            layers: BTreeMap::new(),
        }
    }

    /// A running stage's layers and their optimizer state at committed `step`. (A stage that
    /// never stepped has zero moments, which is what AdamW starts from.)
    pub fn of_stage(runner: &StageRunner, opt: &mut AdamW, step: u64) -> Result<Held> {
        opt.ensure_state(&runner.params())?;
        let mut layers = BTreeMap::new();
        for layer in runner.stage().layers() {
            let params: Vec<(String, Tensor)> = layer
                .params()
                .into_iter()
                .map(|(n, v)| (n, v.as_tensor().clone()))
                .collect();
            let names: Vec<&str> = params.iter().map(|p| p.0.as_str()).collect();
            let opt = opt.export_state_for(&names)?;
            layers.insert(layer.index(), LayerState { params, opt });
        }
        Ok(Held { step, layers })
    }

    pub fn layer_list(&self) -> Vec<usize> {
        self.layers.keys().copied().collect()
    }

    /// The parameters and optimizer entries of `layers` (a tied parameter of two layers once).
    pub fn tensors_of(&self, layers: &BTreeSet<usize>, rank: u32) -> Result<StageTensors> {
        let mut params = HashMap::new();
        let mut opt = BTreeMap::new();
        for l in layers {
            let s = self.layers.get(l).ok_or_else(|| {
                protocol(
                    rank,
                    format!("its new stage needs layer {l}, which it neither holds nor received"),
                )
            })?;
            params.extend(s.params.iter().cloned());
            opt.extend(s.opt.iter().cloned());
        }
        Ok((params, opt.into_iter().collect()))
    }
}

/// A stage's parameters by name, and its optimizer entries.
pub(super) type StageTensors = (HashMap<String, Tensor>, Vec<(String, Tensor)>);

/// Test hooks of [`exchange`]: `after_first` runs once the first copy of the list is done;
/// `corrupt_next_send` flips a bit of the next layer this rank sends.
pub(super) struct CopyHooks<F> {
    pub after_first: F,
    pub corrupt_next_send: bool,
}

impl CopyHooks<fn()> {
    pub fn none() -> Self {
        CopyHooks {
            after_first: || {},
            corrupt_next_send: false,
        }
    }
}

/// What the copies moved into this rank.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct CopyStats {
    pub bytes: u64,
    pub seconds: f64,
}

/// One tensor of a manifest.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Entry {
    name: String,
    /// A parameter (`true`) or an optimizer entry.
    param: bool,
    shape: Vec<usize>,
    checksum: u64,
}

/// Carries out this rank's part of `copies` (ranks of `comm`'s generation): sends what it
/// holds to those that lack it and adds what it receives to `held`.
pub(super) fn exchange(
    comm: &dyn Communicator,
    me: u32,
    held: &mut Held,
    copies: &[LayerCopy],
    timeout: Duration,
    hooks: CopyHooks<impl FnMut()>,
) -> Result<CopyStats> {
    let CopyHooks {
        mut after_first,
        mut corrupt_next_send,
    } = hooks;
    let started = Instant::now();
    let mut stats = CopyStats::default();
    for (i, c) in copies.iter().enumerate() {
        if i == 1 {
            after_first();
        }
        if c.from_rank == me && c.to_rank == me {
            return Err(protocol(
                me,
                format!("told to copy layer {} to itself", c.layer),
            ));
        }
        if c.from_rank == me {
            let state = held.layers.get(&c.layer).ok_or_else(|| {
                protocol(
                    me,
                    format!(
                        "told to send layer {} to rank {}, but it holds only layers {:?}",
                        c.layer,
                        c.to_rank,
                        held.layer_list()
                    ),
                )
            })?;
            let corrupt = std::mem::take(&mut corrupt_next_send);
            send_layer(comm, c.to_rank, c.layer, state, timeout, corrupt).with_ctx(|| {
                format!("rank {me}: sending layer {} to rank {}", c.layer, c.to_rank)
            })?;
        } else if c.to_rank == me {
            let (state, bytes) =
                recv_layer(comm, c.from_rank, c.layer, timeout).with_ctx(|| {
                    format!(
                        "rank {me}: receiving layer {} from rank {}",
                        c.layer, c.from_rank
                    )
                })?;
            stats.bytes += bytes;
            held.layers.insert(c.layer, state);
        }
    }
    stats.seconds = started.elapsed().as_secs_f64();
    Ok(stats)
}

fn tag(layer: usize, index: usize) -> u64 {
    COPY_TAG | ((layer as u64 & 0x3_ffff) << 20) | (index as u64 & 0xf_ffff)
}

fn send_layer(
    comm: &dyn Communicator,
    to: u32,
    layer: usize,
    state: &LayerState,
    timeout: Duration,
    corrupt: bool,
) -> Result<()> {
    let tensors: Vec<(bool, &(String, Tensor))> = state
        .params
        .iter()
        .map(|p| (true, p))
        .chain(state.opt.iter().map(|o| (false, o)))
        .collect();
    let mut bufs = Vec::with_capacity(tensors.len());
    let mut manifest = Vec::with_capacity(tensors.len());
    for (param, (name, t)) in tensors {
        let buf = to_buf(t).with_ctx(|| format!("encoding {name}"))?;
        manifest.push(Entry {
            name: name.clone(),
            param,
            shape: buf.shape().to_vec(),
            checksum: checksum(buf.as_bytes()),
        });
        bufs.push(buf);
    }
    if corrupt {
        // The test hook: one flipped bit after the checksum, as a bad link or memory would.
        if let Some(b) = bufs.first_mut().and_then(|b| b.as_bytes_mut().first_mut()) {
            *b ^= 1;
        }
    }
    let json = serde_json::to_vec(&manifest).ctx("encoding a copy manifest")?;
    let to = to as usize;
    comm.send(to, tag(layer, 0), &bytes_buf(&json)?, timeout)
        .ctx("the manifest")?;
    for (i, b) in bufs.iter().enumerate() {
        comm.send(to, tag(layer, i + 1), b, timeout)
            .with_ctx(|| format!("tensor {}", manifest[i].name))?;
    }
    Ok(())
}

fn recv_layer(
    comm: &dyn Communicator,
    from: u32,
    layer: usize,
    timeout: Duration,
) -> Result<(LayerState, u64)> {
    let from_rank = from as usize;
    let m = comm
        .recv(from_rank, tag(layer, 0), timeout)
        .ctx("the manifest")?;
    let manifest: Vec<Entry> = serde_json::from_slice(&buf_bytes(&m)?).map_err(|e| {
        protocol(
            from,
            format!("sent a malformed manifest for layer {layer}: {e}"),
        )
    })?;
    let mut state = LayerState::default();
    let mut bytes = 0u64;
    for (i, e) in manifest.into_iter().enumerate() {
        let b = comm
            .recv(from_rank, tag(layer, i + 1), timeout)
            .with_ctx(|| format!("tensor {}", e.name))?;
        let got = checksum(b.as_bytes());
        if got != e.checksum || b.shape() != e.shape.as_slice() {
            return Err(RuntimeError::CopyCorrupt {
                layer,
                from,
                tensor: e.name,
                detail: format!(
                    "checksum {got:016x} of shape {:?}, the sender's is {:016x} of shape {:?}",
                    b.shape(),
                    e.checksum,
                    e.shape
                ),
            });
        }
        bytes += b.as_bytes().len() as u64;
        let t = from_buf(&b).with_ctx(|| format!("decoding {}", e.name))?;
        let slot = if e.param {
            &mut state.params
        } else {
            &mut state.opt
        };
        slot.push((e.name, t));
    }
    Ok((state, bytes))
}

/// A tensor's host bytes as they are (f32 parameters and moments, the i64 step counts).
fn to_buf(t: &Tensor) -> crate::Result<TensorBuf> {
    let shape = t.dims().to_vec();
    let flat = t.flatten_all()?;
    let buf = match t.dtype() {
        candle_core::DType::F32 => TensorBuf::from_f32(shape, &flat.to_vec1::<f32>()?),
        candle_core::DType::I64 => TensorBuf::from_i64(shape, &flat.to_vec1::<i64>()?),
        other => {
            return Err(crate::Error::Msg(format!(
                "layer copies move f32 and i64 tensors; this one is {other:?}"
            )))
        }
    };
    Ok(buf?)
}

fn from_buf(b: &TensorBuf) -> crate::Result<Tensor> {
    let t = match b.dtype() {
        DType::F32 => Tensor::from_vec(b.to_f32_vec()?, b.shape(), &Device::Cpu)?,
        DType::I64 => Tensor::from_vec(b.to_i64_vec()?, b.shape(), &Device::Cpu)?,
        other => {
            return Err(crate::Error::DataPlaneDType {
                expected: DType::F32,
                found: other,
            })
        }
    };
    Ok(t)
}

/// Arbitrary bytes as an i64 tensor: the length, then the bytes padded to 8.
fn bytes_buf(bytes: &[u8]) -> crate::Result<TensorBuf> {
    let mut data = (bytes.len() as u64).to_le_bytes().to_vec();
    data.extend_from_slice(bytes);
    data.resize(data.len().div_ceil(8) * 8, 0);
    let n = data.len() / 8;
    Ok(TensorBuf::from_bytes(DType::I64, vec![n], data)?)
}

fn buf_bytes(b: &TensorBuf) -> Result<Vec<u8>> {
    let data = b.as_bytes();
    let bad = || RuntimeError::Invalid("a copy manifest is shorter than its length".into());
    let len: [u8; 8] = data
        .get(..8)
        .ok_or_else(bad)?
        .try_into()
        .map_err(|_| bad())?;
    let len = u64::from_le_bytes(len) as usize;
    Ok(data.get(8..8 + len).ok_or_else(bad)?.to_vec())
}

/// A fast 64-bit checksum of `bytes` (word-wise multiply-rotate, then the tail and length).
pub(super) fn checksum(bytes: &[u8]) -> u64 {
    const K: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut h: u64 = 0x243f_6a88_85a3_08d3;
    let mut words = bytes.chunks_exact(8);
    for w in &mut words {
        let w = u64::from_le_bytes(w.try_into().expect("8 bytes"));
        h = (h ^ w).wrapping_mul(K).rotate_left(31);
    }
    for &b in words.remainder() {
        h = (h ^ u64::from(b)).wrapping_mul(K).rotate_left(31);
    }
    (h ^ bytes.len() as u64).wrapping_mul(K)
}

#[cfg(test)]
mod tests {
    use super::*;
    use oobleck_comm::{LocalNetwork, Tuning};

    fn layer(seed: f32) -> LayerState {
        let p = Tensor::new(&[seed, seed + 1.0, seed + 2.0], &Device::Cpu).expect("p");
        let s = Tensor::new(&[7i64], &Device::Cpu).expect("s");
        LayerState {
            params: vec![(format!("l{seed}.w"), p.clone())],
            opt: vec![
                (format!("l{seed}.w.exp_avg"), p.clone()),
                (format!("l{seed}.w.exp_avg_sq"), p),
                (format!("l{seed}.w.step"), s),
            ],
        }
    }

    #[test]
    fn checksums_see_every_byte_and_the_length() {
        let a = vec![1u8; 4099];
        let mut b = a.clone();
        b[4098] = 2;
        assert_ne!(checksum(&a), checksum(&b));
        assert_ne!(checksum(&a), checksum(&a[..4098]));
        assert_eq!(checksum(&a), checksum(&a.clone()));
    }

    #[test]
    fn copies_spread_over_holders_arrive_whole_and_checked() {
        // Ranks 0 and 1 hold layers 0 and 1; rank 2 holds nothing and gets 0 from rank 0
        // and 1 from rank 1, while rank 1 also gets nothing.
        let copies = vec![
            LayerCopy {
                layer: 0,
                from_rank: 0,
                to_rank: 2,
                from_node: 0,
                to_node: 2,
                bytes: 0,
            },
            LayerCopy {
                layer: 1,
                from_rank: 1,
                to_rank: 2,
                from_node: 1,
                to_node: 2,
                bytes: 0,
            },
        ];
        let comms = LocalNetwork::new(3, 0).communicators(Tuning::default());
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(r, comm)| {
                let copies = copies.clone();
                std::thread::spawn(move || {
                    let mut held = Held::nothing(7);
                    if r < 2 {
                        held.layers.insert(0, layer(0.0));
                        held.layers.insert(1, layer(10.0));
                    }
                    let stats = exchange(
                        &comm,
                        r as u32,
                        &mut held,
                        &copies,
                        Duration::from_secs(10),
                        CopyHooks::none(),
                    )
                    .expect("exchange");
                    (held, stats)
                })
            })
            .collect();
        let results: Vec<(Held, CopyStats)> = handles
            .into_iter()
            .map(|h| h.join().expect("thread"))
            .collect();
        let (got, stats) = &results[2];
        assert_eq!(got.layer_list(), vec![0, 1]);
        assert_eq!(stats.bytes, 2 * (3 * 12 + 8));
        assert_eq!(results[0].1.bytes, 0);
        let (params, opt) = got.tensors_of(&[0, 1].into(), 2).expect("tensors");
        let w = params["l10.w"].to_vec1::<f32>().expect("f32");
        assert_eq!(w, vec![10.0, 11.0, 12.0]);
        assert_eq!(opt.len(), 6);
        let step = opt.iter().find(|o| o.0 == "l0.w.step").expect("step");
        assert_eq!(step.1.to_vec1::<i64>().expect("i64"), vec![7]);
        let e = got
            .tensors_of(&[3].into(), 2)
            .expect_err("layer 3 is nowhere");
        assert!(e.to_string().contains("layer 3"), "{e}");
    }

    #[test]
    fn a_holder_told_to_send_what_it_lacks_says_so() {
        let copies = vec![LayerCopy {
            layer: 4,
            from_rank: 0,
            to_rank: 1,
            from_node: 0,
            to_node: 1,
            bytes: 0,
        }];
        let comm = LocalNetwork::new(2, 0)
            .communicators(Tuning::default())
            .remove(0);
        let e = exchange(
            &comm,
            0,
            &mut Held::nothing(1),
            &copies,
            Duration::from_secs(1),
            CopyHooks::none(),
        )
        .expect_err("holds nothing");
        assert!(e.to_string().contains("holds only layers []"), "{e}");
    }
}
