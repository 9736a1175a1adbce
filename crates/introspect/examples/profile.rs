//! Prints the kernel profile of a kernel as JSON.
//!
//!     cargo run -p vmsight-introspect --example profile -- SYSTEM_MAP BTF_OR_VMLINUX CONFIG

use std::path::Path;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [map, btf, config] = args.as_slice() else {
        eprintln!("usage: profile SYSTEM_MAP BTF_OR_VMLINUX CONFIG");
        std::process::exit(2);
    };
    match vmsight_introspect::profile::generate(Path::new(map), Path::new(btf), Path::new(config)) {
        Ok(p) => match serde_json::to_string_pretty(&p) {
            Ok(s) => println!("{s}"),
            Err(e) => {
                eprintln!("error: cannot serialize the profile: {e}");
                std::process::exit(1);
            }
        },
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
