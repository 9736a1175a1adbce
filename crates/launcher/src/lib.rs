//! vmsight-launcher (skeleton; filled in by its owner).
