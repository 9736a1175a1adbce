//! Builds (or finds) the default guest image and prints its summary and the build time.
//!
//!     cargo run -p vmsight-image --example build [-- --force]

use std::time::Instant;

fn main() {
    let force = std::env::args().any(|a| a == "--force");
    let start = Instant::now();
    match vmsight_image::build(force, |msg| eprintln!("vmsight image: {msg}")) {
        Ok(img) => {
            println!("{}", vmsight_image::info(&img));
            println!("elapsed: {:.1} s", start.elapsed().as_secs_f64());
        }
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
