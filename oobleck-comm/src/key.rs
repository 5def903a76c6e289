//! The secret a generation's ranks share: the master draws a fresh [`SecretKey`] for every
//! generation and hands it to the ranks with the plan, over the authenticated control plane.
//! The data plane's handshake and the state uploads prove it with HMAC-SHA256 without sending
//! it, so a process that can reach a worker's port but was not given the key is refused.

use hmac::{Hmac, Mac};
use rand::RngCore;
use serde::{Deserialize, Serialize};
use sha2::Sha256;

/// Bytes of a key, of a MAC and of a challenge nonce.
pub const KEY_BYTES: usize = 32;

type HmacSha256 = Hmac<Sha256>;

/// A 32-byte shared secret. `Debug` never prints it.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SecretKey([u8; KEY_BYTES]);

impl std::fmt::Debug for SecretKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SecretKey(<redacted>)")
    }
}

impl SecretKey {
    /// A fresh key from the OS-seeded CSPRNG.
    pub fn random() -> SecretKey {
        let mut k = [0u8; KEY_BYTES];
        rand::rng().fill_bytes(&mut k);
        SecretKey(k)
    }

    pub fn from_bytes(bytes: [u8; KEY_BYTES]) -> SecretKey {
        SecretKey(bytes)
    }

    /// `HMAC-SHA256(key, part_0 || part_1 || ...)`. Callers bind everything the MAC vouches
    /// for (a purpose label, the generation, the ranks, the peer's nonce) into `parts`.
    pub fn mac(&self, parts: &[&[u8]]) -> [u8; KEY_BYTES] {
        self.hmac(parts).finalize().into_bytes().into()
    }

    /// Whether `mac` is [`SecretKey::mac`] of `parts`, compared in constant time.
    pub fn verify(&self, parts: &[&[u8]], mac: &[u8]) -> bool {
        self.hmac(parts).verify_slice(mac).is_ok()
    }

    fn hmac(&self, parts: &[&[u8]]) -> HmacSha256 {
        let mut m = HmacSha256::new_from_slice(&self.0).expect("HMAC takes keys of any length");
        for p in parts {
            m.update(p);
        }
        m
    }
}

/// A fresh random challenge nonce.
pub fn nonce() -> [u8; KEY_BYTES] {
    let mut n = [0u8; KEY_BYTES];
    rand::rng().fill_bytes(&mut n);
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mac_verifies_only_under_its_key_and_parts() {
        let k = SecretKey::random();
        let mac = k.mac(&[b"hello", &7u64.to_le_bytes()]);
        assert!(k.verify(&[b"hello", &7u64.to_le_bytes()], &mac));
        assert!(!k.verify(&[b"hello", &8u64.to_le_bytes()], &mac));
        assert!(!SecretKey::random().verify(&[b"hello", &7u64.to_le_bytes()], &mac));
        assert!(!k.verify(&[b"hello", &7u64.to_le_bytes()], &mac[..31]));
        assert_ne!(nonce(), nonce());
    }

    #[test]
    fn debug_hides_the_key_and_json_round_trips() {
        let k = SecretKey::from_bytes([9; KEY_BYTES]);
        assert_eq!(format!("{k:?}"), "SecretKey(<redacted>)");
        let back: SecretKey = serde_json::from_str(&serde_json::to_string(&k).unwrap()).unwrap();
        assert_eq!(back, k);
    }
}
