//! The kernel profile format (`profile.json` in the image directory): symbol addresses and
//! struct layouts of one exact guest kernel. `vmsight image build` writes it
//! (`vmsight_introspect::profile::generate`); the plugin (inside QEMU) and process tracking
//! read it.
//!
//! Only the format lives here: the types, reading and writing the file (with its version
//! check) and lookups. Building a profile from System.map and BTF is introspect's job.

use std::collections::BTreeMap;
use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Version of the profile JSON layout; bump when what a profile holds changes, so cached
/// profiles are regenerated (3: `page` and `address_space` members for page ownership).
pub const PROFILE_FORMAT: u32 = 3;

/// Largest profile file read (real ones are a few KiB).
pub const MAX_PROFILE_BYTES: u64 = 64 << 20;

/// Problems reading, writing or using a kernel profile.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    /// The file cannot be read.
    #[error("cannot read the kernel profile {path}: {source}")]
    Read {
        /// The profile.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The file is larger than [`MAX_PROFILE_BYTES`].
    #[error("the kernel profile {path} is larger than 64 MiB")]
    TooLarge {
        /// The profile.
        path: PathBuf,
    },
    /// The file cannot be written.
    #[error("cannot write the kernel profile {path}: {source}")]
    Write {
        /// The profile.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The text is not a profile.
    #[error("{path} is not a kernel profile: {source}")]
    Parse {
        /// The profile.
        path: PathBuf,
        /// Cause.
        #[source]
        source: serde_json::Error,
    },
    /// The profile was written in another format version.
    #[error("{path} has profile format {found}; this vmsight reads format {expected} (rebuild the image with `vmsight image build --force`)")]
    Format {
        /// The profile.
        path: PathBuf,
        /// Its format.
        found: u32,
        /// [`PROFILE_FORMAT`].
        expected: u32,
    },
    /// A symbol the caller needs is not in the profile.
    #[error("the kernel profile has no symbol {0}")]
    MissingSymbol(String),
    /// A struct the caller needs is not in the profile.
    #[error("the kernel profile has no struct {0}")]
    MissingStruct(String),
    /// A struct member the caller needs is not in the profile.
    #[error("the kernel profile has no member {0}.{1}")]
    MissingMember(String, String),
}

/// Offset and size of a struct member, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberLayout {
    /// Offset from the start of the struct.
    pub offset: u64,
    /// Size.
    pub size: u64,
}

/// Layout of one struct: its size and the members the profile records.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StructLayout {
    /// `sizeof`.
    pub size: u64,
    /// Recorded members by name.
    pub members: BTreeMap<String, MemberLayout>,
}

/// A 64-bit kernel address, serialized as a `"0x…"` hex string for readability (JSON numbers
/// above 2^53 are also lossy in many tools).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Addr(pub u64);

impl fmt::Display for Addr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#018x}", self.0)
    }
}

impl Serialize for Addr {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for Addr {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let hex = s.strip_prefix("0x").unwrap_or(&s);
        u64::from_str_radix(hex, 16)
            .map(Addr)
            .map_err(|e| serde::de::Error::custom(format!("bad address {s:?}: {e}")))
    }
}

/// Everything vmsight knows about the guest kernel without looking at guest memory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KernelProfile {
    /// [`PROFILE_FORMAT`] of the writer.
    pub format: u32,
    /// Upstream version from the config header, e.g. `6.1.192`.
    pub kernel_version: String,
    /// `uname -r`, e.g. `6.1.0-56-cloud-amd64` (set by the image builder; empty if unknown).
    #[serde(default)]
    pub kernel_release: String,
    /// Symbol addresses from System.map. Per-CPU variables (`current_task`, …) are offsets
    /// into a CPU's per-CPU area: add `__per_cpu_offset[cpu]` to get an address.
    pub symbols: BTreeMap<String, Addr>,
    /// Struct layouts from BTF.
    pub structs: BTreeMap<String, StructLayout>,
    /// Selected kernel config options (`CONFIG_` prefix kept), e.g. `CONFIG_PGTABLE_LEVELS`.
    pub config: BTreeMap<String, String>,
}

impl KernelProfile {
    /// Reads a profile written by [`KernelProfile::save`].
    pub fn load(path: &Path) -> Result<KernelProfile, ProfileError> {
        let read = |source| ProfileError::Read {
            path: path.into(),
            source,
        };
        if fs::metadata(path).map_err(read)?.len() > MAX_PROFILE_BYTES {
            return Err(ProfileError::TooLarge { path: path.into() });
        }
        let text = fs::read_to_string(path).map_err(read)?;
        KernelProfile::from_json(&text, path)
    }

    /// Parses the text of a profile; `path` names it in errors. The format version is checked
    /// before the full parse, so an old profile gets the precise error.
    pub fn from_json(text: &str, path: &Path) -> Result<KernelProfile, ProfileError> {
        #[derive(Deserialize)]
        struct Head {
            format: u32,
        }
        let parse = |source| ProfileError::Parse {
            path: path.into(),
            source,
        };
        let head: Head = serde_json::from_str(text).map_err(parse)?;
        if head.format != PROFILE_FORMAT {
            return Err(ProfileError::Format {
                path: path.into(),
                found: head.format,
                expected: PROFILE_FORMAT,
            });
        }
        serde_json::from_str(text).map_err(parse)
    }

    /// Writes the profile as pretty JSON (via a temporary file, then rename).
    pub fn save(&self, path: &Path) -> Result<(), ProfileError> {
        let werr = |source| ProfileError::Write {
            path: path.into(),
            source,
        };
        let mut text =
            serde_json::to_string_pretty(self).map_err(|e| werr(std::io::Error::other(e)))?;
        text.push('\n');
        let tmp = path.with_extension("json.tmp");
        fs::write(&tmp, text).map_err(werr)?;
        fs::rename(&tmp, path).map_err(werr)
    }

    /// Address of a symbol, or an error naming it.
    pub fn symbol(&self, name: &str) -> Result<u64, ProfileError> {
        self.symbols
            .get(name)
            .map(|a| a.0)
            .ok_or_else(|| ProfileError::MissingSymbol(name.into()))
    }

    /// Layout of a struct member, or an error naming it.
    pub fn member(&self, strukt: &str, member: &str) -> Result<MemberLayout, ProfileError> {
        let s = self
            .structs
            .get(strukt)
            .ok_or_else(|| ProfileError::MissingStruct(strukt.into()))?;
        s.members
            .get(member)
            .copied()
            .ok_or_else(|| ProfileError::MissingMember(strukt.into(), member.into()))
    }

    /// `sizeof(struct strukt)`, or an error naming it.
    pub fn struct_size(&self, strukt: &str) -> Result<u64, ProfileError> {
        self.structs
            .get(strukt)
            .map(|s| s.size)
            .ok_or_else(|| ProfileError::MissingStruct(strukt.into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> KernelProfile {
        let mut members = BTreeMap::new();
        members.insert("pid".into(), MemberLayout { offset: 8, size: 4 });
        KernelProfile {
            format: PROFILE_FORMAT,
            kernel_version: "6.1.192".into(),
            kernel_release: String::new(),
            symbols: [("init_task".to_string(), Addr(0xffff_ffff_8200_0000))].into(),
            structs: [(
                "task_struct".to_string(),
                StructLayout {
                    size: 9728,
                    members,
                },
            )]
            .into(),
            config: BTreeMap::new(),
        }
    }

    #[test]
    fn saves_loads_and_looks_up() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("profile.json");
        let p = sample();
        p.save(&path).expect("save");
        let text = fs::read_to_string(&path).expect("read");
        assert!(text.contains("\"0xffffffff82000000\""), "{text}");
        let back = KernelProfile::load(&path).expect("load");
        assert_eq!(back, p);
        assert_eq!(
            back.symbol("init_task").expect("sym"),
            0xffff_ffff_8200_0000
        );
        assert_eq!(back.member("task_struct", "pid").expect("pid").offset, 8);
        assert_eq!(back.struct_size("task_struct").expect("size"), 9728);
        assert_eq!(
            back.member("task_struct", "nope")
                .expect_err("missing")
                .to_string(),
            "the kernel profile has no member task_struct.nope"
        );
        assert!(matches!(
            back.symbol("x"),
            Err(ProfileError::MissingSymbol(_))
        ));
        assert!(matches!(
            back.struct_size("x"),
            Err(ProfileError::MissingStruct(_))
        ));
    }

    #[test]
    fn format_and_parse_errors_name_the_file() {
        let p = Path::new("/img/profile.json");
        assert!(matches!(
            KernelProfile::from_json(r#"{"format": 999}"#, p),
            Err(ProfileError::Format { found: 999, .. })
        ));
        let e = KernelProfile::from_json("[", p).expect_err("not json");
        assert!(e.to_string().starts_with("/img/profile.json is not"), "{e}");
        let incomplete = format!(r#"{{"format": {PROFILE_FORMAT}}}"#);
        let e = KernelProfile::from_json(&incomplete, p).expect_err("incomplete");
        assert!(matches!(e, ProfileError::Parse { .. }), "{e}");
        assert!(matches!(
            KernelProfile::load(Path::new("/nonexistent/profile.json")),
            Err(ProfileError::Read { .. })
        ));
    }

    #[test]
    fn addresses_are_hex_strings() {
        let a: Addr = serde_json::from_str("\"0x10\"").expect("hex");
        assert_eq!(a, Addr(16));
        assert!(serde_json::from_str::<Addr>("\"0xzz\"").is_err());
        assert!(serde_json::from_str::<Addr>("16").is_err());
    }
}
