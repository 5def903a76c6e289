//! Who may do what on the status page. The decision is pure ([`decide`]); the [`Gate`] holds
//! the job token, the one-time login keys `train` prints and the sessions they became.
//!
//! | bound to     | GET (look)          | POST (act)          |
//! |--------------|---------------------|---------------------|
//! | loopback     | anyone on this host | token or session    |
//! | other        | token or session    | token or session    |
//!
//! `/login` (a one-time key for a session) needs no credentials: the key is checked itself.
//!
//! On loopback the `Host` header must name a loopback host too, so a web page elsewhere
//! cannot read the status through DNS rebinding.

use std::collections::HashSet;
use std::sync::Mutex;

use rand::RngCore;

/// The session cookie a one-time key becomes.
pub const SESSION_COOKIE: &str = "oobleck_session";

/// What a request wants to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    Look,
    Act,
    /// Trade a one-time key for a session (`/login`): how one gets credentials, so it needs
    /// none; the key is checked by [`Gate::redeem`].
    LogIn,
}

/// What a request brings.
#[derive(Debug, Clone, Copy, Default)]
pub struct Presented<'a> {
    /// The `Authorization: Bearer` value.
    pub bearer: Option<&'a str>,
    /// The session cookie's value.
    pub session: Option<&'a str>,
    /// The `Host` header.
    pub host: Option<&'a str>,
}

/// The answer to a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Allow,
    /// 401: credentials are needed.
    Unauthorized,
    /// 403: a loopback page asked for by a name that is not loopback.
    ForeignHost,
}

/// The pure rule of the table above. `known`: the request brought the token or a live session.
pub fn decide(loopback: bool, need: Need, known: bool, host_is_loopback: bool) -> Verdict {
    if loopback && !host_is_loopback {
        return Verdict::ForeignHost;
    }
    match (known, loopback, need) {
        (true, _, _) | (_, _, Need::LogIn) => Verdict::Allow,
        (false, true, Need::Look) => Verdict::Allow,
        (false, _, _) => Verdict::Unauthorized,
    }
}

/// Whether a `Host` header (`name[:port]`, `[v6]:port`) names this machine's loopback.
pub fn is_loopback_host(host: &str) -> bool {
    let name = match host.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(""),
        None => host.rsplit_once(':').map_or(host, |(n, _)| n),
    };
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// The token, the unused one-time keys and the live sessions.
pub struct Gate {
    token: String,
    loopback: bool,
    keys: Mutex<Keys>,
}

#[derive(Default)]
struct Keys {
    unused: HashSet<String>,
    sessions: HashSet<String>,
}

impl Gate {
    pub fn new(token: &str, loopback: bool) -> Gate {
        Gate {
            token: token.to_string(),
            loopback,
            keys: Mutex::default(),
        }
    }

    fn keys(&self) -> std::sync::MutexGuard<'_, Keys> {
        self.keys.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new one-time login key (for the link `train` prints).
    pub fn mint_key(&self) -> String {
        let key = random_hex();
        self.keys().unused.insert(key.clone());
        key
    }

    /// Trades a one-time key for a session id; `None` for a key unknown or already used.
    pub fn redeem(&self, key: &str) -> Option<String> {
        let mut k = self.keys();
        if !k.unused.remove(key) {
            return None;
        }
        let session = random_hex();
        k.sessions.insert(session.clone());
        Some(session)
    }

    /// Whether the request brought the token or a live session.
    pub fn knows(&self, p: &Presented) -> bool {
        p.bearer.is_some_and(|b| same(b, &self.token))
            || p.session.is_some_and(|s| self.keys().sessions.contains(s))
    }

    pub fn verdict(&self, need: Need, p: &Presented) -> Verdict {
        let host_ok = p.host.is_some_and(is_loopback_host);
        decide(self.loopback, need, self.knows(p), host_ok)
    }
}

/// Constant-time equality of two secrets (the length is not secret).
fn same(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

fn random_hex() -> String {
    let mut b = [0u8; 24];
    rand::rng().fill_bytes(&mut b);
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The value of cookie `name` in a `Cookie` header.
pub fn cookie<'a>(header: &'a str, name: &str) -> Option<&'a str> {
    header
        .split(';')
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_of_who_may_do_what() {
        use Need::*;
        use Verdict::*;
        // (loopback bind, need, known, host is loopback) -> verdict
        for (lb, need, known, host, want) in [
            (true, Look, false, true, Allow),
            (true, Act, false, true, Unauthorized),
            (true, Act, true, true, Allow),
            (true, Look, true, false, ForeignHost),
            (false, Look, false, true, Unauthorized),
            (false, Look, false, false, Unauthorized),
            (false, Act, false, false, Unauthorized),
            (false, Look, true, false, Allow),
            (false, Act, true, false, Allow),
            (false, LogIn, false, false, Allow),
            (true, LogIn, false, true, Allow),
            (true, LogIn, false, false, ForeignHost),
        ] {
            assert_eq!(
                decide(lb, need, known, host),
                want,
                "{lb} {need:?} {known} {host}"
            );
        }
    }

    #[test]
    fn loopback_host_names() {
        for h in [
            "127.0.0.1:8080",
            "localhost",
            "LOCALHOST:1",
            "[::1]:80",
            "127.3.4.5",
        ] {
            assert!(is_loopback_host(h), "{h}");
        }
        for h in [
            "evil.example:80",
            "10.0.0.1:80",
            "[2001:db8::1]:80",
            "127.0.0.1.evil",
        ] {
            assert!(!is_loopback_host(h), "{h}");
        }
    }

    #[test]
    fn a_key_works_once_and_becomes_a_session() {
        let g = Gate::new("s3cret", false);
        let key = g.mint_key();
        assert_eq!(g.redeem("nope"), None);
        let session = g.redeem(&key).expect("first use");
        assert_eq!(g.redeem(&key), None, "second use");
        let p = |bearer, session| Presented {
            bearer,
            session,
            host: Some("10.0.0.1:80"),
        };
        assert_eq!(
            g.verdict(Need::Act, &p(None, Some(&session))),
            Verdict::Allow
        );
        assert_eq!(
            g.verdict(Need::Look, &p(Some("s3cret"), None)),
            Verdict::Allow
        );
        assert_eq!(
            g.verdict(Need::Look, &p(Some("s3creT"), None)),
            Verdict::Unauthorized
        );
        assert_eq!(
            g.verdict(Need::Look, &p(None, Some(&key))),
            Verdict::Unauthorized,
            "a key is not a session"
        );
    }

    #[test]
    fn cookies_are_found_among_others() {
        let h = "a=1; oobleck_session=abc; b=2";
        assert_eq!(cookie(h, SESSION_COOKIE), Some("abc"));
        assert_eq!(cookie("a=1", SESSION_COOKIE), None);
    }
}
