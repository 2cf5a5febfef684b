//! Fuzz target: arbitrary bytes through the GGUF parser. Whatever parses
//! must expose in-bounds tensor data and rewrite to a file that parses back
//! to the same content (compared as rewritten bytes, since NaN metadata
//! values are not equal to themselves; offsets are compared after rewrite
//! because the writer lays tensors out densely).
#![no_main]

use libfuzzer_sys::fuzz_target;
use mirage_gguf::{GgufFile, GgufWriter};

fuzz_target!(|data: &[u8]| {
    let Ok(f) = GgufFile::from_bytes(data.to_vec()) else { return };
    for v in f.tensor_views() {
        assert_eq!(v.data.len() as u64, v.info.n_bytes());
        std::hint::black_box(v.data.first());
    }
    let _ = f.hparams();
    // A tensor-less file may declare a huge alignment without holding the
    // padding; rewriting it would (correctly) write that padding.
    if f.alignment() > 1 << 20 {
        return;
    }
    let mut once = Vec::new();
    if GgufWriter::from_gguf(&f).write_to(&mut once).is_ok() {
        let g = GgufFile::from_bytes(once.clone()).expect("rewritten file must parse");
        assert_eq!(g.metadata().len(), f.metadata().len());
        for (a, b) in f.tensor_views().zip(g.tensor_views()) {
            assert_eq!((&a.info.name, &a.info.dims, a.info.ty), (&b.info.name, &b.info.dims, b.info.ty));
            assert_eq!(a.data, b.data);
        }
        let mut twice = Vec::new();
        GgufWriter::from_gguf(&g).write_to(&mut twice).unwrap();
        assert!(once == twice, "rewrite is not idempotent");
    }
});
