//! Kernel launches as values: what every op of the backends records (the
//! kernel, its grid and a typed description of its arguments), so that a
//! decode step can be compared with the steps captured before, changed by
//! the fusions (`fusion`) and launched later inside a CUDA graph; and the
//! one launch path, `cuLaunchKernelEx` with programmatic stream
//! serialization (PDL), which cudarc's launch builder does not take.
//!
//! A launch whose arguments a fusion may change is described by what the op
//! is ([`Work::MatVec`], [`Work::GateUp`], [`Work::SparseFfn`],
//! [`Work::Route`], the activation-sparse [`Work::AspSelect`] and
//! [`Work::AspMv`]): its input, output, the norm it folds, its epilogues.
//! The kernel's argument list is written from that description in one place
//! per kind (`args`), so no fusion touches argument positions.

use std::ffi::c_void;

use cudarc::driver::sys;
use cudarc::driver::{CudaFunction, CudaStream, DriverError};

/// One kernel argument, kept by value.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Arg {
    Ptr(u64),
    I32(i32),
    I64(i64),
    F32(f32),
}

impl Arg {
    /// The PTX parameter kind this argument fills.
    pub(crate) fn kind(&self) -> crate::module::ParamKind {
        use crate::module::ParamKind;
        match self {
            Arg::Ptr(_) | Arg::I64(_) => ParamKind::Word64,
            Arg::I32(_) => ParamKind::Int32,
            Arg::F32(_) => ParamKind::F32,
        }
    }
}

/// Whether `args` fill a kernel whose parameters are `params` (count and
/// kind by kind): `Err` names the first that does not.
pub(crate) fn check_args(params: &[crate::module::ParamKind], args: &[Arg]) -> Result<(), String> {
    if params.len() != args.len() {
        return Err(format!(
            "{} arguments for {} parameters",
            args.len(),
            params.len()
        ));
    }
    match params.iter().zip(args).position(|(p, a)| *p != a.kind()) {
        Some(i) => Err(format!(
            "argument {i} is {:?}, the parameter is {:?}",
            args[i], params[i]
        )),
        None => Ok(()),
    }
}

impl PartialEq for Arg {
    fn eq(&self, other: &Arg) -> bool {
        match (self, other) {
            (Arg::Ptr(a), Arg::Ptr(b)) => a == b,
            (Arg::I32(a), Arg::I32(b)) => a == b,
            (Arg::I64(a), Arg::I64(b)) => a == b,
            // Bit equality: a replayed graph must launch exactly these bits.
            (Arg::F32(a), Arg::F32(b)) => a.to_bits() == b.to_bits(),
            _ => false,
        }
    }
}

/// An f32 argument compared by its bits (as [`Arg::F32`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct F32(pub f32);

impl PartialEq for F32 {
    fn eq(&self, other: &F32) -> bool {
        self.0.to_bits() == other.0.to_bits()
    }
}

/// An RMSNorm folded into the launch that reads its output: the kernel
/// reads `x`, normalizes each row with the weights `w` and `eps` itself
/// (norm.cu's arithmetic: the same bits as the `rms_norm` launch) and
/// writes the normalized row to `out` as well.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct NormFold {
    pub x: u64,
    pub w: u64,
    pub eps: F32,
    pub out: u64,
}

/// `mv3_*` (`MV3_PARAMS` in cuda/matvec.cu): `y[m] = W[m] x` for up to three
/// matrices of one input, with optional epilogues.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct MatVec {
    pub w: [u64; 3],
    /// Rows of each matrix; 0 for an unused slot.
    pub rows: [i32; 3],
    pub row_bytes: i64,
    pub cols: i32,
    pub x: u64,
    pub y: [u64; 3],
    /// NVFP4 tensor scales (0 for the other layouts).
    pub tensor_scale: [F32; 3],
    /// Bias added to matrix m's outputs (0: none).
    pub bias: [u64; 3],
    /// Residual stream matrix 0's outputs are added into (0: none).
    pub res: u64,
    pub norm: Option<NormFold>,
    /// The split across blocks (`mvx_*`): its partial sums and tile
    /// counters; such a launch takes no folded norm.
    pub xsplit: Option<XSplit>,
}

/// Device scratch of a mat-vec whose column split runs across blocks:
/// `part[n_act][split][rows]` partial sums and `ctr[n_act][tiles]` counters
/// (zero between launches: the last block of a tile resets its own).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct XSplit {
    pub part: u64,
    pub ctr: u64,
}

impl MatVec {
    fn args(&self) -> Vec<Arg> {
        let mut a = Vec::with_capacity(23);
        a.extend(self.w.map(Arg::Ptr));
        a.extend(self.rows.map(Arg::I32));
        a.extend([
            Arg::I64(self.row_bytes),
            Arg::I32(self.cols),
            Arg::Ptr(self.x),
        ]);
        a.extend(self.y.map(Arg::Ptr));
        a.extend(self.tensor_scale.map(|t| Arg::F32(t.0)));
        a.extend(self.bias.map(Arg::Ptr));
        a.push(Arg::Ptr(self.res));
        a.extend(norm_args(self.norm, true));
        if let Some(xs) = self.xsplit {
            a.extend([Arg::Ptr(xs.part), Arg::Ptr(xs.ctr)]);
        }
        a
    }
}

/// `(nx, nw, neps, nout)` of a folded norm (`with_x`) or `(nw, neps, nout)`;
/// nulls and 0 when none is folded.
fn norm_args(n: Option<NormFold>, with_x: bool) -> Vec<Arg> {
    let (x, w, eps, out) = n.map_or((0, 0, 0.0, 0), |n| (n.x, n.w, n.eps.0, n.out));
    let mut a = Vec::with_capacity(4);
    if with_x {
        a.push(Arg::Ptr(x));
    }
    a.extend([Arg::Ptr(w), Arg::F32(eps), Arg::Ptr(out)]);
    a
}

/// `ffn_*` (`FFN_PARAMS` in cuda/matvec.cu): `h = silu(W_gate x) * (W_up x)`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct GateUp {
    pub gate: u64,
    pub up: u64,
    pub rows: i32,
    pub row_bytes: i64,
    pub cols: i32,
    pub x: u64,
    pub h: u64,
    pub tensor_scale: [F32; 2],
    pub norm: Option<NormFold>,
}

impl GateUp {
    fn args(&self) -> Vec<Arg> {
        let mut a = vec![
            Arg::Ptr(self.gate),
            Arg::Ptr(self.up),
            Arg::I32(self.rows),
            Arg::I64(self.row_bytes),
            Arg::I32(self.cols),
            Arg::Ptr(self.x),
            Arg::Ptr(self.h),
            Arg::F32(self.tensor_scale[0].0),
            Arg::F32(self.tensor_scale[1].0),
        ];
        a.extend(norm_args(self.norm, true));
        a
    }
}

/// One phase launch of a fused sparse FFN (`superblock_ffn_*`,
/// `SB_Q8S_PARAMS` in cuda/superblock.cu) on one row.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct SparseFfn {
    /// pages, page_bytes, n_pages, d and (NVFP4) the three tensor scales.
    pub head: Vec<Arg>,
    pub d: i32,
    pub x: u64,
    /// active ids, their count, the list's capacity.
    pub list: [Arg; 3],
    /// `y = FFN(x) + y` instead of `y = FFN(x)`.
    pub accumulate: bool,
    /// hbuf, partials, counters.
    pub scratch: [u64; 3],
    pub y: u64,
    /// 1 or 2.
    pub phase: i32,
    /// The split Q8_0 kernel's `part_ch` and folded norm (the other formats
    /// take neither).
    pub q8: Option<i32>,
    /// Whether the RMSNorm before it may fold into this launch (a routed
    /// layer that launches no router: the norm the router would have taken).
    pub takes_norm: bool,
    pub norm: Option<NormFold>,
}

impl SparseFfn {
    fn args(&self) -> Vec<Arg> {
        let mut a = self.head.clone();
        // A folded norm reads the norm's input and normalizes it itself.
        a.push(Arg::Ptr(self.norm.map_or(self.x, |n| n.x)));
        a.extend(self.list);
        a.push(Arg::I32(self.accumulate as i32));
        a.extend(self.scratch.map(Arg::Ptr));
        a.extend([Arg::Ptr(self.y), Arg::I32(self.phase)]);
        if let Some(part_ch) = self.q8 {
            a.push(Arg::I32(part_ch));
            a.extend(norm_args(self.norm, false));
        }
        a
    }
}

/// `route_bvh` (cuda/route.cu): the device router of one row.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Route {
    pub x: u64,
    pub d: i32,
    /// The router's tables and the layer's list (the arguments after `d`).
    pub tables: Vec<Arg>,
    pub norm: Option<NormFold>,
}

impl Route {
    fn args(&self) -> Vec<Arg> {
        let mut a = vec![
            Arg::Ptr(self.norm.map_or(self.x, |n| n.x)),
            Arg::I32(self.d),
        ];
        a.extend_from_slice(&self.tables);
        a.extend(norm_args(self.norm, false));
        a
    }
}

/// One `asp_select` launch: the lists of x (`cols` channels) for up to three
/// threshold vectors (0: every channel), with the RMSNorm before it folded
/// in or not (`fusion::fold_norm`).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct AspSelect {
    pub x: u64,
    pub cols: usize,
    pub thr: [u64; 3],
    pub lists: [u64; 3],
    pub norm: Option<NormFold>,
}

impl AspSelect {
    pub(crate) fn args(&self) -> Vec<Arg> {
        let (x, w, eps, out) = self
            .norm
            .map_or((self.x, 0, 0.0, 0), |n| (n.x, n.w, n.eps.0, n.out));
        let mut a = vec![
            Arg::Ptr(x),
            Arg::I32(self.cols as i32),
            Arg::Ptr(w),
            Arg::F32(eps),
            Arg::Ptr(out),
        ];
        a.extend(self.thr.map(Arg::Ptr));
        a.extend(self.lists.map(Arg::Ptr));
        a
    }
}

/// One or two matrices of one product launch (gate and up share one), with
/// its epilogues: down's list of SiLU(gate) * up (`hlist`, `hthr`: gate and
/// up), or `y = product + y` (`accumulate`: one matrix, set by
/// `fusion::fold_epilogue`).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct AspProduct {
    pub w: [u64; 2],
    pub lists: [u64; 2],
    pub y: [u64; 2],
    pub rows: usize,
    pub cols: usize,
    pub gpw: usize,
    pub splits: usize,
    pub part: u64,
    pub ctr: u64,
    pub hthr: u64,
    pub hlist: u64,
    pub accumulate: bool,
}

impl AspProduct {
    pub(crate) fn args(&self) -> Vec<Arg> {
        let mut a = Vec::with_capacity(15);
        a.extend(self.w.map(Arg::Ptr));
        a.extend(self.lists.map(Arg::Ptr));
        a.extend(self.y.map(Arg::Ptr));
        a.extend([
            Arg::I32(self.rows as i32),
            Arg::I32(self.cols as i32),
            Arg::I32(self.gpw as i32),
            Arg::I32(self.splits as i32),
            Arg::Ptr(self.part),
            Arg::Ptr(self.ctr),
            Arg::Ptr(self.hthr),
            Arg::Ptr(self.hlist),
            Arg::I32(self.accumulate as i32),
        ]);
        a
    }
}

/// What a launch does, as far as the fusions need to know.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Work {
    /// A kernel no fusion changes: its arguments as they are.
    Plain(Vec<Arg>),
    MatVec(MatVec),
    GateUp(GateUp),
    SparseFfn(SparseFfn),
    Route(Route),
    AspSelect(AspSelect),
    AspMv(AspProduct),
}

impl Work {
    /// The kernel's argument list.
    pub fn args(&self) -> Vec<Arg> {
        match self {
            Work::Plain(a) => a.clone(),
            Work::MatVec(m) => m.args(),
            Work::GateUp(g) => g.args(),
            Work::SparseFfn(f) => f.args(),
            Work::Route(r) => r.args(),
            Work::AspSelect(s) => s.args(),
            Work::AspMv(p) => p.args(),
        }
    }

    /// Whether any pointer argument is `p`.
    pub fn touches(&self, p: u64) -> bool {
        self.args().contains(&Arg::Ptr(p))
    }
}

/// One kernel launch: kernel index (into the backend's kernel table), grid,
/// block, dynamic shared memory, work.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Launch {
    pub kernel: usize,
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub smem: u32,
    pub work: Work,
}

/// Launches `f` on `stream` with `args`, with programmatic stream
/// serialization when `programmatic`.
///
/// # Safety
/// `args` must be the kernel's argument list (pointers as u64, in the order
/// and with the types of its signature), pointing at memory that outlives
/// the kernel; `f` must belong to `stream`'s context.
pub(crate) unsafe fn launch_ex(
    f: &CudaFunction,
    stream: &CudaStream,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    smem: u32,
    args: &[Arg],
    programmatic: bool,
) -> Result<(), DriverError> {
    let mut params: Vec<*mut c_void> = args
        .iter()
        .map(|a| match a {
            Arg::Ptr(v) => v as *const u64 as *mut c_void,
            Arg::I32(v) => v as *const i32 as *mut c_void,
            Arg::I64(v) => v as *const i64 as *mut c_void,
            Arg::F32(v) => v as *const f32 as *mut c_void,
        })
        .collect();
    // As cudarc's own launches do: the stream's context current on this
    // thread (a no-op when it already is).
    stream.context().bind_to_thread()?;
    // SAFETY: a plain C union of integers; zero is a valid value of every
    // member.
    let mut value: sys::CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
    value.programmaticStreamSerializationAllowed = 1;
    let mut attrs = [sys::CUlaunchAttribute {
        id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
        pad: [0; 4],
        value,
    }];
    let cfg = sys::CUlaunchConfig {
        gridDimX: grid.0,
        gridDimY: grid.1,
        gridDimZ: grid.2,
        blockDimX: block.0,
        blockDimY: block.1,
        blockDimZ: block.2,
        sharedMemBytes: smem,
        hStream: stream.cu_stream(),
        attrs: attrs.as_mut_ptr(),
        numAttrs: programmatic as u32,
    };
    // SAFETY: the caller's contract; `params` points at `args`' values and
    // `attrs` outlives the call.
    unsafe {
        sys::cuLaunchKernelEx(
            &cfg,
            f.cu_function(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The typed descriptions write the kernels' argument lists: the counts
    /// the PTX holds (checked against the PTX by `checks::nvrtc_check`), a
    /// folded norm in its slots, the sparse FFN's input replaced by the
    /// norm's.
    #[test]
    fn launches_are_checked_kind_by_kind_against_the_kernels_parameters() {
        use crate::module::{param_kinds, ParamKind};
        let ptx = ".visible .entry k(\n\t.param .u64 k_param_0,\n\t.param .u32 k_param_1,\n\t.param .f32 k_param_2\n)\n{\n}\n";
        let kinds = param_kinds(ptx, "k").unwrap();
        assert_eq!(kinds, [ParamKind::Word64, ParamKind::Int32, ParamKind::F32]);
        assert!(check_args(&kinds, &[Arg::Ptr(1), Arg::I32(2), Arg::F32(3.0)]).is_ok());
        assert!(check_args(&kinds, &[Arg::I64(1), Arg::I32(2), Arg::F32(3.0)]).is_ok());
        // An int where the pointer goes (the bug this exists for), a float
        // for an int, one argument short.
        let e = check_args(&kinds, &[Arg::I32(2), Arg::Ptr(1), Arg::F32(3.0)]).unwrap_err();
        assert!(e.starts_with("argument 0"), "{e}");
        assert!(check_args(&kinds, &[Arg::Ptr(1), Arg::F32(2.0), Arg::F32(3.0)]).is_err());
        assert!(check_args(&kinds, &[Arg::Ptr(1), Arg::I32(2)]).is_err());
        assert!(param_kinds(ptx, "other").is_none());
    }

    #[test]
    fn typed_launches_write_the_kernels_argument_lists() {
        let norm = NormFold {
            x: 7,
            w: 8,
            eps: F32(1e-6),
            out: 9,
        };
        let mv = MatVec {
            w: [1, 0, 0],
            rows: [32, 0, 0],
            row_bytes: 64,
            cols: 256,
            x: 9,
            y: [3, 0, 0],
            tensor_scale: [F32(0.0); 3],
            bias: [0; 3],
            res: 5,
            norm: Some(norm),
            xsplit: None,
        };
        let a = mv.args();
        assert_eq!(a.len(), crate::matvec::MV3_ARGS);
        let x = MatVec {
            norm: None,
            xsplit: Some(XSplit { part: 11, ctr: 12 }),
            ..mv.clone()
        }
        .args();
        assert_eq!(x.len(), crate::matvec::MV3_ARGS + 2);
        assert_eq!(x[crate::matvec::MV3_ARGS..], [Arg::Ptr(11), Arg::Ptr(12)]);
        assert_eq!(a[8], Arg::Ptr(9));
        assert_eq!(a[18], Arg::Ptr(5));
        assert_eq!(
            a[19..23],
            [Arg::Ptr(7), Arg::Ptr(8), Arg::F32(1e-6), Arg::Ptr(9)]
        );
        let ffn = SparseFfn {
            head: vec![Arg::Ptr(1), Arg::I64(2), Arg::I32(3), Arg::I32(256)],
            d: 256,
            x: 9,
            list: [Arg::Ptr(4), Arg::Ptr(5), Arg::I32(3)],
            accumulate: true,
            scratch: [10, 11, 12],
            y: 13,
            phase: 1,
            q8: Some(128),
            takes_norm: true,
            norm: Some(norm),
        };
        let a = ffn.args();
        assert_eq!(a.len(), crate::sparse::Q8_FFN_ARGS);
        assert_eq!(a[4], Arg::Ptr(7), "x is the norm's input");
        assert_eq!(a[8], Arg::I32(1));
        assert_eq!(a[12], Arg::Ptr(13));
        assert_eq!(a[15..18], [Arg::Ptr(8), Arg::F32(1e-6), Arg::Ptr(9)]);
        assert!(Work::SparseFfn(ffn).touches(11));
    }
}
