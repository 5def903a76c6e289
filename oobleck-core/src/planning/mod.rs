//! planning (in progress).
