//! AVX2+FMA dot kernels (x86_64), chosen at run time.

use crate::types::GgmlType;

/// Whether this CPU runs the kernels here.
pub(crate) fn available() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
}

/// The AVX2 kernel for `ty`, if one exists. Callers check [`available`].
pub(crate) fn dot_fn(ty: GgmlType) -> Option<super::DotFn> {
    let _ = ty;
    None
}
