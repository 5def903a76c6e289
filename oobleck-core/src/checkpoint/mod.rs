//! checkpoint (in progress).
