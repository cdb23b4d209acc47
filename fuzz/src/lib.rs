//! Helpers shared by the fuzz targets: a reader that turns the fuzzer's bytes into values, and
//! buffers placed against a PROT_NONE guard page so that any access past their end faults.

use std::ptr::NonNull;

/// Consumes the fuzzer's bytes; once they run out every read yields zeros, so a target never
/// has to bail out on short input.
pub struct Bytes<'a> {
    data: &'a [u8],
}

impl<'a> Bytes<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        Bytes { data }
    }
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
    pub fn u8(&mut self) -> u8 {
        match self.data.split_first() {
            Some((&b, rest)) => {
                self.data = rest;
                b
            }
            None => 0,
        }
    }
    pub fn take(&mut self, n: usize) -> &'a [u8] {
        let n = n.min(self.data.len());
        let (head, rest) = self.data.split_at(n);
        self.data = rest;
        head
    }
    fn array<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0u8; N];
        let src = self.take(N);
        out[..src.len()].copy_from_slice(src);
        out
    }
    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.array())
    }
    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.array())
    }
    pub fn i32(&mut self) -> i32 {
        i32::from_le_bytes(self.array())
    }
    pub fn i64(&mut self) -> i64 {
        i64::from_le_bytes(self.array())
    }
    pub fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.array())
    }
    /// A value in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        self.u8() as usize % n
    }
    /// A dimension: small values most of the time, the edges of the type now and then.
    pub fn dim(&mut self) -> i64 {
        const EDGES: [i64; 10] = [
            -1,
            -2,
            1 << 31,
            (1 << 32) + 1,
            (1 << 61) + 1,
            1 << 62,
            i64::MAX,
            i64::MIN,
            65536,
            4097,
        ];
        let b = self.u8();
        if b < 0xF0 {
            (b % 24) as i64
        } else {
            EDGES[(b - 0xF0) as usize % EDGES.len()]
        }
    }
}

/// A buffer of `len` bytes whose end touches a PROT_NONE page (and whose start follows one), so
/// that reading or writing one byte past either end faults. Inputs are made read-only with
/// [`GuardBuf::seal`], so a write into them faults too.
pub struct GuardBuf {
    map: NonNull<libc::c_void>,
    map_len: usize,
    data: *mut u8,
    len: usize,
}

fn page() -> usize {
    // SAFETY: sysconf has no preconditions.
    unsafe { libc::sysconf(libc::_SC_PAGESIZE) as usize }
}

impl GuardBuf {
    /// `None` if the mapping cannot be made (the caller skips the input).
    pub fn new(len: usize) -> Option<GuardBuf> {
        let page = page();
        let body = len.div_ceil(page).max(1) * page;
        let map_len = body.checked_add(2 * page)?;
        // SAFETY: an anonymous private mapping with no address hint; the result is checked.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return None;
        }
        let map = NonNull::new(map)?;
        // SAFETY: [page, page + body) lies inside the mapping just made.
        let body_ptr = unsafe { (map.as_ptr() as *mut u8).add(page) };
        // SAFETY: the range is page-aligned and inside the mapping.
        let rc = unsafe {
            libc::mprotect(
                body_ptr as *mut libc::c_void,
                body,
                libc::PROT_READ | libc::PROT_WRITE,
            )
        };
        let buf = GuardBuf {
            map,
            map_len,
            // SAFETY: body - len <= body, so the pointer stays inside the readable pages; the
            // data ends exactly where the trailing guard page begins.
            data: unsafe { body_ptr.add(body - len) },
            len,
        };
        (rc == 0).then_some(buf)
    }
    /// A buffer holding `bytes`.
    pub fn with(bytes: &[u8]) -> Option<GuardBuf> {
        let mut b = GuardBuf::new(bytes.len())?;
        b.bytes_mut().copy_from_slice(bytes);
        Some(b)
    }
    pub fn ptr(&self) -> *mut u8 {
        self.data
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `data..data + len` is mapped readable for the life of `self`.
        unsafe { std::slice::from_raw_parts(self.data, self.len) }
    }
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`; writable until `seal`, which only callers that no longer
        // write call.
        unsafe { std::slice::from_raw_parts_mut(self.data, self.len) }
    }
    /// Makes the buffer read-only.
    pub fn seal(&self) {
        let page = page();
        let body = self.map_len - 2 * page;
        // SAFETY: the body pages of our own mapping.
        let rc = unsafe {
            libc::mprotect(
                (self.map.as_ptr() as *mut u8).add(page) as *mut libc::c_void,
                body,
                libc::PROT_READ,
            )
        };
        assert_eq!(rc, 0, "mprotect(PROT_READ) failed");
    }
}

impl Drop for GuardBuf {
    fn drop(&mut self) {
        // SAFETY: the mapping was made by `new` with this length and is unmapped once.
        unsafe { libc::munmap(self.map.as_ptr(), self.map_len) };
    }
}
