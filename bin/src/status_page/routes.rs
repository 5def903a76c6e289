//! The page's HTTP routes (axum), behind [`limit`], which asks the client's token bucket, and
//! [`gatekeeper`], which asks [`Gate`] about each request.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{ConnectInfo, Path, Query, Request, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use oobleck_core::runtime::wire::client::{request_drain, request_kill};
use serde_json::json;

use super::auth::{cookie, Need, Presented, Verdict, SESSION_COOKIE};
use super::limit::{retry_after_s, Client};
use super::{Shared, ASK_TIMEOUT};

const INDEX: &str = include_str!("assets/index.html");
const JS: &str = include_str!("assets/page.js");
const CSS: &str = include_str!("assets/page.css");

pub(super) fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route(
            "/",
            get(|| async { page(INDEX, "text/html; charset=utf-8") }),
        )
        .route(
            "/assets/page.js",
            get(|| async { page(JS, "text/javascript; charset=utf-8") }),
        )
        .route(
            "/assets/page.css",
            get(|| async { page(CSS, "text/css; charset=utf-8") }),
        )
        .route("/login", get(login))
        .route("/api/status", get(api_status))
        .route("/charts/{name}", get(chart))
        .route("/metrics", get(metrics))
        .route("/api/nodes/{node}/{action}", post(action))
        .fallback(|| async { error(StatusCode::NOT_FOUND, "no such page: try / or /api/status") })
        .layer(middleware::from_fn_with_state(shared.clone(), gatekeeper))
        // Outermost: a flood is refused before anything else is done for it.
        .layer(middleware::from_fn_with_state(shared.clone(), limit))
        .with_state(shared)
}

fn page(body: &'static str, kind: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, kind),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

fn error(code: StatusCode, message: &str) -> Response {
    (code, Json(json!({ "error": message }))).into_response()
}

/// What a request brings, from its headers.
fn presented(h: &HeaderMap) -> Presented<'_> {
    let text = |name| h.get(name).and_then(|v| v.to_str().ok());
    Presented {
        bearer: text(header::AUTHORIZATION).and_then(|a| a.strip_prefix("Bearer ")),
        session: text(header::COOKIE).and_then(|c| cookie(c, SESSION_COOKIE)),
        host: text(header::HOST),
    }
}

/// Lets through what the gate allows.
async fn gatekeeper(State(s): State<Arc<Shared>>, req: Request, next: Next) -> Response {
    let need = match (req.method(), req.uri().path()) {
        (&Method::POST, _) => Need::Act,
        (_, "/login") => Need::LogIn,
        _ => Need::Look,
    };
    match s.gate.verdict(need, &presented(req.headers())) {
        Verdict::Allow => next.run(req).await,
        Verdict::Unauthorized => error(
            StatusCode::UNAUTHORIZED,
            match need {
                Need::Act | Need::LogIn => "actions need the job's token: open the one-time link `train` printed, or send `Authorization: Bearer TOKEN`",
                Need::Look => "this page is not on loopback: open the one-time link `train` printed, or send `Authorization: Bearer TOKEN`",
            },
        ),
        Verdict::ForeignHost => error(
            StatusCode::FORBIDDEN,
            "this page listens on loopback: open it as 127.0.0.1 or localhost",
        ),
    }
}

/// Answers what the client's bucket allows; refuses the rest with 429 (see [`refuse`]).
async fn limit(State(s): State<Arc<Shared>>, req: Request, next: Next) -> Response {
    let ip = req
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map_or(IpAddr::from([0, 0, 0, 0]), |c| c.0.ip());
    let known = s.gate.knows(&presented(req.headers()));
    let verdict = s.limiter().admit(Client { ip, known }, Instant::now());
    match verdict {
        Ok(()) => next.run(req).await,
        Err(wait) => refuse(&s, ip, wait).await,
    }
}

/// A refused request's answer is held this long: a client that asks again as soon as it is
/// answered (a script's loop, a flood) then asks about once a second instead of spinning a
/// core on refusals, the page's and its own.
const HOLD: Duration = Duration::from_secs(1);
/// Refusals held at once, at most; past it they are answered at once (a held one costs a
/// connection and a timer, not CPU).
const HELD_MAX: usize = 256;

/// 429 with `Retry-After`, after [`HOLD`].
async fn refuse(s: &Shared, ip: IpAddr, wait: Duration) -> Response {
    let held = s.held.fetch_add(1, Ordering::Relaxed);
    let _release = Release(&s.held);
    if held < HELD_MAX {
        tokio::time::sleep(HOLD).await;
    }
    let r = s.tuning.rate;
    let after = retry_after_s(wait);
    let message = format!(
        "too many requests from {ip}: this page answers {} at once and {} a second per \
         client; ask again in {after} s\n",
        r.burst, r.per_s
    );
    (
        StatusCode::TOO_MANY_REQUESTS,
        [
            (header::RETRY_AFTER, after.to_string()),
            (header::CONTENT_TYPE, "text/plain; charset=utf-8".into()),
        ],
        message,
    )
        .into_response()
}

/// Counts a held refusal out when its answer is sent or its client hangs up.
struct Release<'a>(&'a AtomicUsize);

impl Drop for Release<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

#[derive(serde::Deserialize)]
struct Key {
    key: String,
}

async fn login(State(s): State<Arc<Shared>>, Query(k): Query<Key>) -> Response {
    match s.gate.redeem(&k.key) {
        Some(session) => {
            let c = format!("{SESSION_COOKIE}={session}; HttpOnly; SameSite=Strict; Path=/");
            ([(header::SET_COOKIE, c)], Redirect::to("/")).into_response()
        }
        None => error(
            StatusCode::UNAUTHORIZED,
            "this link was used already or is not this job's: send the job token as \
             `Authorization: Bearer TOKEN`, or restart `train` for a new link",
        ),
    }
}

async fn api_status(State(s): State<Arc<Shared>>, h: HeaderMap) -> Response {
    let can_act = s.gate.knows(&presented(&h));
    let body = s
        .snapshot()
        .await
        .status_json(&s.job, s.fault_threshold, can_act);
    ([(header::CONTENT_TYPE, "application/json")], body).into_response()
}

async fn metrics(State(s): State<Arc<Shared>>) -> Response {
    let text = s.snapshot().await.metrics_text(s.fault_threshold);
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

async fn chart(State(s): State<Arc<Shared>>, Path(name): Path<String>) -> Response {
    let Some(chart) = super::charts::Chart::named(&name) else {
        return error(
            StatusCode::NOT_FOUND,
            "charts: loss.svg, throughput.svg, step_time.svg",
        );
    };
    let version = s.snapshot().await.feed.charts_version();
    // Reading the run and drawing take milliseconds, off the page's one thread.
    let shared = s.clone();
    let svg = tokio::task::spawn_blocking(move || {
        let mut c = shared.charts.lock().unwrap_or_else(|p| p.into_inner());
        c.get(&shared.run, version, chart)
    })
    .await
    .unwrap_or_else(|e| super::charts::note_svg(&format!("drawing failed: {e}")));
    (
        [
            (header::CONTENT_TYPE, "image/svg+xml"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        svg,
    )
        .into_response()
}

async fn action(State(s): State<Arc<Shared>>, Path((node, what)): Path<(u32, String)>) -> Response {
    let r = match what.as_str() {
        "kill" => request_kill(s.master, &s.token, node, ASK_TIMEOUT).await,
        "drain" => request_drain(s.master, &s.token, node, false, ASK_TIMEOUT).await,
        _ => return error(StatusCode::NOT_FOUND, "actions: kill, drain"),
    };
    match r {
        Ok(_) => {
            let message = match what.as_str() {
                "kill" => format!("node {node} is being killed; the job recovers if it can"),
                _ => format!("node {node} leaves at the next step boundary"),
            };
            Json(json!({ "message": message })).into_response()
        }
        Err(oobleck_core::runtime::wire::WireError::Refused { reason: why }) => {
            error(StatusCode::CONFLICT, &format!("the master refused: {why}"))
        }
        Err(e) => error(
            StatusCode::BAD_GATEWAY,
            &format!("asking the master at {}: {e}", s.master),
        ),
    }
}
