//! GGUF bytes through the parser. Whatever parses must expose in-bounds
//! tensor data and rewrite (GgufWriter::from_gguf) to a file that parses
//! back to the same tensors and rewrites to the same bytes again. Compared
//! as rewritten bytes: a NaN metadata value is not equal to itself.

use mirage_gguf::{GgufFile, GgufWriter};

use crate::{Rng, Target};

pub fn target() -> Target {
    Target {
        name: "gguf_parse",
        about: "GGUF bytes through the parser; whatever parses rewrites to itself",
        seeds: || vec![crate::structure::tiny_model().to_bytes().unwrap()],
        run,
        mutate: Some(mutate),
        dictionary: &[b"GGUF", b"general.alignment", b"tokenizer.ggml.tokens", b"\x03\x00\x00\x00"],
        max_len: 1 << 16,
    }
}

fn mutate(data: &mut Vec<u8>, rng: &mut Rng) {
    let before = data.clone();
    if !crate::structure::mutate_gguf(data, rng) {
        *data = before;
        crate::mutate::havoc(data, &[], &[], 1 << 16, rng);
    }
}

fn run(data: &[u8]) {
    let Ok(f) = GgufFile::from_bytes(data.to_vec()) else {
        return;
    };
    for (_, v) in f.metadata().iter() {
        let _ = v.as_u64();
    }
    for v in f.tensor_views() {
        assert_eq!(v.data.len() as u64, v.info.n_bytes());
        std::hint::black_box(v.data.first());
    }
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
            assert_eq!(
                (&a.info.name, &a.info.dims, a.info.ty),
                (&b.info.name, &b.info.dims, b.info.ty)
            );
            assert_eq!(a.data, b.data);
        }
        let mut twice = Vec::new();
        GgufWriter::from_gguf(&g).write_to(&mut twice).unwrap();
        assert!(once == twice, "rewrite is not idempotent");
    }
}
