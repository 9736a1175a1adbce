//! Errors of the swap cache.

use std::path::PathBuf;

/// Why the swap cache could not be set up or resized.
#[derive(Debug, thiserror::Error)]
pub enum SwapError {
    #[error("a swap disk of {bytes} bytes is not usable: it must hold 2 to 2^32 pages of 4 KiB")]
    Size { bytes: u64 },
    #[error("cannot create the swap region of {bytes} bytes: {source}")]
    Region {
        bytes: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot create the swap file {}: {source}", path.display())]
    File {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot start the swap cache's evictor thread: {0}")]
    Thread(#[source] std::io::Error),
    #[error(
        "a swap cache of {pages} pages is larger than the region's {slots} slots (the cache \
         can grow up to the --swap ...,max-cache= the VM was started with)"
    )]
    TooLarge { pages: u64, slots: u64 },
}
