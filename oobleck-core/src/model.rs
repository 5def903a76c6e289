//! Model-facing traits (in progress).
