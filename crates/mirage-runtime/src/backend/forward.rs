//! Forwarding of [`Backend`](super::Backend) ops for backends that wrap
//! another one (the activation-sparse and page-sparse backends run their
//! own FFN and hand every other op to the dense backend inside them).

/// Inside `impl Backend for W`, where `W` holds the backend it wraps in
/// field `$inner` and uses its vector, activation and KV cache types: its
/// thread pool (`run`), the vector upload, the KV cache ops, the activation
/// buffer, RMSNorm, bias and residual adds, attention, row selection and
/// read-back, each forwarded to `self.$inner`. With
/// `, matrices` also the step, the matrix upload, the products and the
/// embedding lookup (for wrappers that use the inner backend's matrix type
/// as well).
#[macro_export]
macro_rules! forward_backend_ops {
    ($inner:ident) => {
        fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
            self.$inner.run(f)
        }
        fn upload_vector(&self, v: &[f32]) -> $crate::Result<Self::Vector> {
            self.$inner.upload_vector(v)
        }
        fn new_kv_cache(&self, spec: $crate::kv_cache::KvSpec) -> $crate::Result<Self::KvCache> {
            self.$inner.new_kv_cache(spec)
        }
        fn new_kv_cache_pruned(
            &self,
            spec: $crate::kv_cache::KvSpec,
            pruning: Option<$crate::KvPruning>,
        ) -> $crate::Result<Self::KvCache> {
            self.$inner.new_kv_cache_pruned(spec, pruning)
        }
        fn kv_set_pruning(
            &self,
            cache: &mut Self::KvCache,
            pruning: Option<$crate::KvPruning>,
        ) -> $crate::Result<()> {
            self.$inner.kv_set_pruning(cache, pruning)
        }
        fn kv_truncate(&self, cache: &mut Self::KvCache, seq: usize, pos: usize) {
            self.$inner.kv_truncate(cache, seq, pos)
        }
        fn new_activations(&self) -> Self::Activations {
            self.$inner.new_activations()
        }
        fn rms_norm(
            &self,
            x: &Self::Activations,
            weight: &Self::Vector,
            eps: f32,
            out: &mut Self::Activations,
        ) -> $crate::Result<()> {
            self.$inner.rms_norm(x, weight, eps, out)
        }
        fn add_bias(&self, x: &mut Self::Activations, bias: &Self::Vector) -> $crate::Result<()> {
            self.$inner.add_bias(x, bias)
        }
        fn add(&self, acc: &mut Self::Activations, x: &Self::Activations) -> $crate::Result<()> {
            self.$inner.add(acc, x)
        }
        fn attention(
            &self,
            layer: usize,
            params: &$crate::backend::AttentionParams,
            q: &mut Self::Activations,
            k: &mut Self::Activations,
            v: &Self::Activations,
            qk_norm: Option<$crate::backend::QkNorm<'_, Self::Vector>>,
            slots: &[$crate::TokenSlot],
            cache: &mut Self::KvCache,
            out: &mut Self::Activations,
        ) -> $crate::Result<()> {
            self.$inner
                .attention(layer, params, q, k, v, qk_norm, slots, cache, out)
        }
        fn select_rows(
            &self,
            x: &Self::Activations,
            rows: &[usize],
            out: &mut Self::Activations,
        ) -> $crate::Result<()> {
            self.$inner.select_rows(x, rows, out)
        }
        fn read(
            &self,
            x: &Self::Activations,
            out: &mut Vec<f32>,
        ) -> $crate::Result<(usize, usize)> {
            self.$inner.read(x, out)
        }
    };
    ($inner:ident, matrices) => {
        $crate::forward_backend_ops!($inner);
        fn step<R>(
            &self,
            inputs: &$crate::backend::StepInputs<'_>,
            pass: impl FnOnce() -> $crate::Result<R>,
        ) -> $crate::Result<R> {
            self.$inner.step(inputs, pass)
        }
        fn upload_matrix(&self, m: &$crate::backend::HostMatrix) -> $crate::Result<Self::Matrix> {
            self.$inner.upload_matrix(m)
        }
        fn embed(
            &self,
            table: &Self::Matrix,
            tokens: &[u32],
            out: &mut Self::Activations,
        ) -> $crate::Result<()> {
            self.$inner.embed(table, tokens, out)
        }
        fn matmul(
            &self,
            w: &Self::Matrix,
            x: &Self::Activations,
            out: &mut Self::Activations,
        ) -> $crate::Result<()> {
            self.$inner.matmul(w, x, out)
        }
        fn matmul_many(
            &self,
            ws: &[&Self::Matrix],
            x: &Self::Activations,
            outs: &mut [&mut Self::Activations],
        ) -> $crate::Result<()> {
            self.$inner.matmul_many(ws, x, outs)
        }
    };
}
