//! Embeds the guest image recipe (guest/build-image.sh, the two init scripts, every
//! guest/progs/*.c, guest/lib/*.{c,h} and the guest module guest/sym/{*.c,*.h,Kbuild}) into
//! the crate. The file list is generated so that a new helper program only needs a new .c
//! file in guest/progs.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};

fn main() {
    let manifest_dir =
        PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let guest = manifest_dir.join("../../guest");
    let guest = guest
        .canonicalize()
        .unwrap_or_else(|e| panic!("cannot find the recipe directory {}: {e}", guest.display()));

    let mut files: Vec<String> = ["build-image.sh", "init", "initramfs-init"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let progs = guest.join("progs");
    println!("cargo:rerun-if-changed={}", progs.display());
    if let Ok(entries) = fs::read_dir(&progs) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.ends_with(".c") && e.path().is_file() {
                files.push(format!("progs/{name}"));
            }
        }
    }
    // The hint library (libvmsight, LD_PRELOAD shim): C sources and headers.
    let lib = guest.join("lib");
    println!("cargo:rerun-if-changed={}", lib.display());
    if let Ok(entries) = fs::read_dir(&lib) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if (name.ends_with(".c") || name.ends_with(".h")) && e.path().is_file() {
                files.push(format!("lib/{name}"));
            }
        }
    }
    // The symbiotic interface's guest module (vmsight_sym): C sources, headers and Kbuild.
    let sym = guest.join("sym");
    println!("cargo:rerun-if-changed={}", sym.display());
    if let Ok(entries) = fs::read_dir(&sym) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if (name.ends_with(".c") || name.ends_with(".h") || name == "Kbuild")
                && e.path().is_file()
            {
                files.push(format!("sym/{name}"));
            }
        }
    }
    files.sort();

    let mut code = String::from("/// The recipe files, sorted by path relative to guest/.\npub(crate) const RECIPE_FILES: &[(&str, &[u8])] = &[\n");
    for f in &files {
        let path = guest.join(f);
        assert!(
            Path::new(&path).is_file(),
            "recipe file {} is missing",
            path.display()
        );
        println!("cargo:rerun-if-changed={}", path.display());
        code.push_str(&format!(
            "    ({f:?}, include_bytes!({:?})),\n",
            path.display().to_string()
        ));
    }
    code.push_str("];\n");
    let out =
        PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR")).join("recipe_files.rs");
    fs::write(&out, code).unwrap_or_else(|e| panic!("cannot write {}: {e}", out.display()));
}
