//! How token ids are stored ([`TokenDtype`]) and the loops that read them: one generic
//! function per task, instantiated per stored type through [`with_word!`], so the type is
//! dispatched once per call and never inside a loop.

use rayon::prelude::*;

/// Tokens per piece of [`first_outside`]'s parallel scan: 8 MiB of u64 ids at most, large
/// enough that rayon's per-piece cost vanishes, small enough that the first bad id is found
/// without reading much past it.
const SCAN_PIECE_TOKENS: usize = 1 << 20;

/// How one token id is stored (always little-endian).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TokenDtype {
    U8,
    I8,
    I16,
    U16,
    I32,
    U32,
    I64,
}

impl TokenDtype {
    /// Bytes per token: 1, 2, 4 or 8.
    pub fn width(self) -> usize {
        match self {
            TokenDtype::U8 | TokenDtype::I8 => 1,
            TokenDtype::I16 | TokenDtype::U16 => 2,
            TokenDtype::I32 | TokenDtype::U32 => 4,
            TokenDtype::I64 => 8,
        }
    }

    /// The NumPy name (`uint16`, `int32`, ...), as Megatron and nanoGPT call them.
    pub fn name(self) -> &'static str {
        match self {
            TokenDtype::U8 => "uint8",
            TokenDtype::I8 => "int8",
            TokenDtype::I16 => "int16",
            TokenDtype::U16 => "uint16",
            TokenDtype::I32 => "int32",
            TokenDtype::U32 => "uint32",
            TokenDtype::I64 => "int64",
        }
    }
}

impl std::fmt::Display for TokenDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One stored token type: its width and how to read it.
pub(super) trait Word {
    const WIDTH: usize;
    type Value: Copy + Ord + Into<i64> + Send;
    const LOWEST: Self::Value;
    const HIGHEST: Self::Value;
    /// Whether every value of the type is a u32 token id (unsigned, at most 32 bits).
    const ALWAYS_ID: bool;
    fn read(bytes: &[u8]) -> Self::Value;
    /// The value at `bytes` as an i64, which holds every stored type exactly.
    fn read_wide(bytes: &[u8]) -> i64 {
        Self::read(bytes).into()
    }
}

macro_rules! impl_word {
    ($($t:ty),*) => {$(
        impl Word for $t {
            const WIDTH: usize = std::mem::size_of::<$t>();
            type Value = $t;
            const LOWEST: $t = <$t>::MIN;
            const HIGHEST: $t = <$t>::MAX;
            const ALWAYS_ID: bool = <$t>::MIN == 0 && std::mem::size_of::<$t>() <= 4;
            fn read(bytes: &[u8]) -> $t {
                <$t>::from_le_bytes(bytes.try_into().expect("chunks of the type's width"))
            }
        }
    )*};
}
impl_word!(u8, i8, i16, u16, i32, u32, i64);

/// Runs `$body` with `$w` the [`Word`] type of `$dtype`: one dispatch per call, so the loops
/// inside are monomorphic.
macro_rules! with_word {
    ($dtype:expr, $w:ident => $body:expr) => {
        match $dtype {
            $crate::data::TokenDtype::U8 => {
                type $w = u8;
                $body
            }
            $crate::data::TokenDtype::I8 => {
                type $w = i8;
                $body
            }
            $crate::data::TokenDtype::I16 => {
                type $w = i16;
                $body
            }
            $crate::data::TokenDtype::U16 => {
                type $w = u16;
                $body
            }
            $crate::data::TokenDtype::I32 => {
                type $w = i32;
                $body
            }
            $crate::data::TokenDtype::U32 => {
                type $w = u32;
                $body
            }
            $crate::data::TokenDtype::I64 => {
                type $w = i64;
                $body
            }
        }
    };
}
pub(super) use with_word;

/// Appends the ids in `bytes` to `out`; stops at the first value that is no u32 id and returns
/// its position and value.
pub(super) fn push_ids<W: Word>(bytes: &[u8], out: &mut Vec<u32>) -> Option<(usize, i64)> {
    if W::ALWAYS_ID {
        // No value to refuse: one plain widening loop, which the compiler vectorises.
        out.extend(bytes.chunks_exact(W::WIDTH).map(|c| W::read_wide(c) as u32));
        return None;
    }
    for (i, chunk) in bytes.chunks_exact(W::WIDTH).enumerate() {
        let value = W::read_wide(chunk);
        match u32::try_from(value) {
            Ok(id) => out.push(id),
            Err(_) => return Some((i, value)),
        }
    }
    None
}

/// The first value of `data` outside `0..limit`, with its token index. `data` is scanned in
/// pieces on rayon's pool; the answer of the first piece that has one is kept.
pub(super) fn first_outside<W: Word>(data: &[u8], limit: i64) -> Option<(usize, i64)> {
    data.par_chunks(SCAN_PIECE_TOKENS * W::WIDTH)
        .enumerate()
        .find_map_first(|(k, piece)| {
            first_outside_piece::<W>(piece, limit).map(|(i, v)| (k * SCAN_PIECE_TOKENS + i, v))
        })
}

/// [`first_outside`] of one piece. Its minimum and maximum are taken first (a loop the
/// compiler vectorises); positions are only looked for in a piece that has a bad value.
fn first_outside_piece<W: Word>(piece: &[u8], limit: i64) -> Option<(usize, i64)> {
    let (lowest, highest) = piece
        .chunks_exact(W::WIDTH)
        .map(W::read)
        .fold((W::HIGHEST, W::LOWEST), |(lo, hi), v| {
            (lo.min(v), hi.max(v))
        });
    let (lowest, highest): (i64, i64) = (lowest.into(), highest.into());
    if piece.is_empty() || (lowest >= 0 && highest < limit) {
        return None;
    }
    piece
        .chunks_exact(W::WIDTH)
        .map(W::read_wide)
        .enumerate()
        .find(|&(_, v)| v < 0 || v >= limit)
}

/// The position of the first value `target` in `bytes`.
pub(super) fn position_of<W: Word>(bytes: &[u8], target: i64) -> Option<usize> {
    bytes
        .chunks_exact(W::WIDTH)
        .position(|c| W::read_wide(c) == target)
}
