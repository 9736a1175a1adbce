//! SwapBypass's host side (docs/swapbypass.md): the guest's swap disk served by vmsight from a
//! swap cache in host memory that vmsight owns, sized and resized by vmsight, spilling to the
//! swap file; the same memory is shared with the symbiotic guest module, which swaps pages in
//! and out of it without block I/O.
//!
//! * [`region`]: the shared memfd and its bounds-checked accessors;
//! * [`store`]: the cache's operations (the region protocol) and vmsight's eviction, resize
//!   and memory give-back;
//! * [`stage`]: the swap disk's last block stage;
//! * [`evictor`]: the thread that keeps the cache within its size.

pub mod error;
pub mod evictor;
pub mod fuzzing;
pub mod region;
pub mod stage;
pub mod store;

pub use error::SwapError;
pub use evictor::Evictor;
pub use region::Region;
pub use stage::SwapStage;
pub use store::{Counters, OpError, Place, SwapStore};
