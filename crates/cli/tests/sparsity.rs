//! `specee sparsity fit|curve|plot` on SmolLM2 (issue #39's ceiling tool): a fitted file reaches the sparsity it
//! was fitted for on other text, zero sparsity is dense exactly, more sparsity costs perplexity, a file made for
//! another model (or not made by `fit`) is a one-line error, and the plot is written.

mod common;

use common::*;
use serde_json::Value;
use std::time::Duration;

#[test]
fn fit_curve_and_plot_on_smollm2_and_another_models_file_is_one_line() {
    let dir = std::env::temp_dir().join(format!("specee-sparsity-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let smol = smollm2();
    let smol = smol.to_str().unwrap();
    let text = reference_dir().join("perplexity-text.txt");
    let text = text.to_str().unwrap();
    // Calibrate on the second half of the reference text, measure on its first chunks: apart, as in real use.
    let full = std::fs::read_to_string(text).unwrap();
    let calib = dir.join("calib.txt");
    std::fs::write(&calib, &full[full.len() / 2..]).unwrap();
    let file = dir.join("smol.act.safetensors");
    let (calib, file_s) = (calib.to_str().unwrap(), file.to_str().unwrap());
    let o = specee(
        &["sparsity", "fit", "-m", smol, "--calib", calib, "--out", file_s, "--chunks", "4", "-t", "2"],
        Duration::from_secs(300),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("(1024 tokens recorded)"), "{}", stdout(&o));

    let o = specee(
        &[
            "sparsity", "curve", "-m", smol, "--file", file_s, "--text", text, "--levels", "0,0.3", "--mix",
            "down=0.5", "--chunks", "1", "-t", "2", "--json",
        ],
        Duration::from_secs(300),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let c: Value = serde_json::from_str(&stdout(&o)).unwrap();
    let p = c["points"].as_array().unwrap();
    let num = |v: &Value| v.as_f64().unwrap();
    assert_eq!(num(&p[0]["agreement"]), 1.0, "no sparsity must be dense: {c}");
    assert_eq!(num(&p[0]["ppl"]), num(&c["ppl_dense"]), "{c}");
    assert_eq!(num(&p[0]["achieved"]), 0.0, "{c}");
    assert_eq!(num(&p[0]["bytes_ceiling"]), 1.0, "{c}");
    let achieved = num(&p[1]["achieved"]);
    assert!((0.2..0.4).contains(&achieved), "fitted for 30%, reached {achieved}: {c}");
    assert!(num(&p[1]["ppl"]) != num(&c["ppl_dense"]) && num(&p[1]["agreement"]) < 1.0, "{c}");
    assert!(num(&p[1]["bytes_ceiling"]) > 1.1, "{c}");
    // Two rows skip only the columns zero in both: fewer than one row skips.
    assert!(num(&p[1]["rows_union"]["2"]) < achieved, "{c}");
    // The --mix point sparsifies only the down product's input, at its own share.
    let mix = &p[2]["per_site"];
    assert_eq!((num(&mix["qkv"]), num(&mix["o"]), num(&mix["gate_up"])), (0.0, 0.0, 0.0), "{c}");
    assert!((0.4..0.6).contains(&num(&mix["down"])), "{c}");
    assert_eq!(num(&p[2]["target"]["down"]), 0.5, "{c}");
    let curve = dir.join("smol.curve.json");
    std::fs::write(&curve, stdout(&o)).unwrap();

    let png = dir.join("curves.png");
    let o = specee(&["sparsity", "plot", png.to_str().unwrap(), curve.to_str().unwrap()], Duration::from_secs(60));
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(std::fs::read(&png).unwrap().starts_with(b"\x89PNG"));

    // Block sparsity needs no file: no share is dense; half of the down input's blocks of 32 are zeroed exactly
    // (24 of 48 per row), in position order or grouped by channel magnitude on the calibration text.
    for permute in [&[][..], &["--permute", calib][..]] {
        let args: Vec<&str> = [
            "sparsity", "curve", "-m", smol, "--blocks", "32", "--text", text, "--levels", "0,0.5", "--sites", "down",
            "--chunks", "1", "-t", "2", "--json",
        ]
        .iter()
        .chain(permute)
        .copied()
        .collect();
        let o = specee(&args, Duration::from_secs(300));
        assert!(o.status.success(), "{permute:?}: {}", stderr(&o));
        let c: Value = serde_json::from_str(&stdout(&o)).unwrap();
        let p = c["points"].as_array().unwrap();
        assert_eq!((num(&p[0]["agreement"]), num(&p[0]["ppl"])), (1.0, num(&c["ppl_dense"])), "{c}");
        assert_eq!(num(&p[1]["per_site"]["down"]), 0.5, "{c}");
        assert_eq!(num(&p[1]["per_site"]["qkv"]), 0.0, "{c}");
        assert!(num(&p[1]["ppl"]) > num(&c["ppl_dense"]), "{c}");
        assert_eq!(c["blocks"], 32, "{c}");
    }

    // SmolLM2's file on Gemma; a file that `fit` did not write; a bad level; an unknown site.
    let gemma = gemma3();
    let draft = workspace_root().join("heads/SmolLM2-135M-Instruct.Q4_1.draft.safetensors");
    let cases: [(&[&str], &str); 5] = [
        (&["-m", gemma.to_str().unwrap(), "--file", file_s], "was made for SmolLM2-135M-Instruct.Q4_1.gguf"),
        (&["-m", smol, "--file", draft.to_str().unwrap()], "not made by `specee sparsity fit`"),
        (&["-m", smol, "--file", file_s, "--levels", "1.5"], "--levels: 1.5 is not a share in [0, 1)"),
        (&["-m", smol, "--file", file_s, "--sites", "ffn"], "unknown matrix input 'ffn'"),
        (&["-m", smol, "--file", file_s, "--mix", "down"], "--mix: 'down' is not NAME=SHARE"),
    ];
    for (extra, want) in cases {
        let args: Vec<&str> =
            ["sparsity", "curve", "--text", text, "--chunks", "1"].iter().chain(extra).copied().collect();
        let o = specee(&args, Duration::from_secs(120));
        let err = stderr(&o);
        assert!(!o.status.success(), "{extra:?} ran: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{extra:?}: {err}");
        assert!(err.starts_with("error: ") && err.contains(want), "{extra:?}: {err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
