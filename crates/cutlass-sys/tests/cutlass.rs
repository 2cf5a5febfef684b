//! cutlass-sys tests. Without the kernels (default build): every entry
//! returns NotBuilt. With them, here (no GPU): entries reach the CUDA
//! runtime and report its error. The `h200_` test needs the H200 (sm_90)
//! and `--features cutlass`; it is `#[ignore]`d and run by the command in
//! docs/NVFP4.md.

use cutlass_sys::{ComputeCapability, Error, Kernel, Operand};

const SM90: ComputeCapability = ComputeCapability { major: 9, minor: 0 };
const SM120: ComputeCapability = ComputeCapability {
    major: 12,
    minor: 0,
};

#[test]
fn stub_or_runtime_error_without_gpu() {
    let mut d = vec![0f32; 16 * 16];
    let a = vec![0u16; 16 * 16];
    let got = cutlass_sys::sm90_bf16_gemm_host(16, 16, 16, &a, &a, &mut d, 0);
    if !cutlass_sys::is_built() {
        let reason = match got {
            Err(Error::NotBuilt { reason }) => reason,
            other => panic!("stub must say NotBuilt, got {other:?}"),
        };
        assert!(
            reason.contains("cutlass"),
            "reason names the cause: {reason}"
        );
        let msg = Error::NotBuilt { reason }.to_string();
        assert!(msg.starts_with("cutlass-sys kernels not built"), "{msg}");
        assert!(matches!(
            cutlass_sys::device_capability(0),
            Err(Error::NotBuilt { .. })
        ));
        assert!(matches!(
            cutlass_sys::cutlass_version(),
            Err(Error::NotBuilt { .. })
        ));
        assert!(matches!(
            cutlass_sys::sm120_scale_bytes(128, 128, 128, Operand::A),
            Err(Error::NotBuilt { .. })
        ));
        let fp4 = vec![0u8; 128 * 128 / 2];
        let sf = vec![0u8; 128 * 128 / 16];
        let mut d = vec![0f32; 128 * 128];
        assert!(matches!(
            cutlass_sys::sm120_nvfp4_gemm_host(128, 128, 128, &fp4, &sf, &fp4, &sf, 1.0, &mut d, 0),
            Err(Error::NotBuilt { .. })
        ));
    } else {
        assert_eq!(cutlass_sys::cutlass_version().unwrap(), (4, 2));
        // Host-only code (the scale layout) works without a device.
        let bytes = cutlass_sys::sm120_scale_bytes(100, 256, 256, Operand::A).unwrap();
        assert_eq!(bytes, 128 * 256 / 16, "rows padded to 128, 16 k-blocks");
        // Device calls either run (a GPU is present) or fail in CUDA, never NotBuilt.
        match cutlass_sys::device_capability(0) {
            Ok(cc) => assert!(cc.major >= 7, "{cc}"),
            Err(Error::Cuda(msg)) => assert!(!msg.is_empty()),
            Err(other) => panic!("unexpected {other:?}"),
        }
        assert!(!matches!(got, Err(Error::NotBuilt { .. })), "{got:?}");
    }
}

/// CUTLASS's SM1xx scale-factor layout written out independently: 128-row
/// x 4-block atoms of 512 bytes, K atoms contiguous within a row tile;
/// inside an atom row r sits at (r % 32) * 16 + ((r / 32) % 4) * 4, block j
/// at j % 4 (the shape/stride ((32,4),(16,4)) : ((16,4),(0,1)) of
/// `Sm1xxBlkScaledConfig`, visible in the kernel's mangled name).
fn sf_offset(r: usize, j: usize, k: usize) -> usize {
    let k_atoms = k / 64;
    (r % 32) * 16 + ((r / 32) % 4) * 4 + (j % 4) + (j / 4) * 512 + (r / 128) * 512 * k_atoms
}

#[test]
fn sm120_scale_reorder_matches_the_documented_layout() {
    let (m, n, k) = (200usize, 130usize, 384usize);
    for (operand, rows) in [(Operand::A, m), (Operand::B, n)] {
        let rowmajor: Vec<u8> = (0..rows * k / 16).map(|i| (i % 251) as u8 + 1).collect();
        let got = cutlass_sys::sm120_reorder_scales(m, n, k, operand, &rowmajor);
        if !cutlass_sys::is_built() {
            assert!(matches!(got, Err(Error::NotBuilt { .. })), "{got:?}");
            continue;
        }
        let got = got.unwrap();
        let padded_rows = rows.div_ceil(128) * 128;
        assert_eq!(got.len(), padded_rows * k / 16, "{operand:?}");
        let mut want = vec![0u8; got.len()];
        for r in 0..rows {
            for j in 0..k / 16 {
                want[sf_offset(r, j, k)] = rowmajor[r * (k / 16) + j];
            }
        }
        assert_eq!(got, want, "{operand:?}");
    }
    let err = cutlass_sys::sm120_reorder_scales(128, 128, 128, Operand::A, &[0; 10]).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
}

#[test]
fn lengths_and_shapes_are_checked_before_any_call() {
    let mut d = vec![0f32; 4];
    let err = cutlass_sys::sm90_bf16_gemm_host(2, 2, 8, &[0; 15], &[0; 16], &mut d, 0).unwrap_err();
    assert!(
        matches!(&err, Error::InvalidArgument(m) if m.contains("expected 16")),
        "{err}"
    );
    let err = cutlass_sys::sm90_bf16_gemm_host(0, 2, 8, &[], &[0; 16], &mut [], 0).unwrap_err();
    assert!(
        matches!(&err, Error::InvalidArgument(m) if m.contains("m=0")),
        "{err}"
    );
    let err = cutlass_sys::sm120_nvfp4_gemm_host(
        1,
        1,
        64,
        &[0; 32],
        &[0; 4],
        &[0; 32],
        &[0; 4],
        1.0,
        &mut [0.0],
        0,
    )
    .unwrap_err();
    assert!(
        matches!(&err, Error::InvalidArgument(m) if m.contains("multiple of 128")),
        "{err}"
    );
}

#[test]
fn dispatch_by_capability() {
    assert_eq!(Kernel::Sm90Bf16Gemm.check(SM90), Ok(()));
    assert_eq!(Kernel::Sm120Nvfp4Gemm.check(SM120), Ok(()));
    let err = Kernel::Sm120Nvfp4Gemm.check(SM90).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("sm_120a only") && msg.contains("the device is sm_90"),
        "{msg}"
    );
    // Arch-specific cubins do not run on later chips either.
    assert!(Kernel::Sm90Bf16Gemm
        .check(ComputeCapability {
            major: 10,
            minor: 0
        })
        .is_err());
    assert!(Kernel::Sm120Nvfp4Gemm
        .check(ComputeCapability {
            major: 12,
            minor: 1
        })
        .is_err());
}

/// xorshift64*: the tests need no rand crate and give the same data everywhere.
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

fn bf16_bits(x: f32) -> u16 {
    // Round to nearest even (inputs are finite).
    let bits = x.to_bits();
    ((bits + 0x7fff + ((bits >> 16) & 1)) >> 16) as u16
}

fn bf16_value(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// Reference D = A · Bᵀ in f64 from the BF16 values.
fn reference(m: usize, n: usize, k: usize, a: &[u16], b: &[u16]) -> (Vec<f64>, Vec<f64>) {
    let mut d = vec![0f64; m * n];
    let mut abs = vec![0f64; m * n];
    for i in 0..m {
        for j in 0..n {
            let (mut s, mut t) = (0f64, 0f64);
            for p in 0..k {
                let x = bf16_value(a[i * k + p]) as f64 * bf16_value(b[j * k + p]) as f64;
                s += x;
                t += x.abs();
            }
            d[i * n + j] = s;
            abs[i * n + j] = t;
        }
    }
    (d, abs)
}

#[test]
#[ignore = "needs the H200 (sm_90) and --features cutlass: see docs/NVFP4.md"]
fn h200_sm90_gemm_matches_cpu_and_sm120_refuses() {
    assert!(
        cutlass_sys::is_built(),
        "built without kernels: {:?}",
        cutlass_sys::device_capability(0)
    );
    let cc = cutlass_sys::device_capability(0).expect("a CUDA device");
    assert_eq!(cc, SM90, "this check is for the H200 (sm_90)");
    let mut rng = Lcg(0x9e37_79b9_7f4a_7c15);

    // 1. Exact: multiples of 1/8 in [-1, 1]; every partial sum is exact in f32.
    for &(m, n, k) in &[(128, 128, 64), (100, 200, 264), (256, 512, 1024)] {
        let a: Vec<u16> = (0..m * k)
            .map(|_| bf16_bits((rng.unit() * 8.0).round() / 8.0))
            .collect();
        let b: Vec<u16> = (0..n * k)
            .map(|_| bf16_bits((rng.unit() * 8.0).round() / 8.0))
            .collect();
        let mut d = vec![f32::NAN; m * n];
        cutlass_sys::sm90_bf16_gemm_host(m, n, k, &a, &b, &mut d, 0).expect("sm90 gemm");
        let (want, _) = reference(m, n, k, &a, &b);
        let bad = d
            .iter()
            .zip(&want)
            .filter(|(g, w)| **g as f64 != **w)
            .count();
        assert_eq!(
            bad,
            0,
            "{m}x{n}x{k}: {bad} of {} outputs differ from the exact sum",
            m * n
        );
        println!("exact {m}x{n}x{k}: all {} outputs equal the CPU sum", m * n);
    }

    // 2. General BF16 data: f32 accumulation error bound.
    let (m, n, k) = (192, 320, 2048);
    let a: Vec<u16> = (0..m * k).map(|_| bf16_bits(rng.unit())).collect();
    let b: Vec<u16> = (0..n * k).map(|_| bf16_bits(rng.unit())).collect();
    let mut d = vec![f32::NAN; m * n];
    cutlass_sys::sm90_bf16_gemm_host(m, n, k, &a, &b, &mut d, 0).expect("sm90 gemm");
    let (want, abs) = reference(m, n, k, &a, &b);
    let worst = d
        .iter()
        .zip(want.iter().zip(&abs))
        .map(|(g, (w, t))| (*g as f64 - w).abs() / t.max(1e-30))
        .fold(0f64, f64::max);
    println!("random {m}x{n}x{k}: max |err| / sum|a*b| = {worst:.2e}");
    assert!(
        worst < (k as f64) * f32::EPSILON as f64,
        "f32 accumulation bound: {worst:e}"
    );

    // 3. Timing (the cuBLAS comparison is the torch line in docs/NVFP4.md).
    for &(m, n, k) in &[
        (512, 4096, 4096),
        (2048, 4096, 4096),
        (4096, 4096, 4096),
        (8192, 8192, 8192),
    ] {
        let a: Vec<u16> = (0..m * k).map(|_| bf16_bits(rng.unit())).collect();
        let b: Vec<u16> = (0..n * k).map(|_| bf16_bits(rng.unit())).collect();
        let mut d = vec![0f32; m * n];
        let ms = cutlass_sys::sm90_bf16_gemm_host(m, n, k, &a, &b, &mut d, 20)
            .expect("sm90 gemm")
            .expect("timed");
        let tflops = 2.0 * m as f64 * n as f64 * k as f64 / (ms as f64 * 1e-3) / 1e12;
        println!("cutlass sm90 bf16 gemm {m}x{n}x{k}: {ms:.3} ms, {tflops:.0} TFLOP/s (f32 out)");
    }

    // 4. The SM120 entry refuses this GPU with a clear error, before launching.
    let (m, n, k) = (128, 128, 128);
    let fp4 = vec![0x22u8; m * k / 2];
    let sf = vec![0x38u8; m * k / 16];
    let mut d = vec![0f32; m * n];
    let err = cutlass_sys::sm120_nvfp4_gemm_host(m, n, k, &fp4, &sf, &fp4, &sf, 1.0, &mut d, 0)
        .unwrap_err();
    println!("sm120 entry on {cc}: {err}");
    assert!(
        matches!(&err, Error::UnsupportedArch { message } if message.contains("sm_120a only") && message.contains("sm_90")),
        "{err}"
    );
    // SAFETY: null pointers are rejected before use.
    let err = unsafe {
        cutlass_sys::sm120_nvfp4_gemm(
            m,
            n,
            k,
            std::ptr::null(),
            std::ptr::null(),
            std::ptr::null(),
            std::ptr::null(),
            1.0,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        )
    }
    .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
}
