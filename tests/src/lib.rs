//! Helpers shared by the cross-crate and multi-process tests.

pub mod execution;
