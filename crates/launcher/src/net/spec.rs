//! `--net` and its options: how the VM's NIC reaches the host.
//!
//! ```text
//! --net none
//! --net isolated[,ip=CIDR][,gw=ADDR][,host=CIDR][,mtu=N][,offload=on|off][,device=vmsight|qemu]
//! --net tap=NAME[,ip=CIDR][,gw=ADDR][,mtu=N][,offload=on|off]
//! --net bridge=NAME[,ip=CIDR][,gw=ADDR][,mtu=N][,offload=on|off]
//! ```

use std::net::Ipv4Addr;
use std::str::FromStr;

/// Where the NIC's tap lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NetMode {
    /// No NIC.
    None,
    /// A network namespace of the VM's own, holding its tap (the host end of the link).
    Isolated,
    /// An existing (persistent) or new tap of that name in vmsight's namespace.
    Tap(String),
    /// A new tap attached to this existing bridge.
    Bridge(String),
}

/// An IPv4 address with its prefix length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    pub addr: Ipv4Addr,
    pub prefix: u8,
}

impl std::fmt::Display for Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

impl FromStr for Cidr {
    type Err = NetSpecError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || {
            NetSpecError(format!(
                "{s:?} is not an IPv4 address with a prefix (10.0.2.15/24)"
            ))
        };
        let (a, p) = s.split_once('/').ok_or_else(bad)?;
        let addr = a.parse().map_err(|_| bad())?;
        let prefix: u8 = p.parse().map_err(|_| bad())?;
        if prefix == 0 || prefix > 30 {
            return Err(NetSpecError(format!(
                "prefix /{prefix} of {s:?} leaves no room for two hosts (use /1 to /30)"
            )));
        }
        Ok(Cidr { addr, prefix })
    }
}

/// What `--net` asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetSpec {
    pub mode: NetMode,
    /// The guest's address (isolated default: 10.0.2.15/24).
    pub guest: Option<Cidr>,
    /// The guest's default gateway (isolated default: the host end, 10.0.2.1).
    pub gateway: Option<Ipv4Addr>,
    /// The host end's address in isolated mode (default 10.0.2.1/24).
    pub host: Option<Cidr>,
    pub mtu: u16,
    pub offloads: bool,
    /// Who serves the NIC: vmsight's backend (packet stages) or QEMU's own user-space
    /// virtio-net on the same tap (the baseline of the network benchmarks; no stages).
    pub device: NicDevice,
}

/// Who serves the VM's NIC.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NicDevice {
    /// vmsight's vhost-user-net backend.
    #[default]
    Vmsight,
    /// QEMU's virtio-net with `-netdev tap,fd=N,vhost=off`.
    Qemu,
}

/// The guest address of the isolated network.
pub const ISOLATED_GUEST: Cidr = Cidr {
    addr: Ipv4Addr::new(10, 0, 2, 15),
    prefix: 24,
};
/// The host end of the isolated network (the guest's gateway).
pub const ISOLATED_HOST: Cidr = Cidr {
    addr: Ipv4Addr::new(10, 0, 2, 1),
    prefix: 24,
};

/// A `--net` value that cannot be used: one sentence naming the problem.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("--net: {0}")]
pub struct NetSpecError(pub String);

impl NetSpec {
    /// The default NIC: an isolated network.
    pub fn isolated() -> Self {
        Self {
            mode: NetMode::Isolated,
            guest: Some(ISOLATED_GUEST),
            gateway: Some(ISOLATED_HOST.addr),
            host: Some(ISOLATED_HOST),
            mtu: 1500,
            offloads: true,
            device: NicDevice::Vmsight,
        }
    }

    /// No NIC.
    pub fn none() -> Self {
        Self {
            mode: NetMode::None,
            guest: None,
            gateway: None,
            host: None,
            mtu: 1500,
            offloads: true,
            device: NicDevice::Vmsight,
        }
    }

    /// The kernel command-line parameter that tells the guest's init how to set up its
    /// interface (`vmsight.net=ADDR/PREFIX[,GATEWAY][,mtu=N]`), if it has an address.
    pub fn guest_cmdline(&self) -> Option<String> {
        let g = self.guest?;
        let mut s = format!("vmsight.net={g}");
        if let Some(gw) = self.gateway {
            s.push_str(&format!(",{gw}"));
        }
        s.push_str(&format!(",mtu={}", self.mtu));
        Some(s)
    }
}

impl FromStr for NetSpec {
    type Err = NetSpecError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut parts = s.split(',');
        let head = parts.next().unwrap_or("");
        let mut spec = match head.split_once('=') {
            None if head == "none" => return none_only(parts.next()),
            None if head == "isolated" => NetSpec::isolated(),
            Some(("tap", n)) => with_ifname(NetMode::Tap(n.to_owned()), n)?,
            Some(("bridge", n)) => with_ifname(NetMode::Bridge(n.to_owned()), n)?,
            _ => {
                return Err(NetSpecError(format!(
                    "{head:?} is not none, isolated, tap=NAME or bridge=NAME"
                )))
            }
        };
        for opt in parts {
            apply_option(&mut spec, opt)?;
        }
        check_addresses(&spec)?;
        Ok(spec)
    }
}

fn none_only(extra: Option<&str>) -> Result<NetSpec, NetSpecError> {
    match extra {
        None => Ok(NetSpec::none()),
        Some(o) => Err(NetSpecError(format!("none takes no options (got {o:?})"))),
    }
}

fn with_ifname(mode: NetMode, name: &str) -> Result<NetSpec, NetSpecError> {
    vmsight_netdev::tap::check_ifname(name).map_err(|e| NetSpecError(e.to_string()))?;
    Ok(NetSpec {
        mode,
        ..NetSpec::none()
    })
}

fn apply_option(spec: &mut NetSpec, opt: &str) -> Result<(), NetSpecError> {
    let (k, v) = opt
        .split_once('=')
        .ok_or_else(|| NetSpecError(format!("option {opt:?} is not KEY=VALUE")))?;
    match k {
        "ip" => spec.guest = Some(v.parse()?),
        "gw" => {
            spec.gateway = Some(
                v.parse()
                    .map_err(|_| NetSpecError(format!("gw={v:?} is not an IPv4 address")))?,
            )
        }
        "host" if spec.mode == NetMode::Isolated => spec.host = Some(v.parse()?),
        "mtu" => {
            spec.mtu = v
                .parse()
                .ok()
                .filter(|m| (68..=65_521).contains(m))
                .ok_or_else(|| NetSpecError(format!("mtu={v:?} is not between 68 and 65521")))?
        }
        "offload" => {
            spec.offloads = match v {
                "on" => true,
                "off" => false,
                _ => return Err(NetSpecError(format!("offload={v:?} is not on or off"))),
            }
        }
        "device" => {
            spec.device = match v {
                "vmsight" => NicDevice::Vmsight,
                "qemu" => NicDevice::Qemu,
                _ => return Err(NetSpecError(format!("device={v:?} is not vmsight or qemu"))),
            }
        }
        _ => {
            return Err(NetSpecError(format!(
                "unknown option {k:?} (ip=, gw=, host= (isolated), mtu=, offload=, device=)"
            )))
        }
    }
    Ok(())
}

/// In isolated mode the guest and the host end must share a subnet and differ.
fn check_addresses(spec: &NetSpec) -> Result<(), NetSpecError> {
    if spec.mode != NetMode::Isolated {
        return Ok(());
    }
    let (Some(g), Some(h)) = (spec.guest, spec.host) else {
        return Ok(());
    };
    let mask = |p: u8| u32::MAX << (32 - u32::from(p));
    let same = u32::from(g.addr) & mask(h.prefix) == u32::from(h.addr) & mask(h.prefix);
    if !same || g.addr == h.addr {
        return Err(NetSpecError(format!(
            "the guest's address {g} and the host end's {h} must differ and share a subnet"
        )));
    }
    Ok(())
}

/// A MAC address for VM `name`: locally administered (QEMU's 52:54:00 prefix), the rest from
/// a hash of the name, so a VM keeps its MAC across runs.
pub fn mac_for(name: &str) -> String {
    let mut h: u32 = 0x811c_9dc5;
    for b in name.bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    let b = h.to_be_bytes();
    format!("52:54:00:{:02x}:{:02x}:{:02x}", b[1], b[2], b[3])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_modes_parse() {
        assert_eq!("none".parse::<NetSpec>().expect("none"), NetSpec::none());
        assert_eq!(
            "isolated".parse::<NetSpec>().expect("iso"),
            NetSpec::isolated()
        );
        let t: NetSpec = "tap=vmt0,ip=192.168.7.2/24,gw=192.168.7.1,mtu=9000,offload=off"
            .parse()
            .expect("tap");
        assert_eq!(t.mode, NetMode::Tap("vmt0".into()));
        assert_eq!(t.guest.expect("ip").to_string(), "192.168.7.2/24");
        assert_eq!(t.gateway, Some(Ipv4Addr::new(192, 168, 7, 1)));
        assert_eq!(t.mtu, 9000);
        assert!(!t.offloads);
        let q: NetSpec = "isolated,device=qemu".parse().expect("qemu");
        assert_eq!(q.device, NicDevice::Qemu);
        assert!("isolated,device=e1000".parse::<NetSpec>().is_err());
        let b: NetSpec = "bridge=br0".parse().expect("bridge");
        assert_eq!(b.mode, NetMode::Bridge("br0".into()));
        assert_eq!(b.guest, None);
    }

    #[test]
    fn bad_values_are_refused_with_the_reason() {
        for (spec, needle) in [
            ("wifi", "not none, isolated"),
            ("none,mtu=1400", "none takes no options"),
            ("tap=", "bad interface name"),
            ("tap=a/b", "bad interface name"),
            ("isolated,mtu=20", "between 68"),
            ("isolated,ip=10.0.2.15", "prefix"),
            ("isolated,ip=10.0.2.15/32", "/1 to /30"),
            ("isolated,ip=10.0.3.15/24", "share a subnet"),
            ("isolated,ip=10.0.2.1/24", "must differ"),
            ("isolated,offload=maybe", "on or off"),
            ("isolated,speed=10", "unknown option"),
            ("tap=t0,host=10.0.0.1/24", "unknown option"),
            ("isolated,gw=x", "not an IPv4"),
            ("isolated,mtu", "KEY=VALUE"),
        ] {
            let e = spec.parse::<NetSpec>().expect_err(spec).to_string();
            assert!(e.contains(needle), "{spec}: {e}");
            assert!(e.starts_with("--net: "), "{e}");
        }
    }

    #[test]
    fn guest_cmdline_carries_address_gateway_and_mtu() {
        assert_eq!(
            NetSpec::isolated().guest_cmdline().as_deref(),
            Some("vmsight.net=10.0.2.15/24,10.0.2.1,mtu=1500")
        );
        assert_eq!(NetSpec::none().guest_cmdline(), None);
    }

    #[test]
    fn macs_are_stable_and_locally_administered() {
        assert_eq!(mac_for("web1"), mac_for("web1"));
        assert_ne!(mac_for("web1"), mac_for("web2"));
        assert!(mac_for("x").starts_with("52:54:00:"));
        assert_eq!(mac_for("x").len(), 17);
    }
}
