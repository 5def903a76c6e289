//! GPT-2's pre-tokenizer by hand: the pieces of the regex
//! `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`, found in one
//! forward pass instead of a backtracking regex (the `tokenizers` crate runs that regex through
//! `fancy-regex`, most of the time of its encoding).
//!
//! The character classes are the regex's own: the ranges of `\p{L}`, `\p{N}` and `\s` are
//! read from `regex-syntax`, the crate that compiles them for `fancy-regex`, so a Unicode
//! version or a class boundary cannot differ. (`char::is_alphabetic` is not `\p{L}`: it also
//! holds combining marks such as U+0345 and letter numbers such as Ⅻ.)

use std::sync::OnceLock;

use regex_syntax::hir::{Class, HirKind};

/// The class of a character as the regex sees it; the three named ones are disjoint (a
/// general category is one of L*, N*, and White_Space holds only Z*, Cc and U+0085).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(super) enum Kind {
    /// `\p{L}`.
    Letter = 0,
    /// `\p{N}`.
    Number = 1,
    /// `\s` (Unicode White_Space).
    Space = 2,
    /// Everything else: `[^\s\p{L}\p{N}]`.
    Other = 3,
}

const KINDS: [Kind; 4] = [Kind::Letter, Kind::Number, Kind::Space, Kind::Other];

/// Kinds of all characters: a direct table for the Basic Multilingual Plane, sorted ranges
/// above it.
struct Classes {
    bmp: Box<[u8]>,
    astral: Vec<(u32, u32, Kind)>,
}

fn classes() -> &'static Classes {
    static CLASSES: OnceLock<Classes> = OnceLock::new();
    CLASSES.get_or_init(build_classes)
}

/// The ranges of a Unicode class written in regex syntax, as `regex-syntax` compiles it.
fn class_ranges(pattern: &str) -> Vec<(u32, u32)> {
    let hir = regex_syntax::Parser::new()
        .parse(pattern)
        .expect("a Unicode class regex-syntax knows");
    match hir.kind() {
        HirKind::Class(Class::Unicode(class)) => class
            .ranges()
            .iter()
            .map(|r| (u32::from(r.start()), u32::from(r.end())))
            .collect(),
        other => panic!("{pattern} compiled to {other:?}, not a Unicode class"),
    }
}

fn build_classes() -> Classes {
    let mut bmp = vec![Kind::Other as u8; 0x1_0000].into_boxed_slice();
    let mut astral = Vec::new();
    for (pattern, kind) in [
        (r"\p{L}", Kind::Letter),
        (r"\p{N}", Kind::Number),
        (r"\s", Kind::Space),
    ] {
        for (start, end) in class_ranges(pattern) {
            for c in start..=end.min(0xFFFF) {
                bmp[c as usize] = kind as u8;
            }
            if end > 0xFFFF {
                astral.push((start.max(0x1_0000), end, kind));
            }
        }
    }
    astral.sort_unstable_by_key(|r| r.0);
    Classes { bmp, astral }
}

/// The kind of `c`.
pub(super) fn kind_of(c: char) -> Kind {
    let classes = classes();
    let c = u32::from(c);
    if c <= 0xFFFF {
        return KINDS[classes.bmp[c as usize] as usize];
    }
    let i = classes.astral.partition_point(|r| r.0 <= c);
    match i.checked_sub(1).map(|i| classes.astral[i]) {
        Some((_, end, kind)) if c <= end => kind,
        _ => Kind::Other,
    }
}

/// Kinds of the ASCII characters, so that the common case reads no table of `Classes`.
const ASCII: [Kind; 128] = {
    let mut t = [Kind::Other; 128];
    let mut b = 0;
    while b < 128 {
        t[b] = match b as u8 {
            b'a'..=b'z' | b'A'..=b'Z' => Kind::Letter,
            b'0'..=b'9' => Kind::Number,
            b'\t' | b'\n' | 0x0B | 0x0C | b'\r' | b' ' => Kind::Space,
            _ => Kind::Other,
        };
        b += 1;
    }
    t
};

/// The kind and UTF-8 length of the character starting at byte `i` of `s` (`i < s.len()`, at a
/// character boundary).
#[inline]
fn char_at(s: &str, i: usize) -> (Kind, usize) {
    let b = s.as_bytes()[i];
    if b < 0x80 {
        return (ASCII[b as usize], 1);
    }
    let c = s[i..].chars().next().expect("i is inside s");
    (kind_of(c), c.len_utf8())
}

/// End of the run of characters of `kind` starting at `i` (which may be `s.len()`).
#[inline]
fn run_end(s: &str, mut i: usize, kind: Kind) -> usize {
    let b = s.as_bytes();
    while i < b.len() {
        // A tight loop for ASCII letters, the bulk of English text.
        if b[i] < 0x80 {
            if ASCII[b[i] as usize] != kind {
                return i;
            }
            i += 1;
            continue;
        }
        let (k, len) = char_at(s, i);
        if k != kind {
            return i;
        }
        i += len;
    }
    i
}

/// Length of a contraction (`'s`, `'t`, `'re`, `'ve`, `'m`, `'ll`, `'d`) at the start of `b`,
/// 0 if there is none. Case-sensitive, as the regex is.
#[inline]
fn contraction(b: &[u8]) -> usize {
    match b {
        [b'\'', b's' | b't' | b'm' | b'd', ..] => 2,
        [b'\'', b'r', b'e', ..] | [b'\'', b'v', b'e', ..] | [b'\'', b'l', b'l', ..] => 3,
        _ => 0,
    }
}

/// End of the piece starting at `i < s.len()`: the regex's match there, its alternatives
/// tried in order.
#[inline]
fn piece_end(s: &str, i: usize) -> usize {
    let b = s.as_bytes();
    if b[i] == b'\'' {
        let n = contraction(&b[i..]);
        if n > 0 {
            return i + n;
        }
    }
    // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+` with their space.
    if b[i] == b' ' && i + 1 < b.len() {
        let (next, _) = char_at(s, i + 1);
        if next != Kind::Space {
            return run_end(s, i + 1, next);
        }
    }
    let (kind, len) = char_at(s, i);
    if kind != Kind::Space {
        return run_end(s, i + len, kind);
    }
    space_piece_end(s, i, len)
}

/// `\s+(?!\S)|\s+` at a whitespace character of `first_len` bytes at `i`: a run that ends the
/// text is one piece; a run followed by a non-space gives up its last character (which then
/// starts the next piece, ` word` if it is a space), unless that character is all of it.
fn space_piece_end(s: &str, i: usize, first_len: usize) -> usize {
    let b = s.as_bytes();
    let (mut last, mut j) = (i, i + first_len);
    while j < b.len() {
        let (k, len) = char_at(s, j);
        if k != Kind::Space {
            break;
        }
        last = j;
        j += len;
    }
    if j == b.len() || last == i {
        j
    } else {
        last
    }
}

/// The pieces of `s` in order; their concatenation is `s`.
pub(super) fn pieces(s: &str) -> Pieces<'_> {
    Pieces { s, at: 0 }
}

pub(super) struct Pieces<'a> {
    s: &'a str,
    at: usize,
}

impl<'a> Iterator for Pieces<'a> {
    type Item = &'a str;

    #[inline]
    fn next(&mut self) -> Option<&'a str> {
        if self.at >= self.s.len() {
            return None;
        }
        let start = self.at;
        self.at = piece_end(self.s, start);
        Some(&self.s[start..self.at])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(s: &str) -> Vec<&str> {
        pieces(s).collect()
    }

    #[test]
    fn pieces_of_gpt2_examples() {
        assert_eq!(
            split("Hello world, it's 2024!"),
            ["Hello", " world", ",", " it", "'s", " 2024", "!"]
        );
        // A space run before a word keeps its last space for the word; at the end it is whole.
        assert_eq!(split("a   b  "), ["a", "  ", " b", "  "]);
        // A lone non-space whitespace before a word is its own piece (`\s+`).
        assert_eq!(split("a\nb\u{a0}c"), ["a", "\n", "b", "\u{a0}", "c"]);
        assert_eq!(split("x \n\n y"), ["x", " \n\n", " y"]);
        // A contraction only at an apostrophe's piece start; a space before it is punctuation.
        assert_eq!(
            split("?'s 's'LL'll"),
            ["?'", "s", " '", "s", "'", "LL", "'ll"]
        );
    }

    #[test]
    fn classes_are_the_regex_classes_not_std_ones() {
        // U+0345 (combining ypogegrammeni) is Alphabetic but a mark, not \p{L}.
        assert!('\u{345}'.is_alphabetic());
        assert_eq!(kind_of('\u{345}'), Kind::Other);
        // U+216B (Roman numeral twelve) is Alphabetic and \p{N} (Nl).
        assert_eq!(kind_of('\u{216B}'), Kind::Number);
        assert_eq!(kind_of('é'), Kind::Letter);
        assert_eq!(kind_of('\u{2028}'), Kind::Space);
        assert_eq!(kind_of('\u{85}'), Kind::Space);
        assert_eq!(kind_of('\u{200B}'), Kind::Other);
        assert_eq!(kind_of('𝔸'), Kind::Letter);
        assert_eq!(kind_of('🎉'), Kind::Other);
        for b in 0..128u8 {
            assert_eq!(ASCII[b as usize], kind_of(b as char), "byte {b}");
        }
    }
}
