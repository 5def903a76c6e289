//! nanoGPT's raw `train.bin` / `val.bin`: bare u16 little-endian token ids, no header.
//!
//! ```text
//! byte 0        2        4
//! | token 0    | token 1 | ...      (u16 LE each; the file is 2 x count bytes)
//! ```
//!
//! Nothing in the file says what it is, so it is read only when the caller says so
//! (`--data-format u16`, [`super::FormatHint::RawU16`]). nanoGPT's `openwebtext/prepare.py`
//! appends the end-of-text token *after* every document (its Shakespeare files have none: one
//! document), so a document ends with its delimiter ([`super::DelimiterPlacement::After`]).

use std::path::Path;

use super::dtype::TokenDtype;
use super::error::ShardError;
use super::view::{DelimiterPlacement, DocumentLayout, Layout};

/// The token layout of the raw u16 file `bytes` (the whole file at `path`).
pub(super) fn parse(path: &Path, bytes: &[u8]) -> Result<Layout, ShardError> {
    if bytes.len() % 2 != 0 {
        return Err(ShardError::RawOddLength {
            path: path.to_path_buf(),
            len: bytes.len() as u64,
        });
    }
    Ok(Layout {
        dtype: TokenDtype::U16,
        start: 0,
        len: bytes.len() / 2,
        documents: DocumentLayout::Delimited(DelimiterPlacement::After),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_two_bytes_are_one_token() {
        let layout = parse(Path::new("train.bin"), &[1, 0, 2, 0, 3, 0]).unwrap();
        assert_eq!(
            (layout.dtype, layout.start, layout.len),
            (TokenDtype::U16, 0, 3)
        );
        assert_eq!(parse(Path::new("empty.bin"), &[]).unwrap().len, 0);
    }

    #[test]
    fn an_odd_length_names_the_half_token_and_what_to_do() {
        let msg = parse(Path::new("train.bin"), &[1, 0, 2])
            .err()
            .unwrap()
            .to_string();
        assert!(
            msg.starts_with("train.bin: 3 bytes is an odd length"),
            "{msg}"
        );
        assert!(msg.contains("at offset 2, is half a token"), "{msg}");
        assert!(msg.contains("--data-format"), "{msg}");
    }
}
