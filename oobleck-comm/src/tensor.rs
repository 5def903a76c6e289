//! Host tensors as the communicators see them: little-endian bytes + dtype + shape.

use crate::error::{CommError, Result};
use crate::shm::SharedBytes;

/// Element types the data plane moves and reduces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum DType {
    F32,
    BF16,
    F16,
    I64,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::I64 => 8,
        }
    }

    pub(crate) fn code(self) -> u8 {
        match self {
            DType::F32 => 1,
            DType::BF16 => 2,
            DType::F16 => 3,
            DType::I64 => 4,
        }
    }

    pub(crate) fn from_code(code: u8) -> Option<DType> {
        Some(match code {
            1 => DType::F32,
            2 => DType::BF16,
            3 => DType::F16,
            4 => DType::I64,
            _ => return None,
        })
    }
}

/// A dense host tensor: `data` holds `shape.iter().product()` elements of `dtype`, little-endian.
///
/// The bytes are on the heap, or in shared memory when the tensor came from
/// [`Communicator::alloc`](crate::Communicator::alloc); both behave alike, and a clone is
/// always on the heap.
#[derive(Debug)]
pub struct TensorBuf {
    dtype: DType,
    shape: Vec<usize>,
    data: Data,
}

#[derive(Debug)]
enum Data {
    Heap(Vec<u8>),
    Shared(SharedBytes),
}

impl Clone for TensorBuf {
    fn clone(&self) -> Self {
        TensorBuf {
            dtype: self.dtype,
            shape: self.shape.clone(),
            data: Data::Heap(self.as_bytes().to_vec()),
        }
    }
}

impl PartialEq for TensorBuf {
    fn eq(&self, other: &Self) -> bool {
        self.dtype == other.dtype
            && self.shape == other.shape
            && self.as_bytes() == other.as_bytes()
    }
}

impl TensorBuf {
    /// Wraps raw bytes; fails when their length does not match `shape` and `dtype`.
    pub fn from_bytes(dtype: DType, shape: Vec<usize>, data: Vec<u8>) -> Result<Self> {
        let want = byte_len(dtype, &shape)?;
        if data.len() != want {
            return Err(CommError::Invalid(format!(
                "tensor of shape {shape:?} and dtype {dtype:?} needs {want} bytes, got {}",
                data.len()
            )));
        }
        Ok(TensorBuf {
            dtype,
            shape,
            data: Data::Heap(data),
        })
    }

    /// A tensor over shared bytes of exactly its length (from a communicator's pool).
    pub(crate) fn shared(dtype: DType, shape: Vec<usize>, data: SharedBytes) -> Self {
        debug_assert_eq!(byte_len(dtype, &shape).ok(), Some(data.as_slice().len()));
        TensorBuf {
            dtype,
            shape,
            data: Data::Shared(data),
        }
    }

    /// True when the bytes are in shared memory ([`Communicator::alloc`](crate::Communicator::alloc)
    /// on a rank with peers on its host): all-reduces over such tensors work in place.
    pub fn is_shared(&self) -> bool {
        matches!(self.data, Data::Shared(_))
    }

    /// The shared segment's name, for the members of an all-reduce to map.
    pub(crate) fn shared_name(&self) -> Option<&str> {
        match &self.data {
            Data::Shared(s) => Some(s.name()),
            Data::Heap(_) => None,
        }
    }

    /// A zero-filled tensor.
    pub fn zeros(dtype: DType, shape: Vec<usize>) -> Result<Self> {
        let n = byte_len(dtype, &shape)?;
        Ok(TensorBuf {
            dtype,
            shape,
            data: Data::Heap(vec![0; n]),
        })
    }

    pub fn from_f32(shape: Vec<usize>, values: &[f32]) -> Result<Self> {
        Self::from_bytes(DType::F32, shape, bytemuck::cast_slice(values).to_vec())
    }

    pub fn from_i64(shape: Vec<usize>, values: &[i64]) -> Result<Self> {
        Self::from_bytes(DType::I64, shape, bytemuck::cast_slice(values).to_vec())
    }

    pub fn from_bf16(shape: Vec<usize>, values: &[half::bf16]) -> Result<Self> {
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Self::from_bytes(DType::BF16, shape, bytes)
    }

    pub fn from_f16(shape: Vec<usize>, values: &[half::f16]) -> Result<Self> {
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Self::from_bytes(DType::F16, shape, bytes)
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn elem_count(&self) -> usize {
        self.as_bytes().len() / self.dtype.size()
    }

    pub fn as_bytes(&self) -> &[u8] {
        match &self.data {
            Data::Heap(v) => v,
            Data::Shared(s) => s.as_slice(),
        }
    }

    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        match &mut self.data {
            Data::Heap(v) => v,
            Data::Shared(s) => s.as_mut_slice(),
        }
    }

    /// Gives the same bytes another shape of the same byte length (a received message's).
    pub(crate) fn set_shape(&mut self, shape: Vec<usize>) -> Result<()> {
        let want = byte_len(self.dtype, &shape)?;
        if want != self.as_bytes().len() {
            return Err(CommError::Invalid(format!(
                "shape {shape:?} of {:?} needs {want} bytes, the buffer has {}",
                self.dtype,
                self.as_bytes().len()
            )));
        }
        self.shape = shape;
        Ok(())
    }

    /// The bytes as a vector (a copy when they are shared).
    pub fn into_bytes(self) -> Vec<u8> {
        match self.data {
            Data::Heap(v) => v,
            Data::Shared(s) => s.as_slice().to_vec(),
        }
    }

    /// Elements as `f32` (converting from bf16/f16; i64 is rejected).
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        let c = self.as_bytes();
        Ok(match self.dtype {
            DType::F32 => c
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            DType::BF16 => c
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            DType::F16 => c
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            DType::I64 => {
                return Err(CommError::Invalid("to_f32_vec on an i64 tensor".into()));
            }
        })
    }

    pub fn to_i64_vec(&self) -> Result<Vec<i64>> {
        if self.dtype != DType::I64 {
            return Err(CommError::Invalid(format!(
                "to_i64_vec on a {:?} tensor",
                self.dtype
            )));
        }
        Ok(self
            .as_bytes()
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().expect("chunks_exact(8) yields 8 bytes")))
            .collect())
    }
}

pub(crate) fn byte_len(dtype: DType, shape: &[usize]) -> Result<usize> {
    shape
        .iter()
        .try_fold(dtype.size(), |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| CommError::Invalid(format!("shape {shape:?} overflows usize")))
}

/// `acc += other`, elementwise, for `dtype`. Both slices have the same length, a multiple of
/// the element size (callers check). bf16/f16 add in f32 and round once per add.
pub(crate) fn add_into(dtype: DType, acc: &mut [u8], other: &[u8]) {
    debug_assert_eq!(acc.len(), other.len());
    match dtype {
        DType::F32 => {
            // Fast path when both buffers happen to be aligned (the usual case for heap data).
            match (
                bytemuck::try_cast_slice_mut::<u8, f32>(acc),
                bytemuck::try_cast_slice::<u8, f32>(other),
            ) {
                (Ok(a), Ok(b)) => a.iter_mut().zip(b).for_each(|(x, y)| *x += *y),
                _ => acc
                    .chunks_exact_mut(4)
                    .zip(other.chunks_exact(4))
                    .for_each(|(x, y)| {
                        let s = f32::from_le_bytes([x[0], x[1], x[2], x[3]])
                            + f32::from_le_bytes([y[0], y[1], y[2], y[3]]);
                        x.copy_from_slice(&s.to_le_bytes());
                    }),
            }
        }
        DType::I64 => match (
            bytemuck::try_cast_slice_mut::<u8, i64>(acc),
            bytemuck::try_cast_slice::<u8, i64>(other),
        ) {
            (Ok(a), Ok(b)) => a
                .iter_mut()
                .zip(b)
                .for_each(|(x, y)| *x = x.wrapping_add(*y)),
            _ => acc
                .chunks_exact_mut(8)
                .zip(other.chunks_exact(8))
                .for_each(|(x, y)| {
                    let a = i64::from_le_bytes((&*x).try_into().expect("8 bytes"));
                    let b = i64::from_le_bytes(y.try_into().expect("8 bytes"));
                    x.copy_from_slice(&a.wrapping_add(b).to_le_bytes());
                }),
        },
        DType::BF16 => acc
            .chunks_exact_mut(2)
            .zip(other.chunks_exact(2))
            .for_each(|(x, y)| {
                let s = half::bf16::from_le_bytes([x[0], x[1]]).to_f32()
                    + half::bf16::from_le_bytes([y[0], y[1]]).to_f32();
                x.copy_from_slice(&half::bf16::from_f32(s).to_le_bytes());
            }),
        DType::F16 => acc
            .chunks_exact_mut(2)
            .zip(other.chunks_exact(2))
            .for_each(|(x, y)| {
                let s = half::f16::from_le_bytes([x[0], x[1]]).to_f32()
                    + half::f16::from_le_bytes([y[0], y[1]]).to_f32();
                x.copy_from_slice(&half::f16::from_f32(s).to_le_bytes());
            }),
    }
}

/// Tensor metadata on the wire (p2p messages): dtype, rank, dims.
///
/// ```text
/// | dtype u8 | ndim u8 | dims: ndim x u64 LE |
/// ```
pub(crate) fn encode_meta(t: &TensorBuf) -> Result<Vec<u8>> {
    let ndim = u8::try_from(t.shape.len())
        .map_err(|_| CommError::Invalid(format!("{} dims (max 255)", t.shape.len())))?;
    let mut out = Vec::with_capacity(2 + 8 * t.shape.len());
    out.push(t.dtype.code());
    out.push(ndim);
    for &d in &t.shape {
        out.extend_from_slice(&(d as u64).to_le_bytes());
    }
    Ok(out)
}

/// Inverse of [`encode_meta`]; also returns the byte length the data must have.
pub(crate) fn decode_meta(bytes: &[u8]) -> Result<(DType, Vec<usize>, usize), String> {
    let (&code, rest) = bytes.split_first().ok_or("empty tensor metadata")?;
    let dtype = DType::from_code(code).ok_or_else(|| format!("unknown dtype code {code}"))?;
    let (&ndim, dims) = rest.split_first().ok_or("tensor metadata without ndim")?;
    if dims.len() != 8 * ndim as usize {
        return Err(format!(
            "tensor metadata has {} dim bytes for ndim {ndim}",
            dims.len()
        ));
    }
    let shape: Vec<usize> = dims
        .chunks_exact(8)
        .map(|b| usize::try_from(u64::from_le_bytes(b.try_into().expect("8 bytes"))))
        .collect::<Result<_, _>>()
        .map_err(|_| "dimension does not fit usize".to_string())?;
    let len = byte_len(dtype, &shape).map_err(|e| e.to_string())?;
    Ok((dtype, shape, len))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_data_of_the_wrong_length() {
        assert!(TensorBuf::from_bytes(DType::F32, vec![2, 3], vec![0; 23]).is_err());
        assert!(TensorBuf::from_bytes(DType::F32, vec![2, 3], vec![0; 24]).is_ok());
        assert!(TensorBuf::zeros(DType::I64, vec![usize::MAX, 2]).is_err());
    }

    #[test]
    fn adds_every_dtype() {
        let mut a = TensorBuf::from_f32(vec![3], &[1.0, 2.0, 3.0]).unwrap();
        let b = TensorBuf::from_f32(vec![3], &[0.5, 0.5, -3.0]).unwrap();
        add_into(DType::F32, a.as_bytes_mut(), b.as_bytes());
        assert_eq!(a.to_f32_vec().unwrap(), vec![1.5, 2.5, 0.0]);

        let mut a = TensorBuf::from_i64(vec![2], &[i64::MAX, 5]).unwrap();
        let b = TensorBuf::from_i64(vec![2], &[1, -7]).unwrap();
        add_into(DType::I64, a.as_bytes_mut(), b.as_bytes());
        assert_eq!(a.to_i64_vec().unwrap(), vec![i64::MIN, -2]);

        let h = |v: f32| half::bf16::from_f32(v);
        let mut a = TensorBuf::from_bf16(vec![2], &[h(1.0), h(2.0)]).unwrap();
        let b = TensorBuf::from_bf16(vec![2], &[h(0.5), h(-4.0)]).unwrap();
        add_into(DType::BF16, a.as_bytes_mut(), b.as_bytes());
        assert_eq!(a.to_f32_vec().unwrap(), vec![1.5, -2.0]);

        let h = |v: f32| half::f16::from_f32(v);
        let mut a = TensorBuf::from_f16(vec![1], &[h(0.25)]).unwrap();
        let b = TensorBuf::from_f16(vec![1], &[h(0.5)]).unwrap();
        add_into(DType::F16, a.as_bytes_mut(), b.as_bytes());
        assert_eq!(a.to_f32_vec().unwrap(), vec![0.75]);
    }

    #[test]
    // Heap buffers are 8-aligned, so `[1..]` is surely misaligned: arrays would not be.
    #[allow(clippy::useless_vec)]
    fn unaligned_f32_add_matches_aligned() {
        let mut a = vec![0u8; 4 * 5 + 1];
        let mut b = vec![0u8; 4 * 5 + 1];
        for i in 0..5 {
            a[1 + 4 * i..5 + 4 * i].copy_from_slice(&(i as f32).to_le_bytes());
            b[1 + 4 * i..5 + 4 * i].copy_from_slice(&(2.0f32).to_le_bytes());
        }
        add_into(DType::F32, &mut a[1..], &b[1..]);
        let t = TensorBuf::from_bytes(DType::F32, vec![5], a[1..].to_vec()).unwrap();
        assert_eq!(t.to_f32_vec().unwrap(), vec![2.0, 3.0, 4.0, 5.0, 6.0]);
    }

    #[test]
    fn meta_round_trips_and_rejects_garbage() {
        let t = TensorBuf::zeros(DType::BF16, vec![4, 0, 7]).unwrap();
        let m = encode_meta(&t).unwrap();
        assert_eq!(decode_meta(&m).unwrap(), (DType::BF16, vec![4, 0, 7], 0));
        assert!(decode_meta(&[]).is_err());
        assert!(decode_meta(&[9, 0]).is_err());
        assert!(decode_meta(&[1, 2, 0]).is_err());
    }
}
