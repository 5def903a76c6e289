//! Shared code of the `train` and `oobleck` binaries.
