//! The sparse FFN inside recorded steps: the routed FFN replayed from a CUDA
//! graph, and what folds into it (the residual add, the RMSNorm before it,
//! no router launch for an all-trunk layer), bit for bit against op-by-op
//! launches.

use mirage_cuda::{RouteTraversal, SparseCudaBackend, SparsePages};
use mirage_runtime::backend::{Backend, StepInputs, TokenSlot};

use crate::common::{bits_differ, rng};
use crate::fixture::{
    artifact_with_trunks, fixture, run_ffn, sparse, xs, Fixture, D, N_FF, N_LAYER, N_PAGES,
};

#[test]
fn routed_ffn_replays_from_a_cuda_graph() {
    let fx = fixture();
    let margin = fx.artifact.meta().default_margin;
    let mode = SparsePages::Routed {
        margin,
        traversal: RouteTraversal::Auto,
    };
    let Some((sb, ffns)) = sparse("routed_ffn_replays_from_a_cuda_graph", &fx, mode) else {
        return;
    };
    let inputs = xs(4, 6);
    let mut x = sb.new_activations();
    let (mut h, mut y) = (sb.new_activations(), sb.new_activations());
    let step = one_token_step();
    let mut counts = std::collections::BTreeSet::new();
    for xi in &inputs {
        // Eager reference.
        let want = run_ffn(&sb, &ffns[1], &[sb_layer0(&sb, &ffns[0], xi)]);
        // Two chained layers inside one recorded step.
        sb.inner().write_activations(&mut x, 1, D, xi).unwrap();
        sb.step(&step, || {
            sb.ffn(&ffns[0], &x, &mut h)?;
            sb.ffn(&ffns[1], &h, &mut y)
        })
        .unwrap();
        let mut got = Vec::new();
        sb.read(&y, &mut got).unwrap();
        assert_eq!(got, want, "graph replay vs eager launches");
        counts.insert(sb.active_counts().unwrap());
    }
    let st = sb.inner().graph_stats();
    eprintln!("graph stats {st:?}; per-layer active counts seen {counts:?}");
    assert_eq!(st.captures, 1, "one graph for every step: {st:?}");
    assert_eq!(st.replays as usize, inputs.len() - 1);
    assert!(
        counts.len() >= 2,
        "the routed counts must vary between steps: {counts:?}"
    );
}

/// The residual add after a sparse FFN, folded into the FFN's last phase
/// inside a recorded step (`y = FFN(x) + residual` in the ordered finish),
/// equals the FFN then `add_inplace` op by op (two phase launches) bit for
/// bit, forced and routed, and the graph holds no add launch (phase 1 +
/// phase 2, + the router), captured once and replayed.
#[test]
fn residual_add_folds_into_the_sparse_ffn() {
    let fx = fixture();
    let routed = routed_mode(&fx);
    for (mode, launches) in [(SparsePages::Fraction(0.5), 2usize), (routed, 3)] {
        let Some((sb, ffns)) = sparse("residual_add_folds_into_the_sparse_ffn", &fx, mode) else {
            return;
        };
        let inputs = xs(7, 4);
        let residuals = xs(8, 4);
        let mut x = sb.new_activations();
        let mut res = sb.new_activations();
        let mut h = sb.new_activations();
        let step = one_token_step();
        for (xi, ri) in inputs.iter().zip(&residuals) {
            // Op by op: ffn, then add_inplace.
            sb.inner().write_activations(&mut x, 1, D, xi).unwrap();
            sb.inner().write_activations(&mut res, 1, D, ri).unwrap();
            sb.ffn(&ffns[0], &x, &mut h).unwrap();
            sb.add(&mut res, &h).unwrap();
            let mut want = Vec::new();
            sb.read(&res, &mut want).unwrap();
            // Recorded: the add folds into the FFN's last launch.
            sb.inner().write_activations(&mut res, 1, D, ri).unwrap();
            sb.step(&step, || {
                sb.ffn(&ffns[0], &x, &mut h)?;
                sb.add(&mut res, &h)
            })
            .unwrap();
            let mut got = Vec::new();
            sb.read(&res, &mut got).unwrap();
            assert_eq!(
                bits_differ(&got, &want),
                0,
                "{mode:?}: folded add vs ffn + add_inplace"
            );
        }
        let n = sb.inner().last_graph_launches();
        let st = sb.inner().graph_stats();
        eprintln!("{mode:?}: recorded step of {n} launches, folded add == op by op; {st:?}");
        assert_eq!(n, launches, "{mode:?}: launches in the recorded step");
        assert_eq!(st.captures, 1, "{mode:?}: one graph, replayed: {st:?}");
    }
}

/// In a recorded step the RMSNorm before a routed sparse FFN folds into the
/// router (it reads the norm's output first): the same bits as the separate
/// `rms_norm` launch (norm.cu's one row function at 256 threads both), the
/// norm's output buffer still written, the same active lists, 3 launches
/// (router, phase 1, phase 2). Before a forced-mode FFN it stays a launch of
/// its own (3: norm, phase 1, phase 2), the same bits.
#[test]
fn ffn_norm_folds_into_the_router() {
    let fx = fixture();
    let routed = routed_mode(&fx);
    for (mode, launches) in [(SparsePages::Fraction(0.5), 3usize), (routed, 3)] {
        let Some((sb, ffns)) = sparse("ffn_norm_folds_into_the_router", &fx, mode) else {
            return;
        };
        let case = format!("{mode:?}");
        let norm_w = sb.upload_vector(&xs(9, 1)[0]).unwrap();
        let inputs = xs(10, 4);
        let mut x = sb.new_activations();
        let mut xn = sb.new_activations();
        let mut h = sb.new_activations();
        let step = one_token_step();
        for xi in &inputs {
            // Op by op: rms_norm, then the FFN.
            sb.inner().write_activations(&mut x, 1, D, xi).unwrap();
            sb.rms_norm(&x, &norm_w, 1e-6, &mut xn).unwrap();
            sb.ffn(&ffns[0], &xn, &mut h).unwrap();
            let (mut want, mut want_n) = (Vec::new(), Vec::new());
            sb.read(&h, &mut want).unwrap();
            sb.read(&xn, &mut want_n).unwrap();
            let want_pages = sb.active_pages(0).unwrap();
            // Recorded: the norm folds into the router.
            sb.inner()
                .write_activations(&mut xn, 1, D, &vec![0.0; D])
                .unwrap();
            sb.step(&step, || {
                sb.rms_norm(&x, &norm_w, 1e-6, &mut xn)?;
                sb.ffn(&ffns[0], &xn, &mut h)
            })
            .unwrap();
            let (mut got, mut got_n) = (Vec::new(), Vec::new());
            sb.read(&h, &mut got).unwrap();
            sb.read(&xn, &mut got_n).unwrap();
            assert_eq!(
                bits_differ(&got, &want),
                0,
                "{case}: recorded norm + FFN vs rms_norm + FFN"
            );
            assert_eq!(
                bits_differ(&got_n, &want_n),
                0,
                "{case}: the norm's output buffer"
            );
            assert_eq!(
                sb.active_pages(0).unwrap(),
                want_pages,
                "{case}: active pages"
            );
        }
        let n = sb.inner().last_graph_launches();
        eprintln!("{case}: recorded step of {n} launches, == op by op");
        assert_eq!(n, launches, "{case}: launches in the recorded step");
    }
}

/// Routed mode over an artifact whose layer 0 is all trunk (the router can
/// only return every page) and whose layer 1 routes: layer 0 launches no
/// router, its list is every page, and the RMSNorm before it folds into the
/// FFN's phase 1 as it would have into the router (2 launches in a recorded
/// step); layer 1 is routed (3 launches). Both give the bits of rms_norm +
/// FFN op by op and the same lists.
#[test]
fn all_trunk_layers_launch_no_router() {
    let base = fixture();
    let mut r = rng(17);
    let identity: Vec<Vec<u32>> = vec![(0..N_FF as u32).collect(); N_LAYER];
    let artifact = artifact_with_trunks(&base.layers, &identity, N_PAGES, &[N_PAGES, 1], &mut r);
    let fx = Fixture {
        layers: base.layers,
        artifact,
    };
    let Some((sb, ffns)) = sparse("all_trunk_layers_launch_no_router", &fx, routed_mode(&fx))
    else {
        return;
    };
    let norm_w = sb.upload_vector(&xs(19, 1)[0]).unwrap();
    let step = one_token_step();
    let mut x = sb.new_activations();
    let mut xn = sb.new_activations();
    let mut h = sb.new_activations();
    for (layer, launches) in [(0usize, 2), (1, 3)] {
        let case = format!("layer {layer}");
        for xi in &xs(20 + layer as u64, 3) {
            sb.inner().write_activations(&mut x, 1, D, xi).unwrap();
            sb.rms_norm(&x, &norm_w, 1e-6, &mut xn).unwrap();
            sb.ffn(&ffns[layer], &xn, &mut h).unwrap();
            let mut want = Vec::new();
            sb.read(&h, &mut want).unwrap();
            let want_pages = sb.active_pages(layer).unwrap();
            if layer == 0 {
                assert_eq!(
                    want_pages,
                    (0..N_PAGES as u32).collect::<Vec<_>>(),
                    "{case}: every page"
                );
            }
            sb.inner()
                .write_activations(&mut xn, 1, D, &vec![0.0; D])
                .unwrap();
            sb.step(&step, || {
                sb.rms_norm(&x, &norm_w, 1e-6, &mut xn)?;
                sb.ffn(&ffns[layer], &xn, &mut h)
            })
            .unwrap();
            let mut got = Vec::new();
            sb.read(&h, &mut got).unwrap();
            assert_eq!(bits_differ(&got, &want), 0, "{case}: recorded vs op by op");
            assert_eq!(
                sb.active_pages(layer).unwrap(),
                want_pages,
                "{case}: active pages"
            );
        }
        let n = sb.inner().last_graph_launches();
        eprintln!("{case}: recorded step of {n} launches");
        assert_eq!(n, launches, "{case}: launches in the recorded step");
    }
}

/// One row, sequence 0, position 0: the step inputs of the tests that
/// record a single-token step around FFN ops.
fn one_token_step() -> StepInputs<'static> {
    static SLOTS: [TokenSlot; 1] = [TokenSlot { seq: 0, pos: 0 }];
    StepInputs {
        tokens: &[0],
        slots: &SLOTS,
        logits_rows: &[0],
    }
}

/// Routed mode at the fixture artifact's default margin.
fn routed_mode(fx: &Fixture) -> SparsePages {
    SparsePages::Routed {
        margin: fx.artifact.meta().default_margin,
        traversal: RouteTraversal::Auto,
    }
}

fn sb_layer0(sb: &SparseCudaBackend, f: &mirage_cuda::SparseFfn, x: &[f32]) -> Vec<f32> {
    run_ffn(sb, f, &[x.to_vec()])
}
