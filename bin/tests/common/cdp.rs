//! A small Chrome DevTools Protocol client for tests that drive a real headless browser.
//!
//! The browser is started with `--remote-debugging-pipe`: it reads commands on fd 3 and writes
//! replies and events on fd 4, each message one JSON object ended by a NUL byte, so no
//! websocket is needed.
//!
//! ```text
//!  test thread ── command {id, sessionId} ──► fd 3 ──► chromium
//!       ▲                                                 │
//!       └── reply, routed by id (channel) ◄── reader ◄── fd 4
//!                                               │
//!          event, routed by sessionId ──► PageState (console errors, dialogs, loads)
//! ```
//!
//! The reader thread answers JavaScript dialogs itself (accept, with the page's prompt text),
//! so a `confirm()` opened by a click cannot block the click's own `Runtime.evaluate`. Every
//! wait has a timeout and its error names what was waited for. The browser runs in its own
//! process group, killed and reaped on drop, so none outlives a test, also one that panics.
//! Finding, starting and reaping the browser live in `cdp/process.rs`.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::Child;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use base64::Engine as _;
use serde_json::{json, Value};

mod process;
pub use process::processes_of;
use process::{find_browser, spawn};

/// How long one command may wait for its reply.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(15);
/// How long a navigation may take to fire its load event.
pub const LOAD_TIMEOUT: Duration = Duration::from_secs(20);
/// How often `wait_for` re-evaluates its predicate.
const POLL: Duration = Duration::from_millis(50);

/// What one page has seen since it was opened; written by the reader thread.
#[derive(Default)]
struct PageState {
    console_errors: Vec<String>,
    dialogs: Vec<String>,
    prompt_text: String,
    /// Loader ids whose document fired its `load` lifecycle event.
    loaded: HashSet<String>,
}

type Shared = Arc<(Mutex<PageState>, Condvar)>;

/// A string field as an owned `String`, empty when absent.
fn text(v: &Value) -> String {
    v.as_str().unwrap_or_default().to_string()
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Only the reader thread and test code hold these, never across a panic that matters.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The pipe to the browser and the routing tables the reader thread serves.
struct Conn {
    writer: Mutex<File>,
    next_id: AtomicU64,
    pending: Mutex<HashMap<u64, mpsc::Sender<Value>>>,
    sessions: Mutex<HashMap<String, Shared>>,
    /// Set once the browser closed its end, so later calls fail at once.
    closed: AtomicBool,
}

impl Conn {
    /// Writes one command without waiting; returns its id.
    fn send(&self, method: &str, params: Value, session: Option<&str>) -> Result<u64> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.write(id, method, params, session)?;
        Ok(id)
    }

    fn write(&self, id: u64, method: &str, params: Value, session: Option<&str>) -> Result<()> {
        let mut msg = json!({ "id": id, "method": method, "params": params });
        if let Some(s) = session {
            msg["sessionId"] = json!(s);
        }
        let mut bytes = serde_json::to_vec(&msg)?;
        bytes.push(0);
        lock(&self.writer)
            .write_all(&bytes)
            .with_context(|| format!("writing {method} to the browser's pipe"))
    }

    /// Sends one command and waits up to `limit` for its reply; returns the reply's `result`.
    fn call(
        &self,
        method: &str,
        params: Value,
        sess: Option<&str>,
        limit: Duration,
    ) -> Result<Value> {
        if self.closed.load(Ordering::Acquire) {
            bail!("cannot send {method}: the browser has closed its pipe");
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel();
        // Registered before writing, so even an instant reply finds its channel.
        lock(&self.pending).insert(id, tx);
        let written = self.write(id, method, params, sess);
        let reply = written.map(|()| rx.recv_timeout(limit));
        lock(&self.pending).remove(&id);
        let reply = match reply? {
            Ok(r) => r,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                bail!("timed out after {limit:?} waiting for the reply to {method}")
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                bail!("the browser closed its pipe before replying to {method}")
            }
        };
        if let Some(e) = reply.get("error") {
            bail!("{method} failed: {e}");
        }
        Ok(reply.get("result").cloned().unwrap_or(Value::Null))
    }

    /// The reader thread: one NUL-terminated JSON message at a time until the browser closes.
    fn read_loop(&self, pipe: File) {
        let mut r = BufReader::new(pipe);
        let mut buf = Vec::new();
        loop {
            buf.clear();
            match r.read_until(0, &mut buf) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
            if buf.last() == Some(&0) {
                buf.pop();
            }
            // The browser writes only JSON here; anything else is skipped, not fatal.
            if let Ok(msg) = serde_json::from_slice::<Value>(&buf) {
                self.route(msg);
            }
        }
        self.closed.store(true, Ordering::Release);
        // Dropping the senders wakes every waiting call with `Disconnected`.
        lock(&self.pending).clear();
    }

    fn route(&self, msg: Value) {
        if let Some(id) = msg.get("id").and_then(Value::as_u64) {
            // A reply nobody waits for (a timed-out call, a dialog answer) is dropped.
            if let Some(tx) = lock(&self.pending).remove(&id) {
                let _ = tx.send(msg);
            }
            return;
        }
        let Some(session) = msg.get("sessionId").and_then(Value::as_str) else {
            return; // browser-level events: nothing here needs them
        };
        let Some(page) = lock(&self.sessions).get(session).cloned() else {
            return;
        };
        let method = msg["method"].as_str().unwrap_or_default();
        self.on_event(session, &page, method, &msg["params"]);
    }

    fn on_event(&self, session: &str, page: &Shared, method: &str, p: &Value) {
        let (state, changed) = &**page;
        let mut st = lock(state);
        match method {
            "Page.javascriptDialogOpening" => {
                st.dialogs.push(text(&p["message"]));
                let mut answer = json!({ "accept": true });
                if p["type"] == "prompt" {
                    answer["promptText"] = json!(st.prompt_text);
                }
                // Its reply is not awaited: this thread is the one that would deliver it.
                let _ = self.send("Page.handleJavaScriptDialog", answer, Some(session));
            }
            "Page.lifecycleEvent" if p["name"] == "load" => {
                st.loaded.insert(text(&p["loaderId"]));
            }
            _ => match console_error(method, p) {
                Some(e) => st.console_errors.push(e),
                None => return,
            },
        }
        changed.notify_all();
    }
}

/// The text and place of a console error, exception or error log entry; `None` for others.
fn console_error(method: &str, p: &Value) -> Option<String> {
    // Each kind's `place` is the object carrying its `url` and `lineNumber`.
    let (kind, what, place) = match method {
        "Runtime.consoleAPICalled" if p["type"] == "error" => {
            let args = p["args"].as_array().map(Vec::as_slice).unwrap_or_default();
            let words: Vec<String> = args.iter().map(remote_text).collect();
            (
                "console.error",
                words.join(" "),
                &p["stackTrace"]["callFrames"][0],
            )
        }
        "Runtime.exceptionThrown" => {
            let d = &p["exceptionDetails"];
            ("exception", exception_text(d), d)
        }
        "Log.entryAdded" if p["entry"]["level"] == "error" => {
            ("log", text(&p["entry"]["text"]), &p["entry"])
        }
        _ => return None,
    };
    let url = place["url"].as_str().unwrap_or("?");
    // The protocol counts lines from 0; people and editors from 1.
    let line = place["lineNumber"].as_u64().map(|l| format!(":{}", l + 1));
    Some(format!(
        "{kind}: {what} ({url}{})",
        line.unwrap_or_default()
    ))
}

/// An exception's description (message and stack), else the protocol's summary text.
fn exception_text(details: &Value) -> String {
    let d = details["exception"]["description"].as_str();
    d.or(details["text"].as_str()).unwrap_or("?").to_string()
}

/// A console argument as the console would print it.
fn remote_text(arg: &Value) -> String {
    match (&arg["value"], arg["description"].as_str()) {
        (Value::String(s), _) => s.clone(),
        (Value::Null, Some(d)) => d.to_string(),
        (v, _) => v.to_string(),
    }
}

/// A headless chromium on a pipe, in its own process group, with a fresh profile.
pub struct Browser {
    conn: Arc<Conn>,
    child: Child,
    profile: tempfile::TempDir,
}

impl Browser {
    /// Starts the browser, or returns `None` (saying so loudly on stderr) when none is
    /// installed. With `OOBLECK_REQUIRE_BROWSER=1` a missing browser is an error instead, so CI
    /// cannot skip these tests without noticing.
    pub fn launch() -> Result<Option<Browser>> {
        let Some(exe) = find_browser()? else {
            if std::env::var("OOBLECK_REQUIRE_BROWSER").as_deref() == Ok("1") {
                bail!("OOBLECK_REQUIRE_BROWSER=1 but no browser was found (set $OOBLECK_CHROMIUM or install chromium)");
            }
            // Straight to fd 2: `eprintln!` would be swallowed by the test harness's capture.
            let _ = writeln!(
                std::io::stderr(),
                "!!!!! BROWSER TEST SKIPPED: no chromium ($OOBLECK_CHROMIUM, chromium, \
                 chromium-browser, google-chrome); set OOBLECK_REQUIRE_BROWSER=1 to fail instead"
            );
            return Ok(None);
        };
        Self::launch_at(&exe).map(Some)
    }

    fn launch_at(exe: &Path) -> Result<Browser> {
        let profile = tempfile::tempdir().context("creating the browser's profile directory")?;
        let (child, to_browser, from_browser) = spawn(exe, profile.path())?;
        let conn = Arc::new(Conn {
            writer: Mutex::new(to_browser),
            next_id: AtomicU64::new(1),
            pending: Mutex::default(),
            sessions: Mutex::default(),
            closed: AtomicBool::new(false),
        });
        let reader = Arc::clone(&conn);
        std::thread::spawn(move || reader.read_loop(from_browser));
        // From here on, dropping `browser` kills the group, also on the error below.
        let browser = Browser {
            conn,
            child,
            profile,
        };
        if let Err(e) = browser.call("Browser.getVersion", json!({})) {
            let log = std::fs::read_to_string(browser.profile.path().join("stderr.log"));
            let log = log.unwrap_or_default();
            let tail = log.lines().rev().take(20).collect::<Vec<_>>();
            let tail = tail.into_iter().rev().collect::<Vec<_>>().join("\n");
            let exe = exe.display();
            return Err(e.context(format!(
                "{exe} did not answer on its pipe; stderr ends:\n{tail}"
            )));
        }
        Ok(browser)
    }

    fn call(&self, method: &str, params: Value) -> Result<Value> {
        self.conn.call(method, params, None, CALL_TIMEOUT)
    }

    /// The browser's pid, which is also its process group id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The browser's processes now (see [`processes_of`]).
    pub fn processes(&self) -> Vec<u32> {
        processes_of(self.pid(), self.profile.path())
    }

    /// The fresh profile directory (`--user-data-dir`), removed on drop.
    pub fn profile_dir(&self) -> &Path {
        self.profile.path()
    }

    /// Opens a blank tab with Page, Runtime and Log events on.
    pub fn new_page(&self) -> Result<Page> {
        let t = self.call("Target.createTarget", json!({ "url": "about:blank" }))?;
        let target = text(&t["targetId"]);
        let args = json!({ "targetId": target, "flatten": true });
        let session = text(&self.call("Target.attachToTarget", args)?["sessionId"]);
        if target.is_empty() || session.is_empty() {
            bail!("the browser gave no target or session for a new page: {t}");
        }
        let state: Shared = Arc::default();
        // Registered before any domain is enabled, so no event of this page is missed.
        lock(&self.conn.sessions).insert(session.clone(), Arc::clone(&state));
        let conn = Arc::clone(&self.conn);
        let page = Page {
            conn,
            session,
            target,
            state,
        };
        for m in ["Page.enable", "Runtime.enable", "Log.enable"] {
            page.call(m, json!({}))?;
        }
        page.call("Page.setLifecycleEventsEnabled", json!({ "enabled": true }))?;
        Ok(page)
    }
}
impl Drop for Browser {
    fn drop(&mut self) {
        process::kill_all(&mut self.child, self.profile.path());
    }
}

/// One tab, attached with a flat session.
pub struct Page {
    conn: Arc<Conn>,
    session: String,
    target: String,
    state: Shared,
}

impl Page {
    fn call(&self, method: &str, params: Value) -> Result<Value> {
        self.conn
            .call(method, params, Some(&self.session), CALL_TIMEOUT)
    }

    /// Loads `url` and waits for its load event.
    pub fn navigate(&self, url: &str) -> Result<()> {
        let r = self.call("Page.navigate", json!({ "url": url }))?;
        if let Some(e) = r["errorText"].as_str() {
            bail!("navigating to {url}: {e}");
        }
        let Some(loader) = r["loaderId"].as_str() else {
            return Ok(()); // a same-document navigation has no new load
        };
        let (state, changed) = &*self.state;
        let st = lock(state);
        let (st, wait) = changed
            .wait_timeout_while(st, LOAD_TIMEOUT, |s| !s.loaded.contains(loader))
            .unwrap_or_else(|p| p.into_inner());
        drop(st);
        if wait.timed_out() {
            bail!("timed out after {LOAD_TIMEOUT:?} waiting for the load event of {url}");
        }
        Ok(())
    }

    /// Evaluates `js` (awaiting a promise) and returns its value as JSON; a thrown exception is
    /// an error carrying its text.
    pub fn eval(&self, js: &str) -> Result<Value> {
        self.eval_within(js, CALL_TIMEOUT)
    }

    fn eval_within(&self, js: &str, limit: Duration) -> Result<Value> {
        let args = json!({ "expression": js, "returnByValue": true, "awaitPromise": true });
        let r = self
            .conn
            .call("Runtime.evaluate", args, Some(&self.session), limit)?;
        if let Some(d) = r.get("exceptionDetails") {
            bail!("evaluating `{js}` threw: {}", exception_text(d));
        }
        Ok(r["result"].get("value").cloned().unwrap_or(Value::Null))
    }

    /// Polls `js` until it is truthy; after `timeout` an error naming `what` (and the last
    /// evaluation error, if the predicate threw).
    pub fn wait_for(&self, js: &str, timeout: Duration, what: &str) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let expr = format!("!!({js})");
        let mut last_err = None;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.eval_within(&expr, left.max(POLL)) {
                Ok(Value::Bool(true)) => return Ok(()),
                Ok(_) => {}
                Err(e) => last_err = Some(e),
            }
            if Instant::now() >= deadline {
                let why = last_err
                    .map(|e| format!(" (last error: {e:#})"))
                    .unwrap_or_default();
                bail!(
                    "timed out after {timeout:?} waiting for {what}: `{js}` never became true{why}"
                );
            }
            std::thread::sleep(POLL.min(deadline.saturating_duration_since(Instant::now())));
        }
    }

    /// Clicks the first element matching `selector`; no match is an error.
    pub fn click(&self, selector: &str) -> Result<()> {
        let sel = serde_json::to_string(selector)?;
        let js = format!(
            "(() => {{ const el = document.querySelector({sel}); \
             if (!el) throw new Error('no element matches ' + {sel}); el.click(); return true; }})()"
        );
        self.eval(&js)
            .with_context(|| format!("clicking {selector}"))?;
        Ok(())
    }

    /// Console errors, uncaught exceptions and error log entries since the page was opened,
    /// each with its text and `url:line`.
    pub fn console_errors(&self) -> Vec<String> {
        lock(&self.state.0).console_errors.clone()
    }

    /// Messages of the dialogs opened so far; each was accepted.
    pub fn dialogs(&self) -> Vec<String> {
        lock(&self.state.0).dialogs.clone()
    }

    /// The text later `prompt()`s are answered with (empty until set).
    pub fn set_prompt_text(&self, text: &str) {
        lock(&self.state.0).prompt_text = text.to_string();
    }

    /// Writes a PNG of the whole page, beyond the viewport, to `path`.
    pub fn screenshot(&self, path: &Path) -> Result<()> {
        let m = self.call("Page.getLayoutMetrics", json!({}))?;
        let size = &m["cssContentSize"];
        let side = |k: &str| size[k].as_f64().unwrap_or(0.0).max(1.0);
        let clip =
            json!({ "x": 0, "y": 0, "width": side("width"), "height": side("height"), "scale": 1 });
        let args = json!({ "format": "png", "captureBeyondViewport": true, "clip": clip });
        let shot = self.call("Page.captureScreenshot", args)?;
        let png = base64::engine::general_purpose::STANDARD
            .decode(text(&shot["data"]))
            .context("decoding the screenshot's base64")?;
        if png.is_empty() {
            bail!("Page.captureScreenshot gave no image");
        }
        std::fs::write(path, png).with_context(|| format!("writing {}", path.display()))
    }
}

impl Drop for Page {
    fn drop(&mut self) {
        lock(&self.conn.sessions).remove(&self.session);
        // Not awaited: the browser may already be gone, and closing is a courtesy.
        let close = json!({ "targetId": self.target });
        let _ = self.conn.send("Target.closeTarget", close, None);
    }
}
