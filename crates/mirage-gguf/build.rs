//! Sets `cfg(mirage_avx512)` when the compiler has stable AVX-512
//! intrinsics and target features (Rust 1.89 or newer): the Q8_0 AVX-512
//! VNNI kernels are built only then, so the crate still builds, without
//! them, on the workspace's older minimum Rust version.

use std::process::Command;

fn main() {
    println!("cargo:rustc-check-cfg=cfg(mirage_avx512)");
    println!("cargo:rerun-if-env-changed=RUSTC");
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    // "rustc 1.95.0 (<commit> <date>)" -> (1, 95)
    let version = Command::new(rustc)
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|v| {
            let mut parts = v.split_whitespace().nth(1)?.split('.');
            Some((
                parts.next()?.parse::<u32>().ok()?,
                parts.next()?.parse::<u32>().ok()?,
            ))
        });
    if matches!(version, Some((major, minor)) if major > 1 || minor >= 89) {
        println!("cargo:rustc-cfg=mirage_avx512");
    }
}
