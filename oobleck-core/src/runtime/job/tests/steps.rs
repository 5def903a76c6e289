//! The commit protocol: forming, the rendezvous, steps, periodic states, the end.

use super::*;

#[test]
fn plans_once_every_expected_node_joined() {
    let mut h = H::new(spec(3, 1, 4));
    assert!(!has(&h.at(0.0, joined(0)), "plan"));
    assert!(!has(&h.at(0.0, joined(1)), "plan"));
    let a = h.at(0.0, joined(2));
    assert_eq!(plan_request(&a), (vec![0, 1, 2], 1));
    let a = h.at(0.1, Input::Planned(Ok(plan(&[&[0], &[1, 2]]))));
    assert_eq!(kinds(&a), ["record:plan", "deploy"]);
}

#[test]
fn forming_gives_up_after_the_join_timeout() {
    let mut h = H::new(spec(3, 1, 4));
    h.at(0.0, joined(0));
    let a = h.at(61.0, Input::Tick);
    assert!(failure(&a).contains("only 1 of 3 agents registered"));
}

#[test]
fn the_rendezvous_goes_out_once_every_rank_listens() {
    let mut h = H::new(spec(2, 1, 4));
    h.at(0.0, joined(0));
    h.at(0.0, joined(1));
    h.at(0.1, Input::Planned(Ok(plan(&[&[0], &[1]]))));
    let a = h.worker(
        0.2,
        0,
        WorkerReport::Listening {
            rank: 0,
            addr: "127.0.0.1:9000".into(),
            pid: 1,
        },
    );
    assert!(!has(&a, "rendezvous"));
    let a = h.worker(
        0.2,
        1,
        WorkerReport::Listening {
            rank: 1,
            addr: "127.0.0.1:9001".into(),
            pid: 2,
        },
    );
    assert_eq!(
        kinds(&a),
        ["record:process", "record:rendezvous", "rendezvous"]
    );
}

#[test]
fn a_step_commits_once_every_rank_is_ready_and_not_before() {
    let mut h = H::running(spec(2, 1, 4), plan(&[&[0], &[1]]));
    assert!(h.ready(1.0, 0, 1).is_empty());
    let a = h.ready(1.0, 1, 1);
    assert_eq!(kinds(&a), ["commit:1"]);
    assert_eq!(h.m.committed(), 1);
}

#[test]
fn ranks_that_disagree_on_the_loss_end_the_job() {
    let mut h = H::running(spec(2, 1, 4), plan(&[&[0], &[1]]));
    h.ready(1.0, 0, 1);
    let a = h.worker(
        1.0,
        1,
        WorkerReport::Ready {
            rank: 1,
            step: 1,
            loss: 9.0,
            grad_norm: 0.5,
            microbatches: vec![2, 3],
            samples: None,
            times: None,
        },
    );
    assert!(failure(&a).contains("ranks disagree on step 1"));
}

#[test]
fn a_step_that_did_not_train_each_microbatch_once_ends_the_job() {
    let mut h = H::running(spec(2, 1, 4), plan(&[&[0], &[1]]));
    h.ready(1.0, 0, 1);
    // Pipeline 1 read microbatch 1 again instead of 3: a sample of the step twice, one never.
    let a = h.worker(
        1.0,
        1,
        WorkerReport::Ready {
            rank: 1,
            step: 1,
            loss: 2.5,
            grad_norm: 0.5,
            microbatches: vec![1, 2],
            samples: None,
            times: None,
        },
    );
    let e = failure(&a);
    assert!(
        e.contains("trained microbatches [0, 1, 1, 2], not each of 0..4 once"),
        "{e}"
    );
}

/// The step's sample hash is the wrapping sum of what the ranks that read microbatches said
/// (each pipeline's first rank); ranks that read none say none and add nothing.
#[test]
fn the_commit_carries_the_sum_of_the_ranks_sample_hashes() {
    let mut h = H::running(spec(3, 1, 4), plan(&[&[0], &[1, 2]]));
    let (a, b) = (SampleHash(u64::MAX - 1), SampleHash(5));
    let commit = |h: &mut H, step, hashes: [Option<SampleHash>; 3]| {
        let mut last = Vec::new();
        for (rank, samples) in hashes.into_iter().enumerate() {
            let rank = rank as u32;
            let report = WorkerReport::Ready {
                rank,
                step,
                loss: 2.5,
                grad_norm: 0.5,
                microbatches: h.first_microbatch(rank),
                samples: samples.map(|s| s.0),
                times: None,
            };
            let node = h.node_of(rank);
            last = h.worker(1.0, node, report);
        }
        last.iter()
            .find_map(|a| match a {
                Action::Commit { samples, .. } => Some(*samples),
                _ => None,
            })
            .expect("a commit")
    };
    let first_ranks: Vec<u32> = (0..3)
        .filter(|&r| !h.first_microbatch(r).is_empty())
        .collect();
    assert_eq!(first_ranks, [0, 1], "the pipelines' first ranks read");
    let got = commit(&mut h, 1, [Some(a), Some(b), None]);
    assert_eq!(got, Some(SampleHash(3)), "wrapping: (2^64 - 2) + 5");
    assert_eq!(got, Some(a + b));
    // The next step starts from nothing: no rank said a hash, none is written.
    assert_eq!(commit(&mut h, 2, [None, None, None]), None);
    assert_eq!(commit(&mut h, 3, [None, Some(b), None]), Some(b));
}

#[test]
fn a_report_for_the_wrong_step_ends_the_job() {
    let mut h = H::running(spec(2, 1, 4), plan(&[&[0], &[1]]));
    let a = h.ready(1.0, 0, 2);
    assert!(failure(&a).contains("reported step 2 ready while step 1 is open"));
}

#[test]
fn the_job_finishes_with_pipeline_zeros_states_once_every_worker_is_done() {
    let mut h = H::running(spec(3, 1, 2), plan(&[&[0], &[1, 2]]));
    h.step(1.0, 1);
    h.step(2.0, 2);
    let mut last = Vec::new();
    for rank in 0..3 {
        let state = (rank == 0).then(|| "rank-0.safetensors".to_string());
        last = h.worker(
            3.0,
            h.node_of(rank),
            WorkerReport::Done {
                rank,
                step: 2,
                state,
                commit_wait_ms: 1.0,
            },
        );
    }
    let Some(Action::Finish { step, states, .. }) = last.first() else {
        panic!("{:?}", kinds(&last));
    };
    assert_eq!(*step, 2);
    assert_eq!(states.keys().copied().collect::<Vec<_>>(), [0]);
    assert!(h.m.is_over());
}

#[test]
fn periodic_states_are_assembled_and_checkpoints_remembered() {
    let mut s = spec(2, 1, 4);
    s.checkpoint_every = 2;
    let mut h = H::running(s, plan(&[&[0], &[1]]));
    h.step(1.0, 1);
    h.step(2.0, 2);
    let a = h.saved(2.1, 0, 2);
    assert_eq!(kinds(&a), ["assemble:2"]);
    let a = h.at(
        2.5,
        Input::Assembled {
            step: 2,
            checkpoint: Some("ckpt-2".into()),
            val_loss: None,
            duration_s: 0.1,
        },
    );
    assert_eq!(kinds(&a), ["record:checkpoint"]);
    assert_eq!(h.m.steps.newest(), Some(("ckpt-2".into(), 2)));
}

fn save_failed(step: u64, retrying: bool) -> WorkerReport {
    WorkerReport::SaveFailed {
        rank: 0,
        step,
        bytes: 40,
        error: "No space left on device".into(),
        retrying,
    }
}

#[test]
fn a_periodic_save_that_fails_is_skipped_and_training_goes_on() {
    let mut s = spec(2, 1, 6);
    s.checkpoint_every = 2;
    let mut h = H::running(s, plan(&[&[0], &[1]]));
    h.steps_to(2);
    let a = h.worker(2.1, 0, save_failed(2, false));
    assert_eq!(kinds(&a), ["save_failed:2"]);
    // The checkpoint itself failing (the master's disk) is skipped the same way.
    h.step(3.0, 3);
    h.step(4.0, 4);
    assert_eq!(kinds(&h.saved(4.1, 0, 4)), ["assemble:4"]);
    let a = h.at(
        4.2,
        Input::AssemblyFailed {
            step: 4,
            error: "checkpoints/step-000004/model.safetensors: No space left on device".into(),
        },
    );
    assert_eq!(kinds(&a), ["save_failed:4"]);
    assert!(!h.m.is_over());
    assert!(has(&h.step(5.0, 5), "commit:5"), "training goes on");
    assert_eq!(h.m.steps.newest(), None, "no checkpoint was written");
}

#[test]
fn a_final_save_is_retried_and_only_a_given_up_one_ends_the_job_as_lost() {
    let mut h = H::running(spec(2, 1, 2), plan(&[&[0], &[1]]));
    h.steps_to(2);
    let a = h.worker(3.0, 0, save_failed(2, true));
    assert_eq!(kinds(&a), ["save_failed:2:retrying"]);
    // The stall limit counts from the last report: a save retried for minutes is no stall.
    assert!(h.at(150.0, Input::Tick).is_empty());
    let a = h.worker(160.0, 0, save_failed(2, false));
    assert_eq!(kinds(&a), ["save_failed:2:final"]);
    let done = |rank| WorkerReport::Done {
        rank,
        step: 2,
        state: None,
        commit_wait_ms: 1.0,
    };
    h.worker(160.1, 1, done(1));
    let a = h.worker(160.2, 0, done(0));
    let text = failure(&a);
    assert!(
        text.contains("the state after the final step 2 could not be saved")
            && text.contains("No space left on device")
            && text.contains("every trained step is lost"),
        "{text}"
    );
    assert!(!has(&a, "reconfigure:[]"), "no recovery: {:?}", kinds(&a));
}

#[test]
fn a_stop_asked_for_ends_the_run_with_the_next_step_saved_as_its_last() {
    let mut h = H::running(spec(2, 1, 100), plan(&[&[0], &[1]]));
    h.step(1.0, 1);
    let signal = || Input::StopRequested {
        signal: "SIGTERM".into(),
    };
    let a = h.at(1.5, signal());
    assert_eq!(kinds(&a), ["record:stop_requested", "note"]);
    assert!(h.at(1.6, signal()).is_empty(), "asked once");
    let a = h.step(2.0, 2);
    let last = a.iter().any(|a| {
        matches!(
            a,
            Action::Commit {
                step: 2,
                last: true,
                ..
            }
        )
    });
    assert!(last, "{:?}", kinds(&a));
    let done = |rank| WorkerReport::Done {
        rank,
        step: 2,
        state: (rank == 0).then(|| "rank-0.safetensors".to_string()),
        commit_wait_ms: 1.0,
    };
    h.worker(2.1, 1, done(1));
    assert_eq!(kinds(&h.worker(2.2, 0, done(0))), ["finish:2"]);
}

#[test]
fn refused_connections_are_recorded_and_change_nothing_else() {
    let mut h = H::running(spec(2, 1, 10), plan(&[&[0], &[1]]));
    let a = h.at(
        0.5,
        Input::Refused {
            peer: Some("10.0.0.9".into()),
            reason: "authentication failed: wrong token".into(),
            count: 40,
        },
    );
    assert_eq!(kinds(&a), ["record:refused"]);
    assert!(has(&h.step(1.0, 1), "commit:1"));
}

#[test]
fn data_plane_refusals_are_recorded_with_their_worker_in_any_phase() {
    let refused = |rank: u32| WorkerReport::Refused {
        rank,
        peer: Some("10.0.0.7".into()),
        reason: "closed before proving itself".into(),
        count: 200,
    };
    let mut h = H::running(spec(2, 1, 10), plan(&[&[0], &[1]]));
    let a = h.worker(0.5, 1, refused(1));
    assert_eq!(kinds(&a), ["record:refused"]);
    match &a[0] {
        Action::Record(Event::Refused {
            node, rank, count, ..
        }) => assert_eq!((*node, *rank, *count), (Some(1), Some(1), 200)),
        _ => panic!("expected a refused record, got {:?}", kinds(&a)),
    }
    assert!(has(&h.step(1.0, 1), "commit:1"));
    // While recovering, and from a generation that is over: recorded all the same.
    h.at(1.5, lost(1));
    let a = h.at(
        1.6,
        Input::Worker {
            node: 0,
            generation: 0,
            report: refused(0),
        },
    );
    assert!(has(&a, "record:refused"), "{:?}", kinds(&a));
}

#[test]
fn a_stop_before_the_first_plan_ends_the_job_at_once() {
    let mut h = H::new(spec(2, 1, 10));
    h.at(0.0, joined(0));
    let a = h.at(
        0.1,
        Input::StopRequested {
            signal: "SIGINT".into(),
        },
    );
    assert!(failure(&a).contains("stopped by SIGINT before the first step"));
}

#[test]
fn a_worker_failing_while_its_generation_forms_ends_the_job() {
    let mut h = H::new(spec(2, 1, 10));
    h.at(0.0, joined(0));
    h.at(0.0, joined(1));
    h.at(0.1, Input::Planned(Ok(plan(&[&[0], &[1]]))));
    let a = h.worker(
        0.5,
        1,
        WorkerReport::Exited {
            rank: 1,
            status: ExitStatus {
                code: Some(1),
                signal: None,
            },
            error: Some("cannot bind a data-plane port on 203.0.113.7".into()),
        },
    );
    let e = failure(&a);
    assert!(
        e.contains("exited (exit code 1) while the data plane formed") && e.contains("203.0.113.7"),
        "{e}"
    );
}

#[test]
fn a_worker_killed_before_its_generation_forms_is_recovered_from() {
    let mut h = H::new(spec(2, 1, 10));
    h.at(0.0, joined(0));
    h.at(0.0, joined(1));
    h.at(0.1, Input::Planned(Ok(plan(&[&[0], &[1]]))));
    let a = h.worker(
        0.5,
        1,
        WorkerReport::Exited {
            rank: 1,
            status: ExitStatus {
                code: None,
                signal: Some(9),
            },
            error: None,
        },
    );
    assert!(!has(&a, "fail"), "{:?}", kinds(&a));
    assert!(has(&a, "record:failure"), "{:?}", kinds(&a));
}

#[test]
fn no_report_for_the_stall_timeout_ends_the_job() {
    let mut h = H::running(spec(2, 1, 10), plan(&[&[0], &[1]]));
    assert!(h.at(100.0, Input::Tick).is_empty());
    let a = h.at(181.0, Input::Tick);
    assert!(failure(&a).contains("no progress for 180 s"));
}

#[test]
fn no_plan_at_the_start_ends_the_job() {
    let mut h = H::new(spec(1, 1, 10));
    h.at(0.0, joined(0));
    let a = h.at(
        0.1,
        Input::Planned(Err(RuntimeError::Plan {
            nodes: 1,
            reason: "1 node cannot hold 2 pipelines".into(),
        })),
    );
    assert!(failure(&a).contains("1 node cannot hold 2 pipelines"));
}

#[test]
fn an_injected_failure_kills_its_node_after_its_step() {
    let mut s = spec(2, 1, 10);
    s.inject_failures = vec![InjectedFailure {
        node: 1,
        after_step: 2,
    }];
    let mut h = H::running(s, plan(&[&[0], &[1]]));
    assert!(!has(&h.step(1.0, 1), "kill:1"));
    let a = h.step(2.0, 2);
    assert_eq!(
        kinds(&a),
        ["commit:2", "record:inject_failure", "note", "kill:1"]
    );
}

#[test]
fn every_stage_lead_of_pipeline_zero_keeps_state_also_two_on_one_node() {
    // Two devices per node; pipeline 0 is node 0 with two one-device stages (ranks 0 and 1),
    // pipeline 1 is node 1 with one two-device stage (ranks 2 and 3).
    let mut s = spec(2, 1, 4);
    s.devices_per_node = 2;
    s.checkpoint_every = 2;
    let p = plan_with(2, &[&[0], &[1]], &[vec![vec![0, 1]], vec![vec![0]]]);
    let mut h = H::running(s, p);
    h.steps_to(2);
    assert!(h.saved(2.1, 0, 2).is_empty());
    assert_eq!(kinds(&h.saved(2.1, 1, 2)), ["assemble:2"]);
    // Rank 2 leads pipeline 1's only stage: it keeps no state of pipeline 0.
    assert!(failure(&h.saved(2.2, 2, 2)).contains("only ranks [0, 1] keep it"));
}

#[test]
fn a_report_of_a_generation_that_does_not_exist_is_ignored_with_a_note() {
    let mut h = H::running(spec(2, 1, 4), plan(&[&[0], &[1]]));
    let a = h.at(
        1.0,
        Input::Worker {
            node: 1,
            generation: 7,
            report: WorkerReport::Ready {
                rank: 1,
                step: 1,
                loss: 2.5,
                grad_norm: 0.5,
                microbatches: vec![2, 3],
                samples: None,
                times: None,
            },
        },
    );
    assert_eq!(kinds(&a), ["note"]);
    assert!(!h.m.is_over());
    // The real generation goes on untouched.
    h.ready(1.1, 0, 1);
    assert_eq!(kinds(&h.ready(1.1, 1, 1)), ["commit:1"]);
}
