//! The shared secret and the challenge-response that proves it without sending it.
//!
//! The master sends a fresh 32-byte nonce and the node id it is about to assign; the peer answers
//! `HMAC-SHA256(token, nonce || node || protocol)` where `node` is the id as u32 big-endian
//! (`0xffff_ffff` for a client, which gets no id) and `protocol` the version as u16 big-endian.
//! Binding the id and the version means a captured answer is useless for another node, another
//! connection (new nonce) or another protocol. The master compares in constant time.

use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;

use super::error::{WireError, WireResult};

use super::env::TOKEN_ENV;
/// Bytes of a challenge nonce.
pub const NONCE_BYTES: usize = 32;
/// Bytes of a random token before hex encoding.
const RANDOM_TOKEN_BYTES: usize = 32;
/// Node id bound into a client's answer (clients get no node id).
const CLIENT_NODE: u32 = u32::MAX;

type HmacSha256 = Hmac<Sha256>;

/// The job's shared secret, and the name of the job it is for where the launcher knows one
/// (a Slurm job id: [`Token::for_job`]). The name is no secret: the hello carries it, so that
/// agents of two jobs that share one secret are told apart with an error that says so, where
/// the secret alone would admit them into the wrong job. `Debug` never prints the secret.
#[derive(Clone, PartialEq, Eq)]
pub struct Token {
    secret: String,
    job: Option<String>,
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Token(<{} bytes redacted>, job {:?})",
            self.secret.len(),
            self.job
        )
    }
}

impl Token {
    /// A token from a flag or file. Empty or whitespace-only tokens are refused: they would
    /// authenticate anyone who guesses "nothing".
    pub fn new(secret: &str) -> WireResult<Token> {
        let secret = secret.trim();
        if secret.is_empty() {
            return Err(WireError::InvalidToken {
                reason: "the token is empty".into(),
            });
        }
        Ok(Token {
            secret: secret.to_string(),
            job: None,
        })
    }

    /// This token, for the job named `job` (`None`, or an empty name: no job named).
    pub fn for_job(mut self, job: Option<&str>) -> Token {
        self.job = job
            .map(str::trim)
            .filter(|j| !j.is_empty())
            .map(String::from);
        self
    }

    /// The job this token is for, if named.
    pub fn job(&self) -> Option<&str> {
        self.job.as_deref()
    }

    /// A fresh random token (64 hex characters from the OS-seeded CSPRNG), for local mode where
    /// the master hands it to the agents it spawns through [`TOKEN_ENV`].
    pub fn random() -> Token {
        let mut bytes = [0u8; RANDOM_TOKEN_BYTES];
        rand::rng().fill_bytes(&mut bytes);
        Token {
            secret: hex::encode(bytes),
            job: None,
        }
    }

    /// The token in `OOBLECK_TOKEN`, `None` when unset. Set but empty or not UTF-8 is an error.
    pub fn from_env() -> WireResult<Option<Token>> {
        match std::env::var(TOKEN_ENV) {
            Ok(s) => Token::new(&s).map(Some),
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(_)) => Err(WireError::InvalidToken {
                reason: format!("{TOKEN_ENV} is not valid UTF-8"),
            }),
        }
    }

    /// The secret itself, to pass to a child process's environment. Never log it.
    pub fn expose(&self) -> &str {
        &self.secret
    }

    fn mac(&self, nonce: &[u8], node: Option<u32>, protocol: u16) -> HmacSha256 {
        let mut mac = HmacSha256::new_from_slice(self.secret.as_bytes())
            .expect("HMAC accepts keys of any length");
        mac.update(nonce);
        mac.update(&node.unwrap_or(CLIENT_NODE).to_be_bytes());
        mac.update(&protocol.to_be_bytes());
        mac
    }

    /// The peer's answer to a challenge.
    pub fn respond(&self, nonce: &[u8], node: Option<u32>, protocol: u16) -> Vec<u8> {
        self.mac(nonce, node, protocol)
            .finalize()
            .into_bytes()
            .to_vec()
    }

    /// Checks an answer in constant time.
    pub fn verify(&self, nonce: &[u8], node: Option<u32>, protocol: u16, answer: &[u8]) -> bool {
        self.mac(nonce, node, protocol).verify_slice(answer).is_ok()
    }
}

/// A fresh challenge nonce.
pub fn nonce() -> Vec<u8> {
    let mut n = vec![0u8; NONCE_BYTES];
    rand::rng().fill_bytes(&mut n);
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hmac_matches_rfc_4231_test_case_2() {
        // RFC 4231 §4.3: key "Jefe", data "what do ya want for nothing?".
        let key = Token::new("Jefe").unwrap();
        let mut mac = HmacSha256::new_from_slice(key.expose().as_bytes()).unwrap();
        mac.update(b"what do ya want for nothing?");
        assert_eq!(
            hex::encode(mac.finalize().into_bytes()),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }

    #[test]
    fn the_right_token_verifies_and_every_other_binding_fails() {
        let t = Token::new("s3cret").unwrap();
        let n = nonce();
        let answer = t.respond(&n, Some(2), 1);
        assert!(t.verify(&n, Some(2), 1, &answer));
        assert!(!t.verify(&n, Some(3), 1, &answer), "another node id");
        assert!(!t.verify(&n, None, 1, &answer), "client instead of node");
        assert!(!t.verify(&n, Some(2), 2, &answer), "another protocol");
        assert!(!t.verify(&nonce(), Some(2), 1, &answer), "another nonce");
        assert!(!Token::new("s3cres")
            .unwrap()
            .verify(&n, Some(2), 1, &answer));
        assert!(!t.verify(&n, Some(2), 1, &answer[..31]), "short answer");
    }

    #[test]
    fn empty_tokens_are_refused_and_debug_hides_the_secret() {
        assert!(Token::new("  ").is_err());
        let t = Token::random();
        assert_eq!(t.expose().len(), 64);
        assert_ne!(t, Token::random());
        assert!(!format!("{t:?}").contains(t.expose()));
    }
}
