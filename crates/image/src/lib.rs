//! vmsight-image (skeleton; filled in by its owner).
