//! vmsight-image: the default guest image.
//!
//! The recipe (`guest/build-image.sh`, the initramfs and root-disk init scripts, the helper
//! programs in `guest/progs/`) is embedded in this crate; its hash names the image directory in
//! the cache (`$VMSIGHT_CACHE` or `~/.cache/vmsight`, then `images/<hash>/`, see
//! docs/layout-notes.md), so changing the recipe means a new image and an old vmsight keeps
//! finding its own. [`build`] runs the embedded script and then generates the kernel profile
//! with `vmsight_introspect::profile`.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use thiserror::Error;
use vmsight_introspect::profile::{self, GenerateError, KernelProfile, ProfileError};

include!(concat!(env!("OUT_DIR"), "/recipe_files.rs"));

/// Lines of build output kept for the error message of a failed build.
const ERROR_TAIL_LINES: usize = 30;

/// Errors of this crate.
#[derive(Debug, Error)]
pub enum ImageError {
    #[error("the guest image is not built (no {0}); run `vmsight image build`")]
    NotBuilt(PathBuf),
    #[error("the guest image in {dir} is incomplete ({file} is missing); run `vmsight image build --force`")]
    Incomplete { dir: PathBuf, file: &'static str },
    #[error("cannot find the cache directory: set VMSIGHT_CACHE or HOME")]
    NoCacheDir,
    #[error("building the guest image needs root (debootstrap, mknod, root-owned files); run `sudo vmsight image build`")]
    NotRoot,
    #[error("cannot {action} {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot lock {path} against concurrent builds: {source}")]
    Lock { path: PathBuf, source: Errno },
    #[error("cannot start bash for the image build: {0}")]
    Spawn(std::io::Error),
    #[error("the image build script failed ({status}). Last output:\n{tail}")]
    BuildFailed { status: ExitStatus, tail: String },
    #[error("{path} is not a valid image manifest: {source}")]
    Manifest {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("cannot create the kernel profile: {0}")]
    Generate(#[from] GenerateError),
    /// Reading, writing or using a profile (the message names the file).
    #[error(transparent)]
    Profile(#[from] ProfileError),
}

fn io_err<'a>(
    action: &'static str,
    path: &'a Path,
) -> impl FnOnce(std::io::Error) -> ImageError + 'a {
    move |source| ImageError::Io {
        action,
        path: path.to_path_buf(),
        source,
    }
}

/// Size and checksum of one image file, as recorded by the build script.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileInfo {
    pub size: u64,
    /// Bytes actually allocated (rootfs.img is sparse).
    #[serde(default)]
    pub allocated: u64,
    #[serde(default)]
    pub sha256: String,
}

/// `manifest.json` of an image, written by guest/build-image.sh.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: u32,
    pub recipe_hash: String,
    #[serde(default)]
    pub suite: String,
    /// `uname -r` of the guest kernel.
    pub kernel_version: String,
    #[serde(default)]
    pub kernel_package: String,
    #[serde(default)]
    pub kernel_package_version: String,
    #[serde(default)]
    pub busybox_version: String,
    /// UTC, RFC 3339.
    pub build_date: String,
    #[serde(default)]
    pub build_seconds: u64,
    #[serde(default)]
    pub files: BTreeMap<String, FileInfo>,
    /// Debian packages of the root file system: name → version.
    #[serde(default)]
    pub packages: BTreeMap<String, String>,
}

/// A built guest image in the cache.
#[derive(Debug, Clone)]
pub struct GuestImage {
    pub dir: PathBuf,
    pub kernel: PathBuf,
    pub initrd: PathBuf,
    pub rootfs: PathBuf,
    /// The kernel profile (`profile.json`, see `vmsight_introspect::profile`).
    pub profile: PathBuf,
    pub manifest: Manifest,
}

/// Summary of an image for `vmsight image info`.
#[derive(Debug, Clone, Serialize)]
pub struct ImageInfo {
    pub dir: PathBuf,
    pub recipe_hash: String,
    /// Whether the image was built from this vmsight's recipe.
    pub current: bool,
    pub kernel_version: String,
    pub kernel_package_version: String,
    pub build_date: String,
    pub build_seconds: u64,
    /// Apparent and allocated bytes per file.
    pub files: BTreeMap<String, FileInfo>,
    pub packages: usize,
    /// Symbols and structs in the kernel profile, if it loads.
    pub profile: Option<(usize, usize)>,
}

impl fmt::Display for ImageInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "image:    {}", self.dir.display())?;
        let cur = if self.current {
            "current recipe"
        } else {
            "NOT the current recipe"
        };
        writeln!(f, "recipe:   {} ({cur})", self.recipe_hash)?;
        writeln!(
            f,
            "kernel:   {} (Debian {})",
            self.kernel_version, self.kernel_package_version
        )?;
        writeln!(
            f,
            "built:    {} in {} s",
            self.build_date, self.build_seconds
        )?;
        writeln!(
            f,
            "packages: {} Debian packages in the root file system",
            self.packages
        )?;
        match self.profile {
            Some((syms, structs)) => writeln!(f, "profile:  {syms} symbols, {structs} structs")?,
            None => writeln!(f, "profile:  missing or unreadable")?,
        }
        write!(f, "files:")?;
        for (name, fi) in &self.files {
            write!(
                f,
                "\n  {name:<12} {:>10} (allocated {})",
                human(fi.size),
                human(fi.allocated)
            )?;
        }
        Ok(())
    }
}

fn human(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// The embedded recipe files: (path relative to guest/, content), sorted by path.
pub fn recipe_files() -> &'static [(&'static str, &'static [u8])] {
    RECIPE_FILES
}

/// SHA-256 over the files (path, length and content of each, in the given order), hex, first
/// 16 characters. The domain prefix keeps it distinct from any other hash of the same bytes.
fn hash_files(files: &[(&str, &[u8])]) -> String {
    let mut h = Sha256::new();
    h.update(b"vmsight-recipe-v1\0");
    for (path, content) in files {
        h.update(path.as_bytes());
        h.update([0]);
        h.update((content.len() as u64).to_le_bytes());
        h.update(content);
    }
    h.finalize()
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Hash of the embedded recipe: names the image directory in the cache.
pub fn recipe_hash() -> String {
    hash_files(RECIPE_FILES)
}

/// `$VMSIGHT_CACHE` (if set and not empty), else `$HOME/.cache/vmsight`.
fn cache_dir_from(cache: Option<OsString>, home: Option<OsString>) -> Result<PathBuf, ImageError> {
    match (cache, home) {
        (Some(c), _) if !c.is_empty() => Ok(PathBuf::from(c)),
        (_, Some(h)) if !h.is_empty() => Ok(PathBuf::from(h).join(".cache").join("vmsight")),
        _ => Err(ImageError::NoCacheDir),
    }
}

/// The vmsight cache directory (`$VMSIGHT_CACHE` or `~/.cache/vmsight`); not created here.
pub fn cache_dir() -> Result<PathBuf, ImageError> {
    cache_dir_from(std::env::var_os("VMSIGHT_CACHE"), std::env::var_os("HOME"))
}

/// Directory of the image of this recipe: `<cache>/images/<recipe-hash>`.
pub fn image_dir() -> Result<PathBuf, ImageError> {
    Ok(image_dir_in(&cache_dir()?))
}

fn image_dir_in(cache: &Path) -> PathBuf {
    cache.join("images").join(recipe_hash())
}

/// Opens the image of this recipe; an error tells the user to build it if it is missing.
pub fn default_image() -> Result<GuestImage, ImageError> {
    open(&image_dir()?)
}

/// Opens the image in `dir`. A missing or outdated `profile.json` is regenerated from the
/// image's own System.map, BTF and config (cheap, and profile format changes then need no
/// rebuild).
pub fn open(dir: &Path) -> Result<GuestImage, ImageError> {
    let manifest_path = dir.join("manifest.json");
    if !manifest_path.is_file() {
        return Err(ImageError::NotBuilt(dir.to_path_buf()));
    }
    for file in ["vmlinuz", "initrd.img", "rootfs.img"] {
        if !dir.join(file).is_file() {
            return Err(ImageError::Incomplete {
                dir: dir.to_path_buf(),
                file,
            });
        }
    }
    let text = fs::read_to_string(&manifest_path).map_err(io_err("read", &manifest_path))?;
    let manifest: Manifest =
        serde_json::from_str(&text).map_err(|source| ImageError::Manifest {
            path: manifest_path.clone(),
            source,
        })?;
    let profile = dir.join("profile.json");
    match KernelProfile::load(&profile) {
        Ok(_) => {}
        Err(ProfileError::Read { .. } | ProfileError::Format { .. }) => {
            write_profile(dir, &manifest)?;
        }
        Err(e) => return Err(e.into()),
    }
    Ok(GuestImage {
        dir: dir.to_path_buf(),
        kernel: dir.join("vmlinuz"),
        initrd: dir.join("initrd.img"),
        rootfs: dir.join("rootfs.img"),
        profile,
        manifest,
    })
}

/// Generates `profile.json` in `dir` from System.map, vmlinux.btf and config.
fn write_profile(dir: &Path, manifest: &Manifest) -> Result<KernelProfile, ImageError> {
    for file in ["System.map", "vmlinux.btf", "config"] {
        if !dir.join(file).is_file() {
            return Err(ImageError::Incomplete {
                dir: dir.to_path_buf(),
                file,
            });
        }
    }
    let mut p = profile::generate(
        &dir.join("System.map"),
        &dir.join("vmlinux.btf"),
        &dir.join("config"),
    )?;
    p.kernel_release = manifest.kernel_version.clone();
    p.save(&dir.join("profile.json"))?;
    Ok(p)
}

/// Summary of an image.
pub fn info(img: &GuestImage) -> ImageInfo {
    let profile = KernelProfile::load(&img.profile)
        .ok()
        .map(|p| (p.symbols.len(), p.structs.len()));
    ImageInfo {
        dir: img.dir.clone(),
        recipe_hash: img.manifest.recipe_hash.clone(),
        current: img.manifest.recipe_hash == recipe_hash(),
        kernel_version: img.manifest.kernel_version.clone(),
        kernel_package_version: img.manifest.kernel_package_version.clone(),
        build_date: img.manifest.build_date.clone(),
        build_seconds: img.manifest.build_seconds,
        files: img.manifest.files.clone(),
        packages: img.manifest.packages.len(),
        profile,
    }
}

/// Exclusive lock on `<images>/<hash>.lock`, held while building. Waits for another holder,
/// telling `progress` so.
fn lock_build(
    images: &Path,
    hash: &str,
    progress: &impl Fn(&str),
) -> Result<Flock<File>, ImageError> {
    let path = images.join(format!("{hash}.lock"));
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(io_err("open", &path))?;
    match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(l) => Ok(l),
        Err((file, Errno::EWOULDBLOCK)) => {
            progress(&format!(
                "waiting for another build of this image ({} is locked)",
                path.display()
            ));
            Flock::lock(file, FlockArg::LockExclusive)
                .map_err(|(_, source)| ImageError::Lock { path, source })
        }
        Err((_, source)) => Err(ImageError::Lock { path, source }),
    }
}

/// Writes the embedded recipe into `dir` (scripts executable).
fn write_recipe(dir: &Path) -> Result<(), ImageError> {
    for (rel, content) in RECIPE_FILES {
        let path = dir.join(rel);
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent).map_err(io_err("create", parent))?;
        }
        fs::write(&path, content).map_err(io_err("write", &path))?;
        let mode = if rel.ends_with(".c") || rel.ends_with(".h") {
            0o644
        } else {
            0o755
        };
        fs::set_permissions(&path, fs::Permissions::from_mode(mode))
            .map_err(io_err("chmod", &path))?;
    }
    Ok(())
}

/// Builds the image of this recipe into the cache (unless it exists and `force` is false) and
/// returns it. Runs the embedded build-image.sh as root, then generates the kernel profile;
/// everything lands in `<hash>.new` first and is renamed into place at the end, under a lock
/// so concurrent builds do not collide. `progress` gets one line per step.
pub fn build(force: bool, progress: impl Fn(&str)) -> Result<GuestImage, ImageError> {
    let images = cache_dir()?.join("images");
    let hash = recipe_hash();
    let dir = images.join(&hash);
    if !force {
        if let Ok(img) = open(&dir) {
            progress(&format!("image {hash} is already built"));
            return Ok(img);
        }
    }
    if !nix::unistd::geteuid().is_root() {
        return Err(ImageError::NotRoot);
    }
    fs::create_dir_all(&images).map_err(io_err("create", &images))?;
    let _lock = lock_build(&images, &hash, &progress)?;
    // Another process may have finished the same build while we waited for the lock.
    if !force {
        if let Ok(img) = open(&dir) {
            progress(&format!("image {hash} was built meanwhile"));
            return Ok(img);
        }
    }

    let recipe = tempfile::Builder::new()
        .prefix("vmsight-recipe-")
        .tempdir()
        .map_err(io_err(
            "create a temporary directory in",
            &std::env::temp_dir(),
        ))?;
    write_recipe(recipe.path())?;
    let staging = images.join(format!("{hash}.new"));
    if staging.exists() {
        // A finished but unpublished build; the script itself cleans up its own .tmp directory
        // (which may hold mount points of a crashed debootstrap).
        fs::remove_dir_all(&staging).map_err(io_err("remove", &staging))?;
    }

    progress(&format!("building image {hash} in {}", staging.display()));
    let mut child = Command::new("bash")
        .arg(recipe.path().join("build-image.sh"))
        .arg("--force")
        .arg(&staging)
        .env("VMSIGHT_RECIPE_HASH", &hash)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(ImageError::Spawn)?;
    let mut tail: Vec<String> = Vec::new();
    if let Some(stderr) = child.stderr.take() {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            progress(line.strip_prefix("[build-image] ").unwrap_or(&line));
            if tail.len() == ERROR_TAIL_LINES {
                tail.remove(0);
            }
            tail.push(line);
        }
    }
    let status = child
        .wait()
        .map_err(io_err("wait for", &recipe.path().join("build-image.sh")))?;
    if !status.success() {
        return Err(ImageError::BuildFailed {
            status,
            tail: tail.join("\n"),
        });
    }

    progress("generating the kernel profile");
    let manifest_path = staging.join("manifest.json");
    let text = fs::read_to_string(&manifest_path).map_err(io_err("read", &manifest_path))?;
    let manifest: Manifest =
        serde_json::from_str(&text).map_err(|source| ImageError::Manifest {
            path: manifest_path.clone(),
            source,
        })?;
    let p = write_profile(&staging, &manifest)?;
    progress(&format!(
        "kernel profile: {} symbols, {} structs, sizeof(task_struct) = {}",
        p.symbols.len(),
        p.structs.len(),
        p.struct_size("task_struct")?
    ));

    let old = images.join(format!("{hash}.old"));
    if dir.exists() {
        if old.exists() {
            fs::remove_dir_all(&old).map_err(io_err("remove", &old))?;
        }
        fs::rename(&dir, &old).map_err(io_err("move aside", &dir))?;
    }
    fs::rename(&staging, &dir).map_err(io_err("publish", &staging))?;
    if old.exists() {
        fs::remove_dir_all(&old).map_err(io_err("remove", &old))?;
    }
    progress(&format!("image ready: {}", dir.display()));
    open(&dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_is_stable() {
        // Fixed inputs, fixed output: changing hash_files would silently orphan every cache.
        let files: &[(&str, &[u8])] = &[("build-image.sh", b"echo hi\n"), ("init", b"#!/bin/sh\n")];
        assert_eq!(hash_files(files), "8c3d1aa1aec7675c");
        // Path and content boundaries are part of the hash.
        let moved: &[(&str, &[u8])] = &[("build-image.she", b"cho hi\n"), ("init", b"#!/bin/sh\n")];
        assert_ne!(hash_files(moved), hash_files(files));
    }

    #[test]
    fn recipe_hash_covers_the_recipe() {
        let h = recipe_hash();
        assert_eq!(h.len(), 16);
        assert!(h
            .chars()
            .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));
        assert_eq!(h, recipe_hash());
        let names: Vec<&str> = recipe_files().iter().map(|(n, _)| *n).collect();
        for needed in [
            "build-image.sh",
            "init",
            "initramfs-init",
            "progs/getppid_loop.c",
        ] {
            assert!(names.contains(&needed), "{needed} not embedded: {names:?}");
        }
        let mut sorted = names.clone();
        sorted.sort();
        assert_eq!(names, sorted);
    }

    #[test]
    fn cache_dir_resolution() {
        let some = |s: &str| Some(OsString::from(s));
        assert_eq!(
            cache_dir_from(some("/c"), some("/home/u")).ok(),
            Some(PathBuf::from("/c"))
        );
        assert_eq!(
            cache_dir_from(some(""), some("/home/u")).ok(),
            Some(PathBuf::from("/home/u/.cache/vmsight"))
        );
        assert_eq!(
            cache_dir_from(None, some("/root")).ok(),
            Some(PathBuf::from("/root/.cache/vmsight"))
        );
        assert!(matches!(
            cache_dir_from(None, None),
            Err(ImageError::NoCacheDir)
        ));
        assert_eq!(
            image_dir_in(Path::new("/c")),
            PathBuf::from(format!("/c/images/{}", recipe_hash()))
        );
    }

    #[test]
    fn missing_image_says_how_to_build() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let e = open(&tmp.path().join("nope")).expect_err("not built");
        assert!(e.to_string().contains("run `vmsight image build`"), "{e}");
    }

    #[test]
    fn opens_a_complete_image() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let d = tmp.path();
        for f in ["vmlinuz", "initrd.img", "rootfs.img"] {
            fs::write(d.join(f), b"x").expect("write");
        }
        fs::write(
            d.join("manifest.json"),
            r#"{"format":1,"recipe_hash":"0123456789abcdef","kernel_version":"6.1.0-1-cloud-amd64","build_date":"2025-01-01T00:00:00Z"}"#,
        )
        .expect("write");
        // Without profile inputs the profile cannot be regenerated: a clear error.
        let e = open(d).expect_err("no System.map");
        assert!(e.to_string().contains("System.map is missing"), "{e}");
        fs::write(
            d.join("profile.json"),
            format!(
                r#"{{"format":{},"kernel_version":"6.1","symbols":{{}},"structs":{{}},"config":{{}}}}"#,
                vmsight_introspect::profile::PROFILE_FORMAT
            ),
        )
        .expect("write");
        let img = open(d).expect("opens");
        assert_eq!(img.kernel, d.join("vmlinuz"));
        assert_eq!(img.manifest.kernel_version, "6.1.0-1-cloud-amd64");
        let info = info(&img);
        assert!(!info.current);
        assert!(info.to_string().contains("6.1.0-1-cloud-amd64"));
    }

    #[test]
    fn build_lock_excludes_a_second_holder() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let held = lock_build(tmp.path(), "h", &|_: &str| {}).expect("first lock");
        let f = File::open(tmp.path().join("h.lock")).expect("open");
        assert!(Flock::lock(f, FlockArg::LockExclusiveNonblock).is_err());
        drop(held);
        let f = File::open(tmp.path().join("h.lock")).expect("open");
        assert!(Flock::lock(f, FlockArg::LockExclusiveNonblock).is_ok());
    }
}
