//! `oobleck simulate`: replays a failure trace under several recovery policies.

pub mod plot;
