//! The headless-browser driver of `tests/common/cdp.rs` against a static page: console errors
//! and exceptions are seen, a click's `confirm()` is accepted and recorded, predicates are
//! waited for (and time out with their name), screenshots are PNGs, and no browser process
//! outlives the `Browser`.
//!
//! Without chromium these tests say so on stderr and pass, unless `OOBLECK_REQUIRE_BROWSER=1`.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Result;
use common::cdp::{processes_of, Browser};
use serde_json::json;

/// A button that asks a confirmation and writes the answer; one console error at load, one
/// uncaught exception from a timer, and a flag that turns true 300 ms after load.
const PAGE: &str = r#"<!doctype html>
<html><head><title>driver test</title></head>
<body style="background:#fff">
<h1>Node 3</h1>
<button id="kill" onclick="document.getElementById('answer').textContent = String(confirm('Kill node 3?'))">Kill</button>
<p id="answer">unanswered</p>
<div style="height:1500px;background:linear-gradient(#fff,#36c)">tall, to need a full-page shot</div>
<script>
  console.error('boom');
  setTimeout(() => { throw new Error('late failure'); }, 10);
  window.ready = false;
  setTimeout(() => { window.ready = true; }, 300);
</script>
</body></html>
"#;

/// Processes whose command line names `profile` (the browser's `--user-data-dir`).
fn processes_using(profile: &Path) -> Vec<u32> {
    let needle = profile.to_string_lossy().into_owned();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().into_string().ok()?.parse::<u32>().ok())
        .filter(|pid| {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            String::from_utf8_lossy(&cmd).contains(&needle) && common::alive(*pid)
        })
        .collect()
}

#[test]
fn drives_a_page_through_errors_a_confirmed_click_a_wait_and_a_screenshot() -> Result<()> {
    let Some(browser) = Browser::launch()? else {
        return Ok(());
    };
    let (pid, profile) = (browser.pid(), browser.profile_dir().to_path_buf());
    let dir = tempfile::tempdir()?;
    let html = dir.path().join("page.html");
    std::fs::write(&html, PAGE)?;

    let page = browser.new_page()?;
    page.navigate(&format!("file://{}", html.display()))?;
    page.wait_for(
        "document.title === 'driver test'",
        Duration::from_secs(5),
        "the page's title",
    )?;

    // The timer's exception lands after load; wait for it rather than sleep.
    let deadline = Instant::now() + Duration::from_secs(5);
    while page.console_errors().len() < 2 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let errors = page.console_errors();
    assert!(
        errors
            .iter()
            .any(|e| e.contains("boom") && e.contains("page.html:")),
        "console.error missing: {errors:?}"
    );
    assert!(
        errors
            .iter()
            .any(|e| e.contains("late failure") && e.contains("page.html:")),
        "uncaught exception missing: {errors:?}"
    );

    assert!(page.dialogs().is_empty());
    page.click("#kill")?;
    assert_eq!(page.dialogs(), ["Kill node 3?"]);
    assert_eq!(
        page.eval("document.getElementById('answer').textContent")?,
        json!("true")
    );

    assert_eq!(
        page.eval("[1 + 2, 'x'.repeat(3), {a: null}]")?,
        json!([3, "xxx", {"a": null}])
    );
    assert_eq!(page.eval("Promise.resolve(42)")?, json!(42));
    let thrown = page
        .eval("(() => { throw new Error('nope'); })()")
        .unwrap_err();
    assert!(format!("{thrown:#}").contains("nope"), "{thrown:#}");
    assert!(page.click("#missing").is_err());

    page.wait_for("window.ready", Duration::from_secs(5), "the 300 ms flag")?;

    let shot = dir.path().join("page.png");
    page.screenshot(&shot)?;
    let png = std::fs::read(&shot)?;
    assert!(
        png.starts_with(b"\x89PNG\r\n\x1a\n"),
        "not a PNG: {:?}",
        &png[..png.len().min(8)]
    );
    // Full page: the IHDR height (bytes 20..24) covers the 1500 px block, beyond the 800 px window.
    let height = u32::from_be_bytes(png[20..24].try_into()?);
    assert!(
        height > 1500,
        "screenshot is {height} px tall, not the full page"
    );
    if let Some(keep) = std::env::var_os("OOBLECK_KEEP_SCREENSHOT") {
        std::fs::copy(&shot, keep)?;
    }

    // Two views of the browser's processes: command lines naming its profile (the browser,
    // zygotes, renderers, utilities), and the driver's own (its process group, plus crashpad
    // handlers, which leave the group).
    let (named, family) = (processes_using(&profile), browser.processes());
    assert!(
        named.contains(&pid),
        "the browser {pid} is not among {named:?}"
    );
    assert!(
        named.iter().all(|p| family.contains(p)),
        "{named:?} not all in {family:?}"
    );
    drop(page);
    drop(browser);
    let left: Vec<u32> = family.into_iter().filter(|&p| common::alive(p)).collect();
    assert_eq!(
        left,
        Vec::<u32>::new(),
        "browser processes outlived the Browser"
    );
    assert_eq!(
        processes_using(&profile),
        Vec::<u32>::new(),
        "processes of {profile:?} left"
    );
    let of = processes_of(pid, &profile);
    assert_eq!(
        of,
        Vec::<u32>::new(),
        "processes of group {pid} or tagged left"
    );
    Ok(())
}

#[test]
fn a_never_true_wait_fails_within_its_timeout_naming_what_it_waited_for() -> Result<()> {
    let Some(browser) = Browser::launch()? else {
        return Ok(());
    };
    let page = browser.new_page()?;
    let start = Instant::now();
    let err = page
        .wait_for("1 === 2", Duration::from_millis(400), "the impossible flag")
        .unwrap_err();
    let took = start.elapsed();
    let msg = format!("{err:#}");
    assert!(
        msg.contains("the impossible flag") && msg.contains("1 === 2"),
        "{msg}"
    );
    assert!(
        took >= Duration::from_millis(400),
        "gave up early, after {took:?}"
    );
    // Generous: one poll interval past the timeout, plus a slow machine's evaluate.
    assert!(
        took < Duration::from_secs(3),
        "overran its 400 ms timeout: {took:?}"
    );
    Ok(())
}

#[test]
fn a_test_that_panics_leaves_no_browser_behind() {
    let (tx, rx) = std::sync::mpsc::channel();
    let outcome = std::thread::spawn(move || {
        let Some(browser) = Browser::launch().expect("launching the browser") else {
            return;
        };
        let _page = browser.new_page().expect("a page");
        tx.send((browser.pid(), browser.profile_dir().to_path_buf()))
            .expect("the test thread waits");
        panic!("on purpose, with the browser running (this message is expected)");
    })
    .join();
    let Ok((pid, profile)) = rx.try_recv() else {
        return; // no browser: launch said so on stderr
    };
    assert!(outcome.is_err(), "the thread was meant to panic");
    assert!(!common::alive(pid), "browser {pid} outlived a panic");
    assert_eq!(
        processes_of(pid, &profile),
        Vec::<u32>::new(),
        "processes left after a panic"
    );
}
