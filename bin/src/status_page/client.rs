//! A bare HTTP/1 GET against a status page (what `oobleck status` and the tests use), over
//! hyper on a fresh connection, bounded in time and size.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use http_body_util::{BodyExt, Empty, Limited};
use hyper::body::Bytes;
use hyper::{header, Method, Request};
use hyper_util::rt::TokioIo;

/// The largest answer read (a status document is tens of kilobytes).
const MAX_BODY: usize = 16 << 20;

/// The page's address from its URL, `http://IP:PORT/...`.
pub fn page_addr(url: &str) -> Result<SocketAddr> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| anyhow!("{url}: not an http:// address"))?;
    let hostport = rest.split('/').next().unwrap_or(rest);
    oobleck_core::runtime::net::resolve(hostport).with_context(|| format!("{url}: no HOST:PORT"))
}

/// `method path` at `addr` with an optional bearer token: the status code and the body.
pub async fn request(
    addr: SocketAddr,
    method: Method,
    path: &str,
    bearer: Option<&str>,
    host: Option<&str>,
) -> Result<(u16, String)> {
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .with_context(|| format!("connecting to the status page at {addr}"))?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .context("HTTP handshake")?;
    let conn = tokio::spawn(conn);
    let mut req = Request::builder().method(method).uri(path).header(
        header::HOST,
        host.map_or_else(|| addr.to_string(), str::to_string),
    );
    if let Some(t) = bearer {
        req = req.header(header::AUTHORIZATION, format!("Bearer {t}"));
    }
    let res = sender
        .send_request(req.body(Empty::<Bytes>::new())?)
        .await
        .with_context(|| format!("asking {addr} for {path}"))?;
    let status = res.status().as_u16();
    let body = Limited::new(res.into_body(), MAX_BODY)
        .collect()
        .await
        .map_err(|e| anyhow!("reading the answer to {path}: {e}"))?
        .to_bytes();
    conn.abort();
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

/// [`request`] from blocking code, within `timeout`.
pub fn fetch(
    addr: SocketAddr,
    method: Method,
    path: &str,
    bearer: Option<&str>,
    timeout: Duration,
) -> Result<(u16, String)> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting a runtime")?;
    rt.block_on(async {
        match tokio::time::timeout(timeout, request(addr, method, path, bearer, None)).await {
            Ok(r) => r,
            Err(_) => bail!("the status page at {addr} did not answer {path} within {timeout:?}"),
        }
    })
}
