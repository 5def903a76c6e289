//! A full file system under `--out`: periodic checkpoints that do not fit are reported (an
//! event with the numbers, a warning) while training goes on; the final save is tried again
//! from memory until space is freed, or until `--save-wait` runs out, and then the job says
//! which steps are lost. Nothing the saves staged is left behind. The file system is a small
//! tmpfs the test mounts (as root, as CI runs) and unmounts.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::{events, train_cmd, wait_for_events, Guard};

/// A tmpfs of a few MB at a fresh directory, unmounted on drop.
struct Tmpfs {
    dir: tempfile::TempDir,
}

impl Tmpfs {
    /// `None` (with the reason printed) where this process may not mount one.
    fn mount(mb: u64) -> Option<Tmpfs> {
        let dir = tempfile::tempdir().expect("tempdir");
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={mb}m"), "tmpfs"])
            .arg(dir.path())
            .output();
        match out {
            Ok(o) if o.status.success() => Some(Tmpfs { dir }),
            Ok(o) => {
                let why = String::from_utf8_lossy(&o.stderr);
                eprintln!("SKIPPED: cannot mount a tmpfs here (not root?): {why}");
                None
            }
            Err(e) => {
                eprintln!("SKIPPED: no mount command: {e}");
                None
            }
        }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Fills the file system until `left` bytes are free; returns the filler.
    fn fill_leaving(&self, left: u64) -> PathBuf {
        let free = free_bytes(self.path());
        let filler = self.path().join("filler");
        let f = std::fs::File::create(&filler).expect("filler");
        // tmpfs allocates on write, not on set_len: write the bytes.
        let mut w = std::io::BufWriter::new(f);
        let chunk = vec![1u8; 1 << 20];
        let mut written = 0u64;
        while written + chunk.len() as u64 + left <= free {
            std::io::Write::write_all(&mut w, &chunk).expect("filling the tmpfs");
            written += chunk.len() as u64;
        }
        std::io::Write::flush(&mut w).expect("filling the tmpfs");
        filler
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount")
            .arg("-l")
            .arg(self.dir.path())
            .status();
    }
}

fn free_bytes(path: &Path) -> u64 {
    let out = Command::new("df")
        .args(["--output=avail", "-B1"])
        .arg(path)
        .output()
        .expect("df");
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .nth(1)
        .and_then(|l| l.trim().parse().ok())
        .expect("df's answer")
}

/// Files a save staged and should have removed: uploads, states, temporary checkpoints.
fn leftovers(root: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let p = e.path();
            let name = e.file_name().to_string_lossy().to_string();
            if name.ends_with(".partial") || name.starts_with(".tmp-") || name == "cluster" {
                out.push(p.clone());
            }
            if p.is_dir() {
                stack.push(p);
            }
        }
    }
    out
}

/// 2 nodes of gpt-tiny (a state of about 40 MB), a checkpoint every 4 steps.
fn job(out: &Path, save_wait: &str) -> Command {
    train_cmd(
        out,
        12,
        &[
            "--nodes",
            "2",
            "--checkpoint-every",
            "4",
            "--eval-every",
            "0",
            "--save-wait",
            save_wait,
        ],
    )
}

fn failed_saves(run: &Path) -> Vec<(u64, bool)> {
    events(run)
        .iter()
        .filter(|e| e["event"] == "checkpoint_failed")
        .map(|e| {
            (
                e["step"].as_u64().unwrap(),
                e["retrying"].as_bool().unwrap(),
            )
        })
        .collect()
}

#[test]
fn a_full_disk_skips_periodic_checkpoints_and_freed_space_lets_the_final_save_succeed() {
    let Some(fs) = Tmpfs::mount(100) else { return };
    let filler = fs.fill_leaving(20 << 20);
    let out = fs.path().join("run");
    let mut g = Guard(Some(job(&out, "120").spawn().expect("start train")));
    wait_for_events(
        &out,
        1,
        Duration::from_secs(120),
        "a failed final save",
        |e| e["event"] == "checkpoint_failed" && e["step"] == 12 && e["retrying"] == true,
    );
    std::fs::remove_file(&filler).expect("freeing space");
    let o = g.finish(Duration::from_secs(120));
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    assert!(
        stderr.contains("writing a checkpoint takes about"),
        "{stderr}"
    );
    assert!(
        stderr.contains("the checkpoint of step 4 was not saved")
            && stderr.contains("training goes on"),
        "{stderr}"
    );
    let failed = failed_saves(&out);
    assert!(
        failed.starts_with(&[(4, false), (8, false), (12, true)]),
        "{failed:?}"
    );
    let e = events(&out);
    let first = e
        .iter()
        .find(|e| e["event"] == "checkpoint_failed")
        .unwrap();
    assert!(first["free_bytes"].as_u64().unwrap() < first["needed_bytes"].as_u64().unwrap());
    assert!(
        first["filesystem"].as_str().unwrap().contains("tmpfs"),
        "{first}"
    );
    assert!(
        !e.iter()
            .any(|e| e["event"] == "failure" || e["event"] == "reconfig"),
        "a failed save is no worker failure"
    );
    assert_eq!(common::losses(&out).len(), 12, "every step trained");
    assert!(out.join("checkpoints/step-000012/trainer.json").is_file());
    assert!(!out.join("checkpoints/step-000004").exists());
    assert_eq!(leftovers(fs.path()), Vec::<PathBuf>::new());
    common::assert_no_segments(&out);
}

#[test]
fn a_final_save_that_never_fits_ends_the_job_saying_which_steps_are_lost() {
    let Some(fs) = Tmpfs::mount(100) else { return };
    fs.fill_leaving(20 << 20);
    let out = fs.path().join("run");
    let o = common::run(job(&out, "3"), Duration::from_secs(180));
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("the state after the final step 12 could not be saved")
            && stderr.contains("every trained step is lost")
            && stderr.contains("--save-wait"),
        "{stderr}"
    );
    let failed = failed_saves(&out);
    assert_eq!(failed.last(), Some(&(12, false)), "{failed:?}");
    assert!(
        failed.contains(&(12, true)),
        "tried again first: {failed:?}"
    );
    assert!(
        !events(&out).iter().any(|e| e["event"] == "reconfig"),
        "no recovery"
    );
    assert_eq!(leftovers(fs.path()), Vec::<PathBuf>::new());
}

#[test]
fn the_single_process_trainer_skips_and_retries_its_saves_the_same_way() {
    let Some(fs) = Tmpfs::mount(100) else { return };
    let filler = fs.fill_leaving(20 << 20);
    let out = fs.path().join("run");
    let cmd = train_cmd(
        &out,
        6,
        &[
            "--nodes",
            "1",
            "--checkpoint-every",
            "2",
            "--save-wait",
            "120",
        ],
    );
    let mut g = Guard(Some({ cmd }.spawn().expect("start train")));
    wait_for_events(
        &out,
        1,
        Duration::from_secs(120),
        "a failed final save",
        |e| e["event"] == "checkpoint_failed" && e["step"] == 6 && e["retrying"] == true,
    );
    std::fs::remove_file(&filler).expect("freeing space");
    let o = g.finish(Duration::from_secs(120));
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    let failed = failed_saves(&out);
    assert!(
        failed.starts_with(&[(2, false), (4, false), (6, true)]),
        "{failed:?}"
    );
    assert_eq!(common::losses(&out).len(), 6, "every step trained");
    assert!(out.join("checkpoints/step-000006/trainer.json").is_file());
    assert_eq!(leftovers(fs.path()), Vec::<PathBuf>::new());
}
