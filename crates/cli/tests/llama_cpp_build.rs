//! `scripts/build_llama_cpp.sh` (llama.cpp's own C++ tools, the speed baseline) refuses cleanly: with no compiler,
//! no cmake or no source archive it exits 2 with one line naming what is missing and how to get it, and builds
//! nothing. The build itself is not run here (minutes of compiling; the closing notes give its measured use).

use std::path::{Path, PathBuf};
use std::process::Command;

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/build_llama_cpp.sh")
}

/// A fresh folder to use as the whole PATH: links to the few real programs the script needs before its checks
/// (and to `more_real` ones), plus fake `g++`/`cmake` when asked.
fn sandbox(name: &str, fakes: &[&str], more_real: &[&str]) -> (PathBuf, PathBuf) {
    let root = std::env::temp_dir().join(format!("specee-llama-build-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let bin = root.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    for real in ["bash", "dirname", "mkdir", "tr", "grep"].iter().chain(more_real) {
        let found = ["/usr/bin", "/bin"].iter().map(|d| Path::new(d).join(real)).find(|p| p.exists());
        let found = found.unwrap_or_else(|| panic!("{real} not found in /usr/bin or /bin"));
        std::os::unix::fs::symlink(found, bin.join(real)).unwrap();
    }
    for fake in fakes {
        let p = bin.join(fake);
        std::fs::write(&p, "#!/bin/sh\nexit 0\n").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    (root, bin)
}

/// Whether the script left a source tree (finished or half-unpacked) under `work`.
fn unpacked(work: &Path) -> bool {
    work.join("llama.cpp-0.3.36").exists() || work.join("llama.cpp-0.3.36.tmp").exists()
}

/// Runs the script with only `bin` on PATH; returns its exit code, stderr and whether it unpacked anything.
fn run_in(root: &Path, bin: &Path, archive: Option<&Path>) -> (i32, String, bool) {
    let work = root.join("vendor");
    let mut cmd = Command::new(bin.join("bash"));
    cmd.arg(script()).env_clear().env("PATH", bin).env("LLAMA_CPP_DIR", &work);
    if let Some(a) = archive {
        cmd.env("LLAMA_CPP_ARCHIVE", a);
    }
    let out = cmd.output().unwrap();
    assert!(out.stdout.is_empty(), "printed tool paths although it built nothing");
    let result = (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stderr).into_owned(), unpacked(&work));
    let _ = std::fs::remove_dir_all(root);
    result
}

fn run(name: &str, fakes: &[&str], archive: Option<&str>) -> (i32, String, bool) {
    let (root, bin) = sandbox(name, fakes, &[]);
    run_in(&root, &bin, archive.map(Path::new))
}

#[test]
fn refuses_without_a_compiler() {
    let (code, err, _) = run("no-cc", &["cmake"], None);
    assert_eq!(code, 2, "{err}");
    assert_eq!(err.trim(), "build_llama_cpp: no C++ compiler on PATH (install one: apt-get install g++)");
}

#[test]
fn refuses_without_cmake() {
    let (code, err, _) = run("no-cmake", &["g++"], None);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.trim().starts_with("build_llama_cpp: cmake is not on PATH (install it: apt-get install cmake"),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}

#[test]
fn refuses_without_the_source_archive() {
    let (code, err, unpacked) = run("no-archive", &["g++", "cmake"], Some("/nonexistent/llama_cpp_python.tar.gz"));
    assert_eq!(code, 2, "{err}");
    assert!(
        err.trim().starts_with("build_llama_cpp: source archive /nonexistent/llama_cpp_python.tar.gz does not exist"),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(!unpacked, "unpacked something without an archive");
}

#[test]
fn refuses_an_archive_that_is_not_llama_cpp_python() {
    // tar and gzip look inside the archive; rm and mv tidy up.
    let (root, bin) = sandbox("bad-archive", &["g++", "cmake"], &["tar", "gzip", "rm", "mv"]);
    let bogus = root.join("bogus.tar.gz");
    std::fs::write(&bogus, b"not a tar file").unwrap();
    let (code, err, unpacked) = run_in(&root, &bin, Some(&bogus));
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("not a llama-cpp-python 0.3.36 source archive?"), "{err}");
    assert!(!unpacked, "left a half-unpacked source tree");
}
