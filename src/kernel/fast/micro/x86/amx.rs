//! AMX-BF16 tiles for the QK and PV products of prefill items: detection (CPUID, XCR0 and, on
//! Linux, the per-process `arch_prctl` permission), the tile configuration, bf16 packing of the
//! operands, and one 32x32 tile micro-kernel both products run on.
//!
//! Precision: the tiles multiply bf16 operands exactly and sum in f32; how operands become
//! bf16 (rounded once, or cut into parts with [`Bf16::residual`](super::bf16::Bf16::residual) for f32 accuracy) is the
//! caller's rule (`prefill_amx`).
//!
//! Layouts (all zero-padded, `dp` = D rounded up to 32, `r32` = rows rounded up to 32, a "pair
//! row" being two bf16 in one u32, the first in the low half, as `tdpbf16ps` pairs them):
//! - keys `kp[j*ldk + x]` (bf16, a key per row): the A operand of QK;
//! - query pairs `qt[x2*r32 + r]` = (q[r][2*x2], q[r][2*x2+1]): the B operand of QK;
//! - logits `st[j*r32 + r]` (f32, transposed as the `TileMicro` softmax wants them);
//! - values transposed `vt[x*ldv + j]` (bf16): the A operand of PV;
//! - weight pairs `pt[j2*r32 + r]` = (p[2*j2][r], p[2*j2+1][r]): the B operand of PV;
//! - accumulator transposed `acc[x*r32 + r]` (f32).
//!
//! AMX intrinsics are not stable in Rust, so the tile instructions are stable `asm!`. Rust's
//! register model has no tile registers: the compiler never reads or writes them, so tile
//! contents survive between `asm!` blocks of one [`Tiles`] guard, which is what the kernel
//! relies on.

#[cfg(test)]
use super::bf16::Bf16;
use std::arch::asm;
use std::arch::x86_64::*;
use std::marker::PhantomData;
use std::sync::OnceLock;

/// Proof that this CPU has AMX-TILE + AMX-BF16 (and AVX-512F/BW/BF16 for the packers), that
/// the OS saves tile state and that this process may use it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Amx(());

impl Amx {
    /// Checks once per process.
    pub(crate) fn detect() -> Option<Amx> {
        static OK: OnceLock<bool> = OnceLock::new();
        OK.get_or_init(|| cpu_has_amx() && os_grants_tile_data())
            .then_some(Amx(()))
    }

    /// Loads this crate's tile configuration on the calling thread until the guard drops.
    /// Done per item rather than once per thread: other code on the same thread (the host's
    /// own AMX kernels) may load another configuration between our calls.
    pub(crate) fn tiles(self) -> Tiles {
        let cfg = TileCfg::new();
        // SAFETY: `self` proves AMX-TILE and the OS permission; `cfg` is a valid palette-1
        // configuration (8 tiles of 16 rows x 64 bytes), 64 bytes, read only.
        unsafe {
            asm!("ldtilecfg [{}]", in(reg) &cfg as *const TileCfg, options(nostack, readonly))
        };
        Tiles {
            _thread: PhantomData,
        }
    }

    /// `rounds` rounds of four independent `tdpbf16ps` (16 x 16 x 32 multiply-adds each) on
    /// tiles that stay in registers (zeros: no loads, no stores): the tiles' own limit, what the
    /// benchmark calls the AMX peak.
    pub(crate) fn tile_products(self, rounds: usize) {
        let _t = self.tiles();
        if rounds == 0 {
            return;
        }
        // SAFETY: the configuration of `tiles` is loaded on this thread; the tile instructions
        // read and write tiles only.
        unsafe {
            c_zero();
            asm!(
                "tilezero tmm4",
                "tilezero tmm5",
                "tilezero tmm6",
                "tilezero tmm7",
                "2:",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "dec {n}",
                "jnz 2b",
                n = inout(reg) rounds => _,
                options(nostack, nomem),
            )
        };
    }

    /// The AVX512-BF16 token every AMX CPU also has (the packers of the tile operands).
    #[cfg(test)]
    pub(crate) fn bf16(self) -> Bf16 {
        Bf16::detect().expect("an AMX CPU has AVX512-BF16 (checked by detect)")
    }
}

/// The tile configuration is loaded on this thread while this lives (not `Send`: tile state
/// is per thread). Releases the tiles when dropped, so the thread's AMX state returns to its
/// initial state and costs nothing on context switches.
pub(crate) struct Tiles {
    _thread: PhantomData<*const ()>,
}

impl Drop for Tiles {
    fn drop(&mut self) {
        // SAFETY: a `Tiles` exists only after `ldtilecfg` succeeded on this thread.
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }
}

impl Tiles {
    /// QK on tiles for a sum of products: `st[j*r32 + r] = sum_t sum_x kp_t[j*ldk + x] *
    /// q_t[r][x]` for `j < n32`, `r < r32`, `x < dp`, each `(kp_t, qt_t)` of `terms` a keys
    /// panel (`n32` rows of stride `ldk`) and its query pairs (`dp/2` rows of `r32`). Terms
    /// are summed in order, `x` in order, in f32, each 32x32 block of `st` in tiles across
    /// them. Query columns are the outer loop: a 32-column query panel stays in L1 while the
    /// keys stream past it.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn qk_t(
        &self,
        terms: &[(&[u16], &[u32])],
        ldk: usize,
        dp: usize,
        n32: usize,
        r32: usize,
        st: &mut [f32],
    ) {
        super::bf16::assert_qk(terms, ldk, dp, n32, r32, st);
        for rb in (0..r32).step_by(32) {
            for jb in (0..n32).step_by(32) {
                let c = st[jb * r32 + rb..].as_mut_ptr() as *mut u8;
                // Logit rows jb..jb+32 at columns rb..rb+32, key rows jb..jb+32 (dp each,
                // stride ldk) and query-pair rows 0..dp/2 at columns rb..rb+32 of every term
                // are inside the slices (asserted above).
                // SAFETY: all addresses in bounds (above); `self` proves the tile config.
                unsafe {
                    c_zero();
                    for (kp, qt) in terms {
                        k_loop(
                            kp.as_ptr().add(jb * ldk) as *const u8,
                            ldk * 2,
                            qt.as_ptr().add(rb) as *const u8,
                            r32 * 4,
                            dp / 32,
                        );
                    }
                    c_store(c, r32 * 4);
                }
            }
        }
    }

    /// PV on tiles for a sum of products: `acc[x*r32 + r] += sum_t sum_j vt_t[x*ldv + j] *
    /// p_t[j][r]` for `x < dp`, `r < r32`, `j < n32`, each `(vt_t, pt_t)` of `terms` a values
    /// panel (`dp` rows of stride `ldv`) and its weight pairs (`n32/2` rows of `r32`). Each
    /// 32x32 block of `acc` stays in tiles across the terms (loaded and stored once); terms are
    /// summed in order, keys in order, in f32.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn pv_t(
        &self,
        terms: &[(&[u16], &[u32])],
        ldv: usize,
        dp: usize,
        n32: usize,
        r32: usize,
        acc: &mut [f32],
    ) {
        super::bf16::assert_pv(terms, ldv, dp, n32, r32, acc);
        for xb in (0..dp).step_by(32) {
            for rb in (0..r32).step_by(32) {
                let c = acc[xb * r32 + rb..].as_mut_ptr() as *mut u8;
                // Accumulator rows xb..xb+32 at columns rb..rb+32, value rows xb..xb+32 (keys
                // 0..n32, stride ldv) and weight-pair rows 0..n32/2 at columns rb..rb+32 of
                // every term are inside the slices (asserted above).
                // SAFETY: all addresses in bounds (above); `self` proves the tile config.
                unsafe {
                    c_load(c, r32 * 4);
                    for (vt, pt) in terms {
                        k_loop(
                            vt.as_ptr().add(xb * ldv) as *const u8,
                            ldv * 2,
                            pt.as_ptr().add(rb) as *const u8,
                            r32 * 4,
                            n32 / 32,
                        );
                    }
                    c_store(c, r32 * 4);
                }
            }
        }
    }
}

/// `ldtilecfg` operand: palette 1, tiles 0..8 of 16 rows x 64 bytes. Tiles 0-3 hold the 2x2
/// f32 accumulators, 4-5 the A rows, 6-7 the B pair rows.
#[repr(C, align(64))]
struct TileCfg {
    palette: u8,
    start_row: u8,
    _reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

impl TileCfg {
    fn new() -> TileCfg {
        let mut c = TileCfg {
            palette: 1,
            start_row: 0,
            _reserved: [0; 14],
            colsb: [0; 16],
            rows: [0; 16],
        };
        for t in 0..8 {
            c.colsb[t] = 64;
            c.rows[t] = 16;
        }
        c
    }
}

/// Loads the 32x32 f32 block at `c` (rows of stride `ldc` bytes) into tiles 0-3.
///
/// # Safety
/// The tile configuration of [`Amx::tiles`] is loaded on this thread; the 32 rows of 128 bytes
/// are inside a live allocation.
#[inline]
unsafe fn c_load(c: *const u8, ldc: usize) {
    // SAFETY: the caller's contract; tile registers are outside Rust's register model, so
    // they keep their contents until the next tile instruction.
    unsafe {
        let c2 = c.add(16 * ldc);
        asm!(
            "tileloadd tmm0, [{c} + {ldc}]",
            "tileloadd tmm1, [{c} + {ldc} + 64]",
            "tileloadd tmm2, [{c2} + {ldc}]",
            "tileloadd tmm3, [{c2} + {ldc} + 64]",
            c = in(reg) c,
            c2 = in(reg) c2,
            ldc = in(reg) ldc,
            options(nostack, readonly, preserves_flags),
        );
    }
}

/// Zeroes tiles 0-3 (a 32x32 f32 block).
///
/// # Safety
/// The tile configuration of [`Amx::tiles`] is loaded on this thread.
#[inline]
unsafe fn c_zero() {
    // SAFETY: the caller's contract.
    unsafe {
        asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            options(nostack, nomem, preserves_flags),
        );
    }
}

/// Adds `A * B` over `ksteps` k-steps to the 32x32 f32 block in tiles 0-3: A is 32 rows of
/// bf16 (stride `lda` bytes, rows 16..32 at `a + 16*lda`), read 32 elements (64 bytes) per
/// k-step; B is pair rows (stride `ldb` bytes), 16 per k-step, columns 0..16 at `b` and
/// 16..32 at `b + 64`.
///
/// # Safety
/// The tile configuration of [`Amx::tiles`] is loaded on this thread, `ksteps >= 1`, and every
/// byte addressed is inside live allocations.
#[inline]
unsafe fn k_loop(a: *const u8, lda: usize, b: *const u8, ldb: usize, ksteps: usize) {
    debug_assert!(ksteps >= 1);
    // SAFETY: the caller's contract.
    unsafe {
        let a2 = a.add(16 * lda);
        asm!(
            "2:",
            "tileloadd tmm4, [{a} + {lda}]",
            "tileloadd tmm6, [{b} + {ldb}]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tileloadd tmm7, [{b} + {ldb} + 64]",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tileloadd tmm5, [{a2} + {lda}]",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            "add {a}, 64",
            "add {a2}, 64",
            "add {b}, {bstep}",
            "dec {k}",
            "jnz 2b",
            a = inout(reg) a => _,
            a2 = inout(reg) a2 => _,
            b = inout(reg) b => _,
            k = inout(reg) ksteps => _,
            lda = in(reg) lda,
            ldb = in(reg) ldb,
            bstep = in(reg) 16 * ldb,
            options(nostack, readonly),
        );
    }
}

/// Stores tiles 0-3 to the 32x32 f32 block at `c` (rows of stride `ldc` bytes).
///
/// # Safety
/// As [`c_load`], the rows writable.
#[inline]
unsafe fn c_store(c: *mut u8, ldc: usize) {
    // SAFETY: the caller's contract.
    unsafe {
        let c2 = c.add(16 * ldc);
        asm!(
            "tilestored [{c} + {ldc}], tmm0",
            "tilestored [{c} + {ldc} + 64], tmm1",
            "tilestored [{c2} + {ldc}], tmm2",
            "tilestored [{c2} + {ldc} + 64], tmm3",
            c = in(reg) c,
            c2 = in(reg) c2,
            ldc = in(reg) ldc,
            options(nostack, preserves_flags),
        );
    }
}

/// The CPU side: CPUID leaf 7 (AMX-TILE = EDX bit 24, AMX-BF16 = bit 22), the AVX-512
/// features the packers use, and XCR0 bits 17-18 (the OS saves tile configuration and data).
fn cpu_has_amx() -> bool {
    let l7 = __cpuid_count(7, 0);
    let amx = l7.edx & (1 << 24) != 0 && l7.edx & (1 << 22) != 0;
    let vec = is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512bf16")
        && is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c");
    let osxsave = __cpuid(1).ecx & (1 << 27) != 0;
    amx && vec && osxsave && {
        // SAFETY: OSXSAVE is set, so XGETBV is enabled.
        let xcr0 = unsafe { xcr0() };
        xcr0 & (3 << 17) == 3 << 17
    }
}

#[target_feature(enable = "xsave")]
unsafe fn xcr0() -> u64 {
    _xgetbv(0)
}

/// Linux keeps tile data disabled until a process asks (`arch_prctl(ARCH_REQ_XCOMP_PERM,
/// XFEATURE_XTILEDATA)`; the grant covers every thread of the process); a tile instruction
/// before that raises SIGILL. Other systems: not supported here.
#[cfg(target_os = "linux")]
fn os_grants_tile_data() -> bool {
    const ARCH_GET_XCOMP_PERM: libc::c_long = 0x1022;
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl with these codes only reads its integer arguments / writes the u64
    // whose address it is given.
    unsafe {
        if libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) != 0
        {
            return false;
        }
        let mut mask: u64 = 0;
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_GET_XCOMP_PERM,
            &mut mask as *mut u64,
        ) == 0
            && mask & (1 << XFEATURE_XTILEDATA) != 0
    }
}

#[cfg(not(target_os = "linux"))]
fn os_grants_tile_data() -> bool {
    false
}

#[cfg(test)]
mod tests {
    //! The tile products against their scalar twin (`scalar_amx`) on edge shapes, through the
    //! checks the `vdpbf16ps` products share (`bf16::tests`).
    use super::*;
    use crate::kernel::fast::micro::x86::bf16::tests::{check_pv, check_qk};

    fn amx() -> Option<Amx> {
        super::super::detected(Amx::detect(), "AMX", "tile")
    }

    /// The peak probe runs exactly where AMX is granted (`pa_machine` reports null elsewhere).
    #[test]
    fn tile_products_run_only_with_amx() {
        let ran = crate::kernel::fast::amx_bf16_tile_products(3);
        assert_eq!(ran, Amx::detect().is_some());
        assert_eq!(crate::kernel::fast::amx_bf16_tile_products(0), ran);
    }

    #[test]
    fn qk_tiles_match_the_scalar_twin_on_edge_shapes() {
        let Some(a) = amx() else { return };
        let tl = a.tiles();
        check_qk(a.bf16(), 11, &|t, ld, dp, n32, r32, out| {
            tl.qk_t(t, ld, dp, n32, r32, out)
        });
    }

    #[test]
    fn pv_tiles_match_the_scalar_twin_on_edge_shapes() {
        let Some(a) = amx() else { return };
        let tl = a.tiles();
        check_pv(a.bf16(), 12, &|t, ld, dp, n32, r32, out| {
            tl.pv_t(t, ld, dp, n32, r32, out)
        });
    }
}
