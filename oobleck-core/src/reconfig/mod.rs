//! reconfig (in progress).
