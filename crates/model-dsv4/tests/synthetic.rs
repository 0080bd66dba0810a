//! The synthetic DeepSeek-V4-Flash (`cortiq bench model --synthetic deepseek-v4-flash`) against
//! the published size of the release: 284 B parameters, 13 B active per token (DeepSeek's
//! model card; reference-arch.md §1.2), and its layer schedule from the release config.json.

use model_dsv4::AttnKind;
use model_dsv4::synthetic::{Synthetic, release_config};
use quant_codecs::DType;

#[test]
fn the_release_geometry_has_the_published_parameter_counts() {
    // bf16 everywhere: two bytes per parameter, so bytes count parameters.
    let s = Synthetic::new(
        &release_config(43, 256),
        Box::new(|_, _, _| DType::BF16),
        0.0,
        0,
    )
    .unwrap();
    let w = s.weights().unwrap();
    let c = &s.config;
    let kinds: Vec<AttnKind> = (0..43).map(|il| c.attn_kind(il)).collect();
    assert_eq!(
        &kinds[..4],
        &[
            AttnKind::Sliding,
            AttnKind::Sliding,
            AttnKind::Csa,
            AttnKind::Hca
        ]
    );
    assert_eq!(kinds.iter().filter(|&&k| k == AttnKind::Csa).count(), 21);
    assert_eq!(kinds.iter().filter(|&&k| k == AttnKind::Hca).count(), 20);
    let hash = (0..43).filter(|&il| c.is_hash_layer(il)).count();
    assert_eq!(hash, 3);

    let embed = w.embed_tokens.bytes().len() as f64 / 2.0;
    let all_experts = w.bytes_per_token(256) as f64 / 2.0;
    let active = w.bytes_per_token(6) as f64 / 2.0;
    let total = all_experts + embed;
    eprintln!(
        "total {:.2} B, active {:.2} B (+ embedding {:.2} B)",
        total / 1e9,
        active / 1e9,
        embed / 1e9
    );
    assert!(
        (total / 284e9 - 1.0).abs() < 0.01,
        "total {total:.4e} is not 284 B"
    );
    // "13 B active" is rounded: the embedding's row is not read, lm_head is.
    assert!(
        (12.5e9..14.0e9).contains(&(active + embed)),
        "active {active:.4e}"
    );
}
