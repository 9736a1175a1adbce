//! vmsight-introspect (skeleton; filled in by its owner).
