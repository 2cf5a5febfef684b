//! The fusions of a recorded decode step, decided on the typed launches of
//! `launch`: an RMSNorm folded into the launch that reads its output, and a
//! bias or residual add folded into the launch that wrote its operand.
//! Each gives the bits of the unfused ops (the kernels run the same
//! arithmetic: norm.cu's row function, `mv_store`'s order, the sparse FFN's
//! ordered finish), and each saves a dependent launch.

use crate::launch::{Arg, Launch, NormFold, Work, F32};

/// `out = rms_norm(x) * w` over `rows` rows of `width`, recorded but not yet
/// launched: the next launch takes it in when it can (`fold_norm`), else it
/// is launched first.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PendingNorm {
    pub x: u64,
    pub w: u64,
    pub eps: f32,
    pub rows: usize,
    pub width: usize,
    pub out: u64,
}

impl PendingNorm {
    /// The `rms_norm` launch of it (kernel index `kernel`).
    pub fn launch(&self, kernel: usize) -> Launch {
        Launch {
            kernel,
            grid: (self.rows as u32, 1, 1),
            block: (crate::NORM_THREADS, 1, 1),
            smem: 0,
            work: Work::Plain(vec![
                Arg::Ptr(self.x),
                Arg::Ptr(self.w),
                Arg::F32(self.eps),
                Arg::I32(self.width as i32),
                Arg::Ptr(self.out),
            ]),
        }
    }

    fn fold(&self) -> NormFold {
        NormFold {
            x: self.x,
            w: self.w,
            eps: F32(self.eps),
            out: self.out,
        }
    }
}

/// Folds `pn` into `l` when `l` reads exactly the norm's output (all its
/// rows, the same width) and folds no norm yet: a dense mat-vec or gate/up
/// (which then normalizes its input row into shared memory first, `width`
/// floats of it before whatever shared memory the launch already takes),
/// or a one-row sparse FFN phase 1, router or activation-sparse list kernel
/// that takes the norm. Returns whether it folded.
pub(crate) fn fold_norm(pn: &PendingNorm, l: &mut Launch) -> bool {
    let width = pn.width as i32;
    let batch = l.grid.1 as usize;
    let into_matvec = match &mut l.work {
        Work::MatVec(m)
            if m.x == pn.out && m.cols == width && m.norm.is_none() && m.xsplit.is_none() =>
        {
            &mut m.norm
        }
        Work::GateUp(g) if g.x == pn.out && g.cols == width && g.norm.is_none() => &mut g.norm,
        Work::SparseFfn(f)
            if f.takes_norm
                && f.q8.is_some()
                && f.phase == 1
                && f.x == pn.out
                && f.d == width
                && f.norm.is_none() =>
        {
            if pn.rows != 1 {
                return false;
            }
            f.norm = Some(pn.fold());
            return true;
        }
        Work::Route(r) if r.x == pn.out && r.d == width && r.norm.is_none() => {
            if pn.rows != 1 {
                return false;
            }
            r.norm = Some(pn.fold());
            return true;
        }
        // The activation-sparse list kernel: grid.1 counts its lists, not
        // rows; each block normalizes the row into shared memory.
        Work::AspSelect(s) if s.x == pn.out && s.cols == pn.width && s.norm.is_none() => {
            if pn.rows != 1 {
                return false;
            }
            s.norm = Some(pn.fold());
            l.smem += (pn.width * 4) as u32;
            return true;
        }
        _ => return false,
    };
    if batch != pn.rows {
        return false;
    }
    *into_matvec = Some(pn.fold());
    l.smem += (pn.width * 4) as u32;
    true
}

/// Folds an elementwise op on `target` (written by a recorded launch) into
/// that launch as an epilogue: a bias (`res` false: `bias[m]` of the matrix
/// whose output is `target`) or a residual add (`res` true: `extra += target`;
/// a single-matrix mat-vec's `res`, a one-row sparse FFN's last phase or a
/// one-row, one-matrix activation-sparse product, which then write
/// `extra = FFN + extra`, the same add as `add_inplace`'s).
/// Only when no launch after the producer reads or writes `target` or
/// `extra`, and `pending` (a norm not yet launched, which must read its
/// input before the op it precedes) touches neither. Returns whether it
/// folded.
pub(crate) fn fold_epilogue(
    rec: &mut [Launch],
    pending: Option<&PendingNorm>,
    target: u64,
    n_rows: usize,
    extra: u64,
    res: bool,
) -> bool {
    if pending.is_some_and(|p| [p.x, p.out].iter().any(|&q| q == target || q == extra)) {
        return false;
    }
    for l in rec.iter_mut().rev() {
        let batch = l.grid.1 as usize;
        match &mut l.work {
            Work::SparseFfn(f) if f.phase == 2 && f.y == target && !f.accumulate => {
                let reads_extra = f.x == extra || f.norm.is_some_and(|n| n.x == extra);
                if !res || n_rows != 1 || reads_extra {
                    return false;
                }
                f.y = extra;
                f.accumulate = true;
                return true;
            }
            Work::AspMv(p) if p.y[0] == target && p.hlist == 0 && !p.accumulate => {
                // One matrix, one row; it reads only its lists besides the
                // weights, never the residual.
                if !res || n_rows != 1 || p.y[1] != 0 {
                    return false;
                }
                p.y[0] = extra;
                p.accumulate = true;
                return true;
            }
            Work::MatVec(m) if batch == n_rows => {
                if let Some(i) = (0..3).find(|&i| m.y[i] == target && m.rows[i] != 0) {
                    // The residual must not be the launch's own input (other
                    // warps still read it).
                    let reads_extra = m.x == extra || m.norm.is_some_and(|n| n.x == extra);
                    let slot = if res { &mut m.res } else { &mut m.bias[i] };
                    if (res && (i != 0 || m.rows[1] != 0 || m.rows[2] != 0 || reads_extra))
                        || *slot != 0
                    {
                        return false;
                    }
                    *slot = extra;
                    return true;
                }
            }
            _ => {}
        }
        if l.work.touches(target) || l.work.touches(extra) {
            return false;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::launch::{MatVec, SparseFfn};

    fn mv(x: u64, y: [u64; 3], rows: [i32; 3]) -> Launch {
        Launch {
            kernel: 0,
            grid: (4, 1, 1),
            block: (256, 1, 1),
            smem: 0,
            work: Work::MatVec(MatVec {
                w: [100, 101, 102],
                rows,
                row_bytes: 0,
                cols: 256,
                x,
                y,
                tensor_scale: [F32(0.0); 3],
                bias: [0; 3],
                res: 0,
                norm: None,
                xsplit: None,
            }),
        }
    }

    fn norm() -> PendingNorm {
        PendingNorm {
            x: 1,
            w: 2,
            eps: 1e-6,
            rows: 1,
            width: 256,
            out: 3,
        }
    }

    #[test]
    fn a_norm_folds_into_the_mat_vec_that_reads_its_output_only() {
        let mut l = mv(3, [10, 11, 12], [256, 64, 64]);
        assert!(fold_norm(&norm(), &mut l));
        assert_eq!(l.smem, 1024);
        assert!(!fold_norm(&norm(), &mut l), "a second norm");
        let mut other = mv(4, [10, 0, 0], [256, 0, 0]);
        assert!(!fold_norm(&norm(), &mut other), "another input");
        let mut wide = mv(3, [10, 0, 0], [256, 0, 0]);
        wide.grid.1 = 2;
        assert!(!fold_norm(&norm(), &mut wide), "another batch");
        let mut plain = PendingNorm::launch(&norm(), 0);
        assert!(!fold_norm(&norm(), &mut plain));
        // A launch with shared memory of its own (the tensor-core mat-vecs'
        // planes) takes the norm's row in front of it.
        let mut staged = mv(3, [10, 0, 0], [256, 0, 0]);
        staged.smem = 576;
        assert!(fold_norm(&norm(), &mut staged));
        assert_eq!(staged.smem, 576 + 1024);
        // The split across blocks rounds only a slice of its input: no norm.
        let mut xsplit = mv(3, [10, 0, 0], [256, 0, 0]);
        if let Work::MatVec(m) = &mut xsplit.work {
            m.xsplit = Some(crate::launch::XSplit { part: 5, ctr: 6 });
        }
        assert!(
            !fold_norm(&norm(), &mut xsplit),
            "a split-across-blocks launch"
        );
    }

    #[test]
    fn epilogues_fold_into_their_producer_unless_something_reads_between() {
        // Bias of matrix 1 of a Q/K/V launch.
        let mut rec = vec![mv(3, [10, 11, 12], [256, 64, 64])];
        assert!(fold_epilogue(&mut rec, None, 11, 1, 20, false));
        assert!(
            !fold_epilogue(&mut rec, None, 11, 1, 21, false),
            "slot taken"
        );
        // A residual add needs a single matrix, and not its own input.
        assert!(!fold_epilogue(&mut rec, None, 10, 1, 30, true));
        let mut rec = vec![mv(3, [10, 0, 0], [256, 0, 0])];
        assert!(!fold_epilogue(&mut rec, None, 10, 1, 3, true));
        assert!(fold_epilogue(&mut rec, None, 10, 1, 30, true));
        // A launch after the producer that reads the target stops the fold.
        let mut rec = vec![
            mv(3, [10, 0, 0], [256, 0, 0]),
            mv(10, [40, 0, 0], [256, 0, 0]),
        ];
        assert!(!fold_epilogue(&mut rec, None, 10, 1, 30, true));
        // A pending norm over the target too.
        let mut rec = vec![mv(3, [10, 0, 0], [256, 0, 0])];
        let pn = PendingNorm { x: 10, ..norm() };
        assert!(!fold_epilogue(&mut rec, Some(&pn), 10, 1, 30, true));
    }

    #[test]
    fn the_residual_add_folds_into_the_sparse_ffns_last_phase() {
        let ffn = |phase| Launch {
            kernel: 1,
            grid: (132, 1, 1),
            block: (256, 1, 1),
            smem: 0,
            work: Work::SparseFfn(SparseFfn {
                head: vec![],
                d: 256,
                x: 3,
                list: [Arg::Ptr(4), Arg::Ptr(5), Arg::I32(6)],
                accumulate: false,
                scratch: [7, 8, 9],
                y: 10,
                phase,
                q8: None,
                takes_norm: false,
                norm: None,
            }),
        };
        let mut rec = vec![ffn(1), ffn(2)];
        assert!(!fold_epilogue(&mut rec, None, 10, 2, 30, true), "two rows");
        assert!(!fold_epilogue(&mut rec, None, 10, 1, 30, false), "a bias");
        assert!(fold_epilogue(&mut rec, None, 10, 1, 30, true));
        let Work::SparseFfn(f) = &rec[1].work else {
            unreachable!()
        };
        assert!(f.accumulate && f.y == 30);
    }

    fn asp_select(x: u64) -> Launch {
        Launch {
            kernel: 0,
            grid: (14, 2, 1),
            block: (256, 1, 1),
            smem: 0,
            work: Work::AspSelect(crate::launch::AspSelect {
                x,
                cols: 256,
                thr: [40, 41, 0],
                lists: [50, 51, 0],
                norm: None,
            }),
        }
    }

    fn asp_mv(y: [u64; 2], hlist: u64) -> Launch {
        Launch {
            kernel: 0,
            grid: (8, if y[1] == 0 { 1 } else { 2 }, 1),
            block: (256, 1, 1),
            smem: 0,
            work: Work::AspMv(crate::launch::AspProduct {
                w: [60, 61],
                lists: [50, 51],
                y,
                rows: 512,
                cols: 256,
                gpw: 2,
                splits: 1,
                part: 70,
                ctr: 71,
                hthr: 0,
                hlist,
                accumulate: false,
            }),
        }
    }

    #[test]
    fn a_norm_folds_into_the_activation_sparse_list_kernel_of_one_row() {
        // grid.1 is the list count (2), not a batch: one row folds.
        let mut l = asp_select(3);
        assert!(fold_norm(&norm(), &mut l));
        assert_eq!(l.smem, 1024);
        let Work::AspSelect(s) = &l.work else {
            unreachable!()
        };
        assert_eq!(s.norm.map(|n| (n.x, n.w, n.out)), Some((1, 2, 3)));
        // The kernel reads the norm's input and writes its output too.
        assert_eq!(s.args()[0], Arg::Ptr(1));
        assert_eq!(s.args()[4], Arg::Ptr(3));
        let mut two_rows = asp_select(3);
        assert!(!fold_norm(
            &PendingNorm { rows: 2, ..norm() },
            &mut two_rows
        ));
        assert!(!fold_norm(&norm(), &mut asp_select(4)), "another input");
    }

    #[test]
    fn the_residual_add_folds_into_a_one_matrix_activation_sparse_product() {
        let mut rec = vec![asp_select(3), asp_mv([20, 21], 52), asp_mv([22, 0], 0)];
        assert!(!fold_epilogue(&mut rec, None, 22, 2, 30, true), "a batch");
        assert!(!fold_epilogue(&mut rec, None, 22, 1, 30, false), "a bias");
        assert!(fold_epilogue(&mut rec, None, 22, 1, 30, true));
        let Work::AspMv(p) = &rec[2].work else {
            unreachable!()
        };
        assert!(p.accumulate && p.y[0] == 30);
        assert!(!fold_epilogue(&mut rec, None, 30, 1, 31, true), "twice");
        // Gate and up (two outputs, the SwiGLU epilogue): never.
        let mut rec = vec![asp_mv([20, 21], 52)];
        assert!(!fold_epilogue(&mut rec, None, 20, 1, 30, true));
    }
}
