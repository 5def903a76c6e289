//! Tests of `plot.rs`: what the SVG and PNG files hold, bounded size for long traces, the
//! downsampling and mark coalescing, and the errors bad input gets.

use super::*;
use oobleck_core::simulate::TimeFractions;

const HOUR: u64 = 3_600_000;

fn outcome(policy: &str, timeline: Vec<(u64, f64)>, marks: Vec<(u64, Change)>) -> Outcome {
    let end_ms = timeline.last().map_or(0, |p| p.0 + HOUR);
    Outcome {
        policy: policy.to_string(),
        average_samples_per_s: timeline.iter().map(|p| p.1).sum::<f64>()
            / timeline.len().max(1) as f64,
        time_fractions: TimeFractions::default(),
        start_ms: 0,
        end_ms,
        samples: 0.0,
        steps: 0,
        failures: 0,
        reconfigurations: 0,
        restarts: 0,
        timeline: timeline
            .into_iter()
            .map(|(t_ms, samples_per_s)| TimePoint {
                t_ms,
                samples_per_s,
            })
            .collect(),
        marks: marks
            .into_iter()
            .enumerate()
            .map(|(i, (t_ms, change))| Mark {
                t_ms,
                change,
                node: format!("node{}", i % 30),
            })
            .collect(),
        notes: Vec::new(),
    }
}

fn three_policies() -> Vec<Outcome> {
    let marks = vec![
        (2 * HOUR, Change::Remove),
        (5 * HOUR, Change::Remove),
        (7 * HOUR, Change::Add),
    ];
    vec![
        outcome(
            "oobleck",
            vec![
                (0, 900.0),
                (2 * HOUR, 850.0),
                (5 * HOUR, 800.0),
                (7 * HOUR, 860.0),
            ],
            marks.clone(),
        ),
        outcome(
            "checkpoint-restart",
            vec![
                (0, 950.0),
                (2 * HOUR, 0.0),
                (3 * HOUR, 950.0),
                (5 * HOUR, 0.0),
            ],
            marks.clone(),
        ),
        outcome("bamboo", vec![(0, 500.0), (5 * HOUR, 420.0)], marks),
    ]
}

/// Polylines drawn in a colour at the series' width: the series of that colour.
fn series_of(svg: &str, color: RGBColor) -> usize {
    let key = format!(
        "stroke=\"#{:02X}{:02X}{:02X}\" stroke-width=\"{SERIES_WIDTH}\"",
        color.0, color.1, color.2
    );
    svg.split("<polyline")
        .skip(1)
        .filter(|p| p.contains(&key))
        .count()
}

fn draw_to(outcomes: &[Outcome], name: &str) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join(name);
    draw(outcomes, "Throughput under failures", &path).expect("draws");
    (dir, path)
}

#[test]
fn svg_names_every_policy_and_draws_one_line_each() {
    let outcomes = three_policies();
    let (_dir, path) = draw_to(&outcomes, "chart.svg");
    let svg = std::fs::read_to_string(&path).unwrap();
    for o in &outcomes {
        assert!(svg.contains(&o.policy), "legend names {}", o.policy);
    }
    for color in &PALETTE[..3] {
        assert_eq!(series_of(&svg, *color), 1);
    }
    assert_eq!(series_of(&svg, PALETTE[3]), 0);
    assert!(svg.contains("Throughput (samples/s)"));
    assert!(svg.contains("Time since trace start (hours)"));
    assert!(svg.contains("2 node failures") && svg.contains("1 node join"));
    assert!(svg.contains("font-family=\"sans-serif\""));
}

#[test]
fn png_is_a_valid_png_of_the_chart_size() {
    let (_dir, path) = draw_to(&three_policies(), "chart.PNG");
    let png = std::fs::read(&path).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    assert_eq!(&png[12..16], b"IHDR");
    let be = |b: &[u8]| u32::from_be_bytes(b.try_into().unwrap());
    assert_eq!((be(&png[16..20]), be(&png[20..24])), (WIDTH, HEIGHT));
}

#[test]
fn a_hundred_thousand_points_and_five_thousand_marks_stay_small() {
    let timeline = |phase: u64| -> Vec<(u64, f64)> {
        (0..100_000u64)
            .map(|i| (i * 60_000, 1000.0 + ((i * 7919 + phase) % 400) as f64))
            .collect()
    };
    let marks: Vec<(u64, Change)> = (0..5_000u64)
        .map(|i| {
            let change = if i % 2 == 0 {
                Change::Remove
            } else {
                Change::Add
            };
            (i * 1_190_000, change)
        })
        .collect();
    let outcomes = vec![
        outcome("oobleck", timeline(0), marks.clone()),
        outcome("varuna", timeline(13), marks),
    ];
    let (_dir, path) = draw_to(&outcomes, "big.svg");
    let size = std::fs::metadata(&path).unwrap().len();
    assert!(size < 2_000_000, "SVG of {size} bytes");
    let svg = std::fs::read_to_string(&path).unwrap();
    assert_eq!(series_of(&svg, PALETTE[0]) + series_of(&svg, PALETTE[1]), 2);
    assert!(svg.contains("2,500 node failures") && svg.contains("2,500 node joins"));
}

#[test]
fn downsampling_keeps_every_column_s_extremes_within_four_vertices_per_column() {
    let mut timeline: Vec<TimePoint> = (0..10_000u64)
        .map(|i| TimePoint {
            t_ms: i * 1000,
            samples_per_s: 100.0,
        })
        .collect();
    timeline[4_321].samples_per_s = 3.0;
    timeline[7_000].samples_per_s = 250.0;
    let x_max = 10_000_000.0 / MS_PER_HOUR;
    let v = step_vertices(&timeline, x_max, x_max, 500);
    assert!(v.len() <= 4 * 501 + 1, "{} vertices", v.len());
    assert!(v.iter().any(|p| p.1 == 3.0) && v.iter().any(|p| p.1 == 250.0));
    assert!(v.windows(2).all(|w| w[0].0 <= w[1].0), "time order");
}

#[test]
fn short_timelines_are_drawn_exactly_as_steps_until_the_end() {
    let timeline =
        [(0, 10.0), (HOUR, 0.0), (3 * HOUR, 5.0)].map(|(t_ms, samples_per_s)| TimePoint {
            t_ms,
            samples_per_s,
        });
    let v = step_vertices(&timeline, 4.0, 4.0, 1000);
    let want = [
        (0.0, 10.0),
        (1.0, 10.0),
        (1.0, 0.0),
        (3.0, 0.0),
        (3.0, 5.0),
        (4.0, 5.0),
    ];
    assert_eq!(v, want);
}

#[test]
fn marks_shared_by_outcomes_count_once() {
    let outcomes = three_policies();
    let marks = coalesce_marks(&outcomes);
    assert_eq!(marks.removals, vec![2 * HOUR, 5 * HOUR]);
    assert_eq!(marks.joins, vec![7 * HOUR]);
    let cols = per_column(&[0, 1, 2 * HOUR, 100 * HOUR], 4.0, 400);
    assert_eq!(
        cols.into_iter().collect::<Vec<_>>(),
        [(0, 2), (200, 1), (399, 1)]
    );
}

#[test]
fn other_extensions_are_refused_naming_svg_and_png() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["chart.pdf", "chart"] {
        let path = dir.path().join(name);
        let e = draw(&three_policies(), "t", &path).unwrap_err().to_string();
        assert!(e.contains(".svg") && e.contains(".png"), "{e}");
        assert!(!path.exists());
    }
}

#[test]
fn no_outcomes_is_an_error_and_empty_timelines_give_an_empty_chart() {
    let dir = tempfile::tempdir().unwrap();
    let e = draw(&[], "t", &dir.path().join("a.svg")).unwrap_err();
    assert!(e.to_string().contains("no policy outcomes"), "{e}");
    let (_dir, path) = draw_to(&[outcome("idle", Vec::new(), Vec::new())], "e.svg");
    let svg = std::fs::read_to_string(path).unwrap();
    assert!(svg.contains("idle (no data)"));
    assert_eq!(series_of(&svg, PALETTE[0]), 0);
}

#[test]
fn broken_timelines_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("a.svg");
    let nan = outcome("p", vec![(0, f64::NAN)], Vec::new());
    let e = draw(&[nan], "t", &path).unwrap_err().to_string();
    assert!(e.contains("policy p") && e.contains("NaN"), "{e}");
    let backwards = outcome("q", vec![(HOUR, 1.0), (0, 1.0)], Vec::new());
    let e = draw(&[backwards], "t", &path).unwrap_err().to_string();
    assert!(e.contains("policy q") && e.contains("comes before"), "{e}");
}

#[test]
fn numbers_read_like_a_table() {
    assert_eq!(thousands(1_234_567.8), "1,234,568");
    assert_eq!(thousands(999.4), "999");
    assert_eq!(thousands(12.5), "12.5");
    assert_eq!(thousands(0.0), "0");
    assert_eq!(hours_label(1.25), "1.25");
    assert_eq!(hours_label(1680.0), "1,680");
}
