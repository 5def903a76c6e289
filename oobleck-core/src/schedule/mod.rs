//! schedule (in progress).
