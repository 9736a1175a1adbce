//! Reading a fuzz input as a sequence of small decisions. Shared by the `fuzzing` modules of
//! the crates (each includes this file with `#[path]`) so every target decodes its bytes the
//! same way: little-endian integers, and zeroes once the input is used up, so every input,
//! however short, decodes to something and decoding never fails.

/// A cursor over the fuzzer's bytes.
#[derive(Debug, Clone)]
pub(crate) struct Input<'a> {
    bytes: &'a [u8],
}

#[allow(dead_code)] // Each target uses the readers it needs.
impl<'a> Input<'a> {
    /// A cursor at the start of `bytes`.
    pub(crate) fn new(bytes: &'a [u8]) -> Self {
        Self { bytes }
    }

    /// Whether every byte was consumed.
    pub(crate) fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// Bytes left.
    pub(crate) fn remaining(&self) -> usize {
        self.bytes.len()
    }

    /// Up to `n` bytes (fewer at the end of the input).
    pub(crate) fn take(&mut self, n: usize) -> &'a [u8] {
        let (head, tail) = self.bytes.split_at(n.min(self.bytes.len()));
        self.bytes = tail;
        head
    }

    /// Everything left.
    pub(crate) fn rest(&mut self) -> &'a [u8] {
        self.take(self.bytes.len())
    }

    /// `N` bytes, zero-padded at the end of the input.
    pub(crate) fn array<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0u8; N];
        let got = self.take(N);
        out[..got.len()].copy_from_slice(got);
        out
    }

    pub(crate) fn u8(&mut self) -> u8 {
        self.array::<1>()[0]
    }

    pub(crate) fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.array())
    }

    pub(crate) fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.array())
    }

    pub(crate) fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.array())
    }

    pub(crate) fn bool(&mut self) -> bool {
        self.u8() & 1 != 0
    }

    /// A value below `n` (0 when `n` is 0).
    pub(crate) fn below(&mut self, n: u32) -> u32 {
        if n == 0 {
            0
        } else {
            self.u32() % n
        }
    }

    /// A length-prefixed (u16) chunk of at most `max` bytes.
    pub(crate) fn chunk(&mut self, max: usize) -> &'a [u8] {
        let n = usize::from(self.u16()).min(max);
        self.take(n)
    }
}

/// Encodes what [`Input`] decodes (seed generators build their inputs with it).
#[derive(Debug, Clone, Default)]
#[allow(dead_code)] // Used by the seed generators only.
pub(crate) struct Output {
    /// The encoded input.
    pub(crate) bytes: Vec<u8>,
}

#[allow(dead_code)] // Used by the seed generators only.
impl Output {
    pub(crate) fn u8(&mut self, v: u8) -> &mut Self {
        self.bytes.push(v);
        self
    }

    pub(crate) fn u16(&mut self, v: u16) -> &mut Self {
        self.bytes.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub(crate) fn u32(&mut self, v: u32) -> &mut Self {
        self.bytes.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub(crate) fn u64(&mut self, v: u64) -> &mut Self {
        self.bytes.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub(crate) fn raw(&mut self, b: &[u8]) -> &mut Self {
        self.bytes.extend_from_slice(b);
        self
    }

    /// A length-prefixed (u16) chunk; `b` must be shorter than 64 KiB.
    pub(crate) fn chunk(&mut self, b: &[u8]) -> &mut Self {
        let n = u16::try_from(b.len()).unwrap_or(u16::MAX);
        self.u16(n).raw(&b[..usize::from(n)])
    }
}
