//! The live status page of a running local job, in a real headless browser: it loads with no
//! console errors and shows the nodes and pipelines; after `--inject-failure` it shows the new
//! plan and the failure; its Kill button (behind a confirmation and the one-time login) kills
//! a node and the page follows. Meanwhile `/metrics` parses as Prometheus text and agrees with
//! `metrics.jsonl`, `/api/status` agrees with `oobleck status`, and requests without
//! credentials are refused. Screenshots of the page and of the report are kept under
//! `$CARGO_TARGET_TMPDIR/status_page/`.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::cdp::{Browser, Page};
use common::*;
use oobleck_cli::status_page::client::{fetch, page_addr};

const WAIT: Duration = Duration::from_secs(90);
const HTTP: Duration = Duration::from_secs(10);

/// Polls `f` until it gives a value, within `limit`.
fn until<T>(limit: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(start.elapsed() < limit, "waited {limit:?} for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The one-time login link `train` printed (its stderr goes to `log`).
fn login_link(log: &Path) -> String {
    until(WAIT, "the status page line on stderr", || {
        let text = std::fs::read_to_string(log).ok()?;
        let line = text.lines().find(|l| l.starts_with("status page: "))?;
        let at = line.find("/login?key=")?;
        let start = line[..at].rfind("http://")?;
        let end = line[at..].find(' ').map_or(line.len(), |e| at + e);
        Some(line[start..end].to_string())
    })
}

fn out_dir() -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join("status_page");
    std::fs::create_dir_all(&d).expect("screenshot directory");
    d
}

/// How many node rows and pipelines the page shows, and its generation.
fn shown(page: &Page) -> (u64, u64, String) {
    let v = page
        .eval(
            "[document.querySelectorAll('#nodes tr[data-node]').length,
              document.querySelectorAll('#plan [data-pipeline]').length,
              document.querySelector('#generation').textContent.trim()]",
        )
        .expect("read the page");
    let n = |i: usize| v[i].as_u64().unwrap_or(0);
    (n(0), n(1), v[2].as_str().unwrap_or("").to_string())
}

fn assert_no_console_errors(page: &Page, when: &str) {
    let errors = page.console_errors();
    assert!(errors.is_empty(), "console errors {when}: {errors:#?}");
}

/// `/metrics` parses, and its step's loss and throughput are that step's line in the file.
fn metrics_agree_with_the_file(addr: std::net::SocketAddr, run: &Path) {
    // Before the first commit there is no step to report.
    let (text, scrape) = until(WAIT, "a committed step in /metrics", || {
        let (code, text) = fetch(addr, hyper::Method::GET, "/metrics", None, HTTP).ok()?;
        assert_eq!(code, 200, "{text}");
        let scrape = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_string())))
            .expect("Prometheus text");
        scrape
            .samples
            .iter()
            .any(|s| s.metric == "oobleck_step")
            .then_some((text, scrape))
    });
    let gauge = |name: &str| {
        scrape
            .samples
            .iter()
            .find(|s| s.metric == name && s.labels.is_empty())
            .map(|s| match s.value {
                prometheus_parse::Value::Gauge(v) => v,
                ref v => panic!("{name} is not a gauge: {v:?}"),
            })
            .unwrap_or_else(|| panic!("no {name} in {text}"))
    };
    let step = gauge("oobleck_step") as u64;
    let line = per_step(run, "loss")
        .into_iter()
        .find(|(s, _)| *s == step)
        .unwrap_or_else(|| panic!("no step {step} in metrics.jsonl"));
    assert_eq!(gauge("oobleck_loss"), line.1, "loss of step {step}");
    let tput = per_step(run, "tokens_per_s");
    let tput = tput.iter().find(|(s, _)| *s == step).expect("tokens_per_s");
    assert_eq!(gauge("oobleck_tokens_per_second"), tput.1);
    for name in [
        "oobleck_nodes",
        "oobleck_pipelines",
        "oobleck_fault_tolerance",
    ] {
        assert!(gauge(name) >= 1.0, "{name}");
    }
    assert!(
        scrape
            .samples
            .iter()
            .any(|s| s.metric == "oobleck_stage_forward_ms"
                && s.labels.get("pipeline").is_some()
                && s.labels.get("stage").is_some()),
        "per-stage times with their places: {text}"
    );
}

/// `/api/status` and `oobleck status --json` name the same nodes, plan and generation.
fn api_agrees_with_oobleck_status(addr: std::net::SocketAddr, run: &Path) {
    let key = |v: &serde_json::Value| {
        let nodes: Vec<_> = v["nodes"]
            .as_array()
            .expect("nodes")
            .iter()
            .map(|n| n["node"].clone())
            .collect();
        (nodes, v["pipelines"].clone(), v["generation"].clone())
    };
    until(WAIT, "/api/status and oobleck status to agree", || {
        let (code, body) = fetch(addr, hyper::Method::GET, "/api/status", None, HTTP).ok()?;
        assert_eq!(code, 200);
        let api: serde_json::Value = serde_json::from_str(&body).expect("JSON");
        let o = Command::new(OOBLECK)
            .args(["status", "--json", "--run"])
            .arg(run)
            .env_remove("OOBLECK_TOKEN")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .output()
            .expect("oobleck status");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let cli: serde_json::Value = serde_json::from_slice(&o.stdout).expect("status JSON");
        // A step may commit between the two answers; membership and plan do not change then.
        (key(&api["cluster"]) == key(&cli)).then_some(())
    });
}

/// Requests without credentials: an action gets 401; an unknown path 404.
fn refusals(addr: std::net::SocketAddr) {
    let (code, _) = fetch(addr, hyper::Method::POST, "/api/nodes/0/kill", None, HTTP).unwrap();
    assert_eq!(code, 401, "a kill without the token");
    let (code, _) = fetch(addr, hyper::Method::GET, "/no/such/page", None, HTTP).unwrap();
    assert_eq!(code, 404);
}

/// The 4-node job: node 0 sleeps 150 ms per microbatch, so the 30 steps before node 3's
/// injected failure take seconds and the page is open well before it; node 2 is killed from
/// the page after that; f = 1 covers each in place. Its stderr goes to `log`.
fn start_job(run: &Path, log: &Path) -> Guard {
    let flags = [
        "--nodes",
        "4",
        "--fault-threshold",
        "1",
        "--inject-failure",
        "3@30",
    ];
    let mut cmd = train_cmd(run, 60, &flags);
    cmd.env("OOBLECK_TEST_SLOW", "0:150")
        .stderr(std::fs::File::create(log).expect("log file"));
    Guard(Some(cmd.spawn().expect("start train")))
}

/// Generation 0: four nodes, the pipelines, no console error; the endpoints agree.
fn before_the_failure(page: &Page, addr: std::net::SocketAddr, run: &Path) {
    page.wait_for(
        "location.pathname === '/' && document.querySelectorAll('#nodes tr[data-node]').length === 4",
        WAIT,
        "the page to show 4 nodes",
    )
    .expect("4 nodes");
    page.wait_for(
        "document.querySelectorAll('#plan [data-pipeline]').length >= 2",
        WAIT,
        "the plan's pipelines",
    )
    .expect("pipelines");
    let (_, pipelines, generation) = shown(page);
    assert_eq!(
        generation, "0",
        "the page opened before the failure at step 30"
    );
    assert!(pipelines >= 2, "f = 1 needs two pipelines: {pipelines}");
    assert_no_console_errors(page, "on load");
    metrics_agree_with_the_file(addr, run);
    api_agrees_with_oobleck_status(addr, run);
    refusals(addr);
    page.screenshot(&out_dir().join("page-generation-0.png"))
        .expect("screenshot");
}

/// After the injected failure: generation 1 on three nodes, the failure in the log, the
/// charts drawn.
fn after_the_failure(page: &Page) {
    page.wait_for(
        "document.querySelector('#generation').textContent.trim() === '1' && \
         document.querySelectorAll('#nodes tr[data-node]').length === 3 && \
         document.querySelector('#events li[data-kind=\"failure\"]') !== null && \
         document.querySelector('#events li[data-kind=\"reconfig\"]') !== null",
        WAIT,
        "generation 1 on 3 nodes with the failure and the reconfiguration in the log",
    )
    .expect("the new plan");
    assert!(page
        .eval("document.querySelector('#nodes tr[data-node=\"3\"]')")
        .unwrap()
        .is_null());
    page.wait_for(
        "[...document.querySelectorAll('#chart-loss, #chart-throughput, #chart-step-time')]
           .filter(i => i.complete && i.naturalWidth > 0).length === 3",
        WAIT,
        "the three charts to load",
    )
    .expect("charts");
    assert_no_console_errors(page, "after the failure");
    page.screenshot(&out_dir().join("page-after-failure.png"))
        .expect("screenshot");
}

/// Kill node 2 from the page: it asks first (accepted), then the job recovers without it.
fn kill_from_the_page(page: &Page) {
    let button = "button[data-action=\"kill\"][data-node=\"2\"]";
    page.wait_for(
        &format!("document.querySelector('{button}') !== null"),
        WAIT,
        "node 2's kill button",
    )
    .expect("kill button");
    page.click(button).expect("click kill");
    page.wait_for(
        "document.querySelector('#generation').textContent.trim() === '2' && \
         document.querySelectorAll('#nodes tr[data-node]').length === 2",
        WAIT,
        "generation 2 on 2 nodes after the kill",
    )
    .expect("the kill took");
    let dialogs = page.dialogs();
    assert!(
        dialogs.iter().any(|d| d.contains("Kill node 2")),
        "asked first: {dialogs:?}"
    );
    assert!(
        page.eval("document.querySelector('#events li[data-kind=\"kill_requested\"]') !== null")
            .unwrap()
            .as_bool()
            .unwrap_or(false),
        "the kill is in the event log"
    );
    assert_no_console_errors(page, "after the kill");
    page.screenshot(&out_dir().join("page-after-kill.png"))
        .expect("screenshot");
}

/// The finished run's report, in the same browser: its charts, no console error.
fn the_report(browser: &Browser, run: &Path) {
    let report = browser.new_page().expect("a tab for the report");
    report
        .navigate(&format!("file://{}", run.join("report.html").display()))
        .expect("open the report");
    let charts = report
        .eval("document.querySelectorAll('svg').length")
        .unwrap();
    assert!(
        charts.as_u64().unwrap_or(0) >= 5,
        "loss, throughput, timeline, stages, recoveries: {charts}"
    );
    assert_no_console_errors(&report, "in the report");
    report
        .screenshot(&out_dir().join("report.png"))
        .expect("screenshot");
}

#[test]
fn the_status_page_follows_a_job_through_a_failure_and_a_kill() {
    let Some(browser) = Browser::launch().expect("start the browser") else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let run = dir.path().join("run");
    let log = dir.path().join("train.stderr");
    let mut train = start_job(&run, &log);
    let link = login_link(&log);
    let addr = page_addr(&link).expect("the page's address");
    let page = browser.new_page().expect("a tab");
    // The one-time link logs this browser in (a session cookie) and lands on the page.
    page.navigate(&link).expect("open the page");
    before_the_failure(&page, addr, &run);
    after_the_failure(&page);
    kill_from_the_page(&page);
    let o = train.finish(Duration::from_secs(240));
    let stderr = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(o.status.success(), "{stderr}");
    assert_all_gone(&run, 8);
    the_report(&browser, &run);
}
