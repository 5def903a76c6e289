//! Communicators for Oobleck-rs.
