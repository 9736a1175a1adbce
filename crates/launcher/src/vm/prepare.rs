//! Phase 1, prepare: everything that can be checked or decided before anything starts.
//!
//! Validates the configuration, resolves the guest files (the default image supplies what was
//! not given), chooses the accelerator, resolves which QEMU runs (`--qemu`) and checks that the
//! plugin can be loaded into it, finds the plugin, decides tracing, checks
//! every `--stage` request, and creates the runtime directory and the root disk's working
//! copy. Nothing runs yet; dropping a [`Prepared`] removes what it created.

use std::path::{Path, PathBuf};

use crate::accel::{self, Accel, AccelChoice};
use crate::config::VmConfig;
use crate::error::LaunchError;
use crate::qemu;
use crate::runtime::{self, RuntimeDir, WorkingCopy};
use crate::trace::{TraceConfig, TraceTarget};
use vmsight_proto::layout;

use super::Artifacts;

/// The guest's kernel, initramfs, root image and kernel profile, resolved.
#[derive(Debug, Clone)]
pub struct GuestFiles {
    pub kernel: PathBuf,
    pub initrd: PathBuf,
    /// The image the root disk is made from.
    pub root_image: PathBuf,
    pub profile: Option<PathBuf>,
}

/// One disk to serve: the root disk is index 0, then `--disk` in order.
#[derive(Debug, Clone)]
pub struct DiskPlan {
    pub index: usize,
    pub path: PathBuf,
    pub read_only: bool,
    pub serial: String,
    pub num_queues: u16,
    pub direct: bool,
    /// I/O threads of the image file stage.
    pub io_threads: usize,
    /// How the image is served.
    pub io_engine: vmsight_blockdev::IoEngine,
    /// The path is a dedup volume served with these settings.
    pub dedup: Option<crate::config::DedupSpec>,
}

/// What the later phases need, decided once.
pub struct Prepared {
    pub accel: Accel,
    pub accel_reason: String,
    /// The QEMU to start, its version and plugin API.
    pub qemu: qemu::Qemu,
    pub guest: GuestFiles,
    /// Load the TCG plugin.
    pub use_plugin: bool,
    /// Syscall tracing, also implied (silently) by `--insights`.
    pub trace: Option<TraceConfig>,
    /// The command waits for `go` until its PID is monitored (or marked background).
    pub hold: bool,
    /// FoxyIdle is on and the plugin can tag block requests (plugin loaded, profile known).
    pub idle_tags: bool,
    pub disks: Vec<DiskPlan>,
    /// The root disk's working copy (removed on drop unless persistent).
    pub root: WorkingCopy,
    /// The runtime directory (removed on drop).
    pub rt: RuntimeDir,
    /// The unprivileged identity QEMU and virtiofsd run as (`--run-as`); `None`: vmsight's
    /// user. Held (its lock) until the VM is gone.
    pub identity: Option<crate::confine::Identity>,
}

/// Runs phase 1.
pub fn prepare(cfg: &VmConfig, arts: &Artifacts) -> Result<Prepared, LaunchError> {
    cfg.validate()?;
    crate::stages::check_requests(&cfg.stages)?;
    let AccelChoice { accel, reason } = accel::choose(cfg.accel)?;
    tracing::info!("accelerator: {accel} ({reason})");
    let qemu = qemu::Qemu::resolve(&cfg.qemu)?;
    tracing::info!(
        "QEMU (--qemu {}): {qemu}, plugin API {}: {}",
        cfg.qemu,
        qemu.plugin_api(),
        qemu.version_line
    );
    let guest = resolve_guest(cfg)?;
    check_files(cfg, &guest)?;
    let use_plugin = cfg.plugin && accel == Accel::Tcg;
    if use_plugin {
        // Only a run that loads the plugin needs the plugin to speak this QEMU's API.
        qemu.check_plugin_api()?;
        if !arts.plugin.is_file() {
            return Err(LaunchError::PluginMissing(arts.plugin.clone()));
        }
    }
    let trace = trace_config(cfg, use_plugin, guest.profile.as_deref())?;
    let idle_tags = idle_attribution(cfg, use_plugin, guest.profile.as_deref())?;
    let hold = trace
        .as_ref()
        .is_some_and(|t| t.target == TraceTarget::Command)
        || cfg
            .idle
            .as_ref()
            .is_some_and(|i| i.background.contains(&TraceTarget::Command));
    let rt = RuntimeDir::create(&runtime::runtime_base(), &cfg.name)?;
    let identity = vm_identity(cfg, &rt)?;
    let root = if cfg.persist {
        WorkingCopy::in_place(&guest.root_image)
    } else {
        let vms = vmsight_image::cache_dir()?.join("vms");
        let running: Vec<String> = runtime::list_running(&runtime::runtime_base())
            .into_iter()
            .map(|r| r.name)
            .collect();
        runtime::sweep_stale_copies(&vms, &running, runtime::STALE_COPY_AGE);
        WorkingCopy::create(&guest.root_image, &vms.join(&cfg.name).join("root.img"))?
    };
    let disks = disk_plans(cfg, &root.path);
    if let Some((n, _)) = cfg.stream.record.iter().find(|(n, _)| *n >= disks.len()) {
        return Err(LaunchError::Config(format!(
            "--record-writes names disk {n}, but there are only {} disks (0 = root)",
            disks.len()
        )));
    }
    Ok(Prepared {
        accel,
        accel_reason: reason,
        qemu,
        guest,
        use_plugin,
        trace,
        hold,
        idle_tags,
        disks,
        root,
        rt,
        identity,
    })
}

/// The identity QEMU and virtiofsd run as, and, when it is not vmsight's, the empty directory
/// QEMU chroots into (root's, mode 0500: QEMU can neither list nor write it).
fn vm_identity(
    cfg: &VmConfig,
    rt: &RuntimeDir,
) -> Result<Option<crate::confine::Identity>, LaunchError> {
    let id = crate::confine::identity(&cfg.run_as, &runtime::runtime_base(), &cfg.name).map_err(
        |source| LaunchError::Confine {
            vm: cfg.name.clone(),
            source,
        },
    )?;
    if let Some(id) = &id {
        use std::os::unix::fs::DirBuilderExt;
        let jail = rt.join(layout::QEMU_JAIL);
        std::fs::DirBuilder::new()
            .mode(0o500)
            .create(&jail)
            .map_err(|source| LaunchError::RuntimeDir { path: jail, source })?;
        tracing::info!(
            "QEMU and its helpers run as uid {} gid {} (--run-as {})",
            id.uid,
            id.gid,
            cfg.run_as
        );
    }
    Ok(id)
}

/// Fills what the configuration leaves open from the default image; with `persist` and no
/// root image, a per-name persistent copy of the default root file system (made on first use).
pub fn resolve_guest(cfg: &VmConfig) -> Result<GuestFiles, LaunchError> {
    let need_image = cfg.kernel.is_none() || cfg.initrd.is_none() || cfg.root_image.is_none();
    let image = if need_image {
        Some(vmsight_image::default_image()?)
    } else {
        None
    };
    let pick = |given: &Option<PathBuf>, f: fn(&vmsight_image::GuestImage) -> PathBuf| {
        given
            .clone()
            .or_else(|| image.as_ref().map(f))
            .unwrap_or_default()
    };
    let root_image = match (&cfg.root_image, cfg.persist, &image) {
        (Some(r), _, _) => r.clone(),
        (None, true, Some(img)) => persistent_root(&cfg.name, &img.rootfs)?,
        (None, _, _) => pick(&None, |i| i.rootfs.clone()),
    };
    Ok(GuestFiles {
        kernel: pick(&cfg.kernel, |i| i.kernel.clone()),
        initrd: pick(&cfg.initrd, |i| i.initrd.clone()),
        root_image,
        profile: cfg
            .profile
            .clone()
            .or_else(|| image.as_ref().map(|i| i.profile.clone())),
    })
}

/// `<cache>/persist/<name>.img`, a sparse copy of `rootfs` made the first time.
fn persistent_root(name: &str, rootfs: &Path) -> Result<PathBuf, LaunchError> {
    let p = vmsight_image::cache_dir()?
        .join("persist")
        .join(format!("{name}.img"));
    if !p.exists() {
        let dir = p.parent().unwrap_or(&p).to_owned();
        std::fs::create_dir_all(&dir).map_err(|source| LaunchError::RuntimeDir {
            path: dir.clone(),
            source,
        })?;
        // Copied under a temporary name and renamed once on the disk: a copy cut short (a
        // crash, a full disk) is never taken for the VM's disk by the next run.
        let partial = p.with_extension("img.partial");
        let err = |source| LaunchError::RootCopy {
            from: rootfs.to_owned(),
            to: p.clone(),
            source,
        };
        runtime::sparse_copy(rootfs, &partial, runtime::Durability::Durable).map_err(err)?;
        std::fs::rename(&partial, &p).map_err(err)?;
    }
    Ok(p)
}

fn check_readable(path: &Path) -> bool {
    std::fs::File::open(path).is_ok() && path.is_file()
}

/// The kernel, initrd, root image and every extra disk can be opened as needed.
fn check_files(cfg: &VmConfig, guest: &GuestFiles) -> Result<(), LaunchError> {
    if !check_readable(&guest.kernel) {
        return Err(LaunchError::KernelMissing(guest.kernel.clone()));
    }
    if !check_readable(&guest.initrd) {
        return Err(LaunchError::InitrdMissing(guest.initrd.clone()));
    }
    if !check_readable(&guest.root_image) {
        return Err(LaunchError::DiskUnusable {
            path: guest.root_image.clone(),
            reason: "the root image does not exist or is not readable".into(),
        });
    }
    for d in &cfg.disks {
        if d.dedup.is_some() {
            if d.read_only {
                return Err(LaunchError::DiskUnusable {
                    path: d.path.clone(),
                    reason: "a dedup volume cannot be served read-only".into(),
                });
            }
            if !vmsight_dedup::Volume::is_volume(&d.path) {
                return Err(LaunchError::DiskUnusable {
                    path: d.path.clone(),
                    reason: "it is not a dedup volume (create one with `vmsight dedup create VOL --size SIZE`)".into(),
                });
            }
            continue;
        }
        if let Err(e) = std::fs::OpenOptions::new()
            .read(true)
            .write(!d.read_only)
            .open(&d.path)
        {
            return Err(LaunchError::DiskUnusable {
                path: d.path.clone(),
                reason: e.to_string(),
            });
        }
    }
    Ok(())
}

/// Syscall tracing as configured; insights need monitored processes, so without `--trace`
/// they monitor their target silently (no text, no JSON).
/// Whether FoxyIdle can attribute requests (it then needs the plugin and the profile); without
/// them the idle stage still runs but every request is foreground, which the user is told.
fn idle_attribution(
    cfg: &VmConfig,
    use_plugin: bool,
    profile: Option<&Path>,
) -> Result<bool, LaunchError> {
    let Some(idle) = &cfg.idle else {
        return Ok(false);
    };
    if idle.background.contains(&TraceTarget::Command) && cfg.command.is_none() {
        return Err(LaunchError::Config(
            "--background @cmd needs a command (`vmsight run --background @cmd -- CMD ...`)".into(),
        ));
    }
    let why_not = if !use_plugin {
        Some(if cfg.plugin {
            "the TCG plugin does not run under KVM"
        } else {
            "--no-plugin disables the TCG plugin"
        })
    } else if !profile.is_some_and(Path::is_file) {
        Some("there is no kernel profile for the guest kernel")
    } else {
        None
    };
    if let Some(why) = why_not {
        eprintln!(
            "vmsight: FoxyIdle cannot tell background requests apart ({why}): nothing will be held"
        );
    }
    Ok(why_not.is_none())
}

fn trace_config(
    cfg: &VmConfig,
    use_plugin: bool,
    profile: Option<&Path>,
) -> Result<Option<TraceConfig>, LaunchError> {
    let trace = cfg.trace.clone().or_else(|| {
        cfg.insights.as_ref().map(|s| TraceConfig {
            target: s.target.clone(),
            out: None,
            text: false,
            json: None,
            filter: vmsight_introspect::syscall::NameFilter::all(),
        })
    });
    let Some(t) = trace else {
        return Ok(None);
    };
    if !use_plugin {
        return Err(LaunchError::Config(format!(
            "syscall tracing needs the TCG plugin, which is {}",
            if cfg.plugin {
                "not available under KVM"
            } else {
                "disabled by --no-plugin"
            }
        )));
    }
    if t.target == TraceTarget::Command && cfg.command.is_none() {
        return Err(LaunchError::Config(
            "--trace @cmd needs a command (`vmsight run --trace -- CMD ...`)".into(),
        ));
    }
    match profile {
        Some(p) if p.is_file() => Ok(Some(t)),
        Some(p) => Err(LaunchError::Config(format!(
            "the kernel profile {} does not exist",
            p.display()
        ))),
        None => Err(LaunchError::Config(
            "syscall tracing needs the guest kernel's profile (the default image has one)".into(),
        )),
    }
}

/// The root disk (always disk0 = /dev/vda, 2 queues) and the extra disks.
fn disk_plans(cfg: &VmConfig, root: &Path) -> Vec<DiskPlan> {
    let mut v = vec![DiskPlan {
        index: 0,
        path: root.to_owned(),
        read_only: false,
        serial: "vmsight-root".into(),
        num_queues: 2,
        direct: false,
        io_threads: vmsight_blockdev::file::DEFAULT_IO_THREADS,
        io_engine: vmsight_blockdev::IoEngine::default(),
        dedup: None,
    }];
    for (i, d) in cfg.disks.iter().enumerate() {
        v.push(DiskPlan {
            index: i + 1,
            path: d.path.clone(),
            read_only: d.read_only,
            serial: d
                .serial
                .clone()
                .unwrap_or_else(|| format!("vmsight-disk{}", i + 1)),
            num_queues: d.num_queues.unwrap_or(1),
            direct: d.direct,
            io_threads: d
                .io_threads
                .unwrap_or(vmsight_blockdev::file::DEFAULT_IO_THREADS),
            io_engine: d.io_engine.unwrap_or_default(),
            dedup: d.dedup,
        });
    }
    v
}
