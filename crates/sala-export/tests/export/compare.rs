//! `compare_checkpoints` on written fixtures: identical, one code changed, one linear dense.

use crate::common;

use common::*;
use sala_export::compare::compare_checkpoints;
use sala_export::Checkpoint;

const CHANGED: &str = "model.layers.1.mlp.up_proj";
const DENSE: &str = "model.layers.0.self_attn.o_proj";

#[test]
fn identical_checkpoints_agree_everywhere() {
    let root = tempfile::tempdir().unwrap();
    let a = root.path().join("a");
    write_fixture(&a, Format::Gptq, &[], |_, _| {});
    let ck = Checkpoint::open(&a).unwrap();
    let c = compare_checkpoints(&ck, &ck, |_| true).unwrap();
    assert!(c.same_linears());
    assert_eq!(c.linears.len(), 2 * LINEARS.len());
    for l in &c.linears {
        assert_eq!(l.equal_codes, Some(l.weights), "{}", l.module);
        assert_eq!(
            (l.max_code_difference, l.relative_weight_difference),
            (Some(0), 0.0)
        );
        assert_eq!(l.max_scale_relative_difference, Some(0.0));
    }
    let (equal, total) = c.equal_total();
    assert_eq!(equal, total);
}

#[test]
fn a_changed_code_and_a_dense_linear_are_found() {
    let root = tempfile::tempdir().unwrap();
    let (a, b) = (root.path().join("a"), root.path().join("b"));
    write_fixture(&a, Format::Gptq, &[], |_, _| {});
    write_fixture(&b, Format::Gptq, &[DENSE], |module, linear| {
        if let (CHANGED, Linear::Gptq(p)) = (module, linear) {
            // Code 0 of row 0 moves by one step (4-bit codes, 8 per word, lowest bits first).
            let code = p.qweight[0] & 0xF;
            p.qweight[0] = (p.qweight[0] & !0xF) | if code == 0 { 1 } else { code - 1 };
        }
    });
    let (ck_a, ck_b) = (Checkpoint::open(&a).unwrap(), Checkpoint::open(&b).unwrap());
    let c = compare_checkpoints(&ck_a, &ck_b, |_| true).unwrap();
    assert_eq!(c.only_in_first, [DENSE]);
    assert!(c.only_in_second.is_empty() && c.format_mismatch.is_empty());
    assert!(!c.same_linears());
    for l in &c.linears {
        if l.module == CHANGED {
            assert_eq!(l.equal_codes, Some(l.weights - 1));
            assert_eq!(l.max_code_difference, Some(1));
            assert!(l.relative_weight_difference > 0.0);
            assert!(l.equal_fraction() < 1.0);
        } else {
            assert_eq!(l.equal_codes, Some(l.weights), "{}", l.module);
        }
    }
    // A selection leaves the rest out, the dense linear included.
    let layer1 = compare_checkpoints(&ck_a, &ck_b, |m| m.starts_with("model.layers.1.")).unwrap();
    assert!(layer1.same_linears());
    assert_eq!(layer1.linears.len(), LINEARS.len());
}
