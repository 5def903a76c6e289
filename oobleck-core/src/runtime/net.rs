//! Addresses given as text (flags, environment, the plan's rendezvous).

use std::net::{SocketAddr, ToSocketAddrs};

use super::error::{Context, Result};

/// Resolves `HOST:PORT` (a name or an IP) to its first address.
pub fn resolve(addr: &str) -> Result<SocketAddr> {
    addr.to_socket_addrs()
        .with_ctx(|| format!("resolving {addr:?} (expected HOST:PORT)"))?
        .next()
        .with_ctx(|| format!("{addr:?} resolves to no address"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_resolve_and_bad_ones_say_what_was_expected() {
        let a = resolve("127.0.0.1:7000").expect("an IP resolves");
        assert_eq!(a, "127.0.0.1:7000".parse::<SocketAddr>().expect("literal"));
        let e = resolve("no-port-here").expect_err("no port").to_string();
        assert!(e.contains("expected HOST:PORT"), "{e}");
    }
}
