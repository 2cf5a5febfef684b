//! The task schedule of the persistent decode kernel (`cuda/persistent.cu`):
//! a decode step as a flat list of tasks that a grid of co-resident blocks
//! works through in one launch, dependencies carried by counters in device
//! memory instead of kernel boundaries.
//!
//! A step is a list of stages (one op: a mat-vec cut into row groups, a
//! norm, an attention split...), each cut into `tasks` independent tasks
//! (the blocks of the kernel the op launches as on its own). Tasks are
//! numbered stage by stage; stage `s` owns counter `s`, which each of its
//! tasks increments once when done. A task of stage `s` waits, before it
//! reads anything the step wrote, until the counter of every stage it
//! depends on holds `generation * tasks` of that stage: counters only
//! grow, so the next step (generation + 1) needs no reset (the device
//! compares with wrap-around arithmetic; one step is in flight at a time).
//!
//! Deadlock freedom rests on three invariants, checked by
//! [`Schedule::validate`] and exercised by [`simulate`]:
//! 1. every stage depends only on stages before it (so every task waits
//!    only on tasks earlier in the list);
//! 2. block `b` of a grid of `G` takes tasks `b, b + G, b + 2G, ...` in that
//!    order;
//! 3. all `G` blocks are resident at once (the executor sizes the grid with
//!    the occupancy API).
//!
//! Then the lowest unfinished task `t` always runs: its block finished every
//! earlier task it owns (they are below `t`), so it is at `t`, and every
//! task `t` waits on is below `t`, so finished.
//!
//! Dependencies come from what each stage reads and writes (byte ranges of
//! device memory): a stage waits on the latest earlier stage that writes
//! what it reads or writes, or reads what it writes (read after write,
//! write after read, write after write), minus those already implied
//! through another dependency. A stage whose accesses are not known waits
//! on every earlier stage and every later one waits on it, which is the
//! stream order of the graph path.

/// A byte range `[start, start + len)` of device memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Range {
    pub start: u64,
    pub len: u64,
}

impl Range {
    /// `len` bytes at `start`.
    pub fn new(start: u64, len: u64) -> Range {
        Range { start, len }
    }

    fn overlaps(&self, other: &Range) -> bool {
        self.len > 0
            && other.len > 0
            && self.start < other.start.saturating_add(other.len)
            && other.start < self.start.saturating_add(self.len)
    }
}

/// What a stage reads and writes of the memory the step changes (weights,
/// constant during a step, are left out).
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Access {
    /// These ranges exactly.
    Ranges {
        reads: Vec<Range>,
        writes: Vec<Range>,
    },
    /// Unknown: treated as reading and writing everything.
    Everything,
}

impl Access {
    /// Whether running `self` and `other` in either order could give
    /// different results (one writes what the other reads or writes).
    fn conflicts(&self, other: &Access) -> bool {
        match (self, other) {
            (Access::Everything, _) | (_, Access::Everything) => true,
            (
                Access::Ranges {
                    reads: r1,
                    writes: w1,
                },
                Access::Ranges {
                    reads: r2,
                    writes: w2,
                },
            ) => {
                let any =
                    |a: &[Range], b: &[Range]| a.iter().any(|x| b.iter().any(|y| x.overlaps(y)));
                any(w1, r2) || any(w1, w2) || any(r1, w2)
            }
        }
    }
}

/// One op of the step as the schedule sees it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct StageSpec {
    /// Independent tasks (blocks) it is cut into; at least 1.
    pub tasks: u32,
    pub access: Access,
}

/// A stage of a built schedule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Stage {
    pub tasks: u32,
    /// Index of its first task.
    pub first: u32,
    /// Earlier stages whose counters its tasks wait on, ascending.
    pub waits: Vec<u32>,
}

/// Why a schedule is not safe to run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum ScheduleError {
    #[error("stage {0} has no tasks")]
    Empty(usize),
    #[error("stage {stage} waits on stage {on}, which is not before it")]
    WaitsForward { stage: usize, on: u32 },
    #[error("stage {0}'s tasks are not numbered after the stage before it")]
    Numbering(usize),
    #[error("the step has {0} tasks, more than the task table holds")]
    TooManyTasks(u64),
    #[error("blocks stalled with {done} of {total} tasks done (task {task} of block {block} cannot start)")]
    Deadlock {
        done: usize,
        total: usize,
        block: usize,
        task: usize,
    },
    #[error(
        "task {task} (stage {stage}) started before stage {on} finished, which it conflicts with"
    )]
    Hazard {
        task: usize,
        stage: usize,
        on: usize,
    },
}

/// The flat task list of one step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Schedule {
    pub stages: Vec<Stage>,
    pub n_tasks: u32,
}

impl Schedule {
    /// The schedule of `specs` in their order (the order the graph path
    /// launches them), with the dependencies their accesses need.
    pub fn build(specs: &[StageSpec]) -> Result<Schedule, ScheduleError> {
        let n = specs.len();
        // deps[s]: every earlier stage s transitively depends on (a bit set).
        let words = n.div_ceil(64).max(1);
        let mut reach = vec![vec![0u64; words]; n];
        let mut stages = Vec::with_capacity(n);
        let mut first: u64 = 0;
        for (s, spec) in specs.iter().enumerate() {
            if spec.tasks == 0 {
                return Err(ScheduleError::Empty(s));
            }
            // Latest first: a conflicting stage already reached through a
            // later direct dependency needs no wait of its own.
            let mut waits = Vec::new();
            let mut covered = vec![0u64; words];
            for e in (0..s).rev() {
                if covered[e / 64] >> (e % 64) & 1 == 1 {
                    continue;
                }
                if spec.access.conflicts(&specs[e].access) {
                    waits.push(e as u32);
                    covered[e / 64] |= 1 << (e % 64);
                    for (c, r) in covered.iter_mut().zip(&reach[e]) {
                        *c |= r;
                    }
                }
            }
            waits.reverse();
            reach[s] = covered;
            let start = u32::try_from(first).map_err(|_| ScheduleError::TooManyTasks(first))?;
            stages.push(Stage {
                tasks: spec.tasks,
                first: start,
                waits,
            });
            first += spec.tasks as u64;
        }
        let n_tasks = u32::try_from(first)
            .ok()
            .filter(|&t| t < i32::MAX as u32)
            .ok_or(ScheduleError::TooManyTasks(first))?;
        let sched = Schedule { stages, n_tasks };
        sched.validate()?;
        Ok(sched)
    }

    /// Invariant 1 and the numbering: stages in task order, each waiting
    /// only on stages before it.
    pub fn validate(&self) -> Result<(), ScheduleError> {
        let mut next = 0u64;
        for (s, st) in self.stages.iter().enumerate() {
            if st.tasks == 0 {
                return Err(ScheduleError::Empty(s));
            }
            if st.first as u64 != next {
                return Err(ScheduleError::Numbering(s));
            }
            if let Some(&on) = st.waits.iter().find(|&&w| w as usize >= s) {
                return Err(ScheduleError::WaitsForward { stage: s, on });
            }
            next += st.tasks as u64;
        }
        if next != self.n_tasks as u64 {
            return Err(ScheduleError::Numbering(self.stages.len()));
        }
        Ok(())
    }

    /// Stage of every task, in task order.
    pub fn task_stages(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.n_tasks as usize);
        for (s, st) in self.stages.iter().enumerate() {
            out.extend(std::iter::repeat_n(s as u32, st.tasks as usize));
        }
        out
    }

    /// The device tables (`cuda/persistent.cu`): per task `(stage, index
    /// within the stage, first wait, end of waits)`, and the waits, each a
    /// stage (its counter) and that stage's task count (the counter's
    /// growth per step).
    pub fn device_tables(&self) -> (Vec<[u32; 4]>, Vec<[u32; 2]>) {
        let mut waits = Vec::new();
        let mut span = Vec::with_capacity(self.stages.len());
        for st in &self.stages {
            let a = waits.len() as u32;
            waits.extend(st.waits.iter().map(|&w| [w, self.stages[w as usize].tasks]));
            span.push((a, waits.len() as u32));
        }
        let mut tasks = Vec::with_capacity(self.n_tasks as usize);
        for (s, st) in self.stages.iter().enumerate() {
            for i in 0..st.tasks {
                tasks.push([s as u32, i, span[s].0, span[s].1]);
            }
        }
        (tasks, waits)
    }
}

/// What a simulated run did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SimReport {
    /// Final counter of every stage.
    pub counters: Vec<u64>,
    /// Task ids in the order they finished.
    pub order: Vec<u32>,
}

/// Runs `generations` steps of `sched` on `grid` simulated blocks, as the
/// device does: block `b` takes tasks `b, b + grid, ...`; a task starts once
/// every counter it waits on holds `generation * tasks` (counters are never
/// reset); at each point a block that can move is picked by `pick` (given
/// how many can, it returns which: a seeded random choice explores
/// interleavings). Checks that no step stalls, that every task starts after
/// every stage it conflicts with (in `specs`) finished, and that every
/// counter ends at `generations * tasks`.
pub(crate) fn simulate(
    sched: &Schedule,
    specs: &[StageSpec],
    grid: usize,
    generations: u64,
    mut pick: impl FnMut(usize) -> usize,
) -> Result<SimReport, ScheduleError> {
    sched.validate()?;
    let stage_of = sched.task_stages();
    let n = sched.n_tasks as usize;
    let ns = sched.stages.len();
    let mut counters = vec![0u64; ns];
    let mut order = Vec::new();
    for gen in 1..=generations {
        let mut next: Vec<usize> = (0..grid).collect();
        let mut done = 0usize;
        let mut done_in_stage = vec![0u32; ns];
        while done < n {
            let ready: Vec<usize> = (0..grid)
                .filter(|&b| next[b] < n)
                .filter(|&b| {
                    let st = &sched.stages[stage_of[next[b]] as usize];
                    st.waits.iter().all(|&w| {
                        counters[w as usize] >= gen * sched.stages[w as usize].tasks as u64
                    })
                })
                .collect();
            if ready.is_empty() {
                let block = (0..grid).find(|&b| next[b] < n).unwrap_or(0);
                return Err(ScheduleError::Deadlock {
                    done,
                    total: n,
                    block,
                    task: next[block],
                });
            }
            let b = ready[pick(ready.len()) % ready.len()];
            let t = next[b];
            let s = stage_of[t] as usize;
            // The hazard check, independent of the waits: every earlier
            // conflicting stage must be complete when t starts.
            if let Some(on) = (0..s).find(|&e| {
                specs[s].access.conflicts(&specs[e].access)
                    && done_in_stage[e] < sched.stages[e].tasks
            }) {
                return Err(ScheduleError::Hazard {
                    task: t,
                    stage: s,
                    on,
                });
            }
            counters[s] += 1;
            done_in_stage[s] += 1;
            done += 1;
            order.push(t as u32);
            next[b] += grid;
        }
    }
    Ok(SimReport { counters, order })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn r(start: u64, len: u64) -> Range {
        Range::new(start, len)
    }

    fn ranges(reads: &[Range], writes: &[Range]) -> Access {
        Access::Ranges {
            reads: reads.to_vec(),
            writes: writes.to_vec(),
        }
    }

    /// One decode step of a Qwen2.5-shaped model as the graph path records
    /// it (after its fusions), with the accesses of each launch: the
    /// embedding, per layer Q/K/V with the norm folded (three matrices of
    /// one launch), RoPE + KV store, split attention, combine, O with the
    /// residual folded, gate/up with the norm folded, down with the
    /// residual; the final norm folded into the head, arg-max.
    fn decode_step(layers: usize, sms: u32) -> Vec<StageSpec> {
        let (d, kv, ff, vocab) = (896u64, 128u64, 4864u64, 151_936u64);
        // Activation buffers, far apart.
        let [x, xn, q, k, v, att, part, gh, logits, am, cache] =
            [1u64, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11].map(|i| i << 32);
        let mut s = vec![StageSpec {
            tasks: 1,
            access: ranges(&[], &[r(x, 4 * d)]),
        }];
        for l in 0..layers as u64 {
            let kc = cache + l * (1 << 24);
            s.push(StageSpec {
                tasks: 28 + 4 + 4,
                access: ranges(
                    &[r(x, 4 * d)],
                    &[r(xn, 4 * d), r(q, 4 * d), r(k, 4 * kv), r(v, 4 * kv)],
                ),
            });
            s.push(StageSpec {
                tasks: 14,
                access: ranges(
                    &[r(k, 4 * kv), r(v, 4 * kv)],
                    &[r(q, 4 * d), r(kc, 1 << 20)],
                ),
            });
            s.push(StageSpec {
                tasks: 2 * 8,
                access: ranges(&[r(q, 4 * d), r(kc, 1 << 20)], &[r(part, 1 << 16)]),
            });
            s.push(StageSpec {
                tasks: 14,
                access: ranges(&[r(part, 1 << 16)], &[r(att, 4 * d)]),
            });
            s.push(StageSpec {
                tasks: 28,
                access: ranges(&[r(att, 4 * d), r(x, 4 * d)], &[r(q, 4 * d), r(x, 4 * d)]),
            });
            s.push(StageSpec {
                tasks: (ff / 16) as u32,
                access: ranges(&[r(x, 4 * d)], &[r(xn, 4 * d), r(gh, 4 * ff)]),
            });
            s.push(StageSpec {
                tasks: 28,
                access: ranges(&[r(gh, 4 * ff), r(x, 4 * d)], &[r(att, 4 * d), r(x, 4 * d)]),
            });
        }
        s.push(StageSpec {
            tasks: sms * 3,
            access: ranges(&[r(x, 4 * d)], &[r(xn, 4 * d), r(logits, 4 * vocab)]),
        });
        s.push(StageSpec {
            tasks: 1,
            access: ranges(&[r(logits, 4 * vocab)], &[r(am, 4)]),
        });
        s
    }

    #[test]
    fn a_decode_step_runs_to_the_end_under_random_interleavings() {
        let specs = decode_step(4, 132);
        let sched = Schedule::build(&specs).unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for grid in [1, 2, 7, 132, 264, 1000] {
            let rep = simulate(&sched, &specs, grid, 3, |n| rng.random_range(0..n)).unwrap();
            for (c, st) in rep.counters.iter().zip(&sched.stages) {
                assert_eq!(*c, 3 * st.tasks as u64, "every counter reaches its target");
            }
            assert_eq!(rep.order.len(), 3 * sched.n_tasks as usize);
        }
    }

    #[test]
    fn waits_are_the_direct_dependencies_only() {
        let specs = decode_step(2, 132);
        let sched = Schedule::build(&specs).unwrap();
        // Stage 1 (layer 0's Q/K/V) waits on the embedding only; RoPE on
        // Q/K/V; attention on RoPE only (Q/K/V is implied through it).
        assert_eq!(sched.stages[1].waits, vec![0]);
        assert_eq!(sched.stages[2].waits, vec![1]);
        assert_eq!(sched.stages[3].waits, vec![2]);
        // O writes q and x: after attention (which read q) and the
        // combine; the combine already follows attention.
        assert_eq!(sched.stages[5].waits, vec![4]);
        // Every stage waits on something before it, never itself.
        for (s, st) in sched.stages.iter().enumerate().skip(1) {
            assert!(!st.waits.is_empty() && st.waits.iter().all(|&w| (w as usize) < s));
        }
    }

    #[test]
    fn an_unknown_access_orders_like_the_stream() {
        let specs = vec![
            StageSpec {
                tasks: 3,
                access: ranges(&[], &[r(0, 16)]),
            },
            StageSpec {
                tasks: 2,
                access: ranges(&[], &[r(64, 16)]),
            },
            StageSpec {
                tasks: 1,
                access: Access::Everything,
            },
            StageSpec {
                tasks: 4,
                access: ranges(&[r(128, 4)], &[r(256, 4)]),
            },
        ];
        let sched = Schedule::build(&specs).unwrap();
        assert_eq!(
            sched.stages[1].waits,
            Vec::<u32>::new(),
            "disjoint writes run together"
        );
        assert_eq!(sched.stages[2].waits, vec![0, 1]);
        assert_eq!(sched.stages[3].waits, vec![2]);
        let (tasks, waits) = sched.device_tables();
        assert_eq!(tasks.len(), 10);
        assert_eq!(tasks[5], [2, 0, 0, 2]);
        assert_eq!(waits, vec![[0, 3], [1, 2], [2, 1]]);
        assert_eq!(tasks[9], [3, 3, 2, 3]);
    }

    /// The checks fail where they should: a missing wait is a hazard, a
    /// forward wait is refused, and a grid whose blocks take tasks out of
    /// list order can stall.
    #[test]
    fn the_checks_catch_broken_schedules() {
        let specs = vec![
            StageSpec {
                tasks: 2,
                access: ranges(&[], &[r(0, 8)]),
            },
            StageSpec {
                tasks: 2,
                access: ranges(&[r(0, 8)], &[r(8, 8)]),
            },
        ];
        let mut sched = Schedule::build(&specs).unwrap();
        assert_eq!(sched.stages[1].waits, vec![0]);
        sched.stages[1].waits.clear();
        // Without the wait, some interleaving runs stage 1 early.
        let err = (0..50u64)
            .map(|seed| {
                let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
                simulate(&sched, &specs, 4, 1, |n| rng.random_range(0..n))
            })
            .find(|r| r.is_err());
        assert!(matches!(
            err,
            Some(Err(ScheduleError::Hazard {
                stage: 1,
                on: 0,
                ..
            }))
        ));
        sched.stages[0].waits = vec![1];
        assert_eq!(
            sched.validate(),
            Err(ScheduleError::WaitsForward { stage: 0, on: 1 })
        );
        assert!(
            simulate(&sched, &specs, 1, 1, |_| 0).is_err(),
            "simulate validates first"
        );
        assert_eq!(
            Schedule::build(&[StageSpec {
                tasks: 0,
                access: Access::Everything
            }]),
            Err(ScheduleError::Empty(0))
        );
    }

    /// Random step shapes: every schedule built from them validates and
    /// runs to the end on any grid, whatever the interleaving.
    #[test]
    fn random_schedules_never_stall_or_race() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for _ in 0..200 {
            let n = rng.random_range(1..30);
            let specs: Vec<StageSpec> = (0..n)
                .map(|_| {
                    let access = if rng.random_range(0..10) == 0 {
                        Access::Everything
                    } else {
                        let mut pick = |k: usize| {
                            (0..k)
                                .map(|_| r(rng.random_range(0..8u64) * 16, rng.random_range(1..40)))
                                .collect::<Vec<_>>()
                        };
                        let (a, b) = (pick(2), pick(2));
                        ranges(&a, &b)
                    };
                    StageSpec {
                        tasks: rng.random_range(1..9),
                        access,
                    }
                })
                .collect();
            let sched = Schedule::build(&specs).unwrap();
            let grid = rng.random_range(1..12);
            let rep = simulate(&sched, &specs, grid, 2, |k| rng.random_range(0..k)).unwrap();
            assert_eq!(rep.order.len(), 2 * sched.n_tasks as usize);
        }
    }
}
